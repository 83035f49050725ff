"""Resharding plans: which source shard sends which box to which destination shard.

RESHARD CONTRACT: a plan built from a source and a destination :class:`ShardLayout` of the same
tensor gives every destination rank a set of transfers whose boxes tile its box exactly once; each
transfer moves only the intersection of one source shard and one destination shard, so no rank
ever gathers more than it ends up holding (the full tensor is never assembled anywhere). When a box
is replicated on several source ranks, the replica that has been assigned the fewest bytes so far
sends it, spreading the load of a replicated trainer over its replicas.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from tpusync.rl.layout import Box, ShardLayout


@dataclass(frozen=True)
class Transfer:
    src_rank: int
    dst_rank: int
    box: Box  # global coordinates
    src_index: tuple[slice, ...]  # into the source rank's local shard
    dst_index: tuple[slice, ...]  # into the destination rank's local shard

    @property
    def elements(self) -> int:
        return self.box.size


@dataclass(frozen=True)
class ReshardPlan:
    src: ShardLayout
    dst: ShardLayout
    transfers: tuple[Transfer, ...]

    @classmethod
    def build(
        cls, src: ShardLayout, dst: ShardLayout, rows: Sequence[tuple[int, int]] | None = None
    ) -> ReshardPlan:
        """The plan moving every element, or with ``rows`` only the rows (dim-0 index ranges
        ``[r0, r1)``, sorted, disjoint) that a per-chunk delta sends (CHUNK DELTA CONTRACT in
        :mod:`tpusync.rl.chunks`): each transfer is cut to its intersections with the runs."""
        if src.shape != dst.shape:
            raise ValueError(f"layouts describe different shapes: {src.shape} vs {dst.shape}")
        if rows is not None and not src.shape:
            raise ValueError("a 0-d tensor has no rows to send part of")
        replicas: dict[Box, list[int]] = defaultdict(list)
        for rank, box in src.shards:
            replicas[box].append(rank)
        load: dict[int, int] = defaultdict(int)
        transfers = []
        for dst_rank, dbox in sorted(dst.shards, key=lambda s: s[0]):
            for sbox, ranks in replicas.items():
                part = sbox.intersect(dbox)
                if part is None:
                    continue
                # A rank that holds the data on both sides sends to itself: a local copy.
                src_rank = dst_rank if dst_rank in ranks else min(ranks, key=lambda r: (load[r], r))
                load[src_rank] += part.size
                for piece in [part] if rows is None else _cut_rows(part, rows):
                    transfers.append(
                        Transfer(
                            src_rank,
                            dst_rank,
                            piece,
                            sbox.local_slices(piece),
                            dbox.local_slices(piece),
                        )
                    )
        return cls(src, dst, tuple(transfers))

    def to(self, dst_rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst_rank == dst_rank]

    def sent_by(self, src_rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src_rank == src_rank]

    def elements_sent(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.src_rank] += t.elements
        return dict(out)


def _cut_rows(box: Box, rows: Sequence[tuple[int, int]]) -> list[Box]:
    """The parts of ``box`` inside the row runs ``rows`` (dim-0 ranges), in row order."""
    out = []
    for r0, r1 in rows:
        part = box.intersect(Box((r0, *box.lo[1:]), (r1, *box.hi[1:])))
        if part is not None:
            out.append(part)
    return out
