/* Exec channels: start a process with pipes or a PTY, stream its output,
 * feed its stdin, signal it, and report how it ended. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include "agent.h"

#define MAX_ARGS 4096
#define MAX_ENVS 4096

static const struct channel_ops exec_ops;

enum { STAGE_CWD = 1, STAGE_USER, STAGE_EXEC, STAGE_SETUP };

static const char *stage_name(int stage)
{
    switch (stage) {
    case STAGE_CWD: return "cannot enter working directory";
    case STAGE_USER: return "cannot switch user";
    case STAGE_EXEC: return "cannot execute";
    default: return "cannot set up process";
    }
}

struct exec_req {
    char **argv;
    int argc;
    char **envp;
    int envc;
    char *cwd;
    char *user;
    uint32_t flags;
    uint32_t rows, cols;
};

static void req_free(struct exec_req *r)
{
    for (int i = 0; i < r->argc; i++) {
        free(r->argv[i]);
    }
    for (int i = 0; i < r->envc; i++) {
        free(r->envp[i]);
    }
    free(r->argv);
    free(r->envp);
    free(r->cwd);
    free(r->user);
}

static char *dup_value(const struct tlv *t)
{
    if (memchr(t->val, 0, t->len)) {
        return NULL;
    }
    char *s = malloc((size_t)t->len + 1);
    if (s) {
        memcpy(s, t->val, t->len);
        s[t->len] = 0;
    }
    return s;
}

/* Parse SL_EXEC; on failure returns an errno and fills msg. */
static int parse_exec(const uint8_t *p, size_t n, struct exec_req *r, char *msg, size_t msglen)
{
    struct tlv_iter it;
    struct tlv t;
    memset(r, 0, sizeof(*r));
    r->rows = 24;
    r->cols = 80;
    if (!tlv_valid(p, n)) {
        snprintf(msg, msglen, "malformed EXEC payload");
        return EINVAL;
    }
    int nargs = 0, nenvs = 0;
    tlv_begin(&it, p, n);
    while (tlv_next(&it, &t) == 1) {
        nargs += t.tag == SL_T_ARG;
        nenvs += t.tag == SL_T_ENV;
    }
    if (nargs == 0) {
        snprintf(msg, msglen, "EXEC needs at least one argument");
        return EINVAL;
    }
    if (nargs > MAX_ARGS || nenvs > MAX_ENVS) {
        snprintf(msg, msglen, "too many arguments or environment entries");
        return E2BIG;
    }
    r->argv = calloc((size_t)nargs + 1, sizeof(char *));
    r->envp = calloc((size_t)nenvs + 1, sizeof(char *));
    if (!r->argv || !r->envp) {
        snprintf(msg, msglen, "out of memory");
        return ENOMEM;
    }
    tlv_begin(&it, p, n);
    while (tlv_next(&it, &t) == 1) {
        char *v = NULL;
        switch (t.tag) {
        case SL_T_ARG:
        case SL_T_ENV:
        case SL_T_CWD:
        case SL_T_USER:
            v = dup_value(&t);
            if (!v) {
                snprintf(msg, msglen, "string field %u holds a NUL byte", t.tag);
                return EINVAL;
            }
            break;
        case SL_T_FLAGS:
        case SL_T_ROWS:
        case SL_T_COLS:
            if (t.len != 4) {
                snprintf(msg, msglen, "field %u must be 4 bytes", t.tag);
                return EINVAL;
            }
            break;
        default:
            break; /* unknown tags are ignored: newer hosts may send more */
        }
        switch (t.tag) {
        case SL_T_ARG: r->argv[r->argc++] = v; break;
        case SL_T_ENV:
            if (!strchr(v, '=') || v[0] == '=') {
                free(v);
                snprintf(msg, msglen, "environment entry is not NAME=VALUE");
                return EINVAL;
            }
            r->envp[r->envc++] = v;
            break;
        case SL_T_CWD: free(r->cwd); r->cwd = v; break;
        case SL_T_USER: free(r->user); r->user = v; break;
        case SL_T_FLAGS: r->flags = rd32(t.val); break;
        case SL_T_ROWS: r->rows = rd32(t.val); break;
        case SL_T_COLS: r->cols = rd32(t.val); break;
        }
    }
    if (r->argv[0][0] == 0) {
        snprintf(msg, msglen, "empty program name");
        return EINVAL;
    }
    if (r->cwd && r->cwd[0] != '/') {
        snprintf(msg, msglen, "working directory must be absolute");
        return EINVAL;
    }
    if (r->rows == 0 || r->rows > 10000 || r->cols == 0 || r->cols > 10000) {
        snprintf(msg, msglen, "terminal size out of range");
        return EINVAL;
    }
    return 0;
}

static int env_has(char **envp, int envc, const char *key)
{
    size_t kl = strlen(key);
    for (int i = 0; i < envc; i++) {
        if (!strncmp(envp[i], key, kl) && envp[i][kl] == '=') {
            return 1;
        }
    }
    return 0;
}

/* Final environment: defaults the host did not override, then the host's entries. */
static char **build_env(const struct exec_req *r, const struct user_spec *u)
{
    static char hostname[256];
    char **env = calloc((size_t)r->envc + 8, sizeof(char *));
    if (!env) {
        return NULL;
    }
    int k = 0;
    if (!(r->flags & SL_EXEC_CLEAR_ENV)) {
        char tmp[600];
        struct { const char *key; const char *val; } defs[] = {
            {"PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
            {"HOME", u->home[0] ? u->home : "/"},
            {"USER", u->name[0] ? u->name : NULL},
            {"LOGNAME", u->name[0] ? u->name : NULL},
            {"HOSTNAME", gethostname(hostname, sizeof(hostname) - 1) == 0 ? hostname : NULL},
            {"TERM", (r->flags & SL_EXEC_TTY) ? "xterm-256color" : NULL},
        };
        for (size_t i = 0; i < sizeof(defs) / sizeof(defs[0]); i++) {
            if (!defs[i].val || env_has(r->envp, r->envc, defs[i].key)) {
                continue;
            }
            snprintf(tmp, sizeof(tmp), "%s=%s", defs[i].key, defs[i].val);
            env[k++] = strdup(tmp);
        }
    }
    for (int i = 0; i < r->envc; i++) {
        env[k++] = r->envp[i];
    }
    return env;
}

static const char *env_get(char **env, const char *key)
{
    size_t kl = strlen(key);
    for (int i = 0; env[i]; i++) {
        if (!strncmp(env[i], key, kl) && env[i][kl] == '=') {
            return env[i] + kl + 1;
        }
    }
    return NULL;
}

struct child_error {
    int stage;
    int err;
};

static void child_fail(int errfd, int stage, int err)
{
    struct child_error ce = {stage, err};
    ssize_t w = write(errfd, &ce, sizeof(ce));
    (void)w;
    _exit(127);
}

/* execvp with the PATH of the new environment, not the agent's. */
static void exec_search(const char *file, char **argv, char **env, int errfd)
{
    if (strchr(file, '/')) {
        execve(file, argv, env);
        if (errno == ENOEXEC) {
            goto as_script;
        }
        child_fail(errfd, STAGE_EXEC, errno);
    }
    const char *path = env_get(env, "PATH");
    if (!path) {
        path = "/usr/local/bin:/usr/bin:/bin";
    }
    int saw_eacces = 0;
    char full[4096];
    while (*path) {
        const char *end = strchr(path, ':');
        size_t dl = end ? (size_t)(end - path) : strlen(path);
        if (dl + strlen(file) + 2 <= sizeof(full)) {
            if (dl == 0) {
                snprintf(full, sizeof(full), "%s", file);
            } else {
                snprintf(full, sizeof(full), "%.*s/%s", (int)dl, path, file);
            }
            execve(full, argv, env);
            if (errno == ENOEXEC) {
                file = full;
                goto as_script;
            }
            if (errno == EACCES) {
                saw_eacces = 1;
            } else if (errno != ENOENT && errno != ENOTDIR) {
                child_fail(errfd, STAGE_EXEC, errno);
            }
        }
        if (!end) {
            break;
        }
        path = end + 1;
    }
    child_fail(errfd, STAGE_EXEC, saw_eacces ? EACCES : ENOENT);
as_script: {
        /* a script without #!: run it with /bin/sh, as execvp does (no malloc: vfork child) */
        int argc = 0;
        while (argv[argc]) {
            argc++;
        }
        char *nargv[MAX_ARGS + 2];
        nargv[0] = "/bin/sh";
        nargv[1] = (char *)file;
        for (int i = 1; i < argc && i <= MAX_ARGS; i++) {
            nargv[i + 1] = argv[i];
        }
        nargv[argc < MAX_ARGS ? argc + 1 : MAX_ARGS + 1] = NULL;
        execve("/bin/sh", nargv, env);
        child_fail(errfd, STAGE_EXEC, errno);
    }
}

static int set_nonblock_cloexec(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        return -1;
    }
    return fcntl(fd, F_SETFD, FD_CLOEXEC);
}

static int open_pty(int *master, int *slave, uint32_t rows, uint32_t cols)
{
    int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (m < 0) {
        return -1;
    }
    char *name;
    if (grantpt(m) < 0 || unlockpt(m) < 0 || !(name = ptsname(m))) {
        close(m);
        return -1;
    }
    int s = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (s < 0) {
        close(m);
        return -1;
    }
    struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
    ioctl(m, TIOCSWINSZ, &ws);
    *master = m;
    *slave = s;
    return 0;
}

void exec_start(struct session *s, uint32_t ch, const uint8_t *p, size_t n)
{
    uint64_t asked_us = now_us();
    struct exec_req r;
    char msg[512];
    int err = parse_exec(p, n, &r, msg, sizeof(msg));
    if (err) {
        send_error(s, ch, err, SL_EXEC, "%s", msg);
        req_free(&r);
        return;
    }
    if (limits_frozen()) {
        /* its process would be frozen as it joins its cgroup, before execve, and the
         * agent waits in vfork for that execve: the host asks again after the thaw */
        send_error(s, ch, EBUSY, SL_EXEC, "the box's commands are frozen for a save: ask again when it is over");
        req_free(&r);
        return;
    }
    if (g_safe_mode) {
        send_error(s, ch, EPERM, SL_EXEC, "exec is disabled in safe mode");
        req_free(&r);
        return;
    }
    struct user_spec u;
    memset(&u, 0, sizeof(u));
    if (r.user && r.user[0]) {
        if (resolve_user(r.user, &u, msg, sizeof(msg)) < 0) {
            send_error(s, ch, ENOENT, SL_EXEC, "%s", msg);
            req_free(&r);
            return;
        }
    } else {
        resolve_user("0", &u, msg, sizeof(msg));
    }
    char **env = build_env(&r, &u);
    if (!env) {
        send_error(s, ch, ENOMEM, SL_EXEC, "out of memory");
        req_free(&r);
        return;
    }

    int tty = (r.flags & SL_EXEC_TTY) != 0;
    int in_pipe[2] = {-1, -1}, out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1}, st_pipe[2] = {-1, -1};
    int master = -1, slave = -1;
    struct channel *c = NULL;
    struct exec_channel *x = NULL;
    pid_t pid = -1;
    int ok = pipe2(st_pipe, O_CLOEXEC) == 0;
    if (ok && tty) {
        ok = open_pty(&master, &slave, r.rows, r.cols) == 0;
    } else if (ok) {
        ok = pipe2(out_pipe, O_CLOEXEC) == 0 && pipe2(err_pipe, O_CLOEXEC) == 0;
        if (ok && (r.flags & SL_EXEC_STDIN)) {
            ok = pipe2(in_pipe, O_CLOEXEC) == 0;
        }
    }
    if (ok) {
        c = chan_new(s, ch, &exec_ops);
    }
    char cg_procs[64] = "";
    if (c) {
        x = &c->u.exec;
        x->pid = -1;
        x->in.fd = -1;
        for (int i = 0; i < 3; i++) {
            x->out[i].fd = -1;
        }
        x->cgroup = exec_cgroup_new(cg_procs, sizeof(cg_procs));
    }
    if (c) {
        /* vfork: no page-table copy and no copy-on-write faults in the agent
         * afterwards, which under emulation is most of what a fork costs. */
        pid = vfork();
    }
    if (pid == 0) {
        /* vfork child: shares the agent's memory until execve, so only system
         * calls and stack variables here; no malloc, no stdio */
        sigset_t all;
        sigemptyset(&all);
        signal(SIGPIPE, SIG_DFL);
        sigprocmask(SIG_SETMASK, &all, NULL);
        exec_cgroup_join(cg_procs);
        struct rlimit rl = {1024, 524288};
        setrlimit(RLIMIT_NOFILE, &rl);
        setsid();
        int fd0, fd1, fd2;
        if (tty) {
            if (ioctl(slave, TIOCSCTTY, 0) < 0) {
                child_fail(st_pipe[1], STAGE_SETUP, errno);
            }
            fd0 = fd1 = fd2 = slave;
        } else {
            fd0 = in_pipe[0] >= 0 ? in_pipe[0] : open("/dev/null", O_RDONLY | O_CLOEXEC);
            fd1 = out_pipe[1];
            fd2 = err_pipe[1];
        }
        if (fd0 < 0 || dup2(fd0, 0) < 0 || dup2(fd1, 1) < 0 || dup2(fd2, 2) < 0) {
            child_fail(st_pipe[1], STAGE_SETUP, errno);
        }
        if (setgroups((size_t)u.ngroups, u.groups) < 0 && u.uid != 0) {
            child_fail(st_pipe[1], STAGE_USER, errno);
        }
        if (setgid(u.gid) < 0 || setuid(u.uid) < 0) {
            child_fail(st_pipe[1], STAGE_USER, errno);
        }
        const char *cwd = r.cwd ? r.cwd : "/";
        if (chdir(cwd) < 0) {
            child_fail(st_pipe[1], STAGE_CWD, errno);
        }
        exec_search(r.argv[0], r.argv, env, st_pipe[1]);
        _exit(127);
    }

    /* parent */
    int saved_errno = errno;
    int child_side[] = {st_pipe[1], slave, in_pipe[0], out_pipe[1], err_pipe[1]};
    for (size_t i = 0; i < sizeof(child_side) / sizeof(child_side[0]); i++) {
        if (child_side[i] >= 0) {
            close(child_side[i]);
        }
    }
    int our_side[] = {master, in_pipe[1], out_pipe[0], err_pipe[0]};
    if (pid < 0) {
        if (c) {
            chan_free(c);
        }
        if (st_pipe[0] >= 0) {
            close(st_pipe[0]);
        }
        for (size_t i = 0; i < sizeof(our_side) / sizeof(our_side[0]); i++) {
            if (our_side[i] >= 0) {
                close(our_side[i]);
            }
        }
        if (!saved_errno) {
            saved_errno = EAGAIN;
        }
        send_error(s, ch, saved_errno, SL_EXEC, "cannot start process: %s", strerror(saved_errno));
        goto out;
    }

    /* The status pipe closes on a successful execve, or carries the reason it failed. */
    struct child_error ce;
    ssize_t got;
    do {
        got = read(st_pipe[0], &ce, sizeof(ce));
    } while (got < 0 && errno == EINTR);
    close(st_pipe[0]);
    x->pid = pid;
    x->tty = tty;
    if (got == (ssize_t)sizeof(ce)) {
        /* The child exits 127 and is reaped by the loop; this channel reports the
         * failure and ends now. */
        x->pid = -1;
        for (size_t i = 0; i < sizeof(our_side) / sizeof(our_side[0]); i++) {
            if (our_side[i] >= 0) {
                close(our_side[i]);
            }
        }
        chan_free(c);
        const char *what = ce.stage == STAGE_CWD ? (r.cwd ? r.cwd : "/") : ce.stage == STAGE_USER ? r.user : r.argv[0];
        send_error(s, ch, ce.err, SL_EXEC, "%s %s: %s", stage_name(ce.stage), what ? what : "", strerror(ce.err));
        goto out;
    }

    if (tty) {
        set_nonblock_cloexec(master);
        ostream_init(&x->out[1], master, 0);
        x->in.fd = dup(master);
        if (x->in.fd >= 0) {
            set_nonblock_cloexec(x->in.fd);
        }
        x->out[2].eof = 1; /* a PTY merges stderr into stdout */
    } else {
        set_nonblock_cloexec(out_pipe[0]);
        set_nonblock_cloexec(err_pipe[0]);
        /* Bigger pipes mean fewer wake-ups per megabyte, which is most of the
         * cost of streaming output under emulation. Best effort. */
        fcntl(out_pipe[0], F_SETPIPE_SZ, 1 << 20);
        ostream_init(&x->out[1], out_pipe[0], 0);
        ostream_init(&x->out[2], err_pipe[0], 0);
        if (in_pipe[1] >= 0) {
            set_nonblock_cloexec(in_pipe[1]);
            x->in.fd = in_pipe[1];
        }
    }
    stats_exec_started(asked_us);
    struct msg m;
    msg_init(&m);
    msg_u32(&m, SL_T_PID, (uint32_t)pid);
    msg_u32(&m, SL_T_WINDOW, SL_WINDOW);
    send_msg(s, SL_EXEC_STARTED, 0, ch, &m);
out:
    /* env shares its host-given strings with r.envp; only the defaults are its own */
    for (int i = 0; env[i]; i++) {
        int own = 1;
        for (int j = 0; j < r.envc; j++) {
            if (env[i] == r.envp[j]) {
                own = 0;
            }
        }
        if (own) {
            free(env[i]);
        }
    }
    free(env);
    req_free(&r);
}

int exec_follow(struct session *s, uint32_t ch, pid_t pid, int in_fd, int out_fd, int err_fd, uint32_t cgroup,
                int end_signal)
{
    struct channel *c = chan_new(s, ch, &exec_ops);
    if (!c) {
        return -1;
    }
    struct exec_channel *x = &c->u.exec;
    x->pid = pid;
    x->cgroup = cgroup;
    x->end_signal = end_signal;
    x->out[0].fd = -1;
    set_nonblock_cloexec(out_fd);
    set_nonblock_cloexec(err_fd);
    fcntl(out_fd, F_SETPIPE_SZ, 1 << 20);
    ostream_init(&x->out[1], out_fd, 0);
    ostream_init(&x->out[2], err_fd, 0);
    x->in.fd = in_fd;
    if (in_fd >= 0) {
        set_nonblock_cloexec(in_fd);
        fcntl(in_fd, F_SETPIPE_SZ, 1 << 20);
    }
    struct msg m;
    msg_init(&m);
    msg_u32(&m, SL_T_PID, (uint32_t)pid);
    msg_u32(&m, SL_T_WINDOW, SL_WINDOW);
    send_msg(s, SL_EXEC_STARTED, 0, ch, &m);
    return 0;
}

static void exec_signal(struct channel *c, const uint8_t *p, size_t n)
{
    struct exec_channel *x = &c->u.exec;
    uint32_t sig = 0, flags = 0;
    if (!tlv_valid(p, n) || tlv_u32(p, n, SL_T_SIGNAL, &sig) != 1 || tlv_u32(p, n, SL_T_FLAGS, &flags) < 0 ||
        sig == 0 || sig >= NSIG) {
        send_error(c->s, c->id, EINVAL, SL_SIGNAL, "malformed SIGNAL");
        return;
    }
    int group = (flags & SL_SIGNAL_GROUP) != 0;
    if (x->pid <= 0 || (x->exited && !group)) {
        return; /* already gone: signalling a dead process is not an error */
    }
    /* a group outlives its leader: it is signalled as long as one member lives */
    pid_t target = group ? -x->pid : x->pid;
    if (kill(target, (int)sig) < 0 && errno != ESRCH) {
        send_error(c->s, c->id, errno, SL_SIGNAL, "kill: %s", strerror(errno));
        return;
    }
    /* gVisor lets a child being forked escape a SIGKILL of its group (Linux does not):
     * a fork bomb's group is killed again until it is empty, for at most ~100 ms */
    for (int i = 0; group && sig == SIGKILL && i < 50 && kill(target, SIGKILL) == 0; i++) {
        usleep(2000);
    }
}

static void exec_resize(struct channel *c, const uint8_t *p, size_t n)
{
    struct exec_channel *x = &c->u.exec;
    uint32_t rows = 0, cols = 0;
    if (!tlv_valid(p, n) || tlv_u32(p, n, SL_T_ROWS, &rows) != 1 || tlv_u32(p, n, SL_T_COLS, &cols) != 1 ||
        rows == 0 || rows > 10000 || cols == 0 || cols > 10000) {
        send_error(c->s, c->id, EINVAL, SL_RESIZE, "malformed RESIZE");
        return;
    }
    if (!x->tty || x->out[1].fd < 0) {
        return;
    }
    struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
    ioctl(x->out[1].fd, TIOCSWINSZ, &ws);
}

void exec_mark_oom(pid_t sid)
{
    for (struct channel *c = g_channels; c; c = c->next) {
        if (c->ops == &exec_ops && c->u.exec.pid == sid) {
            c->u.exec.oom_killed = 1;
        }
    }
}

void exec_reaped(pid_t pid, int status)
{
    for (struct channel *c = g_channels; c; c = c->next) {
        struct exec_channel *x = &c->u.exec;
        if (c->ops == &exec_ops && x->pid == pid && !x->exited) {
            x->exited = 1;
            x->status = status;
            x->quiet_since_ms = now_ms();
            int killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
            int child_killed = WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGKILL;
            x->oom_killed |= exec_cgroup_oom_killed(x->cgroup, killed || child_killed); /* or the agent's own (limits.c) */
            return;
        }
    }
    /* an orphan adopted by PID 1: reaping it is all there is to do */
}

static void istream_flush(struct channel *c)
{
    struct istream *in = &c->u.exec.in;
    while (in->fd >= 0 && buf_used(&in->pending)) {
        ssize_t w = write(in->fd, in->pending.data + in->pending.head, buf_used(&in->pending));
        if (w > 0) {
            buf_consume(&in->pending, (size_t)w);
            in->written += (uint64_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
            break;
        } else {
            /* the process closed its stdin: drop what is left, keep the process */
            in->written = in->received;
            buf_free(&in->pending);
            close(in->fd);
            in->fd = -1;
            in->gone = 1;
        }
    }
    if (!buf_used(&in->pending) && in->pending.cap > SL_DATA_CHUNK) {
        buf_free(&in->pending);
    }
    if (in->eof && in->fd >= 0 && !buf_used(&in->pending)) {
        close(in->fd);
        in->fd = -1;
    }
    /* ACK once a quarter window has drained, or when everything has. */
    if (in->written > in->acked_sent &&
        (in->written - in->acked_sent >= SL_WINDOW / 4 || in->written == in->received)) {
        send_ack(c->s, c->id, SL_STREAM_STDIN, in->written);
        in->acked_sent = in->written;
    }
}

static void exec_progress(struct channel *c)
{
    struct exec_channel *x = &c->u.exec;
    for (int k = 1; k < 3; k++) {
        ostream_pump(c, (uint32_t)k, &x->out[k]);
    }
    if (!x->exited) {
        return;
    }
    if (x->in.fd >= 0 && !x->tty) {
        close(x->in.fd); /* nobody reads it any more */
        x->in.fd = -1;
        x->in.gone = 1;
    }
    /* A background process may hold the output open forever. Once the main
     * process is gone and the streams have had nothing to read for 100 ms,
     * stop. A stream held back by the host's window is not quiet. */
    uint64_t now = now_ms();
    int open_streams = 0;
    for (int k = 1; k < 3; k++) {
        struct ostream *o = &x->out[k];
        if (o->eof) {
            continue;
        }
        open_streams++;
        if (!ostream_can_read(o)) {
            x->quiet_since_ms = now;
        } else if (ostream_fill(o) > 0) {
            x->quiet_since_ms = now;
        }
    }
    if (open_streams && now - x->quiet_since_ms >= 100) {
        for (int k = 1; k < 3; k++) {
            struct ostream *o = &x->out[k];
            if (!o->eof) {
                if (o->fd >= 0) {
                    close(o->fd);
                    o->fd = -1;
                }
                o->eof = 1;
            }
        }
    }
    for (int k = 1; k < 3; k++) {
        ostream_pump(c, (uint32_t)k, &x->out[k]);
    }
    if (c->detached) {
        if (x->out[1].eof && x->out[2].eof) {
            chan_free(c);
        }
        return;
    }
    if (x->exit_sent || !x->out[1].eof_sent || !x->out[2].eof_sent || !c->s->hello_done || !c->s->connected) {
        return;
    }
    struct msg m;
    msg_init(&m);
    if (WIFEXITED(x->status)) {
        msg_u32(&m, SL_T_EXIT_CODE, (uint32_t)WEXITSTATUS(x->status));
    } else if (WIFSIGNALED(x->status)) {
        msg_u32(&m, SL_T_SIGNAL, (uint32_t)WTERMSIG(x->status));
        msg_u32(&m, SL_T_CORE_DUMPED, WCOREDUMP(x->status) ? 1u : 0u);
    }
    if (x->oom_killed || exec_cgroup_oom_killed(x->cgroup, 0)) {
        msg_u32(&m, SL_T_OOM_KILLED, 1);
    }
    send_msg(c->s, SL_EXIT, 0, c->id, &m);
    x->exit_sent = 1;
}

/* ---- channel_ops: how the rest of the agent reaches an exec ------------------ */

static void exec_release(struct channel *c)
{
    struct exec_channel *x = &c->u.exec;
    for (int i = 0; i < 3; i++) {
        ostream_close(&x->out[i]);
    }
    if (x->in.fd >= 0) {
        close(x->in.fd);
    }
    buf_free(&x->in.pending);
    exec_cgroup_release(x->cgroup);
}

static int exec_wait(struct channel *c, struct chan_wait *w, uint64_t now, int *timeout_ms)
{
    struct exec_channel *x = &c->u.exec;
    int n = 0;
    for (int k = 1; k < 3; k++) {
        n += ostream_wait(&x->out[k], &w[n], k, timeout_ms);
    }
    if (x->in.fd >= 0 && buf_used(&x->in.pending)) {
        w[n++] = (struct chan_wait){.fd = x->in.fd, .events = POLLOUT, .slot = SL_STREAM_STDIN};
    }
    if (x->exited && !x->exit_sent) {
        uint64_t due = x->quiet_since_ms + 100;
        int t = due > now ? (int)(due - now) : 0;
        if (t < *timeout_ms) {
            *timeout_ms = t;
        }
    }
    return n;
}

static void exec_ready(struct channel *c, int slot)
{
    struct exec_channel *x = &c->u.exec;
    if (slot == SL_STREAM_STDIN) {
        istream_flush(c);
    } else if (ostream_fill(&x->out[slot]) > 0) {
        x->quiet_since_ms = now_ms();
    }
}

static struct ostream *exec_output(struct channel *c, uint32_t stream)
{
    return stream == SL_STREAM_STDOUT || stream == SL_STREAM_STDERR ? &c->u.exec.out[stream] : NULL;
}

static int exec_input(struct channel *c, uint8_t type, uint64_t off, const uint8_t *d, size_t n)
{
    struct istream *in = &c->u.exec.in;
    if (in->fd < 0 && in->gone) {
        /* A process that exits (or closes stdin) before its input arrives: the
         * input is dropped, as a pipe to a finished reader drops it, and
         * acknowledged so the host's window does not stall. Which comes first
         * is a race the host cannot see, so it is no error. */
        if (type != SL_EOF && off + n > in->received) {
            in->received = off + n;
        }
        in->written = in->received;
        if (in->written > in->acked_sent) {
            send_ack(c->s, c->id, SL_STREAM_STDIN, in->written);
            in->acked_sent = in->written;
        }
        return 0;
    }
    if (in->fd < 0) {
        return -1;
    }
    if (off > in->received) {
        send_error(c->s, c->id, EINVAL, type, "input gap at offset %llu", (unsigned long long)in->received);
        return 0;
    }
    if (type == SL_EOF) {
        in->eof = 1;
    } else {
        size_t skip = (size_t)(in->received - off);
        if (skip < n) {
            if (in->received + (n - skip) - in->written > SL_WINDOW) {
                send_error(c->s, c->id, ENOBUFS, type, "input beyond the window");
                return 0;
            }
            buf_append(&in->pending, d + skip, n - skip);
            in->received += n - skip;
        }
    }
    istream_flush(c);
    return 0;
}

static void exec_resume(struct channel *c)
{
    struct exec_channel *x = &c->u.exec;
    if (x->in.fd >= 0) {
        send_ack(c->s, c->id, SL_STREAM_STDIN, x->in.written);
        x->in.acked_sent = x->in.written;
    }
    x->exit_sent = 0;
}

static int exec_disconnected(struct channel *c)
{
    c->u.exec.exit_sent = 0; /* the host may not have had it */
    return 1;
}

/* The process keeps running and its output goes nowhere, until it has exited
 * and its output is closed. */
static int exec_detach(struct channel *c)
{
    struct exec_channel *x = &c->u.exec;
    if (x->exited && x->out[1].fd < 0 && x->out[2].fd < 0) {
        return 0;
    }
    if (x->in.fd >= 0) {
        close(x->in.fd);
        x->in.fd = -1;
    }
    if (x->end_signal && !x->exited && x->pid > 0) {
        kill(x->pid, x->end_signal); /* its work is for the host that let go of it */
    }
    return 1;
}

static const struct channel_ops exec_ops = {
    .name = "exec",
    .release = exec_release,
    .progress = exec_progress,
    .wait = exec_wait,
    .ready = exec_ready,
    .output = exec_output,
    .input = exec_input,
    .resume = exec_resume,
    .disconnected = exec_disconnected,
    .detach = exec_detach,
    .signal = exec_signal,
    .resize = exec_resize,
};
