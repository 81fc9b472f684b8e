/* sandlot guest agent: sessions, framing, dispatch and the poll loop.
 *
 * Usage:
 *   /init                       as PID 1 in the guest: boot duties, then serve ports
 *   sandlot-agent --fd N        serve one session on socket fd N (host builds, tests)
 *   sandlot-agent --fd N --safe same, but refuse exec and file-system changes (fuzzing)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

struct channel *g_channels;
int g_safe_mode;
int g_is_pid1;
size_t g_ring_bytes;

#define MAX_SESSIONS 8
#define STALE_INPUT_MS 2000
static struct session g_sessions[MAX_SESSIONS];
static int g_nsessions;
static int g_sigfd = -1;
static int g_host_mode;

/* Output stops flowing to a session once its queue passes the soft limit;
 * ACKs and replies still go out. */
static int session_congested(const struct session *s) { return buf_used(&s->out) >= OUT_SOFT_LIMIT; }

uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void logmsg(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
    va_end(ap);
    if (n < 0) {
        return;
    }
    if ((size_t)n > sizeof(line) - 2) {
        n = (int)sizeof(line) - 2;
    }
    line[n++] = '\n';
    /* stderr is the guest console (PID 1) or the host test's stderr. */
    ssize_t w = write(2, "sandlot-agent: ", 15);
    w = write(2, line, (size_t)n);
    (void)w;
}

/* ---- sending ----------------------------------------------------------- */

static int session_live(const struct session *s) { return s->out_fd >= 0 && s->connected; }

void send_frame(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, const void *p, size_t n)
{
    if (!session_live(s) || n > SL_MAX_PAYLOAD) {
        return;
    }
    uint8_t h[SL_HEADER_SIZE];
    wr16(h, SL_MAGIC);
    h[2] = type;
    h[3] = flags;
    wr32(h + 4, ch);
    wr32(h + 8, (uint32_t)n);
    if (buf_reserve(&s->out, sizeof(h) + n) < 0) {
        logmsg("out of memory queueing a frame");
        return;
    }
    buf_append(&s->out, h, sizeof(h));
    if (n) {
        buf_append(&s->out, p, n);
    }
}

void send_msg(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, struct msg *m)
{
    if (m->overflow) {
        send_error(s, ch, E2BIG, type, "reply does not fit in one frame");
    } else {
        send_frame(s, type, flags, ch, m->data, m->len);
    }
    msg_free(m);
}

void send_error(struct session *s, uint32_t ch, int err, uint8_t frame_type, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    struct msg m;
    msg_init(&m);
    msg_u32(&m, SL_T_ERRNO, (uint32_t)err);
    msg_str(&m, SL_T_MESSAGE, text);
    msg_u32(&m, SL_T_FRAME_TYPE, frame_type);
    send_frame(s, SL_ERROR, 0, ch, m.data, m.len);
    msg_free(&m);
}

/* Write straight to the port while it takes data; queue whatever it does not.
 * Streamed bytes then cost no user-space copy in the common case. */
static void send_direct(struct session *s, const uint8_t *hdr, size_t hlen, const uint8_t *data, size_t n)
{
    size_t done = 0, total = hlen + n;
    if (buf_used(&s->out) == 0) {
        while (done < total) {
            const uint8_t *p = done < hlen ? hdr + done : data + (done - hlen);
            size_t len = done < hlen ? hlen - done : total - done;
            ssize_t w = write(s->out_fd, p, len);
            if (w > 0) {
                done += (size_t)w;
            } else if (w < 0 && errno == EINTR) {
                continue;
            } else {
                break;
            }
        }
    }
    if (done == total) {
        return;
    }
    if (buf_reserve(&s->out, total - done) < 0) {
        logmsg("out of memory queueing a frame");
        return;
    }
    if (done < hlen) {
        buf_append(&s->out, hdr + done, hlen - done);
        done = hlen;
    }
    buf_append(&s->out, data + (done - hlen), total - done);
}

static void send_stream_offset(struct session *s, uint8_t type, uint32_t ch, uint32_t stream, uint64_t off,
                               const void *data, size_t n)
{
    if (!session_live(s)) {
        return;
    }
    if (n > SL_DATA_CHUNK) {
        n = SL_DATA_CHUNK;
    }
    uint8_t h[SL_HEADER_SIZE + SL_DATA_PREFIX];
    wr16(h, SL_MAGIC);
    h[2] = type;
    h[3] = 0;
    wr32(h + 4, ch);
    wr32(h + 8, (uint32_t)(SL_DATA_PREFIX + n));
    wr32(h + 12, stream);
    wr32(h + 16, 0);
    wr64(h + 20, off);
    send_direct(s, h, sizeof(h), data, n);
}

void send_ack(struct session *s, uint32_t ch, uint32_t stream, uint64_t off)
{
    send_stream_offset(s, SL_ACK, ch, stream, off, NULL, 0);
}

/* ---- channels ----------------------------------------------------------- */

/* A detached channel (its process runs on, unheard) no longer has an id a host can
 * use: the next connection numbers its channels from 1 again. */
static struct channel *chan_find(struct session *s, uint32_t id)
{
    for (struct channel *c = g_channels; c; c = c->next) {
        if (c->s == s && c->id == id && !c->detached) {
            return c;
        }
    }
    return NULL;
}

struct channel *chan_new(struct session *s, uint32_t id, int kind)
{
    if (s->nchannels >= SL_MAX_CHANNELS) {
        errno = EMFILE;
        return NULL;
    }
    struct channel *c = calloc(1, sizeof(*c));
    if (!c) {
        errno = ENOMEM;
        return NULL;
    }
    c->s = s;
    c->id = id;
    c->kind = kind;
    c->pid = -1;
    c->wfd = -1;
    c->in.fd = -1;
    for (int i = 0; i < 3; i++) {
        c->out[i].fd = -1;
    }
    c->next = g_channels;
    g_channels = c;
    s->nchannels++;
    return c;
}

void chan_free(struct channel *c)
{
    struct channel **pp = &g_channels;
    while (*pp && *pp != c) {
        pp = &(*pp)->next;
    }
    if (*pp) {
        *pp = c->next;
    }
    for (int i = 0; i < 3; i++) {
        ostream_close(&c->out[i]);
    }
    if (c->in.fd >= 0) {
        close(c->in.fd);
    }
    buf_free(&c->in.pending);
    if (c->kind == CH_FILE_WRITE) {
        file_write_abort(c);
    }
    if (c->kind == CH_LIST) {
        list_close(c);
    }
    if (c->kind == CH_EXEC) {
        exec_cgroup_release(c->cgroup);
    }
    free(c->tmp_path);
    free(c->final_path);
    if (c->s->nchannels) {
        c->s->nchannels--;
    }
    free(c);
}

/* ---- output streams ------------------------------------------------------ */

void ostream_init(struct ostream *o, int fd, int is_file)
{
    memset(o, 0, sizeof(*o));
    o->fd = fd;
    o->is_file = is_file;
}

void ostream_close(struct ostream *o)
{
    if (o->fd >= 0) {
        close(o->fd);
        o->fd = -1;
    }
    if (o->ring) {
        g_ring_bytes -= o->ring_cap;
        free(o->ring);
        o->ring = NULL;
        o->ring_cap = 0;
    }
}

int ostream_can_read(const struct ostream *o)
{
    if (o->fd < 0 || o->eof) {
        return 0;
    }
    if (o->end - o->acked >= SL_WINDOW) {
        return 0;
    }
    if (o->limit && o->end >= o->limit) {
        return 0;
    }
    /* Under memory pressure only streams that still have room keep reading. */
    if (g_ring_bytes >= RING_BUDGET && o->ring_cap - (size_t)(o->end - o->acked) == 0) {
        return 0;
    }
    return 1;
}

int ostream_fill(struct ostream *o)
{
    if (!ostream_can_read(o)) {
        return 0;
    }
    size_t held = (size_t)(o->end - o->acked);
    size_t want = SL_WINDOW - held;
    if (want > SL_DATA_CHUNK) {
        want = SL_DATA_CHUNK;
    }
    if (o->limit && o->limit - o->end < want) {
        want = (size_t)(o->limit - o->end);
    }
    if (held + want > o->ring_cap) {
        size_t cap = o->ring_cap ? o->ring_cap : SL_DATA_CHUNK;
        while (cap < held + want) {
            cap *= 2;
        }
        if (cap > SL_WINDOW) {
            cap = SL_WINDOW;
        }
        uint8_t *r = realloc(o->ring, cap);
        if (!r) {
            return 0;
        }
        g_ring_bytes += cap - o->ring_cap;
        o->ring = r;
        o->ring_cap = cap;
    }
    ssize_t n = read(o->fd, o->ring + held, want);
    if (n > 0) {
        o->end += (uint64_t)n;
        if (o->limit && o->end >= o->limit) {
            o->eof = 1;
        }
        return 1;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        return 0;
    }
    /* 0 is end of file; EIO is how a PTY master reports that the last slave closed. */
    o->eof = 1;
    close(o->fd);
    o->fd = -1;
    return 1;
}

void ostream_pump(struct channel *c, uint32_t stream, struct ostream *o)
{
    struct session *s = c->s;
    if (c->detached) { /* nobody listens: drop output so the process never blocks */
        o->acked = o->sent = o->end;
        o->eof_sent = o->eof;
        return;
    }
    if (!session_live(s) || !s->hello_done) {
        return;
    }
    while (o->sent < o->end && !session_congested(s)) {
        size_t n = (size_t)(o->end - o->sent);
        if (n > SL_DATA_CHUNK) {
            n = SL_DATA_CHUNK;
        }
        send_stream_offset(s, SL_DATA, c->id, stream, o->sent, o->ring + (o->sent - o->acked), n);
        o->sent += n;
    }
    if (o->eof && o->sent == o->end && !o->eof_sent) {
        send_stream_offset(s, SL_EOF, c->id, stream, o->end, NULL, 0);
        o->eof_sent = 1;
    }
}

void ostream_ack(struct ostream *o, uint64_t off)
{
    if (off <= o->acked || off > o->sent) {
        return;
    }
    size_t drop = (size_t)(off - o->acked);
    size_t held = (size_t)(o->end - o->acked);
    memmove(o->ring, o->ring + drop, held - drop);
    o->acked = off;
    if (o->acked == o->end && o->ring && (o->eof || o->ring_cap > SL_DATA_CHUNK)) {
        g_ring_bytes -= o->ring_cap; /* give memory back between bursts */
        free(o->ring);
        o->ring = NULL;
        o->ring_cap = 0;
    }
}

/* ---- session lifecycle -------------------------------------------------- */

static void session_disconnected(struct session *s)
{
    s->connected = 0;
    s->hello_done = 0;
    s->discard = 0;
    s->resync = 0;
    buf_free(&s->in);
    buf_free(&s->out);
    struct channel *c = g_channels, *next;
    for (; c; c = next) {
        next = c->next;
        if (c->s != s) {
            continue;
        }
        if (c->kind == CH_LIST) { /* listings are restarted by the host, not resumed */
            chan_free(c);
            continue;
        }
        /* Nothing sent since the last ACK is known to have arrived: resend on RESUME. */
        for (int i = 1; i < 3; i++) {
            c->out[i].sent = c->out[i].acked;
            c->out[i].eof_sent = 0;
        }
        c->exit_sent = 0;
    }
    if (!s->is_port) {
        logmsg("host closed the session; exiting");
        exit(0);
    }
}

/* A new host (not a reconnection of the last one) owns this session now: the
 * old host's channels keep their processes running but their output is dropped. */
static void session_orphan_channels(struct session *s)
{
    struct channel *c = g_channels, *next;
    for (; c; c = next) {
        next = c->next;
        if (c->s != s) {
            continue;
        }
        if (c->kind == CH_EXEC && (!c->exited || c->out[1].fd >= 0 || c->out[2].fd >= 0)) {
            c->detached = 1;
            if (c->in.fd >= 0) {
                close(c->in.fd);
                c->in.fd = -1;
            }
        } else {
            chan_free(c);
        }
    }
}

static void handle_hello(struct session *s, const uint8_t *p, size_t n)
{
    uint32_t vmin = 0, vmax = 0;
    const uint8_t *token, *entropy;
    uint32_t token_len = 0, entropy_len = 0;
    if (!tlv_valid(p, n) || tlv_u32(p, n, SL_T_VERSION_MIN, &vmin) != 1 ||
        tlv_u32(p, n, SL_T_VERSION_MAX, &vmax) != 1 || !tlv_bytes(p, n, SL_T_SESSION, &token, &token_len) ||
        token_len != sizeof(s->token)) {
        send_error(s, 0, EINVAL, SL_HELLO, "malformed HELLO");
        return;
    }
    if (vmin > SL_PROTOCOL_VERSION || vmax < SL_PROTOCOL_VERSION) {
        send_error(s, 0, EPROTONOSUPPORT, SL_HELLO, "agent speaks protocol version %d, host offers %u..%u",
                   SL_PROTOCOL_VERSION, vmin, vmax);
        return;
    }
    if (tlv_bytes(p, n, SL_T_ENTROPY, &entropy, &entropy_len) && entropy_len <= 4096) {
        add_entropy(entropy, entropy_len);
    }
    uint64_t t;
    if (tlv_u64(p, n, SL_T_TIME_NS, &t) == 1) {
        set_wall_clock(t);
    }
    char *hostname = NULL;
    if (tlv_str(p, n, SL_T_HOSTNAME, &hostname) == 1) {
        set_hostname(hostname);
    }
    free(hostname);
    char *machine_id = NULL;
    if (tlv_str(p, n, SL_T_MACHINE_ID, &machine_id) == 1) {
        set_machine_id(machine_id);
    }
    free(machine_id);
    uint32_t pids_max;
    if (tlv_u32(p, n, SL_T_PIDS_MAX, &pids_max) == 1) {
        limits_set_pids(pids_max);
    }

    int resumed = s->has_token && memcmp(s->token, token, sizeof(s->token)) == 0;
    if (!resumed) {
        session_orphan_channels(s);
        memcpy(s->token, token, sizeof(s->token));
        s->has_token = 1;
    }
    s->hello_done = 1;

    struct msg m;
    msg_init(&m);
    msg_u32(&m, SL_T_VERSION, SL_PROTOCOL_VERSION);
    msg_str(&m, SL_T_AGENT_VERSION, AGENT_VERSION);
    msg_str(&m, SL_T_BOOT_ID, boot_id());
    msg_u32(&m, SL_T_RESUMED, (uint32_t)resumed);
    msg_u32(&m, SL_T_MAX_PAYLOAD, SL_MAX_PAYLOAD);
    msg_u32(&m, SL_T_WINDOW, SL_WINDOW);
    if (resumed) {
        for (struct channel *c = g_channels; c; c = c->next) {
            if (c->s == s && !c->detached) {
                msg_u32(&m, SL_T_CHANNEL, c->id);
            }
        }
    }
    send_msg(s, SL_HELLO_ACK, 0, 0, &m);
}

static void handle_resume(struct session *s, struct channel *c, const uint8_t *p, size_t n)
{
    struct tlv_iter it;
    struct tlv t;
    if (!tlv_valid(p, n)) {
        send_error(s, c->id, EINVAL, SL_RESUME, "malformed RESUME");
        return;
    }
    tlv_begin(&it, p, n);
    while (tlv_next(&it, &t) == 1) {
        if (t.tag != SL_T_STREAM_OFFSET || t.len != 12) {
            continue;
        }
        uint32_t stream = rd32(t.val);
        uint64_t off = rd64(t.val + 4);
        if (stream == SL_STREAM_STDOUT || stream == SL_STREAM_STDERR) {
            struct ostream *o = &c->out[stream];
            o->sent = off < o->acked ? o->acked : (off > o->end ? o->end : off);
            o->eof_sent = 0;
        }
    }
    if (c->kind == CH_EXEC && c->in.fd >= 0) {
        send_ack(s, c->id, SL_STREAM_STDIN, c->in.written);
        c->in.acked_sent = c->in.written;
    } else if (c->kind == CH_FILE_WRITE) {
        send_ack(s, c->id, SL_STREAM_STDIN, c->wbytes);
    }
    c->exit_sent = 0;
}

static uint64_t g_last_request_ms; /* for CONTROL STATUS: when a host last asked for work */

static void handle_control(struct session *s, uint32_t ch, const uint8_t *p, size_t n)
{
    uint32_t op = 0;
    if (!tlv_valid(p, n) || tlv_u32(p, n, SL_T_OP, &op) != 1) {
        send_error(s, ch, EINVAL, SL_CONTROL, "malformed CONTROL");
        return;
    }
    if (op != SL_CTL_STATUS) {
        g_last_request_ms = now_ms();
    }
    switch (op) {
    case SL_CTL_SHUTDOWN: {
        uint32_t timeout_ms = 2000;
        tlv_u32(p, n, SL_T_TIMEOUT_MS, &timeout_ms);
        if (g_safe_mode || !g_is_pid1) {
            send_error(s, ch, EPERM, SL_CONTROL, "shutdown is only possible in a guest");
            return;
        }
        shutdown_guest(s, ch, timeout_ms);
        return;
    }
    case SL_CTL_SYNC:
        sync();
        break;
    case SL_CTL_SET_HOSTNAME: {
        char *name = NULL;
        if (tlv_str(p, n, SL_T_HOSTNAME, &name) != 1) {
            send_error(s, ch, EINVAL, SL_CONTROL, "SET_HOSTNAME needs a hostname");
            return;
        }
        set_hostname(name);
        free(name);
        break;
    }
    case SL_CTL_SET_TIME: {
        uint64_t t;
        if (tlv_u64(p, n, SL_T_TIME_NS, &t) != 1) {
            send_error(s, ch, EINVAL, SL_CONTROL, "SET_TIME needs a time");
            return;
        }
        set_wall_clock(t);
        break;
    }
    case SL_CTL_ADD_ENTROPY: {
        const uint8_t *e;
        uint32_t elen;
        if (!tlv_bytes(p, n, SL_T_ENTROPY, &e, &elen) || elen > 4096) {
            send_error(s, ch, EINVAL, SL_CONTROL, "ADD_ENTROPY needs up to 4096 bytes");
            return;
        }
        add_entropy(e, elen);
        break;
    }
    case SL_CTL_MOUNT: {
        char *where = NULL, *tag = NULL;
        uint32_t flags = 0;
        if (tlv_str(p, n, SL_T_PATH, &where) != 1 || tlv_str(p, n, SL_T_PATH2, &tag) != 1 || where[0] != '/' ||
            tlv_u32(p, n, SL_T_FLAGS, &flags) < 0) {
            free(where);
            free(tag);
            send_error(s, ch, EINVAL, SL_CONTROL, "MOUNT needs an absolute PATH and a PATH2 tag");
            return;
        }
        int r = g_safe_mode || !g_is_pid1 ? (errno = EPERM, -1) : mount_volume(tag, where, flags & SL_MOUNT_READONLY);
        int e = errno;
        if (r < 0) {
            send_error(s, ch, e, SL_CONTROL, "mount %s on %s: %s", tag, where, strerror(e));
        }
        free(where);
        free(tag);
        if (r < 0) {
            return;
        }
        break;
    }
    case SL_CTL_STATUS: {
        /* how busy the box is, for the host's idle timeout: channels in use by any
         * host (this request's own aside) and the time since a request last came */
        uint32_t count = 0;
        for (struct channel *c = g_channels; c; c = c->next) {
            count += !c->detached && c->id != ch;
        }
        struct msg m;
        msg_init(&m);
        msg_u32(&m, SL_T_COUNT, count);
        msg_u64(&m, SL_T_IDLE_MS, now_ms() - g_last_request_ms);
        send_msg(s, SL_CONTROL_OK, 0, ch, &m);
        return;
    }
    default:
        send_error(s, ch, ENOSYS, SL_CONTROL, "unknown control operation %u", op);
        return;
    }
    send_frame(s, SL_CONTROL_OK, 0, ch, NULL, 0);
}

static const char *frame_name(uint8_t type)
{
    switch (type) {
    case SL_DATA: return "DATA";
    case SL_EOF: return "EOF";
    case SL_ACK: return "ACK";
    default: return "frame";
    }
}

static void dispatch(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, const uint8_t *p, size_t n)
{
    if (flags != 0) {
        send_error(s, ch, EINVAL, type, "reserved flags 0x%x set", flags);
        return;
    }
    if (type == SL_HELLO) {
        handle_hello(s, p, n);
        return;
    }
    if (type == SL_PING) {
        send_frame(s, SL_PONG, 0, ch, p, n);
        return;
    }
    if (!s->hello_done) {
        return; /* not reached: session_parse only lets HELLO through before the handshake */
    }
    struct channel *c = ch ? chan_find(s, ch) : NULL;
    if (type != SL_CONTROL && type != SL_CLOSE && type != SL_ACK) {
        g_last_request_ms = now_ms(); /* a host asked for work (a STATUS poll's own CLOSE is not work) */
    }

    switch (type) {
    case SL_EXEC:
    case SL_FILE_READ:
    case SL_FILE_WRITE:
    case SL_FS:
        if (ch == 0) {
            send_error(s, ch, EINVAL, type, "channel 0 is reserved");
            return;
        }
        if (c) {
            send_error(s, ch, EEXIST, type, "channel %u is in use", ch);
            return;
        }
        if (type == SL_EXEC) {
            exec_start(s, ch, p, n);
        } else if (type == SL_FILE_READ) {
            file_read_start(s, ch, p, n);
        } else if (type == SL_FILE_WRITE) {
            file_write_start(s, ch, p, n);
        } else {
            fs_request(s, ch, p, n);
        }
        return;
    case SL_CONTROL:
        handle_control(s, ch, p, n);
        return;
    case SL_CLOSE:
        if (c) {
            if (c->kind == CH_EXEC && !(c->exited && c->out[1].fd < 0 && c->out[2].fd < 0)) {
                c->detached = 1; /* the process keeps running; its output goes nowhere */
                if (c->in.fd >= 0) {
                    close(c->in.fd);
                    c->in.fd = -1;
                }
            } else {
                chan_free(c);
            }
        }
        return;
    case SL_RESUME:
    case SL_SIGNAL:
    case SL_RESIZE:
        if (!c) {
            send_error(s, ch, EBADF, type, "no channel %u", ch);
            return;
        }
        if (type == SL_RESUME) {
            handle_resume(s, c, p, n);
        } else if (c->kind != CH_EXEC) {
            send_error(s, ch, EINVAL, type, "channel %u is not an exec", ch);
        } else if (type == SL_SIGNAL) {
            exec_signal(c, p, n);
        } else {
            exec_resize(c, p, n);
        }
        return;
    case SL_DATA:
    case SL_EOF:
    case SL_ACK: {
        if (n < SL_DATA_PREFIX || (type != SL_DATA && n != SL_DATA_PREFIX)) {
            send_error(s, ch, EINVAL, type, "malformed %s", frame_name(type));
            return;
        }
        if (!c) {
            return; /* late frame for a channel that just ended: not an error */
        }
        uint32_t stream = rd32(p);
        uint64_t off = rd64(p + 8);
        if (type == SL_ACK) {
            if (stream == SL_STREAM_STDOUT || stream == SL_STREAM_STDERR) {
                ostream_ack(&c->out[stream], off);
            } else {
                send_error(s, ch, EINVAL, type, "ACK for stream %u", stream);
            }
            return;
        }
        if (stream != SL_STREAM_STDIN) {
            send_error(s, ch, EINVAL, type, "host may only send stream 0");
            return;
        }
        if (c->kind == CH_FILE_WRITE) {
            if (type == SL_DATA) {
                file_write_data(c, off, p + SL_DATA_PREFIX, n - SL_DATA_PREFIX);
            } else {
                file_write_eof(c, off);
            }
            return;
        }
        if (c->kind != CH_EXEC || c->in.fd < 0) {
            send_error(s, ch, EPIPE, type, "channel %u takes no input", ch);
            return;
        }
        struct istream *in = &c->in;
        if (off > in->received) {
            send_error(s, ch, EINVAL, type, "input gap at offset %llu", (unsigned long long)in->received);
            return;
        }
        if (type == SL_EOF) {
            in->eof = 1;
        } else {
            size_t skip = (size_t)(in->received - off);
            size_t len = n - SL_DATA_PREFIX;
            if (skip < len) {
                if (in->received + (len - skip) - in->written > SL_WINDOW) {
                    send_error(s, ch, ENOBUFS, type, "input beyond the window");
                    return;
                }
                buf_append(&in->pending, p + SL_DATA_PREFIX + skip, len - skip);
                in->received += len - skip;
            }
        }
        istream_flush(c);
        return;
    }
    default:
        send_error(s, ch, ENOSYS, type, "unknown frame type 0x%02x", type);
        return;
    }
}

/* Consume whole frames from s->in. Bad framing never stops the session. */
static void session_parse(struct session *s)
{
    for (;;) {
        size_t avail = buf_used(&s->in);
        uint8_t *p = s->in.data + s->in.head;
        if (s->discard) {
            size_t d = s->discard < avail ? s->discard : avail;
            buf_consume(&s->in, d);
            s->discard -= d;
            if (s->discard) {
                return;
            }
            continue;
        }
        if (!s->hello_done) {
            /* Until HELLO, bytes may be left over from an earlier host connection,
             * even half a frame: skip everything up to a HELLO header. */
            static const uint8_t hello_hdr[8] = {0x53, 0x4C, SL_HELLO, 0, 0, 0, 0, 0};
            size_t i = 0;
            while (i + sizeof(hello_hdr) <= avail && memcmp(p + i, hello_hdr, sizeof(hello_hdr)) != 0) {
                i++;
            }
            if (i + sizeof(hello_hdr) > avail) {
                /* keep a tail that may be the start of a HELLO header */
                size_t keep = avail < sizeof(hello_hdr) - 1 ? avail : sizeof(hello_hdr) - 1;
                buf_consume(&s->in, avail - keep);
                return;
            }
            if (i) {
                buf_consume(&s->in, i);
                avail -= i;
                p = s->in.data + s->in.head;
            }
            s->discard = 0;
            s->resync = 0;
        }
        if (avail < 2) {
            return;
        }
        if (rd16(p) != SL_MAGIC) {
            if (!s->resync) {
                send_error(s, 0, EPROTO, 0, "bad frame magic; resynchronising");
                s->resync = 1;
            }
            /* skip to the next possible magic */
            size_t i = 1;
            while (i + 1 < avail && rd16(p + i) != SL_MAGIC) {
                i++;
            }
            buf_consume(&s->in, i);
            continue;
        }
        if (avail < SL_HEADER_SIZE) {
            return;
        }
        uint8_t type = p[2], flags = p[3];
        uint32_t ch = rd32(p + 4), len = rd32(p + 8);
        if (len > SL_MAX_PAYLOAD) {
            send_error(s, ch, E2BIG, type, "frame of %u bytes exceeds the %u byte limit", len, SL_MAX_PAYLOAD);
            buf_consume(&s->in, SL_HEADER_SIZE);
            s->discard = len;
            continue;
        }
        if (avail < SL_HEADER_SIZE + len) {
            return;
        }
        s->resync = 0;
        s->frames_in++;
        dispatch(s, type, flags, ch, p + SL_HEADER_SIZE, len);
        /* dispatch never touches s->in, so p is still valid to consume */
        buf_consume(&s->in, SL_HEADER_SIZE + len);
    }
}

static void session_read(struct session *s)
{
    if (buf_reserve(&s->in, 64 * 1024) < 0) {
        return;
    }
    ssize_t n = read(s->in_fd, s->in.data + s->in.len, s->in.cap - s->in.len);
    if (n > 0) {
        s->in.len += (size_t)n;
        uint64_t frames = s->frames_in;
        size_t discard = s->discard;
        session_parse(s);
        /* A frame must complete within STALE_INPUT_MS of its start. Bytes that keep
         * arriving do not keep a partial frame alive: after a restore, a half frame
         * saved in the guest would otherwise swallow the host's HELLO retries forever. */
        if (!buf_used(&s->in) && !s->discard) {
            s->last_input_ms = 0;
        } else if (s->frames_in != frames || s->discard != discard || !s->last_input_ms) {
            s->last_input_ms = now_ms();
        }
        /* never keep more than one maximal frame buffered */
        if (s->in.cap > 2 * (SL_HEADER_SIZE + SL_MAX_PAYLOAD) && buf_used(&s->in) < 4096) {
            struct buf fresh = {0};
            if (buf_append(&fresh, s->in.data + s->in.head, buf_used(&s->in)) == 0) {
                buf_free(&s->in);
                s->in = fresh;
            }
        }
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        session_disconnected(s);
    }
}

static void session_write(struct session *s)
{
    /* A virtio-serial port takes at most 32 KiB per write: keep going until it is full. */
    while (buf_used(&s->out)) {
        ssize_t n = write(s->out_fd, s->out.data + s->out.head, buf_used(&s->out));
        if (n > 0) {
            buf_consume(&s->out, (size_t)n);
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            if (n < 0 && errno != EAGAIN) {
                session_disconnected(s);
            }
            return;
        }
    }
}

/* A port whose host end is closed polls as POLLHUP forever, so it leaves the
 * poll set; SIGIO (O_ASYNC) and a slow timer bring it back. */
static void port_check(struct session *s)
{
    struct pollfd pfd = {.fd = s->in_fd, .events = POLLIN};
    if (poll(&pfd, 1, 0) < 0) {
        return;
    }
    int up = !(pfd.revents & POLLHUP);
    if (up && !s->connected) {
        s->connected = 1;
        s->hello_done = 0;
    } else if (!up && s->connected) {
        session_disconnected(s);
    }
}

/* ---- main loop ------------------------------------------------------------ */

static void handle_signals(void)
{
    struct signalfd_siginfo si;
    while (read(g_sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        if (si.ssi_signo == SIGIO) {
            for (int i = 0; i < g_nsessions; i++) {
                if (g_sessions[i].is_port) {
                    port_check(&g_sessions[i]);
                }
            }
        }
    }
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) {
            break;
        }
        if (!dns_relay_reaped(pid)) {
            exec_reaped(pid, status);
        }
    }
}

enum { P_SESSION = 1, P_SIGNAL, P_OUT, P_IN, P_OOM };

struct pollref {
    int what;
    struct session *s;
    struct channel *c;
    int stream;
};

static void progress_all(void)
{
    struct channel *c = g_channels, *next;
    for (; c; c = next) {
        next = c->next;
        if (c->kind == CH_EXEC) {
            exec_progress(c);
        } else if (c->kind == CH_FILE_READ) {
            file_read_progress(c);
        } else if (c->kind == CH_LIST) {
            list_progress(c);
        }
    }
}

static void serve(void)
{
    static struct pollfd pfds[4096];
    static struct pollref refs[4096];
    uint64_t last_port_check = now_ms();
    g_last_request_ms = last_port_check;

    for (;;) {
        progress_all();
        int n = 0, timeout = 1000;
        pfds[n] = (struct pollfd){.fd = g_sigfd, .events = POLLIN};
        refs[n++] = (struct pollref){.what = P_SIGNAL};
        if (g_oom_fd >= 0) {
            pfds[n] = (struct pollfd){.fd = g_oom_fd, .events = POLLPRI};
            refs[n++] = (struct pollref){.what = P_OOM};
        }
        for (int i = 0; i < g_nsessions; i++) {
            struct session *s = &g_sessions[i];
            if (!s->connected) {
                continue;
            }
            if (buf_used(&s->in) || s->discard) {
                uint64_t due = s->last_input_ms + STALE_INPUT_MS, t = now_ms();
                int wait = due > t ? (int)(due - t) : 0;
                if (wait < timeout) {
                    timeout = wait;
                }
            }
            short ev = 0;
            if (buf_used(&s->out) < OUT_HARD_LIMIT) {
                ev |= POLLIN;
            }
            if (buf_used(&s->out)) {
                ev |= POLLOUT;
            }
            pfds[n] = (struct pollfd){.fd = s->in_fd, .events = ev};
            refs[n++] = (struct pollref){.what = P_SESSION, .s = s};
            if (s->out_fd != s->in_fd && buf_used(&s->out)) {
                pfds[n] = (struct pollfd){.fd = s->out_fd, .events = POLLOUT};
                refs[n++] = (struct pollref){.what = P_SESSION, .s = s};
            }
        }
        uint64_t now = now_ms();
        for (struct channel *c = g_channels; c && n < 4090; c = c->next) {
            for (int k = 1; k < 3; k++) {
                struct ostream *o = &c->out[k];
                if (!ostream_can_read(o)) {
                    continue;
                }
                if (o->is_file) {
                    timeout = 0;
                    continue;
                }
                pfds[n] = (struct pollfd){.fd = o->fd, .events = POLLIN};
                refs[n++] = (struct pollref){.what = P_OUT, .c = c, .stream = k};
            }
            if (c->in.fd >= 0 && buf_used(&c->in.pending)) {
                pfds[n] = (struct pollfd){.fd = c->in.fd, .events = POLLOUT};
                refs[n++] = (struct pollref){.what = P_IN, .c = c};
            }
            if (c->kind == CH_LIST && c->s->connected && buf_used(&c->s->out) < OUT_SOFT_LIMIT) {
                timeout = 0;
            }
            if (c->kind == CH_EXEC && c->exited && !c->exit_sent) {
                uint64_t due = c->quiet_since_ms + 100;
                int t = due > now ? (int)(due - now) : 0;
                if (t < timeout) {
                    timeout = t;
                }
            }
        }

        int r = poll(pfds, (nfds_t)n, timeout);
        if (r < 0 && errno != EINTR) {
            logmsg("poll: %s", strerror(errno));
            continue;
        }
        for (int i = 0; r > 0 && i < n; i++) {
            short re = pfds[i].revents;
            if (!re) {
                continue;
            }
            struct pollref *ref = &refs[i];
            switch (ref->what) {
            case P_SIGNAL:
                handle_signals();
                break;
            case P_OOM:
                limits_oom_event();
                break;
            case P_SESSION:
                if (!ref->s->connected) {
                    break;
                }
                if (re & POLLOUT) {
                    session_write(ref->s);
                }
                if (ref->s->connected && (re & (POLLIN | POLLERR))) {
                    session_read(ref->s);
                } else if (ref->s->connected && (re & POLLHUP)) {
                    if (ref->s->is_port) {
                        session_disconnected(ref->s);
                    } else {
                        session_read(ref->s);
                    }
                }
                break;
            case P_OUT: {
                struct channel *c = ref->c;
                /* the channel may have been freed by an earlier event of this round */
                struct channel *x = g_channels;
                while (x && x != c) {
                    x = x->next;
                }
                if (x && ostream_fill(&c->out[ref->stream]) > 0) {
                    c->quiet_since_ms = now_ms();
                }
                break;
            }
            case P_IN: {
                struct channel *x = g_channels;
                while (x && x != ref->c) {
                    x = x->next;
                }
                if (x) {
                    istream_flush(x);
                }
                break;
            }
            }
        }
        for (int i = 0; i < g_nsessions; i++) {
            if (g_sessions[i].connected) {
                session_write(&g_sessions[i]);
            }
        }
        now = now_ms();
        for (int i = 0; i < g_nsessions; i++) {
            struct session *s = &g_sessions[i];
            /* A frame left half-sent by a host that went away must not swallow the
             * next host's HELLO: drop partial input that has not moved for a while. */
            if (s->connected && (buf_used(&s->in) || s->discard) && now - s->last_input_ms >= STALE_INPUT_MS) {
                logmsg("dropping %zu bytes of a stale partial frame", buf_used(&s->in));
                buf_free(&s->in);
                s->discard = 0;
                s->resync = 1;
            }
        }
        if (now - last_port_check >= 1000) {
            last_port_check = now;
            for (int i = 0; i < g_nsessions; i++) {
                if (g_sessions[i].is_port) {
                    port_check(&g_sessions[i]);
                }
            }
        }
    }
}

static void setup_signals(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGIO);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGPWR);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    sigprocmask(SIG_BLOCK, &set, NULL);
    g_sigfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    signal(SIGPIPE, SIG_IGN);
}

int main(int argc, char **argv)
{
    int fd = -1;
    g_is_pid1 = getpid() == 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--fd") && i + 1 < argc) {
            fd = atoi(argv[++i]);
            g_host_mode = 1;
        } else if (!strcmp(argv[i], "--safe")) {
            g_safe_mode = 1;
        } else if (!strcmp(argv[i], "--version")) {
            printf("sandlot-agent %s protocol %d\n", AGENT_VERSION, SL_PROTOCOL_VERSION);
            return 0;
        }
    }
    if (!g_is_pid1 && !g_host_mode) {
        fprintf(stderr, "usage: sandlot-agent --fd N [--safe]   (or run as PID 1 in a guest)\n");
        return 2;
    }
    struct rlimit rl = {65536, 65536};
    setrlimit(RLIMIT_NOFILE, &rl);
    setup_signals();

    if (g_is_pid1) {
        init_early();
        init_after_root();
        g_nsessions = open_ports(g_sessions, MAX_SESSIONS);
        if (g_nsessions == 0) {
            logmsg("no sandlot.* virtio-serial port found");
        }
        for (int i = 0; i < g_nsessions; i++) {
            port_check(&g_sessions[i]);
        }
        logmsg("ready: %d port(s)", g_nsessions);
    } else {
        struct session *s = &g_sessions[0];
        memset(s, 0, sizeof(*s));
        s->in_fd = s->out_fd = fd;
        s->connected = 1;
        snprintf(s->name, sizeof(s->name), "fd%d", fd);
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        fcntl(fd, F_SETFD, FD_CLOEXEC);
        g_nsessions = 1;
    }
    serve();
    return 0;
}
