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
    def build(cls, src: ShardLayout, dst: ShardLayout) -> ReshardPlan:
        if src.shape != dst.shape:
            raise ValueError(f"layouts describe different shapes: {src.shape} vs {dst.shape}")
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
                transfers.append(
                    Transfer(
                        src_rank, dst_rank, part, sbox.local_slices(part), dbox.local_slices(part)
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
