"""What an export in progress writes beside its destination, noted in the home
(``exports/<token>.json``: the hidden parts directory and temporary archive, and the
process writing them), so that an export killed part-way leaves nothing: the next
process to open the home's store (``Runtime.store``), or the next export, deletes
what a dead exporter left; ``sandlot ls``, which reads the store without opening it
where it can, asks ``left_behind`` and opens it where an export did. Apart from
``archive.py`` so that opening a store imports no compression library; what only a
note or a sweep needs is imported by them, so that the listing's question costs none
of it."""

from __future__ import annotations

import json
from pathlib import Path

from .. import pids

EXPORTS = "exports"


def left_behind(home: Path) -> bool:
    """Whether an export noted its files in ``home`` and has not ended: one in progress,
    or one killed part-way, whose files the next opening of the store deletes."""
    folder = home / EXPORTS
    return folder.is_dir() and any(folder.glob("*.json"))


def note(home: Path, work: Path, tmp: Path) -> Path:
    """Note, in the home, the files an export is about to write beside its destination,
    and whose they are: a kill -9 mid-export leaves them for ``sweep``."""
    import secrets

    from ..config import atomic_write

    folder = home / EXPORTS
    folder.mkdir(parents=True, exist_ok=True)
    pid, start = pids.me()
    record = folder / f"{secrets.token_hex(8)}.json"
    atomic_write(record, json.dumps({"pid": pid, "start": start, "paths": [str(work), str(tmp)]}).encode())
    return record


def sweep(home: Path) -> int:
    """Delete what exports killed part-way left beside their destinations (the hidden
    parts directory and temporary archive), once their process is gone; how many."""
    import shutil

    swept = 0
    folder = home / EXPORTS
    for record in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            noted = json.loads(record.read_text())
            if pids.alive(noted["pid"], noted["start"]):
                continue
            for name in noted["paths"]:
                path = Path(name)
                if path.name.startswith("."):  # only the hidden files an export makes
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable (a record cut short): dropped below, it names nothing certain
        record.unlink(missing_ok=True)
        swept += 1
    return swept
