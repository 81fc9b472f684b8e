/* Output streams: bytes a channel reads from a descriptor (a process's stdout,
 * a file) and sends to the host within the host's window, keeping what is not
 * yet acknowledged so that a reconnected host can have it again. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent.h"

size_t g_ring_bytes;

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
        if (r) {
            g_ring_bytes += cap - o->ring_cap;
            o->ring = r;
            o->ring_cap = cap;
        } else if (o->ring_cap > held) {
            want = o->ring_cap - held; /* no memory to grow: read into the room there is */
        } else {
            return 0; /* none: a later ACK frees some */
        }
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
    if (!session_live(s) || !s->hello_done || c->awaiting_resume) {
        return;
    }
    while (o->sent < o->end && !session_congested(s)) {
        size_t n = (size_t)(o->end - o->sent);
        if (n > SL_DATA_CHUNK) {
            n = SL_DATA_CHUNK;
        }
        o->stalled = send_data(s, c->id, stream, o->sent, o->ring + (o->sent - o->acked), n) < 0;
        if (o->stalled) {
            return; /* out of memory: the ring keeps it, a pump soon sends it */
        }
        o->sent += n;
    }
    if (o->eof && o->sent == o->end && !o->eof_sent) {
        o->stalled = send_eof(s, c->id, stream, o->end) < 0;
        o->eof_sent = !o->stalled;
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

#define STALLED_RETRY_MS 50

int ostream_wait(const struct ostream *o, struct chan_wait *w, int slot, int *timeout_ms)
{
    if (o->stalled && *timeout_ms > STALLED_RETRY_MS) {
        *timeout_ms = STALLED_RETRY_MS;
    }
    if (!ostream_can_read(o)) {
        return 0;
    }
    if (o->is_file) {
        *timeout_ms = 0;
        return 0;
    }
    *w = (struct chan_wait){.fd = o->fd, .events = POLLIN, .slot = slot};
    return 1;
}
