/* Faults for the agent built for the host (tests/support/faults.py), by LD_PRELOAD:
 *
 *   SANDLOT_FAULT_READDIR=NAME   readdir() of a directory whose path contains NAME
 *                                fails with EIO after two entries, as a failing disk
 *                                or a vanished /proc directory does.
 *   SANDLOT_FAULT_MALLOC=BYTES   once the file SANDLOT_FAULT_ARMED names exists,
 *                                every malloc/realloc of BYTES or more fails (ENOMEM).
 *
 * Only tests load it; the agent itself has no hook. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int dir_matches(DIR *d, const char *name)
{
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", dirfd(d));
    ssize_t n = readlink(link, path, sizeof(path) - 1);
    if (n < 0) {
        return 0;
    }
    path[n] = 0;
    return strstr(path, name) != NULL;
}

static DIR *counted_dir;
static int counted;

struct dirent *readdir(DIR *d)
{
    static struct dirent *(*real)(DIR *);
    if (!real) {
        real = (struct dirent * (*)(DIR *)) dlsym(RTLD_NEXT, "readdir");
    }
    const char *name = getenv("SANDLOT_FAULT_READDIR");
    if (name && *name && dir_matches(d, name)) {
        if (counted_dir != d) {
            counted_dir = d;
            counted = 0;
        }
        if (counted++ >= 2) {
            errno = EIO;
            return NULL;
        }
    }
    return real(d);
}

static int malloc_fails(size_t n)
{
    static size_t limit = (size_t)-1;
    static int read_limit;
    if (!read_limit) {
        const char *v = getenv("SANDLOT_FAULT_MALLOC");
        limit = v && *v ? strtoull(v, NULL, 10) : (size_t)-1;
        read_limit = 1;
    }
    if (n < limit) {
        return 0;
    }
    const char *armed = getenv("SANDLOT_FAULT_ARMED");
    return armed && access(armed, F_OK) == 0;
}

extern void *__libc_malloc(size_t);
extern void *__libc_realloc(void *, size_t);

void *malloc(size_t n)
{
    if (malloc_fails(n)) {
        errno = ENOMEM;
        return NULL;
    }
    return __libc_malloc(n);
}

void *realloc(void *p, size_t n)
{
    if (malloc_fails(n)) {
        errno = ENOMEM;
        return NULL;
    }
    return __libc_realloc(p, n);
}
