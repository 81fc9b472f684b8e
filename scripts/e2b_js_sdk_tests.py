"""E2B's own JavaScript SDK tests (npm's ``e2b``) against a real ``sandlot serve``, run as
a user would (docs/e2b.md, "E2B's own tests"), as scripts/e2b_sdk_tests.py runs its
Python SDK's. CI cannot reach E2B's repository, so this is run by hand on a checkout of
it, with Node.js (20.18 or later) and npm on the PATH:

    git clone https://github.com/e2b-dev/E2B
    .venv/bin/python scripts/e2b_js_sdk_tests.py E2B/packages/js-sdk [--json out.json] [VITEST ARGS...]

The checkout is not written to: the folder is copied to a scratch directory, where the
tests run. What vitest's ``unit`` project needs (vitest, msw and the SDK's own
dependencies, at the versions its package.json asks) is installed with npm, without
install scripts, once, beside the tests' roots (``deps``:
~/.cache/sandlot-tests/e2b-js-sdk-deps, outside the repository), and linked in as the
copy's node_modules; the project runs under a config of its own (``CONFIG``), since the
SDK's loads Playwright for its browser project.

What it sets up is what scripts/e2b_sdk_tests.py does: a scratch home, a key in E2B's
form, E2B's template ``base`` (``base_root``; the tests' tests/template.ts names it) and
the server, and points the SDK at it with the same variables. It then runs the SDK's
tests of what the face serves (``DEFAULT_TESTS`` but ``OFFLINE``, unless VITEST ARGS
name others) with vitest's JSON reporter, and prints, as JSON, the passed and failed
tests and the rate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.e2b_sdk_tests import base_root, counted, e2b_server, report_out  # noqa: E402 (the checkout, on the path)

# the SDK's tests of what the face serves (docs/e2b.md): sandboxes, commands, PTYs,
# files and the git helpers (tests/sandbox), and the API's calls that reach the server
# (tests/api's others are the client's own, against no server); vitest's filters
DEFAULT_TESTS = ("tests/sandbox/", "tests/api/info", "tests/api/kill", "tests/api/list", "tests/api/snapshot")
# and not those of tests/sandbox that reach no server: msw's mocks of E2B's API at
# ``api.$E2B_DOMAIN`` (which refuse what they do not mock) and sandboxes made for
# e2b.app's URLs; ``E2B_API_URL`` and ``E2B_SANDBOX_URL``, set here, point them at the
# server instead, and they fail (they pass without those variables, as in E2B's CI)
OFFLINE = ("egressProxy", "iam", "lifecycleRequest", "networkTransform", "urls")
# what the unit project loads besides the SDK's dependencies (versions from its devDependencies);
# src/template imports error-stack-parser-es
TEST_DEPS = ("vitest", "msw", "error-stack-parser-es")
# the SDK's unit project (its vitest.config.mts) alone, as the root project: the SDK's
# config loads Playwright for its browser project, and vitest's --exclude reaches only
# the root project
CONFIG = """import { defineConfig } from 'vitest/config'
export default defineConfig({
  test: {
    name: 'unit',
    include: ['tests/**/*.test.ts'],
    exclude: ['tests/runtimes/**', 'tests/template/**', 'tests/connectionConfig.test.ts'],
    isolate: true,
    globals: false,
    testTimeout: 30_000,
    environment: 'node',
    bail: 0,
    setupFiles: ['tests/globalFetchFallback.setup.ts'],
    deps: { interopDefault: true },
  },
})
"""


def deps(sdk: Path) -> Path:
    """The node_modules folder of what the unit project needs, installed once (again when
    the SDK's package.json asks other versions) in the tests' cache, e2b-js-sdk-deps."""
    from tests.support.roots import CACHE

    package = json.loads((sdk / "package.json").read_text())
    wanted = dict(package.get("dependencies", {}))
    wanted.update({name: package["devDependencies"][name] for name in TEST_DEPS})
    text = json.dumps({"name": "sandlot-e2b-js-sdk-deps", "private": True, "dependencies": wanted}, indent=2)
    where = CACHE / "e2b-js-sdk-deps"
    where.mkdir(parents=True, exist_ok=True)
    manifest = where / "package.json"
    if not (where / "node_modules" / ".bin" / "vitest").exists() or manifest.read_text() != text:
        manifest.write_text(text)
        # no install scripts: this host reaches npm's registry and nothing else
        npm = ["npm", "install", "--ignore-scripts", "--no-audit", "--no-fund"]
        subprocess.run(npm, cwd=where, check=True)
    return where / "node_modules"


def summary(report: Path, root: Path | None = None) -> dict[str, object]:
    """Passed, failed (with the first line of each reason) and skipped tests of vitest's
    JSON report; a test is named ``FILE::FULL NAME``, FILE relative to ``root`` when given.
    A file that failed without running a test (it did not load) fails under its own name."""
    passed, failed, skipped = [], {}, []
    for suite in json.loads(report.read_text()).get("testResults", []):
        file = suite.get("name", "")
        if root is not None and Path(file).is_relative_to(root):
            file = str(Path(file).relative_to(root))
        cases = suite.get("assertionResults") or []
        for case in cases:
            name = f"{file}::{case.get('fullName') or case.get('title')}"
            if case.get("status") == "passed":
                passed.append(name)
            elif case.get("status") == "failed":
                reasons = "\n".join(case.get("failureMessages") or []).strip()
                failed[name] = reasons.splitlines()[0][:300] if reasons else ""
            else:  # skipped, pending, todo, disabled
                skipped.append(name)
        if not cases and suite.get("status") == "failed":
            message = (suite.get("message") or "").strip()
            failed[file] = message.splitlines()[0][:300] if message else ""
    return counted(passed, failed, skipped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sdk", type=Path, help="E2B's packages/js-sdk folder")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    ap.add_argument("--workers", type=int, default=2, help="vitest's workers (each runs its sandboxes)")
    ap.add_argument("--timeout", type=int, default=120, help="each test's and hook's limit, in seconds")
    args, vitest_args = ap.parse_known_args()
    if not ((args.sdk / "tests" / "setup.ts").is_file() and (args.sdk / "package.json").is_file()):
        raise SystemExit(f"{args.sdk} is not E2B's packages/js-sdk folder (no tests/setup.ts)")

    with e2b_server(base_root(), "base", 512) as (tmp, env):
        sdk = tmp.resolve() / "js-sdk"
        shutil.copytree(args.sdk, sdk, ignore=shutil.ignore_patterns("node_modules", "dist"))
        (sdk / "node_modules").symlink_to(deps(sdk))
        (sdk / "sandlot.vitest.config.mts").write_text(CONFIG)
        report = tmp / "report.json"
        ms = str(args.timeout * 1000)
        cmd = [str(sdk / "node_modules" / ".bin" / "vitest"), "run", "--config",
               "sandlot.vitest.config.mts", "--project", "unit", "--reporter=default", "--reporter=json",
               f"--outputFile={report}", f"--maxWorkers={args.workers}", f"--testTimeout={ms}",
               f"--hookTimeout={ms}"]  # fmt: skip
        cmd += vitest_args or [*DEFAULT_TESTS, *(f"--exclude=tests/sandbox/{t}.test.ts" for t in OFFLINE)]
        subprocess.run(cmd, cwd=sdk, env=env, check=False)
        if not report.is_file():
            raise SystemExit("vitest wrote no report (see its output above)")
        result = summary(report, sdk)
    report_out(result, args.json)


if __name__ == "__main__":
    main()
