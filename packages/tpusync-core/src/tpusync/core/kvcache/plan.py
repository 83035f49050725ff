"""Segment plans: which bytes of which caller regions pair with which bytes of which host blocks.

Plans are computed vectorised in numpy and handed to the native segment copy
(``_native.put_segments`` / ``get_segments``), which bounds-checks every segment before any byte
moves. Rows are ``(block, block_offset, region, region_offset, bytes)`` (uint64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpusync.core.errors import InvalidArgumentError
from tpusync.core.kvcache.layout import PieceGeometry

__all__ = ["Piece", "check_block_ids", "segments_for"]


@dataclass(frozen=True)
class Piece:
    """One tensor (or shard) of a layer: its region index in the call, geometry, host offset."""

    region: int
    geometry: PieceGeometry
    host_offset: int


def check_block_ids(
    ids: Sequence[int] | np.ndarray, num_blocks: int, what: str, unique: bool
) -> np.ndarray:
    """Device block ids as int64, refused (naming the first bad one) unless all are in range.

    ``unique``: also refuse repeats (a scatter writing one device block twice is ambiguous).
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{what}: block ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"{what}: block ids must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero((arr < 0) | (arr >= num_blocks))
    if bad.size:
        raise InvalidArgumentError(
            f"{what}: block id {int(arr[bad[0]])} (position {int(bad[0])}) is out of range for "
            f"a cache of {num_blocks} blocks; nothing was copied"
        )
    if unique and np.unique(arr).size != arr.size:
        raise InvalidArgumentError(f"{what}: block ids repeat; nothing was copied")
    return arr


def segments_for(
    device_blocks: np.ndarray, pieces: Sequence[Piece], slot_offset: int = 0
) -> np.ndarray:
    """Rows for batch position i <-> device block device_blocks[i] over every piece."""
    n = int(device_blocks.size)
    out = []
    b = device_blocks.astype(np.uint64)
    batch = np.arange(n, dtype=np.uint64)
    for p in pieces:
        g = p.geometry
        r = g.run_offsets.size
        rows = np.empty((n, r, 5), dtype=np.uint64)
        rows[:, :, 0] = batch[:, None]
        rows[:, :, 1] = np.uint64(slot_offset + p.host_offset) + np.arange(
            r, dtype=np.uint64
        ) * np.uint64(g.run_bytes)
        rows[:, :, 2] = p.region
        rows[:, :, 3] = b[:, None] * np.uint64(g.block_stride) + g.run_offsets[None, :]
        rows[:, :, 4] = g.run_bytes
        out.append(rows.reshape(-1, 5))
    if not out:
        return np.zeros((0, 5), dtype=np.uint64)
    return np.ascontiguousarray(np.concatenate(out))
