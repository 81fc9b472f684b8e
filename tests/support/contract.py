"""Checks the contract suite makes the same way on the fake engine (tests/unit) and on
real VMs (tests/vm), whatever the transport the box is driven through."""

from __future__ import annotations

import time
from typing import Any

from sandlot.api import contract

from tests.support.waiting import deadline_in


def events_past_and_followed(box: Any) -> list[Any]:
    """The box's story so far begins with its creation and names only it; a pause and an
    unpause then reach a follower that started after it. The story, as it was read."""
    story = list(box.events(follow=False))
    assert story and story[0].kind == "created" and {e.box_name for e in story} == {box.name}
    following = iter(box.events(after=story[-1].id))
    try:
        box.pause()
        box.unpause()
        assert [next(following).kind, next(following).kind] == ["paused", "unpaused"]
    finally:
        following.close()  # type: ignore[attr-defined]
    return story


def no_watch_left(box: Any) -> None:
    """No watch is left behind in the box (a remote one ends when its stream does)."""
    deadline = deadline_in(10)
    while box.exec("sh", "-c", "ls -l /proc/1/fd | grep -c inotify").stdout.strip() != "0":
        assert time.monotonic() < deadline, "a watch was not freed"
        time.sleep(0.2)


def a_terminal_follows_its_size(box: Any) -> None:
    """A shell on a terminal of 30x100 sees that size, then 50x132 after a resize, and its
    exit status comes back."""
    p = box.spawn("sh", tty=True, rows=30, cols=100)
    chunks = iter(p.stdout)

    def until(text: str) -> None:  # the terminal's output, read until it shows ``text``
        seen = ""
        while text not in seen:
            seen += next(chunks).decode()

    p.write_stdin("stty size\n")
    until("30 100")
    p.resize(50, 132)
    p.write_stdin("stty size; exit 5\n")
    until("50 132")
    assert p.wait(timeout=30) == 5


# what each required field of an operation's arguments takes, for the tests that send every
# operation of the contract through a transport
PLAUSIBLE: dict[str, Any] = {
    "path": "/tmp/x", "src": "/tmp/x", "dst": "/tmp/y", "snapshot": "s1", "mode": 0o644, "user": "root",
    "context": "ctx-1", "port": 8080, "code": "1", "step": "1", "child": "c1", "prefix": "user.",
    "values": {"user.a": "b"},
}  # fmt: skip


def args_for(op: contract.Operation) -> dict[str, Any]:
    """Arguments an operation accepts: its defaults, and a plausible value for each required field."""
    return {name: PLAUSIBLE[name] for name, field in op.params.model_fields.items() if field.is_required()}
