"""Where each shard of a tensor lives: global boxes per rank.

A :class:`ShardLayout` describes one tensor's sharding as the half-open box of global indices that
each rank holds. Replication is several ranks holding the same box. Layouts come from JAX shardings
(``devices_indices_map``), from tensor-parallel splits (torch TP / DTensor ``Shard(dim)``), or from
explicit slices, so trainer and sampler layouts of any framework compare in one currency.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Box:
    """A half-open box ``[lo, hi)`` of global indices, one range per dimension."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.lo) != len(self.hi):
            raise ValueError(f"box bounds have different ranks: {self.lo} vs {self.hi}")
        if any(a > b for a, b in zip(self.lo, self.hi, strict=True)):
            raise ValueError(f"box lower bound exceeds upper bound: {self.lo} > {self.hi}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.lo, self.hi, strict=True))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.lo, other.lo, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.hi, other.hi, strict=True))
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            return None
        return Box(lo, hi)

    def contains(self, other: Box) -> bool:
        return all(
            a <= c and d <= b
            for a, b, c, d in zip(self.lo, self.hi, other.lo, other.hi, strict=True)
        )

    def local_slices(self, inner: Box) -> tuple[slice, ...]:
        """``inner`` (inside this box) as slices into this box's local array."""
        if not self.contains(inner):
            raise ValueError(f"{inner} is not inside {self}")
        return tuple(
            slice(c - a, d - a) for a, c, d in zip(self.lo, inner.lo, inner.hi, strict=True)
        )

    @classmethod
    def from_slices(cls, shape: Sequence[int], index: Sequence[slice]) -> Box:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        lo, hi = [], []
        for s, n in zip(index, shape, strict=True):
            start, stop, step = s.indices(n)
            if step != 1:
                raise ValueError(f"strided shards are not supported (step {step})")
            lo.append(start)
            hi.append(stop)
        return cls(tuple(lo), tuple(hi))


@dataclass(frozen=True)
class ShardLayout:
    """A tensor's global shape and the box each rank holds (ranks may repeat a box: replicas)."""

    shape: tuple[int, ...]
    shards: tuple[tuple[int, Box], ...]

    def __post_init__(self) -> None:
        whole = Box((0,) * len(self.shape), tuple(self.shape))
        ranks = [r for r, _ in self.shards]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"a rank appears twice in one layout: {sorted(ranks)}")
        covered = 0
        for rank, box in self.shards:
            if len(box.lo) != len(self.shape) or not whole.contains(box):
                raise ValueError(f"rank {rank}'s box {box} is outside shape {self.shape}")
        # Coverage: the distinct boxes must tile the tensor (replicas of a box count once).
        distinct = {box for _, box in self.shards}
        covered = sum(b.size for b in distinct)
        overlaps = any(a.intersect(b) is not None for a in distinct for b in distinct if a is not b)
        if overlaps:
            raise ValueError("shards overlap partially; only tilings with replicas are supported")
        if covered != whole.size:
            raise ValueError(
                f"shards cover {covered} of {whole.size} elements of shape {self.shape}"
            )

    @property
    def ranks(self) -> list[int]:
        return [r for r, _ in self.shards]

    def box_of(self, rank: int) -> Box:
        for r, box in self.shards:
            if r == rank:
                return box
        raise KeyError(f"rank {rank} holds no shard of this tensor")

    @classmethod
    def from_slices(
        cls, shape: Sequence[int], index_of: Mapping[int, Sequence[slice]]
    ) -> ShardLayout:
        shape = tuple(int(n) for n in shape)
        return cls(shape, tuple((r, Box.from_slices(shape, idx)) for r, idx in index_of.items()))

    @classmethod
    def replicated(cls, shape: Sequence[int], ranks: Iterable[int]) -> ShardLayout:
        shape = tuple(int(n) for n in shape)
        whole = Box((0,) * len(shape), shape)
        return cls(shape, tuple((r, whole) for r in ranks))

    @classmethod
    def split(
        cls, shape: Sequence[int], dim: int, world: int, ranks: Sequence[int] | None = None
    ) -> ShardLayout:
        """Tensor-parallel split of ``dim`` into ``world`` contiguous parts (torch.chunk rules)."""
        shape = tuple(int(n) for n in shape)
        ranks = list(range(world)) if ranks is None else list(ranks)
        if len(ranks) != world:
            raise ValueError(f"{len(ranks)} ranks given for a {world}-way split")
        step = -(-shape[dim] // world)
        shards = []
        for i, r in enumerate(ranks):
            lo = list((0,) * len(shape))
            hi = list(shape)
            lo[dim] = min(i * step, shape[dim])
            hi[dim] = min((i + 1) * step, shape[dim])
            shards.append((r, Box(tuple(lo), tuple(hi))))
        return cls(shape, tuple(shards))

    @classmethod
    def from_jax(cls, sharding: Any, shape: Sequence[int], rank_of: Any = None) -> ShardLayout:
        """From a ``jax.sharding.Sharding``; ranks default to device ids."""
        rank_of = rank_of or (lambda device: device.id)
        index_map = sharding.devices_indices_map(tuple(shape))
        return cls.from_slices(shape, {rank_of(d): idx for d, idx in index_map.items()})


# A layout's form in a version's announcement on the control channel (tpusync.rl.trainer).
def _layout_to_wire(layout: ShardLayout) -> list:
    return [list(layout.shape), [[r, list(b.lo), list(b.hi)] for r, b in layout.shards]]


def _layout_from_wire(raw: list) -> ShardLayout:
    shape, shards = raw
    return ShardLayout(tuple(shape), tuple((r, Box(tuple(lo), tuple(hi))) for r, lo, hi in shards))
