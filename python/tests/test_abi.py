"""The ctypes structs must match include/kvattn.h byte for byte: compile a probe against the header and compare
every struct size and field offset."""

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvattn import _ffi as F

REPO = Path(__file__).resolve().parents[2]
HEADER_DIR = REPO / "include"


def _cc():
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(not (HEADER_DIR / "kvattn.h").exists(), reason="include/kvattn.h not found (installed copy?)")
def test_struct_layouts_match_header(tmp_path):
    cc = _cc()
    if cc is None:
        pytest.skip("no C compiler on PATH to compile the layout probe")
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include \"kvattn.h\"", "int main(void) {"]
    for name, cls in F.STRUCTS.items():
        lines.append('printf("%s %%zu\\n", sizeof(%s));' % (name, name))
        for field, _ in cls._fields_:
            lines.append('printf("%s.%s %%zu\\n", offsetof(%s, %s));' % (name, field, name, field))
    lines += ["return 0;", "}"]
    src = tmp_path / "probe.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "probe"
    subprocess.run([cc, "-std=c11", "-I", str(HEADER_DIR), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    c_layout = dict((k, int(v)) for k, v in (line.split() for line in out.splitlines()))
    mismatches = []
    for name, cls in F.STRUCTS.items():
        if ctypes.sizeof(cls) != c_layout[name]:
            mismatches.append("sizeof(%s): C %d, ctypes %d" % (name, c_layout[name], ctypes.sizeof(cls)))
        for field, _ in cls._fields_:
            off = getattr(cls, field).offset
            if off != c_layout["%s.%s" % (name, field)]:
                mismatches.append("%s.%s: C offset %d, ctypes %d" % (name, field, c_layout["%s.%s" % (name, field)],
                                                                     off))
    assert not mismatches, "\n".join(mismatches)


def test_every_field_of_the_header_is_mirrored():
    """Catch fields added to the header but not to the ctypes mirror (a size check would too, but this names
    them)."""
    header = HEADER_DIR / "kvattn.h"
    if not header.exists():
        pytest.skip("include/kvattn.h not found")
    text = header.read_text()
    for name, cls in F.STRUCTS.items():
        start = text.find("typedef struct %s {" % name)
        assert start >= 0, name
        body = text[start:text.find("} %s;" % name, start)]
        for field, _ in cls._fields_:
            assert field in body, "%s.%s not in the header" % (name, field)


def test_library_loads_and_reports_version():
    import kvattn

    assert kvattn.library_version().count(".") == 2
    assert Path(kvattn.library_path()).exists()


def test_enum_values_match_header():
    text = (HEADER_DIR / "kvattn.h").read_text() if (HEADER_DIR / "kvattn.h").exists() else None
    if text is None:
        pytest.skip("include/kvattn.h not found")
    import re

    for const in [c for c in dir(F) if c.startswith("KVA_") and isinstance(getattr(F, c), int)]:
        m = re.search(r"\b%s\s*=\s*(\d+)" % const, text)
        if m:
            assert int(m.group(1)) == getattr(F, const), const
    assert sys.byteorder == "little"


def test_import_without_library_is_lazy_and_clear(tmp_path):
    """The package imports without the C library (pure helpers work); the first C call raises
    LibraryNotFoundError naming what was tried."""
    code = (
        "import numpy as np, kvattn\n"
        "assert kvattn.packbits(np.array([1, 0, 1], bool)).tolist() == [160]\n"
        "try:\n"
        "    kvattn.single_decode_with_kv_cache(np.zeros((2, 8), np.float32), np.zeros((3, 2, 8), np.float32),\n"
        "                                       np.zeros((3, 2, 8), np.float32))\n"
        "except kvattn.LibraryNotFoundError as e:\n"
        "    assert 'KVATTN_LIBRARY' in str(e) and isinstance(e, ImportError)\n"
        "    print('OK')\n")
    env = dict(os.environ, KVATTN_LIBRARY=str(tmp_path / "missing.so"))
    pkg_root = str(Path(__import__("kvattn").__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr
