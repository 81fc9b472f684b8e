/* Limits on what a box's commands may use: each command runs in a cgroup of its
 * own under /sys/fs/cgroup/sandlot, whose pids.max bounds the processes of all
 * of them together. The agent itself stays in the root cgroup, outside every
 * limit, so a fork bomb or a memory hog never silences it. A command's cgroup
 * also tells, when its process ends, whether the OOM killer struck inside it
 * (memory.events counts kills by any OOM killer, the whole guest's included). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent.h"

#define CG_ROOT "/sys/fs/cgroup"
#define CG_BOX_V2 CG_ROOT "/sandlot"
#define CG_PIDS_V1 CG_ROOT "/pids"

static int g_cg_ok;
/* gVisor's cgroupfs is v1: one pids hierarchy, and every command in one cgroup of it
 * (CG_PIDS_V1/sandlot), whose pids.max bounds them together; no per-command cgroups */
static int g_cg_v1;
static char g_cg_box[64] = CG_BOX_V2;
int g_oom_fd = -1; /* CG_BOX/memory.events: polled (POLLPRI) for OOM kills */
enum { CG_FREE, CG_IN_USE, CG_DRAINING };
static struct cgroup_slot {
    uint32_t id;      /* CG_BOX/e<id> */
    int state;
    uint64_t ooms;    /* its memory.events oom_kill count when last read */
    int oom_pending;  /* an OOM kill seen since the command started */
} g_cg[256];
static int g_ncg;
#define SPARE_CGROUPS 2
static void keep_spares(void);

static int write_str(const char *path, const char *s)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    ssize_t n = write(fd, s, strlen(s));
    close(fd);
    return n == (ssize_t)strlen(s) ? 0 : -1;
}

/* A small file's first size-1 bytes into buf, NUL-terminated (empty on any error): the
 * kernel's files here (cgroup, /proc) are read whole by one read. -1 if it cannot be opened. */
static int read_text(const char *path, char *buf, size_t size)
{
    buf[0] = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    buf[n > 0 ? n : 0] = 0;
    return 0;
}

/* No cgroup2 (gVisor): the pids controller of cgroup v1, mounted by the agent. */
static int limits_init_v1(void)
{
    mkdir(CG_ROOT, 0755);
    if (access(CG_ROOT, W_OK) != 0 || mkdir(CG_PIDS_V1, 0755) < 0) {
        if (errno != EEXIST) {
            mount("tmpfs", CG_ROOT, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755");
            mkdir(CG_PIDS_V1, 0755);
        }
    }
    if (mount("cgroup", CG_PIDS_V1, "cgroup", MS_NOSUID | MS_NODEV | MS_NOEXEC, "pids") < 0 && errno != EBUSY) {
        logmsg("limits: no cgroup2, and cgroup v1 pids: %s", strerror(errno));
        return -1;
    }
    snprintf(g_cg_box, sizeof(g_cg_box), "%s", CG_PIDS_V1 "/sandlot");
    if (mkdir(g_cg_box, 0755) < 0 && errno != EEXIST) {
        logmsg("limits: %s: %s", g_cg_box, strerror(errno));
        return -1;
    }
    g_cg_v1 = 1;
    g_cg_ok = 1;
    return 0;
}

void limits_init(void)
{
    if (access(CG_ROOT "/cgroup.controllers", F_OK) != 0) {
        limits_init_v1();
        return;
    }
    /* one controller at a time: a kernel without one still gets the other */
    write_str(CG_ROOT "/cgroup.subtree_control", "+memory");
    write_str(CG_ROOT "/cgroup.subtree_control", "+pids");
    if (mkdir(CG_BOX_V2, 0755) < 0 && errno != EEXIST) {
        logmsg("limits: %s: %s", CG_BOX_V2, strerror(errno));
        return;
    }
    write_str(CG_BOX_V2 "/cgroup.subtree_control", "+memory");
    write_str(CG_BOX_V2 "/cgroup.subtree_control", "+pids");
    g_cg_ok = 1;
    /* With no memory limit set, this file changes only when the OOM killer strikes
     * below it: watching it keeps every ordinary command free of cgroup reads
     * (measured: 30+ ms on the first command of a restored VM under emulation). */
    g_oom_fd = open(CG_BOX_V2 "/memory.events", O_RDONLY | O_CLOEXEC);
    limits_oom_event();
    keep_spares();
}

void limits_set_pids(uint32_t max)
{
    char v[16], path[96];
    snprintf(v, sizeof(v), "%u", max);
    snprintf(path, sizeof(path), "%s/pids.max", g_cg_box);
    if (g_cg_ok && write_str(path, max ? v : "max") < 0) {
        logmsg("limits: pids.max %s: %s", v, strerror(errno));
    }
}

static void cg_path(uint32_t id, const char *file, char *buf, size_t n)
{
    snprintf(buf, n, "%s/e%u%s%s", g_cg_box, id, file ? "/" : "", file ? file : "");
}

static uint64_t read_count(uint32_t id, const char *file, const char *key)
{
    char path[64], text[512];
    cg_path(id, file, path, sizeof(path));
    if (read_text(path, text, sizeof(text)) < 0) {
        return 0;
    }
    const char *p = strstr(text, key);
    return p ? strtoull(p + strlen(key), NULL, 10) : 0;
}

static struct cgroup_slot *slot_make(void)
{
    if (g_ncg >= (int)(sizeof(g_cg) / sizeof(g_cg[0]))) {
        return NULL;
    }
    char dir[64];
    uint32_t id = (uint32_t)g_ncg + 1;
    cg_path(id, NULL, dir, sizeof(dir));
    if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
        return NULL;
    }
    struct cgroup_slot *slot = &g_cg[g_ncg++];
    slot->id = id;
    slot->state = CG_FREE;
    slot->ooms = errno == EEXIST ? read_count(id, "memory.events", "oom_kill ") : 0;
    return slot;
}

/* Made ahead, after a command ends (or at boot), never on a command's way in: a
 * restored VM's first command would otherwise create one (cold kernel code under
 * emulation) whenever its template's background processes hold the others. */
static void keep_spares(void)
{
    int free_slots = 0;
    for (int i = 0; i < g_ncg; i++) {
        free_slots += g_cg[i].state == CG_FREE;
    }
    while (g_cg_ok && !g_cg_v1 && free_slots < SPARE_CGROUPS && slot_make()) {
        free_slots++;
    }
}

/* Reused, not made per command (creating and removing one cost 1.6 ms a command
 * under emulation; joining one cost 9 ms until cgroup2 got favordynmods). */
uint32_t exec_cgroup_new(char *procs_path, size_t n)
{
    procs_path[0] = 0;
    if (!g_cg_ok) {
        return 0;
    }
    if (g_cg_v1) { /* the one cgroup of every command; no OOM report from it */
        snprintf(procs_path, n, "%s/cgroup.procs", g_cg_box);
        return 0;
    }
    struct cgroup_slot *slot = NULL;
    for (int pass = 0; pass < 2 && !slot; pass++) {
        for (int i = 0; i < g_ncg && !slot; i++) {
            struct cgroup_slot *c = &g_cg[i];
            if (c->state == CG_FREE) {
                slot = c;
            } else if (pass == 1 && c->state == CG_DRAINING && !read_count(c->id, "cgroup.events", "populated ")) {
                slot = c; /* its background processes have ended */
            }
        }
    }
    if (!slot) {
        slot = slot_make();
    }
    if (!slot) {
        return 0; /* every cgroup still holds background processes: run without one */
    }
    slot->state = CG_IN_USE;
    slot->oom_pending = 0;
    cg_path(slot->id, "cgroup.procs", procs_path, n);
    return slot->id;
}

/* In the vfork child: system calls only. */
void exec_cgroup_join(const char *procs_path)
{
    if (procs_path[0]) {
        /* its own pid, not "0": gVisor's releases before 2023 take "0" for no
         * process at all */
        char num[16];
        int i = (int)sizeof(num);
        for (unsigned v = (unsigned)getpid(); v || i == (int)sizeof(num); v /= 10) {
            num[--i] = (char)('0' + v % 10);
        }
        int fd = open(procs_path, O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            if (write(fd, num + i, sizeof(num) - (size_t)i) < 0) {
                /* the command runs outside its cgroup: no OOM report for it */
            }
            close(fd);
        }
    }
}

/* ``certain``: read the command's own count now (its process was SIGKILLed, or its
 * status says a child of it was); otherwise what the watch on memory.events saw. */
int exec_cgroup_oom_killed(uint32_t id, int certain)
{
    if (!id || id > (uint32_t)g_ncg) {
        return 0;
    }
    struct cgroup_slot *c = &g_cg[id - 1];
    if (certain) {
        uint64_t now = read_count(id, "memory.events", "oom_kill ");
        c->oom_pending |= now > c->ooms;
        c->ooms = now;
    }
    return c->oom_pending;
}

/* memory.events of the commands' cgroup changed: find whose count moved. */
void limits_oom_event(void)
{
    if (g_oom_fd < 0) {
        return;
    }
    char text[512];
    /* reading it again is what re-arms the notification */
    if (lseek(g_oom_fd, 0, SEEK_SET) < 0 || read(g_oom_fd, text, sizeof(text)) < 0) {
        return;
    }
    for (int i = 0; i < g_ncg; i++) {
        struct cgroup_slot *c = &g_cg[i];
        if (c->state != CG_FREE) {
            uint64_t now = read_count(c->id, "memory.events", "oom_kill ");
            c->oom_pending |= now > c->ooms;
            c->ooms = now;
        }
    }
}

void exec_cgroup_release(uint32_t id)
{
    if (!id || id > (uint32_t)g_ncg) {
        return;
    }
    struct cgroup_slot *c = &g_cg[id - 1];
    /* a command that left processes behind keeps its cgroup until they end */
    c->state = read_count(id, "cgroup.events", "populated ") ? CG_DRAINING : CG_FREE;
    keep_spares();
}

/* ---- the box's own OOM killer (gVisor) --------------------------------------
 * gVisor has no OOM killer: past its host cgroup's limit the host's would end the
 * whole sandbox, agent included. So where the host says the box's memory (--memory-mib),
 * the agent watches what the box uses (/proc/meminfo: MemTotal - MemAvailable) and, past
 * it, SIGKILLs the largest process a command started, as Linux's OOM killer would, and
 * marks that command out-of-memory. The host cgroup's limit sits above the box's, so
 * a hog that outruns one check (MEM_CHECK_MS) still fits. */
#define MEM_CHECK_MS 25
#define MEM_AFTER_KILL_MS 300 /* what a killed process held takes a moment to be freed */
static uint64_t g_mem_limit_kib;
static uint64_t g_mem_next_ms;

void limits_watch_memory(uint64_t mib)
{
    g_mem_limit_kib = mib * 1024;
}

static int limits_mem_timeout(int timeout)
{
    return g_mem_limit_kib && (timeout < 0 || timeout > MEM_CHECK_MS) ? MEM_CHECK_MS : timeout;
}

static uint64_t meminfo_used_kib(void)
{
    char text[2048];
    if (read_text("/proc/meminfo", text, sizeof(text)) < 0) {
        return 0;
    }
    const char *t = strstr(text, "MemTotal:"), *a = strstr(text, "MemAvailable:");
    if (!t || !a) {
        return 0;
    }
    uint64_t total = strtoull(t + 9, NULL, 10), avail = strtoull(a + 13, NULL, 10);
    return total > avail ? total - avail : 0;
}

/* The process holding the most resident memory, the agent and its relays aside. */
static pid_t largest_process(void)
{
    DIR *d = opendir("/proc");
    if (!d) {
        return 0;
    }
    pid_t best = 0, me = getpid();
    unsigned long best_rss = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        pid_t pid = (pid_t)atoi(e->d_name);
        if (pid <= 1 || pid == me) {
            continue;
        }
        char path[64], text[128];
        snprintf(path, sizeof(path), "/proc/%d/statm", pid);
        if (read_text(path, text, sizeof(text)) < 0) {
            continue;
        }
        unsigned long size = 0, rss = 0;
        if (sscanf(text, "%lu %lu", &size, &rss) == 2 && rss > best_rss) {
            best_rss = rss;
            best = pid;
        }
    }
    closedir(d);
    return best;
}

static void limits_mem_check(uint64_t now)
{
    if (!g_mem_limit_kib || now < g_mem_next_ms) {
        return;
    }
    g_mem_next_ms = now + MEM_CHECK_MS;
    uint64_t used = meminfo_used_kib();
    if (used < g_mem_limit_kib) {
        return;
    }
    pid_t victim = largest_process();
    if (victim <= 0) {
        return;
    }
    pid_t sid = getsid(victim);
    if (kill(victim, SIGKILL) == 0) {
        logmsg("out of memory: %llu KiB used of %llu; killed process %d (session %d)",
               (unsigned long long)used, (unsigned long long)g_mem_limit_kib, victim, sid);
        exec_mark_oom(sid);
        g_mem_next_ms = now + MEM_AFTER_KILL_MS;
    }
}

/* ---- freezing every command for a save ------------------------------------------ */

/* QEMU cannot load a state saved while a vCPU ran a box's own (nested) VM: the guest-mode
 * state lives in the guest's KVM, which QEMU does not save under TCG. A frozen task has
 * left KVM_RUN (the freezer kicks it out as a signal would), so a box with VMs of its own
 * freezes its commands for the length of a save. The freeze holds for a lease of guest
 * time: a VM restored from that state thaws when its host says so, or when the lease
 * runs out (a VM's clock stands still while it is stopped for the save). */
static uint64_t g_thaw_at; /* 0: not frozen by a host */

/* Whether the box's cgroup is frozen, read from its open cgroup.events (the read also
 * re-arms the file's POLLPRI, which the kernel raises when a value in it changes). */
static int cg_frozen(int events)
{
    char text[256];
    ssize_t n = pread(events, text, sizeof(text) - 1, 0);
    if (n <= 0) {
        return -1;
    }
    text[n] = 0;
    const char *p = strstr(text, "frozen ");
    return p ? p[7] == '1' : -1;
}

/* A kernel thread in a command's cgroup (KVM's kvm-nx-lpage-recovery, which a VM's
 * creator has in its own cgroup before Linux 6.13) is never frozen, and a cgroup that
 * holds one is never reported frozen: such threads move to the root cgroup first. */
static void move_out_kernel_threads(void)
{
    DIR *d = opendir("/proc");
    if (!d) {
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        int pid = atoi(e->d_name);
        char path[64], text[512];
        if (pid <= 2) {
            continue;
        }
        snprintf(path, sizeof(path), "/proc/%d/cgroup", pid);
        read_text(path, text, sizeof(text));
        if (!strstr(text, "::/sandlot/")) {
            continue;
        }
        snprintf(path, sizeof(path), "/proc/%d/stat", pid);
        read_text(path, text, sizeof(text));
        const char *after = strrchr(text, ')'); /* the name may hold spaces and parentheses */
        unsigned long flags = 0;
        if (after && sscanf(after + 1, " %*c %*d %*d %*d %*d %*d %lu", &flags) == 1 && (flags & 0x00200000UL)) {
            char v[16];
            snprintf(v, sizeof(v), "%d", pid); /* PF_KTHREAD */
            if (write_str(CG_ROOT "/cgroup.procs", v) < 0) {
                logmsg("freeze: kernel thread %d stays in its cgroup: %s", pid, strerror(errno));
            }
        }
    }
    closedir(d);
}

int limits_freeze(uint32_t lease_ms, uint32_t wait_ms, char *err, size_t errlen)
{
    if (!g_cg_ok || g_cg_v1) {
        snprintf(err, errlen, "this guest has no cgroup v2 freezer");
        return -1;
    }
    move_out_kernel_threads();
    if (write_str(CG_BOX_V2 "/cgroup.freeze", "1") < 0) {
        snprintf(err, errlen, "freeze: %s", strerror(errno));
        return -1;
    }
    g_thaw_at = now_ms() + lease_ms;
    /* every task stopped: the kernel says so in cgroup.events (a task deep in an
     * uninterruptible wait may take a moment); bounded, as the host waits on it. The file
     * is opened before its first read, so a change after that read wakes the poll. */
    uint64_t deadline = now_ms() + wait_ms;
    int events = open(CG_BOX_V2 "/cgroup.events", O_RDONLY | O_CLOEXEC);
    for (;;) {
        int frozen = events < 0 ? -1 : cg_frozen(events);
        uint64_t now = now_ms();
        if (frozen == 1 || frozen < 0 || now >= deadline) {
            if (events >= 0) {
                close(events);
            }
            if (frozen == 1) {
                return 0;
            }
            limits_thaw();
            if (frozen < 0) {
                snprintf(err, errlen, "freeze: cannot read the box's cgroup.events");
            } else {
                snprintf(err, errlen, "the box's processes did not all stop within %u ms", wait_ms);
            }
            return -1;
        }
        struct pollfd p = {.fd = events, .events = POLLPRI};
        poll(&p, 1, (int)(deadline - now));
    }
}

int limits_frozen(void) { return g_thaw_at != 0; }

void limits_thaw(void)
{
    shares_attach();
    if (g_thaw_at && write_str(CG_BOX_V2 "/cgroup.freeze", "0") < 0) {
        logmsg("thaw: %s", strerror(errno));
    }
    g_thaw_at = 0;
}

int limits_timeout(int timeout, uint64_t now)
{
    timeout = limits_mem_timeout(timeout);
    if (g_thaw_at) {
        int left = g_thaw_at > now ? (int)(g_thaw_at - now) : 0;
        timeout = timeout < 0 || timeout > left ? left : timeout;
    }
    return timeout;
}

void limits_check(uint64_t now)
{
    limits_mem_check(now);
    if (g_thaw_at && now >= g_thaw_at) {
        logmsg("thawed: the lease of a freeze for a save ran out");
        limits_thaw();
    }
}
