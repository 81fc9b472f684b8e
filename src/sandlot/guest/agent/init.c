/* PID 1 duties: early mounts, kernel modules, root disk, switch root,
 * hostname, clock, entropy, and an orderly power-off. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

/* Kernel ioctl numbers, spelled out so the agent builds with musl's headers alone. */
#ifndef BLKGETSIZE64
#define BLKGETSIZE64 _IOR(0x12, 114, size_t)
#endif
#ifndef RNDRESEEDCRNG
#define RNDRESEEDCRNG _IO('R', 0x07)
#endif
#ifndef RNDADDENTROPY
#define RNDADDENTROPY _IOW('R', 0x03, int[2])
#endif
#ifndef EXT4_IOC_RESIZE_FS
#define EXT4_IOC_RESIZE_FS _IOW('f', 16, uint64_t)
#endif

static char g_boot_id[64] = "unknown";
static char g_cmd_hostname[65];
static int g_cmd_net; /* sandlot.net=1: the box has a network card (QEMU user networking) */
static int g_cmd_egress; /* sandlot.egress=1: and the egress port (egress.c) */
static int g_cmd_dns_relay; /* sandlot.dns=relay: names are answered by the host (dns.c), not QEMU */
static int g_net_given;     /* --net: the sandbox configured the card itself (gVisor takes its netns's) */
static int g_cmd_ports;     /* sandlot.ports=N: the agent ports the host made (0: it did not say) */
static char g_root_dev[64] = "/dev/vda";
static char g_root_fstype[16] = "ext4";

static void panic_poweroff(const char *why)
{
    logmsg("fatal: %s; powering off", why);
    sync();
    sleep(1); /* let the console drain */
    reboot(RB_POWER_OFF);
    _exit(1);
}

static void mount_or_log(const char *src, const char *dst, const char *type, unsigned long flags, const char *data)
{
    mkdir(dst, 0755);
    if (mount(src, dst, type, flags, data) < 0 && errno != EBUSY) {
        logmsg("mount %s on %s: %s", type, dst, strerror(errno));
    }
}

static void parse_cmdline(void)
{
    char buf[4096];
    int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return;
    }
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) {
        return;
    }
    buf[n] = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, " \n", &save); tok; tok = strtok_r(NULL, " \n", &save)) {
        if (!strncmp(tok, "sandlot.hostname=", 17)) {
            snprintf(g_cmd_hostname, sizeof(g_cmd_hostname), "%s", tok + 17);
        } else if (!strncmp(tok, "sandlot.root=", 13)) {
            snprintf(g_root_dev, sizeof(g_root_dev), "%s", tok + 13);
        } else if (!strcmp(tok, "sandlot.net=1")) {
            g_cmd_net = 1;
        } else if (!strcmp(tok, "sandlot.dns=relay")) {
            g_cmd_dns_relay = 1;
        } else if (!strcmp(tok, "sandlot.egress=1")) {
            g_cmd_egress = 1;
        } else if (!strncmp(tok, "sandlot.ports=", 14)) {
            g_cmd_ports = atoi(tok + 14);
        } else if (!strncmp(tok, "sandlot.rootfstype=", 19)) {
            snprintf(g_root_fstype, sizeof(g_root_fstype), "%s", tok + 19);
        }
    }
}

int boot_ports(void)
{
    return g_cmd_ports;
}

static void load_modules(void)
{
    FILE *f = fopen("/sandlot/modules.order", "re");
    if (!f) {
        return;
    }
    char name[256], path[400];
    while (fgets(name, sizeof(name), f)) {
        name[strcspn(name, "\n")] = 0;
        if (!name[0] || strchr(name, '/')) {
            continue;
        }
        snprintf(path, sizeof(path), "/sandlot/modules/%s", name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            logmsg("module %s: %s", name, strerror(errno));
            continue;
        }
        if (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST) {
            logmsg("module %s: %s", name, strerror(errno));
        }
        close(fd);
        unlink(path); /* the initramfs is RAM: give it back */
    }
    fclose(f);
}

/* Free page reporting (the balloon's) in blocks of 128 KiB, not the 2 MiB the kernel
 * sets when the balloon registers: what boot-time work touched and freed is scattered
 * in smaller blocks (measured: an idle box's guest RAM on the host 108 -> 100.5 MiB).
 * Lower orders gave little more for many more reports. */
static void tune_page_reporting(void)
{
    int fd = open("/sys/module/page_reporting/parameters/page_reporting_order", O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
        return; /* no balloon, or a kernel without free page reporting */
    }
    if (write(fd, "5", 1) < 0) {
        logmsg("page_reporting_order: %s", strerror(errno));
    }
    close(fd);
}

int read_sys(const char *path, char *buf, size_t n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        buf[0] = 0;
        return -1;
    }
    ssize_t r = read(fd, buf, n - 1);
    close(fd);
    buf[r > 0 ? r : 0] = 0;
    buf[strcspn(buf, "\n")] = 0;
    return r > 0 ? (int)strlen(buf) : -1;
}

int wait_for(const char *path, int ms)
{
    struct stat st;
    for (int waited = 0; waited <= ms; waited += 2) {
        if (stat(path, &st) == 0) {
            return 0;
        }
        usleep(2000);
    }
    return -1;
}

/* ext4 superblock: total blocks and block size, to grow the filesystem when
 * the disk is larger than the image it was made from. */
static int ext4_geometry(const char *dev, uint64_t *blocks, uint64_t *block_size, uint64_t *dev_bytes)
{
    uint8_t sb[1024];
    int fd = open(dev, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    int ok = pread(fd, sb, sizeof(sb), 1024) == (ssize_t)sizeof(sb) && ioctl(fd, BLKGETSIZE64, dev_bytes) == 0;
    close(fd);
    if (!ok || rd16(sb + 0x38) != 0xEF53) {
        return -1;
    }
    uint32_t feature_incompat = rd32(sb + 0x60);
    *block_size = 1024ull << rd32(sb + 0x18);
    *blocks = rd32(sb + 0x4);
    if (feature_incompat & 0x80) { /* 64bit */
        *blocks |= (uint64_t)rd32(sb + 0x150) << 32;
    }
    return 0;
}

static void grow_root(const char *dev)
{
    uint64_t blocks, bs, dev_bytes;
    if (strcmp(g_root_fstype, "ext4") || ext4_geometry(dev, &blocks, &bs, &dev_bytes) < 0) {
        return;
    }
    uint64_t want = dev_bytes / bs;
    if (want <= blocks + (16u << 20) / bs) {
        return;
    }
    int fd = open("/newroot", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        return;
    }
    if (ioctl(fd, EXT4_IOC_RESIZE_FS, &want) < 0) {
        logmsg("growing the root filesystem to %llu blocks: %s", (unsigned long long)want, strerror(errno));
    }
    close(fd);
}

static void move_to(const char *from, const char *to)
{
    mkdir(to, 0755);
    if (mount(from, to, NULL, MS_MOVE, NULL) < 0) {
        logmsg("move %s to %s: %s", from, to, strerror(errno));
    }
}

void init_early(void)
{
    mount_or_log("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    mount_or_log("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount_or_log("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    parse_cmdline();
    load_modules();
    tune_page_reporting();

    if (wait_for(g_root_dev, 10000) < 0) {
        panic_poweroff("root disk did not appear");
    }
    mkdir("/newroot", 0755);
    /* The base image is a sparse file whose unused inode tables already read as
     * zeros: noinit_itable stops the kernel from zeroing them again, which would
     * copy tens of MB into every box's overlay. no_prefetch_block_bitmaps: the
     * bitmaps are read when an allocation needs them, not by a background thread
     * that a VM restored from a state saved soon after boot would run again (a
     * quarter of the blocks a restored VM translates under TCG before its HELLO). */
    const char *rootflags = strcmp(g_root_fstype, "ext4") == 0 ? "noinit_itable,no_prefetch_block_bitmaps" : NULL;
    if (mount(g_root_dev, "/newroot", g_root_fstype, 0, rootflags) < 0) {
        char why[160];
        snprintf(why, sizeof(why), "cannot mount %s (%s) as the root: %s", g_root_dev, g_root_fstype,
                 strerror(errno));
        panic_poweroff(why);
    }
    grow_root(g_root_dev);
    move_to("/dev", "/newroot/dev");
    move_to("/proc", "/newroot/proc");
    move_to("/sys", "/newroot/sys");
    unlink("/sandlot/modules.order");
    rmdir("/sandlot/modules");
    rmdir("/sandlot");
    unlink("/init");
    if (chdir("/newroot") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 || chdir("/") < 0) {
        panic_poweroff("cannot switch to the root disk");
    }
}

static void bring_up_loopback(void)
{
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return;
    }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "lo");
    if (ioctl(fd, SIOCGIFFLAGS, &ifr) == 0) {
        ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
        ioctl(fd, SIOCSIFFLAGS, &ifr);
    }
    close(fd);
}

static int set_addr(int fd, const char *ifname, unsigned long req, const char *addr)
{
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname);
    struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
    sin->sin_family = AF_INET;
    inet_pton(AF_INET, addr, &sin->sin_addr);
    return ioctl(fd, req, &ifr);
}

/* QEMU's user networking has fixed addresses: the guest is 10.0.2.15/24, the
 * gateway 10.0.2.2 and the resolver 10.0.2.3. The host decides what any of it
 * reaches. Where the host filters (sandlot.dns=relay), 10.0.2.3 is out of reach
 * and the resolver is the relay to the host's answerer (dns.c). The image's
 * /etc/resolv.conf (often copied from the machine that built it) is covered,
 * not changed: ours is bind-mounted over it. */
/* Bind SOURCE (a file of /run's tmpfs) over TARGET, which is made, empty, where the
 * image has none: something to cover. 0, or -1 with errno. */
static int bind_over(const char *source, const char *target, mode_t cover_mode)
{
    struct stat st;
    if (lstat(target, &st) != 0) {
        int cover = open(target, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, cover_mode);
        if (cover < 0) {
            return -1;
        }
        close(cover);
    }
    return mount(source, target, NULL, MS_BIND, NULL);
}

/* QEMU's card: the guest's fixed address and route (see above). */
static void configure_card(void)
{
    char ifname[IFNAMSIZ] = "";
    for (int waited = 0; waited < 2000 && !ifname[0]; waited += 10) {
        DIR *d = opendir("/sys/class/net");
        struct dirent *de;
        while (d && (de = readdir(d))) {
            if (de->d_name[0] != '.' && strcmp(de->d_name, "lo") && strlen(de->d_name) < IFNAMSIZ) {
                memcpy(ifname, de->d_name, strlen(de->d_name) + 1); /* shorter than IFNAMSIZ */
                break;
            }
        }
        if (d) {
            closedir(d);
        }
        if (!ifname[0]) {
            usleep(10000);
        }
    }
    if (!ifname[0]) {
        logmsg("network: no network card appeared");
        return;
    }
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return;
    }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname);
    if (set_addr(fd, ifname, SIOCSIFADDR, "10.0.2.15") < 0 || set_addr(fd, ifname, SIOCSIFNETMASK, "255.255.255.0") < 0 ||
        ioctl(fd, SIOCGIFFLAGS, &ifr) < 0) {
        logmsg("network: configuring %s: %s", ifname, strerror(errno));
        close(fd);
        return;
    }
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(fd, SIOCSIFFLAGS, &ifr) < 0) {
        logmsg("network: bringing up %s: %s", ifname, strerror(errno));
    }
    struct rtentry rt;
    memset(&rt, 0, sizeof(rt));
    struct sockaddr_in *gw = (struct sockaddr_in *)&rt.rt_gateway, *dst = (struct sockaddr_in *)&rt.rt_dst,
                       *mask = (struct sockaddr_in *)&rt.rt_genmask;
    gw->sin_family = dst->sin_family = mask->sin_family = AF_INET;
    inet_pton(AF_INET, "10.0.2.2", &gw->sin_addr);
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    rt.rt_dev = ifname;
    if (ioctl(fd, SIOCADDRT, &rt) < 0) {
        logmsg("network: default route: %s", strerror(errno));
    }
    close(fd);
}

/* A container's init (gVisor) is told by its arguments what a VM's reads from the
 * kernel's command line; its sandbox gave the card its address and routes already. */
void network_given(int dns_relay)
{
    g_cmd_net = 1;
    g_net_given = 1;
    g_cmd_dns_relay = dns_relay;
}

static void bring_up_network(void)
{
    if (!g_net_given) {
        configure_card();
    }
    if (g_cmd_egress) {
        egress_start();
    }
    if (g_cmd_dns_relay) {
        dns_relay_start();
    }
    const char *conf = g_cmd_dns_relay ? "nameserver 127.0.0.53\n" : "nameserver 10.0.2.3\n";
    mkdir("/run/sandlot", 0755);
    char target[256] = "/run/sandlot/resolv.conf";
    struct stat st;
    if (lstat("/etc/resolv.conf", &st) == 0 && S_ISLNK(st.st_mode)) {
        /* a link into /run (systemd-resolved images): /run is our tmpfs, write there */
        ssize_t n = readlink("/etc/resolv.conf", target, sizeof(target) - 1);
        target[n > 0 ? n : 0] = 0;
        if (strncmp(target, "/run/", 5) || strstr(target, "..")) {
            logmsg("network: /etc/resolv.conf links to %s; left as it is", target);
            return;
        }
        char dir[256];
        snprintf(dir, sizeof(dir), "%s", target);
        for (char *q = dir + 1; *q; q++) {
            if (*q == '/') {
                *q = 0;
                mkdir(dir, 0755);
                *q = '/';
            }
        }
    }
    int rf = open(target, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (rf < 0 || write(rf, conf, strlen(conf)) != (ssize_t)strlen(conf)) {
        logmsg("network: %s: %s", target, strerror(errno));
    }
    if (rf >= 0) {
        close(rf);
    }
    if (strcmp(target, "/run/sandlot/resolv.conf")) {
        return; /* written through the link */
    }
    if (bind_over(target, "/etc/resolv.conf", 0644) < 0) {
        logmsg("network: /etc/resolv.conf: %s", strerror(errno));
    }
}

/* Every HELLO writes the box's machine-id (each start, restore and fork child): into
 * a file of /run's tmpfs bound over the image's /etc/machine-id, not onto the root's
 * ext4, which would then journal and write back in every restored VM (under TCG a
 * few thousand kernel blocks each VM translates again). The box's id comes with each
 * HELLO, so nothing needs it on disk (an image without the file gets an empty one
 * to bind over, written once, at the first boot). */
static void machine_id_in_memory(void)
{
    struct stat st;
    if (lstat("/etc/machine-id", &st) == 0 && !S_ISREG(st.st_mode)) {
        return;
    }
    char id[40] = {0};
    int in = open("/etc/machine-id", O_RDONLY | O_CLOEXEC);
    ssize_t n = in >= 0 ? read(in, id, sizeof(id) - 1) : -1;
    if (in >= 0) {
        close(in);
    }
    mkdir("/run/sandlot", 0755);
    int out = open("/run/sandlot/machine-id", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0444);
    if (out < 0) {
        return;
    }
    int ok = n <= 0 || write(out, id, (size_t)n) == n;
    close(out);
    if (!ok) {
        logmsg("machine-id in /run: write failed");
    } else if (bind_over("/run/sandlot/machine-id", "/etc/machine-id", 0444) < 0 && errno != ENOENT && errno != EROFS) {
        logmsg("machine-id in /run: %s", strerror(errno)); /* no /etc, or a read-only root: the HELLO does what it can */
    }
}

/* Minimal images (debootstrap's minbase, scratch images) have no /etc/hosts, and
 * then "localhost" does not resolve: a program connecting to itself fails (CPython's
 * own test suite: 298 failures). An image's own file is never touched. */
static void ensure_hosts_file(void)
{
    static const char hosts[] = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";
    mkdir("/etc", 0755);
    int fd = open("/etc/hosts", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        return; /* there is one (or /etc is read-only): leave it */
    }
    if (write(fd, hosts, sizeof(hosts) - 1) < 0) {
        logmsg("write /etc/hosts: %s", strerror(errno));
    }
    close(fd);
}

/* /dev/kvm, in a box with nested virtualization (its modules load with the others), as a
 * distro's udev leaves it: group kvm where the image has one, and mode 0666 as systemd's
 * default rule has it, so that any user of the box may run VMs of their own. */
static void open_up_kvm(void)
{
    gid_t gid;
    if (access("/dev/kvm", F_OK) != 0) {
        return;
    }
    if (find_group("kvm", &gid) && chown("/dev/kvm", 0, gid) < 0) {
        logmsg("chown /dev/kvm: %s", strerror(errno));
    }
    if (chmod("/dev/kvm", 0666) < 0) {
        logmsg("chmod /dev/kvm: %s", strerror(errno));
    }
}

void init_after_root(void)
{
    mount_or_log("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5");
    mount_or_log("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    mount_or_log("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    mount_or_log("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755");
    /* favordynmods (Linux 6.0+): moving a task into a cgroup, which every command
     * does, no longer waits for an RCU grace period (measured: 9 ms an exec) */
    if (mount("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, "favordynmods") < 0) {
        mount_or_log("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    }
    limits_init();
    symlink("/proc/self/fd", "/dev/fd");
    symlink("/proc/self/fd/0", "/dev/stdin");
    symlink("/proc/self/fd/1", "/dev/stdout");
    symlink("/proc/self/fd/2", "/dev/stderr");
    if (access("/dev/ptmx", F_OK) != 0) {
        symlink("pts/ptmx", "/dev/ptmx");
    }
    open_up_kvm();
    bring_up_loopback();
    ensure_hosts_file();
    machine_id_in_memory();
    if (g_cmd_net) {
        bring_up_network();
    }
    set_hostname(g_cmd_hostname[0] ? g_cmd_hostname : "sandlot");
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, g_boot_id, sizeof(g_boot_id) - 1);
        g_boot_id[n > 0 ? n : 0] = 0;
        g_boot_id[strcspn(g_boot_id, "\n")] = 0;
        close(fd);
    }
}

const char *boot_id(void) { return g_boot_id; }

/* /dev/<name> of the virtio disk whose serial is ``serial``: drives are named by the
 * order the kernel found them, so a volume is known by the serial the host gave it. */
static int find_drive(const char *serial, char *dev, size_t len)
{
    for (int tries = 0; tries < 100; tries++) { /* probed at boot; a late probe gets 2 s */
        DIR *d = opendir("/sys/block");
        struct dirent *e;
        while (d && (e = readdir(d)) != NULL) {
            if (strncmp(e->d_name, "vd", 2) != 0) {
                continue;
            }
            char path[300], got[64] = "";
            snprintf(path, sizeof(path), "/sys/block/%s/serial", e->d_name);
            if (read_sys(path, got, sizeof(got)) >= 0 && strcmp(got, serial) == 0) {
                snprintf(dev, len, "/dev/%s", e->d_name);
                closedir(d);
                return 0;
            }
        }
        if (d) {
            closedir(d);
        }
        usleep(20000);
    }
    errno = ENODEV;
    return -1;
}

/* ---- virtio-9p shares, taken down for a save ------------------------------------ */

/* QEMU refuses to save a VM while a 9p export is mounted in its guest (its 9p server's
 * open fids cannot be saved), so a box with shares has them unmounted for a save, with
 * every command frozen, and mounted again before its commands thaw: no command ever
 * sees a mount point bare. A state saved so comes back with its shares down and its
 * commands frozen, and its thaw mounts them. */
#define MAX_SHARES 8
static struct {
    char tag[64];
    char where[1024];
    uint32_t flags;
    int down;
} g_shares[MAX_SHARES];
static int g_nshares;

static int mount_9p(int i)
{
    unsigned long mflags = MS_NOSUID | MS_NODEV | ((g_shares[i].flags & SL_MOUNT_READONLY) ? MS_RDONLY : 0);
    return mount(g_shares[i].tag, g_shares[i].where, "9p", mflags,
                 "trans=virtio,version=9p2000.L,msize=524288,cache=mmap");
}

/* Mounted once: asking again for a share that is up (a host that lost track) is done. */
static int mount_share(const char *tag, const char *where, uint32_t flags)
{
    int i = 0;
    while (i < g_nshares && strcmp(g_shares[i].where, where) != 0) {
        i++;
    }
    if (i < g_nshares && !g_shares[i].down && strcmp(g_shares[i].tag, tag) == 0) {
        return 0;
    }
    if (i == MAX_SHARES || strlen(tag) >= sizeof(g_shares[i].tag) || strlen(where) >= sizeof(g_shares[i].where)) {
        errno = i == MAX_SHARES ? ENOSPC : ENAMETOOLONG;
        return -1;
    }
    snprintf(g_shares[i].tag, sizeof(g_shares[i].tag), "%s", tag);
    snprintf(g_shares[i].where, sizeof(g_shares[i].where), "%s", where);
    g_shares[i].flags = flags;
    if (mount_9p(i) < 0) {
        return -1;
    }
    g_shares[i].down = 0;
    g_nshares = i == g_nshares ? i + 1 : g_nshares;
    return 0;
}

static int is_under(const char *path, const char *where)
{
    size_t n = strlen(where);
    return strncmp(path, where, n) == 0 && (path[n] == 0 || path[n] == '/' || path[n] == ' ');
}

/* The processes that keep ``where`` busy (a working directory, a root, an executable or
 * an open file under it), for the error that says why a save cannot take it down. */
static void share_holders(const char *where, char *out, size_t len)
{
    out[0] = 0;
    DIR *d = opendir("/proc");
    struct dirent *e;
    int found = 0;
    while (d && (e = readdir(d)) != NULL && found < 4) {
        int pid = atoi(e->d_name);
        if (pid <= 0 || pid == getpid()) {
            continue;
        }
        char path[300], target[1100];
        int held = 0;
        static const char *const links[] = {"cwd", "root", "exe"};
        for (size_t k = 0; k < 3 && !held; k++) {
            snprintf(path, sizeof(path), "/proc/%d/%s", pid, links[k]);
            ssize_t n = readlink(path, target, sizeof(target) - 1);
            held = n > 0 && (target[n] = 0, is_under(target, where));
        }
        snprintf(path, sizeof(path), "/proc/%d/fd", pid);
        DIR *fds = held ? NULL : opendir(path);
        struct dirent *f;
        while (fds && !held && (f = readdir(fds)) != NULL) {
            snprintf(path, sizeof(path), "/proc/%d/fd/%s", pid, f->d_name);
            ssize_t n = readlink(path, target, sizeof(target) - 1);
            held = n > 0 && (target[n] = 0, is_under(target, where));
        }
        if (fds) {
            closedir(fds);
        }
        if (held) {
            char comm[64] = "";
            snprintf(path, sizeof(path), "/proc/%d/comm", pid);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            ssize_t got = fd < 0 ? 0 : read(fd, comm, sizeof(comm) - 1);
            comm[got > 0 ? got : 0] = 0;
            comm[strcspn(comm, "\n")] = 0;
            if (fd >= 0) {
                close(fd);
            }
            size_t used = strlen(out);
            snprintf(out + used, len - used, "%spid %d (%s)", found ? ", " : "", pid, comm);
            found++;
        }
    }
    if (d) {
        closedir(d);
    }
}

int shares_detach(char *err, size_t errlen)
{
    if (!limits_frozen()) {
        snprintf(err, errlen, "shares are taken down for a save only while the commands are frozen");
        errno = EINVAL;
        return -1;
    }
    for (int i = 0; i < g_nshares; i++) {
        if (g_shares[i].down) {
            continue;
        }
        if (umount2(g_shares[i].where, 0) < 0) {
            int e = errno;
            char who[400];
            share_holders(g_shares[i].where, who, sizeof(who));
            snprintf(err, errlen, "%s cannot be unmounted for the save: %s%s%s", g_shares[i].where,
                     e == EBUSY ? "files are open under it" : strerror(e), who[0] ? ", by " : "", who);
            shares_attach();
            errno = e;
            return -1;
        }
        g_shares[i].down = 1;
    }
    return 0;
}

void shares_attach(void)
{
    for (int i = 0; i < g_nshares; i++) {
        if (g_shares[i].down && mount_9p(i) < 0) {
            logmsg("mount the share %s on %s again: %s", g_shares[i].tag, g_shares[i].where, strerror(errno));
        } else {
            g_shares[i].down = 0;
        }
    }
}

int mount_volume(const char *tag, const char *where, uint32_t flags)
{
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s", where);
    for (char *q = tmp + 1; *q; q++) {
        if (*q == '/') {
            *q = 0;
            mkdir(tmp, 0755);
            *q = '/';
        }
    }
    mkdir(tmp, 0755);
    unsigned long mflags = MS_NOSUID | MS_NODEV | ((flags & SL_MOUNT_READONLY) ? MS_RDONLY : 0);
    if (flags & SL_MOUNT_BLOCK) {
        char dev[300];
        if (find_drive(tag, dev, sizeof(dev)) < 0) {
            return -1;
        }
        /* read-only or not, the drive is writable (a private top layer), so the kernel
         * replays a journal left by a box that ended without unmounting */
        return mount(dev, where, "ext4", mflags, "noinit_itable,no_prefetch_block_bitmaps");
    }
    return mount_share(tag, where, flags); /* a host directory shared over virtio-9p */
}

void set_hostname(const char *name)
{
    if (!g_is_pid1 || !name[0]) {
        return;
    }
    if (sethostname(name, strlen(name)) < 0) {
        logmsg("sethostname: %s", strerror(errno));
    }
}

void add_entropy(const uint8_t *p, size_t n)
{
    if (!g_is_pid1 || n == 0) {
        return; /* never feed the host's pool from a test build */
    }
    struct {
        int entropy_count;
        int buf_size;
        uint8_t buf[4096];
    } info;
    if (n > sizeof(info.buf)) {
        n = sizeof(info.buf);
    }
    info.entropy_count = (int)(n * 8);
    info.buf_size = (int)n;
    memcpy(info.buf, p, n);
    int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (ioctl(fd, RNDADDENTROPY, &info) < 0) {
            logmsg("RNDADDENTROPY: %s", strerror(errno));
        }
        /* a restored or forked guest must not repeat its CRNG output: reseed now,
         * not at the next scheduled reseed (up to a minute away) */
        if (ioctl(fd, RNDRESEEDCRNG, NULL) < 0 && errno != EINVAL) {
            logmsg("RNDRESEEDCRNG: %s", strerror(errno));
        }
        close(fd);
    }
}

/* The guest kernel's address-space randomization (kernel.randomize_va_space): 2 (on) or
 * 0 (off), as the box asks at every HELLO, so a box restored or forked from a state saved
 * with the other has its own. Under TCG it is what a dynamically linked program's start
 * costs most: QEMU 7.2 translates guest code per virtual address, so each process whose
 * libraries land elsewhere translates them again. What it last set is kept, in the
 * saved memory too: a restored or forked guest whose setting stays makes no system call
 * (each is kernel code to translate again on a fork child's HELLO). */
static int g_aslr = -1;

int set_aslr(int want)
{
    if (want == g_aslr) {
        return g_aslr;
    }
    int fd = open("/proc/sys/kernel/randomize_va_space", O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        return -1; /* gVisor has none: it always randomizes */
    }
    char cur[8] = {0};
    ssize_t n = pread(fd, cur, sizeof(cur) - 1, 0);
    int now = n > 0 ? atoi(cur) : -1;
    if (g_is_pid1 && (want == 0 || want == 2) && now != want) {
        char v[2] = {(char)('0' + want), '\n'};
        if (pwrite(fd, v, sizeof(v), 0) == (ssize_t)sizeof(v)) {
            now = want;
        } else {
            logmsg("randomize_va_space %d: %s", want, strerror(errno));
        }
    }
    close(fd);
    if (now == want) {
        g_aslr = now;
    }
    return now;
}

/* /etc/machine-id of the root, set to the id the host gives (each fork child is
 * its own machine). This runs on every HELLO, and after a restore under TCG every
 * kernel path the guest takes costs translation: rewriting the existing 33 bytes
 * in place costs a third of a create + rename (measured: ~6,700 translated blocks,
 * 50 ms per fork child). A file that is missing or of another size is replaced
 * atomically instead. */
void set_machine_id(const char *id)
{
    if (!g_is_pid1 || strlen(id) != 32) {
        return;
    }
    char line[33];
    memcpy(line, id, 32);
    line[32] = '\n';
    char cur[40] = {0};
    int fd = open("/etc/machine-id", O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd >= 0) {
        ssize_t n = pread(fd, cur, sizeof(cur), 0);
        /* truncated only when longer: a truncate to its own size still walks tmpfs's
         * truncation paths (~120 translated blocks per restored VM) */
        int ok = (n == 33 && memcmp(cur, line, 33) == 0) ||
                 (pwrite(fd, line, 33, 0) == 33 && (n <= 33 || ftruncate(fd, 33) == 0));
        close(fd);
        if (ok) {
            return;
        }
    }
    fd = open("/etc/.machine-id.sandlot", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0444);
    if (fd < 0) {
        return; /* no /etc, or a read-only root: nothing to keep in step */
    }
    int ok = write(fd, line, 33) == 33;
    close(fd);
    if (!ok || rename("/etc/.machine-id.sandlot", "/etc/machine-id") < 0) {
        unlink("/etc/.machine-id.sandlot");
    }
}

void set_wall_clock(uint64_t ns)
{
    if (!g_is_pid1) {
        return;
    }
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
    if (clock_settime(CLOCK_REALTIME, &ts) < 0) {
        logmsg("clock_settime: %s", strerror(errno));
    }
}

static void reap_all(void)
{
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

static int any_children(void)
{
    /* PID 1 adopts everything, so any process but us is a child or will be */
    DIR *d = opendir("/proc");
    struct dirent *de;
    int found = 0;
    while (d && (de = readdir(d))) {
        int pid = atoi(de->d_name);
        if (pid > 1) {
            char path[64], stat[256];
            snprintf(path, sizeof(path), "/proc/%d/stat", pid);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0) {
                continue;
            }
            ssize_t n = read(fd, stat, sizeof(stat) - 1);
            close(fd);
            if (n <= 0) {
                continue;
            }
            stat[n] = 0;
            /* kernel threads have parent 2 (kthreadd) or are 2 itself */
            char *rp = strrchr(stat, ')');
            int ppid = 0;
            if (rp && sscanf(rp + 2, "%*c %d", &ppid) == 1 && ppid != 2 && pid != 2) {
                found = 1;
                break;
            }
        }
    }
    if (d) {
        closedir(d);
    }
    return found;
}

/* Stop every process, flush the disk, and power off. The CONTROL_OK reply is
 * sent once the root filesystem is read-only, so the host knows the disk is clean. */
void shutdown_guest(struct session *s, uint32_t ch, uint32_t timeout_ms)
{
    if (timeout_ms > 60000) {
        timeout_ms = 60000;
    }
    kill(-1, SIGTERM);
    uint64_t deadline = now_ms() + timeout_ms;
    while (now_ms() < deadline) {
        reap_all();
        if (!any_children()) {
            break;
        }
        usleep(10000);
    }
    kill(-1, SIGKILL);
    for (int i = 0; i < 100 && any_children(); i++) {
        reap_all();
        usleep(10000);
    }
    reap_all();
    sync();
    umount2("/tmp", MNT_DETACH);
    umount2("/run", MNT_DETACH);
    umount2("/dev/shm", MNT_DETACH);
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_RDONLY, NULL) < 0) {
        logmsg("remount / read-only: %s", strerror(errno));
    }
    sync();
    send_frame(s, SL_CONTROL_OK, 0, ch, NULL, 0);
    uint64_t flush_deadline = now_ms() + 1000;
    while (buf_used(&s->out) && now_ms() < flush_deadline) {
        struct pollfd pfd = {.fd = s->out_fd, .events = POLLOUT};
        if (poll(&pfd, 1, 50) > 0) {
            ssize_t w = write(s->out_fd, s->out.data + s->out.head, buf_used(&s->out));
            if (w > 0) {
                buf_consume(&s->out, (size_t)w);
            } else if (w < 0 && errno != EAGAIN) {
                break;
            }
        }
    }
    reboot(RB_POWER_OFF);
    _exit(0);
}
