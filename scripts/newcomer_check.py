"""The README's install, followed on a clean Debian 12 machine, timed step by step.

The clean machine is a sandlot box made from a fresh Debian root filesystem (python3
and its venv module, nothing else of sandlot's), with open networking: inside it,
the wheel built from this checkout is installed with pip from PyPI, `sandlot setup`
installs the host packages with apt and fetches the guest kernel, and the README's
quick start runs, its boxes nested in the box under TCG. ``python:3.12-slim`` comes
from a local registry on this host (Docker Hub is not reachable from every host this
runs on), through ``SANDLOT_REGISTRY_MIRRORS``.

Not part of the test suite: it needs the internet (PyPI, a Debian mirror) and takes
about a quarter of an hour under TCG. tests/vm/test_wheel.py checks the same path
offline, on this host. Run it from a checkout after ./scripts/setup:

    .venv/bin/python scripts/newcomer_check.py [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import sandlot  # noqa: E402

from tests.support.docs import blocks  # noqa: E402
from tests.support.images import python_layout  # noqa: E402
from tests.support.registry import run_registry  # noqa: E402
from tests.support.roots import CACHE, debian_root  # noqa: E402

# what this host's network needs of any machine on it (a TLS proxy's CA, apt's settings)
HOST_NETWORK_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/apt/apt.conf.d/99artifact-registry")
PATH = "/root/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# boxes nested in a TCG box boot tens of times slower than on the host
ENV = {"PATH": PATH, "HOME": "/root", "PIP_CERT": HOST_NETWORK_FILES[0], "SANDLOT_BOOT_TIMEOUT": "900"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.mkdtemp(prefix="newcomer-")))
    work = parser.parse_args().work
    root = work / "rootfs"
    if not (root / "usr/bin/python3").exists():
        subprocess.run([sys.executable, "-m", "sandlot.cli", "rootfs", "debian", str(root),
                        "-p", "python3-venv", "-p", "ca-certificates"], check=True)  # fmt: skip
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(work / "dist"), str(REPO)],
                   check=True, capture_output=True)  # fmt: skip
    wheel = sorted((work / "dist").glob("*.whl"))[-1]
    quick_start = next(b.code for b in blocks(REPO / "README.md") if b.lang == "python")  # the three lines
    times: dict[str, float] = {}
    with run_registry(work / "registry") as reg:
        reg.push(python_layout(CACHE, debian_root()), "test/python:3", "library/python:3.12-slim")
        mirror = f"docker.io=http://10.0.2.2:{reg.host.rsplit(':', 1)[1]}"  # the host, from the box
        with sandlot.Box(rootfs=str(root), network="open", memory_mib=3072, cpus=2, disk_size_gb=10,
                         boot_timeout=120) as box:  # fmt: skip
            box.files.write(f"/root/{wheel.name}", wheel.read_bytes())
            box.files.write("/root/quickstart.py", quick_start)
            for path in HOST_NETWORK_FILES:
                if Path(path).exists():
                    box.files.write(path, Path(path).read_bytes())
            steps = {
                "python3 -m venv": "python3 -m venv /root/venv",
                "pip install": f"pip install -q /root/{wheel.name}",
                "sandlot setup": "sandlot setup",
                "quick start": f"SANDLOT_REGISTRY_MIRRORS={mirror} python quickstart.py",
            }
            for name, command in steps.items():
                started = time.monotonic()
                r = box.exec("sh", "-c", f"cd /root && {command}", user="root", timeout=3600, env=ENV)
                times[name] = round(time.monotonic() - started, 1)
                step = {"step": name, "seconds": times[name], "exit": r.exit_code}
                step |= {"stdout": r.stdout[-2000:], "stderr": r.stderr[-2000:]}
                print(json.dumps(step), flush=True)
                if r.exit_code != 0:
                    sys.exit(1)
    print(json.dumps({"seconds": times, "total": round(sum(times.values()), 1)}))


if __name__ == "__main__":
    main()
