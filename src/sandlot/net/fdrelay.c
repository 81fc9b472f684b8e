/* sandlot-fdrelay SOCKET -- HELPER [ARG...]
 *
 * QEMU's user network runs this once per guest connection to the egress proxy
 * or the DNS answerer (guestfwd ... cmd:), the connection being descriptors 0-2.
 * Starting a Python helper per connection costs 60-80 ms; this costs about one
 * fork and exec. It hands descriptor 0 and the helper's argv to the home's
 * egress server (sandlot/net/egress.py) in one SOCK_SEQPACKET message with
 * SCM_RIGHTS, waits for the server's one-byte receipt and exits: from then on
 * the server owns the connection.
 *
 * Where no server takes the connection (none runs, it refuses, it dies before
 * its receipt), the relay execs HELPER itself with the connection still on 0-2
 * and SANDLOT_EGRESS_SOCKET naming the socket it tried: a connection is served
 * slowly, never lost (the launcher starts a server again at the next boot, from
 * outside any box's cgroup). There is no timeout on
 * the receipt: a receipt that came late after a fallback would have two
 * processes serve one connection.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_MESSAGE 16384

static int hand_over(const char *path, char **helper) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path)
        return -1;
    strcpy(addr.sun_path, path);

    /* the message: the helper's argv, each string ending in NUL */
    static char payload[MAX_MESSAGE];
    size_t used = 0;
    for (char **a = helper; *a; a++) {
        size_t n = strlen(*a) + 1;
        if (used + n > sizeof payload)
            return -1;
        memcpy(payload + used, *a, n);
        used += n;
    }

    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -1;
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0)
        goto fail;

    int fd = 0;
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof control);
    struct iovec iov = {.iov_base = payload, .iov_len = used};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1,
                         .msg_control = control.buf, .msg_controllen = sizeof control.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    ssize_t sent;
    do
        sent = sendmsg(s, &msg, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    if (sent != (ssize_t)used)
        goto fail;

    char receipt = 0;
    ssize_t got;
    do
        got = recv(s, &receipt, 1, 0);
    while (got < 0 && errno == EINTR);
    if (got == 1 && receipt == '+') {
        close(s);
        return 0;
    }
fail:
    close(s);
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 4 || strcmp(argv[2], "--") != 0) {
        /* nothing on stderr: it is the guest's connection */
        return 2;
    }
    if (hand_over(argv[1], argv + 3) == 0)
        return 0;
    setenv("SANDLOT_EGRESS_SOCKET", argv[1], 1);
    execv(argv[3], argv + 3);
    return 127;
}
