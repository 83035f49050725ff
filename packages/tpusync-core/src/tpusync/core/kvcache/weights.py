"""Weight bucket plans: a state dict / pytree flattened into buckets of host pool blocks.

MANIFEST CONTRACT: tensors are laid out in the given order as one byte stream, each starting at a
64-byte-aligned offset; a bucket is a run of whole host blocks that never splits a tensor (a tensor
larger than the bucket size gets a bucket of its own). The manifest (names, dtypes, shapes, offsets,
block size) travels with the blocks; a receiver restores only into tensors whose name, dtype and
shape match it, and a mismatch is refused naming the tensor and the field before any byte moves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tpusync.core.errors import InvalidArgumentError, StateError

if TYPE_CHECKING:
    from tpusync.core.pool import HostBlockPool

__all__ = ["HostWeights", "WeightEntry", "WeightManifest", "plan_weights", "weight_segments"]

ALIGN = 64


@dataclass(frozen=True)
class WeightEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # in the byte stream
    bucket: int


@dataclass
class WeightManifest:
    block_bytes: int
    entries: list[WeightEntry]
    buckets: list[tuple[int, int]] = field(default_factory=list)  # [first block, end block)

    @property
    def num_blocks(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def to_dict(self) -> dict:
        return {
            "block_bytes": self.block_bytes,
            "entries": [asdict(e) for e in self.entries],
            "buckets": [list(b) for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, d: dict) -> WeightManifest:
        entries = [WeightEntry(**{**e, "shape": tuple(e["shape"])}) for e in d["entries"]]
        return cls(d["block_bytes"], entries, [tuple(b) for b in d["buckets"]])

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def check_targets(self, targets: Sequence[tuple[str, str, tuple[int, ...]]]) -> None:
        """Refuse targets (name, dtype, shape) that do not match the manifest, naming the field."""
        names = [t[0] for t in targets]
        mine = [e.name for e in self.entries]
        if sorted(names) != sorted(mine):
            missing = sorted(set(mine) - set(names))
            extra = sorted(set(names) - set(mine))
            raise InvalidArgumentError(
                f"weight names differ from the manifest (field 'name'): missing {missing[:5]}, "
                f"unexpected {extra[:5]}"
            )
        by_name = {e.name: e for e in self.entries}
        for name, dtype, shape in targets:
            e = by_name[name]
            if dtype != e.dtype:
                raise InvalidArgumentError(
                    f"weight {name!r}: field 'dtype' is {dtype} here, {e.dtype} in the manifest"
                )
            if tuple(shape) != e.shape:
                raise InvalidArgumentError(
                    f"weight {name!r}: field 'shape' is {tuple(shape)} here, {e.shape} in the "
                    f"manifest"
                )


@dataclass
class HostWeights:
    """Weights in host blocks: the manifest and the pool block ids of each bucket (what
    ``flatten_weights`` of tpusync-torch and tpusync-jax return). ``free`` gives the blocks back
    to the pool; the object holds no blocks after it."""

    pool: HostBlockPool
    manifest: WeightManifest
    bucket_ids: list[list[int]]

    @classmethod
    def alloc(cls, pool: HostBlockPool, manifest: WeightManifest) -> HostWeights:
        """The blocks of every bucket of ``manifest``, all or none (a bucket that does not fit
        frees the ones before it)."""
        host = cls(pool, manifest, [])
        try:
            for first, end in manifest.buckets:
                host.bucket_ids.append(pool.alloc(end - first))
        except BaseException:
            host.free()
            raise
        return host

    def ids_of(self, buckets: Sequence[int] | None = None) -> list[tuple[int, list[int]]]:
        """(bucket, its block ids) for ``buckets`` (default: all), refused before any byte moves
        when the weights were freed or a bucket does not exist (a freed HostWeights used to
        restore uninitialised memory)."""
        if len(self.bucket_ids) != len(self.manifest.buckets):
            raise StateError("these HostWeights were freed: their blocks are gone")
        chosen = range(len(self.bucket_ids)) if buckets is None else list(buckets)
        for b in chosen:
            if isinstance(b, bool) or not isinstance(b, int | np.integer):
                raise InvalidArgumentError(f"bucket {b!r} is not an int")
            if not 0 <= b < len(self.bucket_ids):
                raise InvalidArgumentError(
                    f"bucket {b} does not exist (the manifest has {len(self.bucket_ids)})"
                )
        return [(int(b), self.bucket_ids[b]) for b in chosen]

    def free(self) -> None:
        for ids in self.bucket_ids:
            self.pool.free(ids)
        self.bucket_ids = []


def plan_weights(
    items: Sequence[tuple[str, str, tuple[int, ...], int]], block_bytes: int, bucket_bytes: int
) -> WeightManifest:
    """Plan (name, dtype, shape, nbytes) items into buckets of whole blocks."""
    if block_bytes <= 0 or bucket_bytes <= 0:
        raise InvalidArgumentError("block_bytes and bucket_bytes must be > 0")
    if len({i[0] for i in items}) != len(items):
        raise InvalidArgumentError("weight names repeat")
    entries: list[WeightEntry] = []
    buckets: list[tuple[int, int]] = []
    bucket_start = 0  # byte offset of the open bucket (block aligned)
    pos = 0
    for name, dtype, shape, nbytes in items:
        pos = -(-pos // ALIGN) * ALIGN
        if pos > bucket_start and pos + nbytes - bucket_start > bucket_bytes:
            end = -(-pos // block_bytes) * block_bytes
            buckets.append((bucket_start // block_bytes, end // block_bytes))
            bucket_start = pos = end
        entries.append(
            WeightEntry(name, dtype, tuple(int(s) for s in shape), int(nbytes), pos, len(buckets))
        )
        pos += int(nbytes)
    if entries:
        end = max(-(-pos // block_bytes) * block_bytes, bucket_start + block_bytes)
        buckets.append((bucket_start // block_bytes, end // block_bytes))
    return WeightManifest(block_bytes, entries, buckets)


def weight_segments(manifest: WeightManifest, bucket: int, regions: Sequence[int]) -> np.ndarray:
    """Segment rows for one bucket: entry k of the bucket (in manifest order) is region
    ``regions[k]`` (a contiguous byte region of the tensor); block column is relative to the
    bucket's first block."""
    first, _ = manifest.buckets[bucket]
    entries = [e for e in manifest.entries if e.bucket == bucket]
    if len(entries) != len(regions):
        raise InvalidArgumentError(f"{len(regions)} regions for {len(entries)} tensors in bucket")
    rows = []
    b = manifest.block_bytes
    for e, region in zip(entries, regions, strict=True):
        start, end = e.offset, e.offset + e.nbytes
        pos = start
        while pos < end:
            blk = pos // b
            take = min(end, (blk + 1) * b) - pos
            rows.append((blk - first, pos - blk * b, region, pos - start, take))
            pos += take
    return np.asarray(rows, dtype=np.uint64).reshape(-1, 5)
