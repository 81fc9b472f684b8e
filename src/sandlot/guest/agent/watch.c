/* Watch channels: inotify on a directory (its whole tree, or only itself) or
 * on one file, reported to the host as compact event records on stream 1
 * under the stream's window, like an exec's output (docs/protocol.md, "Watch").
 *
 * What inotify gives is raw; what the host gets is meant to be read by people:
 * - a move inside the tree is one MOVED record (IN_MOVED_FROM and IN_MOVED_TO
 *   paired by cookie); a move out of it is DELETED, a move into it CREATED;
 * - MODIFIED is reported when a file written to is closed, so a 1 MiB write is
 *   one event, not one per write(); a file kept open and appended to is
 *   reported at most once per MODIFY_SETTLE_MS;
 * - a new directory is watched as it appears, and what was created in it
 *   before its watch took hold is reported from a scan (once: the events
 *   inotify queued meanwhile for the same names are dropped);
 * - nothing is lost silently: a kernel queue overflow, this channel's own
 *   queue filling up while the host does not read, records past the rate the
 *   host asked for (RATE a second, BURST at once: a box that churns files makes
 *   the host work no faster than that), and a directory that could not be
 *   watched (WATCH_MAX, fs.inotify limits) are OVERFLOW records naming the
 *   directory under which events may be missing.
 * A file is watched through its directory, so the path is followed when the
 * file is replaced (atomic writes rename a new file over it). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "agent.h"

#define WATCH_MAX 8192u            /* directories one channel watches */
#define WATCH_QUEUE (256u << 10)   /* event bytes held for a host that does not read */
#define MODIFY_SETTLE_MS 250       /* a file written and not closed: at most one MODIFIED per this */
#define MOVE_PAIR_MS 20            /* an IN_MOVED_FROM without its IN_MOVED_TO by then moved out */
#define DIRTY_MAX 1024             /* files written to and not closed yet, tracked for coalescing */
#define SCANNED_MAX 65536          /* names a scan reported, kept until inotify's queue is drained */
#define NODE_BUCKETS 1024u
#define MAX_DEPTH 256          /* directories below the base; deeper ones are reported unwatched */
#define DIR_MASK (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_MODIFY | IN_CLOSE_WRITE | \
                  IN_DELETE_SELF | IN_MOVE_SELF | IN_EXCL_UNLINK | IN_ONLYDIR)

struct wnode {                 /* one watched directory */
    struct wnode *next;        /* hash chain by wd */
    int wd;
    char *path;                /* relative to the base; "" is the base itself */
};

struct dirty {                 /* a file written to since its last report */
    char *path;
    uint64_t since_ms;
};

struct scanned {               /* a name a scan reported as created */
    int wd;
    char *name;
};

struct watch_state {
    int fd;                    /* inotify; -1 once the watch ended */
    int recursive;
    char *base;                /* absolute: the watched directory, or a watched file's directory */
    char *file_name;           /* a file watch: the file's name in base; NULL for a directory */
    int file_exists;
    int root_wd;
    uint32_t nwatches;
    struct wnode *nodes[NODE_BUCKETS];
    struct ostream out;        /* stream 1: records [acked, end) kept for resending */
    int overflow;              /* records were dropped: an OVERFLOW of the base is due */
    uint32_t rate, burst;      /* records a second and at once (rate 0: no limit) */
    double tokens;             /* what the rate allows now, as of tokens_ms */
    uint64_t tokens_ms;
    int moving;                /* an IN_MOVED_FROM waits for its IN_MOVED_TO */
    uint32_t move_cookie;
    char *move_path;
    int move_is_dir;
    uint64_t move_ms;
    struct dirty dirty[DIRTY_MAX];
    int ndirty;
    struct scanned *scanned;
    size_t nscanned, scanned_cap;
};

static const struct channel_ops watch_ops;

/* ---- records ----------------------------------------------------------------- */

/* Appends one record to the stream, or notes an overflow when the host has not
 * taken what is queued: one OVERFLOW record then stands for everything dropped. */
static int record_put(struct watch_state *w, uint8_t kind, int is_dir, const char *path, const char *old)
{
    struct ostream *o = &w->out;
    size_t pl = strlen(path), ol = old ? strlen(old) : 0;
    if (pl > 65535 || ol > 65535 || o->eof) {
        return -1;
    }
    size_t n = SL_WATCH_RECORD + pl + ol;
    size_t held = (size_t)(o->end - o->acked);
    if (held + n > WATCH_QUEUE) {
        return -1;
    }
    if (held + n > o->ring_cap) {
        size_t cap = o->ring_cap ? o->ring_cap : 4096;
        while (cap < held + n) {
            cap *= 2;
        }
        if (g_ring_bytes + (cap - o->ring_cap) > RING_BUDGET) {
            return -1;
        }
        uint8_t *r = realloc(o->ring, cap);
        if (!r) {
            return -1;
        }
        g_ring_bytes += cap - o->ring_cap;
        o->ring = r;
        o->ring_cap = cap;
    }
    uint8_t *p = o->ring + held;
    p[0] = kind;
    p[1] = is_dir ? SL_WATCH_IS_DIR : 0;
    wr16(p + 2, (uint16_t)pl);
    wr16(p + 4, (uint16_t)ol);
    memcpy(p + SL_WATCH_RECORD, path, pl);
    if (ol) {
        memcpy(p + SL_WATCH_RECORD + pl, old, ol);
    }
    o->end += n;
    return 0;
}

/* What the watch's rate allows now (a token bucket), refilled to this moment. */
static double rate_refill(struct watch_state *w)
{
    uint64_t now = now_ms();
    w->tokens += (double)(now - w->tokens_ms) * w->rate / 1000.0;
    if (w->tokens > w->burst) {
        w->tokens = w->burst;
    }
    w->tokens_ms = now;
    return w->tokens;
}

/* One record's worth of the watch's rate, if there is one now. */
static int rate_take(struct watch_state *w)
{
    if (w->rate == 0) {
        return 1;
    }
    if (rate_refill(w) < 1.0) {
        return 0;
    }
    w->tokens -= 1.0;
    return 1;
}

/* After records went past the rate, the watch goes on only once a quarter of its burst
 * is back: one OVERFLOW then stands for a pause, not for every other record of a flood. */
static double rate_resume(struct watch_state *w) { return w->burst >= 4 ? w->burst / 4.0 : 1.0; }

static void emit(struct watch_state *w, uint8_t kind, int is_dir, const char *path, const char *old)
{
    if (w->file_name && strcmp(path, w->file_name) && (!old || strcmp(old, w->file_name))) {
        return; /* a file watch hears only of its own name */
    }
    if (w->overflow || !rate_take(w) || record_put(w, kind, is_dir, path, old) < 0) {
        w->overflow = 1;
    }
}

/* A directory that could not be watched: what happens below it goes unseen. */
static void emit_unwatched(struct watch_state *w, const char *path)
{
    if (w->overflow || !rate_take(w) || record_put(w, SL_WE_OVERFLOW, 1, path, NULL) < 0) {
        w->overflow = 1;
    }
}

/* Once the host has taken enough, and the rate allows one more record, the dropped
 * records become one OVERFLOW. */
static void overflow_flush(struct watch_state *w)
{
    if (!w->overflow || w->out.eof) {
        return;
    }
    size_t held = (size_t)(w->out.end - w->out.acked);
    if (held + SL_WATCH_RECORD > WATCH_QUEUE || (w->rate && rate_refill(w) < rate_resume(w))) {
        return;
    }
    if (rate_take(w) && record_put(w, SL_WE_OVERFLOW, 1, "", NULL) == 0) {
        w->overflow = 0;
    }
}

/* The watch is over (its root went away): what is queued goes, then EOF. */
static void watch_end(struct watch_state *w)
{
    overflow_flush(w);
    if (w->fd >= 0) {
        close(w->fd);
        w->fd = -1;
    }
    w->out.eof = 1;
}

/* ---- the directory table ---------------------------------------------------------- */

static struct wnode *node_find(struct watch_state *w, int wd)
{
    for (struct wnode *n = w->nodes[(unsigned)wd % NODE_BUCKETS]; n; n = n->next) {
        if (n->wd == wd) {
            return n;
        }
    }
    return NULL;
}

static void node_drop(struct watch_state *w, struct wnode *gone)
{
    struct wnode **pp = &w->nodes[(unsigned)gone->wd % NODE_BUCKETS];
    while (*pp && *pp != gone) {
        pp = &(*pp)->next;
    }
    if (*pp) {
        *pp = gone->next;
        w->nwatches--;
    }
    free(gone->path);
    free(gone);
}

static int node_set(struct watch_state *w, int wd, const char *path)
{
    struct wnode *n = node_find(w, wd);
    char *copy = strdup(path);
    if (!copy) {
        return -1;
    }
    if (n) { /* the same directory again (a rescan): it may have moved */
        free(n->path);
        n->path = copy;
        return 0;
    }
    n = calloc(1, sizeof(*n));
    if (!n) {
        free(copy);
        return -1;
    }
    n->wd = wd;
    n->path = copy;
    n->next = w->nodes[(unsigned)wd % NODE_BUCKETS];
    w->nodes[(unsigned)wd % NODE_BUCKETS] = n;
    w->nwatches++;
    return 0;
}

static int under(const char *path, const char *dir)
{
    size_t n = strlen(dir);
    return !strncmp(path, dir, n) && (path[n] == 0 || path[n] == '/');
}

/* A directory moved within the tree: its watches (and its subdirectories') keep
 * their wds, their paths change. */
static void nodes_rename(struct watch_state *w, const char *from, const char *to)
{
    size_t fl = strlen(from), tl = strlen(to);
    for (unsigned b = 0; b < NODE_BUCKETS; b++) {
        for (struct wnode *n = w->nodes[b]; n; n = n->next) {
            if (!under(n->path, from)) {
                continue;
            }
            size_t rest = strlen(n->path) - fl;
            char *p = malloc(tl + rest + 1);
            if (p) {
                memcpy(p, to, tl);
                memcpy(p + tl, n->path + fl, rest + 1);
                free(n->path);
                n->path = p;
            }
        }
    }
}

/* A directory moved out of the tree: stop hearing of it. */
static void nodes_forget(struct watch_state *w, const char *dir)
{
    for (unsigned b = 0; b < NODE_BUCKETS; b++) {
        struct wnode *n = w->nodes[b], *next;
        for (; n; n = next) {
            next = n->next;
            if (n->wd != w->root_wd && under(n->path, dir)) {
                inotify_rm_watch(w->fd, n->wd);
                node_drop(w, n);
            }
        }
    }
}

/* ---- coalescing and pairing ------------------------------------------------------- */

static int dirty_find(struct watch_state *w, const char *path)
{
    for (int i = 0; i < w->ndirty; i++) {
        if (!strcmp(w->dirty[i].path, path)) {
            return i;
        }
    }
    return -1;
}

static void dirty_remove(struct watch_state *w, int i)
{
    free(w->dirty[i].path);
    w->dirty[i] = w->dirty[--w->ndirty];
}

static void on_modify(struct watch_state *w, const char *path)
{
    if (dirty_find(w, path) >= 0) {
        return;
    }
    char *copy = w->ndirty < DIRTY_MAX ? strdup(path) : NULL;
    if (!copy) {
        emit(w, SL_WE_MODIFIED, 0, path, NULL); /* too many open writers to coalesce: report now */
        return;
    }
    w->dirty[w->ndirty++] = (struct dirty){.path = copy, .since_ms = now_ms()};
}

/* A close after writing is the one report of a write; a close without one
 * (an O_TRUNC counts as a write) reports nothing. */
static void on_close_write(struct watch_state *w, const char *path)
{
    int i = dirty_find(w, path);
    if (i >= 0) {
        dirty_remove(w, i);
        emit(w, SL_WE_MODIFIED, 0, path, NULL);
    }
}

static void dirty_due(struct watch_state *w, uint64_t now)
{
    for (int i = 0; i < w->ndirty;) {
        if (now - w->dirty[i].since_ms >= MODIFY_SETTLE_MS) {
            emit(w, SL_WE_MODIFIED, 0, w->dirty[i].path, NULL);
            dirty_remove(w, i);
        } else {
            i++;
        }
    }
}

static void scanned_add(struct watch_state *w, int wd, const char *name)
{
    if (w->nscanned == w->scanned_cap) {
        size_t cap = w->scanned_cap ? w->scanned_cap * 2 : 64;
        if (cap > SCANNED_MAX) {
            return; /* a name may then be reported twice, never lost */
        }
        struct scanned *s = realloc(w->scanned, cap * sizeof(*s));
        if (!s) {
            return;
        }
        w->scanned = s;
        w->scanned_cap = cap;
    }
    char *copy = strdup(name);
    if (copy) {
        w->scanned[w->nscanned++] = (struct scanned){wd, copy};
    }
}

/* 1 when a scan already reported this name (the event is the same creation). */
static int scanned_take(struct watch_state *w, int wd, const char *name)
{
    for (size_t i = 0; i < w->nscanned; i++) {
        if (w->scanned[i].wd == wd && !strcmp(w->scanned[i].name, name)) {
            free(w->scanned[i].name);
            w->scanned[i] = w->scanned[--w->nscanned];
            return 1;
        }
    }
    return 0;
}

static void scanned_clear(struct watch_state *w)
{
    for (size_t i = 0; i < w->nscanned; i++) {
        free(w->scanned[i].name);
    }
    w->nscanned = 0;
}

/* ---- watching a tree -------------------------------------------------------------- */

#define NO_DEV ((dev_t)-1) /* add_tree: the parent's device is not worth comparing */

/* File systems whose changes the kernel makes without telling inotify: a watch
 * there would see nothing and cost thousands of watches (/proc, /sys). */
static int silent_fs(int dfd)
{
    struct statfs sfs;
    if (fstatfs(dfd, &sfs) < 0) {
        return 0;
    }
    switch ((unsigned long)sfs.f_type) {
    case 0x9fa0:     /* proc */
    case 0x62656572: /* sysfs */
    case 0x63677270: /* cgroup2 */
    case 0x27e0eb:   /* cgroup */
    case 0x64626720: /* debugfs */
    case 0x74726163: /* tracefs */
    case 0x73636673: /* securityfs */
    case 0xcafe4a11: /* bpf */
    case 0x6165676c: /* pstore */
    case 0x62656570: /* configfs */
    case 0x1cd1:     /* devpts */
        return 1;
    default:
        return 0;
    }
}

static int full_path(const struct watch_state *w, const char *rel, char *out, size_t n)
{
    int k = rel[0] ? snprintf(out, n, "%s/%s", strcmp(w->base, "/") ? w->base : "", rel)
                   : snprintf(out, n, "%s", w->base);
    return k < 0 || (size_t)k >= n ? -1 : 0;
}

static int join(const char *dir, const char *name, char *out, size_t n)
{
    int k = dir[0] ? snprintf(out, n, "%s/%s", dir, name) : snprintf(out, n, "%s", name);
    return k < 0 || (size_t)k >= n ? -1 : 0;
}

/* Watches the directory rel and, recursively, those below it. ``report``: its
 * entries are new to the host (a directory created or moved in), so each is
 * reported as created. The base itself may be reached through a symbolic link;
 * nothing below it is. parent_dev: its parent's device, to notice a mount. */
static void add_tree(struct watch_state *w, const char *rel, int report, int depth, dev_t parent_dev)
{
    char abs[PATH_MAX];
    int is_base = rel[0] == 0;
    if (w->fd < 0 || full_path(w, rel, abs, sizeof(abs)) < 0) {
        return;
    }
    if (w->nwatches >= WATCH_MAX || depth > MAX_DEPTH) {
        emit_unwatched(w, rel);
        return;
    }
    /* Opened first, so that what it is decides whether to watch it. */
    int dfd = open(abs, O_RDONLY | O_DIRECTORY | O_CLOEXEC | (is_base ? 0 : O_NOFOLLOW));
    struct stat dst;
    if (dfd < 0 || fstat(dfd, &dst) < 0) {
        if (dfd >= 0) {
            close(dfd);
            dfd = -1;
        }
        if (!is_base) {
            return; /* gone already, or not a directory any more: its events say so */
        }
        dst.st_dev = parent_dev;
    } else if (!is_base && parent_dev != NO_DEV && dst.st_dev != parent_dev && silent_fs(dfd)) {
        close(dfd);
        return; /* a mount of /proc or /sys below the watched path */
    }
    int wd = inotify_add_watch(w->fd, abs, DIR_MASK | (is_base ? 0 : IN_DONT_FOLLOW));
    if (wd < 0) {
        if (errno == ENOSPC || errno == ENOMEM) { /* fs.inotify.max_user_watches */
            emit_unwatched(w, rel);
        }
        if (dfd >= 0) {
            close(dfd);
        }
        return;
    }
    if (node_set(w, wd, rel) < 0) {
        if (!is_base) {
            inotify_rm_watch(w->fd, wd);
        }
        emit_unwatched(w, rel);
        if (dfd >= 0) {
            close(dfd);
        }
        return;
    }
    if (is_base && w->root_wd < 0) {
        w->root_wd = wd;
    }
    DIR *d = dfd >= 0 && (report || w->recursive) ? fdopendir(dfd) : NULL;
    if (!d) {
        if (dfd >= 0) {
            close(dfd);
        }
        return;
    }
    struct dirent *de;
    char *child = malloc(PATH_MAX); /* not on the stack: this recurses */
    while (child && (de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..") ||
            join(rel, de->d_name, child, PATH_MAX) < 0) {
            continue;
        }
        int is_dir = de->d_type == DT_DIR;
        if (de->d_type == DT_UNKNOWN) {
            struct stat st;
            is_dir = fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
        }
        if (report) {
            emit(w, SL_WE_CREATED, is_dir, child, NULL);
            scanned_add(w, wd, de->d_name);
        }
        if (is_dir && w->recursive) {
            add_tree(w, child, report, depth + 1, dst.st_dev);
        }
    }
    free(child);
    closedir(d);
}

/* An IN_MOVED_FROM whose IN_MOVED_TO did not come: the entry left the tree. */
static void move_flush(struct watch_state *w)
{
    if (!w->moving) {
        return;
    }
    w->moving = 0;
    emit(w, SL_WE_DELETED, w->move_is_dir, w->move_path, NULL);
    if (w->file_name && !strcmp(w->move_path, w->file_name)) {
        w->file_exists = 0;
    }
    if (w->move_is_dir && w->recursive) {
        nodes_forget(w, w->move_path);
    }
    free(w->move_path);
    w->move_path = NULL;
}

static void on_event(struct watch_state *w, const struct inotify_event *ev)
{
    if (ev->mask & IN_Q_OVERFLOW) {
        /* the kernel dropped events: say so, and watch what appeared meanwhile */
        move_flush(w);
        w->overflow = 1;
        if (w->recursive && !w->file_name) {
            add_tree(w, "", 0, 0, 0);
        }
        return;
    }
    struct wnode *n = node_find(w, ev->wd);
    if (!n) {
        return; /* a watch just removed */
    }
    int is_root = ev->wd == w->root_wd;
    if (w->moving && !((ev->mask & IN_MOVED_TO) && ev->cookie == w->move_cookie)) {
        move_flush(w);
    }
    if (ev->mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT)) {
        if (is_root && w->fd >= 0) {
            /* The watched path is gone. A watched directory was reported deleted
             * by nobody (its parent is not watched); a watched file was, unless
             * its directory moved away with it. */
            if (!w->file_name) {
                emit(w, SL_WE_DELETED, 1, "", NULL);
            } else if (w->file_exists && !(ev->mask & IN_DELETE_SELF)) {
                emit(w, SL_WE_DELETED, 0, w->file_name, NULL);
            }
            watch_end(w);
        } else if (ev->mask & IN_IGNORED) {
            node_drop(w, n); /* a subdirectory's watch ended (it was deleted) */
        }
        return;
    }
    if (!ev->len) {
        return;
    }
    char path[PATH_MAX];
    if (join(n->path, ev->name, path, sizeof(path)) < 0) {
        return;
    }
    int is_dir = (ev->mask & IN_ISDIR) != 0;
    if (w->file_name && strcmp(ev->name, w->file_name) && !(ev->mask & (IN_MOVED_FROM | IN_MOVED_TO))) {
        return; /* a sibling of the watched file (a move may still name it) */
    }
    if (w->file_name && !strcmp(ev->name, w->file_name)) {
        if (ev->mask & (IN_CREATE | IN_MOVED_TO)) {
            w->file_exists = 1;
        } else if (ev->mask & IN_DELETE) {
            w->file_exists = 0;
        }
    }
    if (ev->mask & IN_CREATE) {
        if (scanned_take(w, ev->wd, ev->name)) {
            return; /* reported by the scan of its new directory */
        }
        emit(w, SL_WE_CREATED, is_dir, path, NULL);
        if (is_dir && w->recursive) {
            add_tree(w, path, 1, 0, NO_DEV); /* made or moved here: on its parent's file system */
        }
    } else if (ev->mask & IN_MODIFY) {
        if (!is_dir) {
            on_modify(w, path);
        }
    } else if (ev->mask & IN_CLOSE_WRITE) {
        on_close_write(w, path);
    } else if (ev->mask & IN_DELETE) {
        scanned_take(w, ev->wd, ev->name);
        int i = dirty_find(w, path);
        if (i >= 0) {
            dirty_remove(w, i);
        }
        emit(w, SL_WE_DELETED, is_dir, path, NULL);
    } else if (ev->mask & IN_MOVED_FROM) {
        char *copy = strdup(path);
        if (!copy) {
            emit(w, SL_WE_DELETED, is_dir, path, NULL);
            return;
        }
        w->moving = 1;
        w->move_cookie = ev->cookie;
        w->move_path = copy;
        w->move_is_dir = is_dir;
        w->move_ms = now_ms();
    } else if (ev->mask & IN_MOVED_TO) {
        scanned_take(w, ev->wd, ev->name);
        if (w->moving) { /* the pair: a move within the tree */
            w->moving = 0;
            int i = dirty_find(w, w->move_path);
            if (i >= 0) { /* a file being written keeps being coalesced under its new name */
                char *p = strdup(path);
                if (p) {
                    free(w->dirty[i].path);
                    w->dirty[i].path = p;
                } else {
                    dirty_remove(w, i);
                }
            }
            emit(w, SL_WE_MOVED, is_dir, path, w->move_path);
            if (w->file_name && !strcmp(w->move_path, w->file_name) && strcmp(path, w->file_name)) {
                w->file_exists = 0;
            }
            if (is_dir && w->recursive) {
                nodes_rename(w, w->move_path, path);
            }
            free(w->move_path);
            w->move_path = NULL;
        } else { /* from outside the tree */
            emit(w, SL_WE_CREATED, is_dir, path, NULL);
            if (is_dir && w->recursive) {
                add_tree(w, path, 1, 0, NO_DEV); /* made or moved here: on its parent's file system */
            }
        }
    }
}

static void watch_read(struct watch_state *w)
{
    static char buf[64 * 1024] __attribute__((aligned(__alignof__(struct inotify_event))));
    for (int round = 0; round < 16 && w->fd >= 0; round++) {
        ssize_t n = read(w->fd, buf, sizeof(buf));
        if (n <= 0) {
            if (n < 0 && errno == EAGAIN) {
                /* every event queued before a scan has been seen: its names are
                 * no longer duplicates */
                scanned_clear(w);
            }
            return;
        }
        for (char *p = buf; p < buf + n && w->fd >= 0;) {
            const struct inotify_event *ev = (const struct inotify_event *)p;
            on_event(w, ev);
            p += sizeof(*ev) + ev->len;
        }
    }
}

/* ---- the channel -------------------------------------------------------------- */

static void state_free(struct watch_state *w)
{
    if (w->fd >= 0) {
        close(w->fd);
    }
    ostream_close(&w->out);
    for (unsigned b = 0; b < NODE_BUCKETS; b++) {
        struct wnode *n = w->nodes[b], *next;
        for (; n; n = next) {
            next = n->next;
            free(n->path);
            free(n);
        }
    }
    for (int i = 0; i < w->ndirty; i++) {
        free(w->dirty[i].path);
    }
    scanned_clear(w);
    free(w->scanned);
    free(w->move_path);
    free(w->base);
    free(w->file_name);
    free(w);
}

/* Each watch channel is an inotify instance; the kernel's default of 128 per
 * user is low for an agent whose every host may watch. */
static int inotify_open(void)
{
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0 && errno == EMFILE && g_is_pid1) {
        int p = open("/proc/sys/fs/inotify/max_user_instances", O_WRONLY | O_CLOEXEC);
        if (p >= 0) {
            ssize_t k = write(p, "1024", 4);
            (void)k;
            close(p);
            fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
        }
    }
    return fd;
}

void watch_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n)
{
    char *path = NULL;
    uint32_t flags = 0, rate = 0, burst = 0;
    if (!tlv_valid(p, n) || tlv_str(p, n, SL_T_PATH, &path) != 1 || path[0] != '/' ||
        strlen(path) >= PATH_MAX || tlv_u32(p, n, SL_T_FLAGS, &flags) < 0 || tlv_u32(p, n, SL_T_RATE, &rate) < 0 ||
        tlv_u32(p, n, SL_T_BURST, &burst) < 0) {
        free(path);
        send_error(s, ch, EINVAL, SL_WATCH, "WATCH needs an absolute PATH shorter than %d bytes", PATH_MAX);
        return;
    }
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/') {
        path[--len] = 0;
    }
    struct stat st;
    if (stat(path, &st) < 0) {
        int e = errno;
        send_error(s, ch, e, SL_WATCH, "%s: %s", path, strerror(e));
        free(path);
        return;
    }
    struct watch_state *w = calloc(1, sizeof(*w));
    if (!w) {
        send_error(s, ch, ENOMEM, SL_WATCH, "out of memory");
        free(path);
        return;
    }
    ostream_init(&w->out, -1, 0);
    w->recursive = (flags & SL_WATCH_RECURSIVE) != 0;
    w->rate = rate;
    w->burst = burst ? burst : (rate ? rate : 1);
    w->tokens = w->burst;
    w->tokens_ms = now_ms();
    w->root_wd = -1;
    w->fd = inotify_open();
    int err = w->fd < 0 ? errno : 0;
    if (S_ISDIR(st.st_mode)) {
        w->base = path;
    } else {
        char *slash = strrchr(path, '/');
        w->file_name = strdup(slash + 1);
        if (slash == path) {
            free(path);
            w->base = strdup("/");
        } else {
            *slash = 0;
            w->base = path;
        }
        w->recursive = 0;
        w->file_exists = 1;
        if (!w->file_name || !w->base) {
            err = ENOMEM;
        }
    }
    if (!err) {
        add_tree(w, "", 0, 0, 0);
        err = w->root_wd < 0 ? (errno ? errno : ENOMEM) : 0;
    }
    if (err) {
        send_error(s, ch, err, SL_WATCH, "cannot watch %s: %s", w->base ? w->base : "", strerror(err));
        state_free(w);
        return;
    }
    struct channel *c = chan_new(s, ch, &watch_ops);
    if (!c) {
        send_error(s, ch, errno, SL_WATCH, "cannot open a channel: %s", strerror(errno));
        state_free(w);
        return;
    }
    c->u.watch.st = w;
    struct msg m;
    msg_init(&m);
    msg_str(&m, SL_T_PATH, w->base);
    msg_u32(&m, SL_T_MODE, st.st_mode);
    msg_u32(&m, SL_T_COUNT, w->nwatches);
    msg_u32(&m, SL_T_WINDOW, SL_WINDOW);
    send_msg(s, SL_WATCH_STARTED, 0, ch, &m);
}

static void watch_release(struct channel *c)
{
    if (c->u.watch.st) {
        state_free(c->u.watch.st);
        c->u.watch.st = NULL;
    }
}

static void watch_progress(struct channel *c)
{
    struct watch_state *w = c->u.watch.st;
    uint64_t now = now_ms();
    if (w->moving && now - w->move_ms >= MOVE_PAIR_MS) {
        move_flush(w);
    }
    if (w->ndirty) {
        dirty_due(w, now);
    }
    overflow_flush(w);
    ostream_pump(c, SL_STREAM_STDOUT, &w->out);
}

static int watch_wait(struct channel *c, struct chan_wait *wt, uint64_t now, int *timeout_ms)
{
    struct watch_state *w = c->u.watch.st;
    uint64_t due = UINT64_MAX;
    if (w->moving) {
        due = w->move_ms + MOVE_PAIR_MS;
    }
    if (w->overflow && w->rate && w->tokens < rate_resume(w)) { /* the OVERFLOW goes once the rate allows */
        uint64_t later = w->tokens_ms + 1 + (uint64_t)((rate_resume(w) - w->tokens) * 1000.0 / w->rate);
        if (later < due) {
            due = later;
        }
    }
    for (int i = 0; i < w->ndirty; i++) {
        if (w->dirty[i].since_ms + MODIFY_SETTLE_MS < due) {
            due = w->dirty[i].since_ms + MODIFY_SETTLE_MS;
        }
    }
    if (due != UINT64_MAX) {
        int t = due > now ? (int)(due - now) : 0;
        if (t < *timeout_ms) {
            *timeout_ms = t;
        }
    }
    if (w->fd < 0) {
        return 0;
    }
    /* read even while the host does not: the tree must stay watched, and the
     * records dropped meanwhile are reported as one overflow */
    *wt = (struct chan_wait){.fd = w->fd, .events = POLLIN, .slot = SL_STREAM_STDOUT};
    return 1;
}

static void watch_ready(struct channel *c, int slot) { watch_read(c->u.watch.st); }

static struct ostream *watch_output(struct channel *c, uint32_t stream)
{
    return stream == SL_STREAM_STDOUT ? &c->u.watch.st->out : NULL;
}

/* A reconnected host resumes the stream from what it acknowledged; meanwhile
 * the watch went on, within its queue. */
static int watch_disconnected(struct channel *c) { return 1; }

/* DATA on stream 0: a barrier (a token of 1 to 64 printable bytes). What the kernel
 * queued before it, inotify's queue read now, and a move whose other half is not there
 * with it (it left the tree), goes out before a BARRIER record whose path is the token:
 * a host that made a change and then reads up to its barrier has that change's events. */
static int watch_input(struct channel *c, uint8_t type, uint64_t off, const uint8_t *d, size_t n)
{
    struct watch_state *w = c->u.watch.st;
    char token[65];
    if (type != SL_DATA || n == 0 || n > 64) {
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        if (d[i] < 0x21 || d[i] > 0x7e) {
            return -1;
        }
        token[i] = (char)d[i];
    }
    token[n] = 0;
    if (w->fd >= 0) {
        watch_read(w);
    }
    move_flush(w);
    record_put(w, SL_WE_BARRIER, 0, token, NULL); /* past the rate: the host waits on it */
    send_ack(c->s, c->id, SL_STREAM_STDIN, off + n);
    return 0;
}

static const struct channel_ops watch_ops = {
    .name = "watch",
    .release = watch_release,
    .progress = watch_progress,
    .wait = watch_wait,
    .ready = watch_ready,
    .output = watch_output,
    .input = watch_input,
    .disconnected = watch_disconnected,
};
