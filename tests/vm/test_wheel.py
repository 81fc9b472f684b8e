"""The wheel, as a new user meets it: built with ``python -m build``, installed into a
fresh venv outside the checkout, set up with ``sandlot setup``, and the README's
quick start run from it, unchanged.

The venv installs sandlot's dependencies from the wheelhouse ``scripts/setup`` filled
(tests reach nothing past 127.0.0.1), and ``python:3.12-slim`` comes from a local
registry standing in for Docker Hub (``SANDLOT_REGISTRY_MIRRORS``). The guest kernel
is copied from the tests' home, as on a machine that fetched it once."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import sandlot

from tests.support.docs import REPO, blocks

pytestmark = pytest.mark.vm

WHEELHOUSE = REPO / ".cache" / "wheelhouse"


def readme_quick_start() -> str:
    """The README's first Python example: the three lines."""
    return next(b.code for b in blocks(REPO / "README.md") if b.lang == "python")


def test_wheel_installs_anywhere_and_runs_the_readme(tmp_path: Path, hub_mirror: str) -> None:
    if not WHEELHOUSE.is_dir():
        pytest.fail("no wheelhouse: ./scripts/setup makes it")
    offline = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(WHEELHOUSE),
               "SANDLOT_WHEEL_NATIVE": "required", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # fmt: skip
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(REPO)],
                           capture_output=True, text=True, env=offline, timeout=300)  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    tags = "-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.musllinux_1_1_x86_64.whl"
    assert wheel.name.endswith(tags)  # any x86_64 Linux, any Python 3: the binaries are static
    with zipfile.ZipFile(wheel) as z:
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
    for binary in ("sandlot/_prebuilt/sandlot-agent", "sandlot/_prebuilt/sandlot-fdrelay"):
        assert modes[binary] & 0o111, f"{binary} is not executable in the wheel"

    # a user's machine: a fresh venv, home and working directory, none in the checkout
    user = tmp_path / "user"
    user.mkdir()
    venv = user / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    home = user / "home"
    home.mkdir()
    shutil.copytree(sandlot.Runtime.for_home().home / "kernels", home / "kernels", symlinks=True)
    env = {**offline, "SANDLOT_HOME": str(home), "SANDLOT_REGISTRY_MIRRORS": f"docker.io={hub_mirror}",
           "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HOME": str(user)}  # fmt: skip
    for key in ("PYTHONPATH", "VIRTUAL_ENV", "SANDLOT_BUILD_NATIVE"):
        env.pop(key, None)

    def run(*argv: str, timeout: float = 300) -> str:
        r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=user, timeout=timeout)
        assert r.returncode == 0, f"{argv}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    started = time.monotonic()
    run("pip", "install", "-q", str(wheel))
    installed = time.monotonic()
    where = run("python", "-c", "import sandlot, sys; print(sandlot.__file__)")
    assert where.startswith(str(venv)), where  # the wheel's sandlot, not the checkout's
    setup = run("sandlot", "setup")
    assert re.search(r"^agent .*_prebuilt/sandlot-agent \(prebuilt\)$", setup, re.M), setup
    assert not (home / "agent").exists()  # nothing compiled on the user's machine
    (user / "quickstart.py").write_text(readme_quick_start())
    out = run("python", "quickstart.py", timeout=600)
    assert out == "42\n\nhello\n", out
    rest = time.monotonic() - installed
    print(f"\npip install {installed - started:.1f} s; setup + quick start {rest:.1f} s")
