/* The egress port's guest side: the connections programs in the box make to
 * sandlot's address (10.0.2.100: the egress proxy, its transparent ports, the DNS
 * answerer) carried as streams over the virtio-serial port "sandlot-egress" to the
 * home's egress server, instead of through QEMU's user network, which forks QEMU
 * twice for each one. src/sandlot/net/mux.py is the host's side and says the
 * protocol.
 *
 * Once the host's HELLO names the ports it serves, this process listens for each
 * on the loopback, and a connect hook (redirect, below) sends programs' TCP
 * connections to 10.0.2.100 there. A connection it takes is OPENed as a stream,
 * its bytes sent at once (and kept until the host says it took the stream); where
 * the host is away (its server gone, QEMU reconnecting) or refuses, the connection
 * goes the slow way instead: a child joins it to the same port at 10.0.2.99, where
 * QEMU's user network runs the very same helpers, after the bytes kept. A
 * connection is slower then, never lost.
 *
 * A child of the agent, like the DNS relay: a bug here costs the box its egress
 * for a moment, never its PID 1. Its hook goes with it. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "agent.h"

#define PORT_NAME "sandlot-egress"
#define FALLBACK_ADDR 0x0a000263u /* 10.0.2.99: the same helpers through QEMU's user network */
#define MAGIC "SLMUX1"
#define MAGIC_LEN 6u
#define HDR 8u
#define CHUNK 32768u
#define WINDOW (256u * 1024u)
#define MAX_STREAMS 1024
#define MAX_PORTS 64
#define OUT_HIGH (1u << 20)
#define IN_MAX (HDR + 65535u + HDR)
#define CHECK_MIN_MS 1000
#define CHECK_MAX_MS 8000
#define STATE_FILE "/run/sandlot/egress"

enum { M_HELLO = 1, M_OPEN, M_OPENED, M_DATA, M_EOF, M_CLOSE, M_WINDOW };
#define REFUSED 0x1u

struct stream {
    uint32_t id;
    int fd;         /* the program's connection; -1: a free slot */
    uint16_t port;
    int opened;     /* the host took it */
    struct buf early; /* what was sent before it did: for the slow way, if it refuses */
    uint32_t credit; /* bytes this side may still send */
    uint32_t taken;  /* bytes given to the program, not yet given back as WINDOW */
    struct buf pend; /* from the host, for the program */
    int host_eof, shut, client_eof;
};

static struct stream g_streams[MAX_STREAMS];
static int g_listen[MAX_PORTS];
static uint16_t g_listen_port[MAX_PORTS];
static int g_nlisten;
static int g_port = -1;
static int g_up, g_ready;
static uint32_t g_next_id;
static struct buf g_in, g_out;
static pid_t g_pid;
static uint64_t g_started_ms;

static void frame(uint32_t id, uint8_t type, uint8_t flags, const void *payload, uint16_t len)
{
    uint8_t h[HDR] = {id >> 24, id >> 16, id >> 8, id, type, flags, len >> 8, len & 0xff};
    if (buf_append(&g_out, h, HDR) < 0 || buf_append(&g_out, payload, len) < 0) {
        logmsg("egress: out of memory");
        _exit(1);
    }
}

static void say_state(const char *state)
{
    int fd = open(STATE_FILE ".tmp", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
        ssize_t w = write(fd, state, strlen(state));
        (void)w;
        close(fd);
        rename(STATE_FILE ".tmp", STATE_FILE);
    }
}

/* ---- the slow way ----------------------------------------------------- */

static int fd_ended; /* in the slow way's child: the program had ended its side already */

static void join(int a, int b)
{
    char buf[16384];
    int open_[2] = {!fd_ended, 1};
    int fds[2] = {a, b};
    while (open_[0] || open_[1]) {
        struct pollfd p[2] = {{.fd = open_[0] ? a : -1, .events = POLLIN}, {.fd = open_[1] ? b : -1, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) {
                continue;
            }
            return;
        }
        for (int i = 0; i < 2; i++) {
            if (!open_[i] || !p[i].revents) {
                continue;
            }
            ssize_t r = read(fds[i], buf, sizeof(buf));
            if (r <= 0) {
                if (r < 0 && errno == EINTR) {
                    continue;
                }
                if (r < 0) {
                    return; /* a reset: the other side gets one as this process ends */
                }
                open_[i] = 0;
                shutdown(fds[1 - i], SHUT_WR);
                continue;
            }
            for (ssize_t off = 0; off < r;) {
                ssize_t w = write(fds[1 - i], buf + off, (size_t)(r - off));
                if (w < 0 && errno == EINTR) {
                    continue;
                }
                if (w <= 0) {
                    return;
                }
                off += w;
            }
        }
    }
}

/* The connection joined to the same port at 10.0.2.99 by a child of its own, after
 * what the program sent already (early; ended, if it had ended its side); the fd is
 * closed here. */
static void the_slow_way(int fd, uint16_t port, const struct buf *early, int ended)
{
    pid_t pid = fork();
    if (pid == 0) {
        close_inherited(fd); /* another stream's connection must end when this process ends it */
        int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(FALLBACK_ADDR)};
        int flags = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
        if (s < 0 || connect(s, (struct sockaddr *)&to, sizeof(to)) < 0) {
            _exit(1);
        }
        for (size_t off = early ? early->head : 0; early && off < early->len;) {
            ssize_t w = write(s, early->data + off, early->len - off);
            if (w <= 0 && errno != EINTR) {
                _exit(1);
            }
            off += w > 0 ? (size_t)w : 0;
        }
        if (ended) {
            shutdown(s, SHUT_WR);
            fd_ended = 1;
        }
        join(fd, s);
        _exit(0);
    }
    if (pid < 0) {
        logmsg("egress: fork: %s", strerror(errno));
    }
    close(fd);
}

/* ---- streams ---------------------------------------------------------- */

static struct stream *find(uint32_t id)
{
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (g_streams[i].fd >= 0 && g_streams[i].id == id) {
            return &g_streams[i];
        }
    }
    return NULL;
}

static void release(struct stream *s, int reset)
{
    if (reset) {
        struct linger l = {.l_onoff = 1, .l_linger = 0};
        setsockopt(s->fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
    }
    if (s->fd >= 0) {
        close(s->fd);
    }
    buf_free(&s->pend);
    buf_free(&s->early);
    memset(s, 0, sizeof(*s));
    s->fd = -1;
}

/* Every stream reset and nothing more for the host: a new one greets, or none is there. */
static void reset_all(void)
{
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (g_streams[i].fd >= 0) {
            release(&g_streams[i], 1);
        }
    }
    buf_reset(&g_out);
    g_ready = 0;
}

/* The stream ends at once: a CLOSE for the host, a reset for the program. */
static void abort_stream(struct stream *s)
{
    frame(s->id, M_CLOSE, 0, NULL, 0);
    release(s, 1);
}

static void maybe_done(struct stream *s)
{
    if (s->shut && s->client_eof) {
        release(s, 0);
    }
}

static void deliver(struct stream *s)
{
    while (buf_used(&s->pend)) {
        ssize_t w = send(s->fd, s->pend.data + s->pend.head, buf_used(&s->pend), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EAGAIN || errno == EINTR) {
                break;
            }
            abort_stream(s);
            return;
        }
        buf_consume(&s->pend, (size_t)w);
        s->taken += (uint32_t)w;
    }
    if (s->taken >= WINDOW / 4) { /* in quarters: a request's bytes cost no frame of their own */
        uint8_t n[4] = {s->taken >> 24, s->taken >> 16, s->taken >> 8, s->taken};
        frame(s->id, M_WINDOW, 0, n, 4);
        s->taken = 0;
    }
    if (s->host_eof && !buf_used(&s->pend) && !s->shut) {
        s->shut = 1;
        shutdown(s->fd, SHUT_WR);
    }
    maybe_done(s);
}

static void from_program(struct stream *s)
{
    static uint8_t data[CHUNK];
    size_t want = s->credit < CHUNK ? s->credit : CHUNK;
    ssize_t r = recv(s->fd, data, want, MSG_DONTWAIT);
    if (r < 0) {
        if (errno == EAGAIN || errno == EINTR) {
            return;
        }
        abort_stream(s);
        return;
    }
    if (r == 0) {
        s->client_eof = 1;
        frame(s->id, M_EOF, 0, NULL, 0);
        maybe_done(s);
        return;
    }
    s->credit -= (uint32_t)r;
    if (!s->opened && buf_append(&s->early, data, (size_t)r) < 0) {
        abort_stream(s);
        return;
    }
    frame(s->id, M_DATA, 0, data, (uint16_t)r);
}

static void accept_on(int li)
{
    int fd = accept4(g_listen[li], NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
        return;
    }
    uint16_t port = g_listen_port[li];
    struct stream *s = NULL;
    for (int i = 0; g_ready && i < MAX_STREAMS && !s; i++) {
        if (g_streams[i].fd < 0) {
            s = &g_streams[i];
        }
    }
    if (!s) {
        the_slow_way(fd, port, NULL, 0);
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    s->fd = fd;
    s->id = ++g_next_id ? g_next_id : ++g_next_id;
    s->port = port;
    s->credit = WINDOW;
    uint8_t p[2] = {port >> 8, port & 0xff};
    frame(s->id, M_OPEN, 0, p, 2);
}

/* ---- the host's HELLO --------------------------------------------------- */

/* Programs connect to 10.0.2.100:P; a BPF program on the root cgroup's connect
 * hook sends each such TCP connect to 127.0.0.1:Q instead, where this process
 * listens (Q, a port the kernel chose). So 10.0.2.100 stays QEMU's (the slow
 * way's replies come from there), and no listener of ours stands on a port a
 * program in the box may want for its own server (a wildcard bind of :80 would
 * collide with a listener at 10.0.2.100:80). The hook is attached through a BPF
 * link this process holds: it goes when this process does. */

#define BPF_PROG_LOAD_CMD 5
#define BPF_LINK_CREATE_CMD 28
#define PROG_TYPE_CGROUP_SOCK_ADDR 18
#define ATTACH_CGROUP_INET4_CONNECT 10
#define CTX_USER_IP4 4   /* struct bpf_sock_addr: network order */
#define CTX_USER_PORT 24 /* network order, in the low 16 bits */
#define CTX_TYPE 32
#define HELPER_GET_NETNS_COOKIE 122
#define SO_NETNS_COOKIE_OPT 71 /* Linux 5.14 */

struct insn {
    uint8_t code;
    uint8_t regs; /* dst in the low nibble, src in the high */
    int16_t off;
    int32_t imm;
};

#define I(c, d, s, o, i) ((struct insn){.code = (c), .regs = (uint8_t)((d) | (s) << 4), .off = (o), .imm = (i)})
#define MOV64_REG(d, s) I(0xbf, d, s, 0, 0)
#define MOV64_IMM(d, i) I(0xb7, d, 0, 0, i)
#define LDX_W(d, s, o) I(0x61, d, s, o, 0)
#define STX_W(d, s, o) I(0x63, d, s, o, 0)
#define JNE_IMM(d, i, o) I(0x55, d, 0, o, i)
#define JA(o) I(0x05, 0, 0, o, 0)
#define EXIT() I(0x95, 0, 0, 0, 0)

static uint16_t g_local_port[MAX_PORTS]; /* network order: where 10.0.2.100:g_listen_port[i] goes */
static int g_link = -1;
static int g_linked; /* the ports the attached program knows */

/* A u32 read of a network-order value, as the program sees it (x86 is little-endian). */
static int32_t wire32(uint32_t host_order) { return (int32_t)htonl(host_order); }

static long sys_bpf(int cmd, void *attr, unsigned size) { return syscall(SYS_bpf, cmd, attr, size); }

static int redirect(void)
{
    if (g_link >= 0 && g_linked == g_nlisten) {
        return 0;
    }
    struct insn prog[12 + 6 * MAX_PORTS];
    int n = 0;
    int to_out[3 + MAX_PORTS], outs = 0;
    prog[n++] = MOV64_REG(6, 1);
    uint64_t cookie;
    socklen_t clen = sizeof(cookie);
    if (getsockopt(g_listen[0], SOL_SOCKET, SO_NETNS_COOKIE_OPT, &cookie, &clen) == 0) {
        /* this network namespace's connects only: a container's in the box has its own
         * loopback, where nothing of ours listens (its 10.0.2.100 is reached through
         * its own routes, as before) */
        prog[n++] = I(0x85, 0, 0, 0, HELPER_GET_NETNS_COOKIE); /* r0 = the connecting socket's */
        prog[n++] = I(0x18, 2, 0, 0, (int32_t)(uint32_t)cookie); /* r2 = cookie (two slots) */
        prog[n++] = I(0x00, 0, 0, 0, (int32_t)(uint32_t)(cookie >> 32));
        to_out[outs++] = n;
        prog[n++] = I(0x5d, 0, 2, 0, 0); /* if r0 != r2 goto out */
    }
    prog[n++] = LDX_W(2, 6, CTX_TYPE);
    to_out[outs++] = n;
    prog[n++] = JNE_IMM(2, SOCK_STREAM, 0);
    prog[n++] = LDX_W(2, 6, CTX_USER_IP4);
    to_out[outs++] = n;
    prog[n++] = JNE_IMM(2, wire32(SL_PROXY_ADDR), 0);
    prog[n++] = LDX_W(2, 6, CTX_USER_PORT);
    for (int i = 0; i < g_nlisten; i++) {
        prog[n++] = JNE_IMM(2, (int32_t)htons(g_listen_port[i]), 5);
        prog[n++] = MOV64_IMM(3, wire32(INADDR_LOOPBACK));
        prog[n++] = STX_W(6, 3, CTX_USER_IP4);
        prog[n++] = MOV64_IMM(3, (int32_t)g_local_port[i]);
        prog[n++] = STX_W(6, 3, CTX_USER_PORT);
        to_out[outs++] = n;
        prog[n++] = JA(0);
    }
    int out = n;
    prog[n++] = MOV64_IMM(0, 1); /* the connect goes on, wherever it goes now */
    prog[n++] = EXIT();
    for (int k = 0; k < outs; k++) {
        prog[to_out[k]].off = (int16_t)(out - to_out[k] - 1);
    }

    static char log[8192];
    uint8_t attr[128];
    memset(attr, 0, sizeof(attr));
    uint32_t u32;
    uint64_t u64;
    u32 = PROG_TYPE_CGROUP_SOCK_ADDR;
    memcpy(attr + 0, &u32, 4);
    u32 = (uint32_t)n;
    memcpy(attr + 4, &u32, 4);
    u64 = (uintptr_t)prog;
    memcpy(attr + 8, &u64, 8);
    u64 = (uintptr_t) "GPL";
    memcpy(attr + 16, &u64, 8);
    u32 = ATTACH_CGROUP_INET4_CONNECT;
    memcpy(attr + 68, &u32, 4); /* expected_attach_type */
    int pfd = (int)sys_bpf(BPF_PROG_LOAD_CMD, attr, sizeof(attr));
    if (pfd < 0) {
        u32 = 1; /* log_level: why the verifier said no */
        memcpy(attr + 24, &u32, 4);
        u32 = sizeof(log);
        memcpy(attr + 28, &u32, 4);
        u64 = (uintptr_t)log;
        memcpy(attr + 32, &u64, 8);
        int again = (int)sys_bpf(BPF_PROG_LOAD_CMD, attr, sizeof(attr));
        logmsg("egress: the connect hook was refused: %s %.400s", strerror(errno), log);
        if (again >= 0) {
            close(again);
        }
        return -1;
    }
    int cg = open("/sys/fs/cgroup", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    memset(attr, 0, sizeof(attr));
    u32 = (uint32_t)pfd;
    memcpy(attr + 0, &u32, 4);
    u32 = (uint32_t)cg;
    memcpy(attr + 4, &u32, 4);
    u32 = ATTACH_CGROUP_INET4_CONNECT;
    memcpy(attr + 8, &u32, 4);
    int link = cg < 0 ? -1 : (int)sys_bpf(BPF_LINK_CREATE_CMD, attr, sizeof(attr));
    if (link < 0) {
        logmsg("egress: attaching the connect hook: %s", strerror(errno));
    }
    close(pfd);
    if (cg >= 0) {
        close(cg);
    }
    if (link < 0) {
        return -1;
    }
    fcntl(link, F_SETFD, FD_CLOEXEC);
    if (g_link >= 0) {
        close(g_link); /* the program before, which knew fewer ports */
    }
    g_link = link;
    g_linked = g_nlisten;
    return 0;
}

static void listen_on(uint16_t port)
{
    for (int i = 0; i < g_nlisten; i++) {
        if (g_listen_port[i] == port) {
            return;
        }
    }
    if (g_nlisten == MAX_PORTS) {
        return;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(me);
    if (fd < 0 || bind(fd, (struct sockaddr *)&me, sizeof(me)) < 0 || listen(fd, 128) < 0 ||
        getsockname(fd, (struct sockaddr *)&me, &len) < 0) {
        logmsg("egress: a listener for port %u: %s", port, strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return;
    }
    g_listen[g_nlisten] = fd;
    g_local_port[g_nlisten] = me.sin_port;
    g_listen_port[g_nlisten++] = port;
}

static void on_hello(const uint8_t *p, size_t n)
{
    reset_all();
    for (size_t i = MAGIC_LEN; i + 2 <= n; i += 2) {
        listen_on((uint16_t)(p[i] << 8 | p[i + 1]));
    }
    if (!g_nlisten || redirect() < 0) {
        /* no hook (a kernel without cgroup BPF): programs go through QEMU, and this
         * process is of no use; the host gives up on the session */
        say_state("unsupported\n");
        _exit(0);
    }
    frame(0, M_HELLO, 0, MAGIC, MAGIC_LEN);
    g_ready = 1;
    static unsigned sessions;
    char said[32];
    snprintf(said, sizeof(said), "ready %u\n", ++sessions); /* the count: a restore's new session shows */
    say_state(said);
}

/* ---- frames from the host ------------------------------------------------- */

/* One frame; -1: it makes no sense here (the input is read again from a HELLO). */
static int on_frame(uint32_t id, uint8_t type, uint8_t flags, const uint8_t *p, size_t n)
{
    if (type == M_HELLO) {
        if (id != 0 || n < MAGIC_LEN || memcmp(p, MAGIC, MAGIC_LEN)) {
            return -1;
        }
        on_hello(p, n);
        return 0;
    }
    if (!g_ready || id == 0 || type > M_WINDOW) {
        return -1;
    }
    struct stream *s = find(id);
    if (!s) {
        return 0; /* ended here already */
    }
    switch (type) {
    case M_OPENED:
        s->opened = 1;
        buf_free(&s->early);
        break;
    case M_DATA:
        if (s->host_eof || buf_used(&s->pend) + n > WINDOW || buf_append(&s->pend, p, n) < 0) {
            abort_stream(s);
            break;
        }
        deliver(s);
        break;
    case M_EOF:
        s->host_eof = 1;
        deliver(s);
        break;
    case M_CLOSE:
        if ((flags & REFUSED) && !s->opened) {
            int fd = s->fd;
            s->fd = -1;
            the_slow_way(fd, s->port, &s->early, s->client_eof);
            release(s, 0);
        } else {
            release(s, 1);
        }
        break;
    case M_WINDOW:
        if (n == 4) {
            s->credit += (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
        }
        break;
    default:
        return -1;
    }
    return 0;
}

static void parse(void)
{
    const uint8_t *in = g_in.data + g_in.head;
    size_t len = buf_used(&g_in), used = 0;
    for (;;) {
        if (!g_ready) {
            /* skip to a HELLO: MAGIC right after a header */
            const uint8_t *m = memmem(in + used, len - used, MAGIC, MAGIC_LEN);
            while (m && (size_t)(m - in) < used + HDR) {
                m = memmem(m + 1, len - (size_t)(m + 1 - in), MAGIC, MAGIC_LEN);
            }
            if (!m) {
                if (len - used > HDR + MAGIC_LEN) {
                    used = len - (HDR + MAGIC_LEN);
                }
                break;
            }
            used = (size_t)(m - in) - HDR;
        }
        if (len - used < HDR) {
            break;
        }
        const uint8_t *h = in + used;
        uint32_t id = (uint32_t)h[0] << 24 | (uint32_t)h[1] << 16 | (uint32_t)h[2] << 8 | h[3];
        size_t n = (size_t)h[6] << 8 | h[7];
        if (len - used < HDR + n) {
            break;
        }
        if (on_frame(id, h[4], h[5], h + HDR, n) < 0) {
            /* in a VM restored mid-frame: the new session's zeros ended that frame (mux.py's
             * PREAMBLE), and its HELLO follows them */
            if (g_ready) {
                if (h[4]) {
                    logmsg("egress: a frame of type %u on stream %u makes no sense; waiting for a HELLO", h[4], id);
                }
                reset_all();
                say_state("waiting\n");
            }
            used += 1; /* look further for a HELLO */
            continue;
        }
        used += HDR + n;
    }
    buf_consume(&g_in, used);
}

/* ---- the port ------------------------------------------------------------ */

static int open_port(void)
{
    for (int waited = 0; waited < 5000; waited += 10) {
        DIR *d = opendir("/sys/class/virtio-ports");
        struct dirent *de;
        while (d && (de = readdir(d))) {
            char path[300], name[64] = {0};
            snprintf(path, sizeof(path), "/sys/class/virtio-ports/%s/name", de->d_name);
            if (read_sys(path, name, sizeof(name)) > 0 && !strcmp(name, PORT_NAME)) {
                snprintf(path, sizeof(path), "/dev/%s", de->d_name);
                closedir(d);
                if (wait_for(path, 2000) < 0) {
                    return -1;
                }
                int pfd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC);
                if (pfd >= 0) {
                    fcntl(pfd, F_SETOWN, getpid());
                    fcntl(pfd, F_SETFL, fcntl(pfd, F_GETFL) | O_ASYNC); /* SIGIO: the host came or went */
                }
                return pfd;
            }
        }
        if (d) {
            closedir(d);
        }
        usleep(10000);
    }
    return -1;
}

static void check_port(void)
{
    struct pollfd p = {.fd = g_port, .events = POLLIN};
    if (poll(&p, 1, 0) < 0) {
        return;
    }
    int up = !(p.revents & POLLHUP);
    if (up != g_up) {
        reset_all();
        buf_reset(&g_in);
        g_up = up;
        say_state(up ? "waiting\n" : "away\n");
    }
}

static void port_read(void)
{
    for (;;) {
        if (buf_reserve(&g_in, 65536) < 0) {
            _exit(1);
        }
        ssize_t r = read(g_port, g_in.data + g_in.len, g_in.cap - g_in.len);
        if (r <= 0) {
            if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
                check_port();
            }
            return;
        }
        g_in.len += (size_t)r;
        parse();
    }
}

static void port_write(void)
{
    while (buf_used(&g_out)) {
        ssize_t w = write(g_port, g_out.data + g_out.head, buf_used(&g_out));
        if (w <= 0) {
            return;
        }
        buf_consume(&g_out, (size_t)w);
    }
}

static void egress_loop(int sigfd)
{
    struct pollfd pfds[2 + MAX_PORTS + MAX_STREAMS];
    int ref[2 + MAX_PORTS + MAX_STREAMS];
    uint64_t check_every = CHECK_MIN_MS, check_at = now_ms() + check_every;
    check_port();
    for (;;) {
        int n = 0;
        pfds[n] = (struct pollfd){.fd = sigfd, .events = POLLIN};
        ref[n++] = -1;
        if (g_up) {
            pfds[n] = (struct pollfd){.fd = g_port, .events = POLLIN | (buf_used(&g_out) ? POLLOUT : 0)};
            ref[n++] = -2;
        }
        for (int i = 0; i < g_nlisten; i++) {
            pfds[n] = (struct pollfd){.fd = g_listen[i], .events = POLLIN};
            ref[n++] = -3 - i;
        }
        int busy = buf_used(&g_out) >= OUT_HIGH;
        for (int i = 0; i < MAX_STREAMS; i++) {
            struct stream *s = &g_streams[i];
            if (s->fd < 0) {
                continue;
            }
            short ev = 0;
            if (s->credit && !s->client_eof && !busy) {
                ev |= POLLIN;
            }
            if (buf_used(&s->pend)) {
                ev |= POLLOUT;
            }
            if (ev) {
                pfds[n] = (struct pollfd){.fd = s->fd, .events = ev};
                ref[n++] = i;
            }
        }
        uint64_t now = now_ms();
        int timeout = -1;
        if (!g_up) {
            timeout = check_at > now ? (int)(check_at - now) : 0;
        }
        int r = poll(pfds, (nfds_t)n, timeout);
        if (r < 0 && errno != EINTR) {
            _exit(1);
        }
        now = now_ms();
        if (!g_up && now >= check_at) {
            check_port();
            check_every = g_up ? CHECK_MIN_MS : (check_every < CHECK_MAX_MS ? check_every * 2 : CHECK_MAX_MS);
            check_at = now + check_every;
        }
        for (int k = 0; r > 0 && k < n; k++) {
            if (!pfds[k].revents) {
                continue;
            }
            if (ref[k] == -1) {
                struct signalfd_siginfo si;
                while (read(sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
                }
                check_port();
                check_every = CHECK_MIN_MS;
                check_at = now + check_every;
            } else if (ref[k] == -2) {
                if (pfds[k].revents & POLLHUP) {
                    check_port();
                    continue;
                }
                if (pfds[k].revents & POLLOUT) {
                    port_write();
                }
                if (pfds[k].revents & POLLIN) {
                    port_read();
                }
            } else if (ref[k] <= -3) {
                accept_on(-3 - ref[k]);
            } else {
                struct stream *s = &g_streams[ref[k]];
                if (s->fd >= 0 && (pfds[k].revents & POLLOUT)) {
                    deliver(s);
                }
                if (s->fd >= 0 && (pfds[k].revents & (POLLIN | POLLHUP | POLLERR)) && !s->client_eof) {
                    from_program(s);
                }
            }
        }
        if (g_up && buf_used(&g_out)) {
            port_write();
        }
    }
}

/* ---- the agent's side ------------------------------------------------------ */

void egress_start(void)
{
    pid_t pid = fork();
    if (pid == 0) {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGIO);
        sigprocmask(SIG_SETMASK, &set, NULL); /* SIGIO comes through the signalfd only */
        signal(SIGCHLD, SIG_IGN);             /* the slow way's children reap themselves */
        signal(SIGPIPE, SIG_IGN);
        become_helper("sandlot-egress", -1);
        for (int i = 0; i < MAX_STREAMS; i++) {
            g_streams[i].fd = -1;
        }
        int sigfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
        g_port = open_port();
        if (g_port < 0 || sigfd < 0) {
            logmsg("egress: no port %s", PORT_NAME);
            _exit(0);
        }
        egress_loop(sigfd);
        _exit(1);
    }
    if (pid < 0) {
        logmsg("egress: fork: %s", strerror(errno));
    }
    g_pid = pid > 0 ? pid : 0;
    g_started_ms = now_ms();
}

int egress_reaped(pid_t pid, int status)
{
    if (!g_pid || pid != g_pid) {
        return 0;
    }
    g_pid = 0;
    /* its connect hook went with it: programs reach 10.0.2.100 through QEMU again */
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) { /* 0: no port, or no hook */
        restart_helper("egress", g_started_ms, egress_start);
    }
    return 1;
}
