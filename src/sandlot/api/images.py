"""Images: pull from registries, load archives, import directories, list, remove, prune.

>>> import sandlot
>>> img = sandlot.pull("127.0.0.1:5000/tools/python:3.11")      # doctest: +SKIP
>>> img.config.cmd, img.size                                   # doctest: +SKIP
(('python3',), 49273344)
>>> with sandlot.Box(img) as box:                              # doctest: +SKIP
...     box.exec(*box.default_command())
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..core import snapshots
from ..core.runtime import Runtime
from ..errors import InvalidArgument
from ..images.store import Image, PruneReport

if TYPE_CHECKING:
    from ..images.registry import ProgressFn

Home = str | os.PathLike[str] | None


async def pull_async(
    ref: str,
    *,
    insecure: bool = False,
    ca_cert: str | os.PathLike[str] | None = None,
    credentials: tuple[str, str] | None = None,
    progress: ProgressFn | None = None,
    home: Home = None,
) -> Image:
    """Pull ``ref`` (x86_64 variant) and prepare its disk. Plain HTTP is used only for
    registries on the loopback or with ``insecure=True``; ``ca_cert`` trusts a private CA;
    ``credentials`` (user, password) override ``~/.docker/config.json``."""
    if credentials is not None and (
        not isinstance(credentials, tuple)
        or len(credentials) != 2
        or not all(isinstance(c, str) for c in credentials)
    ):
        raise InvalidArgument("credentials must be a (username, password) tuple of strings")
    return await Runtime.for_home(home).images.pull(
        ref,
        credentials=credentials,
        insecure=insecure,
        ca_cert=Path(ca_cert) if ca_cert else None,
        progress=progress,
    )


def list_images(home: Home = None) -> list[Image]:
    """Images in the store, newest first."""
    return Runtime.for_home(home).images.list_images()


def get_image(name: str, home: Home = None) -> Image | None:
    """An image by name, digest or id prefix, or None."""
    return Runtime.for_home(home).images.get(name)


def remove_image(name: str, home: Home = None) -> list[str]:
    """Untag a name (the image goes with its last name) or remove an image by digest or id.
    An image that goes takes its automatic templates along (those no box was started from)."""
    rt = Runtime.for_home(home)
    removed = rt.images.remove(name)
    gone = {d for d in removed if d.startswith(("sha256:", "sha512:"))}
    if gone:
        snapshots.drop_automatic_templates(rt.home, rt.store, gone)
    return removed


def load_image(path: str | os.PathLike[str], name: str | None = None, home: Home = None) -> list[Image]:
    """Load a ``docker save`` or OCI archive, or an OCI layout directory."""
    return Runtime.for_home(home).images.load(Path(path), name)


def import_image(
    directory: str | os.PathLike[str],
    name: str,
    *,
    cmd: Sequence[str] | None = None,
    entrypoint: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str = "",
    user: str = "",
    labels: Mapping[str, str] | None = None,
    home: Home = None,
) -> Image:
    """Make a single-layer image named ``name`` from a directory tree."""
    env_list = [f"{k}={v}" for k, v in (env or {}).items()] or None
    return Runtime.for_home(home).images.import_dir(
        Path(directory),
        name,
        cmd=list(cmd) if cmd is not None else None,
        entrypoint=list(entrypoint) if entrypoint else None,
        env=env_list,
        workdir=workdir,
        user=user,
        labels=dict(labels or {}),
    )


def prune_images(home: Home = None, *, unused_for: float = 0.0) -> PruneReport:
    """Remove blobs and base disks that no image and no box uses.

    ``unused_for`` (seconds) keeps the base disks made from a root filesystem directory
    or tarball that a box started from in that time, so that the next box from the same
    root need not make its base again::

        sandlot.prune_images(unused_for=7 * 86400)  # keep what a box used this week
    """
    if not unused_for >= 0:  # NaN too
        raise InvalidArgument(f"unused_for must be 0 or more seconds, not {unused_for}")
    rt = Runtime.for_home(home)
    return rt.images.prune(rt.boxes_dir, unused_for)
