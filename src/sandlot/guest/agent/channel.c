/* The channel table: every live channel of every session, whatever its kind.
 * What a channel does is its kind's business (struct channel_ops); this file
 * only adds, finds and frees them, and applies what happens to a session (a
 * dropped connection, a new host) to the channels on it. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>

#include "agent.h"

struct channel *g_channels;

/* A detached channel (its process runs on, unheard) no longer has an id a host can
 * use: the next connection numbers its channels from 1 again. */
struct channel *chan_find(struct session *s, uint32_t id)
{
    for (struct channel *c = g_channels; c; c = c->next) {
        if (c->s == s && c->id == id && !c->detached) {
            return c;
        }
    }
    return NULL;
}

struct channel *chan_new(struct session *s, uint32_t id, const struct channel_ops *ops)
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
    c->ops = ops;
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
    c->ops->release(c);
    if (c->s->nchannels) {
        c->s->nchannels--;
    }
    free(c);
}

/* An event gathered before this loop round began may be for a channel that an
 * earlier event of the round has freed. */
int chan_alive(const struct channel *c)
{
    const struct channel *x = g_channels;
    while (x && x != c) {
        x = x->next;
    }
    return x != NULL;
}

struct ostream *chan_output(struct channel *c, uint32_t stream)
{
    return c->ops->output ? c->ops->output(c, stream) : NULL;
}

/* The host is done with c: what runs on without a listener is detached, the
 * rest is freed. */
void chan_let_go(struct channel *c)
{
    if (c->ops->detach && c->ops->detach(c)) {
        c->detached = 1;
    } else {
        chan_free(c);
    }
}

void chan_disconnect_all(struct session *s)
{
    struct channel *c = g_channels, *next;
    for (; c; c = next) {
        next = c->next;
        if (c->s != s) {
            continue;
        }
        if (c->ops->disconnected && !c->ops->disconnected(c)) {
            chan_free(c);
            continue;
        }
        /* Nothing sent since the last ACK is known to have arrived: resend on RESUME,
         * and only then. Output sent before it would reach a new host ahead of the
         * RESUME that makes the channel its own; it would drop the bytes and take its
         * position from whatever frame came next (an EOF past them). */
        c->awaiting_resume = 1;
        for (uint32_t k = SL_STREAM_STDOUT; k <= SL_STREAM_STDERR; k++) {
            struct ostream *o = chan_output(c, k);
            if (o) {
                o->sent = o->acked;
                o->eof_sent = 0;
            }
        }
    }
}

/* A new host (not a reconnection of the last one) owns this session now: the
 * old host's channels keep their processes running but their output is dropped. */
void chan_orphan_all(struct session *s)
{
    struct channel *c = g_channels, *next;
    for (; c; c = next) {
        next = c->next;
        if (c->s == s) {
            chan_let_go(c);
        }
    }
}
