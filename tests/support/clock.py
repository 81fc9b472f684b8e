"""A guest's wall clock, checked against the host's while it was read: a command that
reads it takes as long as the host's load makes it, so the guest's answer is held to
the span between asking and being answered, not to one host reading after it."""

from __future__ import annotations


def set_while_read(guest_epoch: str | int, asked: float, answered: float) -> bool:
    """Whether the guest's ``date +%s`` fell between ``asked`` and ``answered`` (host
    ``time.time()`` around the command): a second of slack below for the truncation of
    ``%s``, and half a second either way for the clocks' own difference. A clock left
    where a pause or a snapshot stopped it is behind by that whole while."""
    return asked - 1.5 <= int(guest_epoch) <= answered + 0.5
