"""Collecting the storage tier: deleting from the bucket what no home and no box needs.

Many homes share a bucket, and none knows what the others hold, so each says it:

- **declarations** (``homes/<home id>.json``): the saved states a home holds that are in
  the tier, and the boxes it has. A home writes its own after every push, before a
  pull takes a box (so that what it is about to hold is never collected), and when it
  collects.
- **box documents** (``boxes/<id>.json``) keep their suspended state and their disk's
  files while the box may still be pulled: while its lease is let go, while the home
  that holds it declares it, or while that home has declared nothing (a home older
  than collections). A box its holder no longer has (removed there) goes, lease too.

A collection deletes every state manifest no declaration and no box document names,
every disk-file manifest no box document names, and every chunk none of the rest lists.

**It never runs beside a push.** A push holds a lock object (``locks/push-*``), a
collection holds ``locks/gc.json``; each writes its own, then looks for the other's, and
the one that finds the other backs off (S3 lists and reads what was written, at once), so
a chunk a push found in the tier, or counted on finding, is never collected under it.
A lock is rewritten while its work goes on; one older than ``STALE`` seconds, or whose
process is gone from this host, is taken as dead.

**Homes forget what was collected.** A home remembers which chunks the tier holds (so
that it sends each once); a collection may delete one it remembers (listed only by a
state the home has since removed). So each collection first counts itself
(``gc/generation.json``) and writes what it will delete (``gc/<n>.json``); before a push,
a home reads the records of the collections since its last look and forgets what they
deleted. A home too far behind (the oldest records are dropped, ``RECORDS_KEPT``), or
that finds a record missing, forgets every chunk it knew of, and asks the tier again
for each.

A collection killed at any point leaves nothing half-done that matters: what it
recorded, the next one deletes (it is still unlisted); what it did not record, it did
not delete.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import pids
from ..config import atomic_write
from ..crashpoints import crash_point
from ..errors import CorruptSnapshot, TierError
from . import boxdoc, packs
from .manifest import Manifest
from .packs import Place
from .tier import Conflict, Tier

STALE = 600.0  # seconds after which a lock not rewritten is its dead holder's
REFRESH = STALE / 4  # a lock is rewritten this often while its work goes on
WAIT = 120.0  # seconds a push waits for a collection (and a collection for pushes) by default
RECORDS_KEPT = 50  # the records of the newest collections: a home further behind forgets all
SEEN_FILE = "tier-generation"  # in the chunk store: the last collection this home caught up with


@dataclass(frozen=True, slots=True)
class TierGcReport:
    """What a collection of the tier deleted."""

    states: int = 0  # state manifests
    files: int = 0  # disk-file manifests
    boxes: int = 0  # box documents (and their leases) of boxes no home has
    chunks: int = 0
    bytes_freed: int = 0  # of the chunks (and packs)
    generation: int = 0  # the collection's number
    packs: int = 0  # packs none of whose chunks is listed any more
    dead_bytes: int = 0  # kept in packs some of whose chunks are still listed (too few to rewrite them)
    repacked: int = 0  # packs written again without their dead chunks (``packs.rewrite``)


class Lock:
    """A lock object of the tier, rewritten while its holder works (``touch``)."""

    def __init__(self, tier: Tier, name: str, me: str) -> None:
        self.tier, self.key, self.me = tier, tier.key("locks", name), me
        self.at = 0.0

    def body(self) -> bytes:
        pid, start = pids.me()
        return json.dumps({"home": self.me, "host": socket.gethostname(), "pid": pid, "start": start,
                           "at": time.time()}).encode()  # fmt: skip

    def write(self, *, exclusive: bool = False, if_match: str | None = None) -> None:
        self.tier.put(self.key, self.body(), if_none_match=exclusive, if_match=if_match)
        self.at = time.monotonic()

    def touch(self) -> None:
        if time.monotonic() - self.at >= REFRESH:
            self.write()

    def drop(self) -> None:
        with contextlib.suppress(TierError):
            self.tier.delete(self.key)


def dead(lock: dict[str, Any]) -> bool:
    """Whether a lock's holder is gone: not rewritten for ``STALE`` seconds, or its process
    is no more on this host."""
    if time.time() - float(lock.get("at", 0)) > STALE:
        return True
    if lock.get("host") == socket.gethostname():
        return not pids.alive(lock.get("pid"), lock.get("start"))
    return False


def read_lock(tier: Tier, name: str) -> tuple[dict[str, Any], str] | None:
    found = tier.get(tier.key("locks", name))
    if found is None:
        return None
    try:
        lock = json.loads(found[0])
        if not isinstance(lock, dict):
            raise ValueError("not an object")
    except ValueError:
        return {"at": 0.0}, found[1]  # unreadable: nobody's
    return lock, found[1]


def live_pushes(tier: Tier) -> list[dict[str, Any]]:
    """The push locks of live holders; those of dead ones are deleted (a killed push
    leaves its lock behind)."""
    out, gone = [], []
    for name in tier.names("locks"):
        if name.startswith("push-"):
            found = read_lock(tier, name)
            if found is not None and not dead(found[0]):
                out.append(found[0])
            elif found is not None:
                gone.append(tier.key("locks", name))
    tier.delete_many(gone)
    return out


def collecting_now(tier: Tier) -> dict[str, Any] | None:
    found = read_lock(tier, "gc.json")
    return found[0] if found is not None and not dead(found[0]) else None


def busy(what: str, holder: dict[str, Any]) -> TierError:
    return TierError(
        f"{what} of the storage tier by home {holder.get('home', '?')} (host {holder.get('host', '?')}) is "
        f"under way: try again once it ends (a lock not rewritten for {STALE:.0f}s is taken as dead)"
    )


@contextlib.contextmanager
def pushing(tier: Tier, me: str, wait: float | None = None) -> Iterator[Lock]:
    """Hold a push lock (no collection runs meanwhile): its holder ``touch``es it as it
    goes. Waits ``wait`` seconds at most (``WAIT``) for a collection under way."""
    lock = Lock(tier, f"push-{me}-{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}.json", me)
    deadline = time.monotonic() + (WAIT if wait is None else wait)
    while True:
        lock.write()
        holder = collecting_now(tier)
        if holder is None:
            break
        lock.drop()
        if time.monotonic() >= deadline:
            raise busy("a collection", holder)
        time.sleep(1.0)
    try:
        yield lock
    finally:
        lock.drop()


@contextlib.contextmanager
def collection_lock(tier: Tier, me: str, wait: float) -> Iterator[Lock]:
    lock = Lock(tier, "gc.json", me)
    deadline = time.monotonic() + wait
    while True:
        try:
            lock.write(exclusive=True)
        except Conflict:
            found = read_lock(tier, "gc.json")
            if found is not None and not dead(found[0]):
                if time.monotonic() >= deadline:
                    raise busy("a collection", found[0]) from None
                time.sleep(1.0)
                continue
            with contextlib.suppress(Conflict):  # a dead holder's: taken over, unless another was first
                lock.write(if_match=found[1]) if found is not None else lock.write(exclusive=True)
                break
            continue
        break
    try:
        while pushes := live_pushes(tier):
            if time.monotonic() >= deadline:
                raise busy("a push", pushes[0])
            lock.touch()
            time.sleep(1.0)
        yield lock
    finally:
        lock.drop()


# -- what each home holds ------------------------------------------------------------------


def names_in(value: Any) -> set[str]:
    """A list of names, as a declaration or a record holds them (ValueError else: a string
    taken for one would be read as its letters)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("not a list of names")
    return set(value)


def declare(tier: Tier, me: str, states: Iterable[str], boxes: Iterable[str]) -> None:
    """Write this home's declaration: the states it holds that are in the tier, its boxes."""
    doc = {"home": me, "at": time.time(), "states": sorted(set(states)), "boxes": sorted(set(boxes))}
    tier.put(tier.key("homes", f"{me}.json"), json.dumps(doc).encode())


def declarations(tier: Tier) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in tier.names("homes"):
        found = tier.get(tier.key("homes", name))
        if found is None:
            continue
        try:
            doc = json.loads(found[0])
            out[str(doc["home"])] = {"states": names_in(doc["states"]), "boxes": names_in(doc["boxes"])}
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptSnapshot(f"the declaration {name} in the storage tier is malformed: {exc}") from None
    return out


# -- what collections deleted, and a home catching up ---------------------------------------------


def generation(tier: Tier) -> tuple[int, str | None]:
    found = tier.get(tier.key("gc", "generation.json"))
    if found is None:
        return 0, None
    try:
        return int(json.loads(found[0])["generation"]), found[1]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptSnapshot(f"the storage tier's gc/generation.json is malformed: {exc}") from None


@dataclass
class Forget:
    """What a home must forget it knew the tier held (``everything``: all of it), and the
    packs whose live chunks went to new packs (``moved``: where they are is in ``moved/``)."""

    everything: bool = False
    chunks: set[bytes] = field(default_factory=set)
    states: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)
    moved: set[str] = field(default_factory=set)


def catch_up(tier: Tier, root: Path, forget: Callable[[Forget], None]) -> None:
    """Forget what the collections since this home last looked deleted (``root``: the
    home's chunk store, which keeps the number of the last). Where a record is missing
    or unreadable (dropped as too old), or the count went back (another bucket, or one
    emptied), everything."""
    seen_file = root / SEEN_FILE
    try:
        seen = int(seen_file.read_text())
    except (OSError, ValueError):
        seen = 0
    now, _ = generation(tier)
    if now == seen:
        return
    todo = Forget(everything=now < seen or now - seen > RECORDS_KEPT)
    for n in range(seen + 1, now + 1):
        if todo.everything:
            break
        found = tier.get(tier.key("gc", f"{n}.json"))
        try:
            if found is None:
                raise ValueError("dropped")
            record = json.loads(found[0])
            todo.chunks |= {bytes.fromhex(h) for h in names_in(record["chunks"])}
            todo.states |= names_in(record["states"])
            todo.files |= names_in(record["files"])
            todo.moved |= names_in(record.get("repacked", []))
        except (ValueError, KeyError, TypeError):
            todo = Forget(everything=True)
    forget(todo)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(seen_file, str(now).encode())


# -- a collection -------------------------------------------------------------------------------


def collect(tier: Tier, me: str, declare_mine: Callable[[], None], *, wait: float = WAIT) -> TierGcReport:
    """One collection of the tier, under its lock (``declare_mine``: this home's own
    declaration, written first, so that it is current)."""
    with collection_lock(tier, me, wait) as lock:
        declare_mine()
        homes = declarations(tier)
        live_states: set[str] = set()
        for held in homes.values():
            live_states |= held["states"]
        live_files: set[str] = set()
        dead_boxes: list[str] = []
        for name in tier.names("boxes"):
            found = tier.get(tier.key("boxes", name))
            if found is None:
                continue
            doc = boxdoc.read(found[0], name)
            box_id = doc["box"]["id"]
            holder = tier.holder(box_id)
            if holder is not None and holder in homes and box_id not in homes[holder]["boxes"]:
                dead_boxes.append(box_id)  # removed where it was: nobody will pull it
                continue
            live_states.add(doc["snapshot"]["id"])
            live_files |= {str(f["file"]) for f in doc["disk"]}
        lock.touch()
        in_tier = tier.listing("chunks")  # chunks as objects of their own (older homes sent them so)
        packed = tier.listing("packs")
        states = set(tier.names("states"))
        files = set(tier.names("files"))
        live_chunks: set[str] = set()

        def listed(key: str) -> set[str]:
            found = tier.get(key)
            if found is None:
                return set()
            return {d.hex() for d in Manifest.decode(found[0], key).digests()}

        keys = [tier.key("states", s) for s in sorted(live_states & states)]
        keys += [tier.key("files", f) for f in sorted(live_files & files)]
        for digests in tier.each(listed, keys):
            live_chunks |= digests
        lock.touch()
        gone_states, gone_files = sorted(states - live_states), sorted(files - live_files)
        gone_chunks = sorted(set(in_tier) - live_chunks)
        # a pack goes once none of its chunks is listed; one whose header cannot be read stays
        entries = dict(tier.each(lambda name: (name, _entries(tier, name)), sorted(packed)))
        held = {n: None if e is None else {d.hex() for d, _, _ in e} for n, e in entries.items()}
        gone_packs = sorted(n for n, inside in held.items() if inside is not None
                            and not inside & live_chunks)  # fmt: skip
        gone_chunks += sorted({d for name in gone_packs for d in held[name] or ()} - set(gone_chunks))
        # one whose dead chunks are much of it is written again without them
        live = {bytes.fromhex(d) for d in live_chunks}
        worth = {bytes.fromhex(n): e for n, e in entries.items()
                 if e and n not in gone_packs and packs.worth_rewriting(e, live)}  # fmt: skip
        moved, written = packs.rewrite(tier, worth, live, _sound) if worth else ({}, 0)
        repacked = sorted(p.hex() for p in moved)
        lock.touch()
        if moved:
            _point_places_at_new_packs(tier, moved, states - set(gone_states),
                                       files - set(gone_files))  # fmt: skip
            lock.touch()
            crash_point("tiergc.repacked")
        dropped = {d for name in repacked for d in held[name] or ()} - live_chunks
        gone_chunks += sorted(dropped - set(gone_chunks))
        dead_bytes = sum(packed[name] * len(inside - live_chunks) // max(len(inside), 1)
                         for name, inside in held.items()
                         if inside and name not in gone_packs and name not in repacked)  # fmt: skip
        # places of states and files that go, and of any a killed push left without its manifest
        kept_states, kept_files = states - set(gone_states), files - set(gone_files)
        gone_places = [tier.key("places", "states", s) for s in tier.names("places/states")
                       if s not in kept_states]  # fmt: skip
        gone_places += [tier.key("places", "files", f) for f in tier.names("places/files")
                        if f not in kept_files]  # fmt: skip
        # its number first (one conditional write: of two collections that each took the
        # lock for a dead one's, one goes on), then its record: a home that finds the
        # number and not the record (a kill between) forgets everything, which is safe
        n, etag = generation(tier)
        body = json.dumps({"generation": n + 1}).encode()
        try:
            tier.put(tier.key("gc", "generation.json"), body, if_none_match=etag is None, if_match=etag)
        except Conflict:
            raise TierError("another collection of the storage tier began at once: try again") from None
        record = {"by": me, "at": time.time(), "chunks": gone_chunks, "states": gone_states,
                  "files": gone_files, "boxes": dead_boxes, "packs": gone_packs,
                  "repacked": repacked}  # fmt: skip
        tier.put(tier.key("gc", f"{n + 1}.json"), json.dumps(record).encode())
        crash_point("tiergc.recorded")
        # manifests before the chunks they list: a reader finds a state whole or not at all
        tier.delete_many([tier.key("boxes", f"{b}.json") for b in dead_boxes])
        tier.delete_many([tier.key("leases", f"{b}.json") for b in dead_boxes])
        tier.delete_many([tier.key("states", s) for s in gone_states])
        tier.delete_many([tier.key("files", f) for f in gone_files])
        tier.delete_many(gone_places)
        lock.touch()
        tier.delete_many([tier.key("chunks", c) for c in gone_chunks if c in in_tier])
        tier.delete_many([tier.key("packs", name) for name in gone_packs + repacked])
        crash_point("tiergc.deleted")
        if n + 1 > RECORDS_KEPT:  # the record that falls out of those kept, and its packs' moves
            _drop_record(tier, n + 1 - RECORDS_KEPT)
        return TierGcReport(
            states=len(gone_states), files=len(gone_files), boxes=len(dead_boxes), chunks=len(gone_chunks),
            bytes_freed=sum(in_tier.get(c, 0) for c in gone_chunks) + sum(packed[p] for p in gone_packs)
            + sum(packed[p] for p in repacked) - written,
            generation=n + 1, packs=len(gone_packs), dead_bytes=dead_bytes, repacked=len(repacked),
        )  # fmt: skip


def _entries(tier: Tier, name: str) -> list[tuple[bytes, int, int]] | None:
    """The chunks a pack holds, with their offsets and lengths; None where its header cannot
    be read (it stays)."""
    try:
        return packs.header(tier, name)
    except CorruptSnapshot:
        return None


def _sound(d: bytes, packed: bytes) -> bool:
    """Whether a chunk as kept (zstd) is the chunk its hash names."""
    from .chunks import digest, unpack

    try:
        return digest(unpack(packed)) == d
    except Exception:  # (a frame zstd refuses)
        return False


def _point_places_at_new_packs(
    tier: Tier, moved: dict[bytes, dict[bytes, Place]], states: set[str], files: set[str]
) -> None:
    """The places of each kept state and file that point into a pack written again point at
    the chunks' new packs (before the old packs are deleted: a home reads either)."""

    def one(key: str) -> None:
        found = tier.get(key)
        if found is None:
            return
        try:
            places = packs.decode_places(found[0], key)
        except CorruptSnapshot:  # damaged already (no reader can use it): left as it is
            return
        if not any(p.pack in moved for p in places.values()):
            return
        now = {d: moved[p.pack].get(d, p) if p.pack in moved else p for d, p in places.items()}
        tier.put(key, packs.encode_places(now))

    keys = [tier.key("places", "states", s) for s in sorted(states)]
    keys += [tier.key("places", "files", f) for f in sorted(files)]
    tier.each(one, keys)


def _drop_record(tier: Tier, n: int) -> None:
    """Delete collection ``n``'s record, and the ``moved/`` of the packs it wrote again: a
    home further behind than the records kept forgets all it knew of the tier anyway."""
    key = tier.key("gc", f"{n}.json")
    found = tier.get(key)
    if found is not None:
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            repacked = names_in(json.loads(found[0]).get("repacked", []))
            tier.delete_many([packs.moved_key(tier, bytes.fromhex(p)) for p in repacked])
    tier.delete(key)


__all__ = ["TierGcReport", "catch_up", "collect", "declare", "pushing"]
