"""API keys and the audit trail of ``sandlot serve`` (``core/access.py``), their facade
and their commands: keys are stored only as salted scrypt hashes, a verification is
cached but a revocation by another process counts within a second, and audit
entries are written in batches off the caller's thread and pruned."""

from __future__ import annotations

import asyncio
import doctest
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot.api import access as api
from sandlot.cli import access as cli_access
from sandlot.core import access
from sandlot.core.access import (
    ApiKey,
    AuditEntry,
    AuditLog,
    KeyVerifier,
    Quotas,
    create_key,
    list_keys,
    read_audit,
    revoke_key,
)
from sandlot.core.store import MIGRATIONS, SCHEMA_VERSION, BoxStore
from sandlot.errors import InvalidArgument, NotFound, Unauthorized

from tests.support.cli import in_process

KEY_FORMAT = re.compile(r"sk-sl-[0-9a-f]{8}-[A-Za-z0-9_-]{43}")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BoxStore]:
    s = BoxStore(tmp_path / "sandlot.db")
    yield s
    s.close()


def other_secret(key: str) -> str:
    """The same key id with another secret of the right shape."""
    head, secret = key[:15], key[15:]
    return head + ("A" if secret[0] != "A" else "B") + secret[1:]


# -- keys ------------------------------------------------------------------------------------


def test_create_list_and_revoke(store: BoxStore) -> None:
    rec, key = create_key(store, "ci", namespace="team-a", quotas=Quotas(boxes=3, memory_mib=4096))
    assert KEY_FORMAT.fullmatch(key) and key.startswith(f"sk-sl-{rec.id}-")
    assert (rec.name, rec.namespace, rec.admin, rec.revoked) == ("ci", "team-a", False, False)
    admin, _ = create_key(store, "root.key_1", admin=True)
    assert [k.name for k in list_keys(store)] == ["ci", "root.key_1"]
    assert list_keys(store)[0] == rec  # everything but the secret round-trips
    assert list_keys(store)[1].admin and list_keys(store)[1].quotas == Quotas()
    assert rec.to_json() == {"id": rec.id, "name": "ci", "namespace": "team-a", "admin": False,
                             "quotas": {"boxes": 3, "memory_mib": 4096, "disk_gb": None, "volumes": None,
                                        "volume_gb": None, "awake": None},
                             "created_at": rec.created_at, "last_used_at": None,
                             "revoked_at": None, "lease": None}  # fmt: skip

    gone = revoke_key(store, "ci")
    assert gone.revoked and gone.revoked_at is not None
    assert revoke_key(store, admin.id).revoked  # by id too
    assert revoke_key(store, "ci").revoked_at == gone.revoked_at  # again: nothing changes
    listed = {k.name: k for k in list_keys(store)}
    assert listed["ci"].revoked and listed["root.key_1"].revoked  # revoked ones are listed, marked
    with pytest.raises(NotFound, match="no API key 'nope'"):
        revoke_key(store, "nope")


def test_the_store_keeps_a_hash_never_the_key(tmp_path: Path) -> None:
    store = BoxStore(tmp_path / "sandlot.db")
    keys = [create_key(store, f"k{i}")[1] for i in range(3)]
    row = access.key_row(store, keys[0][6:14])
    assert row is not None and len(row["salt"]) == 16 and len(row["hash"]) == 32
    store.close()
    data = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("sandlot.db"))
    assert row["hash"] in data
    for key in keys:
        secret = key[15:]
        assert key.encode() not in data and secret.encode() not in data


def test_a_duplicate_name_is_refused_naming_it(store: BoxStore) -> None:
    create_key(store, "ci")
    with pytest.raises(InvalidArgument, match="'ci' already exists"):
        create_key(store, "ci", admin=True)
    assert len(list_keys(store)) == 1


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "ü", "a/b", "a:b", None, 3])
def test_bad_names_and_namespaces_are_refused(store: BoxStore, name: Any) -> None:
    with pytest.raises(InvalidArgument, match="invalid key name"):
        create_key(store, name)
    if name is not None:  # None is no namespace
        with pytest.raises(InvalidArgument, match="invalid namespace"):
            create_key(store, "ok", namespace=name)
    assert list_keys(store) == []
    create_key(store, "x" * 64, namespace="A-z_0.9")  # the longest name, every kind of character


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "3"])
def test_quotas_are_positive_integers_or_none(value: Any) -> None:
    with pytest.raises(InvalidArgument, match="positive integer"):
        Quotas(boxes=value)
    with pytest.raises(InvalidArgument, match="quota volume_gb must be a positive integer"):
        Quotas(volume_gb=value)
    with pytest.raises(InvalidArgument):
        api.create_key("q", max_disk_gb=value, home="/nonexistent/never/made")
    with pytest.raises(InvalidArgument):
        api.create_key("q", max_volumes=value, home="/nonexistent/never/made")
    full = Quotas(1, 2, 3, 4, 5)
    assert Quotas.from_json(full.to_json()) == full and Quotas.from_json({"boxes": 1}) == Quotas(boxes=1)


# -- verification ----------------------------------------------------------------------------


def test_verify_ok_malformed_wrong_and_unknown(store: BoxStore) -> None:
    rec, key = create_key(store, "ci", namespace="team-a")
    v = KeyVerifier(store)
    try:
        assert v.verify(key).id == rec.id
        assert v.verify(key).id == rec.id  # cached
        for bad in ["", "sk-sl-", "Bearer " + key, key + "!", key[:-5], key.replace("sk-sl-", "sk-xx-"),
                    key.upper(), "sk-sl-1234567-" + key[15:], "x" * 10_000]:  # fmt: skip
            with pytest.raises(Unauthorized, match="malformed API key") as e:
                v.verify(bad)
            assert e.value.status == 401 and e.value.code == "unauthorized"
        wrong = other_secret(key)
        for _ in range(2):  # a failure is never remembered as a success, before or after one
            with pytest.raises(Unauthorized, match="invalid API key"):
                v.verify(wrong)
        unknown = "sk-sl-00000000-" + key[15:]
        with pytest.raises(Unauthorized, match="invalid API key"):
            v.verify(unknown)
        assert v.verify(key).id == rec.id
        other, other_key = create_key(store, "other")
        swapped = other_key[:15] + key[15:]  # a valid secret under another key's id
        with pytest.raises(Unauthorized, match="invalid API key"):
            v.verify(swapped)
        assert v.verify(other_key).id == other.id
    finally:
        v.close()


def test_a_revocation_from_another_store_counts_within_a_second(tmp_path: Path) -> None:
    mine, theirs = BoxStore(tmp_path / "sandlot.db"), BoxStore(tmp_path / "sandlot.db")
    _, key = create_key(mine, "ci")
    v = KeyVerifier(mine)
    for _ in range(3):
        v.verify(key)  # cached now
    revoke_key(theirs, "ci")
    revoked_at = time.monotonic()
    while True:
        try:
            v.verify(key)
        except Unauthorized as exc:
            assert str(exc) == "API key revoked"
            break
        time.sleep(0.01)
    # a row a second old is read again (row_ttl): a second, and a busy host's slack, where a
    # key kept for its touch_every would answer for a minute
    assert time.monotonic() - revoked_at < 3
    with pytest.raises(Unauthorized, match="API key revoked"):
        v.verify(key)  # for good
    assert v.cached(key) is None
    v.close()
    mine.close()
    theirs.close()


def test_a_key_made_by_another_store_is_accepted(tmp_path: Path) -> None:
    mine, theirs = BoxStore(tmp_path / "sandlot.db"), BoxStore(tmp_path / "sandlot.db")
    v = KeyVerifier(mine)
    _, key = create_key(theirs, "late")
    assert v.verify(key).name == "late"
    v.close()
    mine.close()
    theirs.close()


def test_last_used_is_written_at_most_once_a_minute(store: BoxStore) -> None:
    _, key = create_key(store, "ci")
    v = KeyVerifier(store)
    before = time.time()
    v.verify(key)
    v.verify(key)
    v.close()  # waits for the write
    (rec,) = list_keys(store)
    assert rec.last_used_at is not None and rec.last_used_at >= before
    v2 = KeyVerifier(store)  # another process, say: it sees the last use, a few seconds old
    v2.verify(key)
    v2.close()
    assert list_keys(store)[0].last_used_at == rec.last_used_at
    v3 = KeyVerifier(store, touch_every=0.0)
    assert v3.verify(key).name == "ci"
    v3.close()
    assert (list_keys(store)[0].last_used_at or 0) > rec.last_used_at


def test_cached_never_does_io_and_verify_async_falls_back_to_a_thread(store: BoxStore) -> None:
    rec, key = create_key(store, "ci")
    # rows fresh for the whole test: a loaded host can take the default second between a
    # row's read and the look at the cache (a scrypt between), which is not this test's point
    v = KeyVerifier(store, row_ttl=3600)
    assert v.cached(key) is None  # never verified: the caller must verify
    assert v.cached("nonsense") is None
    assert asyncio.run(v.verify_async(key)).id == rec.id
    hit = v.cached(key)
    assert hit is not None and hit.id == rec.id
    assert v.cached(other_secret(key)) is None
    with pytest.raises(Unauthorized, match="invalid API key"):
        asyncio.run(v.verify_async(other_secret(key)))
    v.invalidate()
    assert v.cached(key) is None  # its row must be read again
    assert asyncio.run(v.verify_async(key)).id == rec.id
    v.close()


def test_verify_is_thread_safe(store: BoxStore) -> None:
    keys = [create_key(store, f"k{i}") for i in range(3)]
    v = KeyVerifier(store, row_ttl=0.001)  # rows read again all the time
    errors: list[BaseException] = []

    def work(i: int) -> None:
        rec, key = keys[i % 3]
        try:
            for n in range(100):
                assert v.verify(key).id == rec.id
                if n % 25 == 0:
                    with pytest.raises(Unauthorized):
                        v.verify(other_secret(key))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    v.close()
    assert errors == []


# -- the audit trail ---------------------------------------------------------------------------


def entry(action: str = "POST /v1/boxes", **kw: Any) -> AuditEntry:
    return AuditEntry(action=action, status=kw.pop("status", 200), **kw)


def test_entries_are_written_in_batches_off_the_callers_thread(
    store: BoxStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, started = threading.Event(), threading.Event()
    real = access.insert_audit
    calls: list[int] = []

    def slow_insert(db: BoxStore, rows: list[dict[str, Any]]) -> None:
        calls.append(len(rows))
        started.set()
        gate.wait(10)  # the disk is slow
        real(db, rows)

    monkeypatch.setattr(access, "insert_audit", slow_insert)
    log = AuditLog(store)
    log.record(entry("first"))
    assert started.wait(5)
    for i in range(99):
        log.record(entry(f"e{i}", box="b1"))  # returns while the disk is busy
    assert not log.flush(timeout=0.05)  # not written yet
    gate.set()
    assert log.flush()
    assert calls == [1, 99] and (log.batches, log.written, log.dropped) == (2, 100, 0)
    got = read_audit(store, limit=1000)
    assert [e.action for e in got] == ["first", *(f"e{i}" for i in range(99))]  # in order
    log.close()
    log.record(entry("late"))  # after close: dropped, counted
    assert log.dropped == 1 and log.flush()
    assert len(read_audit(store)) == 100


def test_an_entry_round_trips_and_its_detail_is_bounded(store: BoxStore) -> None:
    e = AuditEntry(action="POST /v1/boxes/{box}/exec", status=200, key_id="abcd0123", key_name="ci",
                   namespace="team-a", box="b1", error=None, duration=0.25,
                   detail={"argv": ["echo", "x" * 5000], "exit_code": 0, "stdin": "secret",
                           "stdout": "out"})  # fmt: skip
    with AuditLog(store) as log:
        log.record(e)
        log.record(entry(status=404, error="box_not_found"))
    first, second = read_audit(store)
    assert first.id is not None and second.id == first.id + 1
    assert (first.action, first.key_id, first.key_name, first.namespace, first.box, first.status,
            first.duration, first.at) == (e.action, "abcd0123", "ci", "team-a", "b1", 200, 0.25,
                                          e.at)  # fmt: skip
    assert first.detail["exit_code"] == 0 and "stdin" not in first.detail and "stdout" not in first.detail
    assert first.detail["argv"][0] == "echo" and len(first.detail["argv"][1]) < 1100
    assert (second.status, second.error, second.detail) == (404, "box_not_found", {})
    assert json.loads(json.dumps(first.to_json()))["detail"] == first.detail


def test_pruning_by_age(store: BoxStore) -> None:
    old = time.time() - 31 * 86400
    with AuditLog(store, max_age_days=30) as log:
        for i in range(3):
            log.record(entry(f"old{i}", at=old))
        log.record(entry("new"))
    assert [e.action for e in read_audit(store)] == ["new"]


def test_pruning_by_rows_at_most_once_an_interval(store: BoxStore) -> None:
    with AuditLog(store, max_rows=10) as log:  # prunes after its first write, then once a minute
        for i in range(5):
            log.record(entry(f"a{i}"))
        assert log.flush()
        for i in range(20):
            log.record(entry(f"b{i}"))
        assert log.flush()
        assert len(read_audit(store)) == 25  # not pruned again yet
        assert log.prune() == 15
    assert [e.action for e in read_audit(store)] == [f"b{i}" for i in range(10, 20)]
    with AuditLog(store, max_rows=4, prune_interval=0) as log:
        for i in range(6):
            log.record(entry(f"c{i}"))
    assert [e.action for e in read_audit(store)] == [f"c{i}" for i in range(2, 6)]


def test_read_audit_filters(store: BoxStore) -> None:
    t = time.time()
    with AuditLog(store) as log:
        log.record(entry("a", box="b1", key_id="11111111", key_name="ci", at=t - 7200))
        log.record(entry("b", box="b2", key_id="11111111", key_name="ci", at=t - 60))
        log.record(entry("c", box="b1", key_id="22222222", key_name="ops", at=t - 30))
        log.record(entry("d", box="b10", at=t))

    def actions(**kw: Any) -> list[str]:
        return [e.action for e in read_audit(store, **kw)]

    assert actions() == ["a", "b", "c", "d"]  # newest last
    assert actions(box="b1") == ["a", "c"]  # exactly, not b10
    assert actions(key="ci") == ["a", "b"] and actions(key="22222222") == ["c"]
    assert actions(since=t - 3600) == ["b", "c", "d"]
    assert actions(limit=2) == ["c", "d"]  # the newest two
    assert actions(box="b1", key="ci") == ["a"] and actions(box="nope") == []
    with pytest.raises(InvalidArgument):
        read_audit(store, limit=0)


# -- the store migration, the facade, the commands ---------------------------------------------


def test_a_version_3_store_gets_the_keys_and_audit_tables(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "sandlot.db")
    for step in MIGRATIONS[:3]:
        db.executescript(step) if isinstance(step, str) else step(db)
    db.execute("PRAGMA user_version=3")
    db.execute("INSERT INTO boxes (id, name, state, options, created_at, updated_at)"
               " VALUES ('b1', 'dev', 'stopped', '{}', 1, 1)")  # fmt: skip
    db.commit()
    db.close()
    assert SCHEMA_VERSION >= 4  # the version that brought them
    store = BoxStore(tmp_path / "sandlot.db")
    assert store.get("dev").state == "stopped"
    create_key(store, "ci")
    with AuditLog(store) as log:
        log.record(entry())
    assert len(list_keys(store)) == len(read_audit(store)) == 1
    store.close()


def test_the_facade_and_its_doctest(tmp_path: Path) -> None:
    home = tmp_path / "home"
    rec, key = api.create_key("ci", namespace="ns", admin=True, max_boxes=2, max_memory_mib=512,
                              max_disk_gb=5, home=home)  # fmt: skip
    assert rec.quotas == Quotas(2, 512, 5) and rec.admin
    assert isinstance(rec, ApiKey) and api.list_keys(home) == [rec]
    v = api.key_verifier(home)
    assert v.verify(key).id == rec.id
    v.close()
    with api.audit_writer(home, max_rows=5) as log:
        assert isinstance(log, AuditLog)
        log.record(api.AuditEntry(action="exec", status=200, key_name="ci", box="b1",
                                  detail={"argv": ["true"], "exit_code": 0}))  # fmt: skip
    assert [e.detail for e in api.audit_log(box="b1", home=home)] == [{"argv": ["true"], "exit_code": 0}]
    assert api.revoke_key("ci", home).revoked
    result = doctest.testmod(api)
    assert result.attempted > 5 and result.failed == 0


def test_parse_since() -> None:
    now = 1_700_000_000.0
    assert cli_access.parse_since("1h", now) == now - 3600
    assert cli_access.parse_since("30m", now) == now - 1800
    assert cli_access.parse_since("2d", now) == now - 2 * 86400
    assert cli_access.parse_since("90s", now) == now - 90
    assert cli_access.parse_since("2023-11-14T22:13:20Z") == now
    assert cli_access.parse_since("2023-11-14T23:13:20+01:00") == now
    with pytest.raises(ValueError, match="--since"):
        cli_access.parse_since("yesterday")


def test_the_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("SANDLOT_HOME", str(home))
    cli = in_process()

    r = cli("keys", "create", "--name", "ci", "--namespace", "team-a", "--max-boxes", "3",
            "--max-memory-mib", "4096")  # fmt: skip
    (key,) = r.stdout.splitlines()
    assert KEY_FORMAT.fullmatch(key) and "only this once" in r.stderr
    cli("keys", "create", "--name", "root", "--admin", "--max-disk-gb", "10")
    cli("keys", "create", "--name", "ci", code=125)  # taken
    cli("keys", "create", "--name", "bad name", code=125)
    cli("keys", "create", "--name", "x", "--max-boxes", "0", code=2)
    v = api.key_verifier(home)
    assert v.verify(key).namespace == "team-a"
    v.close()

    listed = json.loads(cli("keys", "ls", "--json").stdout)
    assert [(k["name"], k["admin"], k["quotas"]["boxes"]) for k in listed] == [
        ("ci", False, 3),
        ("root", True, None),
    ]
    table = cli("keys", "ls").stdout
    assert "NAMESPACE" in table and "team-a" in table and "boxes=3" in table and "disk=10GB" in table
    assert cli("keys", "revoke", "ci").stdout.strip() == "ci"
    cli("keys", "revoke", "nope", code=125)
    listed = json.loads(cli("keys", "ls", "--json").stdout)
    assert listed[0]["revoked_at"] is not None and listed[1]["revoked_at"] is None

    with api.audit_writer(home) as log:
        log.record(entry("POST /v1/boxes/{box}/exec", box="b1", key_name="root", duration=0.012,
                         detail={"argv": ["echo", "[bold]hi there"], "exit_code": 3}))  # fmt: skip
        log.record(entry("DELETE /v1/boxes/{box}", box="b2", key_name="ci", status=404, error="box_not_found",
                         at=time.time() - 7200))  # fmt: skip
    got = json.loads(cli("audit", "--json").stdout)
    assert [e["box"] for e in got] == ["b2", "b1"]
    assert [e["box"] for e in json.loads(cli("audit", "--json", "--since", "1h").stdout)] == ["b1"]
    assert [e["box"] for e in json.loads(cli("audit", "--json", "--key", "ci").stdout)] == ["b2"]
    assert [e["box"] for e in json.loads(cli("audit", "--json", "--box", "b1").stdout)] == ["b1"]
    assert [e["box"] for e in json.loads(cli("audit", "--json", "--limit", "1").stdout)] == ["b1"]
    table = cli("audit").stdout
    assert "echo '[bold]hi there' -> 3" in table and "404 box_not_found" in table
    cli("audit", "--since", "yesterday", code=2)
    cli("audit", "--limit", "0", code=2)


def test_the_sandlot_command_has_them(tmp_path: Path) -> None:
    env = {**os.environ, "SANDLOT_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "sandlot.cli", "keys", "create", "--name", "ci"],
                       capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert KEY_FORMAT.fullmatch(r.stdout.strip())
    r = subprocess.run([sys.executable, "-m", "sandlot.cli", "audit", "--json"], capture_output=True,
                       text=True, env=env, timeout=60)  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
