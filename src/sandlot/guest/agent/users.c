/* User resolution from the guest's own /etc/passwd and /etc/group.
 * No NSS: the agent is static and must work in any image (alpine, distroless). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent.h"

static int parse_id(const char *s, unsigned long *out)
{
    if (!*s) {
        return 0;
    }
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (*end || errno || v > 0x7fffffffUL) {
        return 0;
    }
    *out = v;
    return 1;
}

/* Split a passwd/group line into at most max fields separated by ':'. */
static int split_fields(char *line, char **f, int max)
{
    int n = 0;
    char *p = line;
    line[strcspn(line, "\n")] = 0;
    while (n < max) {
        f[n++] = p;
        p = strchr(p, ':');
        if (!p) {
            break;
        }
        *p++ = 0;
    }
    return n;
}

/* Find a passwd entry by name (name != NULL) or uid. */
static int find_passwd(const char *name, uid_t uid, struct user_spec *u)
{
    FILE *f = fopen("/etc/passwd", "re");
    if (!f) {
        return 0;
    }
    char line[1024];
    int found = 0;
    while (fgets(line, sizeof(line), f)) {
        char *fl[7];
        if (split_fields(line, fl, 7) < 7) {
            continue;
        }
        unsigned long id, gid;
        if (!parse_id(fl[2], &id) || !parse_id(fl[3], &gid)) {
            continue;
        }
        if (name ? strcmp(fl[0], name) != 0 : id != uid) {
            continue;
        }
        u->uid = (uid_t)id;
        u->gid = (gid_t)gid;
        snprintf(u->name, sizeof(u->name), "%s", fl[0]);
        snprintf(u->home, sizeof(u->home), "%s", fl[5]);
        snprintf(u->shell, sizeof(u->shell), "%s", fl[6]);
        found = 1;
        break;
    }
    fclose(f);
    return found;
}

int find_group(const char *name, gid_t *gid)
{
    FILE *f = fopen("/etc/group", "re");
    if (!f) {
        return 0;
    }
    char line[4096];
    int found = 0;
    while (fgets(line, sizeof(line), f)) {
        char *fl[4];
        unsigned long id;
        if (split_fields(line, fl, 4) < 3 || strcmp(fl[0], name) || !parse_id(fl[2], &id)) {
            continue;
        }
        *gid = (gid_t)id;
        found = 1;
        break;
    }
    fclose(f);
    return found;
}

/* Supplementary groups: every group that lists the user as a member. */
static void find_supplementary(struct user_spec *u)
{
    u->ngroups = 0;
    u->groups[u->ngroups++] = u->gid;
    if (!u->name[0]) {
        return;
    }
    FILE *f = fopen("/etc/group", "re");
    if (!f) {
        return;
    }
    char line[4096];
    while (fgets(line, sizeof(line), f)) {
        char *fl[4];
        unsigned long id;
        if (split_fields(line, fl, 4) < 4 || !parse_id(fl[2], &id) || (gid_t)id == u->gid) {
            continue;
        }
        char *save = NULL;
        for (char *m = strtok_r(fl[3], ",", &save); m; m = strtok_r(NULL, ",", &save)) {
            if (!strcmp(m, u->name) && u->ngroups < (int)(sizeof(u->groups) / sizeof(u->groups[0]))) {
                u->groups[u->ngroups++] = (gid_t)id;
                break;
            }
        }
    }
    fclose(f);
}

/* spec: "name", "uid", "name:group", "uid:gid", "name:gid", "uid:group". */
int resolve_user(const char *spec, struct user_spec *u, char *err, size_t errlen)
{
    char user[256], group[256];
    memset(u, 0, sizeof(*u));
    const char *colon = strchr(spec, ':');
    size_t ul = colon ? (size_t)(colon - spec) : strlen(spec);
    if (ul == 0 || ul >= sizeof(user) || (colon && (!colon[1] || strlen(colon + 1) >= sizeof(group)))) {
        snprintf(err, errlen, "invalid user %.200s", spec);
        return -1;
    }
    memcpy(user, spec, ul);
    user[ul] = 0;
    group[0] = 0;
    if (colon) {
        snprintf(group, sizeof(group), "%s", colon + 1);
    }

    unsigned long id;
    int explicit_group = group[0] != 0;
    if (parse_id(user, &id)) {
        if (!find_passwd(NULL, (uid_t)id, u)) {
            /* a uid with no passwd entry is allowed, as in Docker: gid 0, home / */
            u->uid = (uid_t)id;
            u->gid = 0;
            snprintf(u->home, sizeof(u->home), "/");
        }
    } else if (!find_passwd(user, 0, u)) {
        snprintf(err, errlen, "unknown user %.200s (not in the guest's /etc/passwd)", user);
        return -1;
    }
    if (explicit_group) {
        gid_t gid;
        if (parse_id(group, &id)) {
            u->gid = (gid_t)id;
        } else if (find_group(group, &gid)) {
            u->gid = gid;
        } else {
            snprintf(err, errlen, "unknown group %.200s (not in the guest's /etc/group)", group);
            return -1;
        }
        u->ngroups = 1;
        u->groups[0] = u->gid;
    } else {
        find_supplementary(u);
    }
    return 0;
}
