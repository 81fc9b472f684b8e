"""The leases of boxes that remote clients made for ``with`` blocks (``core/leases.py``):
granted at ``POST /v1/boxes`` with ``"ephemeral": true``, renewed by the client with
``POST /v1/leases/renew``, and swept: a box whose lease lapsed is removed, and the
audit trail says why (``lease lapsed``, with the key that held it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request

from ..api import leases
from ..api.box import AsyncBox
from ..errors import BoxNotFound, InvalidArgument, SandlotError
from .state import Caller, ServerState

log = logging.getLogger("sandlot.server")

v1 = APIRouter()  # under /v1, authenticated by a key
SWEEP_EVERY = 1.0  # seconds between looks for lapsed leases
# A box labelled so is suspended when its lease lapses, not removed (an E2B sandbox made
# with ``on_timeout="pause"``): it keeps its state, frees its memory, and holds no lease
# until something resumes it and leases it again.
ON_END_LABEL = "lease.on_end"
MOST_RENEWED = 10_000  # boxes one renewal may name


def lease_for(state: ServerState, caller: Caller, wanted: dict[str, Any]) -> float | None:
    """The length of the lease a new box gets (None: it gets none): a ``with`` block's
    box (``ephemeral``) or one that asks for a ``lease`` gets the box's own length,
    else its key's, else the server's."""
    asked = wanted.pop("lease", None)
    if not wanted.pop("ephemeral", False) and asked is None:
        return None
    return leases.check_seconds(asked if asked is not None else caller.lease or state.settings.lease)


async def grant(
    state: ServerState, caller: Caller, box_id: str, seconds: float, *, shortest: float = leases.SHORTEST
) -> leases.Lease:
    return await asyncio.to_thread(leases.grant, box_id, seconds, key_id=caller.key_id,
                                   key_name=caller.key_name, namespace=caller.namespace,
                                   home=state.home, shortest=shortest)  # fmt: skip


@v1.post("/leases/renew", tags=["boxes"])
async def renew(request: Request, boxes: Annotated[list[str], Body(embed=True)]) -> dict[str, Any]:
    """Renew the leases of these boxes (those of the caller's namespace): each runs its
    whole length again from now. A box missing from ``leases`` has no lease any more:
    it lapsed (and is being removed) or it never had one."""
    if len(boxes) > MOST_RENEWED:
        raise InvalidArgument(f"at most {MOST_RENEWED} boxes per renewal, not {len(boxes)}")
    caller: Caller = request.state.caller
    state: ServerState = request.app.state.server
    renewed = await asyncio.to_thread(leases.renew, boxes, namespace=caller.namespace, home=state.home)
    return {"leases": {lease.box_id: lease.to_json() for lease in renewed}}


async def sweep(state: ServerState) -> None:
    """Remove the boxes whose lease lapsed, for as long as the server runs. Every server
    of a home sweeps; a box another one removed first is skipped."""
    await asyncio.to_thread(leases.give_time, home=state.home)
    while True:
        await asyncio.sleep(SWEEP_EVERY)
        try:
            lapsed = await asyncio.to_thread(leases.lapsed, home=state.home)
        except SandlotError as exc:  # a busy store: the next sweep looks again
            log.debug("lease sweep skipped: %s", exc)
            continue
        for lease in lapsed:
            await _remove(state, lease)


async def _remove(state: ServerState, lease: leases.Lease) -> None:
    caller = Caller(lease.key_id, lease.key_name, lease.namespace)
    detail = {"reason": "lease lapsed", "seconds": lease.seconds, "expired_at": lease.until}
    try:
        box = await AsyncBox.get(lease.box_id, home=state.home)
        if await asyncio.to_thread(leases.of, lease.box_id, home=state.home) != lease:
            return  # renewed (or swept by another server) since we looked
        if box.info["labels"].get(ON_END_LABEL) in ("suspend", "stop"):
            await _suspend(state, box, caller, detail)
            return
        state.handles.pop(box.id, None)
        await box.remove(force=True)
    except BoxNotFound:
        with contextlib.suppress(SandlotError):
            await asyncio.to_thread(leases.drop, lease.box_id, home=state.home)
        return
    except SandlotError as exc:
        # tried again after one more length of the lease (not at every sweep)
        log.warning("box %s: its lease lapsed but it could not be removed: %s", lease.box_id, exc)
        state.record(caller, "lease lapsed", lease.box_id, exc.status, exc.code, 0.0, detail)
        with contextlib.suppress(SandlotError):
            await grant(state, caller, lease.box_id, lease.seconds)
        return
    state.record(caller, "lease lapsed", lease.box_id, 200, None, 0.0, detail)


async def _suspend(state: ServerState, box: AsyncBox, caller: Caller, detail: dict[str, Any]) -> None:
    """The end of a lease that keeps its box: suspended (memory and all), or, where its
    label says ``stop``, stopped (its disk kept: it boots again, as E2B's filesystem-only
    pause)."""
    state.handles.pop(box.id, None)  # the routes' handle would not know of the change
    stop = box.info["labels"].get(ON_END_LABEL) == "stop"
    if box.state in ("running", "paused"):
        await (box.stop() if stop else box.suspend())
    await asyncio.to_thread(leases.drop, box.id, home=state.home)
    then = "stopped" if stop else "suspended"
    state.record(caller, "lease lapsed", box.id, 200, None, 0.0, {**detail, "then": then})
