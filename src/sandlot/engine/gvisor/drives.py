"""A gVisor box's named volumes: each a directory bound into the sandbox, where a
user-space ext4 serves the volume's top layer.

A volume is an ext4 filesystem in a chain of qcow2 layers (``core.layers``), which a
QEMU guest mounts as a drive. gVisor has no block devices, and the host kernel must
not parse a filesystem a box wrote block by block (a QEMU box's guest writes any
bytes it likes into a volume it mounts). So, per drive, on the host:

1. ``qemu-storage-daemon`` opens the drive's top, over its whole chain, and exports
   it as a raw file (FUSE): the layers stay copy-on-write, as a QEMU box's would;
2. a loop device over that file: its page cache turns the 4 KiB writes of step 3
   into large requests to step 1 (26.8 MB/s against 5.2 without, measured here);
3. ``e2fsck -p`` replays what a QEMU guest's journal left (or refuses a damaged
   filesystem, clearly), and ``fuse2fs`` serves the filesystem in user space;
4. the sandbox's gofer binds that directory, at the mount's guest path (``ro``: a
   read-only bind of a read-only mount).

Nothing of it is in a checkpoint but the bind's path: a save ends the sandbox, the
tops are closed (every write flushed down to the layer), frozen by the core, and the
sandbox restored over new tops served at the same place. Each drive's processes and
loop device are named in ``<run_dir>/drives/<serial>.json``, so whichever process
ends the box takes them down, also after a crash of the one that started them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ... import pids
from ...errors import HostSetupError, SavedStateError
from ...hostsetup import which
from ..base import Drive
from .mountinfo import is_mounted, unmount

TOOLS = {"qemu-storage-daemon": "qemu-system-common", "fuse2fs": "fuse2fs", "losetup": "mount",
         "e2fsck": "e2fsprogs"}  # fmt: skip
START_TIMEOUT = 20.0
STOP_TIMEOUT = 30.0  # fuse2fs writes back what it holds as it ends
FSCK_TIMEOUT = 300.0  # a whole check of a large volume a crash left unclean


def missing_tools() -> list[str]:
    """The host packages a gVisor box with named volumes needs and this host lacks."""
    need = sorted({pkg for tool, pkg in TOOLS.items() if not which(tool)})
    if not os.path.exists("/dev/fuse"):
        need.append("/dev/fuse (the fuse kernel module)")
    return need


def _tool(tool: str) -> str:
    found = which(tool)
    if found is None:
        raise HostSetupError(
            f"{tool} not found: a gVisor box's named volumes need it (apt install {TOOLS[tool]})"
        )
    return found


def drives_dir(run_dir: Path) -> Path:
    return run_dir / "drives"


def serve(run_dir: Path, drives: tuple[Drive, ...]) -> None:
    """Serve each drive at ``drives_dir(run_dir) / serial``; on failure, nothing is left
    served."""
    try:
        for d in drives:
            _serve_one(run_dir, d)
    except BaseException:
        stop_all(run_dir)
        raise


def _serve_one(run_dir: Path, drive: Drive) -> None:
    where = drives_dir(run_dir)
    where.mkdir(parents=True, exist_ok=True)
    state_file = where / f"{drive.serial}.json"
    if state_file.exists():
        _stop(state_file)
    image, mount = where / f"{drive.serial}.img", where / drive.serial
    image.touch()
    mount.mkdir(exist_ok=True)
    state: dict[str, Any] = {"top": str(drive.path), "serial": drive.serial, "guest": drive.guest,
                             "readonly": drive.guest_readonly, "image": str(image),
                             "mount": str(mount)}  # fmt: skip
    _write(state_file, state)
    # 1. the chain as a raw file
    pid_file = where / f"{drive.serial}.qsd.pid"
    pid_file.unlink(missing_ok=True)
    _run([_tool("qemu-storage-daemon"), "--daemonize", "--pidfile", str(pid_file),
          "--blockdev", f"driver=qcow2,node-name=top,file.driver=file,file.filename={_escape(drive.path)}",
          "--export", f"type=fuse,id=vol,node-name=top,mountpoint={_escape(image)},writable=on"],
         "serve the volume's layers", START_TIMEOUT)  # fmt: skip
    qsd = int(pid_file.read_text().strip())
    state["qsd"] = [qsd, pids.start_time(qsd) or ""]
    _write(state_file, state)
    # 2. a loop device over it
    loop = _run([_tool("losetup"), "--find", "--show", str(image)], "attach a loop device", START_TIMEOUT)
    state["loop"] = loop.strip()
    _write(state_file, state)
    # 3. the filesystem, checked and served
    check = None if _clean(Path(state["loop"])) else subprocess.run(
        [_tool("e2fsck"), "-p", state["loop"]], capture_output=True, text=True, timeout=FSCK_TIMEOUT
    )  # fmt: skip
    if check is not None and check.returncode >= 4:
        raise SavedStateError(
            f"the volume's filesystem ({drive.path.name}) is damaged beyond what e2fsck -p mends: "
            f"{(check.stdout + check.stderr).strip()[-800:]}"
        )
    opts = f"{'ro' if drive.guest_readonly else 'rw'},allow_other,big_writes"
    log = where / f"{drive.serial}.fuse2fs.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [_tool("fuse2fs"), state["loop"], str(mount), "-f", "-o", opts],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    state["fuse2fs"] = [proc.pid, pids.start_time(proc.pid) or ""]
    _write(state_file, state)
    end = time.monotonic() + START_TIMEOUT
    while not is_mounted(mount):
        if proc.poll() is not None or time.monotonic() > end:
            why = log.read_text(errors="replace").strip()[-800:] if log.exists() else ""
            raise HostSetupError(f"fuse2fs could not serve the volume {drive.path.name}: {why}")
        time.sleep(0.005)


def _clean(device: Path) -> bool:
    """Whether the ext4 superblock says the filesystem was closed cleanly, with no
    journal to replay and no error recorded: then ``e2fsck -p`` (16 to 37 ms here) has
    nothing to do. What a save froze and every fork's copy of it are so; what a QEMU
    guest or a killed server left is not."""
    try:
        with open(device, "rb") as f:
            f.seek(1024)
            sb = f.read(100)
    except OSError:
        return False
    if len(sb) < 100 or int.from_bytes(sb[56:58], "little") != 0xEF53:
        return False
    state, incompat = int.from_bytes(sb[58:60], "little"), int.from_bytes(sb[96:100], "little")
    return state == 1 and not incompat & 0x4  # EXT2_VALID_FS alone; no INCOMPAT_RECOVER


def stop_all(run_dir: Path) -> None:
    """Take down every drive served for the box (idempotent, and also for what a crashed
    process left): the filesystem ends first, writing back what it holds."""
    where = drives_dir(run_dir)
    with contextlib.suppress(FileNotFoundError):
        for state_file in sorted(where.glob("*.json")):
            _stop(state_file)


def recorded(run_dir: Path) -> tuple[Drive, ...]:
    """The drives served for a box, as its state files say (for a process that found the
    box running and saves it: the restore serves them again)."""
    found: list[Drive] = []
    with contextlib.suppress(FileNotFoundError):
        for state_file in drives_dir(run_dir).glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                st = json.loads(state_file.read_text())
                top, ro = Path(st["top"]), bool(st["readonly"])
                found.append(Drive(top, st["serial"], guest=st["guest"], guest_readonly=ro))
    return tuple(sorted(found, key=lambda d: _index(d.serial)))


def _index(serial: str) -> int:
    digits = serial[len(serial.rstrip("0123456789")) :]
    return int(digits) if digits else 0


def any_left(run_dir: Path) -> bool:
    return any(drives_dir(run_dir).glob("*.json")) if drives_dir(run_dir).exists() else False


def _stop(state_file: Path) -> None:
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state = {}
    mount = Path(state.get("mount") or state_file.with_suffix(""))
    fuse = state.get("fuse2fs")
    unmount(mount, lazy=False)  # still open somewhere (a sandbox not yet gone): detached
    if fuse:
        _wait_gone(int(fuse[0]), str(fuse[1]), STOP_TIMEOUT)
    loop = state.get("loop")
    if loop:
        subprocess.run([_tool("losetup"), "--detach", loop], capture_output=True, timeout=STOP_TIMEOUT)
    qsd = state.get("qsd")
    if qsd and pids.alive(int(qsd[0]), str(qsd[1])):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(qsd[0]), signal.SIGTERM)  # it flushes the layer and leaves its export
        _wait_gone(int(qsd[0]), str(qsd[1]), STOP_TIMEOUT)
    image = Path(state.get("image") or state_file.with_suffix(".img"))
    unmount(image)
    for left in (image, state_file):
        left.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        mount.rmdir()


def _wait_gone(pid: int, start: str, timeout: float) -> None:
    """Wait for a server to end; one that will not is killed (a filesystem still held
    open past the sandbox's end: ``e2fsck -p`` mends what it left, at the next mount)."""
    if not pids.wait_gone(pid, start, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        pids.wait_gone(pid, start, 5.0)


def _run(argv: list[str], what: str, timeout: float) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise HostSetupError(f"could not {what} in {timeout:.0f} s ({argv[0]})") from exc
    if proc.returncode != 0:
        raise HostSetupError(f"could not {what}: {(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc.stdout


def _escape(path: Path) -> str:
    """A path as one value of QEMU's key=value options (a comma is written twice)."""
    return str(path).replace(",", ",,")


def _write(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
