"""The sandlot node actor: one per Ray node, detached, holding that node's own
sandlot home (its store, its engine, its VMs) and running the async API on the
actor's event loop. Everything a fleet does to a box happens here, on the node
that has it; the client only says which node.

Its calls take and give plain data (summaries, ``ExecResult``, ``FileInfo``); a
sandlot error comes back as ``{"error": err.to_dict()}`` and is raised again as
the same class by the client, since Ray would wrap it in its own exception.
Saved state leaves a node as chunks it ``ray.put``s and enters another as the
chunks that node fetches and verifies (``transfer``).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import os
import secrets
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import ray

from ..api.box import AsyncBox, AsyncSnapshot
from ..api.templates import import_snapshot_async, restore_moved_box_async
from ..config import runtime_dir
from ..core.runtime import Runtime
from ..errors import InvalidArgument, InvalidState, SandlotError
from ..version import __version__
from . import transfer

# the names of the snapshots the fleet makes to move a box or a fork's state (on the
# source, and as imported on each target): they go with the last box started from them
TRANSIENT = ("move-", "fork-", "replica-")
P = ParamSpec("P")
T = TypeVar("T")
Reply = dict[str, Any]

# what a fleet box may ask of its box and of its files, by name: the methods whose
# arguments and results are plain data
BOX_CALLS = frozenset({
    "exec", "sh", "start", "stop", "restart", "kill", "pause", "unpause", "inspect", "stats", "logs",
    "refresh", "ping", "suspend", "resume", "activity", "port",
})  # fmt: skip
FILE_CALLS = frozenset(
    {"read", "read_text", "write", "stat", "exists", "list", "mkdir", "remove", "rename", "chmod", "chown"}
)


def error_reply(exc: SandlotError) -> Reply:
    return {"error": {**exc.to_dict(), "type": type(exc).__name__}}


def guarded(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[Reply]]:
    """A node call's result as ``{"ok": value}``, or its sandlot error as ``{"error": ...}``."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> Reply:
        try:
            return {"ok": await fn(*args, **kwargs)}
        except SandlotError as exc:
            return error_reply(exc)

    return call


def summary(box: AsyncBox) -> dict[str, Any]:
    """What the directory and ``list()`` show of a box."""
    rec = box.info
    opts = rec.get("options") or {}
    return {
        "id": box.id,
        "name": box.name,
        "labels": dict(rec.get("labels") or {}),
        "state": box.state,
        "cpus": opts.get("cpus"),
        "memory_mib": opts.get("memory_mib"),
    }


def snapshot_summary(snap: AsyncSnapshot) -> dict[str, Any]:
    return {"id": snap.id, "name": snap.name, "box_name": snap.box_name, "created_at": snap.created_at,
            "size": snap.size}  # fmt: skip


class NodeService:
    """The body of a node actor (``ray.remote`` is applied by the client)."""

    def __init__(self, node_id: str, home: str | None = None) -> None:
        self.node_id = node_id
        # the home is the node's: its SANDLOT_HOME (set where `ray start` runs), unless given
        self.home = Runtime.for_home(home).home
        self.started_at = time.time()
        self.boxes: dict[str, AsyncBox] = {}
        self.moving: dict[str, dict[str, Any]] = {}

    async def box(self, key: str) -> AsyncBox:
        found = self.boxes.get(key)
        if found is None:
            found = await AsyncBox.get(key, home=self.home)
            self.boxes[found.id] = found
        return found

    # -- the node --------------------------------------------------------------------------

    async def facts(self) -> dict[str, Any]:
        boxes = await AsyncBox.list(home=self.home)
        return {"node_id": self.node_id, "home": str(self.home), "version": __version__, "pid": os.getpid(),
                "host": socket.gethostname(), "runtime_dir": str(runtime_dir()),
                "started_at": self.started_at, "boxes": len(boxes),
                "running": sum(1 for b in boxes if b.state == "running")}  # fmt: skip

    @guarded
    async def list(self) -> builtins.list[dict[str, Any]]:
        return [summary(b) for b in await AsyncBox.list(home=self.home)]

    # -- boxes -----------------------------------------------------------------------------

    @guarded
    async def create(self, image: str | None, options: dict[str, Any], start: bool) -> dict[str, Any]:
        box = await AsyncBox.create(image, keep=True, home=self.home, **options)
        if start:
            await box.start()
        self.boxes[box.id] = box
        return summary(box)

    @guarded
    async def call(self, box_id: str, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if method not in BOX_CALLS:
            raise InvalidArgument(f"a fleet box has no method {method!r}")
        box = await self.box(box_id)
        return await getattr(box, method)(*args, **kwargs)

    @guarded
    async def state(self, box_id: str) -> dict[str, Any]:
        box = await self.box(box_id)
        await box.refresh()
        return summary(box)

    @guarded
    async def files(self, box_id: str, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if method not in FILE_CALLS:
            raise InvalidArgument(f"a fleet box's files have no method {method!r}")
        box = await self.box(box_id)
        return await getattr(box.files, method)(*args, **kwargs)

    @guarded
    async def remove(self, box_id: str, force: bool) -> None:
        try:
            box = await self.box(box_id)
        except SandlotError:
            return
        await self.remove_box(box, force)

    async def remove_box(self, box: AsyncBox, force: bool) -> None:
        """Remove a box, and the state the fleet moved here for it once no box needs it."""
        origin = (await box.inspect()).get("origin")
        await box.remove(force=force)
        self.boxes.pop(box.id, None)
        if origin:
            with contextlib.suppress(SandlotError):  # SnapshotInUse: other children still need it
                snap = await AsyncSnapshot.get(origin, home=self.home)
                if (snap.name or "").startswith(TRANSIENT):
                    await snap.remove()

    async def spawn(
        self, box_id: str, argv: Sequence[str], kwargs: dict[str, Any], stdin: bytes | None
    ) -> AsyncIterator[tuple[str, Any]]:
        """A command's output as it comes: ("stdout"|"stderr", bytes) items, then ("exit",
        code); or ("error", the error) (a Ray streaming generator)."""
        try:
            box = await self.box(box_id)
            proc = await box.spawn(*argv, stdin=stdin is not None, **kwargs)
        except SandlotError as exc:
            yield "error", error_reply(exc)["error"]
            return
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()

        async def pump(name: str, stream: Any) -> None:
            async for chunk in stream:
                await queue.put((name, chunk))
            await queue.put(None)

        async def feed() -> None:
            assert stdin is not None
            await proc.write_stdin(stdin)
            await proc.close_stdin()

        tasks = [asyncio.ensure_future(pump("stdout", proc.stdout))]
        if not kwargs.get("tty"):
            tasks.append(asyncio.ensure_future(pump("stderr", proc.stderr)))
        if stdin is not None:
            tasks.append(asyncio.ensure_future(feed()))
        try:
            open_streams = 2 if not kwargs.get("tty") else 1
            while open_streams:
                item = await queue.get()
                if item is None:
                    open_streams -= 1
                else:
                    yield item
            yield "exit", await proc.wait()
        except SandlotError as exc:
            yield "error", error_reply(exc)["error"]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)

    # -- live state ------------------------------------------------------------------------

    @guarded
    async def snapshot(self, box_id: str, name: str | None) -> dict[str, Any]:
        return snapshot_summary(await (await self.box(box_id)).snapshot(name))

    @guarded
    async def snapshots(self, box_id: str) -> builtins.list[dict[str, Any]]:
        return [snapshot_summary(s) for s in await (await self.box(box_id)).snapshots()]

    @guarded
    async def rollback(self, box_id: str, snapshot: str) -> None:
        await (await self.box(box_id)).rollback(snapshot)

    @guarded
    async def fork(self, box_id: str, n: int, name: str | None) -> builtins.list[dict[str, Any]]:
        kids = await (await self.box(box_id)).fork(n, name=name)
        self.boxes.update({k.id: k for k in kids})
        return [summary(k) for k in kids]

    @guarded
    async def start_from(
        self,
        snapshot: str,
        n: int,
        name: str | None,
        box_id: str | None,
        labels: Mapping[str, str],
        as_prefix: bool = False,
    ) -> builtins.list[dict[str, Any]]:
        """Start boxes from a snapshot of this home; ``as_prefix``: ``name`` is the prefix
        of their names even for one (a fork's child)."""
        if as_prefix and name is not None:
            name = prefixed(name)
        snap = await AsyncSnapshot.get(snapshot, home=self.home)
        kids = await start_boxes(snap, n, name, box_id, labels)
        self.boxes.update({k.id: k for k in kids})
        return [summary(k) for k in kids]

    @guarded
    async def drop_snapshot(self, snapshot: str) -> None:
        with contextlib.suppress(SandlotError):
            await (await AsyncSnapshot.get(snapshot, home=self.home)).remove()

    # -- moving saved state ----------------------------------------------------------------

    @guarded
    async def export(self, snapshot: str) -> dict[str, Any]:
        """A snapshot of this node as chunks in the object store: their descriptions and
        references (owned by this actor, which lives as long as the node)."""
        snap = await AsyncSnapshot.get(snapshot, home=self.home)
        work = Path(tempfile.mkdtemp(prefix="fleet-export-", dir=self.home))
        try:
            t0 = time.monotonic()
            path = await snap.export(work / "state.sandlot")
            saved = time.monotonic() - t0
            total = await asyncio.to_thread(transfer.digest, path)
            chunks = []
            for piece, data in await asyncio.to_thread(lambda: builtins.list(transfer.pieces(path))):
                chunks.append((piece, ray.put(data)))
            return {"chunks": chunks, "sha256": total, "size": path.stat().st_size, "export_s": saved,
                    "snapshot": snapshot_summary(snap)}  # fmt: skip
        finally:
            await asyncio.to_thread(_rmtree, work)

    @guarded
    async def import_state(self, moved: dict[str, Any], start: dict[str, Any] | None) -> dict[str, Any]:
        """Fetch and verify the chunks of a moved snapshot, import it into this home
        (the archive's own integrity and compatibility checks apply), and with
        ``start`` ({"n", "name", "box_id", "labels"}) start boxes from it."""
        work = Path(tempfile.mkdtemp(prefix="fleet-import-", dir=self.home))
        try:
            t0 = time.monotonic()
            # one chunk in memory at a time: fetched, checked, written
            assembly = transfer.Assembly(work / "state.sandlot", moved["sha256"])
            try:
                for piece, ref in moved["chunks"]:
                    data = await ref
                    await asyncio.to_thread(assembly.add, piece, data)
                archive = await asyncio.to_thread(assembly.finish)
            except BaseException:
                assembly.abort()
                raise
            fetched_s = time.monotonic() - t0
            t1 = time.monotonic()
            snap = await import_snapshot_async(archive, home=self.home, start=False)
            assert isinstance(snap, AsyncSnapshot)
            imported_s = time.monotonic() - t1
        finally:
            await asyncio.to_thread(_rmtree, work)
        out: dict[str, Any] = {"snapshot": snap.id, "fetch_s": fetched_s, "import_s": imported_s, "boxes": []}
        if start is not None:
            t2 = time.monotonic()
            try:
                name = start.get("name")
                if start.get("as_prefix") and name is not None:
                    name = prefixed(name)
                kids = await start_boxes(snap, start.get("n", 1), name, start.get("box_id"),
                                         start.get("labels") or {})  # fmt: skip
            except BaseException:
                with contextlib.suppress(SandlotError):
                    await snap.remove()  # nothing half-moved stays behind
                raise
            self.boxes.update({k.id: k for k in kids})
            out["boxes"] = [summary(k) for k in kids]
            out["start_s"] = time.monotonic() - t2
        return out

    @guarded
    async def hold(self, box_id: str) -> dict[str, Any]:
        """Freeze a box for a move: a suspended one is resumed first; then it is paused
        and snapshotted (the state that moves). ``release`` undoes this, ``finish`` ends
        the box here once it runs elsewhere."""
        if box_id in self.moving:
            raise InvalidState(f"box {box_id} is being moved already", box=box_id, state="moving")
        box = await self.box(box_id)
        await box.refresh()
        was = box.state
        if was not in ("running", "paused", "suspended"):
            raise InvalidArgument(
                f"box {box.name} is {was}: only a running, paused or suspended box moves with its processes",
            )
        t0 = time.monotonic()
        if was == "suspended":
            await box.resume()
        if box.state == "running":
            await box.pause()
        try:
            snap = await box.snapshot(f"move-{secrets.token_hex(4)}")
        except BaseException:
            await self._undo_hold(box, was)
            raise
        self.moving[box_id] = {"was": was, "snapshot": snap.id}
        return {"was": was, "snapshot": snap.id, "hold_s": time.monotonic() - t0}

    async def _undo_hold(self, box: AsyncBox, was: str) -> None:
        with contextlib.suppress(SandlotError):
            if was in ("running", "suspended"):
                await box.unpause()
            if was == "suspended":
                await box.suspend()

    @guarded
    async def release(self, box_id: str) -> None:
        """A move failed: the box goes on here as it was."""
        held = self.moving.pop(box_id, None)
        if held is None:
            return
        box = await self.box(box_id)
        with contextlib.suppress(SandlotError):
            await (await AsyncSnapshot.get(held["snapshot"], home=self.home)).remove()
        await self._undo_hold(box, held["was"])

    @guarded
    async def finish(self, box_id: str) -> None:
        """A move succeeded: the box and its move snapshot go from this node."""
        held = self.moving.pop(box_id, None)
        await self.remove_box(await self.box(box_id), True)
        if held is not None:
            with contextlib.suppress(SandlotError):
                await (await AsyncSnapshot.get(held["snapshot"], home=self.home)).remove()


async def start_boxes(
    snap: AsyncSnapshot, n: int, name: str | None, box_id: str | None, labels: Mapping[str, str]
) -> builtins.list[AsyncBox]:
    """Boxes from a snapshot of this home: a moved box under its own id and name, or
    ``n`` new ones (a fork's children)."""
    if box_id is not None:
        if name is None:
            raise InvalidArgument("a moved box keeps its name; give it")
        return [
            await restore_moved_box_async(
                snap, box_id=box_id, name=name, labels=dict(labels), home=snap.runtime.home
            )
        ]
    return await snap.start(n, name=name, labels=dict(labels))


def prefixed(name: str) -> str:
    """A child's own name under a fork's prefix: ``snap.start`` takes one box's name as
    exact, and the children of one fork on several nodes must not share one."""
    return f"{name}-{secrets.token_hex(3)}"


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
