/* Byte buffers and the TLV payload format (docs/protocol.md, "Payloads"). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"

int buf_reserve(struct buf *b, size_t extra)
{
    if (b->head > 0 && b->head == b->len) {
        b->head = b->len = 0;
    }
    if (b->len + extra <= b->cap) {
        return 0;
    }
    if (b->head > 0) { /* compact before growing */
        memmove(b->data, b->data + b->head, b->len - b->head);
        b->len -= b->head;
        b->head = 0;
        if (b->len + extra <= b->cap) {
            return 0;
        }
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) {
        cap *= 2;
    }
    uint8_t *d = realloc(b->data, cap);
    if (!d) {
        return -1;
    }
    b->data = d;
    b->cap = cap;
    return 0;
}

int buf_append(struct buf *b, const void *p, size_t n)
{
    if (n == 0) {
        return 0;
    }
    if (buf_reserve(b, n) < 0) {
        return -1;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

void buf_consume(struct buf *b, size_t n)
{
    b->head += n;
    if (b->head >= b->len) {
        b->head = b->len = 0;
    }
}

size_t buf_used(const struct buf *b) { return b->len - b->head; }

void buf_free(struct buf *b)
{
    free(b->data);
    memset(b, 0, sizeof(*b));
}

/* Empty, keeping a buffer of a session's usual size for the next host: under TCG
 * allocating it again cost each connection (every pool claim's) ~2.5 ms of the guest's
 * time. A buffer grown for a large frame is given back. */
#define BUF_KEEP (256 * 1024)
void buf_reset(struct buf *b)
{
    if (b->cap > BUF_KEEP) {
        buf_free(b);
        return;
    }
    b->head = b->len = 0;
}

/* A TLV item is tag u16, length u32, then length bytes. */
#define TLV_HDR 6u

void tlv_begin(struct tlv_iter *it, const uint8_t *p, size_t n)
{
    it->p = p;
    it->left = n;
}

/* 1: item, 0: end, -1: malformed */
int tlv_next(struct tlv_iter *it, struct tlv *out)
{
    if (it->left == 0) {
        return 0;
    }
    if (it->left < TLV_HDR) {
        return -1;
    }
    uint32_t len = rd32(it->p + 2);
    if (len > it->left - TLV_HDR) {
        return -1;
    }
    out->tag = rd16(it->p);
    out->len = len;
    out->val = it->p + TLV_HDR;
    it->p += TLV_HDR + len;
    it->left -= TLV_HDR + len;
    return 1;
}

int tlv_valid(const uint8_t *p, size_t n)
{
    struct tlv_iter it;
    struct tlv t;
    int r;
    tlv_begin(&it, p, n);
    while ((r = tlv_next(&it, &t)) == 1) {
    }
    return r == 0;
}

int tlv_bytes(const uint8_t *p, size_t n, uint16_t tag, const uint8_t **val, uint32_t *len)
{
    struct tlv_iter it;
    struct tlv t;
    tlv_begin(&it, p, n);
    while (tlv_next(&it, &t) == 1) {
        if (t.tag == tag) {
            *val = t.val;
            *len = t.len;
            return 1;
        }
    }
    return 0;
}

int tlv_u32(const uint8_t *p, size_t n, uint16_t tag, uint32_t *out)
{
    const uint8_t *v;
    uint32_t len;
    if (!tlv_bytes(p, n, tag, &v, &len)) {
        return 0;
    }
    if (len != 4) {
        return -1;
    }
    *out = rd32(v);
    return 1;
}

int tlv_u64(const uint8_t *p, size_t n, uint16_t tag, uint64_t *out)
{
    const uint8_t *v;
    uint32_t len;
    if (!tlv_bytes(p, n, tag, &v, &len)) {
        return 0;
    }
    if (len != 8) {
        return -1;
    }
    *out = rd64(v);
    return 1;
}

int tlv_str(const uint8_t *p, size_t n, uint16_t tag, char **out)
{
    const uint8_t *v;
    uint32_t len;
    *out = NULL;
    if (!tlv_bytes(p, n, tag, &v, &len)) {
        return 0;
    }
    if (memchr(v, 0, len)) {
        return -1;
    }
    char *s = malloc((size_t)len + 1);
    if (!s) {
        return -1;
    }
    memcpy(s, v, len);
    s[len] = 0;
    *out = s;
    return 1;
}

void msg_init(struct msg *m) { memset(m, 0, sizeof(*m)); }

void msg_free(struct msg *m)
{
    free(m->data);
    memset(m, 0, sizeof(*m));
}

void msg_put(struct msg *m, uint16_t tag, const void *val, uint32_t len)
{
    size_t need = m->len + TLV_HDR + len;
    if (m->overflow) {
        return;
    }
    if (need > SL_MAX_PAYLOAD) {
        m->overflow = MSG_TOO_BIG;
        return;
    }
    if (need > m->cap) {
        size_t cap = m->cap ? m->cap : 256;
        while (cap < need) {
            cap *= 2;
        }
        uint8_t *d = realloc(m->data, cap);
        if (!d) {
            m->overflow = MSG_NO_MEMORY;
            return;
        }
        m->data = d;
        m->cap = cap;
    }
    wr16(m->data + m->len, tag);
    wr32(m->data + m->len + 2, len);
    if (len) {
        memcpy(m->data + m->len + TLV_HDR, val, len);
    }
    m->len = need;
}

void msg_u32(struct msg *m, uint16_t tag, uint32_t v)
{
    uint8_t b[4];
    wr32(b, v);
    msg_put(m, tag, b, 4);
}

void msg_u64(struct msg *m, uint16_t tag, uint64_t v)
{
    uint8_t b[8];
    wr64(b, v);
    msg_put(m, tag, b, 8);
}

void msg_str(struct msg *m, uint16_t tag, const char *s) { msg_put(m, tag, s, (uint32_t)strlen(s)); }
