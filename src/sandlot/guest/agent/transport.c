/* Sessions: the byte stream to one host. Framing in both directions, the
 * queue of frames waiting for the port, and the port's own comings and goings.
 * Frames are handed to dispatch.c whole; what a frame means is not known here. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "agent.h"

#define STALE_INPUT_MS 2000

int session_live(const struct session *s) { return s->out_fd >= 0 && s->connected; }

/* Output stops flowing to a session once its queue passes the soft limit;
 * ACKs and replies still go out. */
int session_congested(const struct session *s) { return buf_used(&s->out) >= OUT_SOFT_LIMIT; }

/* ---- sending -------------------------------------------------------- */

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
        /* Never half a frame: none is queued. Its channel ends with an error in its
         * place where that one, small, still fits; a channel's result is never
         * silently missing. */
        logmsg("out of memory queueing a %zu-byte frame for channel %u", n, ch);
        if (type != SL_ERROR && ch != 0) {
            send_error(s, ch, ENOMEM, type, "the agent ran out of memory sending this");
        }
        return;
    }
    buf_append(&s->out, h, sizeof(h));
    if (n) {
        buf_append(&s->out, p, n);
    }
}

void send_msg(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, struct msg *m)
{
    if (m->overflow == MSG_NO_MEMORY) {
        send_error(s, ch, ENOMEM, type, "the agent ran out of memory building the reply");
    } else if (m->overflow) {
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

#define WRITE_THROUGH_MS 30000

/* Write bytes [done, total) of a frame (its header, then its data) while the port takes
 * them; how far it got. errno says why it stopped short (EAGAIN: the port is full). */
static size_t write_frame(struct session *s, const uint8_t *hdr, size_t hlen, const uint8_t *data, size_t done,
                          size_t total)
{
    while (done < total) {
        const uint8_t *p = done < hlen ? hdr + done : data + (done - hlen);
        size_t len = done < hlen ? hlen - done : total - done;
        ssize_t w = write(s->out_fd, p, len);
        if (w > 0) {
            done += (size_t)w;
        } else if (w < 0 && errno == EINTR) {
            continue;
        } else {
            if (w == 0) {
                errno = EIO; /* took nothing, said nothing: not a full port */
            }
            break;
        }
    }
    return done;
}

/* The rest of a frame begun on the wire, written as the port takes it (the out queue
 * could not hold it). A port that takes nothing for WRITE_THROUGH_MS has no live host:
 * the session is given up, as if the host had gone, and a reconnected host resumes. */
static void write_through(struct session *s, const uint8_t *hdr, size_t hlen, const uint8_t *data, size_t done,
                          size_t total)
{
    for (;;) {
        done = write_frame(s, hdr, hlen, data, done, total);
        if (done == total) {
            return;
        }
        struct pollfd pfd = {.fd = s->out_fd, .events = POLLOUT};
        if (errno != EAGAIN || poll(&pfd, 1, WRITE_THROUGH_MS) <= 0 || (pfd.revents & (POLLERR | POLLHUP))) {
            logmsg("the port took no more of a frame; giving the session up");
            s->lost_output = 1;
            return;
        }
    }
}

/* Write straight to the port while it takes data; queue whatever it does not.
 * Streamed bytes then cost no user-space copy in the common case. */
static int send_direct(struct session *s, const uint8_t *hdr, size_t hlen, const uint8_t *data, size_t n)
{
    size_t done = 0, total = hlen + n;
    if (buf_used(&s->out) == 0) {
        done = write_frame(s, hdr, hlen, data, 0, total);
    }
    if (done == total) {
        return 0;
    }
    if (buf_reserve(&s->out, total - done) < 0) {
        if (done > 0) {
            /* Part of the frame is on the wire: dropping the rest would cost the host the
             * framing of every channel. Write the rest as the port takes it instead. */
            logmsg("out of memory queueing a frame's last %zu bytes: writing them through", total - done);
            write_through(s, hdr, hlen, data, done, total);
            return 0;
        }
        return -1; /* nothing sent: the caller keeps it, to send again */
    }
    if (done < hlen) {
        buf_append(&s->out, hdr + done, hlen - done);
        done = hlen;
    }
    buf_append(&s->out, data + (done - hlen), total - done);
    return 0;
}

static int send_stream_offset(struct session *s, uint8_t type, uint32_t ch, uint32_t stream, uint64_t off,
                              const void *data, size_t n)
{
    if (!session_live(s)) {
        return 0;
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
    return send_direct(s, h, sizeof(h), data, n);
}

void send_ack(struct session *s, uint32_t ch, uint32_t stream, uint64_t off)
{
    (void)send_stream_offset(s, SL_ACK, ch, stream, off, NULL, 0); /* a later ACK covers it */
}

int send_data(struct session *s, uint32_t ch, uint32_t stream, uint64_t off, const void *p, size_t n)
{
    return send_stream_offset(s, SL_DATA, ch, stream, off, p, n);
}

int send_eof(struct session *s, uint32_t ch, uint32_t stream, uint64_t off)
{
    return send_stream_offset(s, SL_EOF, ch, stream, off, NULL, 0);
}

/* ---- receiving ------------------------------------------------------ */

static void session_disconnected(struct session *s)
{
    s->connected = 0;
    s->hello_done = 0;
    s->discard = 0;
    s->resync = 0;
    buf_reset(&s->in);
    buf_reset(&s->out);
    chan_disconnect_all(s);
    if (s->listen_fd > 0) {
        /* a listener's connection is gone for good: the next host connects anew */
        close(s->in_fd);
        s->in_fd = s->out_fd = -1;
        return;
    }
    if (!s->is_port) {
        logmsg("host closed the session; exiting");
        exit(0);
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

void session_write(struct session *s)
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

/* ---- the poll loop's share ------------------------------------------ */

int session_poll(struct session *s, struct pollfd *pfds, int *timeout_ms)
{
    if (s->lost_output) { /* here, where no channel's code is running */
        s->lost_output = 0;
        session_disconnected(s);
    }
    if (!s->connected) {
        return 0;
    }
    if (buf_used(&s->in) || s->discard) {
        uint64_t due = s->last_input_ms + STALE_INPUT_MS, t = now_ms();
        int wait = due > t ? (int)(due - t) : 0;
        if (wait < *timeout_ms) {
            *timeout_ms = wait;
        }
    }
    int n = 0;
    short ev = 0;
    if (buf_used(&s->out) < OUT_HARD_LIMIT) {
        ev |= POLLIN;
    }
    if (buf_used(&s->out)) {
        ev |= POLLOUT;
    }
    pfds[n++] = (struct pollfd){.fd = s->in_fd, .events = ev};
    if (s->out_fd != s->in_fd && buf_used(&s->out)) {
        pfds[n++] = (struct pollfd){.fd = s->out_fd, .events = POLLOUT};
    }
    return n;
}

void session_events(struct session *s, short revents)
{
    if (!s->connected) {
        return;
    }
    if (revents & POLLOUT) {
        session_write(s);
    }
    if (s->connected && (revents & (POLLIN | POLLERR))) {
        session_read(s);
    } else if (s->connected && (revents & POLLHUP)) {
        if (s->is_port) {
            session_disconnected(s);
        } else {
            session_read(s);
        }
    }
}

/* A frame left half-sent by a host that went away must not swallow the next
 * host's HELLO: drop partial input that has not moved for a while. */
void session_drop_stale(struct session *s, uint64_t now)
{
    if (s->connected && (buf_used(&s->in) || s->discard) && now - s->last_input_ms >= STALE_INPUT_MS) {
        logmsg("dropping %zu bytes of a stale partial frame", buf_used(&s->in));
        buf_free(&s->in);
        s->discard = 0;
        s->resync = 1;
    }
}

/* ---- opening -------------------------------------------------------- */

void session_open_fd(struct session *s, int fd)
{
    memset(s, 0, sizeof(*s));
    s->in_fd = s->out_fd = fd;
    s->connected = 1;
    snprintf(s->name, sizeof(s->name), "fd%d", fd);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    fcntl(fd, F_SETFD, FD_CLOEXEC);
}

/* Every virtio-serial port named sandlot.* is one session. */
/* The kernel registers a virtio-serial device's ports one at a time, as the host
 * announces them after the device itself: a scan right after boot can find only
 * some. A host that is never answered on the port it connects to would time the
 * boot out, so the agent waits for the number of ports the host says it made
 * (sandlot.ports=N), or for one where it does not say. */
#define PORTS_WAIT_MS 5000

static int port_opened(const struct session *sessions, int n, const char *dev)
{
    for (int i = 0; i < n; i++) {
        if (!strcmp(sessions[i].dev, dev)) {
            return 1;
        }
    }
    return 0;
}

int open_ports(struct session *sessions, int max, int want)
{
    int n = 0;
    want = want < 1 ? 1 : want > max ? max : want;
    for (int waited = 0; waited < PORTS_WAIT_MS && n < want; waited += 5) {
        DIR *d = opendir("/sys/class/virtio-ports");
        struct dirent *de;
        while (d && (de = readdir(d)) && n < max) {
            if (strncmp(de->d_name, "vport", 5)) {
                continue;
            }
            char path[300], name[64] = {0}, dev[300];
            snprintf(dev, sizeof(dev), "/dev/%s", de->d_name);
            if (port_opened(sessions, n, dev)) {
                continue;
            }
            snprintf(path, sizeof(path), "/sys/class/virtio-ports/%s/name", de->d_name);
            if (read_sys(path, name, sizeof(name)) < 0) {
                continue; /* registered, not named yet: the next scan sees it */
            }
            if (strncmp(name, "sandlot.", 8)) {
                continue;
            }
            struct session *s = &sessions[n];
            memset(s, 0, sizeof(*s));
            snprintf(s->name, sizeof(s->name), "%s", name);
            snprintf(s->dev, sizeof(s->dev), "%s", dev);
            if (wait_for(s->dev, 2000) < 0) {
                s->dev[0] = 0;
                continue;
            }
            int pfd = open(s->dev, O_RDWR | O_NONBLOCK | O_CLOEXEC);
            if (pfd < 0) {
                logmsg("open %s: %s", s->dev, strerror(errno));
                s->dev[0] = 0;
                continue;
            }
            /* SIGIO tells us when the host end connects or goes away */
            fcntl(pfd, F_SETOWN, getpid());
            fcntl(pfd, F_SETFL, fcntl(pfd, F_GETFL) | O_ASYNC);
            s->in_fd = s->out_fd = pfd;
            s->is_port = 1;
            n++;
        }
        if (d) {
            closedir(d);
        }
        if (n < want) {
            usleep(5000);
        }
    }
    if (n < want) {
        logmsg("only %d of the %d sandlot ports appeared", n, want);
    }
    return n;
}

/* A port whose host end is closed polls as POLLHUP forever, so it leaves the
 * poll set; SIGIO (O_ASYNC) and a slow timer bring it back. Returns whether the
 * port's host end came or went. */
int port_check(struct session *s)
{
    struct pollfd pfd = {.fd = s->in_fd, .events = POLLIN};
    if (poll(&pfd, 1, 0) < 0) {
        return 0;
    }
    int up = !(pfd.revents & POLLHUP);
    if (up && !s->connected) {
        s->connected = 1;
        s->hello_done = 0;
        return 1;
    }
    if (!up && s->connected) {
        session_disconnected(s);
        return 1;
    }
    return 0;
}

/* ---- listeners (a container's init: no virtio-serial ports) ---------- */

/* Port N is the Unix socket DIR/port.N. It takes one host at a time, as a
 * virtio-serial port does: a new connection replaces the one before (a host that
 * died without closing, or one reconnecting after a restore), and the host's
 * kept channels follow it, as they follow a port's reconnection. */
int open_listeners(struct session *sessions, int max, const char *dir, int want)
{
    int n = 0;
    want = want < 1 ? 1 : want > max ? max : want;
    mkdir(dir, 0700);
    for (int i = 0; i < want; i++) {
        struct sockaddr_un un;
        memset(&un, 0, sizeof(un));
        un.sun_family = AF_UNIX;
        int len = snprintf(un.sun_path, sizeof(un.sun_path), "%s/port.%d", dir, i);
        if (len < 0 || (size_t)len >= sizeof(un.sun_path)) {
            logmsg("listen: %s is too long a directory", dir);
            break;
        }
        unlink(un.sun_path);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0 || bind(fd, (struct sockaddr *)&un, sizeof(un)) < 0 || listen(fd, 4) < 0) {
            logmsg("listen %s: %s", un.sun_path, strerror(errno));
            if (fd >= 0) {
                close(fd);
            }
            break;
        }
        struct session *s = &sessions[n++];
        memset(s, 0, sizeof(*s));
        snprintf(s->name, sizeof(s->name), "sandlot.%d", i);
        s->in_fd = s->out_fd = -1;
        s->listen_fd = fd;
    }
    return n;
}

void listener_accept(struct session *s)
{
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
        return;
    }
    if (s->connected) {
        session_disconnected(s);
    } else if (s->in_fd >= 0) {
        close(s->in_fd);
    }
    s->in_fd = s->out_fd = fd;
    s->connected = 1;
    s->hello_done = 0;
    s->discard = 0;
    s->resync = 0;
}
