/* Frames in: what each frame type means, on the session or on one of its
 * channels. Frames that start work go to the kind that does it (exec.c,
 * files.c); frames for a live channel go through its kind's channel_ops. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent.h"

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
    uint32_t aslr_wanted;
    int aslr = tlv_u32(p, n, SL_T_ASLR, &aslr_wanted) == 1 ? set_aslr((int)aslr_wanted) : -1;

    int resumed = s->has_token && memcmp(s->token, token, sizeof(s->token)) == 0;
    if (!resumed) {
        chan_orphan_all(s);
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
    if (aslr >= 0) {
        msg_u32(&m, SL_T_ASLR, (uint32_t)aslr);
    }
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
        struct ostream *o = NULL;
        if (stream == SL_STREAM_STDOUT || stream == SL_STREAM_STDERR) {
            o = chan_output(c, stream);
        }
        if (o) {
            o->sent = off < o->acked ? o->acked : (off > o->end ? o->end : off);
            o->eof_sent = 0;
        }
    }
    c->awaiting_resume = 0;
    if (c->ops->resume) {
        c->ops->resume(c);
    }
}

static uint64_t g_last_request_ms; /* for CONTROL STATUS: when a host last asked for work */

/* The idle time STATUS reports counts from when the loop starts. */
void dispatch_init(uint64_t now) { g_last_request_ms = now; }

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
        int r = g_safe_mode || !g_is_pid1 ? (errno = EPERM, -1) : mount_volume(tag, where, flags);
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
    case SL_CTL_FREEZE: {
        uint32_t lease_ms = 3000;
        char why[160];
        tlv_u32(p, n, SL_T_TIMEOUT_MS, &lease_ms);
        if (limits_freeze(lease_ms > 60000 ? 60000 : lease_ms, 2000, why, sizeof(why)) < 0) {
            send_error(s, ch, EAGAIN, SL_CONTROL, "%s", why);
            return;
        }
        break;
    }
    case SL_CTL_THAW:
        limits_thaw();
        break;
    case SL_CTL_DETACH: {
        char why[600];
        if (shares_detach(why, sizeof(why)) < 0) {
            send_error(s, ch, errno, SL_CONTROL, "%s", why);
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
        stats_add(&m);
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

void dispatch(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, const uint8_t *p, size_t n)
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
    case SL_ARCHIVE:
    case SL_FILE_READ:
    case SL_FILE_WRITE:
    case SL_FS:
    case SL_WATCH:
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
        } else if (type == SL_ARCHIVE) {
            archive_start(s, ch, p, n);
        } else if (type == SL_FILE_READ) {
            file_read_start(s, ch, p, n);
        } else if (type == SL_FILE_WRITE) {
            file_write_start(s, ch, p, n);
        } else if (type == SL_WATCH) {
            watch_start(s, ch, p, n);
        } else {
            fs_request(s, ch, p, n);
        }
        return;
    case SL_CONTROL:
        handle_control(s, ch, p, n);
        return;
    case SL_CLOSE:
        if (c) {
            chan_let_go(c);
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
            return;
        }
        void (*op)(struct channel *, const uint8_t *, size_t) = type == SL_SIGNAL ? c->ops->signal : c->ops->resize;
        if (op) {
            op(c, p, n);
        } else {
            send_error(s, ch, EINVAL, type, "channel %u is not an exec", ch);
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
                struct ostream *o = chan_output(c, stream);
                if (o) {
                    ostream_ack(o, off);
                }
            } else {
                send_error(s, ch, EINVAL, type, "ACK for stream %u", stream);
            }
            return;
        }
        if (stream != SL_STREAM_STDIN) {
            send_error(s, ch, EINVAL, type, "host may only send stream 0");
            return;
        }
        if (!c->ops->input || c->ops->input(c, type, off, p + SL_DATA_PREFIX, n - SL_DATA_PREFIX) < 0) {
            send_error(s, ch, EPIPE, type, "channel %u takes no input", ch);
        }
        return;
    }
    default:
        send_error(s, ch, ENOSYS, type, "unknown frame type 0x%02x", type);
        return;
    }
}
