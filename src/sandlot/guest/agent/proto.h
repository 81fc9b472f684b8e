/* Wire constants of the sandlot agent protocol, version 1.
 * docs/protocol.md is the specification; src/sandlot/protocol/wire.py mirrors
 * these numbers and tests/unit/test_wire.py checks that the two agree. */
#ifndef SANDLOT_PROTO_H
#define SANDLOT_PROTO_H

#define SL_PROTOCOL_VERSION 1
#define SL_MAGIC 0x4C53u              /* bytes 'S' 'L' on the wire */
#define SL_HEADER_SIZE 12u            /* magic u16, type u8, flags u8, channel u32, length u32 */
#define SL_MAX_PAYLOAD (1u << 20)     /* frames above this are refused */
#define SL_DATA_PREFIX 16u            /* stream u32, reserved u32, offset u64 */
#define SL_DATA_CHUNK (256u * 1024u)  /* largest DATA payload the agent sends */
#define SL_WINDOW (1u << 20)          /* bytes in flight per stream, both directions */
#define SL_MAX_CHANNELS 1024u         /* live channels per session */

#define SL_FLAG_MORE 0x01u            /* FS_RESULT: more frames of this answer follow */

enum sl_frame_type {
    SL_HELLO = 0x01,
    SL_HELLO_ACK = 0x02,
    SL_ERROR = 0x03,
    SL_PING = 0x04,
    SL_PONG = 0x05,
    SL_CLOSE = 0x06,
    SL_RESUME = 0x07,

    SL_EXEC = 0x10,
    SL_EXEC_STARTED = 0x11,
    SL_EXIT = 0x12,
    SL_SIGNAL = 0x13,
    SL_RESIZE = 0x14,
    SL_ARCHIVE = 0x15, /* a tree as a tar stream, or one unpacked: answered as an EXEC (archive.c) */

    SL_DATA = 0x20,
    SL_EOF = 0x21,
    SL_ACK = 0x22,

    SL_FILE_READ = 0x30,
    SL_FILE_INFO = 0x31,
    SL_FILE_WRITE = 0x32,
    SL_FILE_READY = 0x33,
    SL_FILE_DONE = 0x34,

    SL_FS = 0x40,
    SL_FS_RESULT = 0x41,
    SL_WATCH = 0x42,
    SL_WATCH_STARTED = 0x43,

    SL_CONTROL = 0x50,
    SL_CONTROL_OK = 0x51,
};

enum sl_tag {
    SL_T_ARG = 1,
    SL_T_ENV = 2,
    SL_T_CWD = 3,
    SL_T_USER = 4,
    SL_T_FLAGS = 5,
    SL_T_ROWS = 6,
    SL_T_COLS = 7,
    SL_T_PID = 8,
    SL_T_EXIT_CODE = 9,
    SL_T_SIGNAL = 10,
    SL_T_WINDOW = 11,
    SL_T_PATH = 12,
    SL_T_PATH2 = 13,
    SL_T_MODE = 14,
    SL_T_SIZE = 15,
    SL_T_OFFSET = 16,
    SL_T_LENGTH = 17,
    SL_T_OP = 18,
    SL_T_ENTRY = 19,
    SL_T_ERRNO = 20,
    SL_T_MESSAGE = 21,
    SL_T_VERSION_MIN = 22,
    SL_T_VERSION_MAX = 23,
    SL_T_VERSION = 24,
    SL_T_SESSION = 25,
    SL_T_ENTROPY = 26,
    SL_T_TIME_NS = 27,
    SL_T_HOSTNAME = 28,
    SL_T_AGENT_VERSION = 29,
    SL_T_BOOT_ID = 30,
    SL_T_RESUMED = 31,
    SL_T_CHANNEL = 32,
    SL_T_MAX_PAYLOAD = 33,
    SL_T_STREAM_OFFSET = 34,
    SL_T_FRAME_TYPE = 35,
    SL_T_CORE_DUMPED = 36,
    SL_T_TIMEOUT_MS = 37,
    SL_T_UID = 38,
    SL_T_GID = 39,
    SL_T_MACHINE_ID = 40,
    SL_T_COUNT = 41,
    SL_T_IDLE_MS = 42,
    SL_T_PIDS_MAX = 43,   /* HELLO: processes all commands together may have (0: no limit) */
    SL_T_OOM_KILLED = 44, /* EXIT: the OOM killer killed a process of this command */
    /* CONTROL_OK of STATUS: what the guest says of itself (stats.c) */
    SL_T_MEM_TOTAL_KB = 45,
    SL_T_MEM_AVAILABLE_KB = 46,
    SL_T_NET_RX_BYTES = 47,
    SL_T_NET_TX_BYTES = 48,
    SL_T_DISK_READ_BYTES = 49,
    SL_T_DISK_WRITTEN_BYTES = 50,
    SL_T_EXECS = 51,         /* commands started since the agent started */
    SL_T_EXEC_START_US = 52, /* their microseconds from request to running, summed */
    SL_T_TREE_ENTRY = 53,    /* FS TREE: one path of the manifest (files.py parse_tree_entry) */
    SL_T_TARGET = 54,        /* FS SYMLINK: the link's target, as given (relative or absolute) */
    SL_T_RDEV = 55,          /* FS MKNOD: the device number (u64, the kernel's encoding) */
    SL_T_ASLR = 56,          /* HELLO: kernel.randomize_va_space wanted (2 or 0); its ACK: in force */
    SL_T_RATE = 57,          /* WATCH: records a second the watch sends at most (0: no limit) */
    SL_T_BURST = 58,         /* WATCH: ... and at once */
    SL_T_PREFIX = 59,        /* FS: the extended attributes meant: the names that start with it */
    SL_T_XATTR = 60,         /* FS SETXATTRS (repeated): u16 name length, the name, the value */
};

/* SL_T_FLAGS bits of SL_EXEC */
#define SL_EXEC_TTY 0x1u
#define SL_EXEC_STDIN 0x2u      /* give the process a stdin pipe; else /dev/null */
#define SL_EXEC_CLEAR_ENV 0x4u  /* do not add the default environment */

/* SL_T_FLAGS bits of SL_FILE_WRITE */
#define SL_WRITE_APPEND 0x1u
#define SL_WRITE_PARENTS 0x2u
#define SL_WRITE_EXCLUSIVE 0x4u
#define SL_WRITE_SYNC 0x8u

/* SL_T_FLAGS bits of SL_FS */
#define SL_FS_PARENTS 0x1u
#define SL_FS_RECURSIVE 0x2u
#define SL_FS_NOFOLLOW 0x4u
#define SL_FS_MISSING_OK 0x8u
#define SL_FS_SELF 0x10u /* TREE: the path's own entry only (any type) */
/* STAT, LIST: each entry's extended attributes named SL_T_PREFIX..., after its name and
 * target: u16 count, then for each u16 name length, u32 value length, name, value */
#define SL_FS_XATTRS 0x20u

/* SL_ARCHIVE: SL_T_OP says which way; SL_T_FLAGS bits; the records its child reports
 * (u32 length, then TLV: SL_T_OP the kind, SL_T_PATH the entry, SL_T_ERRNO, SL_T_MESSAGE,
 * and for DONE SL_T_COUNT entries and SL_T_SIZE bytes of files) */
enum sl_archive_op {
    SL_ARCHIVE_READ = 1,  /* PATH's tree as a tar stream on stdout; records on stderr */
    SL_ARCHIVE_WRITE = 2, /* a tar stream on stdin unpacked into PATH; records on stdout */
};
#define SL_ARCHIVE_FOLLOW 0x1u /* READ: a link to what is inside the tree goes as what it points to */
enum sl_archive_record {
    SL_AR_SKIPPED = 1, /* an entry left out (a device where none can be made), and why */
    SL_AR_FAILED = 2,  /* the last record of a failure: the entry, errno, message */
    SL_AR_DONE = 3,    /* the last record of a success */
    SL_AR_WRITTEN = 4, /* a merge that failed part way moved this entry into place */
};

/* SL_T_FLAGS bits of SL_WATCH */
#define SL_WATCH_RECURSIVE 0x1u

/* Event records of a watch channel's stream 1 (docs/protocol.md, "Watch"):
 * kind u8, flags u8, path_len u16, old_len u16, path, old path. */
#define SL_WATCH_RECORD 6u
#define SL_WATCH_IS_DIR 0x1u    /* record flag: the path is a directory */

enum sl_watch_event {
    SL_WE_CREATED = 1,
    SL_WE_MODIFIED = 2,
    SL_WE_DELETED = 3,
    SL_WE_MOVED = 4,
    SL_WE_OVERFLOW = 5,      /* events under the path may be lost: look again */
    SL_WE_BARRIER = 6,       /* the host's barrier (its DATA's bytes as the path): all before it is sent */
};

/* SL_T_FLAGS bits of SL_SIGNAL */
#define SL_SIGNAL_GROUP 0x1u

enum sl_fs_op {
    SL_FS_STAT = 1,
    SL_FS_LIST = 2,
    SL_FS_MKDIR = 3,
    SL_FS_REMOVE = 4,
    SL_FS_RENAME = 5,
    SL_FS_CHMOD = 6,
    SL_FS_CHOWN = 7,
    SL_FS_TREE = 8, /* a manifest of the tree under the path, on its device (tree.c) */
    SL_FS_SYMLINK = 9, /* make PATH a symbolic link to TARGET */
    SL_FS_MKNOD = 10,  /* make PATH a fifo or device: MODE holds the type, RDEV the number */
    SL_FS_SETXATTRS = 11, /* PATH's attributes named PREFIX... become the SL_T_XATTR given */
};

enum sl_control_op {
    SL_CTL_SHUTDOWN = 1,
    SL_CTL_SYNC = 2,
    SL_CTL_SET_HOSTNAME = 3,
    SL_CTL_SET_TIME = 4,
    SL_CTL_ADD_ENTROPY = 5,
    SL_CTL_MOUNT = 6,        /* PATH: mount point, PATH2: virtio-9p tag or drive serial, FLAGS: SL_MOUNT_* */
    SL_CTL_STATUS = 7,       /* reply: COUNT (channels in use by any host), IDLE_MS */
    SL_CTL_FREEZE = 8,       /* every command stopped; TIMEOUT_MS: the lease (guest time) */
    SL_CTL_THAW = 9,         /* the shares a DETACH took down are mounted again first */
    SL_CTL_DETACH = 10,      /* every 9p share unmounted for a save; only while frozen */
};

#define SL_MOUNT_READONLY 0x1u
#define SL_MOUNT_BLOCK 0x2u /* PATH2 is the serial of a virtio-blk drive holding ext4 */

/* Streams of a channel. */
#define SL_STREAM_STDIN 0u
#define SL_STREAM_STDOUT 1u
#define SL_STREAM_STDERR 2u

#endif
