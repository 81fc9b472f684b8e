/* A file tree's manifest (SL_FS_TREE): every path under a directory with what a
 * comparison needs (type and mode, owner, size, times, inode, links, device
 * number, a link's target), streamed in batches as a listing is. The host
 * compares two manifests to tell what changed between two states of a box
 * (api diff): equal inode, size and change time mean an unchanged file, so
 * only the files that differ are read.
 *
 * The walk stays on the device it starts on, as find -xdev does: /proc, /sys,
 * /dev, /run and the files bound over /etc from /run are other file systems,
 * not the box's disk. It holds one open directory per level, so it needs no
 * memory for the tree beyond the current path. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent.h"

#define TREE_ENTRY_FIXED 60u
#define TREE_BATCH (256u * 1024u)
#define TREE_DEPTH 1024
#define TREE_PATH 16384

struct tree_walk {
    dev_t dev;
    int depth;                 /* directories open */
    DIR *dirs[TREE_DEPTH];
    size_t ends[TREE_DEPTH];   /* the length of path that names dirs[i] */
    char path[TREE_PATH];      /* relative to the root: "" for it, "etc/passwd" */
};

static void put_tree_entry(struct msg *m, const char *rel, const struct stat *st, const char *target)
{
    size_t nl = strlen(rel), tl = target ? strlen(target) : 0;
    if (tl > 65535) {
        tl = 65535;
    }
    uint8_t *e = malloc(TREE_ENTRY_FIXED + nl + tl);
    if (!e) {
        m->overflow = MSG_NO_MEMORY;
        return;
    }
    wr_stat_head(e, st);
    wr64(e + 32, ns_of(st->st_ctim));
    wr64(e + 40, (uint64_t)st->st_ino);
    wr64(e + 48, (uint64_t)st->st_rdev);
    wr16(e + 56, (uint16_t)nl);
    wr16(e + 58, (uint16_t)tl);
    memcpy(e + TREE_ENTRY_FIXED, rel, nl);
    if (tl) {
        memcpy(e + TREE_ENTRY_FIXED + nl, target, tl);
    }
    msg_put(m, SL_T_TREE_ENTRY, e, (uint32_t)(TREE_ENTRY_FIXED + nl + tl));
    free(e);
}

static void walk_close(struct tree_walk *w)
{
    while (w->depth > 0) {
        closedir(w->dirs[--w->depth]);
    }
}

static void tree_release(struct channel *c)
{
    struct tree_walk *w = c->u.tree.walk;
    if (w) {
        walk_close(w);
        free(w);
        c->u.tree.walk = NULL;
    }
}

/* Enter rel's directory (name in the directory on top of the stack). */
static int walk_push(struct tree_walk *w, const char *name)
{
    if (w->depth >= TREE_DEPTH) {
        errno = ELOOP;
        return -1;
    }
    int parent = w->depth ? dirfd(w->dirs[w->depth - 1]) : AT_FDCWD;
    int fd = open_dir_nofollow(parent, name);
    if (fd < 0) {
        return -1;
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    w->dirs[w->depth] = d;
    w->ends[w->depth] = strlen(w->path);
    w->depth++;
    return 0;
}

static void tree_fail(struct channel *c, int e, const char *what)
{
    struct tree_walk *w = c->u.tree.walk;
    send_error(c->s, c->id, e, SL_FS, "tree cut short at %s: %s", w->path[0] ? w->path : "/", what);
    chan_free(c);
}

static void tree_progress(struct channel *c)
{
    struct session *s = c->s;
    struct tree_walk *w = c->u.tree.walk;
    if (!w || !s->connected || !s->hello_done || session_congested(s)) {
        return;
    }
    struct msg m;
    msg_init(&m);
    while (m.len < TREE_BATCH && w->depth > 0) {
        DIR *d = w->dirs[w->depth - 1];
        size_t base = w->ends[w->depth - 1];
        errno = 0;
        struct dirent *de = readdir(d);
        if (!de) {
            if (errno) {
                int e = errno;
                msg_free(&m);
                tree_fail(c, e, strerror(e));
                return;
            }
            closedir(d);
            w->depth--;
            w->path[w->depth ? w->ends[w->depth - 1] : 0] = 0; /* back to the parent's path */
            continue;
        }
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) {
            continue;
        }
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            continue; /* removed while walking */
        }
        if (st.st_dev != w->dev) {
            continue; /* another file system mounted here */
        }
        size_t nl = strlen(de->d_name);
        if (base + (base ? 1 : 0) + nl + 1 > TREE_PATH) {
            msg_free(&m);
            tree_fail(c, ENAMETOOLONG, "a path longer than the manifest takes");
            return;
        }
        char *at = w->path + base;
        if (base) {
            *at++ = '/';
        }
        memcpy(at, de->d_name, nl + 1);
        char *target = S_ISLNK(st.st_mode) ? read_link_at(dirfd(d), de->d_name) : NULL;
        put_tree_entry(&m, w->path, &st, target);
        free(target);
        if (S_ISDIR(st.st_mode)) {
            if (walk_push(w, de->d_name) < 0) {
                int e = errno;
                if (e == ENOENT || e == ENOTDIR || e == ELOOP) { /* replaced while walking */
                    w->path[base] = 0;
                    continue;
                }
                msg_free(&m);
                tree_fail(c, e, strerror(e));
                return;
            }
            continue; /* path stays: it names the directory just entered */
        }
        w->path[base] = 0;
    }
    int done = w->depth == 0;
    send_msg(s, SL_FS_RESULT, done ? 0 : SL_FLAG_MORE, c->id, &m);
    if (done) {
        chan_free(c);
    }
}

static const struct channel_ops tree_ops = {
    .name = "file tree",
    .release = tree_release,
    .progress = tree_progress,
    .wait = batch_wait,                 /* paced, and restarted by the host, as a listing is */
    .disconnected = batch_disconnected,
};

int tree_start(struct session *s, uint32_t ch, const char *path, int self_only)
{
    struct stat st;
    if (lstat(path, &st) < 0) {
        return -1;
    }
    if (self_only) {
        char *target = S_ISLNK(st.st_mode) ? read_link_at(AT_FDCWD, path) : NULL;
        struct msg m;
        msg_init(&m);
        put_tree_entry(&m, "", &st, target);
        free(target);
        send_msg(s, SL_FS_RESULT, 0, ch, &m);
        return 0;
    }
    if (!S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return -1;
    }
    struct tree_walk *w = calloc(1, sizeof(*w));
    if (!w) {
        return -1;
    }
    w->dev = st.st_dev;
    if (walk_push(w, path) < 0) {
        int e = errno;
        free(w);
        errno = e;
        return -1;
    }
    w->ends[0] = 0;
    struct channel *c = chan_new(s, ch, &tree_ops);
    if (!c) {
        int e = errno;
        walk_close(w);
        free(w);
        errno = e;
        return -1;
    }
    c->u.tree.walk = w;
    struct msg m; /* the root itself first, as "" */
    msg_init(&m);
    put_tree_entry(&m, "", &st, NULL);
    send_msg(s, SL_FS_RESULT, SL_FLAG_MORE, ch, &m);
    tree_progress(c);
    return 0;
}
