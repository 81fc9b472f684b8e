"""Every page of the README and docs/ runs as written (tests/support/docs.py says how
a page marks what it needs): its Python and console blocks in order, on real boxes, in
a home kept from run to run, emptied of all but its images and their automatic templates
(a reader's second start of an image). ``python:3.12-slim`` and the like come from a
local registry standing in for Docker Hub; a block marked ``server`` talks to a real
``sandlot serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

import sandlot

from tests.support.docs import PAGES, REPO, blocks
from tests.support.serve import empty_but_templates, kept_home, serving

pytestmark = pytest.mark.vm

RUNNABLE = [p for p in PAGES if any("skip" not in b.marks for b in blocks(p))]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_page_runs_as_written(
    page: Path, tmp_path: Path, hub_mirror: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one home for every page, run after run, emptied of all but its images and their
    # automatic templates: a page's boxes start as a reader's second start of an image
    # does, not from a boot and a save each time (tests/support/serve.py)
    home = kept_home(sandlot.Runtime.for_home().home.with_name("docs-home"))
    monkeypatch.setenv("SANDLOT_REGISTRY_MIRRORS", f"docker.io={hub_mirror}")  # a server started here too
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "SANDLOT_HOME": str(home), "PYTHONPATH": str(REPO)}
    outcomes = []
    with ExitStack() as stack:
        if any("server" in b.marks for b in blocks(page)):
            served = stack.enter_context(serving(home))
            env |= {"SANDLOT_URL": served.url, "SANDLOT_API_KEY": served.api_key or ""}
        try:
            r = subprocess.run([sys.executable, "-m", "tests.support.docs", str(page)], env=env, cwd=work,
                               capture_output=True, text=True, timeout=1400)  # fmt: skip
            outcomes = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        finally:  # what the page left behind, should it have stopped half way
            empty_but_templates(home)
    for o in outcomes:  # shown with -rP, or -s: what each block printed, and how long it took
        print(f"--- {o['where']}: {o['result']} {o.get('seconds', '')} {o.get('why', '')}")
        print(o.get("stdout", ""), end="")
    failed = [o for o in outcomes if o["result"] == "failed"]
    assert not failed, (f"{failed[0]['where']} failed:\n{failed[0]['error']}\n{failed[0]['stdout']}\n"
                        f"{r.stderr[-6000:]}")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ran = {o["where"] for o in outcomes}
    assert ran == {b.where for b in blocks(page)}, "the page stopped before its end"
