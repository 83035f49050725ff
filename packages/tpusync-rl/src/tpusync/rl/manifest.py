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

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "format": MANIFEST_FORMAT,
                "version": self.version,
                "base_version": self.base_version,
                "extra": self.extra,
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
        if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
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
        return cls(raw["version"], tensors, raw["base_version"], raw.get("extra", {}))
