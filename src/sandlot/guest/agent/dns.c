/* The DNS relay of the proxied network modes: programs in the box ask
 * 127.0.0.53 over UDP, as every libc and Go do; the relay carries each query
 * over its own TCP connection to 10.0.2.100:53, where QEMU starts the host's
 * answerer (sandlot.net.dns), and sends the answer back. Every decision about a
 * name is made on the host; the relay answers alone only what needs none (AAAA)
 * or what the host already answered (kept for its TTL).
 *
 * It runs as a child process, not in the agent's loop: a bug here costs the
 * box its names, never its PID 1. A connection per query leaves nothing to
 * break across a snapshot: a query in flight when the box was saved times out
 * into SERVFAIL and the client asks again. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "agent.h"

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

#define RELAY_ADDR 0x7f000035u  /* 127.0.0.53, as systemd-resolved's stub: 127.0.0.1:53 stays free */
#define SLOTS 16                /* queries in flight; more wait in the socket's buffer */
/* Under glibc's 5 s per try, so a lost query is answered SERVFAIL before the
 * client gives up on it; the host's own lookup normally takes milliseconds. */
#define QUERY_TIMEOUT_MS 4000
#define MAX_QUERY 1024
#define MAX_ANSWER 4096
#define TYPE_AAAA 28

static pid_t g_relay_pid;
static uint64_t g_relay_started_ms;

struct slot {
    int fd;                        /* the TCP connection; -1: free */
    struct sockaddr_in client;
    uint64_t deadline_ms;
    uint8_t query[2 + MAX_QUERY];  /* as sent over TCP: length first */
    size_t query_len, sent;
    uint8_t answer[2 + MAX_ANSWER];
    size_t got;
};

static struct slot g_slots[SLOTS];

/* Answers with records, kept for their TTL: a program that resolves a name for
 * every request then waits for the host once per TTL, not each time (measured
 * under emulation: 80 ms a lookup from the host, against 2 ms from here). They
 * grant nothing: in the proxied modes every answer is the proxy's address, and
 * the proxy checks each connection. Refusals are not kept, so a name the policy
 * allows from now on resolves at once. */
#define CACHE_SLOTS 32
#define CACHE_MAX_TTL_MS 60000
struct cached {
    uint8_t question[255 + 4]; /* name (lower case), type, class */
    size_t question_len;
    uint8_t answer[512];
    size_t len;
    uint64_t expires_ms;
};
static struct cached g_cache[CACHE_SLOTS];

/* Where a single question ends (0: not a standard query with one question). */
static size_t question_end(const uint8_t *q, size_t n, unsigned *qtype)
{
    if (n < 12 || (q[2] & 0x80) || (q[2] & 0x78) || q[4] != 0 || q[5] != 1) {
        return 0;
    }
    size_t p = 12;
    while (p < n && q[p] != 0) {
        if (q[p] > 63) {
            return 0;
        }
        p += 1 + q[p];
    }
    if (p + 5 > n) {
        return 0;
    }
    *qtype = (unsigned)(q[p + 1] << 8 | q[p + 2]);
    return p + 5;
}

static void lower_question(uint8_t *dst, const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        dst[i] = src[i] >= 'A' && src[i] <= 'Z' ? (uint8_t)(src[i] | 0x20) : src[i];
    }
}

static struct cached *cache_find(const uint8_t *q, size_t end)
{
    uint8_t key[sizeof(g_cache[0].question)];
    if (end - 12 > sizeof(key)) {
        return NULL;
    }
    lower_question(key, q + 12, end - 12);
    uint64_t now = now_ms();
    for (int i = 0; i < CACHE_SLOTS; i++) {
        struct cached *c = &g_cache[i];
        if (c->len && c->expires_ms > now && c->question_len == end - 12 && !memcmp(c->question, key, end - 12)) {
            return c;
        }
    }
    return NULL;
}

/* Keeps an answer of the host's whose first record gives a TTL (our answerer's
 * records name the question by a pointer, so its TTL is at a fixed place). */
static void cache_store(const uint8_t *q, size_t end, const uint8_t *a, size_t n)
{
    if (end - 12 > sizeof(g_cache[0].question) || n > sizeof(g_cache[0].answer) || n < end + 10 ||
        (a[3] & 0x0F) != 0 || (a[6] == 0 && a[7] == 0) || memcmp(a + 12, q + 12, end - 12) ||
        (a[end] & 0xC0) != 0xC0) {
        return;
    }
    uint32_t ttl = (uint32_t)a[end + 6] << 24 | (uint32_t)a[end + 7] << 16 | (uint32_t)a[end + 8] << 8 | a[end + 9];
    uint64_t now = now_ms(), ms = ttl * 1000ull < CACHE_MAX_TTL_MS ? ttl * 1000ull : CACHE_MAX_TTL_MS;
    struct cached *c = &g_cache[0];
    for (int i = 0; i < CACHE_SLOTS; i++) { /* a free or expired slot, else the one to expire first */
        if (g_cache[i].expires_ms <= now) {
            c = &g_cache[i];
            break;
        }
        if (g_cache[i].expires_ms < c->expires_ms) {
            c = &g_cache[i];
        }
    }
    lower_question(c->question, q + 12, end - 12);
    c->question_len = end - 12;
    memcpy(c->answer, a, n);
    c->len = n;
    c->expires_ms = now + ms;
}

/* A kept answer, as the answer to this query: its id, flags and question as asked. */
static void reply_cached(int udp, const struct sockaddr_in *to, const uint8_t *q, size_t end, const struct cached *c)
{
    uint8_t r[sizeof(c->answer)];
    memcpy(r, c->answer, c->len);
    memcpy(r, q, 2);
    r[2] = (uint8_t)((r[2] & ~0x01) | (q[2] & 0x01));
    memcpy(r + 12, q + 12, end - 12);
    sendto(udp, r, c->len, MSG_NOSIGNAL, (const struct sockaddr *)to, sizeof(*to));
}

/* An answer made here, with no records: the header and question of the query. */
static void reply_empty(int udp, const struct sockaddr_in *to, const uint8_t *q, size_t n, int rcode)
{
    uint8_t r[12 + MAX_QUERY];
    unsigned qtype;
    size_t end = question_end(q, n, &qtype);
    memcpy(r, q, 12);
    r[2] = (uint8_t)(0x80 | (q[2] & 0x79)); /* a response; opcode and RD as asked */
    r[3] = (uint8_t)(0x80 | rcode);         /* recursion available */
    memset(r + 4, 0, 8);
    if (end) {
        r[5] = 1;
        memcpy(r + 12, q + 12, end - 12);
    }
    sendto(udp, r, end ? end : 12, MSG_NOSIGNAL, (const struct sockaddr *)to, sizeof(*to));
}

static void slot_close(struct slot *s, int udp, int rcode)
{
    if (rcode >= 0) {
        reply_empty(udp, &s->client, s->query + 2, s->query_len - 2, rcode);
    }
    close(s->fd);
    s->fd = -1;
}

static void slot_open(struct slot *s, int udp, const uint8_t *q, size_t n, const struct sockaddr_in *from)
{
    s->client = *from;
    s->query[0] = (uint8_t)(n >> 8);
    s->query[1] = (uint8_t)n;
    memcpy(s->query + 2, q, n);
    s->query_len = n + 2;
    s->sent = s->got = 0;
    s->deadline_ms = now_ms() + QUERY_TIMEOUT_MS;
    s->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in host = {.sin_family = AF_INET, .sin_port = htons(53), .sin_addr.s_addr = htonl(SL_PROXY_ADDR)};
    if (s->fd < 0 || (connect(s->fd, (struct sockaddr *)&host, sizeof(host)) < 0 && errno != EINPROGRESS)) {
        slot_close(s, udp, 2); /* SERVFAIL */
    }
}

static void on_query(int udp)
{
    uint8_t q[MAX_QUERY];
    struct sockaddr_in from;
    socklen_t fl = sizeof(from);
    ssize_t n = recvfrom(udp, q, sizeof(q), MSG_TRUNC, (struct sockaddr *)&from, &fl);
    if (n < 12 || n > (ssize_t)sizeof(q) || (q[2] & 0x80)) {
        return; /* too short or long to be a query, or a response: nobody to answer */
    }
    unsigned qtype = 0;
    size_t end = question_end(q, (size_t)n, &qtype);
    if (end && qtype == TYPE_AAAA) {
        /* Every getaddrinfo asks A and AAAA together. The box's network has no
         * IPv6, so the host's answer would be empty (or NXDOMAIN, which the A
         * answer says as well): answering here halves the lookups that cost a
         * host process each. */
        reply_empty(udp, &from, q, (size_t)n, 0);
        return;
    }
    const struct cached *c = end ? cache_find(q, end) : NULL;
    if (c) {
        reply_cached(udp, &from, q, end, c);
        return;
    }
    for (int i = 0; i < SLOTS; i++) {
        if (g_slots[i].fd < 0) {
            slot_open(&g_slots[i], udp, q, (size_t)n, &from);
            return;
        }
    }
}

static void on_connection(struct slot *s, int udp)
{
    if (s->sent < s->query_len) {
        ssize_t w = send(s->fd, s->query + s->sent, s->query_len - s->sent, MSG_NOSIGNAL);
        if (w < 0 && errno != EAGAIN && errno != EINTR) {
            slot_close(s, udp, 2);
        } else if (w > 0) {
            s->sent += (size_t)w;
        }
        return;
    }
    ssize_t r = recv(s->fd, s->answer + s->got, sizeof(s->answer) - s->got, 0);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) {
        return;
    }
    if (r <= 0) {
        slot_close(s, udp, 2);
        return;
    }
    s->got += (size_t)r;
    if (s->got < 4) { /* its length and id */
        return;
    }
    size_t len = (size_t)(s->answer[0] << 8 | s->answer[1]);
    if (len < 12 || len > MAX_ANSWER || memcmp(s->answer + 2, s->query + 2, 2)) {
        slot_close(s, udp, 2); /* not the answer to this query */
    } else if (s->got >= 2 + len) {
        sendto(udp, s->answer + 2, len, MSG_NOSIGNAL, (struct sockaddr *)&s->client, sizeof(s->client));
        unsigned qtype;
        size_t end = question_end(s->query + 2, s->query_len - 2, &qtype);
        if (end) {
            cache_store(s->query + 2, end, s->answer + 2, len);
        }
        slot_close(s, udp, -1);
    }
}

static void relay_loop(int udp)
{
    for (int i = 0; i < SLOTS; i++) {
        g_slots[i].fd = -1;
    }
    struct pollfd pfds[SLOTS + 1];
    int which[SLOTS + 1];
    for (;;) {
        int n = 0, timeout = -1, busy = 0;
        uint64_t now = now_ms();
        for (int i = 0; i < SLOTS; i++) {
            struct slot *s = &g_slots[i];
            if (s->fd < 0) {
                continue;
            }
            if (now >= s->deadline_ms) {
                slot_close(s, udp, 2);
                continue;
            }
            busy++;
            int left = (int)(s->deadline_ms - now);
            timeout = timeout < 0 || left < timeout ? left : timeout;
            pfds[n] = (struct pollfd){.fd = s->fd, .events = s->sent < s->query_len ? POLLOUT : POLLIN};
            which[n++] = i;
        }
        if (busy < SLOTS) {
            pfds[n] = (struct pollfd){.fd = udp, .events = POLLIN};
            which[n++] = -1;
        }
        if (poll(pfds, (nfds_t)n, timeout) < 0) {
            continue;
        }
        for (int k = 0; k < n; k++) {
            if (!pfds[k].revents) {
                continue;
            }
            if (which[k] < 0) {
                on_query(udp);
            } else {
                on_connection(&g_slots[which[k]], udp);
            }
        }
    }
}

/* In a helper child of the agent (the DNS relay, the egress child): its name, an OOM
 * score that spares it (a few pages: the OOM killer should pick the command that
 * needed memory), and nothing of the agent's open but keep and the console. */
void become_helper(const char *name, int keep)
{
    close_inherited(keep);
    prctl(PR_SET_NAME, name);
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t w = write(fd, "-1000", 5);
        (void)w;
        close(fd);
    }
}

/* Everything the agent had open but keep and the console (0-2): the DNS relay's
 * socket, the egress child's connection. */
void close_inherited(int keep)
{
    if (keep < 3 && syscall(SYS_close_range, 3, ~0u, 0) == 0) {
        return;
    }
    if (keep >= 3 && (keep == 3 || syscall(SYS_close_range, 3, keep - 1, 0) == 0) &&
        syscall(SYS_close_range, keep + 1, ~0u, 0) == 0) {
        return;
    }
    DIR *d = opendir("/proc/self/fd"); /* kernels before 5.9 */
    struct dirent *de;
    while (d && (de = readdir(d))) {
        int fd = atoi(de->d_name);
        if (fd > 2 && fd != keep && fd != dirfd(d)) {
            close(fd);
        }
    }
    if (d) {
        closedir(d);
    }
}

void dns_relay_start(void)
{
    /* bound here, before the fork: a query sent before the child runs waits in the socket */
    int udp = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(53), .sin_addr.s_addr = htonl(RELAY_ADDR)};
    if (udp < 0 || bind(udp, (struct sockaddr *)&me, sizeof(me)) < 0) {
        logmsg("dns relay: 127.0.0.53:53: %s", strerror(errno));
        if (udp >= 0) {
            close(udp);
        }
        return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL); /* the agent blocks them for its signalfd */
        become_helper("sandlot-dns", udp);
        relay_loop(udp);
        _exit(1);
    }
    if (pid < 0) {
        logmsg("dns relay: fork: %s", strerror(errno));
    }
    g_relay_pid = pid > 0 ? pid : 0;
    g_relay_started_ms = now_ms();
    close(udp);
}

int dns_relay_reaped(pid_t pid)
{
    if (!g_relay_pid || pid != g_relay_pid) {
        return 0;
    }
    g_relay_pid = 0;
    restart_helper("dns relay", g_relay_started_ms, dns_relay_start);
    return 1;
}

/* A helper child that ended (killed from inside the box): another, unless it keeps
 * dying at once. */
void restart_helper(const char *what, uint64_t started_ms, void (*start)(void))
{
    if (now_ms() - started_ms < 1000) {
        logmsg("%s: exited within a second of starting; not restarted", what);
    } else {
        start();
    }
}
