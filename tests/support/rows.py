"""Box rows planted in a home's store as a crash leaves them, in any state.

No write of sandlot's makes such a row: the store makes a row only in a state a box
is born in, and moves it only along the declared transitions (core/state.py). The
rows recovery and the quick listing must read are those that writes cut short by a
kill -9 leave behind, so their tests plant them directly.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from sandlot.core.boxrecord import BoxRecord
from sandlot.core.store import BoxStore, encoded


def plant(db: Path, rec: BoxRecord) -> None:
    """Write ``rec`` into the store at ``db`` (made and migrated first) as it is."""
    BoxStore(db).close()
    row = encoded(rec.to_json())  # as the store encodes its own rows
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(f"INSERT INTO boxes ({', '.join(row)}) VALUES ({', '.join(f':{k}' for k in row)})", row)
