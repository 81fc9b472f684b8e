"""E2B's own Python SDK tests against a real ``sandlot serve``, run as a user would
(docs/e2b.md, "E2B's own tests"). CI cannot reach E2B's repository, so this is run by
hand on a checkout of it:

    git clone https://github.com/e2b-dev/E2B && python -m venv e2b-venv
    e2b-venv/bin/pip install ./E2B/packages/python-sdk pytest pytest-asyncio pytest-xdist \\
        pytest-timeout pytest-dotenv
    .venv/bin/python scripts/e2b_sdk_tests.py E2B/packages/python-sdk --python e2b-venv/bin/python \\
        [--json out.json] [PYTEST ARGS...]

and ``e2b-code-interpreter``'s tests on a checkout of its repository (its ``python``
folder, the SDK and pytest-asyncio installed in that Python): ``--code-interpreter``.

What it sets up, in a scratch home: a key in E2B's form (``sandlot keys create --e2b``),
E2B's default template ``base`` as a sandlot template (Debian with bash, python3, git
and curl, the user ``user`` E2B's templates run as, and a network card), and the server
(``--mcp-image`` unset: only ``base`` is served). The SDK is pointed at it as docs/e2b.md
says: ``E2B_API_URL`` and ``E2B_SANDBOX_URL``, one URL for every sandbox. It then runs
the SDK's tests of what the face serves (``DEFAULT_TESTS``, unless PYTEST ARGS name
others) and prints, as JSON, the passed and failed tests and the rate. With
``--code-interpreter``, the template is E2B's ``code-interpreter-v1`` (``interpreter_root``:
Debian with python3's Jupyter kernel, matplotlib and pandas, Node.js with TypeScript, R's
Jupyter kernel, and the user ``user``), and
the tests are ``INTERPRETER_TESTS``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the SDK's tests of what the face serves (docs/e2b.md): sandboxes, commands, PTYs,
# files and the git helpers (which run git through commands); not templates' builds,
# volumes or secrets, which sandlot does elsewhere
DEFAULT_TESTS = ("tests/sync/sandbox_sync", "tests/sync/api_sync", "tests/async/sandbox_async",
                 "tests/async/api_async", "tests/shared/git")  # fmt: skip
INTERPRETER_TESTS = ("tests/sync", "tests/charts", "tests/images")
# E2B's templates' user: home /home/user, bash, sudo without a password
USER_HOOKS = ['chroot "$1" useradd -m -u 1001 -s /bin/bash user',  # (1000: debian_rootfs's agent)
              'echo "user ALL=(ALL:ALL) NOPASSWD: ALL" > "$1/etc/sudoers.d/user"']  # fmt: skip
PACKAGES = ["python3", "python-is-python3", "git", "curl", "ca-certificates", "sudo"]


def base_root() -> Path:
    """E2B's ``base`` template as a root filesystem: Debian with ``PACKAGES`` and the user
    ``user`` (home /home/user, bash, sudo without a password, as in E2B's), cached
    beside the tests' roots."""
    from sandlot.images.builders import debian_rootfs

    from tests.support.roots import CACHE

    dest = CACHE / "rootfs-e2b-base-v2"
    if not (dest / "home" / "user").is_dir():
        debian_rootfs(dest, PACKAGES, hooks=USER_HOOKS)
    return dest


def interpreter_root() -> Path:
    """E2B's ``code-interpreter-v1`` template as a root filesystem: the packages of the
    tests' Jupyter root (python3-ipykernel, matplotlib, pandas, Node.js with TypeScript),
    R's Jupyter kernel (IRkernel) and ``base``'s user ``user``, cached beside the tests'
    roots. JavaScript, TypeScript and bash run in sandlot's own kernels; Java, whose
    Jupyter kernel Debian does not package, does not run."""
    from sandlot.images.builders import debian_rootfs

    from tests.support.roots import CACHE

    dest = CACHE / "rootfs-e2b-code-interpreter-v2"
    if not (dest / "home" / "user").is_dir():
        packages = ["python3", "python3-ipykernel", "python3-matplotlib", "python3-pandas", "python3-munkres",
                    "nodejs", "node-typescript", "r-cran-irkernel", "sudo"]  # fmt: skip
        debian_rootfs(dest, packages, recommends=False, hooks=USER_HOOKS)
    return dest


STARTUP_DIR = "/root/.ipython/profile_default/startup"  # cells run as root, as E2B's do


def summary(report: Path) -> dict[str, object]:
    """Passed, failed (with the first line of each reason) and skipped tests of a JUnit report."""
    passed, failed, skipped = [], {}, []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            failed[name] = (bad.get("message") or "").splitlines()[0][:300] if bad.get("message") else ""
        elif case.find("skipped") is not None:
            skipped.append(name)
        else:
            passed.append(name)
    return counted(passed, failed, skipped)


def counted(passed: list[str], failed: dict[str, str], skipped: list[str]) -> dict[str, object]:
    """The summary both harnesses print: counts, the rate of those that ran, and each failure."""
    ran = len(passed) + len(failed)
    return {"passed": len(passed), "failed": len(failed), "skipped": len(skipped),
            "rate": round(len(passed) / ran, 3) if ran else None, "failures": failed}  # fmt: skip


@contextlib.contextmanager
def e2b_server(
    root: Path, template: str, memory: int, setup: list[list[str]] | None = None
) -> Iterator[tuple[Path, dict[str, str]]]:
    """A scratch folder with a home in it, a server on that home, a key in E2B's form and
    the sandlot template ``template`` of ``root``: the folder, and the environment that
    points E2B's SDKs at the server (one sandbox URL for every sandbox, as docs/e2b.md says)."""
    import sandlot

    from tests.support.serve import create_key, serving, shared_home

    with tempfile.TemporaryDirectory(prefix="sandlot-e2b-sdk-") as tmp:
        home = shared_home(Path(tmp))
        with serving(home) as served:
            key = create_key(home, "e2b-sdk", "--admin", "--e2b")
            sandlot.template(rootfs=str(root), name=template, memory_mib=memory, network="public", home=home,
                             setup=setup or [])  # fmt: skip
            yield Path(tmp), {**os.environ, "E2B_API_URL": f"{served.url}/e2b",
                              "E2B_SANDBOX_URL": f"{served.url}/e2b", "E2B_API_KEY": key,
                              "E2B_DOMAIN": "sandlot.invalid"}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sdk", type=Path, help="E2B's packages/python-sdk folder (or code-interpreter's python)")
    ap.add_argument("--code-interpreter", action="store_true", help="e2b-code-interpreter's tests")
    ap.add_argument("--python", default=sys.executable, help="a Python with that SDK and pytest installed")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (each runs its sandboxes)")
    args, pytest_args = ap.parse_known_args()
    if not (args.sdk / "tests" / "conftest.py").is_file():
        raise SystemExit(f"{args.sdk} is not E2B's packages/python-sdk folder (no tests/conftest.py)")

    if args.code_interpreter:
        root, template, memory, tests = interpreter_root(), "code-interpreter-v1", 1024, INTERPRETER_TESTS
        from tests.support.roots import IMAGES_STARTUP

        setup = [["mkdir", "-p", STARTUP_DIR],
                 ["python3", "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                  f"{STARTUP_DIR}/0003_images.py", IMAGES_STARTUP]]  # fmt: skip
    else:
        root, template, memory, tests = base_root(), "base", 512, DEFAULT_TESTS
        setup = []
    with e2b_server(root, template, memory, setup) as (tmp, env):
        report = tmp / "report.xml"
        cmd = [args.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={report}",
               "--timeout=300", *(["-n", str(args.workers)] if args.workers > 1 else []),
               *(pytest_args or tests)]  # fmt: skip
        subprocess.run(cmd, cwd=args.sdk, env=env, check=False)
        result = summary(report)
    report_out(result, args.json)


def report_out(result: dict[str, object], to: Path | None) -> None:
    """Print the summary as JSON, and write it to ``to`` where given."""
    text = json.dumps(result, indent=2)
    if to is not None:
        to.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
