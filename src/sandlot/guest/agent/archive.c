/* Archives (SL_ARCHIVE): a directory tree of the guest as a tar stream, and a tar
 * stream unpacked into a directory of the guest, moved as `docker cp` moves them.
 *
 * A child process of the agent does the work with plain blocking calls, and the host
 * follows it as it follows a command (exec.c): READ writes the tar on its stdout,
 * WRITE reads it from its stdin; each reports in records (u32 length, then TLV fields)
 * on its other stream: stderr for READ, stdout for WRITE (docs/protocol.md, "Archives").
 *
 * Read. A link is carried as a link, whatever it points at (with FOLLOW, a link to a
 * file or directory inside the tree is carried as what it points to, and one that
 * leads out of the tree or nowhere is refused by name); files linked together go as
 * hard links; fifos and device nodes as what they are. Every entry is opened O_PATH
 * without following it, and only a regular file is then opened for reading, so no
 * fifo or device is ever opened. Sockets are skipped, each named in a global header of
 * the stream (SANDLOT.skip.N.path, .why). An entry that fails (a file that shrinks as it
 * is read) ends the stream with a global header naming it (SANDLOT.error.path, .errno,
 * .message) and no end-of-archive blocks, so that no reader takes the stream for whole.
 *
 * Write. Every member is made beneath a staging directory, each component of its path
 * opened without following a link (openat2 with RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS, or
 * an O_NOFOLLOW walk where the kernel has no openat2): a member under a link, one the
 * archive made or any other, a hard link to what the archive did not hold before it, a
 * name that is absolute or holds "..", is refused by name. Only a whole archive goes
 * into place: the staging directory is renamed to a destination that did not exist,
 * or merged into one that does as `docker cp` merges (a directory into a directory,
 * anything else replaced; a directory against a non-directory is refused before
 * anything moves). A failure leaves the destination as it was, but for a merge that
 * fails while it moves entries (the file system refused a rename): the entries moved
 * by then are reported (WRITTEN records). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

#define BLOCK 512u
#define ARC_PATH 32768u         /* the longest member name made or taken */
#define ARC_DEPTH 2048          /* directories deep */
#define PAX_MAX (1u << 20)      /* the largest extended header taken */
#define IO_BUF (1u << 16)

/* ---- what the child reports ------------------------------------------------------ */

static int g_report_fd = 2;
static struct {
    int set;
    int of_root; /* the tree's own path, not an entry of it (fail's entry NULL) */
    int err;
    char entry[4096];
    char message[1024];
} g_fail;

/* The first failure is the one reported; -1 for the caller to return. ``entry`` NULL:
 * the tree's own path failed (the host raises the guest's OS error for it). */
static int fail(const char *entry, int err, const char *fmt, ...)
{
    if (!g_fail.set) {
        g_fail.set = 1;
        g_fail.of_root = entry == NULL;
        g_fail.err = err ? err : EIO;
        snprintf(g_fail.entry, sizeof(g_fail.entry), "%s", entry ? entry : "");
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(g_fail.message, sizeof(g_fail.message), fmt, ap);
        va_end(ap);
    }
    return -1;
}

static int write_all(int fd, const void *p, size_t n)
{
    const uint8_t *d = p;
    while (n) {
        ssize_t k = write(fd, d, n);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) {
            return -1;
        }
        d += k;
        n -= (size_t)k;
    }
    return 0;
}

static void record(uint32_t kind, const char *entry, int err, const char *message, uint32_t count, uint64_t bytes)
{
    struct msg m;
    msg_init(&m);
    msg_u32(&m, SL_T_OP, kind);
    if (entry) {
        msg_str(&m, SL_T_PATH, entry);
    }
    if (err) {
        msg_u32(&m, SL_T_ERRNO, (uint32_t)err);
    }
    if (message) {
        msg_str(&m, SL_T_MESSAGE, message);
    }
    if (kind == SL_AR_DONE) {
        msg_u32(&m, SL_T_COUNT, count);
        msg_u64(&m, SL_T_SIZE, bytes);
    }
    if (!m.overflow) {
        uint8_t len[4];
        wr32(len, (uint32_t)m.len);
        if (write_all(g_report_fd, len, 4) == 0) {
            write_all(g_report_fd, m.data, m.len);
        }
    }
    msg_free(&m);
}

static void report_failure(void)
{
    if (!g_fail.set) {
        fail("", EIO, "failed");
    }
    record(SL_AR_FAILED, g_fail.of_root ? NULL : g_fail.entry, g_fail.err, g_fail.message, 0, 0);
}

/* ---- tar headers -------------------------------------------------------------------- */

struct out {
    int fd;
    size_t len;
    uint8_t *buf;
};

static int out_flush(struct out *o)
{
    if (o->len && write_all(o->fd, o->buf, o->len) < 0) {
        return fail("", errno ? errno : EPIPE, "cannot send the archive: %s", strerror(errno ? errno : EPIPE));
    }
    o->len = 0;
    return 0;
}

static int out_put(struct out *o, const void *p, size_t n)
{
    const uint8_t *d = p;
    while (n) {
        if (o->len == IO_BUF && out_flush(o) < 0) {
            return -1;
        }
        size_t k = IO_BUF - o->len < n ? IO_BUF - o->len : n;
        memcpy(o->buf + o->len, d, k);
        o->len += k;
        d += k;
        n -= k;
    }
    return 0;
}

static int out_zeros(struct out *o, uint64_t n)
{
    static const uint8_t zeros[BLOCK];
    while (n) {
        size_t k = n < BLOCK ? (size_t)n : BLOCK;
        if (out_put(o, zeros, k) < 0) {
            return -1;
        }
        n -= k;
    }
    return 0;
}

static void octal(char *field, size_t width, uint64_t v)
{
    field[width - 1] = 0;
    for (size_t i = width - 1; i-- > 0;) {
        field[i] = (char)('0' + (v & 7));
        v >>= 3;
    }
}

static int fits(uint64_t v, size_t width) { return v < ((uint64_t)1 << (3 * (width - 1))); }

/* One "LEN key=value\n" record of an extended header. */
static int pax_add(char *buf, size_t cap, size_t *at, const char *key, const char *val, size_t vlen)
{
    size_t body = 1 + strlen(key) + 1 + vlen + 1, digits = 1, total;
    for (;;) {
        total = body + digits;
        size_t d = 0;
        for (size_t t = total; t; t /= 10) {
            d++;
        }
        if (d == digits) {
            break;
        }
        digits = d;
    }
    if (*at + total > cap) {
        return -1;
    }
    int n = snprintf(buf + *at, cap - *at, "%zu %s=", total, key);
    memcpy(buf + *at + n, val, vlen);
    buf[*at + (size_t)n + vlen] = '\n';
    *at += total;
    return 0;
}

static int header_block(struct out *o, const char *name, char type, const char *link, uint32_t mode, uint64_t size,
                        int64_t mtime, uint64_t uid, uint64_t gid, dev_t rdev)
{
    uint8_t b[BLOCK];
    memset(b, 0, sizeof(b));
    char *h = (char *)b;
    size_t nl = strlen(name);
    memcpy(h, name, nl > 100 ? 100 : nl);
    octal(h + 100, 8, mode & 07777);
    octal(h + 108, 8, fits(uid, 8) ? uid : 0);
    octal(h + 116, 8, fits(gid, 8) ? gid : 0);
    octal(h + 124, 12, fits(size, 12) ? size : 0);
    octal(h + 136, 12, mtime > 0 && fits((uint64_t)mtime, 12) ? (uint64_t)mtime : 0);
    memset(h + 148, ' ', 8);
    h[156] = type;
    if (link) {
        size_t ll = strlen(link);
        memcpy(h + 157, link, ll > 100 ? 100 : ll);
    }
    memcpy(h + 257, "ustar", 6);
    memcpy(h + 263, "00", 2);
    if (type == '3' || type == '4') {
        octal(h + 329, 8, fits(major(rdev), 8) ? major(rdev) : 0);
        octal(h + 337, 8, fits(minor(rdev), 8) ? minor(rdev) : 0);
    }
    unsigned sum = 0;
    for (size_t i = 0; i < BLOCK; i++) {
        sum += b[i];
    }
    octal(h + 148, 7, sum);
    h[155] = ' ';
    return out_put(o, b, BLOCK);
}

static char *g_pax; /* the extended header being made: two names and a few numbers */
#define PAX_CAP (2 * ARC_PATH + 1024)

static int extended(struct out *o, char type, const char *name, size_t len)
{
    if (header_block(o, name, type, NULL, 0644, len, 0, 0, 0, 0) < 0 || out_put(o, g_pax, len) < 0) {
        return -1;
    }
    return out_zeros(o, -len % BLOCK);
}

static int put_header(struct out *o, const char *name, char type, const char *link, const struct stat *st,
                      uint64_t size)
{
    size_t at = 0, nl = strlen(name), ll = link ? strlen(link) : 0;
    char num[32];
    if (nl > 100) {
        pax_add(g_pax, PAX_CAP, &at, "path", name, nl);
    }
    if (ll > 100) {
        pax_add(g_pax, PAX_CAP, &at, "linkpath", link, ll);
    }
    if (!fits(size, 12)) {
        pax_add(g_pax, PAX_CAP, &at, "size", num, (size_t)snprintf(num, sizeof(num), "%llu", (unsigned long long)size));
    }
    if (!fits(st->st_uid, 8)) {
        pax_add(g_pax, PAX_CAP, &at, "uid", num, (size_t)snprintf(num, sizeof(num), "%u", (unsigned)st->st_uid));
    }
    if (!fits(st->st_gid, 8)) {
        pax_add(g_pax, PAX_CAP, &at, "gid", num, (size_t)snprintf(num, sizeof(num), "%u", (unsigned)st->st_gid));
    }
    if (at && extended(o, 'x', "././@PaxHeader", at) < 0) {
        return -1;
    }
    return header_block(o, name, type, link, st->st_mode, size, st->st_mtim.tv_sec, st->st_uid, st->st_gid,
                        st->st_rdev);
}

/* A note for the reader in a global header: its keys and values, NULL-terminated pairs. */
static int global_note(struct out *o, const char *const *kv)
{
    size_t at = 0;
    for (int i = 0; kv[i]; i += 2) {
        if (pax_add(g_pax, PAX_CAP, &at, kv[i], kv[i + 1], strlen(kv[i + 1])) < 0) {
            return -1;
        }
    }
    return extended(o, 'g', "././@PaxHeader", at);
}

/* ---- reading a tree ------------------------------------------------------------------ */

struct seen {
    dev_t dev;
    ino_t ino;
    char *name;
};

struct walker {
    struct out out;
    int follow;
    char root[PATH_MAX]; /* the tree's real path, for FOLLOW */
    char *path;          /* the member name being made */
    size_t len;
    struct {
        dev_t dev;
        ino_t ino;
    } stack[ARC_DEPTH]; /* the directories being read, for a loop through followed links */
    int depth;
    struct seen *links; /* files with more than one link, by device and inode */
    size_t nlinks, caplinks;
    unsigned skips;
    uint64_t files, bytes;
};

static size_t seen_slot(const struct walker *w, dev_t dev, ino_t ino)
{
    uint64_t h = ((uint64_t)dev * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)ino * 0xC2B2AE3D27D4EB4Full);
    size_t i = (size_t)(h >> 17) & (w->caplinks - 1);
    while (w->links[i].name && (w->links[i].dev != dev || w->links[i].ino != ino)) {
        i = (i + 1) & (w->caplinks - 1);
    }
    return i;
}

static const char *seen_find(const struct walker *w, dev_t dev, ino_t ino)
{
    return w->caplinks ? w->links[seen_slot(w, dev, ino)].name : NULL;
}

static void seen_add(struct walker *w, dev_t dev, ino_t ino, const char *name)
{
    if ((w->nlinks + 1) * 2 > w->caplinks) {
        size_t cap = w->caplinks ? w->caplinks * 2 : 256;
        struct seen *old = w->links;
        size_t oldcap = w->caplinks;
        struct seen *links = calloc(cap, sizeof(*links));
        if (!links) {
            return; /* no memory: it goes as a copy */
        }
        w->links = links;
        w->caplinks = cap;
        for (size_t i = 0; i < oldcap; i++) {
            if (old[i].name) {
                w->links[seen_slot(w, old[i].dev, old[i].ino)] = old[i];
            }
        }
        free(old);
    }
    char *copy = strdup(name);
    if (copy) {
        size_t i = seen_slot(w, dev, ino);
        w->links[i] = (struct seen){dev, ino, copy};
        w->nlinks++;
    }
}

static int skip(struct walker *w, const char *why)
{
    char key_path[40], key_why[40];
    snprintf(key_path, sizeof(key_path), "SANDLOT.skip.%u.path", w->skips);
    snprintf(key_why, sizeof(key_why), "SANDLOT.skip.%u.why", w->skips);
    w->skips++;
    const char *kv[] = {key_path, w->path, key_why, why, NULL};
    return global_note(&w->out, kv);
}

/* Another file system mounted in the tree that holds no files of its own to copy
 * (/proc, /sys and their kind): left out, and said. */
static const char *pseudo_fs(int fd)
{
    struct statfs sf;
    if (fstatfs(fd, &sf) < 0) {
        return NULL;
    }
    switch ((unsigned long)sf.f_type) {
    case 0x9fa0: return "proc";
    case 0x62656572: return "sysfs";
    case 0x1cd1: return "devpts";
    case 0x27e0eb: return "cgroup";
    case 0x63677270: return "cgroup2";
    case 0x64626720: return "debugfs";
    case 0x74726163: return "tracefs";
    case 0x73636673: return "securityfs";
    case 0xcafe4a11: return "bpf";
    case 0x6165676c: return "pstore";
    case 0xde5e81e4: return "efivarfs";
    case 0x62656570: return "configfs";
    case 0x19800202: return "mqueue";
    case 0x65735543: return "fusectl";
    case 0x42494e4d: return "binfmt_misc";
    default: return NULL;
    }
}

static int name_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int put_entry(struct walker *w, int dfd, const char *name, dev_t parent_dev);

/* The entries of an open directory, in name order; fd is its own. */
static int put_children(struct walker *w, int fd, dev_t dev)
{
    DIR *d = fdopendir(fd);
    if (!d) {
        int e = errno;
        close(fd);
        return fail(w->path, e, "cannot read the directory: %s", strerror(e));
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    int r = 0;
    for (;;) {
        errno = 0;
        de = readdir(d);
        if (!de) {
            if (errno) {
                r = fail(w->path, errno, "cannot read the directory: %s", strerror(errno));
            }
            break;
        }
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) {
            continue;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **grown = realloc(names, cap * sizeof(*names));
            if (!grown) {
                r = fail(w->path, ENOMEM, "out of memory");
                break;
            }
            names = grown;
        }
        if (!(names[n] = strdup(de->d_name))) {
            r = fail(w->path, ENOMEM, "out of memory");
            break;
        }
        n++;
    }
    if (r == 0 && n) {
        qsort(names, n, sizeof(*names), name_cmp);
        for (size_t i = 0; i < n && r == 0; i++) {
            r = put_entry(w, dirfd(d), names[i], dev);
        }
    }
    for (size_t i = 0; i < n; i++) {
        free(names[i]);
    }
    free(names);
    closedir(d);
    return r;
}

static int put_dir(struct walker *w, int pfd, dev_t parent_dev)
{
    int fd = openat(pfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) {
        int e = errno;
        if (fd >= 0) {
            close(fd);
        }
        return fail(w->path, e, "cannot open the directory: %s", strerror(e));
    }
    if (st.st_dev != parent_dev) {
        const char *fs = pseudo_fs(fd);
        if (fs) {
            char why[96];
            snprintf(why, sizeof(why), "a %s file system mounted here: not copied", fs);
            close(fd);
            return skip(w, why);
        }
    }
    for (int i = 0; i < w->depth; i++) {
        if (w->stack[i].dev == st.st_dev && w->stack[i].ino == st.st_ino) {
            close(fd);
            return fail(w->path, ELOOP, "a symbolic link back to a directory that holds it: a loop");
        }
    }
    if (w->depth >= ARC_DEPTH) {
        close(fd);
        return fail(w->path, ELOOP, "more than %d directories deep", ARC_DEPTH);
    }
    w->path[w->len] = '/';
    w->path[w->len + 1] = 0;
    int r = put_header(&w->out, w->path, '5', NULL, &st, 0);
    w->path[w->len] = 0;
    if (r < 0) {
        close(fd);
        return -1;
    }
    w->stack[w->depth].dev = st.st_dev;
    w->stack[w->depth].ino = st.st_ino;
    w->depth++;
    r = put_children(w, fd, st.st_dev);
    w->depth--;
    return r;
}

static int put_file(struct walker *w, int dfd, const char *name, int pfd, const struct stat *lst)
{
    if (lst->st_nlink > 1) {
        const char *first = seen_find(w, lst->st_dev, lst->st_ino);
        if (first) {
            return put_header(&w->out, w->path, '1', first, lst, 0);
        }
    }
    /* opened for reading only now that it is known to be a regular file: through its
     * O_PATH descriptor, so it is the very file that was looked at */
    char proc[40];
    snprintf(proc, sizeof(proc), "/proc/self/fd/%d", pfd);
    int fd = open(proc, O_RDONLY | O_NOCTTY | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) { /* no /proc: by name, and checked to be the same file */
        fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    }
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) {
        int e = errno;
        if (fd >= 0) {
            close(fd);
        }
        if (e == ENOENT) {
            return 0; /* removed as the tree was read */
        }
        return fail(w->path, e, "cannot open: %s", strerror(e));
    }
    if (st.st_dev != lst->st_dev || st.st_ino != lst->st_ino || !S_ISREG(st.st_mode)) {
        close(fd);
        return fail(w->path, EAGAIN, "replaced while the tree was read");
    }
    uint64_t size = (uint64_t)st.st_size, sent = 0;
    if (put_header(&w->out, w->path, '0', NULL, &st, size) < 0) {
        close(fd);
        return -1;
    }
    int r = 0;
    while (sent < size) {
        if (w->out.len == IO_BUF && out_flush(&w->out) < 0) {
            r = -1;
            break;
        }
        size_t want = IO_BUF - w->out.len;
        if (want > size - sent) {
            want = (size_t)(size - sent);
        }
        ssize_t k = read(fd, w->out.buf + w->out.len, want);
        if (k < 0 && errno == EINTR) {
            continue;
        }
        if (k <= 0) { /* shrank, or the disk failed: the stream is kept whole up to the note */
            int e = k < 0 ? errno : 0;
            if (e) {
                fail(w->path, e, "cannot read: %s", strerror(e));
            } else {
                fail(w->path, EAGAIN, "changed while it was read: it ended at %llu of %llu bytes",
                     (unsigned long long)sent, (unsigned long long)size);
            }
            out_zeros(&w->out, size - sent);
            r = -1;
            break;
        }
        w->out.len += (size_t)k;
        sent += (uint64_t)k;
    }
    close(fd);
    if (r < 0 || out_zeros(&w->out, -size % BLOCK) < 0) {
        return -1;
    }
    w->files++;
    w->bytes += size;
    if (st.st_nlink > 1) {
        seen_add(w, st.st_dev, st.st_ino, w->path);
    }
    return 0;
}

/* FOLLOW: what a link in the tree points to, if that is in the tree; an O_PATH descriptor. */
static int follow_link(struct walker *w, int dfd, const char *name, const char *target)
{
    int t = openat(dfd, name, O_PATH | O_CLOEXEC);
    if (t < 0) {
        int e = errno;
        return fail(w->path, e, "a symbolic link to %s, which leads nowhere here (%s): not followed", target,
                    strerror(e));
    }
    char proc[40], real[PATH_MAX];
    snprintf(proc, sizeof(proc), "/proc/self/fd/%d", t);
    ssize_t n = readlink(proc, real, sizeof(real) - 1);
    if (n < 0) {
        close(t);
        return fail(w->path, errno, "a symbolic link to %s: where it leads cannot be told: %s", target,
                    strerror(errno));
    }
    real[n] = 0;
    size_t rl = strlen(w->root);
    int inside = !strcmp(w->root, "/") || !strcmp(real, w->root) ||
                 (!strncmp(real, w->root, rl) && real[rl] == '/');
    if (!inside) {
        close(t);
        return fail(w->path, EXDEV, "a symbolic link to %s, outside the tree: not followed", target);
    }
    return t;
}

static int put_entry(struct walker *w, int dfd, const char *name, dev_t parent_dev)
{
    size_t base = w->len, nl = strlen(name);
    if (base + (base ? 1 : 0) + nl + 2 > ARC_PATH) {
        return fail(w->path, ENAMETOOLONG, "a path longer than %u bytes under it", ARC_PATH);
    }
    if (base) {
        w->path[w->len++] = '/';
    }
    memcpy(w->path + w->len, name, nl + 1);
    w->len += nl;
    int r = 0;
    int pfd = openat(dfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (pfd < 0 || fstat(pfd, &st) < 0) {
        int e = errno;
        if (e != ENOENT) { /* ENOENT: removed as the tree was read */
            r = fail(w->path, e, "cannot look at it: %s", strerror(e));
        }
        goto out;
    }
    if (S_ISLNK(st.st_mode)) {
        char *target = read_link_at(pfd, "");
        if (!target) {
            target = read_link_at(dfd, name);
        }
        if (!target) {
            r = errno == ENOENT ? 0 : fail(w->path, errno, "cannot read the link: %s", strerror(errno));
            goto out;
        }
        if (!w->follow) {
            r = put_header(&w->out, w->path, '2', target, &st, 0);
            free(target);
            goto out;
        }
        int t = follow_link(w, dfd, name, target);
        free(target);
        if (t < 0) {
            r = -1;
            goto out;
        }
        close(pfd);
        pfd = t;
        if (fstat(pfd, &st) < 0) {
            r = fail(w->path, errno, "cannot look at what it links to: %s", strerror(errno));
            goto out;
        }
    }
    switch (st.st_mode & S_IFMT) {
    case S_IFDIR: r = put_dir(w, pfd, parent_dev); break;
    case S_IFREG: r = put_file(w, dfd, name, pfd, &st); break;
    case S_IFIFO: r = put_header(&w->out, w->path, '6', NULL, &st, 0); break;
    case S_IFCHR: r = put_header(&w->out, w->path, '3', NULL, &st, 0); break;
    case S_IFBLK: r = put_header(&w->out, w->path, '4', NULL, &st, 0); break;
    default: r = skip(w, "a socket: it cannot be copied"); break;
    }
out:
    if (pfd >= 0) {
        close(pfd);
    }
    w->len = base;
    w->path[base] = 0;
    return r;
}

static int archive_read(const char *root, uint32_t flags)
{
    g_report_fd = 2;
    struct walker *w = calloc(1, sizeof(*w));
    g_pax = malloc(PAX_CAP);
    if (!w || !g_pax || !(w->path = malloc(ARC_PATH)) || !(w->out.buf = malloc(IO_BUF))) {
        fail("", ENOMEM, "out of memory");
        report_failure();
        return 1;
    }
    w->out.fd = 1;
    w->follow = (flags & SL_ARCHIVE_FOLLOW) != 0;
    w->path[0] = 0;
    int fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) {
        fail(NULL, errno, "%s: %s", root, strerror(errno));
        report_failure();
        return 1;
    }
    if (w->follow && !realpath(root, w->root)) {
        fail(NULL, errno, "%s: %s", root, strerror(errno));
        report_failure();
        return 1;
    }
    w->stack[0].dev = st.st_dev;
    w->stack[0].ino = st.st_ino;
    w->depth = 1;
    int r = put_header(&w->out, "./", '5', NULL, &st, 0); /* the tree's own mode and time, as tar -C DIR . */
    if (r == 0) {
        r = put_children(w, fd, st.st_dev);
    } else {
        close(fd);
    }
    if (r == 0) {
        r = out_zeros(&w->out, 2 * BLOCK);
    } else if (g_fail.set) {
        char err[16];
        snprintf(err, sizeof(err), "%d", g_fail.err);
        const char *kv[] = {"SANDLOT.error.path", g_fail.entry, "SANDLOT.error.errno", err,
                            "SANDLOT.error.message", g_fail.message, NULL};
        global_note(&w->out, kv);
    }
    int flushed = out_flush(&w->out);
    if (r < 0 || flushed < 0) {
        report_failure();
        return 1;
    }
    record(SL_AR_DONE, NULL, 0, NULL, (uint32_t)(w->files > UINT32_MAX ? UINT32_MAX : w->files), w->bytes);
    return 0;
}

/* ---- writing a tree ------------------------------------------------------------------- */

struct in {
    int fd;
    int eof;
    size_t head, len;
    uint8_t *buf;
};

/* n bytes, or -1: the stream ended (eof set) or failed (errno) */
static int in_read(struct in *r, void *dst, size_t n)
{
    uint8_t *d = dst;
    while (n) {
        if (r->head == r->len) {
            ssize_t k = read(r->fd, r->buf, IO_BUF);
            if (k < 0 && errno == EINTR) {
                continue;
            }
            if (k <= 0) {
                r->eof = k == 0;
                return -1;
            }
            r->head = 0;
            r->len = (size_t)k;
        }
        size_t k = r->len - r->head < n ? r->len - r->head : n;
        if (d) {
            memcpy(d, r->buf + r->head, k);
            d += k;
        }
        r->head += k;
        n -= k;
    }
    return 0;
}

static int in_skip(struct in *r, uint64_t n)
{
    while (n) {
        size_t k = n > IO_BUF ? IO_BUF : (size_t)n;
        if (in_read(r, NULL, k) < 0) {
            return -1;
        }
        n -= k;
    }
    return 0;
}

struct member {
    char type;
    char *name;   /* as the archive gives it */
    char *link;
    uint32_t mode;
    uint64_t size;
    int64_t mtime;
    unsigned devmajor, devminor;
};

struct dirmeta {
    char *path; /* relative to the staging directory; "" for it */
    uint32_t mode;
    int64_t mtime;
    int explicit_; /* a member of the archive (not a parent made for one) */
    size_t seq;
};

struct unpacker {
    struct in in;
    int stage;               /* the staging directory */
    int stage_parent;        /* the directory holding it */
    char stage_name[300];
    int dest;                /* the destination it merges into; -1 for a new one */
    int dest_parent;         /* a new destination's directory, and its name there */
    const char *dest_name;
    int own;
    uid_t uid;
    gid_t gid;
    char *cache_path;        /* the directory last resolved, and its descriptor */
    int cache_fd;
    struct dirmeta *dirs;
    size_t ndirs, capdirs;
    uint64_t entries, bytes;
    char **written;          /* a merge that failed part way: what it moved */
    size_t nwritten, capwritten;
};

static uint64_t parse_num(const uint8_t *f, size_t n, int *bad)
{
    uint64_t v = 0;
    if (f[0] & 0x80) { /* base-256 (GNU): positive only */
        if (f[0] != 0x80) {
            *bad = 1;
            return 0;
        }
        for (size_t i = 1; i < n; i++) {
            if (v >> 56) {
                *bad = 1;
                return 0;
            }
            v = (v << 8) | f[i];
        }
        return v;
    }
    size_t i = 0;
    while (i < n && (f[i] == ' ' || f[i] == 0)) {
        i++;
    }
    for (; i < n && f[i] >= '0' && f[i] <= '7'; i++) {
        if (v >> 60) {
            *bad = 1;
            return 0;
        }
        v = (v << 3) | (uint64_t)(f[i] - '0');
    }
    for (; i < n; i++) {
        if (f[i] != ' ' && f[i] != 0) {
            *bad = 1;
        }
    }
    return v;
}

static int checksum_ok(const uint8_t *b)
{
    int bad = 0;
    uint64_t want = parse_num(b + 148, 8, &bad);
    uint64_t usum = 0;
    int64_t ssum = 0;
    for (size_t i = 0; i < BLOCK; i++) {
        uint8_t c = i >= 148 && i < 156 ? ' ' : b[i];
        usum += c;
        ssum += (int8_t)c;
    }
    return !bad && (want == usum || (int64_t)want == ssum);
}

static char *field_str(const uint8_t *f, size_t n)
{
    size_t l = strnlen((const char *)f, n);
    char *s = malloc(l + 1);
    if (s) {
        memcpy(s, f, l);
        s[l] = 0;
    }
    return s;
}

/* An extended header's records: path and linkpath, size; a global one's note of a
 * failure (SANDLOT.error.*), which refuses the archive. */
static int parse_pax(const char *data, size_t n, int global, char **path, char **link, uint64_t *size, int *has_size,
                     const char *last)
{
    char *err_path = NULL, *err_msg = NULL;
    size_t at = 0;
    while (at < n) {
        size_t len = 0, i = at;
        while (i < n && data[i] >= '0' && data[i] <= '9' && len < PAX_MAX) {
            len = len * 10 + (size_t)(data[i++] - '0');
        }
        if (i == at || i >= n || data[i] != ' ' || len <= i - at || at + len > n || data[at + len - 1] != '\n') {
            free(err_path);
            free(err_msg);
            return fail(last, EINVAL, "a malformed extended header after it");
        }
        const char *kv = data + i + 1, *end = data + at + len - 1;
        const char *eq = memchr(kv, '=', (size_t)(end - kv));
        if (!eq) {
            free(err_path);
            free(err_msg);
            return fail(last, EINVAL, "a malformed extended header after it");
        }
        size_t kl = (size_t)(eq - kv), vl = (size_t)(end - eq - 1);
        const char *v = eq + 1;
        char **into = NULL;
        if (!global && kl == 4 && !memcmp(kv, "path", 4)) {
            into = path;
        } else if (!global && kl == 8 && !memcmp(kv, "linkpath", 8)) {
            into = link;
        } else if (!global && kl == 4 && !memcmp(kv, "size", 4)) {
            uint64_t s = 0;
            for (size_t j = 0; j < vl; j++) {
                if (v[j] < '0' || v[j] > '9' || s > (UINT64_MAX - 9) / 10) {
                    return fail(last, EINVAL, "a malformed size in an extended header after it");
                }
                s = s * 10 + (uint64_t)(v[j] - '0');
            }
            *size = s;
            *has_size = 1;
        } else if (global && kl == 18 && !memcmp(kv, "SANDLOT.error.path", 18)) {
            into = &err_path;
        } else if (global && kl == 21 && !memcmp(kv, "SANDLOT.error.message", 21)) {
            into = &err_msg;
        }
        if (into) {
            if (memchr(v, 0, vl)) {
                return fail(last, EINVAL, "a name with a NUL byte in an extended header after it");
            }
            free(*into);
            *into = malloc(vl + 1);
            if (!*into) {
                return fail(last, ENOMEM, "out of memory");
            }
            memcpy(*into, v, vl);
            (*into)[vl] = 0;
        }
        at += len;
    }
    if (err_path || err_msg) {
        fail(err_path ? err_path : "", EIO, "%s", err_msg ? err_msg : "the archive says it failed here");
        free(err_path);
        free(err_msg);
        return -1;
    }
    return 0;
}

/* The next member, 0; 1 at the end of the archive; -1 failed. */
static int next_member(struct unpacker *u, struct member *m, const char *last)
{
    char *long_name = NULL, *long_link = NULL;
    uint64_t pax_size = 0;
    int has_pax_size = 0;
    uint8_t b[BLOCK];
    for (;;) {
        if (in_read(&u->in, b, BLOCK) < 0) {
            free(long_name);
            free(long_link);
            if (u->in.eof) {
                return fail(last, EIO, "the archive ends early, after this entry (no end-of-archive blocks)");
            }
            return fail(last, errno, "cannot read the archive: %s", strerror(errno));
        }
        int zero = 1;
        for (size_t i = 0; i < BLOCK && zero; i++) {
            zero = b[i] == 0;
        }
        if (zero) {
            free(long_name);
            free(long_link);
            return 1;
        }
        if (!checksum_ok(b)) {
            free(long_name);
            free(long_link);
            return fail(last, EINVAL, "not a tar archive after this entry (a header's checksum is wrong)");
        }
        int bad = 0;
        char type = (char)b[156];
        uint64_t size = parse_num(b + 124, 12, &bad);
        if (bad) {
            free(long_name);
            free(long_link);
            return fail(last, EINVAL, "a malformed size in the header after this entry");
        }
        if (type == 'x' || type == 'g' || type == 'L' || type == 'K') {
            if (size > PAX_MAX) {
                free(long_name);
                free(long_link);
                return fail(last, E2BIG, "an extended header of %llu bytes after this entry (the most taken: %u)",
                            (unsigned long long)size, PAX_MAX);
            }
            char *data = malloc((size_t)size + 1);
            if (!data || in_read(&u->in, data, (size_t)size) < 0 || in_skip(&u->in, -size % BLOCK) < 0) {
                free(data);
                free(long_name);
                free(long_link);
                return fail(last, u->in.eof ? EIO : errno, "the archive ends early, after this entry");
            }
            data[size] = 0;
            int r = 0;
            if (type == 'L' || type == 'K') {
                char **into = type == 'L' ? &long_name : &long_link;
                free(*into);
                *into = strndup(data, (size_t)size);
            } else {
                r = parse_pax(data, (size_t)size, type == 'g', &long_name, &long_link, &pax_size, &has_pax_size,
                              last);
            }
            free(data);
            if (r < 0) {
                free(long_name);
                free(long_link);
                return -1;
            }
            continue;
        }
        memset(m, 0, sizeof(*m));
        m->type = type ? type : '0';
        if (long_name) {
            m->name = long_name;
        } else {
            char *name = field_str(b, 100);
            int posix = !memcmp(b + 257, "ustar\0", 6);
            if (posix && b[345] && name) {
                char *prefix = field_str(b + 345, 155);
                char *joined = prefix ? malloc(strlen(prefix) + strlen(name) + 2) : NULL;
                if (joined) {
                    sprintf(joined, "%s/%s", prefix, name);
                }
                free(prefix);
                free(name);
                name = joined;
            }
            m->name = name;
        }
        m->link = long_link ? long_link : field_str(b + 157, 100);
        m->mode = (uint32_t)parse_num(b + 100, 8, &bad) & 07777;
        m->size = has_pax_size ? pax_size : size;
        m->mtime = (int64_t)parse_num(b + 136, 12, &bad);
        m->devmajor = (unsigned)parse_num(b + 329, 8, &bad);
        m->devminor = (unsigned)parse_num(b + 337, 8, &bad);
        if (!m->name || !m->link) {
            free(m->name);
            free(m->link);
            return fail(last, ENOMEM, "out of memory");
        }
        if (bad) {
            fail(m->name, EINVAL, "a malformed header");
            free(m->name);
            free(m->link);
            return -1;
        }
        return 0;
    }
}

/* A member's name as a path under the destination: "." and empty components go, a
 * trailing slash too; "" is the destination itself. -1: absolute, or "..". */
static int clean_name(const char *in, char *out)
{
    if (in[0] == '/') {
        return -1;
    }
    size_t o = 0;
    const char *p = in;
    while (*p) {
        const char *e = strchr(p, '/');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == 2 && p[0] == '.' && p[1] == '.') {
            return -1;
        }
        if (l && !(l == 1 && p[0] == '.')) {
            if (o) {
                out[o++] = '/';
            }
            memcpy(out + o, p, l);
            o += l;
        }
        p += l;
        if (*p == '/') {
            p++;
        }
    }
    out[o] = 0;
    return 0;
}

static int dir_add(struct unpacker *u, const char *rel, uint32_t mode, int64_t mtime, int explicit_)
{
    if (u->ndirs == u->capdirs) {
        size_t cap = u->capdirs ? u->capdirs * 2 : 64;
        struct dirmeta *d = realloc(u->dirs, cap * sizeof(*d));
        if (!d) {
            return fail(rel, ENOMEM, "out of memory");
        }
        u->dirs = d;
        u->capdirs = cap;
    }
    char *copy = strdup(rel);
    if (!copy) {
        return fail(rel, ENOMEM, "out of memory");
    }
    u->dirs[u->ndirs] = (struct dirmeta){copy, mode, mtime, explicit_, u->ndirs};
    u->ndirs++;
    return 0;
}

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
struct sl_open_how {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};
#define SL_RESOLVE_NO_MAGICLINKS 0x02
#define SL_RESOLVE_NO_SYMLINKS 0x04
#define SL_RESOLVE_BENEATH 0x08
static int g_no_openat2;

/* The directory rel (a cleaned path, "" for the staging directory itself) beneath the
 * staging directory, no link followed on the way; with create, missing directories
 * are made (owned as members are). A descriptor the caller keeps (cache 0) or owns. */
static int beneath(struct unpacker *u, const char *rel, int create, const char *entry, int cache)
{
    if (!*rel) {
        return cache ? u->stage : dup(u->stage);
    }
    if (cache && u->cache_path && !strcmp(u->cache_path, rel)) {
        return u->cache_fd;
    }
    int fd = -1;
    if (!g_no_openat2) {
        struct sl_open_how how = {O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0,
                                  SL_RESOLVE_BENEATH | SL_RESOLVE_NO_SYMLINKS | SL_RESOLVE_NO_MAGICLINKS};
        fd = (int)syscall(SYS_openat2, u->stage, rel, &how, sizeof(how));
        if (fd < 0 && (errno == ENOSYS || errno == EPERM)) {
            g_no_openat2 = 1; /* an older kernel, or gVisor: the walk below */
        }
    }
    if (fd < 0) { /* the O_NOFOLLOW walk: it also makes what is missing, and says what stood in the way */
        char *copy = strdup(rel);
        if (!copy) {
            return fail(entry, ENOMEM, "out of memory");
        }
        int cur = u->stage;
        for (char *p = copy;;) {
            char *slash = strchr(p, '/');
            if (slash) {
                *slash = 0;
            }
            int next = open_dir_nofollow(cur, p);
            if (next < 0 && errno == ENOENT && create) {
                if (mkdirat(cur, p, 0700) < 0 && errno != EEXIST) {
                    int e = errno;
                    fail(entry, e, "cannot make the directory %s: %s", copy, strerror(e));
                    goto walk_failed;
                }
                if (u->own) {
                    fchownat(cur, p, u->uid, u->gid, AT_SYMLINK_NOFOLLOW);
                }
                if (dir_add(u, copy, 0755, time(NULL), 0) < 0) {
                    goto walk_failed;
                }
                next = open_dir_nofollow(cur, p);
            }
            if (next < 0) {
                int e = errno;
                struct stat st;
                if (fstatat(cur, p, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
                    fail(entry, ELOOP, "%s is a symbolic link: not followed", copy);
                } else if (e == ENOTDIR || e == ELOOP) {
                    fail(entry, ENOTDIR, "%s is not a directory", copy);
                } else {
                    fail(entry, e, "%s: %s", copy, strerror(e));
                }
                goto walk_failed;
            }
            if (cur != u->stage) {
                close(cur);
            }
            cur = next;
            if (!slash) {
                break;
            }
            *slash = '/';
            p = slash + 1;
        }
        free(copy);
        fd = cur;
        goto found;
    walk_failed:
        if (cur != u->stage) {
            close(cur);
        }
        free(copy);
        return -1;
    }
found:
    if (!cache) {
        return fd;
    }
    if (u->cache_path) {
        close(u->cache_fd);
        free(u->cache_path);
    }
    u->cache_path = strdup(rel);
    u->cache_fd = fd;
    if (!u->cache_path) {
        close(fd);
        return fail(entry, ENOMEM, "out of memory");
    }
    return fd;
}

static void set_times(int fd, int64_t mtime)
{
    struct timespec ts[2] = {{mtime, 0}, {mtime, 0}};
    futimens(fd, ts);
}

static void set_times_at(int dfd, const char *name, int64_t mtime)
{
    struct timespec ts[2] = {{mtime, 0}, {mtime, 0}};
    utimensat(dfd, name, ts, AT_SYMLINK_NOFOLLOW);
}

/* What stands at name before a member is made there: nothing (0), a directory the
 * member may reuse (1), or a non-directory that a non-directory replaces (removed, 0). */
static int clear_place(int pfd, const char *base, const char *rel, int is_dir)
{
    struct stat st;
    if (fstatat(pfd, base, &st, AT_SYMLINK_NOFOLLOW) < 0) {
        return errno == ENOENT ? 0 : fail(rel, errno, "%s", strerror(errno));
    }
    if (S_ISDIR(st.st_mode)) {
        return is_dir ? 1 : fail(rel, EISDIR, "an earlier member made a directory here");
    }
    if (is_dir) {
        return fail(rel, EEXIST, "an earlier member made a non-directory here");
    }
    if (unlinkat(pfd, base, 0) < 0) {
        return fail(rel, errno, "cannot replace an earlier member: %s", strerror(errno));
    }
    return 0;
}

static int copy_data(struct unpacker *u, int fd, const struct member *m)
{
    uint64_t left = m->size;
    while (left) {
        if (u->in.head == u->in.len) {
            ssize_t k = read(u->in.fd, u->in.buf, IO_BUF);
            if (k < 0 && errno == EINTR) {
                continue;
            }
            if (k <= 0) {
                int e = k < 0 ? errno : EIO;
                return fail(m->name, e, "the archive %s inside this file", k < 0 ? "cannot be read" : "ends");
            }
            u->in.head = 0;
            u->in.len = (size_t)k;
        }
        size_t k = u->in.len - u->in.head;
        if (k > left) {
            k = (size_t)left;
        }
        if (write_all(fd, u->in.buf + u->in.head, k) < 0) {
            int e = errno;
            return fail(m->name, e, "cannot write: %s", strerror(e));
        }
        u->in.head += k;
        left -= k;
    }
    if (in_skip(&u->in, -m->size % BLOCK) < 0) {
        return fail(m->name, EIO, "the archive ends inside this file");
    }
    return 0;
}

/* 0: made; 1: left out (said in a SKIPPED record); -1: failed. */
static int make_member(struct unpacker *u, const struct member *m, const char *rel)
{
    if (!*rel) { /* the destination itself ("./"): its mode, where it is made */
        if (m->type == '5') {
            return dir_add(u, "", m->mode, m->mtime, 1);
        }
        return fail(m->name, EINVAL, "names the destination itself, which is a directory");
    }
    const char *slash = strrchr(rel, '/');
    char *parent = slash ? strndup(rel, (size_t)(slash - rel)) : strdup("");
    const char *base = slash ? slash + 1 : rel;
    if (!parent) {
        return fail(rel, ENOMEM, "out of memory");
    }
    int pfd = beneath(u, parent, 1, m->name, 1);
    free(parent);
    if (pfd < 0) {
        return -1;
    }
    int is_dir = m->type == '5';
    int there = clear_place(pfd, base, m->name, is_dir);
    if (there < 0) {
        return -1;
    }
    mode_t perm = m->mode & 07777;
    switch (m->type) {
    case '5':
        if (!there && mkdirat(pfd, base, 0700) < 0) {
            return fail(m->name, errno, "cannot make the directory: %s", strerror(errno));
        }
        if (!there && u->own) {
            fchownat(pfd, base, u->uid, u->gid, AT_SYMLINK_NOFOLLOW);
        }
        return dir_add(u, rel, perm, m->mtime, 1);
    case '0':
    case '7': {
        int fd = openat(pfd, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC, 0600);
        if (fd < 0) {
            return fail(m->name, errno, "cannot make the file: %s", strerror(errno));
        }
        if (copy_data(u, fd, m) < 0) {
            close(fd);
            return -1;
        }
        if (u->own && fchown(fd, u->uid, u->gid) < 0) {
            int e = errno;
            close(fd);
            return fail(m->name, e, "cannot give it its owner: %s", strerror(e));
        }
        if (fchmod(fd, perm) < 0) { /* after the owner: chown drops set-id bits */
            int e = errno;
            close(fd);
            return fail(m->name, e, "cannot give it its mode: %s", strerror(e));
        }
        set_times(fd, m->mtime);
        if (close(fd) < 0) {
            return fail(m->name, errno, "cannot write: %s", strerror(errno));
        }
        u->bytes += m->size;
        return 0;
    }
    case '2':
        if (!*m->link) {
            return fail(m->name, EINVAL, "a symbolic link to nothing");
        }
        if (symlinkat(m->link, pfd, base) < 0) {
            return fail(m->name, errno, "cannot make the symbolic link: %s", strerror(errno));
        }
        if (u->own) {
            fchownat(pfd, base, u->uid, u->gid, AT_SYMLINK_NOFOLLOW);
        }
        set_times_at(pfd, base, m->mtime);
        return 0;
    case '1': {
        char *target = malloc(strlen(m->link) + 1);
        if (!target) {
            return fail(m->name, ENOMEM, "out of memory");
        }
        if (clean_name(m->link, target) < 0 || !*target) {
            free(target);
            return fail(m->name, EXDEV, "a hard link to %s, outside the destination: refused", m->link);
        }
        const char *ts = strrchr(target, '/');
        char *tparent = ts ? strndup(target, (size_t)(ts - target)) : strdup("");
        int tfd = tparent ? beneath(u, tparent, 0, m->name, 0) : -1;
        int r = tfd < 0 ? -1 : linkat(tfd, ts ? ts + 1 : target, pfd, base, 0);
        int e = errno;
        free(tparent);
        free(target);
        if (tfd >= 0) {
            close(tfd);
        }
        if (r == 0) {
            return 0;
        }
        g_fail.set = 0; /* what the walk to its target said: said again, as the link's */
        if (e == ENOENT || e == ELOOP || e == ENOTDIR) {
            return fail(m->name, ENOENT, "a hard link to %s, which the archive does not hold before it: refused",
                        m->link);
        }
        return fail(m->name, e, "cannot make the hard link to %s: %s", m->link, strerror(e));
    }
    case '6':
    case '3':
    case '4': {
        mode_t kind = m->type == '6' ? S_IFIFO : m->type == '3' ? S_IFCHR : S_IFBLK;
        dev_t dev = m->type == '6' ? 0 : makedev(m->devmajor, m->devminor);
        if (mknodat(pfd, base, kind | perm, dev) < 0) {
            int e = errno;
            if (e == EPERM || e == EACCES || e == EINVAL || e == EOPNOTSUPP || e == ENOSYS) {
                char why[160];
                snprintf(why, sizeof(why), "a %s, which cannot be made here: %s",
                         m->type == '6' ? "fifo" : "device node", strerror(e));
                record(SL_AR_SKIPPED, m->name, e, why, 0, 0);
                return 1; /* left out: not counted */
            }
            return fail(m->name, e, "cannot make it: %s", strerror(e));
        }
        if (u->own) {
            fchownat(pfd, base, u->uid, u->gid, AT_SYMLINK_NOFOLLOW);
        }
        fchmodat(pfd, base, perm, 0); /* a fifo or device just made by name: not a link */
        set_times_at(pfd, base, m->mtime);
        return 0;
    }
    default:
        return fail(m->name, EINVAL, "an entry of type '%c', which is not copied: refused", m->type);
    }
}

static int dir_cmp(const void *a, const void *b)
{
    const struct dirmeta *x = a, *y = b;
    int c = strcmp(x->path, y->path);
    return c ? c : (x->seq < y->seq ? -1 : x->seq > y->seq);
}

/* Each directory's last word, in path order; then modes and times, deepest first. */
static int finish_dirs(struct unpacker *u)
{
    if (u->ndirs) {
        qsort(u->dirs, u->ndirs, sizeof(*u->dirs), dir_cmp);
    }
    size_t n = 0;
    for (size_t i = 0; i < u->ndirs; i++) {
        if (n && !strcmp(u->dirs[n - 1].path, u->dirs[i].path)) {
            int keep_explicit = u->dirs[n - 1].explicit_ || u->dirs[i].explicit_;
            free(u->dirs[n - 1].path);
            u->dirs[n - 1] = u->dirs[i];
            u->dirs[n - 1].explicit_ = keep_explicit;
        } else {
            u->dirs[n++] = u->dirs[i];
        }
    }
    u->ndirs = n;
    for (size_t i = n; i-- > 0;) {
        struct dirmeta *d = &u->dirs[i];
        int fd = beneath(u, d->path, 0, d->path, 0);
        if (fd < 0) {
            return -1;
        }
        fchmod(fd, d->mode);
        set_times(fd, d->mtime);
        close(fd);
    }
    return 0;
}

static int is_explicit_dir(const struct unpacker *u, const char *rel)
{
    size_t lo = 0, hi = u->ndirs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(u->dirs[mid].path, rel);
        if (!c) {
            return u->dirs[mid].explicit_;
        }
        if (c < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return 0;
}

static char **dir_names(int fd, size_t *count)
{
    int dup_fd = openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = dup_fd >= 0 ? fdopendir(dup_fd) : NULL;
    if (!d) {
        if (dup_fd >= 0) {
            close(dup_fd);
        }
        return NULL;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) {
            continue;
        }
        if (n + 1 >= cap) {
            cap = cap ? cap * 2 : 64;
            char **g = realloc(names, cap * sizeof(*names));
            if (!g) {
                break;
            }
            names = g;
        }
        names[n++] = strdup(de->d_name);
    }
    closedir(d);
    if (!names) {
        names = calloc(1, sizeof(*names));
    }
    if (n) {
        qsort(names, n, sizeof(*names), name_cmp);
    }
    *count = n;
    return names;
}

static void free_names(char **names, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(names[i]);
    }
    free(names);
}

static char *join(const char *rel, const char *name)
{
    char *p = malloc(strlen(rel) + strlen(name) + 2);
    if (p) {
        sprintf(p, *rel ? "%s/%s" : "%s%s", rel, name);
    }
    return p;
}

/* A merge's first pass: a directory against a non-directory anywhere refuses it all. */
static int merge_check(int sfd, int dfd, const char *rel)
{
    size_t n = 0;
    char **names = dir_names(sfd, &n);
    if (!names) {
        return fail(rel, errno, "cannot read the staging directory: %s", strerror(errno));
    }
    int r = 0;
    for (size_t i = 0; i < n && r == 0; i++) {
        struct stat s, d;
        char *path = join(rel, names[i]);
        if (!path || fstatat(sfd, names[i], &s, AT_SYMLINK_NOFOLLOW) < 0) {
            r = fail(path ? path : rel, errno ? errno : ENOMEM, "cannot look at it in the staging directory");
        } else if (fstatat(dfd, names[i], &d, AT_SYMLINK_NOFOLLOW) < 0) {
            if (errno != ENOENT) {
                r = fail(path, errno, "cannot look at it in the destination: %s", strerror(errno));
            }
        } else if (S_ISDIR(s.st_mode) && S_ISDIR(d.st_mode)) {
            int s2 = open_dir_nofollow(sfd, names[i]);
            int d2 = open_dir_nofollow(dfd, names[i]);
            r = s2 < 0 || d2 < 0 ? fail(path, errno, "cannot open the directory: %s", strerror(errno))
                                 : merge_check(s2, d2, path);
            if (s2 >= 0) {
                close(s2);
            }
            if (d2 >= 0) {
                close(d2);
            }
        } else if (S_ISDIR(s.st_mode)) {
            r = fail(path, ENOTDIR, "cannot overwrite the non-directory there with a directory%s",
                     S_ISLNK(d.st_mode) ? " (it is a symbolic link, which is not followed)" : "");
        } else if (S_ISDIR(d.st_mode)) {
            r = fail(path, EISDIR, "cannot overwrite the directory there with a non-directory");
        }
        free(path);
    }
    free_names(names, n);
    return r;
}

static void written_add(struct unpacker *u, const char *path)
{
    if (u->nwritten == u->capwritten) {
        size_t cap = u->capwritten ? u->capwritten * 2 : 64;
        char **g = realloc(u->written, cap * sizeof(*g));
        if (!g) {
            return;
        }
        u->written = g;
        u->capwritten = cap;
    }
    u->written[u->nwritten++] = strdup(path);
}

/* The second pass: what is not there moves whole, a non-directory replaces one, a
 * directory merges into one (taking the archive's mode and time where it named it). */
static int merge_move(struct unpacker *u, int sfd, int dfd, const char *rel)
{
    size_t n = 0;
    char **names = dir_names(sfd, &n);
    if (!names) {
        return fail(rel, errno, "cannot read the staging directory: %s", strerror(errno));
    }
    int r = 0;
    for (size_t i = 0; i < n && r == 0; i++) {
        struct stat s, d;
        char *path = join(rel, names[i]);
        if (!path) {
            r = fail(rel, ENOMEM, "out of memory");
            break;
        }
        int there = fstatat(dfd, names[i], &d, AT_SYMLINK_NOFOLLOW) == 0;
        if (fstatat(sfd, names[i], &s, AT_SYMLINK_NOFOLLOW) < 0) {
            r = fail(path, errno, "cannot look at it in the staging directory: %s", strerror(errno));
        } else if (there && S_ISDIR(s.st_mode) && S_ISDIR(d.st_mode)) {
            int s2 = open_dir_nofollow(sfd, names[i]);
            int d2 = open_dir_nofollow(dfd, names[i]);
            r = s2 < 0 || d2 < 0 ? fail(path, errno, "cannot open the directory: %s", strerror(errno))
                                 : merge_move(u, s2, d2, path);
            if (r == 0 && is_explicit_dir(u, path)) {
                fchmod(d2, s.st_mode & 07777);
                struct timespec ts[2] = {s.st_mtim, s.st_mtim};
                futimens(d2, ts);
            }
            if (s2 >= 0) {
                close(s2);
            }
            if (d2 >= 0) {
                close(d2);
            }
        } else if (there && (S_ISDIR(s.st_mode) || S_ISDIR(d.st_mode))) {
            r = fail(path, S_ISDIR(s.st_mode) ? ENOTDIR : EISDIR,
                     "changed in the destination while it was merged: a directory against a non-directory");
        } else if (renameat(sfd, names[i], dfd, names[i]) < 0) {
            r = fail(path, errno, "cannot move it into place: %s", strerror(errno));
        } else {
            written_add(u, path);
        }
        free(path);
    }
    free_names(names, n);
    return r;
}

static int mkdir_p(const char *path, int own, uid_t uid, gid_t gid)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof(tmp), "%s", path);
    for (char *q = tmp + 1;; q++) {
        if (*q == '/' || *q == 0) {
            char save = *q;
            *q = 0;
            if (mkdir(tmp, 0755) == 0) {
                if (own) {
                    lchown(tmp, uid, gid);
                }
            } else if (errno != EEXIST) {
                return -1;
            }
            *q = save;
            if (!save) {
                break;
            }
        }
    }
    return 0;
}

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE 1
#endif

static int rename_noreplace(int fd, const char *from, const char *to)
{
#ifdef SYS_renameat2
    if (syscall(SYS_renameat2, fd, from, fd, to, RENAME_NOREPLACE) == 0) {
        return 0;
    }
    if (errno != ENOSYS && errno != EINVAL) {
        return -1;
    }
#endif
    struct stat st; /* no renameat2 (gVisor, old kernels): checked, then renamed */
    if (fstatat(fd, to, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        errno = EEXIST;
        return -1;
    }
    return renameat(fd, from, fd, to);
}

static void unpacker_cleanup(struct unpacker *u)
{
    if (u->cache_path) {
        close(u->cache_fd);
        free(u->cache_path);
        u->cache_path = NULL;
    }
    if (u->stage >= 0) {
        close(u->stage);
        u->stage = -1;
        remove_tree_at(u->stage_parent, u->stage_name);
    }
}

static int archive_write(const char *dest, int own, uid_t uid, gid_t gid)
{
    g_report_fd = 1;
    struct unpacker u;
    memset(&u, 0, sizeof(u));
    u.in.fd = 0;
    u.stage = u.dest = u.dest_parent = u.stage_parent = -1;
    u.own = own;
    u.uid = uid;
    u.gid = gid;
    char *name = malloc(ARC_PATH), *rel = malloc(ARC_PATH), *last = calloc(1, ARC_PATH);
    u.in.buf = malloc(IO_BUF);
    if (!name || !rel || !last || !u.in.buf) {
        fail("", ENOMEM, "out of memory");
        report_failure();
        return 1;
    }
    struct stat st;
    if (stat(dest, &st) == 0) { /* the destination as the caller names it: followed */
        if (!S_ISDIR(st.st_mode)) {
            fail(NULL, ENOTDIR, "%s is not a directory", dest);
            report_failure();
            return 1;
        }
        u.dest = open(dest, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        u.stage_parent = u.dest; /* inside it: the same file system, so entries rename into place */
        snprintf(u.stage_name, sizeof(u.stage_name), ".sandlot-incoming-%d", (int)getpid());
    } else if (errno == ENOENT) {
        const char *slash = strrchr(dest, '/');
        char parent[PATH_MAX];
        snprintf(parent, sizeof(parent), "%.*s", slash == dest ? 1 : (int)(slash - dest), dest);
        u.dest_name = slash + 1;
        if (mkdir_p(parent, own, uid, gid) < 0) {
            fail(NULL, errno, "cannot make %s: %s", parent, strerror(errno));
            report_failure();
            return 1;
        }
        u.dest_parent = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        u.stage_parent = u.dest_parent;
        snprintf(u.stage_name, sizeof(u.stage_name), ".%.200s.sandlot-incoming-%d", u.dest_name, (int)getpid());
    } else {
        fail(NULL, errno, "%s: %s", dest, strerror(errno));
        report_failure();
        return 1;
    }
    if (u.stage_parent < 0) {
        fail(NULL, errno, "%s: %s", dest, strerror(errno));
        report_failure();
        return 1;
    }
    remove_tree_at(u.stage_parent, u.stage_name); /* a killed transfer's, of a pid used again */
    if (mkdirat(u.stage_parent, u.stage_name, 0700) < 0 ||
        (u.stage = open_dir_nofollow(u.stage_parent, u.stage_name)) < 0) {
        fail(NULL, errno, "cannot make a staging directory in %s: %s", dest, strerror(errno));
        report_failure();
        return 1;
    }
    int r;
    for (;;) {
        struct member m;
        r = next_member(&u, &m, last);
        if (r != 0) {
            break;
        }
        snprintf(last, ARC_PATH, "%s", m.name);
        if (strlen(m.name) >= ARC_PATH) {
            r = fail(m.name, ENAMETOOLONG, "a name longer than %u bytes", ARC_PATH);
        } else if (clean_name(m.name, rel) < 0) {
            r = fail(m.name, EXDEV, "a name that leads out of the destination: refused");
        } else if (m.type != '0' && m.type != '7' && in_skip(&u.in, m.size + (-m.size % BLOCK)) < 0) {
            r = fail(m.name, EIO, "the archive ends inside this entry");
        } else {
            r = make_member(&u, &m, rel);
            if (r == 0 && *rel) {
                u.entries++;
            }
            r = r > 0 ? 0 : r;
        }
        free(m.name);
        free(m.link);
        if (r < 0) {
            break;
        }
    }
    if (r == 1) {
        r = finish_dirs(&u);
    }
    if (r == 0 && u.dest < 0) {
        if (u.own) {
            fchown(u.stage, uid, gid);
        }
        int explicit_root = is_explicit_dir(&u, "");
        if (!explicit_root) {
            fchmod(u.stage, 0755);
        }
        if (rename_noreplace(u.dest_parent, u.stage_name, u.dest_name) == 0) {
            close(u.stage);
            u.stage = -1;
        } else if (errno == EEXIST) { /* made while this ran: merged into, as one that was there */
            u.dest = openat(u.dest_parent, u.dest_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (u.dest < 0) {
                r = fail("", errno, "%s appeared while this ran, and is not a directory", dest);
            }
        } else {
            r = fail("", errno, "cannot move the tree into place at %s: %s", dest, strerror(errno));
        }
    }
    if (r == 0 && u.dest >= 0 && u.stage >= 0) {
        r = merge_check(u.stage, u.dest, "");
        if (r == 0) {
            r = merge_move(&u, u.stage, u.dest, "");
        }
    }
    unpacker_cleanup(&u);
    if (r != 0) {
        for (size_t i = 0; i < u.nwritten; i++) {
            record(SL_AR_WRITTEN, u.written[i], 0, NULL, 0, 0);
        }
        report_failure();
        return 1;
    }
    record(SL_AR_DONE, NULL, 0, NULL, (uint32_t)(u.entries > UINT32_MAX ? UINT32_MAX : u.entries), u.bytes);
    return 0;
}

/* ---- the channel ---------------------------------------------------------------------- */

void archive_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n)
{
    uint32_t op = 0, flags = 0;
    char *path = NULL, *user = NULL;
    if (!tlv_valid(p, n) || tlv_u32(p, n, SL_T_OP, &op) != 1 || tlv_u32(p, n, SL_T_FLAGS, &flags) < 0 ||
        (op != SL_ARCHIVE_READ && op != SL_ARCHIVE_WRITE)) {
        send_error(s, ch, EINVAL, SL_ARCHIVE, "malformed ARCHIVE request");
        return;
    }
    int r = tlv_str(p, n, SL_T_PATH, &path);
    if (r != 1 || path[0] != '/' || strlen(path) >= PATH_MAX) {
        send_error(s, ch, EINVAL, SL_ARCHIVE, "an archive needs an absolute path, without NUL, under %d bytes",
                   PATH_MAX);
        free(path);
        return;
    }
    if (tlv_str(p, n, SL_T_USER, &user) < 0) {
        send_error(s, ch, EINVAL, SL_ARCHIVE, "user holds a NUL byte");
        free(path);
        return;
    }
    if (g_safe_mode) {
        send_error(s, ch, EPERM, SL_ARCHIVE, "archives are disabled in safe mode");
        goto out;
    }
    if (limits_frozen()) { /* as for a command: the host asks again after the thaw */
        send_error(s, ch, EBUSY, SL_ARCHIVE,
                   "the box's commands are frozen for a save: ask again when it is over");
        goto out;
    }
    struct user_spec u;
    int own = user && *user;
    char err[300];
    if (own && resolve_user(user, &u, err, sizeof(err)) < 0) {
        send_error(s, ch, ENOENT, SL_ARCHIVE, "%s", err);
        goto out;
    }
    int writing = op == SL_ARCHIVE_WRITE;
    int in_pipe[2] = {-1, -1}, out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
    if ((writing && pipe2(in_pipe, O_CLOEXEC) < 0) || pipe2(out_pipe, O_CLOEXEC) < 0 ||
        pipe2(err_pipe, O_CLOEXEC) < 0) {
        int e = errno;
        int fds[] = {in_pipe[0], in_pipe[1], out_pipe[0], out_pipe[1]};
        for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++) {
            if (fds[i] >= 0) {
                close(fds[i]);
            }
        }
        send_error(s, ch, e, SL_ARCHIVE, "cannot start: %s", strerror(e));
        goto out;
    }
    char cg_procs[64] = "";
    uint32_t cgroup = exec_cgroup_new(cg_procs, sizeof(cg_procs));
    pid_t pid = fork();
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        int sigs[] = {SIGPIPE, SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGIO, SIGUSR1, SIGUSR2};
        for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
            signal(sigs[i], SIG_DFL);
        }
        sigprocmask(SIG_SETMASK, &none, NULL);
        exec_cgroup_join(cg_procs);
        int fd0 = writing ? in_pipe[0] : open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (fd0 < 0 || dup2(fd0, 0) < 0 || dup2(out_pipe[1], 1) < 0 || dup2(err_pipe[1], 2) < 0) {
            _exit(126);
        }
        close_inherited(-1);
        prctl(PR_SET_NAME, writing ? "sandlot-untar" : "sandlot-tar");
        int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (fd >= 0) { /* not the agent's protection: this may be killed */
            ssize_t w = write(fd, "0", 1);
            (void)w;
            close(fd);
        }
        umask(022);
        _exit(writing ? archive_write(path, own, own ? u.uid : 0, own ? u.gid : 0) : archive_read(path, flags));
    }
    int e = errno;
    close(out_pipe[1]);
    close(err_pipe[1]);
    if (in_pipe[0] >= 0) {
        close(in_pipe[0]);
    }
    if (pid < 0 || exec_follow(s, ch, pid, in_pipe[1], out_pipe[0], err_pipe[0], cgroup, writing ? 0 : SIGKILL) < 0) {
        e = pid < 0 ? e : errno;
        if (pid > 0) {
            kill(pid, SIGKILL); /* reaped by the loop, as an orphan */
        }
        close(out_pipe[0]);
        close(err_pipe[0]);
        if (in_pipe[1] >= 0) {
            close(in_pipe[1]);
        }
        exec_cgroup_release(cgroup);
        send_error(s, ch, e, SL_ARCHIVE, "cannot start: %s", strerror(e));
    }
out:
    free(path);
    free(user);
}
