/* File channels: streamed read and write, directory listing, and one-shot
 * file-system requests (stat, mkdir, remove, rename, chmod, chown). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "agent.h"

#define ENTRY_FIXED 36u
#define LIST_BATCH (256u * 1024u)
#define MAX_TREE_DEPTH 4096

static unsigned g_tmp_counter;

static const struct channel_ops read_ops, write_ops, list_ops;

/* A request's payload must be well-formed TLV, and its paths absolute,
 * NUL-free and shorter than PATH_MAX. */
static int get_path(struct session *s, uint32_t ch, uint8_t type, const uint8_t *p, size_t n, uint16_t tag,
                    char **out)
{
    *out = NULL;
    if (!tlv_valid(p, n)) {
        send_error(s, ch, EINVAL, type, "malformed payload");
        return -1;
    }
    int r = tlv_str(p, n, tag, out);
    if (r != 1) {
        send_error(s, ch, EINVAL, type, r == 0 ? "a path is required" : "path holds a NUL byte");
        return -1;
    }
    if ((*out)[0] != '/' || strlen(*out) >= PATH_MAX) {
        send_error(s, ch, EINVAL, type, "path must be absolute and shorter than %d bytes", PATH_MAX);
        free(*out);
        *out = NULL;
        return -1;
    }
    return 0;
}

#define XATTR_LIST_MAX_BYTES 65536u
#define XATTR_VALUE_MAX_BYTES 65536u

/* The extended attributes of ``path`` (the link itself unless ``follow``) whose names start
 * with ``prefix``, as SL_FS_XATTRS puts them after an entry: u16 count, then for each
 * u16 name length, u32 value length, name, value. Appended to ``b``; what cannot be read
 * (no support on the file system, a value too large) is left out, and so is all of it
 * where memory runs out (a count of none). */
static void put_xattrs(struct buf *b, const char *path, int follow, const char *prefix)
{
    uint8_t count[2] = {0, 0};
    if (buf_append(b, count, 2) < 0) {
        return;
    }
    char *names = malloc(XATTR_LIST_MAX_BYTES);
    uint8_t *value = malloc(XATTR_VALUE_MAX_BYTES);
    ssize_t n = -1;
    if (names && value) {
        n = follow ? listxattr(path, names, XATTR_LIST_MAX_BYTES) : llistxattr(path, names, XATTR_LIST_MAX_BYTES);
    }
    uint16_t found = 0;
    size_t pl = strlen(prefix);
    for (ssize_t i = 0; n > 0 && i < n && found < 65535; i += (ssize_t)strlen(names + i) + 1) {
        const char *name = names + i;
        size_t nl = strlen(name);
        if (nl > 65535 || strncmp(name, prefix, pl) != 0) {
            continue;
        }
        ssize_t vl = follow ? getxattr(path, name, value, XATTR_VALUE_MAX_BYTES)
                            : lgetxattr(path, name, value, XATTR_VALUE_MAX_BYTES);
        if (vl < 0) {
            continue;
        }
        uint8_t head[6];
        wr16(head, (uint16_t)nl);
        wr32(head + 2, (uint32_t)vl);
        if (buf_append(b, head, 6) < 0 || buf_append(b, name, nl) < 0 || buf_append(b, value, (size_t)vl) < 0) {
            b->len = 2;
            found = 0;
            break;
        }
        found++;
    }
    free(names);
    free(value);
    wr16(b->data, found);
}

static void put_entry(struct msg *m, const char *name, const struct stat *st, const char *target,
                      const char *xpath, int follow, const char *xprefix)
{
    size_t nl = strlen(name), tl = target ? strlen(target) : 0;
    if (nl > 65535) {
        nl = 65535;
    }
    if (tl > 65535) {
        tl = 65535;
    }
    struct buf x = {0};
    if (xprefix) {
        put_xattrs(&x, xpath, follow, xprefix);
    }
    uint8_t *e = malloc(ENTRY_FIXED + nl + tl + x.len);
    if (!e) {
        buf_free(&x);
        m->overflow = MSG_NO_MEMORY;
        return;
    }
    wr_stat_head(e, st);
    wr16(e + 32, (uint16_t)nl);
    wr16(e + 34, (uint16_t)tl);
    memcpy(e + ENTRY_FIXED, name, nl);
    if (tl) {
        memcpy(e + ENTRY_FIXED + nl, target, tl);
    }
    if (x.len) {
        memcpy(e + ENTRY_FIXED + nl + tl, x.data, x.len);
    }
    msg_put(m, SL_T_ENTRY, e, (uint32_t)(ENTRY_FIXED + nl + tl + x.len));
    free(e);
    buf_free(&x);
}

/* SETXATTRS: ``path``'s attributes named ``prefix``... become those given (SL_T_XATTR,
 * repeated): the others of that prefix are removed. 0, or -1 with errno. */
static int set_xattrs(const char *path, const char *prefix, const uint8_t *p, size_t n)
{
    size_t pl = strlen(prefix);
    struct tlv_iter it;
    struct tlv t;
    char name[65536 + 1];
    tlv_begin(&it, p, n);
    while (tlv_next(&it, &t) == 1) { /* every one well formed before any is set */
        if (t.tag != SL_T_XATTR) {
            continue;
        }
        if (t.len < 2 || rd16(t.val) + 2u > t.len || rd16(t.val) == 0 || rd16(t.val) <= pl ||
            memchr(t.val + 2, 0, rd16(t.val)) || strncmp((const char *)t.val + 2, prefix, pl) != 0) {
            errno = EINVAL;
            return -1;
        }
    }
    char *names = malloc(XATTR_LIST_MAX_BYTES);
    if (!names) {
        return -1;
    }
    ssize_t have = listxattr(path, names, XATTR_LIST_MAX_BYTES);
    for (ssize_t i = 0; have > 0 && i < have; i += (ssize_t)strlen(names + i) + 1) {
        if (strncmp(names + i, prefix, pl) == 0 && removexattr(path, names + i) < 0 && errno != ENODATA) {
            int e = errno;
            free(names);
            errno = e;
            return -1;
        }
    }
    free(names);
    if (have < 0 && errno != ENOTSUP && errno != ENODATA) {
        return -1;
    }
    tlv_begin(&it, p, n);
    while (tlv_next(&it, &t) == 1) {
        if (t.tag != SL_T_XATTR) {
            continue;
        }
        uint16_t nl = rd16(t.val);
        memcpy(name, t.val + 2, nl);
        name[nl] = 0;
        if (setxattr(path, name, t.val + 2 + nl, t.len - 2u - nl, 0) < 0) {
            return -1;
        }
    }
    return 0;
}

char *read_link_at(int dirfd, const char *name)
{
    char buf[PATH_MAX];
    ssize_t n = readlinkat(dirfd, name, buf, sizeof(buf) - 1);
    if (n < 0) {
        return NULL;
    }
    buf[n] = 0;
    return strdup(buf);
}

/* ---- read -------------------------------------------------------------------- */

void file_read_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n)
{
    char *path = NULL;
    uint64_t offset = 0, length = 0;
    if (get_path(s, ch, SL_FILE_READ, p, n, SL_T_PATH, &path) < 0) {
        return;
    }
    if (tlv_u64(p, n, SL_T_OFFSET, &offset) < 0 || tlv_u64(p, n, SL_T_LENGTH, &length) < 0) {
        send_error(s, ch, EINVAL, SL_FILE_READ, "offset and length are u64");
        free(path);
        return;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) {
        int e = errno;
        if (fd >= 0) {
            close(fd);
        }
        send_error(s, ch, e, SL_FILE_READ, "%s: %s", path, strerror(e));
        free(path);
        return;
    }
    int regular = S_ISREG(st.st_mode);
    if (S_ISDIR(st.st_mode) || (!regular && !S_ISCHR(st.st_mode)) || (!regular && length == 0)) {
        close(fd);
        int e = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        send_error(s, ch, e, SL_FILE_READ, "%s: %s", path,
                   e == EISDIR ? "is a directory" : "not a regular file (devices need a length)");
        free(path);
        return;
    }
    if (offset && lseek(fd, (off_t)offset, SEEK_SET) < 0) {
        int e = errno;
        close(fd);
        send_error(s, ch, e, SL_FILE_READ, "%s: seek: %s", path, strerror(e));
        free(path);
        return;
    }
    free(path);
    struct channel *c = chan_new(s, ch, &read_ops);
    if (!c) {
        close(fd);
        send_error(s, ch, errno, SL_FILE_READ, "cannot open a channel: %s", strerror(errno));
        return;
    }
    struct ostream *o = &c->u.read.out;
    ostream_init(o, fd, regular);
    o->limit = length;
    if (regular) {
        int fl = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    }
    struct msg m;
    msg_init(&m);
    msg_u64(&m, SL_T_SIZE, (uint64_t)st.st_size);
    msg_u32(&m, SL_T_MODE, st.st_mode);
    send_msg(s, SL_FILE_INFO, 0, ch, &m);
}

int g_read_idle_ms = 600000;

/* A read the host neither acknowledges nor closes (its client died while the session
 * lived on, in a server) would hold its descriptor and buffer for as long as the
 * session lives: after g_read_idle_ms without an ACK it is closed, with an error the
 * host sees should it come back. */
static int read_reclaimed(struct channel *c, uint64_t now)
{
    struct file_read_channel *r = &c->u.read;
    if (r->out.acked != r->acked_seen || r->active_ms == 0) {
        r->acked_seen = r->out.acked;
        r->active_ms = now;
        return 0;
    }
    if (now - r->active_ms < (uint64_t)g_read_idle_ms) {
        return 0;
    }
    send_error(c->s, c->id, ETIMEDOUT, SL_FILE_READ, "file read closed: untouched for %d s", g_read_idle_ms / 1000);
    chan_free(c);
    return 1;
}

static void read_progress(struct channel *c)
{
    if (read_reclaimed(c, now_ms())) {
        return;
    }
    struct ostream *o = &c->u.read.out;
    for (int i = 0; i < 8 && o->is_file && ostream_can_read(o); i++) {
        if (ostream_fill(o) <= 0) {
            break;
        }
        ostream_pump(c, SL_STREAM_STDOUT, o);
    }
    ostream_pump(c, SL_STREAM_STDOUT, o);
}

static void read_release(struct channel *c) { ostream_close(&c->u.read.out); }

static int read_wait(struct channel *c, struct chan_wait *w, uint64_t now, int *timeout_ms)
{
    struct file_read_channel *r = &c->u.read;
    uint64_t due = r->active_ms + (uint64_t)g_read_idle_ms;
    int left = due > now ? (int)(due - now) : 0;
    if (r->active_ms && left < *timeout_ms) {
        *timeout_ms = left;
    }
    return ostream_wait(&r->out, w, SL_STREAM_STDOUT, timeout_ms);
}

static void read_ready(struct channel *c, int slot) { ostream_fill(&c->u.read.out); }

static struct ostream *read_output(struct channel *c, uint32_t stream)
{
    return stream == SL_STREAM_STDOUT ? &c->u.read.out : NULL;
}

static const struct channel_ops read_ops = {
    .name = "file read",
    .release = read_release,
    .progress = read_progress,
    .wait = read_wait,
    .ready = read_ready,
    .output = read_output,
};

/* ---- write ------------------------------------------------------------------- */

static int mkdir_parents(const char *path, mode_t mode, int own, uid_t uid, gid_t gid)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof(tmp), "%s", path);
    size_t len = strlen(tmp);
    while (len > 1 && tmp[len - 1] == '/') {
        tmp[--len] = 0;
    }
    for (char *q = tmp + 1;; q++) {
        if (*q == '/' || *q == 0) {
            char save = *q;
            *q = 0;
            if (mkdir(tmp, mode) == 0) {
                if (own && chown(tmp, uid, gid) < 0) {
                    return -1;
                }
            } else if (errno != EEXIST) {
                return -1;
            } else {
                struct stat st;
                if (stat(tmp, &st) < 0) {
                    return -1;
                }
                if (!S_ISDIR(st.st_mode)) {
                    errno = ENOTDIR;
                    return -1;
                }
            }
            *q = save;
            if (!save) {
                break;
            }
        }
    }
    return 0;
}

static int get_owner(struct session *s, uint32_t ch, uint8_t type, const uint8_t *p, size_t n, uid_t *uid,
                     gid_t *gid)
{
    char *spec = NULL;
    int r = tlv_str(p, n, SL_T_USER, &spec);
    if (r < 0) {
        send_error(s, ch, EINVAL, type, "user holds a NUL byte");
        return -1;
    }
    if (r == 0) {
        return 0;
    }
    struct user_spec u;
    char err[300];
    if (resolve_user(spec, &u, err, sizeof(err)) < 0) {
        send_error(s, ch, ENOENT, type, "%s", err);
        free(spec);
        return -1;
    }
    free(spec);
    *uid = u.uid;
    *gid = u.gid;
    return 1;
}

void file_write_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n)
{
    char *path = NULL;
    uint32_t mode = 0, flags = 0;
    if (get_path(s, ch, SL_FILE_WRITE, p, n, SL_T_PATH, &path) < 0) {
        return;
    }
    int has_mode = tlv_u32(p, n, SL_T_MODE, &mode);
    if (has_mode < 0 || tlv_u32(p, n, SL_T_FLAGS, &flags) < 0 || mode > 07777) {
        send_error(s, ch, EINVAL, SL_FILE_WRITE, "malformed mode or flags");
        free(path);
        return;
    }
    if (g_safe_mode) {
        send_error(s, ch, EPERM, SL_FILE_WRITE, "writes are disabled in safe mode");
        free(path);
        return;
    }
    uid_t uid = 0;
    gid_t gid = 0;
    int own = get_owner(s, ch, SL_FILE_WRITE, p, n, &uid, &gid);
    if (own < 0) {
        free(path);
        return;
    }
    char *slash = strrchr(path, '/');
    if (slash[1] == 0) {
        send_error(s, ch, EISDIR, SL_FILE_WRITE, "%s: path names a directory", path);
        free(path);
        return;
    }
    if (flags & SL_WRITE_PARENTS) {
        *slash = 0;
        int r = slash == path ? 0 : mkdir_parents(path, 0755, own, uid, gid);
        *slash = '/';
        if (r < 0) {
            int e = errno;
            send_error(s, ch, e, SL_FILE_WRITE, "%s: cannot create parent directories: %s", path, strerror(e));
            free(path);
            return;
        }
    }
    /* Write through a symlink to its target, as open() would. */
    struct stat st;
    int exists = stat(path, &st) == 0;
    if (exists) {
        char *real = realpath(path, NULL);
        if (real) {
            free(path);
            path = real;
        }
        if (S_ISDIR(st.st_mode)) {
            send_error(s, ch, EISDIR, SL_FILE_WRITE, "%s: is a directory", path);
            free(path);
            return;
        }
        if (flags & SL_WRITE_EXCLUSIVE) {
            send_error(s, ch, EEXIST, SL_FILE_WRITE, "%s: file exists", path);
            free(path);
            return;
        }
    }
    struct channel *c = chan_new(s, ch, &write_ops);
    if (!c) {
        send_error(s, ch, errno, SL_FILE_WRITE, "cannot open a channel: %s", strerror(errno));
        free(path);
        return;
    }
    struct file_write_channel *w = &c->u.write;
    w->fd = -1;
    w->flags = flags;
    w->final_path = path;
    w->mode = has_mode == 1 ? mode : (exists ? (st.st_mode & 07777) : 0644);
    w->mode_set = 1; /* the temporary is created 0600: always give the file its real mode */
    w->own_set = own || exists;
    w->uid = own ? uid : (exists ? st.st_uid : 0);
    w->gid = own ? gid : (exists ? st.st_gid : 0);
    if (flags & SL_WRITE_APPEND) {
        w->fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY, w->mode);
    } else {
        /* Whole-file writes go to a temporary beside the target and are renamed
         * into place at EOF: readers never see half a file, and an aborted
         * transfer leaves the old file untouched. */
        size_t len = strlen(path) + 64;
        w->tmp_path = malloc(len);
        if (w->tmp_path) {
            char *base = strrchr(path, '/') + 1;
            snprintf(w->tmp_path, len, "%.*s.%s.sandlot-%u", (int)(base - path), path, base,
                     ++g_tmp_counter);
            if (strlen(w->tmp_path) >= PATH_MAX || strlen(base) > 200) {
                snprintf(w->tmp_path, len, "%.*s.sandlot-write-%u", (int)(base - path), path, g_tmp_counter);
            }
            w->fd = open(w->tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600);
        }
    }
    if (w->fd < 0) {
        int e = w->tmp_path || (flags & SL_WRITE_APPEND) ? errno : ENOMEM;
        if (w->tmp_path) {
            send_error(s, ch, e, SL_FILE_WRITE, "%s: cannot create a temporary file beside it: %s", path,
                       strerror(e));
        } else {
            send_error(s, ch, e, SL_FILE_WRITE, "%s: %s", path, strerror(e));
        }
        free(w->tmp_path);
        w->tmp_path = NULL;
        chan_free(c);
        return;
    }
    struct msg m;
    msg_init(&m);
    msg_u32(&m, SL_T_WINDOW, SL_WINDOW);
    send_msg(s, SL_FILE_READY, 0, ch, &m);
}

/* Also how a transfer that did not finish is aborted: the temporary goes, the
 * target stays as it was. */
static void write_release(struct channel *c)
{
    struct file_write_channel *w = &c->u.write;
    if (w->fd >= 0) {
        close(w->fd);
        w->fd = -1;
    }
    if (w->tmp_path) {
        unlink(w->tmp_path);
        free(w->tmp_path);
        w->tmp_path = NULL;
    }
    free(w->final_path);
}

static void write_fail(struct channel *c, int e, const char *what)
{
    send_error(c->s, c->id, e, SL_FILE_WRITE, "%s: %s: %s", c->u.write.final_path, what, strerror(e));
    chan_free(c); /* aborts: the temporary goes, the target stays as it was */
}

static void file_write_data(struct channel *c, uint64_t off, const uint8_t *d, size_t n)
{
    struct file_write_channel *w = &c->u.write;
    if (off > w->bytes) {
        write_fail(c, EINVAL, "data gap");
        return;
    }
    size_t skip = (size_t)(w->bytes - off);
    if (skip >= n) {
        return; /* a resend of bytes already written */
    }
    d += skip;
    n -= skip;
    if (w->bytes + n - w->acked > SL_WINDOW) {
        write_fail(c, ENOBUFS, "data beyond the window");
        return;
    }
    while (n) {
        ssize_t k = write(w->fd, d, n);
        if (k < 0) {
            if (errno == EINTR) {
                continue;
            }
            write_fail(c, errno, "write");
            return;
        }
        d += k;
        n -= (size_t)k;
        w->bytes += (uint64_t)k;
    }
    if (w->bytes - w->acked >= SL_WINDOW / 4) {
        send_ack(c->s, c->id, SL_STREAM_STDIN, w->bytes);
        w->acked = w->bytes;
    }
}

static void file_write_eof(struct channel *c, uint64_t off)
{
    struct file_write_channel *w = &c->u.write;
    if (off != w->bytes) {
        write_fail(c, EINVAL, "EOF offset does not match the bytes received");
        return;
    }
    if (w->mode_set && fchmod(w->fd, w->mode) < 0) {
        write_fail(c, errno, "chmod");
        return;
    }
    if (w->own_set && fchown(w->fd, w->uid, w->gid) < 0) {
        write_fail(c, errno, "chown");
        return;
    }
    if ((w->flags & SL_WRITE_SYNC) && fsync(w->fd) < 0) {
        write_fail(c, errno, "fsync");
        return;
    }
    if (close(w->fd) < 0) {
        w->fd = -1;
        write_fail(c, errno, "close");
        return;
    }
    w->fd = -1;
    if (w->tmp_path) {
        int r;
        if (w->flags & SL_WRITE_EXCLUSIVE) {
            r = link(w->tmp_path, w->final_path);
            if (r == 0) {
                unlink(w->tmp_path);
            }
        } else {
            r = rename(w->tmp_path, w->final_path);
        }
        if (r < 0) {
            write_fail(c, errno, "rename into place");
            return;
        }
        free(w->tmp_path);
        w->tmp_path = NULL;
    }
    struct msg m;
    msg_init(&m);
    msg_u64(&m, SL_T_SIZE, w->bytes);
    send_msg(c->s, SL_FILE_DONE, 0, c->id, &m);
    chan_free(c);
}

static int write_input(struct channel *c, uint8_t type, uint64_t off, const uint8_t *d, size_t n)
{
    if (type == SL_DATA) {
        file_write_data(c, off, d, n);
    } else {
        file_write_eof(c, off);
    }
    return 0;
}

static void write_resume(struct channel *c) { send_ack(c->s, c->id, SL_STREAM_STDIN, c->u.write.bytes); }

static const struct channel_ops write_ops = {
    .name = "file write",
    .release = write_release,
    .input = write_input,
    .resume = write_resume,
};

/* ---- directory listing ------------------------------------------------------ */

static void list_release(struct channel *c)
{
    if (c->u.dir.dir) {
        closedir(c->u.dir.dir);
        c->u.dir.dir = NULL;
    }
    free(c->u.dir.xprefix);
    c->u.dir.xprefix = NULL;
}

static void list_progress(struct channel *c)
{
    struct session *s = c->s;
    DIR *dir = c->u.dir.dir;
    if (!dir || !s->connected || !s->hello_done || session_congested(s)) {
        return;
    }
    int dfd = dirfd(dir);
    struct msg m;
    msg_init(&m);
    struct dirent *de;
    int done = 0;
    while (m.len < LIST_BATCH) {
        errno = 0;
        de = readdir(dir);
        if (!de && errno) { /* not the end: a failure, which must not pass for one */
            int e = errno;
            msg_free(&m);
            send_error(s, c->id, e, SL_FS, "listing cut short: %s", strerror(e));
            chan_free(c);
            return;
        }
        if (!de) {
            done = 1;
            break;
        }
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) {
            continue;
        }
        struct stat st;
        if (fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            continue; /* removed while listing */
        }
        char *target = S_ISLNK(st.st_mode) ? read_link_at(dfd, de->d_name) : NULL;
        char xpath[64 + NAME_MAX];
        if (c->u.dir.xprefix) { /* the entry by the listing's open directory, as it was opened */
            snprintf(xpath, sizeof(xpath), "/proc/self/fd/%d/%s", dfd, de->d_name);
        }
        put_entry(&m, de->d_name, &st, target, xpath, 0, c->u.dir.xprefix);
        free(target);
    }
    send_msg(s, SL_FS_RESULT, done ? 0 : SL_FLAG_MORE, c->id, &m);
    if (done) {
        chan_free(c);
    }
}

/* Another batch is due as soon as the session takes more output. */
int batch_wait(struct channel *c, struct chan_wait *w, uint64_t now, int *timeout_ms)
{
    if (c->s->connected && !session_congested(c->s)) {
        *timeout_ms = 0;
    }
    return 0;
}

/* A batched answer is restarted by the host, not resumed. */
int batch_disconnected(struct channel *c) { return 0; }

static const struct channel_ops list_ops = {
    .name = "directory listing",
    .release = list_release,
    .progress = list_progress,
    .wait = batch_wait,
    .disconnected = batch_disconnected,
};

/* ---- one-shot requests ------------------------------------------------------ */

int open_dir_nofollow(int dirfd, const char *name)
{
    int p = openat(dirfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (p < 0) {
        return -1;
    }
    struct stat st;
    int fd = -1;
    if (fstat(p, &st) < 0) {
        /* errno says why */
    } else if (!S_ISDIR(st.st_mode)) {
        errno = S_ISLNK(st.st_mode) ? ELOOP : ENOTDIR;
    } else {
        fd = openat(p, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* the very directory looked at */
    }
    int e = errno;
    close(p);
    errno = e;
    return fd;
}

static int remove_tree(int dirfd, const char *name, int depth)
{
    if (depth > MAX_TREE_DEPTH) {
        errno = ELOOP;
        return -1;
    }
    int fd = open_dir_nofollow(dirfd, name);
    if (fd < 0) {
        return -1;
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return -1;
    }
    struct dirent *de;
    int r = 0;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) {
            continue;
        }
        struct stat st;
        if (fstatat(fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            continue;
        }
        if (S_ISDIR(st.st_mode)) {
            r = remove_tree(fd, de->d_name, depth + 1);
        } else {
            r = unlinkat(fd, de->d_name, 0);
        }
        if (r < 0 && errno != ENOENT) {
            int e = errno;
            closedir(d);
            errno = e;
            return -1;
        }
    }
    closedir(d);
    return unlinkat(dirfd, name, AT_REMOVEDIR);
}

int remove_tree_at(int dirfd, const char *name)
{
    struct stat st;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
        return errno == ENOENT ? 0 : -1;
    }
    return S_ISDIR(st.st_mode) ? remove_tree(dirfd, name, 0) : unlinkat(dirfd, name, 0);
}

static int is_mutation(uint32_t op) { return op != SL_FS_STAT && op != SL_FS_LIST && op != SL_FS_TREE; }

void fs_request(struct session *s, uint32_t ch, const uint8_t *p, size_t n)
{
    uint32_t op = 0, flags = 0, mode = 0;
    char *path = NULL, *path2 = NULL, *xprefix = NULL;
    if (!tlv_valid(p, n) || tlv_u32(p, n, SL_T_OP, &op) != 1 || tlv_u32(p, n, SL_T_FLAGS, &flags) < 0) {
        send_error(s, ch, EINVAL, SL_FS, "malformed FS request");
        return;
    }
    if (op < SL_FS_STAT || op > SL_FS_SETXATTRS) {
        send_error(s, ch, ENOSYS, SL_FS, "unknown file-system operation %u", op);
        return;
    }
    if (get_path(s, ch, SL_FS, p, n, SL_T_PATH, &path) < 0) {
        return;
    }
    if (((flags & SL_FS_XATTRS) || op == SL_FS_SETXATTRS) && tlv_str(p, n, SL_T_PREFIX, &xprefix) != 1) {
        send_error(s, ch, EINVAL, SL_FS, "extended attributes need a prefix of their names (no NUL)");
        goto out;
    }
    if (g_safe_mode && is_mutation(op)) {
        send_error(s, ch, EPERM, SL_FS, "changes are disabled in safe mode");
        goto out;
    }
    struct stat st;
    struct msg m;
    msg_init(&m);
    int r = 0;
    switch (op) {
    case SL_FS_STAT:
        r = (flags & SL_FS_NOFOLLOW) ? lstat(path, &st) : stat(path, &st);
        if (r == 0) {
            const char *base = strrchr(path, '/') + 1;
            char *target = NULL;
            if (S_ISLNK(st.st_mode)) {
                target = read_link_at(AT_FDCWD, path);
            }
            put_entry(&m, *base ? base : "/", &st, target, path, !(flags & SL_FS_NOFOLLOW),
                      (flags & SL_FS_XATTRS) ? xprefix : NULL);
            free(target);
        }
        break;
    case SL_FS_LIST: {
        DIR *d = opendir(path);
        if (!d) {
            r = -1;
            break;
        }
        struct channel *c = chan_new(s, ch, &list_ops);
        if (!c) {
            int e = errno;
            closedir(d);
            errno = e;
            r = -1;
            break;
        }
        c->u.dir.dir = d;
        if (flags & SL_FS_XATTRS) {
            c->u.dir.xprefix = xprefix;
            xprefix = NULL;
        }
        list_progress(c);
        msg_free(&m);
        goto out;
    }
    case SL_FS_SYMLINK: {
        char *target = NULL;
        int t = tlv_str(p, n, SL_T_TARGET, &target);
        if (t != 1 || !*target || strlen(target) >= PATH_MAX) {
            free(target);
            msg_free(&m);
            send_error(s, ch, EINVAL, SL_FS, "a symlink needs a target: non-empty, no NUL, under PATH_MAX");
            goto out;
        }
        r = symlink(target, path);
        free(target);
        break;
    }
    case SL_FS_MKNOD: {
        uint64_t rdev = 0;
        if (tlv_u32(p, n, SL_T_MODE, &mode) != 1 || tlv_u64(p, n, SL_T_RDEV, &rdev) < 0 ||
            !(S_ISFIFO(mode) || S_ISCHR(mode) || S_ISBLK(mode)) || (mode & ~(S_IFMT | 07777))) {
            errno = EINVAL;
            r = -1;
        } else {
            r = mknod(path, mode, (dev_t)rdev);
        }
        break;
    }
    case SL_FS_SETXATTRS:
        r = set_xattrs(path, xprefix, p, n);
        break;
    case SL_FS_TREE:
        r = tree_start(s, ch, path, flags & SL_FS_SELF);
        if (r == 0) {
            msg_free(&m);
            goto out;
        }
        break;
    case SL_FS_MKDIR: {
        uid_t uid = 0;
        gid_t gid = 0;
        int own = get_owner(s, ch, SL_FS, p, n, &uid, &gid);
        if (own < 0) {
            msg_free(&m);
            goto out;
        }
        if (tlv_u32(p, n, SL_T_MODE, &mode) != 1) {
            mode = 0755;
        }
        if (mode > 07777) {
            errno = EINVAL;
            r = -1;
        } else if (flags & SL_FS_PARENTS) {
            r = mkdir_parents(path, mode, own, uid, gid);
        } else {
            r = mkdir(path, mode);
            if (r == 0 && own) {
                r = chown(path, uid, gid);
            }
        }
        break;
    }
    case SL_FS_REMOVE:
        r = lstat(path, &st);
        if (r == 0) {
            if (!S_ISDIR(st.st_mode)) {
                r = unlink(path);
            } else if (flags & SL_FS_RECURSIVE) {
                r = remove_tree(AT_FDCWD, path, 0);
            } else {
                r = rmdir(path);
            }
        }
        if (r < 0 && errno == ENOENT && (flags & SL_FS_MISSING_OK)) {
            r = 0;
        }
        break;
    case SL_FS_RENAME:
        if (get_path(s, ch, SL_FS, p, n, SL_T_PATH2, &path2) < 0) {
            msg_free(&m);
            goto out;
        }
        r = rename(path, path2);
        break;
    case SL_FS_CHMOD:
        if (tlv_u32(p, n, SL_T_MODE, &mode) != 1 || mode > 07777) {
            errno = EINVAL;
            r = -1;
        } else {
            r = chmod(path, mode);
        }
        break;
    case SL_FS_CHOWN: {
        uid_t uid = 0;
        gid_t gid = 0;
        int own = get_owner(s, ch, SL_FS, p, n, &uid, &gid);
        if (own < 0) {
            msg_free(&m);
            goto out;
        }
        if (own == 0) {
            errno = EINVAL;
            r = -1;
        } else {
            r = (flags & SL_FS_NOFOLLOW) ? lchown(path, uid, gid) : chown(path, uid, gid);
        }
        break;
    }
    }
    if (r < 0) {
        int e = errno;
        msg_free(&m);
        send_error(s, ch, e, SL_FS, "%s: %s", path, strerror(e));
    } else {
        send_msg(s, SL_FS_RESULT, 0, ch, &m);
    }
out:
    free(path);
    free(path2);
    free(xprefix);
}
