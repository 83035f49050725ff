"""Blocks with known content for the disk-tier restart tests (test_store_manifest.py,
test_store_checkpoint.py): every id has its own bytes, so a hit can be checked byte for byte."""

from __future__ import annotations

import numpy as np

import tpusync.core as tc

BLOCK = 4096


def blocks(ids) -> np.ndarray:
    """Deterministic content per key id (every byte differs between ids)."""
    base = np.arange(BLOCK, dtype=np.uint32)
    return np.stack([((base * 7 + i * 131) % 251).astype(np.uint8) for i in ids])


def keys(ids) -> list[bytes]:
    return [b"blk-%d" % i for i in ids]


def served(s: tc.KVStore, ids: list[int]) -> set[int]:
    """The ids the store serves; asserts each hit holds its own bytes."""
    dst = np.zeros((len(ids), BLOCK), np.uint8)
    found = s.get(keys(ids), dst).result(10)
    want = blocks(ids)
    for row, ok in enumerate(found):
        if ok:
            np.testing.assert_array_equal(dst[row], want[row])
    return {i for i, ok in zip(ids, found, strict=True) if ok}
