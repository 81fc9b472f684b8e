"""The command line's own cost (issue 17, part 5): wall time of ``sandlot --version``,
``sandlot ls`` and ``sandlot exec BOX true`` (a running box), measured with
``hyperfine`` (apt package ``hyperfine``), next to Python's own start and
``import sandlot``. Targets: ``ls`` (of a home with one running box) at most 60 ms more
than Python's own start (issue 64: it reads the store without the box API where no box
needs recovery, ``api/listing.py``), and ``exec BOX true`` at most 120 ms.

The commands run this checkout's code (``python -m sandlot.cli`` with its ``src``
first on the path), compiled to bytecode first, as an installed package is.
``--before REF`` measures the same commands with the code of a git revision too
(its ``src`` extracted to a temporary folder), in the same run.

    .venv/bin/python benchmarks/cli.py [--runs 30] [--before REF] [--quick]
"""

from __future__ import annotations

import compileall
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import sandlot

from _common import busybox_root, drop_home, emit, host_facts, parser, scratch_home, summary

REPO = Path(__file__).resolve().parent.parent
TARGET_MS = 120.0  # exec BOX true
LS_OVER_PYTHON_MS = 60.0


def hyperfine(commands: dict[str, list[str]], env: dict[str, str], runs: int, warmup: int) -> dict[str, Any]:
    """Each command's wall time in ms (median, p99, min, max) from hyperfine's JSON export."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "hf.json"
        argv = ["hyperfine", "--shell=none", "--style", "none", "--runs", str(runs), "--warmup", str(warmup),
                "--export-json", str(out)]  # fmt: skip
        for name, cmd in commands.items():
            argv += ["--command-name", name, shlex.join(cmd)]  # split with shell-words rules
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, timeout=600)
        results = json.loads(out.read_text())["results"]
    return {r["command"]: summary(r["times"], 1e3, 1) for r in results}


def measure(src: Path, home: Path, box: str, runs: int, warmup: int) -> dict[str, Any]:
    compileall.compile_dir(src / "sandlot", quiet=1)  # as pip leaves an installed package
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(src), SANDLOT_HOME=str(home))
    py = sys.executable
    figures = hyperfine(
        {
            "python_startup": [py, "-c", "pass"],
            "import_sandlot": [py, "-c", "import sandlot"],
            "version": [py, "-m", "sandlot.cli", "--version"],
            "ls": [py, "-m", "sandlot.cli", "ls"],
            "exec_true": [py, "-m", "sandlot.cli", "exec", box, "true"],
        },
        env,
        runs,
        warmup,
    )
    return {f"{k}_ms": v for k, v in figures.items()}


def checkout(ref: str, dest: Path) -> Path:
    """``ref``'s ``src`` folder, extracted under ``dest``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "src"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--before", metavar="REF", help="also measure this git revision's code (e.g. main)")
    args = ap.parse_args()
    if shutil.which("hyperfine") is None:
        ap.error("hyperfine is not installed (apt package hyperfine; scripts/setup installs it)")
    runs, warmup = (5, 1) if args.quick else (args.runs, 3)
    home = scratch_home("bench-cli-")
    try:
        box = sandlot.Box(rootfs=busybox_root(), memory_mib=256, name="cli-bench", keep=True, home=home)
        box.start()
        box.exec("true")
        accel = box.accel
        doc: dict[str, Any] = {"benchmark": "cli", "quick": args.quick, "host": host_facts(accel),
                               "target_ms": {"exec_true": TARGET_MS, "ls_over_python": LS_OVER_PYTHON_MS},
                               "load_before": os.getloadavg()[0]}  # fmt: skip
        doc.update(measure(REPO / "src", home, box.name, runs, warmup))
        over = doc["ls_ms"]["median"] - doc["python_startup_ms"]["median"]
        doc["ls_over_python_ms"] = round(over, 1)
        doc["targets_met"] = {"ls_over_python": over <= LS_OVER_PYTHON_MS,
                              "exec_true": doc["exec_true_ms"]["median"] <= TARGET_MS}  # fmt: skip
        if args.before:
            with tempfile.TemporaryDirectory() as d:
                old = checkout(args.before, Path(d))
                doc["before"] = {"ref": args.before, **measure(old, home, box.name, runs, warmup)}
        doc["load_after"] = os.getloadavg()[0]
        box.remove(force=True)
    finally:
        drop_home(home)
    emit(doc)


if __name__ == "__main__":
    main()
