/* sandlot guest agent: the process and its poll loop.
 *
 * Usage:
 *   /init                       as PID 1 in the guest: boot duties, then serve ports
 *   sandlot-agent --fd N        serve one session on socket fd N (host builds, tests)
 *   /init --listen DIR --ports N [--console FILE] [--memory-mib N] [--net[=relay]]
 *                               as a container's init (gVisor): the root, /proc, /dev
 *                               and the rest are already there; serve Unix sockets DIR/port.0..N-1,
 *                               log to FILE instead of the standard output the sandbox was given;
 *                               with --memory-mib, be the box's OOM killer (limits.c)
 *   sandlot-agent --fd N --safe same, but refuse exec and file-system changes (fuzzing)
 *   ... --read-idle-ms N        close file reads the host leaves untouched for N ms (600000)
 *   /proc/1/exe --relay PORT    a command the host runs: a pipe to a guest TCP port or Unix socket (relay.c)
 *
 * The loop waits on the sessions (transport.c), on what each channel's kind asks
 * for (channel_ops.wait), on signals and on OOM events, and gives every channel
 * a turn each round (channel_ops.progress). Frames go from transport.c to
 * dispatch.c; no file but a kind's own looks inside a channel of that kind.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

int g_safe_mode;
int g_is_pid1;

#define MAX_SESSIONS 8
static struct session g_sessions[MAX_SESSIONS];
static int g_nsessions;
static int g_sigfd = -1;
static int g_host_mode;

uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void logmsg(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
    va_end(ap);
    if (n < 0) {
        return;
    }
    if ((size_t)n > sizeof(line) - 2) {
        n = (int)sizeof(line) - 2;
    }
    line[n++] = '\n';
    /* stderr is the guest console (PID 1) or the host test's stderr. */
    ssize_t w = write(2, "sandlot-agent: ", 15);
    w = write(2, line, (size_t)n);
    (void)w;
}

/* ---- the loop ------------------------------------------------------- */

/* A port's host end opening or closing raises SIGIO; the timer is the fallback for
 * one that did not. It backs off while nothing changes (1, 2, 4, then every 8 s), so
 * an idle box wakes for it every 8 s, not every second (under TCG each wakeup costs
 * the host a few hundred microseconds), and is back at 1 s after any change. */
#define PORT_CHECK_MIN_MS 1000
#define PORT_CHECK_MAX_MS 8000
static uint64_t g_port_check_every = PORT_CHECK_MIN_MS;
static uint64_t g_port_check_at;

/* SIGIO is raised, waiting in the signalfd unread: the timer got to a change first. */
static int sigio_pending(void)
{
    sigset_t pending;
    return sigpending(&pending) == 0 && sigismember(&pending, SIGIO) == 1;
}

static void check_ports(uint64_t now, int on_sigio)
{
    int changed = 0;
    for (int i = 0; i < g_nsessions; i++) {
        if (g_sessions[i].is_port && port_check(&g_sessions[i])) {
            changed = 1;
            /* a SIGIO that never came: said, as it costs a host up to 8 s. One raised
             * between the loop's poll and this check is on its way, not missing. */
            if (!on_sigio && !sigio_pending()) {
                logmsg("port %s: its host end came or went without SIGIO", g_sessions[i].name);
            }
        }
    }
    if (changed) {
        g_port_check_every = PORT_CHECK_MIN_MS;
    } else if (g_port_check_every < PORT_CHECK_MAX_MS) {
        g_port_check_every *= 2;
    }
    g_port_check_at = now + g_port_check_every;
}

static void handle_signals(void)
{
    struct signalfd_siginfo si;
    while (read(g_sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        if (si.ssi_signo == SIGIO) {
            g_port_check_every = PORT_CHECK_MIN_MS / 2; /* a change: checked at 1 s again */
            check_ports(now_ms(), 1);
        }
    }
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) {
            break;
        }
        if (!dns_relay_reaped(pid) && !egress_reaped(pid, status)) {
            exec_reaped(pid, status);
        }
    }
}

enum { P_SESSION = 1, P_SIGNAL, P_CHANNEL, P_OOM, P_LISTEN };

struct pollref {
    int what;
    struct session *s;
    struct channel *c;
    int slot;
};

static void progress_all(void)
{
    struct channel *c = g_channels, *next;
    for (; c; c = next) {
        next = c->next;
        if (c->ops->progress) {
            c->ops->progress(c);
        }
    }
}

static void serve(void)
{
    static struct pollfd pfds[4096];
    static struct pollref refs[4096];
    uint64_t start = now_ms();
    dispatch_init(start);
    g_port_check_at = start + g_port_check_every;

    for (;;) {
        progress_all();
        uint64_t due = g_port_check_at, t = now_ms();
        int n = 0, timeout = due > t ? (int)(due - t) : 0;
        pfds[n] = (struct pollfd){.fd = g_sigfd, .events = POLLIN};
        refs[n++] = (struct pollref){.what = P_SIGNAL};
        if (g_oom_fd >= 0) {
            pfds[n] = (struct pollfd){.fd = g_oom_fd, .events = POLLPRI};
            refs[n++] = (struct pollref){.what = P_OOM};
        }
        for (int i = 0; i < g_nsessions; i++) {
            struct session *s = &g_sessions[i];
            if (s->listen_fd > 0) {
                pfds[n] = (struct pollfd){.fd = s->listen_fd, .events = POLLIN};
                refs[n++] = (struct pollref){.what = P_LISTEN, .s = s};
            }
            int k = session_poll(s, &pfds[n], &timeout);
            for (int j = 0; j < k; j++) {
                refs[n++] = (struct pollref){.what = P_SESSION, .s = s};
            }
        }
        uint64_t now = now_ms();
        for (struct channel *c = g_channels; c && n < 4090; c = c->next) {
            struct chan_wait w[CHAN_WAITS];
            int k = c->ops->wait ? c->ops->wait(c, w, now, &timeout) : 0;
            for (int i = 0; i < k; i++) {
                pfds[n] = (struct pollfd){.fd = w[i].fd, .events = w[i].events};
                refs[n++] = (struct pollref){.what = P_CHANNEL, .c = c, .slot = w[i].slot};
            }
        }

        int r = poll(pfds, (nfds_t)n, limits_timeout(timeout, now_ms()));
        if (r < 0 && errno != EINTR) {
            logmsg("poll: %s", strerror(errno));
            continue;
        }
        for (int i = 0; r > 0 && i < n; i++) {
            short re = pfds[i].revents;
            if (!re) {
                continue;
            }
            struct pollref *ref = &refs[i];
            switch (ref->what) {
            case P_SIGNAL:
                handle_signals();
                break;
            case P_OOM:
                limits_oom_event();
                break;
            case P_SESSION:
                session_events(ref->s, re);
                break;
            case P_LISTEN:
                listener_accept(ref->s);
                break;
            case P_CHANNEL:
                if (chan_alive(ref->c)) {
                    ref->c->ops->ready(ref->c, ref->slot);
                }
                break;
            }
        }
        for (int i = 0; i < g_nsessions; i++) {
            if (g_sessions[i].connected) {
                session_write(&g_sessions[i]);
            }
        }
        now = now_ms();
        limits_check(now);
        for (int i = 0; i < g_nsessions; i++) {
            session_drop_stale(&g_sessions[i], now);
        }
        if (now >= g_port_check_at) {
            check_ports(now, 0);
        }
    }
}

/* ---- the process ---------------------------------------------------- */

static void setup_signals(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGIO);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGPWR);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    sigprocmask(SIG_BLOCK, &set, NULL);
    g_sigfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    signal(SIGPIPE, SIG_IGN);
}

/* A container's standard streams are host file descriptors, which no saved state
 * can hold (gVisor restores them by number, into a process where the number means
 * nothing): the init logs to a file of the sandbox's own instead and keeps none. */
static void console_to(const char *path)
{
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    int log = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (null < 0 || log < 0) {
        logmsg("console %s: %s", path, strerror(errno));
    } else {
        dup2(null, 0);
        dup2(log, 1);
        dup2(log, 2);
    }
    if (null >= 0) {
        close(null);
    }
    if (log >= 0) {
        close(log);
    }
}

int main(int argc, char **argv)
{
    int fd = -1, ports = 1;
    const char *listen_dir = NULL, *console = NULL;
    g_is_pid1 = getpid() == 1;
    if (argc == 3 && !strcmp(argv[1], "--relay")) {
        return relay_main(argv[2]);
    }
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--fd") && i + 1 < argc) {
            fd = atoi(argv[++i]);
            g_host_mode = 1;
        } else if (!strcmp(argv[i], "--listen") && i + 1 < argc) {
            listen_dir = argv[++i];
        } else if (!strcmp(argv[i], "--ports") && i + 1 < argc) {
            ports = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--console") && i + 1 < argc) {
            console = argv[++i];
        } else if (!strcmp(argv[i], "--memory-mib") && i + 1 < argc) {
            limits_watch_memory(strtoull(argv[++i], NULL, 10));
        } else if (!strcmp(argv[i], "--net")) {
            network_given(0);
        } else if (!strcmp(argv[i], "--net=relay")) {
            network_given(1);
        } else if (!strcmp(argv[i], "--safe")) {
            g_safe_mode = 1;
        } else if (!strcmp(argv[i], "--read-idle-ms") && i + 1 < argc) {
            g_read_idle_ms = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--version")) {
            printf("sandlot-agent %s protocol %d\n", AGENT_VERSION, SL_PROTOCOL_VERSION);
            return 0;
        }
    }
    if (!g_is_pid1 && !g_host_mode && listen_dir == NULL) {
        fprintf(stderr, "usage: sandlot-agent --fd N [--safe]   (or run as PID 1 in a guest)\n");
        return 2;
    }
    struct rlimit rl = {65536, 65536};
    setrlimit(RLIMIT_NOFILE, &rl);
    setup_signals();

    if (listen_dir != NULL) {
        if (console != NULL) {
            console_to(console);
        }
        /* the sandbox made the root and its mounts; the rest of a boot's duties remain */
        init_after_root();
        g_nsessions = open_listeners(g_sessions, MAX_SESSIONS, listen_dir, ports);
        logmsg("ready: %d socket(s) in %s", g_nsessions, listen_dir);
    } else if (g_is_pid1) {
        init_early();
        init_after_root();
        g_nsessions = open_ports(g_sessions, MAX_SESSIONS, boot_ports());
        if (g_nsessions == 0) {
            logmsg("no sandlot.* virtio-serial port found");
        }
        for (int i = 0; i < g_nsessions; i++) {
            port_check(&g_sessions[i]);
        }
        logmsg("ready: %d port(s)", g_nsessions);
    } else {
        session_open_fd(&g_sessions[0], fd);
        g_nsessions = 1;
    }
    serve();
    return 0;
}
