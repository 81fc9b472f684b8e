"""Containers inside a box (``containers=True``, docs/containers.md): Debian's Docker in a
1 GiB microVM of the image with both engines (``tests.support.roots.containers_root``),
its container image a busybox tree imported into it (``docker import``: no registry).

* the daemon's start in a running box: dockerd stopped, then started and waited for
  until ``docker version`` answers (as sandlot does at every boot), timed in the guest;
* a box's start to ``docker version`` answering: from the image's template, which holds
  the daemon already running (``--cold`` adds a cold boot that starts it, no template);
* ``docker run --rm IMAGE true`` in the box (median, p99), beside the same on this host
  where its Docker daemon (or Podman) answers, and their ratio; or why not;
* a fork of a box with three running containers (one holding a TCP connection to
  another) to all three answering (``docker exec NAME true`` in the fork).

    .venv/bin/python benchmarks/containers.py [--runs 10] [--cold] [--quick]
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sandlot

from _common import busybox_root, emit, host_facts, parser, summary
from tests.support.roots import containers_root

IMAGE = "bench/busybox:1"
THREE = (
    "docker network create bench >/dev/null; "
    "docker run -d -i --name srv --network bench {image} nc -l -p 9000 >/dev/null; "
    "docker run -d --name web --network bench {image} httpd -f -p 8080 -h / >/dev/null; "
    "docker run -d --name cli --network bench {image} sh -c "
    "'while :; do (while :; do echo tick; sleep 1; done) | nc srv 9000; sleep 1; done' >/dev/null"
)
WAIT_DOCKER = "until docker version >/dev/null 2>&1; do sleep 0.05; done"
RESTART = (
    "kill $(pidof dockerd); while pidof dockerd >/dev/null; do sleep 0.05; done; "
    "t0=$(date +%s%N); setsid dockerd --cgroup-parent=/sandlot/containers >>/var/log/dockerd.log 2>&1 "
    f"</dev/null & {WAIT_DOCKER}; echo $(( ($(date +%s%N) - t0) / 1000000 ))"
)


def sh(box: sandlot.Box, script: str, timeout: float = 300) -> str:
    r = box.sh(script, timeout=timeout)
    if r.exit_code != 0:
        raise RuntimeError(f"{script}: exit {r.exit_code}\n{r.stdout}{r.stderr}")
    return r.stdout


def busybox_tar() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.add(busybox_root(), arcname=".")
    return out.getvalue()


@contextmanager
def docker_box(**options: Any) -> Iterator[sandlot.Box]:
    with sandlot.Box(rootfs=containers_root(), memory_mib=1024, containers=True, **options) as box:
        yield box


def on_this_host(runs: int) -> dict[str, Any]:
    """``docker run --rm IMAGE true`` on this host, where a daemon of its answers."""
    why = "no Docker daemon or Podman answers on this host"
    for tool in ("docker", "podman"):
        if not shutil.which(tool) or subprocess.run([tool, "info"], capture_output=True).returncode != 0:
            continue
        try:
            subprocess.run([tool, "import", "-", IMAGE], input=busybox_tar(), capture_output=True, check=True)
            times = []
            for _ in range(runs):
                t = time.monotonic()
                subprocess.run([tool, "run", "--rm", IMAGE, "/bin/true"], check=True, capture_output=True)
                times.append(time.monotonic() - t)
            return {"tool": tool, "run_true_ms": summary(times, 1000)}
        except subprocess.CalledProcessError as exc:  # a host that forbids what containers need
            said = exc.stderr.decode(errors="replace").strip()[-300:]
            why = f"{tool} on this host runs no container: {said}"
    return {"skipped": why}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=10, help="docker runs, daemon starts, forks")
    ap.add_argument("--cold", action="store_true", help="also a cold boot to docker answering (no template)")
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    tar = busybox_tar()
    starts, restarts, run_true, forks = [], [], [], []
    cold: dict[str, Any] | None = None
    if args.cold:
        t = time.monotonic()
        with docker_box(template=False) as box:
            sh(box, WAIT_DOCKER)
            cold = {"boot_to_docker_answering_s": round(time.monotonic() - t, 2)}
    for i in range(1 if args.quick else 3):
        t = time.monotonic()
        with docker_box() as box:
            sh(box, WAIT_DOCKER)
            starts.append(time.monotonic() - t)
            if i:
                continue
            box.files.write("/tmp/busybox.tar", tar)
            sh(box, f"docker import /tmp/busybox.tar {IMAGE} >/dev/null && rm /tmp/busybox.tar")
            for _ in range(runs):
                t = time.monotonic()
                sh(box, f"docker run --rm {IMAGE} /bin/true")
                run_true.append(time.monotonic() - t)
            for _ in range(runs):
                restarts.append(int(sh(box, RESTART).split()[-1]) / 1000)
            sh(box, THREE.format(image=IMAGE))
            for _ in range(1 if args.quick else 3):
                t = time.monotonic()
                [fork] = box.fork(1)
                try:
                    sh(fork, "for c in srv web cli; do docker exec $c true; done")
                    forks.append(time.monotonic() - t)
                finally:
                    fork.remove(force=True)
    host = on_this_host(runs)
    in_box = summary(run_true, 1000)
    emit({
        "benchmark": "containers", "quick": args.quick, "host": host_facts(None),
        "daemon_start_in_box_s": summary(restarts),
        "box_start_from_template_to_docker_answering_s": summary(starts),
        "cold": cold,
        "docker_run_true_ms": {"box": in_box, "host": host,
                               "box_over_host": round(in_box["median"] / host["run_true_ms"]["median"], 2)
                               if "run_true_ms" in host else None},
        "fork_3_containers_to_all_answering_s": summary(forks),
    })  # fmt: skip


if __name__ == "__main__":
    main()
