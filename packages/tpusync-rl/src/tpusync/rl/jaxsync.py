"""Multi-controller JAX trainers: publish a pytree of sharded ``jax.Array`` from every process.

In multi-controller JAX (``jax.distributed.initialize``) every process runs the same program and
holds only the shards on its own devices (``addressable_shards``). :class:`JaxTrainerSync` maps
that onto :class:`tpusync.rl.trainer.TrainerSync`: every *device* is one rank of the trainer layouts
(its index in ``jax.devices()``, which every process lists in the same order), each process owns
the ranks of its local devices, and the process holding device 0 serves the control channel.

ADDRESSABLE CONTRACT: a process reads only ``array.addressable_shards`` (zero-copy through
DLPack on CPU; a device -> host copy per piece on accelerators) and sends only the streams whose
source rank is one of its devices; nothing is gathered, no cross-process collective runs. A box
replicated on several devices is sent by one of them (:class:`tpusync.rl.plan.ReshardPlan`).

Names: a pytree leaf's name is its key path joined with dots (``{"layers": [{"w": x}]}`` gives
``layers.0.w``), the same on every process. Pathways (single controller) would call the same
:class:`~tpusync.rl.trainer.TrainerSync` from the controller with the same layouts; see docs/rl.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpusync.rl.layout import ShardLayout
from tpusync.rl.reports import PublishReport
from tpusync.rl.trainer import TrainerSync

__all__ = ["JaxTrainerSync", "device_ranks", "leaf_name", "pytree_shards"]


def device_ranks() -> dict[Any, int]:
    """Every device of the (multi-process) JAX runtime -> its trainer-layout rank."""
    import jax

    return {d: i for i, d in enumerate(sorted(jax.devices(), key=lambda d: d.id))}


def leaf_name(path: tuple) -> str:
    """A pytree key path as a dotted name (dict keys, sequence indices, attribute names)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def pytree_shards(tree: Any) -> dict[str, tuple[dict[int, Any], ShardLayout]]:
    """``{name: ({local rank: local shard}, layout)}`` for every ``jax.Array`` leaf of ``tree``.

    The layout is global (every device's box, from the array's sharding); the shards are this
    process's addressable ones only, as zero-copy torch views where DLPack allows.
    """
    import jax
    import torch

    ranks = device_ranks()
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array):
            raise TypeError(f"{leaf_name(path)}: a {type(leaf).__name__}, not a jax.Array")
        name = leaf_name(path)
        if name in out:
            # NAME RULE: two paths that join to one dotted name (``{"a.0": {"w"}}`` and
            # ``{"a": [{"w"}]}``) would publish one leaf under both; the later one was dropped.
            raise ValueError(
                f"two pytree leaves are both named {name!r} (their key paths join to the same "
                "dotted name): rename one of them"
            )
        layout = ShardLayout.from_jax(leaf.sharding, leaf.shape, rank_of=ranks.__getitem__)
        local = {}
        for shard in leaf.addressable_shards:
            local[ranks[shard.device]] = torch.from_dlpack(shard.data)
        out[name] = (local, layout)
    return out


class JaxTrainerSync:
    """One multi-controller JAX process's publisher (every process creates one, same arguments).

    ``control``: on the process holding device 0, the address to listen on (default an ephemeral
    loopback port); on the others, that process's :attr:`control_address` (share it out of band,
    e.g. through ``jax.distributed``'s key-value store or the launcher). Other keyword arguments go
    to :class:`~tpusync.rl.trainer.TrainerSync`.
    """

    def __init__(
        self,
        dst_layouts: Mapping[str, ShardLayout],
        *,
        control: str | None = None,
        **kwargs: Any,
    ) -> None:
        import jax

        ranks = device_ranks()
        local = sorted(ranks[d] for d in jax.local_devices())
        self.sync = TrainerSync(
            local[0], len(ranks), dst_layouts, control=control, local_ranks=local, **kwargs
        )

    @property
    def is_control(self) -> bool:
        return self.sync.rank == 0

    @property
    def control_address(self) -> str:
        return self.sync.control_address

    def wait_for_samplers(self, count: int, timeout: float) -> list[str]:
        return self.sync.wait_for_samplers(count, timeout)

    def publish(self, version: int, tree: Any, delta: bool = False) -> PublishReport:
        """Publish ``tree`` as ``version`` (every process calls this with the same version and
        ``delta``). With ``delta`` only leaves whose shard changed on any device are sent (the
        processes agree on the set through the control process: AGREEMENT CONTRACT of
        :class:`~tpusync.rl.trainer.TrainerSync`)."""
        return self.sync.publish(version, pytree_shards(tree), delta=delta)

    def close(self) -> None:
        self.sync.close()
