"""A box from a root filesystem directory starts from that tree's automatic template,
as a box from an image does from the image's: its first boot is saved, the boxes after
it restore that state, a tree that changed boots again and its new template replaces
the older tree's. On the fake engine; tests/vm proves the same on real VMs (every
``Box(rootfs=...)`` of the VM tier after the first of its kind)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import sandlot

from tests.support.fake_engine import FakeEngine, fake_rootfs, register

register()


def origin(box: sandlot.Box) -> str | None:
    found: str | None = box.inspect()["origin"]
    return found


def automatic(home: Path) -> list[sandlot.Snapshot]:
    return [s for s in sandlot.list_snapshots(kind="template", home=home) if s.name is None]


def test_a_trees_first_boot_is_the_template_of_the_boxes_after_it(home: Path, tmp_path: Path) -> None:
    root = fake_rootfs(tmp_path)

    def box(**kw: object) -> sandlot.Box:
        return sandlot.Box(rootfs=root, engine="fake", home=home, **{"memory_mib": 256, **kw}).start()

    first = box()
    assert origin(first) is None  # booted
    [tmpl] = automatic(home)
    assert tmpl.box_name == first.name
    assert first.snapshots() == []  # sandlot's saved boot, not one of the box's own steps
    first.exec("remember", "k", "first's")
    saved_boot = home / "snapshots" / tmpl.id
    assert not FakeEngine(home).memory_shared(saved_boot)  # one box of a tree pays for no shared form
    second = box()
    assert origin(second) == tmpl.id  # restored, not booted
    # the second box gave the template the form boxes map copy-on-write, as an explicit one has
    assert FakeEngine(home).memory_shared(saved_boot)
    assert second.exec("recall", "k").stdout.strip() == ""  # the boot's state, not the first box's since
    assert origin(box(template=False)) is None  # asked to boot, it boots
    assert origin(box(memory_mib=512)) is None  # another shape: a template of its own
    assert len(automatic(home)) == 2

    # the tree changes: its boxes boot again, and the new template replaces the older
    # tree's (of the same shape) unless a box was started from that one
    (root / "etc" / "motd").write_text("changed\n")
    for b in sandlot.list(home=home):
        b.remove(force=True)
    third = box()
    assert origin(third) is None
    assert tmpl.id not in {s.id for s in automatic(home)}
    [newer] = [s for s in automatic(home) if s.box_name == third.name]
    assert origin(box()) == newer.id


def test_an_older_trees_template_a_box_was_started_from_stays(home: Path, tmp_path: Path) -> None:
    root = fake_rootfs(tmp_path)
    make = lambda: sandlot.Box(rootfs=root, engine="fake", memory_mib=256, home=home).start()  # noqa: E731
    make()
    [tmpl] = automatic(home)
    kept = make()
    assert origin(kept) == tmpl.id
    (root / "etc" / "motd").write_text("changed\n")
    make()
    assert tmpl.id in {s.id for s in automatic(home)}  # kept's saved state
    with pytest.raises(sandlot.SnapshotInUse):
        sandlot.get_snapshot(tmpl.id, home=home).remove()


def test_a_missing_root_filesystem_is_refused_naming_it(home: Path, tmp_path: Path) -> None:
    with pytest.raises(sandlot.InvalidArgument, match="nowhere"):
        sandlot.Box(rootfs=tmp_path / "nowhere", engine="fake", home=home).start()


def test_a_box_from_the_template_has_its_own_settings_not_the_first_boxs(home: Path, tmp_path: Path) -> None:
    """The template stands in for a boot: the environment, user, working directory and
    limits the first box was given are that box's, never a later one's."""
    root = fake_rootfs(tmp_path)
    mine = {"env": {"TOKEN": "first box's"}, "user": "nobody", "workdir": "/tmp", "pids_limit": 50}
    sandlot.Box(rootfs=root, engine="fake", memory_mib=256, home=home, **mine).start()  # type: ignore[arg-type]
    [tmpl] = automatic(home)
    later = sandlot.Box(rootfs=root, engine="fake", memory_mib=256, home=home).start()
    assert origin(later) == tmpl.id
    options = later.inspect()["options"]
    assert not any(options[k] for k in mine), options


def test_pruning_takes_the_templates_of_trees_that_changed_or_went(home: Path, tmp_path: Path) -> None:
    kept_root, gone_root = fake_rootfs(tmp_path / "kept"), fake_rootfs(tmp_path / "gone")
    for root in (kept_root, gone_root):
        sandlot.Box(rootfs=root, engine="fake", memory_mib=256, home=home).start().remove(force=True)
    by_tree = {s.info["box_name"]: s for s in automatic(home)}
    assert len(by_tree) == 2
    assert sandlot.prune_snapshots(home=home) == []  # both trees are as they were booted
    shutil.rmtree(gone_root)
    (kept_root / "etc" / "motd").write_text("changed\n")
    pruned = {s.id for s in sandlot.prune_snapshots(home=home)}
    assert pruned == {s.id for s in by_tree.values()}
    assert automatic(home) == []
