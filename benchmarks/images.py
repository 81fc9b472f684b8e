"""Image benchmarks (issue: OCI images).

In one run, against a local docker-registry on 127.0.0.1 serving the Debian +
python3 image the tests build:

* cold pull + unpack + base disk with sandlot, from an empty store;
* the baseline: ``skopeo copy`` to an OCI layout + ``umoci unpack`` of the same image;
* their ratio (target: at most 1.0);
* creating a box (disk ready) from an already pulled image (target: at most 50 ms).

    .venv/bin/python benchmarks/images.py [--runs 3] [--quick]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import sandlot

from _common import CACHE, debian_root, emit, host_facts, parser, scratch_home, summary
from tests.support.images import base_disk_bytes, python_layout
from tests.support.registry import run_registry


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.runs = 1
    root = debian_root()
    layout = python_layout(CACHE, root)
    sandlot.Runtime.for_home().prepare()
    # under the cache, not /tmp: on some hosts /tmp is much slower to create files in
    work = Path(tempfile.mkdtemp(prefix="bench-images-", dir=CACHE))
    try:
        with run_registry(work / "registry") as reg:
            reg.push(layout, "test/python:3")
            ref = reg.ref("test/python:3")
            size = sum(p.stat().st_size for p in (layout / "blobs/sha256").iterdir())

            def settle() -> None:
                # this host's ext4 discards on delete: let earlier runs' deletions finish
                os.sync()
                time.sleep(3)

            ours, baseline = [], []
            for i in range(args.runs):
                home = scratch_home("home-", work)
                settle()
                t0 = time.perf_counter()
                img = sandlot.pull(ref, home=home)
                ours.append(time.perf_counter() - t0)
                oci, bundle = work / f"oci-{i}", work / f"bundle-{i}"
                settle()
                t0 = time.perf_counter()
                subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", f"docker://{ref}",
                                f"oci:{oci}:py"], check=True)  # fmt: skip
                subprocess.run(["umoci", "unpack", "--image", f"{oci}:py", str(bundle)], check=True,
                               capture_output=True)  # fmt: skip
                baseline.append(time.perf_counter() - t0)
                shutil.rmtree(bundle, ignore_errors=True)
                shutil.rmtree(oci, ignore_errors=True)
                if i < args.runs - 1:
                    shutil.rmtree(home, ignore_errors=True)

            # a new box from the pulled image: resolve it, find the base, make the overlay, record it
            prep = []
            for _ in range(3 if args.quick else 20):
                t0 = time.perf_counter()
                box = sandlot.Box.create(ref, home=home, pull="never", template=False)
                prep.append(time.perf_counter() - t0)
                box.remove()
            o, b = summary(ours, digits=2), summary(baseline, digits=2)
            emit(
                {
                    "benchmark": "images",
                    "quick": args.quick,
                    "host": host_facts(sandlot.Runtime.for_home().prepare().accel),
                    "image": {"compressed_MB": round(size / 1e6, 1), "layers": len(img.layers)},
                    "cold_pull_unpack_base_s": o,
                    "skopeo_copy_plus_umoci_unpack_s": b,
                    "ratio_sandlot_over_skopeo_umoci": round(o["median"] / b["median"], 2),
                    "base_disk_MB_on_host": round(base_disk_bytes(home, img) / 1e6, 1),
                    "box_create_from_pulled_image_ms": summary(prep, 1e3, 1),
                }
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("SANDLOT_HOME", str(CACHE / "home"))
    main()
