/* What the guest says of itself in CONTROL STATUS, for the host's metrics: memory,
 * network and disk bytes as the guest kernel counts them, and the commands started
 * with how long each took to start. Read on each STATUS (files of /proc and /sys,
 * a few microseconds), so nothing runs between two polls. */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "agent.h"

static uint64_t g_execs;          /* commands started since the agent started */
static uint64_t g_exec_start_us;  /* their time from request to running, summed */

uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

void stats_exec_started(uint64_t since_us)
{
    g_execs++;
    g_exec_start_us += now_us() - since_us;
}

static size_t read_file(const char *path, char *buf, size_t size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        buf[0] = 0;
        return 0;
    }
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    buf[n > 0 ? n : 0] = 0;
    return n > 0 ? (size_t)n : 0;
}

static uint64_t meminfo(const char *text, const char *key)
{
    const char *at = strstr(text, key);
    return at ? strtoull(at + strlen(key), NULL, 10) : 0;
}

/* Bytes received and sent by every interface but loopback (/proc/net/dev: after
 * "name:", 8 receive counters then 8 transmit ones, bytes first in each). */
static void net_bytes(uint64_t *rx, uint64_t *tx)
{
    char text[4096];
    *rx = *tx = 0;
    read_file("/proc/net/dev", text, sizeof(text));
    for (char *line = strchr(text, '\n'); line && *++line; line = strchr(line, '\n')) {
        char *colon = strchr(line, ':');
        char *end = strchr(line, '\n');
        if (!colon || (end && colon > end)) {
            continue;
        }
        char *name = line;
        while (*name == ' ') {
            name++;
        }
        if (strncmp(name, "lo:", 3) == 0) {
            continue;
        }
        unsigned long long f[9];
        if (sscanf(colon + 1, "%llu %llu %llu %llu %llu %llu %llu %llu %llu", &f[0], &f[1], &f[2], &f[3], &f[4],
                   &f[5], &f[6], &f[7], &f[8]) == 9) {
            *rx += f[0];
            *tx += f[8];
        }
    }
}

/* Bytes read and written by the guest's virtio disks (/sys/block/vd*: sectors of 512
 * bytes, the 3rd and 7th fields of "stat"); none under gVisor. */
static void disk_bytes(uint64_t *rd, uint64_t *wr)
{
    *rd = *wr = 0;
    DIR *d = opendir("/sys/block");
    if (!d) {
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, "vd", 2) != 0) {
            continue;
        }
        char path[300], text[512];
        snprintf(path, sizeof(path), "/sys/block/%s/stat", e->d_name);
        unsigned long long f[7];
        read_file(path, text, sizeof(text));
        if (sscanf(text, "%llu %llu %llu %llu %llu %llu %llu", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6]) == 7) {
            *rd += f[2] * 512;
            *wr += f[6] * 512;
        }
    }
    closedir(d);
}

void stats_add(struct msg *m)
{
    char text[2048];
    read_file("/proc/meminfo", text, sizeof(text));
    msg_u64(m, SL_T_MEM_TOTAL_KB, meminfo(text, "MemTotal:"));
    msg_u64(m, SL_T_MEM_AVAILABLE_KB, meminfo(text, "MemAvailable:"));
    uint64_t a, b;
    net_bytes(&a, &b);
    msg_u64(m, SL_T_NET_RX_BYTES, a);
    msg_u64(m, SL_T_NET_TX_BYTES, b);
    disk_bytes(&a, &b);
    msg_u64(m, SL_T_DISK_READ_BYTES, a);
    msg_u64(m, SL_T_DISK_WRITTEN_BYTES, b);
    msg_u64(m, SL_T_EXECS, g_execs);
    msg_u64(m, SL_T_EXEC_START_US, g_exec_start_us);
}
