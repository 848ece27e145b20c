"""Build hook of the kvattn Python package: bundles libkvattn.so into the package.

`pip install ./python` runs this. The shared library is taken from, in order:
  1. $KVATTN_LIBRARY (a built libkvattn.so: copied into the package);
  2. a cmake build of the repository this directory sits in (or $KVATTN_SOURCE_DIR), into build/temp*/:
     `cmake -S <repo> -B <tmp> -DKVA_BUILD_TESTS=OFF -DKVA_BUILD_APPS=OFF [-DKVA_CUDA=$KVATTN_CUDA]`
     (KVA_CUDA defaults to AUTO: the CUDA backend is built when the toolkit is found, else CPU only);
     extra cmake arguments come from $KVATTN_CMAKE_ARGS.
Set KVATTN_SKIP_BUILD=1 to install only the Python code (the library is then looked up at run time through
$KVATTN_LIBRARY or the repository's build/ directory).
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
LIB_NAMES = ("libkvattn.so", "libkvattn.dylib", "kvattn.dll")


def _log(msg):
    print("kvattn setup: " + msg, file=sys.stderr)


def _source_dir():
    src = os.environ.get("KVATTN_SOURCE_DIR")
    cand = Path(src).resolve() if src else HERE.parent
    if (cand / "CMakeLists.txt").exists() and (cand / "include" / "kvattn.h").exists():
        return cand
    return None


def _cmake_build(build_temp):
    src = _source_dir()
    if src is None:
        raise RuntimeError("kvattn: cannot find the kvattn C sources (expected the repository around python/, or "
                           "set KVATTN_SOURCE_DIR); alternatively set KVATTN_LIBRARY to a built libkvattn.so")
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("kvattn: cmake is not on PATH; install cmake (>= 3.20) or set KVATTN_LIBRARY to a built "
                           "libkvattn.so")
    bdir = Path(build_temp).resolve() / "kvattn-cmake"
    bdir.mkdir(parents=True, exist_ok=True)
    args = [cmake, "-S", str(src), "-B", str(bdir), "-DCMAKE_BUILD_TYPE=Release", "-DKVA_BUILD_TESTS=OFF",
            "-DKVA_BUILD_APPS=OFF", "-DKVA_CUDA=" + os.environ.get("KVATTN_CUDA", "AUTO")]
    args += shlex.split(os.environ.get("KVATTN_CMAKE_ARGS", ""))
    _log(" ".join(args))
    subprocess.run(args, check=True)
    jobs = os.environ.get("KVATTN_BUILD_JOBS", str(os.cpu_count() or 2))
    subprocess.run([cmake, "--build", str(bdir), "--target", "kvattn", "-j", jobs], check=True)
    for name in LIB_NAMES:
        for cand in (bdir / name, bdir / "Release" / name):
            if cand.exists():
                return cand
    raise RuntimeError("kvattn: the cmake build finished but no libkvattn shared library was found in %s" % bdir)


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        if os.environ.get("KVATTN_SKIP_BUILD") == "1":
            _log("KVATTN_SKIP_BUILD=1: not bundling libkvattn")
            return
        env_lib = os.environ.get("KVATTN_LIBRARY")
        if env_lib:
            lib = Path(env_lib).resolve()
            if not lib.exists():
                raise RuntimeError("KVATTN_LIBRARY=%s does not exist" % env_lib)
        else:
            build_temp = self.get_finalized_command("build").build_temp
            lib = _cmake_build(build_temp)
        dest = Path(self.build_lib) / "kvattn" / ("libkvattn" + (".dylib" if lib.suffix == ".dylib" else
                                                                 ".dll" if lib.suffix == ".dll" else ".so"))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(str(lib.resolve()), str(dest))
        _log("bundled %s -> %s" % (lib, dest))


class BinaryDistribution(Distribution):
    """The wheel carries a native library: mark it platform specific."""

    def has_ext_modules(self):
        return os.environ.get("KVATTN_SKIP_BUILD") != "1"


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
