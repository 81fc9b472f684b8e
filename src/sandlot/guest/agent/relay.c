/* Relay mode: `/proc/1/exe --relay PORT`, run by the host as an ordinary exec,
 * connects to PORT on the guest's loopback and copies stdin to the connection
 * and the connection to stdout. `--relay /ABSOLUTE/PATH` connects to a Unix
 * socket instead (the code interpreter's kernels listen on one, so that only
 * their owner and the agent can reach them). The host reaches a port in the box this way
 * (box.connect, the server's port bridge) through the agent channel it already
 * has: no published port, no network device, whatever the network policy.
 *
 * On success it writes "connected\n" to stderr, so the host knows the port
 * answered; on failure it writes the reason and exits 111. It ends when the
 * connection's far side closes; end of stdin is a half close (shutdown). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "agent.h"

#define RELAY_CONNECT_FAILED 111

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int connect_loopback(long port)
{
    struct sockaddr_in v4;
    memset(&v4, 0, sizeof(v4));
    v4.sin_family = AF_INET;
    v4.sin_port = htons((uint16_t)port);
    v4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s >= 0 && connect(s, (struct sockaddr *)&v4, sizeof(v4)) == 0) {
        return s;
    }
    int err = errno;
    if (s >= 0) {
        close(s);
    }
    /* a server may listen on ::1 only */
    struct sockaddr_in6 v6;
    memset(&v6, 0, sizeof(v6));
    v6.sin6_family = AF_INET6;
    v6.sin6_port = htons((uint16_t)port);
    v6.sin6_addr = in6addr_loopback;
    s = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s >= 0 && connect(s, (struct sockaddr *)&v6, sizeof(v6)) == 0) {
        return s;
    }
    if (s >= 0) {
        close(s);
    }
    errno = err;
    return -1;
}

static int connect_unix(const char *path)
{
    struct sockaddr_un un;
    memset(&un, 0, sizeof(un));
    un.sun_family = AF_UNIX;
    memcpy(un.sun_path, path, strlen(path));
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s >= 0 && connect(s, (struct sockaddr *)&un, sizeof(un)) == 0) {
        return s;
    }
    int err = errno;
    if (s >= 0) {
        close(s);
    }
    errno = err;
    return -1;
}

int relay_main(const char *target)
{
    int s;
    signal(SIGPIPE, SIG_IGN);
    if (target[0] == '/') {
        if (strlen(target) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
            fprintf(stderr, "sandlot relay: socket path too long: %s\n", target);
            return 2;
        }
        s = connect_unix(target);
        if (s < 0) {
            fprintf(stderr, "errno %d: nothing answers on %s in the box: %s\n", errno, target, strerror(errno));
            return RELAY_CONNECT_FAILED;
        }
    } else {
        char *end = NULL;
        long port = strtol(target, &end, 10);
        if (!end || *end || port < 1 || port > 65535) {
            fprintf(stderr, "sandlot relay: %s is not a TCP port\n", target);
            return 2;
        }
        s = connect_loopback(port);
        if (s < 0) {
            fprintf(stderr, "errno %d: nothing answers on port %ld in the box: %s\n", errno, port,
                    strerror(errno));
            return RELAY_CONNECT_FAILED;
        }
    }
    if (write_all(2, "connected\n", 10) < 0) {
        return 1;
    }
    static char buf[64 * 1024];
    int in_open = 1;
    for (;;) {
        struct pollfd p[2] = {{.fd = s, .events = POLLIN}, {.fd = 0, .events = POLLIN}};
        if (poll(p, in_open ? 2 : 1, -1) < 0) {
            if (errno == EINTR) {
                continue;
            }
            return 1;
        }
        if (p[0].revents) {
            ssize_t r = read(s, buf, sizeof(buf));
            if (r < 0 && errno == EINTR) {
                continue;
            }
            if (r <= 0) {
                return 0; /* the far side closed (or reset): done */
            }
            if (write_all(1, buf, (size_t)r) < 0) {
                return 0; /* the host stopped listening */
            }
        }
        if (in_open && p[1].revents) {
            ssize_t r = read(0, buf, sizeof(buf));
            if (r < 0 && errno == EINTR) {
                continue;
            }
            if (r <= 0) {
                shutdown(s, SHUT_WR);
                in_open = 0;
            } else if (write_all(s, buf, (size_t)r) < 0) {
                shutdown(s, SHUT_WR);
                in_open = 0;
            }
        }
    }
}
