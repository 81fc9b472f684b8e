"""sandlot's two C programs, declared once for the wheel's build and for a build on the host.

- the **agent** (``guest/agent/*.c``): the guest's init and the endpoint of every
  request, static so it runs in any root filesystem;
- the **egress relay** (``net/fdrelay.c``): run by QEMU once per guest connection,
  where a Python start would cost more than the connection.

A wheel ships both prebuilt (``setup.py`` compiles them with ``musl-gcc -static``
into ``sandlot/_prebuilt/``), so a user's host needs no compiler. A source checkout
has no ``_prebuilt`` folder and builds them on first use (``config.build_c``), and so
does a wheel's install where ``SANDLOT_BUILD_NATIVE=1`` asks for it.

Standard library only, no relative imports: ``setup.py`` loads this file by its
path before sandlot or its dependencies are installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
PREBUILT = "_prebuilt"
FROM_SOURCE = "SANDLOT_BUILD_NATIVE"  # "1": build both from the shipped sources, ignore _prebuilt


@dataclass(frozen=True, slots=True)
class Program:
    name: str
    folder: str  # relative to the package: where its sources are
    pattern: str  # which files of the folder are its sources (.c and .h)
    flags: tuple[str, ...]

    def sources(self, package: Path | None = None) -> list[Path]:
        folder = (package or PACKAGE) / self.folder
        return sorted(p for p in folder.glob(self.pattern) if p.suffix in (".c", ".h"))

    def source_digest(self, package: Path | None = None) -> str:
        """The sources' hash: a prebuilt binary records it, so a stale one is never used."""
        h = hashlib.sha256()
        for f in self.sources(package):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        return h.hexdigest()[:16]


AGENT = Program(
    "sandlot-agent", "guest/agent", "*",
    ("-std=gnu11", "-Os", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-strict-aliasing"),
)  # fmt: skip
RELAY = Program("sandlot-fdrelay", "net", "fdrelay.c", ("-std=gnu11", "-O2", "-Wall", "-Wextra"))
PROGRAMS = (AGENT, RELAY)


def static_compiler() -> list[str] | None:
    """musl-gcc gives a ~130 KB agent; glibc's static one is larger and warns about NSS."""
    for cc in ("musl-gcc", "gcc"):
        if shutil.which(cc):
            return [cc, "-static"]
    return None


def compile_program(program: Program, out: Path, cc: list[str], package: Path | None = None) -> None:
    """Compile ``program`` into the file ``out``; CalledProcessError with the compiler's output."""
    sources = [str(p) for p in program.sources(package) if p.suffix == ".c"]
    subprocess.run(
        [*cc, *program.flags, "-o", str(out), *sources], check=True, capture_output=True, text=True
    )


def prebuilt(program: Program) -> Path | None:
    """The wheel's binary of ``program``, if it has one built from these very sources
    and the user did not ask for a build from source."""
    if os.environ.get(FROM_SOURCE) == "1":
        return None
    binary = PACKAGE / PREBUILT / program.name
    stamp = binary.with_name(program.name + ".sources")
    try:
        if stamp.read_text().strip() != program.source_digest():
            return None
    except OSError:
        return None
    return binary if os.access(binary, os.X_OK) else None


def write_prebuilt(dest: Path, package: Path, cc: list[str]) -> list[Path]:
    """Build every program into ``dest`` (the wheel's ``sandlot/_prebuilt``), each with
    the digest of its sources beside it."""
    dest.mkdir(parents=True, exist_ok=True)
    made = []
    for program in PROGRAMS:
        compile_program(program, dest / program.name, [*cc, "-s"], package)  # stripped: the wheel ships it
        (dest / f"{program.name}.sources").write_text(program.source_digest(package) + "\n")
        made.append(dest / program.name)
    return made
