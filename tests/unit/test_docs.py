"""The docs cannot drift from the code: every Python and console block of the README
and docs/ is checked here without a VM (it compiles, the ``sandlot`` names and keyword
arguments it uses exist, each ``sandlot ...`` command line parses with the real command
line), and every relative link finds its file. tests/vm/test_docs.py runs them."""

from __future__ import annotations

import re

import pytest

from tests.support.docs import (
    PAGES,
    REPO,
    Block,
    blocks,
    cli_problems,
    compiled,
    python_names,
    setup_problems,
    signature_problems,
)

BLOCKS = [b for page in PAGES for b in blocks(page)]
KNOWN_MARKS = {"skip", "setup", "server", "any-output", "signature"}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_matches_the_code(block: Block) -> None:
    assert set(block.marks) <= KNOWN_MARKS, f"unknown docs-test marker in {block.marks}"
    assert "skip" not in block.marks or block.marks["skip"], "a skipped block says why"
    assert setup_problems(block) == []
    if "signature" in block.marks:
        assert signature_problems(block) == []
    elif block.lang == "python":
        compiled(block)
        assert python_names(block) == []
    else:
        assert block.commands(), "a console block shows its commands as `$ command`"
        assert cli_problems(block) == []


def test_every_page_has_blocks_that_run() -> None:
    """A page whose every block is skipped tests nothing: at most the ones that need
    what no test here has are."""
    for page in PAGES:
        mine = [b for b in BLOCKS if b.page == page]
        if mine:
            assert any("skip" not in b.marks for b in mine), f"{page.name}: every block is skipped"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page) -> None:  # type: ignore[no-untyped-def]
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(REPO)} links to {target}, which is not there"


def test_the_checks_catch_drift(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The checks are not vacuous: the mistakes the docs once had are caught."""
    page = tmp_path / "page.md"
    page.write_text(
        "```console\n$ sandlot ls --label team=a\n$ sandlot export dev out.sandlot > log\n"
        '$ sandlot snapshot export dev x.sandlot --quiet\n$ sandlot ls -q; echo "exit $?"\nexit 2\n```\n\n'
        "```python\nfrom sandlot import fleet\nfleet.recover(box)\nsandlot.Box('x', memory=1)\n```\n"
    )
    console, python = blocks(page)
    problems = cli_problems(console)
    assert len(problems) == 3, problems
    assert "--label" in problems[0] and "export" in problems[1] and "parses" in problems[2]
    assert python_names(python) == [
        "fleet.recover: sandlot.fleet has no 'recover'",
        "sandlot.Box(): no keyword argument 'memory'",
    ]
