"""Packing plans: the chunks of one (trainer rank -> sampler rank) stream laid out in host blocks.

PACK CONTRACT: :func:`pack_streams` is a pure function of the manifest, the samplers' layouts (by
trainer name), the block size and the bucket size, so the trainer ranks and every sampler compute
the same plan independently and no byte offset travels on the wire. A stream is the ordered list
of pieces trainer rank ``src`` sends sampler rank ``dst``: each planned transfer
(:class:`tpusync.rl.plan.Transfer`) is cut into sub-boxes that fit the room left in the current
block (a piece never straddles two blocks), so buckets of whole blocks can be put on the wire as
soon as they are filled. Rejected alternative: pieces spanning blocks; the pool gives no
guarantee that consecutive block ids are adjacent in memory, so a spanning piece would need a
bounce copy on both ends.

BLOCK TRAILER CONTRACT: the last 16 bytes of every block hold the version (u64 LE) and the piece
count (u64 LE); the receiver checks both before it uses a byte of the block.

BLOCK CHECKSUM CONTRACT: a block's integrity is one XXH3-64 of the whole block (pieces, padding
and trailer), computed by the trainer rank right after filling it and handed to the transport,
which sends it instead of hashing again and verifies it at every hop (TCP and same-host; a
forwarding sampler passes the trainer's value on). One hash pass per block at the origin serves
as the end-to-end digest and as the transport checksum. Rejected alternative (the first
version): a digest per piece plus the transport's own per-hop checksum - three hash passes per
byte per hop where one suffices, and still no check of a forwarder's memory by the transport.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpusync.rl.layout import Box, ShardLayout
from tpusync.rl.manifest import Manifest
from tpusync.rl.plan import ReshardPlan

ALIGN = 64
TRAILER = 16
# A block with less room than this (and than the rest of the transfer) is closed: smaller pieces
# cost more per-piece work than the padding costs on the wire.
MIN_PIECE = 4096


@dataclass(frozen=True)
class Piece:
    name: str  # trainer name
    dtype: str  # trainer dtype
    transfer: Box  # the planned transfer this piece belongs to (global coordinates)
    box: Box  # the piece itself (inside ``transfer``)
    block: int  # block index within the stream
    offset: int  # bytes into the block
    nbytes: int
    slot: int  # index in the block's digest table


@dataclass(frozen=True)
class StreamPlan:
    src: int
    dst: int
    blocks: tuple[tuple[Piece, ...], ...]  # pieces of each block, in order
    buckets: tuple[tuple[int, int], ...]  # [first block, end block) of each bucket

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for blk in self.blocks for p in blk)


def itemsize(dtype: str) -> int:
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return dt.itemsize


def _take(box: Box, max_elems: int) -> tuple[Box, list[Box]]:
    """A leading sub-box of ``box`` with at most ``max_elems`` elements, and the rest (boxes)."""
    if box.size <= max_elems:
        return box, []
    shape = box.shape
    row = math.prod(shape[1:])
    if row <= max_elems:
        k = max_elems // row
        head = Box(box.lo, (box.lo[0] + k, *box.hi[1:]))
        tail = Box((box.lo[0] + k, *box.lo[1:]), box.hi)
        return head, [tail]
    # One row is too large: cut inside the first row, keep the other rows whole.
    first = Box(box.lo, (box.lo[0] + 1, *box.hi[1:]))
    rest = [] if shape[0] == 1 else [Box((box.lo[0] + 1, *box.lo[1:]), box.hi)]
    inner = Box(first.lo[1:], first.hi[1:])
    head, tails = _take(inner, max_elems)
    lift = lambda b: Box((box.lo[0], *b.lo), (box.lo[0] + 1, *b.hi))  # noqa: E731
    return lift(head), [lift(t) for t in tails] + rest


def pack_streams(
    manifest: Manifest,
    dst_layouts: dict[str, ShardLayout],
    block_bytes: int,
    bucket_blocks: int,
) -> dict[tuple[int, int], StreamPlan]:
    """Every (trainer rank, sampler rank) stream of ``manifest`` (tensors absent from
    ``dst_layouts`` are not sent)."""
    if block_bytes < 2 * MIN_PIECE or bucket_blocks < 1:
        raise ValueError(f"block_bytes {block_bytes} / bucket_blocks {bucket_blocks} too small")
    transfers: dict[tuple[int, int], list[tuple[str, str, Box]]] = {}
    for meta in manifest.tensors:
        if meta.name not in dst_layouts:
            continue
        if meta.layout.shape and math.prod(meta.layout.shape) == 0:
            continue
        plan = ReshardPlan.build(meta.layout, dst_layouts[meta.name], manifest.rows_of(meta.name))
        for t in plan.transfers:
            transfers.setdefault((t.src_rank, t.dst_rank), []).append(
                (meta.name, meta.dtype, t.box)
            )
    out = {}
    for (src, dst), items in sorted(transfers.items()):
        blocks: list[list[Piece]] = [[]]
        pos = 0
        for name, dtype, tbox in items:
            size = itemsize(dtype)
            work = [tbox]
            while work:
                box = work.pop(0)
                pos = -(-pos // ALIGN) * ALIGN
                room = block_bytes - TRAILER - pos
                if room < min(MIN_PIECE, box.size * size) or room < size:
                    blocks.append([])
                    pos = 0
                    room = block_bytes - TRAILER
                head, rest = _take(box, room // size)
                nbytes = head.size * size
                blocks[-1].append(
                    Piece(name, dtype, tbox, head, len(blocks) - 1, pos, nbytes, len(blocks[-1]))
                )
                pos += nbytes
                work = rest + work
        if not blocks[-1]:
            blocks.pop()
        buckets = tuple(
            (i, min(i + bucket_blocks, len(blocks))) for i in range(0, len(blocks), bucket_blocks)
        )
        out[(src, dst)] = StreamPlan(src, dst, tuple(tuple(b) for b in blocks), buckets)
    return out
