/* sandlot guest agent: shared declarations.
 *
 * One process, one thread, one poll loop. It is PID 1 in the guest (init.c),
 * serves any number of sessions (one per virtio-serial port named "sandlot.*",
 * or stdin/stdout in host mode), and each session multiplexes channels: one per
 * exec, file transfer or file-system request. Every buffer has a fixed bound, so
 * a hostile or buggy host cannot make the agent allocate without limit.
 *
 * main.c runs the poll loop; transport.c moves frames to and from a session;
 * dispatch.c says what a frame means; channel.c keeps the table of channels;
 * stream.c holds the output streams. Each kind of channel (exec.c; files.c:
 * read, write, directory listing; watch.c: file-system events) owns its member
 * of struct channel's union and the struct channel_ops through which everything
 * else reaches it. */
#ifndef SANDLOT_AGENT_H
#define SANDLOT_AGENT_H

#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>

#include "proto.h"

#define AGENT_VERSION "0.1.0"

/* ---- byte buffers ---------------------------------------------------- */

struct buf {
    uint8_t *data;
    size_t head; /* first unconsumed byte */
    size_t len;  /* end of valid bytes */
    size_t cap;
};

int buf_reserve(struct buf *b, size_t extra);
int buf_append(struct buf *b, const void *p, size_t n);
void buf_consume(struct buf *b, size_t n);
size_t buf_used(const struct buf *b);
void buf_free(struct buf *b);
void buf_reset(struct buf *b);

/* ---- TLV payloads ---------------------------------------------------- */

struct tlv_iter {
    const uint8_t *p;
    size_t left;
};

struct tlv {
    uint16_t tag;
    uint32_t len;
    const uint8_t *val;
};

int tlv_valid(const uint8_t *p, size_t n);
void tlv_begin(struct tlv_iter *it, const uint8_t *p, size_t n);
int tlv_next(struct tlv_iter *it, struct tlv *out);
/* Lookups return 1 when found, 0 when absent, -1 when present but malformed. */
int tlv_u32(const uint8_t *p, size_t n, uint16_t tag, uint32_t *out);
int tlv_u64(const uint8_t *p, size_t n, uint16_t tag, uint64_t *out);
/* Strings: copies into a NUL-terminated malloc'd string; -1 if it holds a NUL. */
int tlv_str(const uint8_t *p, size_t n, uint16_t tag, char **out);
int tlv_bytes(const uint8_t *p, size_t n, uint16_t tag, const uint8_t **val, uint32_t *len);

/* A message under construction; bounded by SL_MAX_PAYLOAD. */
struct msg {
    uint8_t *data;
    size_t len;
    size_t cap;
    int overflow; /* MSG_TOO_BIG or MSG_NO_MEMORY: what went wrong, the message is void */
};
#define MSG_TOO_BIG 1
#define MSG_NO_MEMORY 2

void msg_init(struct msg *m);
void msg_free(struct msg *m);
void msg_put(struct msg *m, uint16_t tag, const void *val, uint32_t len);
void msg_u32(struct msg *m, uint16_t tag, uint32_t v);
void msg_u64(struct msg *m, uint16_t tag, uint64_t v);
void msg_str(struct msg *m, uint16_t tag, const char *s);

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32); }
static inline void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void wr32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
static inline void wr64(uint8_t *p, uint64_t v) { wr32(p, (uint32_t)v); wr32(p + 4, (uint32_t)(v >> 32)); }
static inline uint64_t ns_of(struct timespec t) { return (uint64_t)((int64_t)t.tv_sec * 1000000000LL + t.tv_nsec); }
/* The first 32 bytes of a file's entry on the wire, the same in a listing (files.c)
 * and a tree's walk (tree.c): mode, uid, gid, links, size, mtime in ns (protocol/files.py). */
static inline void wr_stat_head(uint8_t *e, const struct stat *st)
{
    wr32(e, st->st_mode);
    wr32(e + 4, st->st_uid);
    wr32(e + 8, st->st_gid);
    wr32(e + 12, (uint32_t)st->st_nlink);
    wr64(e + 16, (uint64_t)st->st_size);
    wr64(e + 24, ns_of(st->st_mtim));
}

/* ---- sessions (transport.c) ----------------------------------------- */

/* Output the agent produces for one session. Beyond OUT_SOFT_LIMIT no new data
 * is produced; beyond OUT_HARD_LIMIT the session stops reading requests. */
#define OUT_SOFT_LIMIT (2u << 20)
#define OUT_HARD_LIMIT (8u << 20)

struct session {
    int in_fd, out_fd;
    char name[64];
    char dev[300];
    int is_port;          /* a virtio-serial port (reconnects) rather than a pipe */
    int listen_fd;        /* >0: a listening Unix socket whose connections this session takes */
    int connected;        /* the host end is open */
    int hello_done;
    uint8_t token[16];
    int has_token;
    struct buf in;        /* partial frame */
    size_t discard;       /* bytes of an oversized frame still to skip */
    int resync;           /* lost framing: scanning for the next magic */
    uint64_t last_input_ms; /* when the pending partial frame began (0: none); dropped when stale */
    uint64_t frames_in;     /* frames parsed, to tell progress from a stuck partial frame */
    struct buf out;       /* frames waiting for the port */
    int lost_output;      /* a frame could not be finished: the session is given up (transport.c) */
    uint32_t nchannels;
};

struct pollfd;

void send_frame(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, const void *p, size_t n);
void send_msg(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, struct msg *m);
void send_error(struct session *s, uint32_t ch, int err, uint8_t frame_type, const char *fmt, ...);
void send_ack(struct session *s, uint32_t ch, uint32_t stream, uint64_t off);
/* 0: sent or queued whole; -1: not sent at all (out of memory), to be sent again */
int send_data(struct session *s, uint32_t ch, uint32_t stream, uint64_t off, const void *p, size_t n);
int send_eof(struct session *s, uint32_t ch, uint32_t stream, uint64_t off);
int session_live(const struct session *s);      /* frames sent now reach a host */
int session_congested(const struct session *s); /* stop producing output for it */
void session_open_fd(struct session *s, int fd); /* host mode: one socket */
int open_ports(struct session *sessions, int max, int want); /* guest: every sandlot.* port */
int port_check(struct session *s);
int open_listeners(struct session *sessions, int max, const char *dir, int want); /* container: one socket a port */
void listener_accept(struct session *s);
/* The loop's share: what to poll for (at most 2 fds), what came of it. */
int session_poll(struct session *s, struct pollfd *pfds, int *timeout_ms);
void session_events(struct session *s, short revents);
void session_write(struct session *s);
void session_drop_stale(struct session *s, uint64_t now);

/* ---- streams (stream.c) --------------------------------------------- */

struct ostream {              /* agent -> host, e.g. stdout */
    int fd;                   /* -1 once closed */
    int is_file;              /* regular file: always readable, no poll */
    int eof;                  /* source exhausted */
    int eof_sent;
    uint64_t acked;           /* host has consumed up to here */
    uint64_t sent;            /* sent up to here */
    uint64_t end;             /* read from the source up to here */
    uint64_t limit;           /* stop after this many bytes (file ranges) */
    uint8_t *ring;            /* bytes [acked, end) */
    size_t ring_cap;
    int stalled;              /* the last send found no memory: try again soon (ostream_wait) */
};

struct istream {              /* host -> agent, e.g. stdin */
    int fd;                   /* -1 when closed */
    uint64_t received;        /* bytes accepted from the host */
    uint64_t written;         /* bytes written to fd */
    uint64_t acked_sent;      /* last ACK sent to the host */
    int eof;                  /* host sent EOF */
    int gone;                 /* the process stopped reading: later input is dropped, not refused */
    struct buf pending;
};

extern size_t g_ring_bytes;  /* memory held by all output rings */
#define RING_BUDGET (64u << 20)

struct channel;
struct chan_wait;

void ostream_init(struct ostream *o, int fd, int is_file);
void ostream_close(struct ostream *o);
int ostream_can_read(const struct ostream *o);
int ostream_fill(struct ostream *o);   /* 1 progressed, 0 would block, -1 error */
void ostream_pump(struct channel *c, uint32_t stream, struct ostream *o);
void ostream_ack(struct ostream *o, uint64_t off);
/* Its share of a channel's wait: 1 when it filled *w, else 0 (a regular file
 * needs no poll and sets the timeout to 0 instead). */
int ostream_wait(const struct ostream *o, struct chan_wait *w, int slot, int *timeout_ms);

/* ---- channels (channel.c) ------------------------------------------- */

/* Each kind's state, reachable only through its member of the channel's union. */

struct exec_channel {         /* exec.c */
    pid_t pid;
    int tty;
    int exited;
    int status;
    int exit_sent;
    uint64_t quiet_since_ms;  /* after exit: when output last moved */
    struct ostream out[3];    /* index 1 stdout, 2 stderr */
    struct istream in;
    uint32_t cgroup;          /* the command's cgroup (limits.c); 0: none */
    int oom_killed;           /* the OOM killer struck inside it */
    int end_signal;           /* a child of the agent's own (exec_follow): what ends it when let go */
};

struct file_read_channel {    /* files.c */
    struct ostream out;       /* stream 1 */
    uint64_t acked_seen;      /* the host's last ACK, as last seen */
    uint64_t active_ms;       /* when the host last acknowledged (or opened) it */
};

struct file_write_channel {   /* files.c */
    int fd;
    char *tmp_path;           /* NULL: appending, or renamed into place */
    char *final_path;
    uint32_t mode;
    int mode_set;
    uid_t uid;
    gid_t gid;
    int own_set;
    uint32_t flags;
    uint64_t bytes;
    uint64_t acked;
};

struct dir_channel {          /* files.c: a directory listing */
    DIR *dir;
    char *xprefix; /* each entry's extended attributes of these names too (NULL: none) */
};

struct tree_walk;
struct tree_channel {         /* tree.c: a file tree's manifest */
    struct tree_walk *walk;
};

struct watch_state;
struct watch_channel {        /* watch.c: inotify on a path, events as records on stream 1 */
    struct watch_state *st;
};

/* One descriptor a channel wants the loop to wait on. The slot is the kind's
 * own name for it, handed back to ready() (exec and file reads use the stream). */
struct chan_wait {
    int fd;
    short events;
    int slot;
};
#define CHAN_WAITS 3 /* the most one channel asks for: an exec's stdout, stderr, stdin */

/* What the code outside a kind may ask of a channel of that kind. Each kind's
 * file defines one table and hands it to chan_new, so dispatch, the loop and
 * the channel table never look inside the union. Only release is required. */
struct channel_ops {
    const char *name;         /* for logs and debuggers */
    /* Gives back what the kind holds (descriptors, files, cgroup); chan_free
     * then frees the channel. Runs on any channel chan_new returned. */
    void (*release)(struct channel *c);
    /* Once per loop round: move data, report an end. May free c. */
    void (*progress)(struct channel *c);
    /* What the loop waits on for it: fills up to CHAN_WAITS entries, returns
     * how many, and lowers *timeout_ms when progress() has work due. ready()
     * hears of each entry that polled ready; a kind that waits needs it. */
    int (*wait)(struct channel *c, struct chan_wait *w, uint64_t now, int *timeout_ms);
    void (*ready)(struct channel *c, int slot);
    /* Output stream 1 or 2, for ACK, RESUME and a reconnection; NULL: none. */
    struct ostream *(*output)(struct channel *c, uint32_t stream);
    /* DATA or EOF for stream 0 (n is 0 for EOF); may free c. -1, or no hook:
     * the channel takes no input, which the caller reports. */
    int (*input)(struct channel *c, uint8_t type, uint64_t off, const uint8_t *d, size_t n);
    /* RESUME, after the output streams were rewound: tell the host again
     * where input stands, and report again what was reported. */
    void (*resume)(struct channel *c);
    /* The host connection dropped; its output streams get rewound to what was
     * acknowledged. 0: free the channel instead (the host restarts this kind,
     * it does not resume it). No hook: keep it as it is. */
    int (*disconnected)(struct channel *c);
    /* The host let go of it (CLOSE, or a new host took the session). 1: it
     * keeps running unheard, its output dropped; 0 or no hook: free it. */
    int (*detach)(struct channel *c);
    /* SIGNAL and RESIZE: only a kind that runs a process has these. */
    void (*signal)(struct channel *c, const uint8_t *p, size_t n);
    void (*resize)(struct channel *c, const uint8_t *p, size_t n);
};

struct channel {
    struct channel *next;
    struct session *s;
    uint32_t id;
    const struct channel_ops *ops; /* tells which member of u is live */
    int detached;             /* host closed the channel: discard output */
    int awaiting_resume;      /* its host went away: send nothing until a host RESUMEs it */
    union {
        struct exec_channel exec;
        struct file_read_channel read;
        struct file_write_channel write;
        struct dir_channel dir;
        struct tree_channel tree;
        struct watch_channel watch;
    } u;
};

extern struct channel *g_channels;

/* The kind's member of u starts zeroed: its start function sets its
 * descriptors right away, before anything can free the channel. */
struct channel *chan_new(struct session *s, uint32_t id, const struct channel_ops *ops);
void chan_free(struct channel *c);
struct channel *chan_find(struct session *s, uint32_t id);
int chan_alive(const struct channel *c);
struct ostream *chan_output(struct channel *c, uint32_t stream);
void chan_let_go(struct channel *c);
void chan_disconnect_all(struct session *s);
void chan_orphan_all(struct session *s);

/* ---- relay mode (relay.c) -------------------------------------------- */

int relay_main(const char *target); /* a TCP port number, or an absolute Unix socket path */

/* ---- frames (dispatch.c) -------------------------------------------- */

void dispatch_init(uint64_t now);
void dispatch(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, const uint8_t *p, size_t n);

/* ---- the process (main.c) ------------------------------------------- */

extern int g_safe_mode;      /* host fuzzing: refuse exec and mutations */
extern int g_read_idle_ms;   /* a file read the host has not touched for this long is closed */
extern int g_is_pid1;
uint64_t now_ms(void);
void logmsg(const char *fmt, ...);

/* exec.c */
void exec_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n);
void exec_reaped(pid_t pid, int status);
/* Follow a child the agent forked itself (archive.c) as an exec: its stdin (-1: none),
 * stdout and stderr (the agent's ends of pipes), its cgroup, and the signal that ends it
 * when its host lets go (0: its stdin closes, nothing more). EXEC_STARTED goes to the
 * host; -1 and errno: no channel (the caller ends the child). */
int exec_follow(struct session *s, uint32_t ch, pid_t pid, int in_fd, int out_fd, int err_fd, uint32_t cgroup,
                int end_signal);

/* archive.c */
void archive_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n);

/* files.c */
void file_read_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n);
void file_write_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n);
void fs_request(struct session *s, uint32_t ch, const uint8_t *p, size_t n);
/* files.c, for tree.c too: a link's target (malloc'd; NULL on failure), and the pacing
 * of an answer sent in batches (a listing, a tree): the next batch as soon as the
 * session takes more output; restarted by the host after a reconnection. */
char *read_link_at(int dirfd, const char *name);
int remove_tree_at(int dirfd, const char *name); /* a tree, no link followed; 0 if it was not there */
/* A directory by name, never through a link (ELOOP for one; ENOTDIR): O_NOFOLLOW with
 * O_DIRECTORY is not enough everywhere (gVisor opens the directory a link points to),
 * so the name is opened O_PATH without following, checked, and that inode reopened. */
int open_dir_nofollow(int dirfd, const char *name);
int batch_wait(struct channel *c, struct chan_wait *w, uint64_t now, int *timeout_ms);
int batch_disconnected(struct channel *c);
/* tree.c: start streaming the manifest of the tree at path (-1 and errno: not begun);
 * self_only: the path's own entry, whatever its type */
int tree_start(struct session *s, uint32_t ch, const char *path, int self_only);

/* watch.c */
void watch_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n);

/* users.c */
struct user_spec {
    uid_t uid;
    gid_t gid;
    char name[64];
    char home[256];
    char shell[256];
    gid_t groups[64];
    int ngroups;
};
int resolve_user(const char *spec, struct user_spec *u, char *err, size_t errlen);
int find_group(const char *name, gid_t *gid); /* the guest's /etc/group; 0: none */

/* stats.c */
uint64_t now_us(void);
void stats_exec_started(uint64_t since_us); /* a command runs, asked for at since_us */
void stats_add(struct msg *m);              /* the guest's figures, for STATUS */

/* dns.c */
void dns_relay_start(void);      /* PID 1, at network bring-up in the proxied modes */
int dns_relay_reaped(pid_t pid); /* 1: it was the relay's (restarted) */
void close_inherited(int keep);  /* in a child: every descriptor above 2 but keep */
void become_helper(const char *name, int keep); /* a helper child's name, OOM score, descriptors */
void restart_helper(const char *what, uint64_t started_ms, void (*start)(void)); /* one that ended */

/* 10.0.2.100: sandlot's address on QEMU's user network (the DNS relay's host, the egress
 * child's hook), net/addresses.py's PROXY_ADDRESS */
#define SL_PROXY_ADDR 0x0a000264u

/* egress.c */
void egress_start(void);                  /* PID 1, at network bring-up where the port exists */
int egress_reaped(pid_t pid, int status); /* 1: it was the egress child's */

/* limits.c */
void limits_init(void);
void limits_set_pids(uint32_t max); /* 0: no limit */
uint32_t exec_cgroup_new(char *procs_path, size_t n);
void exec_cgroup_join(const char *procs_path); /* in the vfork child */
int exec_cgroup_oom_killed(uint32_t id, int certain);
void limits_oom_event(void); /* g_oom_fd polled POLLPRI */
extern int g_oom_fd;
void exec_cgroup_release(uint32_t id);
void limits_watch_memory(uint64_t mib); /* be the box's OOM killer (gVisor has none) */
int limits_timeout(int timeout, uint64_t now_ms); /* the poll timeout, shortened while watching */
void limits_check(uint64_t now_ms);               /* the memory watch, a freeze's lease */
/* every command frozen (a save of a box with VMs of its own), until limits_thaw or
 * lease_ms of guest time; -1 and err where they did not all stop within wait_ms */
int limits_freeze(uint32_t lease_ms, uint32_t wait_ms, char *err, size_t errlen);
void limits_thaw(void); /* the shares taken down for the save go up first */
int limits_frozen(void);
void exec_mark_oom(pid_t sid); /* the command of session sid lost a process to it */

/* init.c */
void init_early(void);          /* mounts, modules, root switch (PID 1 only) */
void init_after_root(void);
void network_given(int dns_relay); /* --net[=relay]: a sandbox's card, configured already */
int wait_for(const char *path, int ms); /* a device node to appear */
int read_sys(const char *path, char *buf, size_t n); /* a sysfs file's first line; its length, or -1 */
int boot_ports(void);          /* sandlot.ports=N from the kernel command line (0: not given) */
void set_hostname(const char *name);
int mount_volume(const char *tag, const char *where, uint32_t flags);
/* every 9p share unmounted for a save (the commands frozen); -1, errno and err (naming
 * the processes that keep one busy) with all of them up again */
int shares_detach(char *err, size_t errlen);
void shares_attach(void); /* up again: before the commands thaw */
void add_entropy(const uint8_t *p, size_t n);
void set_wall_clock(uint64_t ns);
void set_machine_id(const char *id);
int set_aslr(int want); /* the value in force after, -1 where the kernel has none */
void shutdown_guest(struct session *s, uint32_t ch, uint32_t timeout_ms);
const char *boot_id(void);

#endif
