"""The wheel ships sandlot's C programs prebuilt (``sandlot.native`` declares them),
so installing it needs no compiler; everything else is in pyproject.toml.

The binaries are static (musl), so the wheel is tagged for any x86_64 Linux rather
than for one C library, and for any Python 3 (no extension module)."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PLATFORM = "manylinux_2_17_x86_64.manylinux2014_x86_64.musllinux_1_1_x86_64"


def _native():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("_sandlot_native", HERE / "src/sandlot/native.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


class BuildWithNative(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # a checkout builds on first use, from the sources it edits
            return
        native = _native()
        cc = native.static_compiler()
        if cc is None or platform.machine() != "x86_64":
            if os.environ.get("SANDLOT_WHEEL_NATIVE") == "required":
                raise SystemExit("sandlot's wheel needs musl-gcc (Debian: musl-tools) on x86_64")
            print("sandlot: no static C compiler or not x86_64: the wheel builds its agent on first use")
            return
        dest = Path(self.build_lib) / "sandlot" / native.PREBUILT
        for binary in native.write_prebuilt(dest, HERE / "src" / "sandlot", cc):
            print(f"sandlot: built {binary} with {' '.join(cc)}")


class WithBinaries(Distribution):
    def has_ext_modules(self) -> bool:  # a platform wheel, installed as one piece into platlib
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", PLATFORM


setup(distclass=WithBinaries, cmdclass={"build_py": BuildWithNative, "bdist_wheel": PlatformWheel})
