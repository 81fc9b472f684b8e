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


def ticks_in(seconds: float, every: float = 0.1) -> int:
    """The most a guest counter that ticks every ``every`` seconds (a shell loop's
    ``sleep``) can add in ``seconds`` of host time its guest could run: one more for a
    tick under way at each end. A counter that ran while its box was suspended goes
    past it."""
    return int(seconds / every) + 2
