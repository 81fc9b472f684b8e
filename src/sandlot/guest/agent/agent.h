/* sandlot guest agent: shared declarations.
 *
 * One process, one thread, one poll loop. It is PID 1 in the guest (init.c),
 * serves any number of sessions (one per virtio-serial port named "sandlot.*",
 * or stdin/stdout in host mode), and each session multiplexes channels: one per
 * exec, file transfer or file-system request. Every buffer has a fixed bound, so
 * a hostile or buggy host cannot make the agent allocate without limit. */
#ifndef SANDLOT_AGENT_H
#define SANDLOT_AGENT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

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
    int overflow;
};

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

/* ---- sessions and channels ------------------------------------------- */

/* Output the agent produces for one session. Beyond OUT_SOFT_LIMIT no new data
 * is produced; beyond OUT_HARD_LIMIT the session stops reading requests. */
#define OUT_SOFT_LIMIT (2u << 20)
#define OUT_HARD_LIMIT (8u << 20)

struct session {
    int in_fd, out_fd;
    char name[64];
    char dev[300];
    int is_port;          /* a virtio-serial port (reconnects) rather than a pipe */
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
    uint32_t nchannels;
};

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
};

struct istream {              /* host -> agent, e.g. stdin */
    int fd;                   /* -1 when closed */
    uint64_t received;        /* bytes accepted from the host */
    uint64_t written;         /* bytes written to fd */
    uint64_t acked_sent;      /* last ACK sent to the host */
    int eof;                  /* host sent EOF */
    struct buf pending;
};

enum chan_kind { CH_EXEC = 1, CH_FILE_READ, CH_FILE_WRITE, CH_LIST };

struct channel {
    struct channel *next;
    struct session *s;
    uint32_t id;
    int kind;
    int detached;             /* host closed the channel: discard output */

    /* exec */
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

    /* file write */
    int wfd;
    char *tmp_path;
    char *final_path;
    uint32_t wmode;
    int wmode_set;
    uid_t wuid;
    gid_t wgid;
    int wown_set;
    uint32_t wflags;
    uint64_t wbytes;
    uint64_t wacked;

    /* directory listing */
    void *dir;
};

/* globals (main.c) */
extern struct channel *g_channels;
extern int g_safe_mode;      /* host fuzzing: refuse exec and mutations */
extern int g_is_pid1;
extern size_t g_ring_bytes;  /* memory held by all output rings */
#define RING_BUDGET (64u << 20)

/* main.c */
void send_frame(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, const void *p, size_t n);
void send_msg(struct session *s, uint8_t type, uint8_t flags, uint32_t ch, struct msg *m);
void send_error(struct session *s, uint32_t ch, int err, uint8_t frame_type, const char *fmt, ...);
void send_ack(struct session *s, uint32_t ch, uint32_t stream, uint64_t off);
struct channel *chan_new(struct session *s, uint32_t id, int kind);
void chan_free(struct channel *c);
uint64_t now_ms(void);
void logmsg(const char *fmt, ...);

/* streams (main.c) */
void ostream_init(struct ostream *o, int fd, int is_file);
void ostream_close(struct ostream *o);
int ostream_can_read(const struct ostream *o);
int ostream_fill(struct ostream *o);   /* 1 progressed, 0 would block, -1 error */
void ostream_pump(struct channel *c, uint32_t stream, struct ostream *o);
void ostream_ack(struct ostream *o, uint64_t off);

/* exec.c */
void exec_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n);
void exec_signal(struct channel *c, const uint8_t *p, size_t n);
void exec_resize(struct channel *c, const uint8_t *p, size_t n);
void exec_reaped(pid_t pid, int status);
void exec_progress(struct channel *c);
void istream_flush(struct channel *c);

/* files.c */
void file_read_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n);
void file_write_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n);
void file_write_data(struct channel *c, uint64_t off, const uint8_t *d, size_t n);
void file_write_eof(struct channel *c, uint64_t off);
void file_write_abort(struct channel *c);
void file_read_progress(struct channel *c);
void list_progress(struct channel *c);
void list_close(struct channel *c);
void fs_request(struct session *s, uint32_t ch, const uint8_t *p, size_t n);

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

/* dns.c */
void dns_relay_start(void);      /* PID 1, at network bring-up in the proxied modes */
int dns_relay_reaped(pid_t pid); /* 1: it was the relay's (restarted) */

/* init.c */
/* limits.c */
void limits_init(void);
void limits_set_pids(uint32_t max); /* 0: no limit */
uint32_t exec_cgroup_new(char *procs_path, size_t n);
void exec_cgroup_join(const char *procs_path); /* in the vfork child */
int exec_cgroup_oom_killed(uint32_t id, int certain);
void limits_oom_event(void); /* g_oom_fd polled POLLPRI */
extern int g_oom_fd;
void exec_cgroup_release(uint32_t id);

void init_early(void);          /* mounts, modules, root switch (PID 1 only) */
void init_after_root(void);
void set_hostname(const char *name);
int mount_volume(const char *tag, const char *where, int readonly);
void add_entropy(const uint8_t *p, size_t n);
void set_wall_clock(uint64_t ns);
void set_machine_id(const char *id);
void shutdown_guest(struct session *s, uint32_t ch, uint32_t timeout_ms);
const char *boot_id(void);
int open_ports(struct session *sessions, int max);

#endif
