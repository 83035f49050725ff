"""WRITABLE MEMORY CHECK (tpusync.core.procmaps): ranges in read-only or unmapped memory are
refused by name; writable ones, and ranges spanning several writable mappings, pass."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from tpusync.core import InvalidArgumentError
from tpusync.core.procmaps import check_writable


def test_writable_heap_memory_passes():
    a = np.zeros(1 << 20, np.uint8)
    check_writable([(a.ctypes.data, a.nbytes, "a"), (a.ctypes.data + 5, 0, "empty")], "a test")


def test_read_only_file_mapping_is_refused_by_name(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        ro = np.frombuffer(m, np.uint8)
        at = ro.ctypes.data + 100
        with pytest.raises(
            InvalidArgumentError,
            match=rf"cache 3: its memory at {at:#x} is read-only \(a r--s mapping of .*/f\); a load",
        ):
            check_writable([(at, 10, "cache 3")], "a load")
        del ro


def test_a_range_that_runs_off_its_writable_mapping_is_refused():
    """Two adjacent anonymous pages, the second made read-only: a range over both is refused at
    the second page's address; the first page alone passes."""
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page)
    a = np.frombuffer(m, np.uint8)
    base = a.ctypes.data
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + page), page, mmap.PROT_READ) == 0
    check_writable([(base, page, "first page")], "a load")
    with pytest.raises(InvalidArgumentError, match=f"both pages: its memory at {base + page:#x}"):
        check_writable([(base, 2 * page, "both pages")], "a load")
    assert libc.mprotect(ctypes.c_void_p(base + page), page, mmap.PROT_READ | mmap.PROT_WRITE) == 0
    del a
    m.close()


def test_unmapped_memory_is_refused():
    with pytest.raises(InvalidArgumentError, match="is not mapped"):
        check_writable([(16, 8, "null-ish")], "a load")
