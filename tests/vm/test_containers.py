"""Containers inside a box, for real (docs/containers.md): Debian's Docker (with Compose)
and Podman in a microVM with ``containers=True``, pulling from a registry on the host's
127.0.0.1 through the box's egress policy, building, publishing a port to the host,
composing two services; then snapshot, rollback, fork and suspend with three containers
running and a TCP connection open between two of them; the box's limits and its kernel
around every container, a privileged one too.

One box of the image with both engines (``roots.containers_root``) serves the module:
its first boot in a home is saved as the image's template with the daemon running, so
later runs start it in a restore's time. Tests that change what runs leave it as they
found it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import sandlot

from tests.support import roots
from tests.support.images import build_layouts
from tests.support.registry import Registry, run_registry
from tests.support.roots import CACHE
from tests.support.waiting import wait_for
from tests.vm.test_cli import sandlot as sandlot_cli

pytestmark = pytest.mark.vm

HOST = "host.sandlot.internal"  # the host's 127.0.0.1, as the box names it (net.policy.HOST_NAME)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, busybox_root: Path) -> Iterator[Registry]:
    with run_registry(tmp_path_factory.mktemp("registry")) as reg:
        reg.push(build_layouts(CACHE, busybox_root)["busybox"], "test/busybox:1")
        yield reg


@pytest.fixture(scope="module")
def port(registry: Registry) -> int:
    return int(registry.host.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def image(port: int) -> str:
    return f"{HOST}:{port}/test/busybox:1"


@pytest.fixture(scope="module")
def box(port: int, image: str) -> Iterator[sandlot.Box]:
    """The box: the registry's port allowed, the box's 8080 published; dockerd told the
    registry speaks plain HTTP (a reload, SIGHUP: it was started at boot) and the image
    pulled by both engines."""
    with sandlot.Box(rootfs=roots.containers_root(), memory_mib=1024, containers=True, network="allowlist",
                     allow=[f"127.0.0.1:{port}"], ports=[8080], pids_limit=2048) as b:  # fmt: skip
        daemon = json.dumps({"insecure-registries": [f"{HOST}:{port}"]})
        sh(
            b,
            f"mkdir -p /etc/docker && echo '{daemon}' >/etc/docker/daemon.json && kill -HUP $(pidof dockerd)",
        )
        wait_for("dockerd's reload", lambda: f"{HOST}:{port}" in sh(b, "docker info 2>/dev/null"), 30)
        sh(b, f"docker pull -q {image} && podman pull -q --tls-verify=false {image}", timeout=300)
        yield b


def sh(box: sandlot.Box, script: str, timeout: float = 180) -> str:
    r = box.sh(script, timeout=timeout)
    assert r.exit_code == 0, f"{script}\n{r.stdout}{r.stderr}"
    return r.stdout


def test_docker_pulls_through_the_policy_and_runs(box: sandlot.Box, image: str, port: int) -> None:
    assert sh(box, f"docker run --rm {image} echo hello from a container") == "hello from a container\n"
    # the pulls went through the proxy to the host's 127.0.0.1, allowed by the policy
    log = Path(box.inspect()["paths"]["dir"]) / "egress.log"

    def decisions(on: int) -> set[str]:
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        return {e["decision"] for e in entries if e.get("host") == HOST and e.get("port") == on}

    assert decisions(port) == {"allowed"}
    # a port of the host that allow does not list: refused by the proxy, never reached
    other = box.sh(f"docker pull {HOST}:{port + 1}/test/busybox:1", timeout=120)
    assert other.exit_code != 0
    assert wait_for("the refusal in the egress log", lambda: decisions(port + 1), 30) == {"denied"}


def test_a_built_image_serves_on_a_port_the_box_publishes(box: sandlot.Box, image: str) -> None:
    dockerfile = (
        f'FROM {image}\nRUN echo built in the box > /www.txt\nCMD ["httpd", "-f", "-p", "8080", "-h", "/"]\n'
    )
    box.files.write("/build/Dockerfile", dockerfile.encode())
    sh(box, "cd /build && docker build -q -t web:1 . && docker run -d --name web -p 8080:8080 web:1")
    try:
        host_port = box.inspect()["network"]["ports"][0]["host"]

        def served() -> str | None:
            try:
                return httpx.get(f"http://127.0.0.1:{host_port}/www.txt", timeout=10).text
            except httpx.HTTPError:
                return None

        assert wait_for("the container's server, from the host", served, 60) == "built in the box\n"
    finally:
        sh(box, "docker rm -f web")


def test_compose_runs_two_services_that_talk(box: sandlot.Box, image: str) -> None:
    compose = f"""version: "3"
services:
  api:
    image: {image}
    command: ["sh", "-c", "echo answered by api > /index.html; httpd -f -p 8000 -h /"]
  client:
    image: {image}
    depends_on: [api]
    command: ["sh", "-c", "for i in $$(seq 30); do wget -qO- http://api:8000/ && exit; sleep 1; done; false"]
"""
    box.files.write("/compose/docker-compose.yml", compose.encode())
    try:
        both = "docker-compose up --abort-on-container-exit --exit-code-from client"  # both services
        out = sh(box, f"cd /compose && {both}", 300)
        assert "answered by api" in out  # the client's line, as compose shows it
    finally:  # what compose made, gone (as `docker-compose down` would do, without its Python's start);
        # not asserted: a failure above, before compose made anything, stays the one reported
        made = 'ids="$(docker ps -aq --filter label=com.docker.compose.project=compose)"'
        box.sh(f'{made}; [ -z "$ids" ] || docker rm -f $ids; docker network rm compose_default', timeout=180)


def test_podman_runs_the_same_image(box: sandlot.Box, image: str) -> None:
    assert sh(box, f"podman run --rm {image} echo hello from podman") == "hello from podman\n"


def running(box: sandlot.Box) -> list[str]:
    return sorted(sh(box, "docker ps --format '{{.Names}}'").split())


def ticks(box: sandlot.Box) -> int:
    """The ticks the server container has received over its TCP connection."""
    return sh(box, "docker logs srv 2>&1").count("tick")


def alive(box: sandlot.Box) -> None:
    """The three containers run, and the connection between two of them still carries."""
    assert running(box) == ["cli", "srv", "web"]
    first = ticks(box)
    wait_for("a tick over the containers' connection", lambda: ticks(box) > first, 60)
    assert sh(box, "docker exec web wget -qO- http://127.0.0.1:8080/mark") == "original\n"


@pytest.fixture
def three(box: sandlot.Box, image: str) -> Iterator[sandlot.Box]:
    """Three running containers on a network of their own: ``srv`` listens, ``cli`` holds a
    TCP connection to it and sends a tick a second (trying until it reaches ``srv``, whose
    ``nc -l`` takes one connection only), ``web`` serves a file. ``srv``'s input is kept
    open (``-i``): busybox's ``nc -l`` ends its connection at the end of its input."""
    counting = "i=0; while :; do echo tick $i; i=$((i+1)); sleep 1; done"
    client = f"while :; do ({counting}) | nc srv 9000; sleep 1; done"
    web = "echo original >/mark; httpd -f -p 8080 -h /"
    sh(box, f"""docker network create ln >/dev/null
docker run -d -i --name srv --network ln {image} nc -l -p 9000 >/dev/null
docker run -d --name web --network ln {image} sh -c '{web}' >/dev/null
docker run -d --name cli --network ln {image} sh -c '{client}' >/dev/null""")  # fmt: skip
    wait_for("the first ticks", lambda: ticks(box) >= 2, 60)
    yield box
    sh(box, "docker rm -f srv web cli >/dev/null; docker network rm ln >/dev/null")


def test_live_state_with_containers_running(three: sandlot.Box) -> None:
    box = three
    alive(box)
    snap = box.snapshot("three-containers")
    try:
        sh(box, "docker rm -f web && docker exec cli true")
        box.rollback(snap)
        alive(box)
        forks = box.fork(2)  # two: each holds a dockerd and three containers under emulation
        try:
            for i, fork in enumerate(forks):  # each fork's containers are its own
                sh(fork, f"docker exec web sh -c 'echo fork {i} >/mark'")
            for i, fork in enumerate(forks):
                assert running(fork) == ["cli", "srv", "web"]
                assert sh(fork, "docker exec web cat /mark") == f"fork {i}\n"
                first = ticks(fork)
                wait_for("a tick in a fork", lambda f=fork, n=first: ticks(f) > n, 60)  # type: ignore[misc]
        finally:
            for fork in forks:
                fork.remove(force=True)
        alive(box)  # the forks changed nothing of it
        box.suspend()
        assert box.state == "suspended"
        box.resume()
        alive(box)
    finally:
        snap.remove()


def test_containers_count_against_the_boxs_pids_and_stay_in_its_kernel(box: sandlot.Box, image: str) -> None:
    # a container's processes are in the box's own cgroup, whose pids.max is its pids_limit
    before = int(sh(box, "cat /sys/fs/cgroup/sandlot/pids.current"))
    sh(box, f"docker run -d --name many {image} sh -c 'for i in $(seq 60); do sleep 300 & done; wait'")
    try:
        counted = lambda: int(sh(box, "cat /sys/fs/cgroup/sandlot/pids.current")) >= before + 60  # noqa: E731
        wait_for("the container's processes, counted in the box's cgroup", counted, 60)
        assert sh(box, "cat /sys/fs/cgroup/sandlot/pids.max") == "2048\n"
        assert sh(box, "cat /proc/$(docker inspect -f '{{.State.Pid}}' many)/cgroup").startswith(
            "0::/sandlot/containers/"
        )
    finally:
        sh(box, "docker rm -f many")
    # a privileged container with the host's PID namespace: the box's kernel, its init, its disk
    marker = f"box-marker-{os.urandom(4).hex()}"
    sh(box, f"echo {marker} >/marker")
    look = "uname -r; tr '\\0' ' ' </proc/1/cmdline; echo; mkdir /m && mount /dev/vda /m && cat /m/marker"
    out = sh(box, f'docker run --rm --privileged --pid=host {image} sh -c "{look}"')
    kernel, init, seen = out.splitlines()[:3]
    assert kernel == sh(box, "uname -r").strip()  # the box's kernel (the VM's, whatever the host runs)
    assert "sandlot-agent" in init or init.startswith("/init")  # the VM's init: sandlot's agent
    assert seen == marker  # the disk it can reach is the box's


def test_the_option_on_the_command_line_and_where_it_cannot_be_had(busybox_root: Path) -> None:
    with pytest.raises(sandlot.InvalidArgument, match="containers must be True or False"):
        sandlot.Box(rootfs=busybox_root, containers="yes")  # type: ignore[arg-type]
    if shutil.which("runsc") and os.geteuid() == 0:
        with pytest.raises(sandlot.InvalidArgument, match="runs no container engine"):  # noqa: SIM117
            with sandlot.Box(rootfs=busybox_root, engine="gvisor", containers=True):
                pass
    # an image with no engine: the kernel's side is ready, and nothing is started
    check = "grep -qw overlay /proc/filesystems && test -d /sys/module/bridge -a -d /sys/module/nf_tables"
    r = sandlot_cli("run", "--rm", "--containers", "--rootfs", str(busybox_root), "--", "sh", "-c", check)
    assert r.returncode == 0, r.stderr
