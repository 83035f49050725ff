"""Which KV bytes one SGLang prefill rank sends one decode rank, when their TP sizes may differ.

SGLang keeps each layer's K and V in a buffer of pages; a page is ``[page_size, heads, head_dim]``
(NHD), so one token's kv heads are ``row = item // page_size`` contiguous bytes, and a rank of
attention TP size ``tp`` holds a contiguous run of the model's kv heads: ``H / tp`` each when
``tp`` divides ``H``, one head shared by ``tp / H`` consecutive ranks when ``H`` divides ``tp``
(grouped-query heads replicated). An MLA cache holds one latent row that every rank keeps whole.

HEAD SLICE CONTRACT: a prefill rank sends a decode rank the kv heads both hold (the overlap of
their runs; SGLang's rank mapping pairs only ranks whose runs nest, and a pair sharing no head
is refused), as one byte stream: for buffer ``j``, page ``i`` of the chunk, token ``t``, the
token's slice of ``width[j]`` bytes, back to back, cut into blocks of ``block_bytes`` (the prefill's
page item, its pool block). A slice never straddles two blocks. Each side describes the same
stream over its own memory (:func:`stream_segments`): the prefill gathers from its token rows at
``src_off``, the decode scatters into its rows at ``dst_off``. Both sides derive the slice from
the same two :class:`RankLayout` (the decode's travels in its registration, the prefill's with
every chunk), so neither needs the other's addresses, and equal layouts give the old stream
exactly (whole pages, one block each).

LAYER PAIRING CONTRACT (pipeline parallelism): the stream's buffers are the prefill rank's own,
in its order; each goes into the decode buffer of the same model layer. Both sides send the layer
of each of their buffers (SGLang's ``KVArgs.kv_layer_ids``: K of every local layer, then V, the
ids SGLang itself pairs by), and :func:`tpusync.core.pd.pair_layers` pairs occurrences in order,
so a prefill pipeline stage fills exactly its layers of a decode that holds every layer, or its
own stage's of a decode split alike. A prefill layer the decode does not hold is refused by name.
A side that sends no layer ids pairs by position, equal buffer counts only (one stage on both
sides).

Rejected alternative: sending each prefill rank's whole pages to every decode rank that shares
them (a shared send pulled by several readers, as tpusync-vllm does when the prefill cannot know
its readers in advance). Here the decode ranks register before the first chunk, so each gets
only its heads: a TP=1 -> TP=2 transfer moves the cache once, not twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np

from tpusync.core.pd import pair_layers

__all__ = ["HeadSlice", "RankLayout", "head_slice", "pair_buffers", "stream_segments"]


@dataclass(frozen=True)
class RankLayout:
    """How one rank holds its KV pages (what a peer needs to pair its bytes with this rank's)."""

    tp: int  # attention TP size of the rank's server
    rank: int  # attention TP rank
    total_heads: int  # the model's kv heads; 0: unknown (UNKNOWN HEADS RULE); ignored for MLA
    page_size: int  # tokens per page
    item_lens: tuple[int, ...]  # bytes per page of each KV buffer (K of every layer, then V)
    mla: bool = False
    layer_ids: tuple[int, ...] = ()  # the model layer of each KV buffer; () = not known

    def heads(self) -> tuple[int, int]:
        """The model kv heads [first, end) this rank holds; ValueError for a split SGLang does
        not make."""
        if self.mla:
            return 0, 1
        h, tp = self.total_heads, self.tp
        if h > 0 and tp > 0 and h % tp == 0:
            per = h // tp
            return self.rank * per, (self.rank + 1) * per
        if h > 0 and tp > 0 and tp % h == 0:
            g = self.rank // (tp // h)
            return g, g + 1
        raise ValueError(f"{h} kv heads do not split over attention TP {tp}")

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "tp": self.tp,
                "rank": self.rank,
                "total_heads": self.total_heads,
                "page_size": self.page_size,
                "item_lens": list(self.item_lens),
                "mla": self.mla,
                "layer_ids": list(self.layer_ids),
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RankLayout:
        """A peer's layout; ValueError naming the field for anything malformed."""
        try:
            d = json.loads(raw)
            out = cls(
                tp=d["tp"],
                rank=d["rank"],
                total_heads=d["total_heads"],
                page_size=d["page_size"],
                item_lens=tuple(d["item_lens"]),
                mla=d["mla"],
                layer_ids=tuple(d.get("layer_ids", ())),  # absent: a peer before pipelines
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed KV layout {raw[:200]!r}: {e}") from None
        ints = (out.tp, out.rank, out.total_heads, out.page_size, *out.item_lens, *out.layer_ids)
        if (
            not all(type(x) is int for x in ints)
            or type(out.mla) is not bool
            or out.tp <= 0
            or out.total_heads < 0
            or not 0 <= out.rank < out.tp
            or out.page_size <= 0
            or not out.item_lens
            or min(out.item_lens) <= 0
            or (out.layer_ids and len(out.layer_ids) != len(out.item_lens))
            or min(out.layer_ids, default=0) < 0
        ):
            raise ValueError(f"malformed KV layout {raw[:200]!r}")
        return out


@dataclass(frozen=True)
class HeadSlice:
    """Per KV buffer: the bytes of a token row that travel, on each side (HEAD SLICE CONTRACT)."""

    heads: tuple[int, int]  # model kv heads that travel
    page_size: int
    src_buf: tuple[int, ...]  # stream part k: prefill buffer src_buf[k] -> decode dst_buf[k]
    dst_buf: tuple[int, ...]
    width: tuple[int, ...]  # bytes per token
    src_off: tuple[int, ...]  # where they start in a prefill token row
    dst_off: tuple[int, ...]  # where they go in a decode token row
    src_item: tuple[int, ...]  # page bytes of each part's buffer, on each side
    dst_item: tuple[int, ...]

    @property
    def bytes_per_page(self) -> int:
        """Stream bytes per page of the chunk (all buffers)."""
        return self.page_size * sum(self.width)


def pair_buffers(src: RankLayout, dst: RankLayout) -> list[tuple[int, int]]:
    """(prefill buffer, decode buffer) for every prefill buffer, in the prefill's order (LAYER
    PAIRING CONTRACT); ValueError when a prefill buffer has no decode buffer."""
    n_src, n_dst = len(src.item_lens), len(dst.item_lens)
    if not (src.layer_ids and dst.layer_ids):
        if n_src != n_dst:
            raise ValueError(
                f"KV buffer counts differ: prefill {n_src}, decode {n_dst}, and "
                f"{'the prefill' if not src.layer_ids else 'the decode'} sent no layer ids "
                "to pair them by"
            )
        return [(i, i) for i in range(n_src)]
    try:
        return list(enumerate(pair_layers(src.layer_ids, dst.layer_ids)))
    except ValueError as e:
        raise ValueError(f"decode rank: {e}; pipeline stages that do not match") from None


def head_slice(src: RankLayout, dst: RankLayout) -> HeadSlice:
    """What prefill rank ``src`` sends decode rank ``dst``; ValueError naming the mismatch when
    the two cannot pair (page size, layers, MLA or not, model heads, head size)."""
    if src.page_size != dst.page_size:
        raise ValueError(f"page sizes differ: prefill {src.page_size}, decode {dst.page_size}")
    pairs = pair_buffers(src, dst)
    if src.mla != dst.mla:
        raise ValueError(f"one side is MLA and the other not (prefill {src.mla})")
    if not src.mla:
        if src.total_heads and dst.total_heads and src.total_heads != dst.total_heads:
            raise ValueError(
                f"kv heads differ: prefill {src.total_heads}, decode {dst.total_heads}"
            )
        # UNKNOWN HEADS RULE: SGLang's decode fills in the model's kv heads only with staging
        # on, so a side that does not know them (0) takes the peer's; the page sizes are still
        # checked against them below. Unknown on both sides pairs equal TP sizes only (each
        # rank's row is then one opaque unit).
        total = src.total_heads or dst.total_heads
        if not total:
            if src.tp != dst.tp:
                raise ValueError(
                    f"attention TP sizes differ (prefill {src.tp}, decode {dst.tp}) and neither "
                    "side knows the model's kv heads"
                )
            total = src.tp
        src, dst = replace(src, total_heads=total), replace(dst, total_heads=total)
    big, small = max(src.tp, dst.tp), min(src.tp, dst.tp)
    if big % small:
        raise ValueError(f"attention TP sizes {src.tp} and {dst.tp} are not multiples")
    (s0, s1), (d0, d1) = src.heads(), dst.heads()
    lo, hi = max(s0, d0), min(s1, d1)
    if lo >= hi:
        raise ValueError(
            f"prefill rank {src.rank} (heads {s0}..{s1 - 1}) and decode rank {dst.rank} "
            f"(heads {d0}..{d1 - 1}) share no kv head"
        )
    p = src.page_size
    width, src_off, dst_off = [], [], []
    for i, j in pairs:
        si, di = src.item_lens[i], dst.item_lens[j]
        hb = si // (p * (s1 - s0))
        if hb <= 0 or si != hb * p * (s1 - s0) or di != hb * p * (d1 - d0):
            where = f"KV buffer {i}" if i == j else f"prefill KV buffer {i} -> decode buffer {j}"
            raise ValueError(
                f"{where}: page bytes {si} (prefill) and {di} (decode) are not "
                f"{p} tokens of {s1 - s0} and {d1 - d0} heads of one size"
            )
        width.append((hi - lo) * hb)
        src_off.append((lo - s0) * hb)
        dst_off.append((lo - d0) * hb)
    return HeadSlice(
        heads=(lo, hi),
        page_size=p,
        src_buf=tuple(i for i, _ in pairs),
        dst_buf=tuple(j for _, j in pairs),
        width=tuple(width),
        src_off=tuple(src_off),
        dst_off=tuple(dst_off),
        src_item=tuple(src.item_lens[i] for i, _ in pairs),
        dst_item=tuple(dst.item_lens[j] for _, j in pairs),
    )


def stream_segments(
    sl: HeadSlice, pages: np.ndarray, block_bytes: int, side: str
) -> tuple[np.ndarray, int]:
    """Segment rows ``(block, block_offset, region, region_offset, bytes)`` of one chunk's stream
    over ``side``'s memory ("src": the prefill's buffers, "dst": the decode's; region j = that
    side's buffer j as flat bytes, LAYER PAIRING CONTRACT), and the number of blocks the stream
    fills. ``pages``: that side's page indices of the chunk, in order. Whole rows are one
    segment per page."""
    if side not in ("src", "dst"):
        raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
    if side == "src":
        items, offs, bufs = sl.src_item, sl.src_off, sl.src_buf
    else:
        items, offs, bufs = sl.dst_item, sl.dst_off, sl.dst_buf
    pages = np.asarray(pages, dtype=np.uint64)
    n, p = int(pages.size), sl.page_size
    out, base = [], 0
    for j, w, item, off in zip(bufs, sl.width, items, offs, strict=True):
        row = item // p
        if w == row and block_bytes % (p * w) == 0 and base % (p * w) == 0:
            pos = base + np.arange(n, dtype=np.uint64) * np.uint64(p * w)
            where = pages * np.uint64(item)
            size = p * w
        elif block_bytes % w == 0 and base % w == 0:
            pos = base + np.arange(n * p, dtype=np.uint64) * np.uint64(w)
            tokens = np.arange(p, dtype=np.uint64) * np.uint64(row) + np.uint64(off)
            where = (pages[:, None] * np.uint64(item) + tokens[None, :]).ravel()
            size = w
        else:
            raise ValueError(f"a {w}-byte token slice does not tile {block_bytes}-byte blocks")
        rows = np.empty((pos.size, 5), dtype=np.uint64)
        rows[:, 0] = pos // np.uint64(block_bytes)
        rows[:, 1] = pos % np.uint64(block_bytes)
        rows[:, 2] = j
        rows[:, 3] = where
        rows[:, 4] = size
        out.append(rows)
        base += n * p * w
    segs = np.concatenate(out) if out else np.zeros((0, 5), dtype=np.uint64)
    return np.ascontiguousarray(segs), -(-base // block_bytes)
