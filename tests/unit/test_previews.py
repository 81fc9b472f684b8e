"""Preview URLs (``core/previews.py``) and their commands: a token is signed by the home
and names a row of the store, so revoking its key, revoking it, or removing its box
ends it for every process of the home at once; forged, foreign, expired and old-form
tokens are refused with the reason."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandlot.api import access as api
from sandlot.core import previews
from sandlot.core.access import create_key, revoke_key
from sandlot.core.store import MIGRATIONS, BoxStore
from sandlot.errors import Forbidden, InvalidArgument, NotFound

from tests.support.cli import in_process


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


@pytest.fixture
def store(home: Path) -> Iterator[BoxStore]:
    s = BoxStore(home / "sandlot.db")
    yield s
    s.close()


def raw_write(home: Path, sql: str, *args: Any) -> None:
    """A write by another process, under the store's API."""
    with contextlib.closing(sqlite3.connect(home / "sandlot.db")) as db, db:
        db.execute(sql, args)


def make(store: BoxStore, home: Path, box: str = "b1", port: int = 8080, ttl: float = 60,
         key: Any = None) -> tuple[previews.Preview, str]:  # fmt: skip
    who = {"key_id": key.id, "key_name": key.name, "namespace": key.namespace} if key else {}
    return previews.make_preview(store, home, box, port, ttl, **who)


def test_a_token_is_checked_against_its_signature_and_its_row(store: BoxStore, home: Path) -> None:
    p, token = make(store, home)
    assert p.id.startswith("pv-") and p.live() and p.expires_at >= time.time() + 59
    assert previews.check_token(store, home, token) == p
    assert previews.token_target(home, token) == (p.id, "b1", 8080)
    pid, box, port, expires, sig = token.split(".")
    forged = {
        f"{pid}.b2.{port}.{expires}.{sig}": "signature",  # another box
        f"{pid}.{box}.8081.{expires}.{sig}": "signature",  # another port
        f"{pid}.{box}.{port}.{int(expires) + 3600}.{sig}": "signature",  # a later expiry
        f"{pid}.{box}.{port}.{expires}.{sig[:-2]}AA": "signature",
        f"{box}.{port}.{expires}.{sig}": "older sandlot",  # the old form: no row, not revocable
        "garbage": "malformed",
        f"pv-zz.{box}.{port}.{expires}.{sig}": "malformed",
    }
    for bad, why in forged.items():
        with pytest.raises(Forbidden, match=why):
            previews.check_token(store, home, bad)
    # a token signed by another home is refused by this one
    other = home.parent / "other"
    other.mkdir()
    with contextlib.closing(BoxStore(other / "sandlot.db")) as theirs:
        _, foreign = make(theirs, other)
    with pytest.raises(Forbidden, match="signature"):
        previews.check_token(store, home, foreign)
    # a signed token whose row is not in this store (a copied secret, a wiped store)
    previews.end_rows(store, "test", time.time(), preview_id=p.id)
    raw_write(home, "DELETE FROM previews")  # the row gone, as after a wipe
    with pytest.raises(Forbidden, match="unknown to this home"):
        previews.check_token(store, home, token)


def test_expiry(store: BoxStore, home: Path) -> None:
    _, token = make(store, home, ttl=0.5)
    previews.check_token(store, home, token)
    time.sleep(1.6)  # the token's expiry is a whole second, rounded up
    with pytest.raises(Forbidden, match="expired"):
        previews.check_token(store, home, token)
    assert previews.list_previews(store) == []
    assert len(previews.list_previews(store, live=False)) == 1
    for ttl in (0, -1, previews.MAX_TTL + 1, True, "60"):
        with pytest.raises(InvalidArgument, match="ttl"):
            make(store, home, ttl=ttl)
    for port in (0, 65536, True, "80"):
        with pytest.raises(InvalidArgument, match="port"):
            make(store, home, port=port)


def test_revoking_the_key_ends_its_previews_in_every_process(store: BoxStore, home: Path) -> None:
    key, _ = create_key(store, "ci", namespace="team-a")
    other, _ = create_key(store, "cd", namespace="team-a")
    mine = [make(store, home, port=8080 + i, key=key) for i in range(3)]
    theirs = make(store, home, key=other)
    expired = make(store, home, ttl=0.2, key=key)
    time.sleep(1.3)
    with contextlib.closing(BoxStore(home / "sandlot.db")) as elsewhere:  # another server of the home
        previews.check_token(elsewhere, home, mine[0][1])
        gone = revoke_key(store, "ci")
        for _, token in mine:
            with pytest.raises(Forbidden, match="API key was revoked"):
                previews.check_token(elsewhere, home, token)
        previews.check_token(elsewhere, home, theirs[1])  # another key's preview lives on
    assert previews.ended_with_key(store, key.id, gone.revoked_at or 0) == 3  # not the expired one
    assert revoke_key(store, "ci").revoked_at == gone.revoked_at  # again: nothing more ends
    assert previews.ended_with_key(store, key.id, gone.revoked_at or 0) == 3
    listed = {p.id: p for p in previews.list_previews(store, key_id=key.id, live=False)}
    assert listed[expired[0].id].ended_at is None and not listed[expired[0].id].live()
    assert all(listed[p.id].ended_why == "its API key was revoked" for p, _ in mine)


def test_a_revocation_that_did_not_reach_the_previews_still_ends_them(store: BoxStore, home: Path) -> None:
    """The check joins the key's row: a key revoked by a store write alone (an older
    sandlot, a crash between two writes) ends its previews all the same."""
    key, _ = create_key(store, "ci")
    _, token = make(store, home, key=key)
    raw_write(home, "UPDATE keys SET revoked_at = ? WHERE id = ?", time.time(), key.id)
    with pytest.raises(Forbidden, match="API key was revoked"):
        previews.check_token(store, home, token)


def test_ending_previews_one_by_one_by_box_and_by_namespace(store: BoxStore, home: Path) -> None:
    a, _ = create_key(store, "a", namespace="ns-a")
    b, _ = create_key(store, "b", namespace="ns-b")
    one, t1 = make(store, home, "b1", key=a)
    two, t2 = make(store, home, "b1", 9000, key=a)
    three, t3 = make(store, home, "b2", key=b)
    four, t4 = make(store, home, "b3", key=b)
    assert [p.id for p in previews.list_previews(store, namespace="ns-a")] == [one.id, two.id]
    assert [p.id for p in previews.list_previews(store, box_id="b1", namespace="ns-b")] == []
    assert previews.end_previews(store, "revoked", preview_id=one.id) == 1
    assert previews.end_previews(store, "revoked", preview_id=one.id) == 0  # already ended
    with pytest.raises(Forbidden, match=r"ended at .*: revoked"):
        previews.check_token(store, home, t1)
    previews.check_token(store, home, t2)
    store.delete("b1")  # the box's removal ends the previews of it, in its transaction
    with pytest.raises(Forbidden, match="its box was removed"):
        previews.check_token(store, home, t2)
    assert previews.end_previews(store, "namespace closed", namespace="ns-b") == 2
    for token in (t3, t4):
        with pytest.raises(Forbidden, match="namespace closed"):
            previews.check_token(store, home, token)
    with pytest.raises(InvalidArgument, match="say which"):
        previews.end_previews(store, "all")
    with pytest.raises(InvalidArgument, match="preview id"):
        previews.end_previews(store, "x", preview_id="b1")
    with pytest.raises(NotFound):
        previews.end_previews(store, "x", preview_id="pv-000000000000")
    assert {p.id: p.ended_why for p in previews.list_previews(store, live=False)} == {
        one.id: "revoked", two.id: "its box was removed", three.id: "namespace closed",
        four.id: "namespace closed",
    }  # fmt: skip


def test_rows_past_a_week_are_pruned(store: BoxStore, home: Path) -> None:
    old, _ = make(store, home)
    previews.end_rows(store, "revoked", time.time() - previews.KEEP_ENDED - 10, preview_id=old.id)
    make(store, home)
    assert old.id not in {p.id for p in previews.list_previews(store, live=False)}


def test_a_store_of_the_last_schema_gains_the_table(tmp_path: Path) -> None:
    path = tmp_path / "sandlot.db"
    db = sqlite3.connect(path)
    for step in MIGRATIONS[:5]:
        db.executescript(step) if isinstance(step, str) else step(db)
    db.execute("PRAGMA user_version=5")
    db.commit()
    db.close()
    with contextlib.closing(BoxStore(path)) as store:
        assert previews.list_previews(store) == []
        previews.make_preview(store, tmp_path, "b1", 80, 60)
        assert len(previews.list_previews(store)) == 1


def test_the_commands(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDLOT_HOME", str(home))
    cli = in_process()

    cli("keys", "create", "--name", "ci", "--namespace", "team-a")
    key = api.list_keys()[0]
    made = [api.make_preview("b1", 8000 + i, 600, key_id=key.id, key_name=key.name, namespace=key.namespace)
            for i in range(3)]  # fmt: skip
    mine = api.make_preview("b2", 80, 600)  # a server without keys
    listed = json.loads(cli("previews", "ls", "--json").stdout)
    assert [p["id"] for p in listed] == [p.id for p, _ in made] + [mine[0].id]
    assert [p["id"] for p in json.loads(cli("previews", "ls", "--key", "ci", "--json").stdout)] == [
        p.id for p, _ in made
    ]
    table = cli("previews", "ls", "--box", "b1").stdout
    assert "NAMESPACE" in table and "team-a" in table and made[0][0].id in table
    assert cli("previews", "revoke", made[0][0].id).stdout.strip() == "1"
    cli("previews", "revoke", "pv-000000000000", code=125)
    cli("previews", "revoke", code=125)  # which ones?
    cli("previews", "ls", "--key", "nope", code=125)
    r = cli("keys", "revoke", "ci")
    assert r.stdout.strip() == "ci" and "2 preview URLs ended with it" in r.stderr
    with pytest.raises(Forbidden, match="API key was revoked"):
        api.check_preview(made[1][1])
    assert [p["id"] for p in json.loads(cli("previews", "ls", "--json").stdout)] == [mine[0].id]
    ended = json.loads(cli("previews", "ls", "--all", "--json").stdout)
    assert [(p["ended_why"], p["live"]) for p in ended] == [
        ("revoked", False), ("its API key was revoked", False), ("its API key was revoked", False),
        (None, True),
    ]  # fmt: skip
    assert cli("previews", "revoke", "--box", "b2").stdout.strip() == "1"
