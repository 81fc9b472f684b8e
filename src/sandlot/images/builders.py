"""Build small root filesystems from the host's Debian packages.

Used by ``sandlot rootfs``, the setup script's demo and the tests, so nothing
depends on a registry being reachable:

* ``busybox``: one static busybox with its applet links (~2 MB), from
  Debian's ``busybox-static``.
* ``debian``: a Debian minbase (optionally with more packages, e.g. python3)
  made by ``mmdebstrap``.
* ``desktop``: Debian with a desktop that ``box.desktop`` drives (``api/desktop.py``):
  Xvnc, openbox, Chromium, xterm, xdotool, wmctrl, and noVNC's viewer behind websockify.
* ``docker`` and ``podman``: Debian with a container engine, for a box with
  ``containers=True`` (``core/containers.py``; docs/containers.md).

Both add a user ``agent`` (uid 1000) beside root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import HostSetupError

PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "agent:x:1000:1000:agent:/home/agent:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
GROUP = "root:x:0:\nagent:x:1000:\nusers:x:100:agent\nnogroup:x:65534:\n"


def _replace_dir(tmp: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    return dest


def busybox_rootfs(dest: Path, busybox: str | None = None) -> Path:
    """A busybox root filesystem at ``dest`` (replaced if it exists)."""
    binary = busybox or next((p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.exists(p)), None)
    if binary is None:
        raise HostSetupError("busybox not found: install busybox-static")
    check = subprocess.run(["file", "-L", binary], capture_output=True, text=True)
    if check.returncode == 0 and "statically linked" not in check.stdout and "static-pie" not in check.stdout:
        raise HostSetupError(f"{binary} is not statically linked: install busybox-static")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "tmp", "proc", "sys", "dev", "run", "root",
              "home/agent", "var/tmp"):  # fmt: skip
        (tmp / d).mkdir(parents=True, exist_ok=True)
    os.chmod(tmp / "tmp", 0o1777)
    os.chmod(tmp / "root", 0o700)
    shutil.copy2(binary, tmp / "bin" / "busybox")
    os.chmod(tmp / "bin" / "busybox", 0o755)
    applets = subprocess.run([binary, "--list-full"], capture_output=True, text=True, check=True).stdout
    for rel in applets.split():
        link = tmp / rel
        if link.exists() or link.is_symlink() or rel == "bin/busybox":
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("/bin/busybox", link)
    (tmp / "etc" / "passwd").write_text(PASSWD)
    (tmp / "etc" / "group").write_text(GROUP)
    (tmp / "etc" / "hostname").write_text("sandlot\n")
    (tmp / "etc" / "os-release").write_text('NAME="busybox"\nID=busybox\nPRETTY_NAME="BusyBox rootfs"\n')
    if os.geteuid() == 0:
        os.chown(tmp / "home" / "agent", 1000, 1000)
    return _replace_dir(tmp, dest)


def debian_rootfs(
    dest: Path,
    packages: list[str] | None = None,
    suite: str = "bookworm",
    *,
    recommends: bool = True,
    dpkg_options: list[str] | None = None,
    hooks: list[str] | None = None,
) -> Path:
    """A Debian minbase root filesystem at ``dest`` made by mmdebstrap; ``recommends=False``
    leaves out the packages' recommended ones (a much smaller tree for heavy stacks);
    ``dpkg_options`` go to every dpkg call, in order (``path-exclude=...`` then the
    ``path-include=...`` that it spares, as in slim images); ``hooks`` are shell commands
    run on the finished tree (``$1``), before apt's caches are emptied."""
    mmdebstrap = shutil.which("mmdebstrap")
    if not mmdebstrap:
        raise HostSetupError("mmdebstrap not found: install mmdebstrap")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tarball = tmp.with_suffix(".tar")
    cmd = [
        mmdebstrap, "--quiet", "--variant=minbase", f"--include={','.join(packages or [])}",
        "--customize-hook=chroot \"$1\" useradd --create-home --uid 1000 --shell /bin/bash agent",
        "--customize-hook=rm -rf \"$1\"/var/cache/apt/archives/*.deb \"$1\"/var/lib/apt/lists/*",
        suite, str(tarball),
    ]  # fmt: skip
    extra = [f"--dpkgopt={option}" for option in dpkg_options or []]
    if not recommends:
        extra.append('--aptopt=APT::Install-Recommends "false"')
    extra += [f"--customize-hook={hook}" for hook in hooks or []]
    cmd[2:2] = extra
    if not packages:
        cmd.remove("--include=")
    # mmdebstrap clamps the tree's times to SOURCE_DATE_EPOCH; set here, the hooks see it
    # too, and caches that record a folder's time (fontconfig's) match the tree's
    epoch = os.environ.get("SOURCE_DATE_EPOCH") or str(int(time.time()))
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SOURCE_DATE_EPOCH": epoch})
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HostSetupError(f"mmdebstrap failed:\n{proc.stderr[-3000:]}")
    root = tmp / "root"
    root.mkdir()
    subprocess.run(["tar", "-xpf", str(tarball), "-C", str(root), "--numeric-owner"], check=True)
    tarball.unlink()
    final_tmp = dest.parent / f".{dest.name}.ready"
    if final_tmp.exists():
        shutil.rmtree(final_tmp)
    os.rename(root, final_tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    return _replace_dir(final_tmp, dest)


# what no box reads: manuals, translations (the copyright files stay)
NO_DOCS = [
    "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
]  # fmt: skip
# Debian's Docker (the daemon, its CLI, containerd, runc) with Compose (v1, docker-compose)
# and the iptables its networks need; Podman with its network stack (netavark) and crun
DOCKER_PACKAGES = ["docker.io", "docker-compose", "iptables", "ca-certificates", "procps", "iproute2"]
PODMAN_PACKAGES = ["podman", "crun", "netavark", "aardvark-dns", "catatonit", "iptables",
                   "ca-certificates", "procps", "iproute2"]  # fmt: skip


# Podman 4.3 looks for CNI's plugins first (which it does not depend on) and warns at
# every command that they are missing: told to use netavark, which it has
PODMAN_NETWORK = 'printf \'[network]\\nnetwork_backend = "netavark"\\n\' >"$1"/etc/containers/containers.conf'


def containers_rootfs(dest: Path, packages: list[str]) -> Path:
    """A root filesystem at ``dest`` with a container engine (``DOCKER_PACKAGES``,
    ``PODMAN_PACKAGES``, or both): boot it with ``containers=True``."""
    hooks = [PODMAN_NETWORK] if "podman" in packages else []
    return debian_rootfs(
        dest, list(dict.fromkeys(packages)), recommends=False, dpkg_options=NO_DOCS, hooks=hooks
    )


DESKTOP = Path(__file__).parent / "desktop"
DESKTOP_PACKAGES = [
    "tigervnc-standalone-server", "tigervnc-tools", "xfonts-base",  # X and VNC in one process
    "openbox", "chromium", "xterm", "fonts-dejavu-core",
    "xdotool", "wmctrl", "x11-apps", "x11-utils",  # input, windows, xwd (screenshots), xdpyinfo, xprop
    "x11-xserver-utils",  # xsetroot: the background
    "websockify", "python3", "procps",
]  # fmt: skip
# and what a desktop box never reads: Chromium's other languages
SLIM = [
    *NO_DOCS, "path-exclude=/usr/lib/chromium/locales/*", "path-include=/usr/lib/chromium/locales/en-US.pak",
]  # fmt: skip
# Debian's chromium wrapper reads /etc/chromium.d: a browser for a box with no GPU, no
# keyring and no first-run dialogs, whoever starts it (box.desktop, an agent's shell)
CHROMIUM_FLAGS = (
    "--no-first-run --no-default-browser-check --disable-gpu --disable-dev-shm-usage "
    "--lang=en-US --password-store=basic --disable-background-networking --disable-component-update "
    "--disable-features=Translate,MediaRouter,OptimizationHints --noerrdialogs --test-type"
)
# Chromium maps a metrics file from its profile's BrowserMetrics folder, then deletes it,
# still mapped (with no flag or policy that stops it); a deleted file that a process
# holds open on the root filesystem fails gVisor's checkpoint (no snapshot, no fork). A
# plain file in the folder's place: the browser keeps its metrics in memory instead.
CHROMIUM_NO_METRICS_FILE = """
metrics="${XDG_CONFIG_HOME:-$HOME/.config}/chromium/BrowserMetrics"
if [ ! -f "$metrics" ]; then
    { rm -rf "$metrics" && mkdir -p "${metrics%/*}" && : >"$metrics"; } 2>/dev/null || true
fi
"""


def desktop_rootfs(dest: Path, packages: list[str] | None = None) -> Path:
    """A desktop root filesystem at ``dest``: Debian with ``packages`` (default
    ``DESKTOP_PACKAGES``) and sandlot's desktop files (``install_desktop``). Boot it and
    drive it with ``box.desktop``."""
    # fontconfig's caches made now, or every program's first font lookup scans the fonts
    # (6 s of each desktop's first start under emulation). A cache holds its folder's
    # time, and the finished tree's times are clamped to SOURCE_DATE_EPOCH: the font
    # folders are set to it first, or no cache would match its folder and fontconfig
    # would scan the fonts again at every boot.
    fonts = '"$1"/usr/share/fonts "$1"/usr/local/share/fonts'
    hooks = [f'find {fonts} -type d -exec touch -d "@$SOURCE_DATE_EPOCH" {{}} + && chroot "$1" fc-cache -f']
    debian_rootfs(dest, packages or DESKTOP_PACKAGES, recommends=False, dpkg_options=SLIM, hooks=hooks)
    install_desktop(dest)
    return dest


def install_desktop(root: Path) -> None:
    """Put sandlot's desktop files into the root filesystem ``root`` (again, if they are
    there): ``/usr/local/bin/sandlot-desktop``, the viewer page with its noVNC, and the
    browser's flags and policies. Cheap, so a cached tree is brought up to this version of sandlot."""
    root = Path(root)
    script = root / "usr/local/bin/sandlot-desktop"
    script.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DESKTOP / "sandlot-desktop", script)
    os.chmod(script, 0o755)
    viewer = root / "usr/share/sandlot-desktop/viewer"
    if viewer.exists():
        shutil.rmtree(viewer)
    shutil.copytree(DESKTOP / "viewer", viewer)
    flags = root / "etc/chromium.d/sandlot"
    flags.parent.mkdir(parents=True, exist_ok=True)
    flags.write_text(f'export CHROMIUM_FLAGS="$CHROMIUM_FLAGS {CHROMIUM_FLAGS}"\n{CHROMIUM_NO_METRICS_FILE}')
    # Chromium's policies, for what no flag turns off: no sign-in chip that unfolds in the
    # toolbar a while after the start (a screen that changes by itself), no sync, no
    # password or address prompts over the page
    policy = root / "etc/chromium/policies/managed/sandlot.json"
    policy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DESKTOP / "chromium-policy.json", policy)


def desktop_files_digest() -> str:
    """A digest of the files ``install_desktop`` writes, to tell a cached tree's age."""
    h = hashlib.sha256((CHROMIUM_FLAGS + CHROMIUM_NO_METRICS_FILE).encode())
    for path in sorted(p for p in DESKTOP.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(DESKTOP)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]
