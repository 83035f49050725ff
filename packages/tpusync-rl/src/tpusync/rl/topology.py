"""Where a bucket goes: transport request ids and the fan-out tree of each sampler rank.

FAN-OUT CONTRACT: for each sampler rank ``r`` the live replicas form a tree of degree ``fanout``
(``fanout=1``: a chain). Only the tree's first level pulls from the trainer; every other replica
pulls the same blocks from its parent, which registers each bucket for its children as soon as
it landed (forwarding while receiving), so the trainer sends each byte ``fanout`` times, not N.
A replica whose parent is lost in the middle of a version is re-parented to the trainer for the
rest of that version (RE-PARENTING CONTRACT in :mod:`tpusync.rl.membership`); its own subtree
stays below it.

A request id names one bucket of one stream (trainer rank -> sampler rank) for one child slot of
its sender (:func:`request_id`); a sampler is named ``"replica:rank"`` (:func:`_key`) on the
control channel.
"""

from __future__ import annotations

__all__ = ["request_id"]

_VERSION_BITS, _RANK_BITS, _CHILD_BITS, _BUCKET_BITS = 20, 10, 6, 18


def request_id(version: int, src: int, dst: int, child: int, bucket: int) -> int:
    """The transport request id of one bucket of stream (src -> dst) for one child of a sender.

    Unique per sender for 2**20 consecutive versions; ranks < 1024, fanout < 64, buckets < 2**18.
    """
    if not (0 <= src < 1 << _RANK_BITS and 0 <= dst < 1 << _RANK_BITS):
        raise ValueError(f"ranks must be below {1 << _RANK_BITS}: {src}, {dst}")
    if not 0 <= child < 1 << _CHILD_BITS:
        raise ValueError(f"fanout must be below {1 << _CHILD_BITS}")
    if not 0 <= bucket < 1 << _BUCKET_BITS:
        raise ValueError(f"a stream has more than {1 << _BUCKET_BITS} buckets: raise bucket size")
    v = version & ((1 << _VERSION_BITS) - 1)
    return (
        v << 44
        | src << (_CHILD_BITS + _BUCKET_BITS + _RANK_BITS)
        | dst << (_CHILD_BITS + _BUCKET_BITS)
        | child << _BUCKET_BITS
        | bucket
    )


def _decode_dst(rid: int) -> int:
    return (rid >> (_CHILD_BITS + _BUCKET_BITS)) & ((1 << _RANK_BITS) - 1)


def _decode_child(rid: int) -> int:
    return (rid >> _BUCKET_BITS) & ((1 << _CHILD_BITS) - 1)


def _key(replica: int, rank: int) -> str:
    return f"{replica}:{rank}"


def _children(topo: list[int], replica: int | None, fanout: int) -> list[int]:
    """Replicas pulling from ``replica`` (None: the trainer) in a tree of degree ``fanout``."""
    first = 0 if replica is None else fanout * (topo.index(replica) + 1)
    return topo[first : first + fanout]


def _parent(topo: list[int], replica: int, fanout: int) -> tuple[int | None, int]:
    """(parent replica or None for the trainer, this replica's child index at the parent)."""
    i = topo.index(replica)
    if i < fanout:
        return None, i
    return topo[i // fanout - 1], i % fanout
