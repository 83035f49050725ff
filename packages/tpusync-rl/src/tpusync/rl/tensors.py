"""The ``tensors`` argument of :meth:`tpusync.rl.trainer.TrainerSync.publish`: every accepted
form brought to one, ``({local rank: local shard}, layout)`` per tensor, and the one-shard view
that the manifest and the delta digests look at."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpusync.rl.layout import ShardLayout


def _normalize(
    tensors: Mapping[str, Any], world: int, ranks: tuple[int, ...]
) -> dict[str, tuple[dict[int, Any], ShardLayout]]:
    """Every tensor as ``({local rank: local shard}, layout)``.

    A value is a plain tensor (held whole by every rank), ``(shard, layout)`` (this process holds
    one layout rank) or ``({rank: shard}, layout)`` (one shard per local layout rank).
    """
    out = {}
    for name, v in tensors.items():
        if isinstance(v, tuple):
            local, layout = v
        else:  # a plain tensor: every trainer rank holds all of it
            local, layout = v, ShardLayout.replicated(tuple(v.shape), range(world))
        if not isinstance(local, Mapping):
            local = {r: local for r in ranks}
        held = {r for r, _ in layout.shards}
        missing = [r for r in ranks if r in held and r not in local]
        if missing:
            raise ValueError(f"{name}: no local shard given for layout ranks {missing}")
        mine = {r: local[r] for r in ranks if r in held}
        for r, shard in mine.items():
            # SHARD SHAPE RULE: checked before anything is announced. A shard larger than its
            # box had part of it sent silently (e.g. the full tensor passed as every rank's
            # shard: each rank's box got the first rows); a smaller one failed mid-version.
            want = layout.box_of(r).shape
            if tuple(shard.shape) != tuple(want):
                raise ValueError(
                    f"{name}: the local shard of rank {r} has shape {tuple(shard.shape)}, its "
                    f"layout box {tuple(want)}"
                )
            if str(getattr(shard, "device", "")) == "meta":
                raise ValueError(f"{name}: the local shard of rank {r} is a meta tensor (no data)")
        out[name] = (mine, layout)
    return out


def _first(tensors: Mapping[str, tuple[dict[int, Any], ShardLayout]]) -> dict[str, tuple]:
    """``(one local shard, layout)`` per tensor: what the manifest and delta digests look at."""
    out = {}
    for name, (local, layout) in tensors.items():
        if not local:
            raise ValueError(f"{name}: this process holds no shard of it")
        out[name] = (local[min(local)], layout)
    return out
