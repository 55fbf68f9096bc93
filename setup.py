"""Builds the native CPU kernels (rag_promptcache/model/kernels/*.c) into the package at install time.

Everything else about the package is in pyproject.toml. The kernels are one plain shared library loaded
with ctypes, not a Python extension module, so the build step compiles it with the flags
model/native.py names (`native.build`, loaded here by path: importing the package would need torch,
which a build environment may not have). The build is optional: without a C compiler, or with one
that does not know AVX512-BF16, the install goes on with a warning and the torch code runs.
`rag-promptcache kernels build` builds them later.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_rag_promptcache_native", HERE / "rag_promptcache/model/native.py")
native = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native)

# The name only places the output: package rag_promptcache.model.kernels (a plain directory), file LIBRARY_NAME.
KERNELS = Extension("rag_promptcache.model.kernels.kernels", sources=[str(p.relative_to(HERE)) for p in native.SOURCES])


class BuildKernels(build_ext):
    """build_ext for the one library (the package has no other extension): native.build's compiler and
    flags, its record beside it, and a warning instead of a failed install where it cannot be built."""

    def get_ext_filename(self, fullname: str) -> str:
        # called with the dotted name, or with its last part only (get_ext_fullpath); both end in LIBRARY_NAME
        return os.path.join(*fullname.split(".")[:-1], native.LIBRARY_NAME)

    def build_extension(self, ext: Extension) -> None:
        why = native.build(Path(self.get_ext_fullpath(ext.name)))
        if why is not None:
            self.warn(f"the native CPU kernels were not built, so the torch code will run (slower, same results): "
                      f"{why}. Build them later with `rag-promptcache kernels build`.")

    def get_outputs(self) -> list[str]:
        # a library that was not built is not an output; its record is one
        built = [p for p in super().get_outputs() if os.path.exists(p)]
        return built + [str(native.record_path(Path(p))) for p in built if p.endswith(native.LIBRARY_NAME)]

    def copy_extensions_to_source(self) -> None:
        # `pip install -e .` builds in place: the library and its record go next to the sources
        # get_ext_fullpath would name the in-place file here: run() has set inplace back by now
        built = Path(self.build_lib) / self.get_ext_filename(KERNELS.name)
        if not built.exists():
            return
        build_py = self.get_finalized_command("build_py")
        dest = Path(build_py.get_package_dir("rag_promptcache.model.kernels")) / native.LIBRARY_NAME
        # the library first: its old record does not match it, so no reader loads a mismatched pair
        for src, dst in ((built, dest), (native.record_path(built), native.record_path(dest))):
            tmp = dst.with_name(dst.name + ".tmp")
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o755 if dst == dest else 0o644)
            os.replace(tmp, dst)


setup(ext_modules=[KERNELS], cmdclass={"build_ext": BuildKernels})
