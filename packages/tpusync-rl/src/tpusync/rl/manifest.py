"""Update manifests: what one weight version contains and how to verify it.

VERSION CONTRACT: versions are integers that only grow. A subscriber holding version v accepts an
update only for a version > v built against its expected base (``base_version``: the version a
delta applies to, or None for a full update); anything else is refused as version skew before a
byte is staged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from tpusync.rl.layout import Box, ShardLayout

MANIFEST_FORMAT = 1
# Format 2 adds ``rows`` (a per-chunk delta): a reader of format 1 would expect whole tensors, so
# it refuses such a manifest instead of misreading it. Manifests without rows stay format 1.
MANIFEST_FORMAT_ROWS = 2


@dataclass(frozen=True)
class TensorMeta:
    name: str  # the trainer's name; subscribers may map it
    dtype: str  # the trainer's dtype (casting happens on the subscriber)
    layout: ShardLayout


@dataclass(frozen=True)
class Manifest:
    version: int
    tensors: tuple[TensorMeta, ...]
    base_version: int | None = None  # set for delta updates: only changed tensors are listed
    extra: dict = field(default_factory=dict)
    # Per-chunk delta (CHUNK DELTA CONTRACT in tpusync.rl.chunks): tensor name -> the runs of
    # rows (dim-0 ranges [r0, r1), sorted, disjoint) that are sent; a listed tensor absent here
    # is sent whole. Only in delta manifests.
    rows: dict[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rows and self.base_version is None:
            raise ValueError("only a delta manifest (with a base version) sends part of a tensor")
        metas = {t.name: t for t in self.tensors}
        for name, runs in self.rows.items():
            meta = metas.get(name)
            if meta is None or not meta.layout.shape:
                raise ValueError(f"manifest rows for {name!r}, which it does not send in rows")
            end = 0
            for r0, r1 in runs:
                if not end <= r0 < r1 <= meta.layout.shape[0]:
                    raise ValueError(
                        f"manifest rows of {name!r} are not sorted, disjoint runs inside "
                        f"[0, {meta.layout.shape[0]}): {list(runs)}"
                    )
                end = r1

    def rows_of(self, name: str) -> tuple[tuple[int, int], ...] | None:
        """The row runs of ``name`` that are sent; None: all of it."""
        return self.rows.get(name)

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "format": MANIFEST_FORMAT_ROWS if self.rows else MANIFEST_FORMAT,
                "version": self.version,
                "base_version": self.base_version,
                "extra": self.extra,
                "rows": {n: [list(r) for r in runs] for n, runs in self.rows.items()},
                "tensors": [
                    {
                        "name": t.name,
                        "dtype": t.dtype,
                        "shape": list(t.layout.shape),
                        "shards": [[r, list(b.lo), list(b.hi)] for r, b in t.layout.shards],
                    }
                    for t in self.tensors
                ],
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            raw = msgpack.unpackb(data)
        except Exception as e:  # noqa: BLE001 - any decode failure is the same to the caller
            raise ValueError(f"malformed weight-update manifest: {e}") from e
        if not isinstance(raw, dict) or raw.get("format") not in (
            MANIFEST_FORMAT,
            MANIFEST_FORMAT_ROWS,
        ):
            raise ValueError(f"unsupported weight-update manifest format {raw!r:.80}")
        tensors = tuple(
            TensorMeta(
                t["name"],
                t["dtype"],
                ShardLayout(
                    tuple(t["shape"]),
                    tuple((r, Box(tuple(lo), tuple(hi))) for r, lo, hi in t["shards"]),
                ),
            )
            for t in raw["tensors"]
        )
        rows = {
            str(n): tuple((int(r0), int(r1)) for r0, r1 in runs)
            for n, runs in (raw.get("rows") or {}).items()
        }
        return cls(raw["version"], tensors, raw["base_version"], raw.get("extra", {}), rows)
