"""HEAD SLICE CONTRACT (tpusync.sglang.pd_layout): which KV bytes a prefill rank sends a decode
rank of another attention TP size, moved through real pool blocks by the core's segment copies.

Every case builds one model's KV (every kv head of every token), splits it over the prefill's
and the decode's ranks the way SGLang does (NHD pages, heads by attention TP rank), moves each
(prefill rank, decode rank) pair that SGLang's rank mapping pairs through a real
``HostBlockPool`` with ``put_segments`` / ``get_segments``, and checks every decode rank's pages
hold exactly its heads of the right tokens, untouched pages stay zero.
"""

from __future__ import annotations

import numpy as np
import pytest

from tpusync.core import HostBlockPool, _native
from tpusync.sglang.pd_layout import RankLayout, head_slice, stream_segments

DIM, ITEM = 8, 2  # head_dim, bytes per element (bf16-sized)


def _targets(p_tp: int, d_tp: int, d: int) -> list[int]:
    """SGLang's rank mapping (CommonKVReceiver): the prefill ranks decode rank ``d`` pulls from."""
    if d_tp >= p_tp:
        return [d // (d_tp // p_tp)]
    k = p_tp // d_tp
    return list(range(d * k, (d + 1) * k))


def _layout(tp: int, rank: int, heads: int, page: int, buffers: int, known: int) -> RankLayout:
    per = max(1, heads // tp)
    return RankLayout(tp, rank, known, page, (page * per * DIM * ITEM,) * buffers)


def _rank_buffers(model: np.ndarray, lay: RankLayout, heads: int) -> list[np.ndarray]:
    """Flat byte buffers of one rank: buffer j is model[j] (tokens, heads, dim) cut to the
    rank's heads, laid out as pages in token order."""
    lo, hi = lay.heads() if heads else (0, 0)
    return [np.ascontiguousarray(model[j][:, lo:hi]).reshape(-1) for j in range(model.shape[0])]


def _move(src_bufs, src_pages, dst_bufs, dst_pages, sl, block) -> int:
    """One chunk through a real pool, as the prefill gathers and the decode scatters it."""
    segs, blocks = stream_segments(sl, src_pages, block, "src")
    dsegs, dblocks = stream_segments(sl, dst_pages, block, "dst")
    assert blocks == dblocks
    pool = HostBlockPool(block, blocks + 1)
    ids = pool.alloc(blocks)
    _native.put_segments(pool.engine, pool.native, ids, src_bufs, segs).result(30)
    _native.get_segments(pool.engine, pool.native, ids, dst_bufs, dsegs).result(30)
    pool.free(ids)
    return blocks


CASES = [  # prefill TP, decode TP, model kv heads
    (1, 1, 2),
    (2, 2, 4),
    (1, 2, 2),
    (2, 1, 2),
    (1, 4, 2),  # decode TP above the heads: pairs of decode ranks share one head
    (2, 4, 4),
    (4, 2, 4),
    (4, 1, 4),
    (4, 2, 2),  # prefill TP above the heads: two prefill ranks send the decode the same head
    (4, 8, 2),
]


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), CASES)
@pytest.mark.parametrize("known", ["both", "prefill"])
def test_every_decode_rank_gets_exactly_its_heads(p_tp, d_tp, heads, page, known):
    rng = np.random.default_rng(p_tp * 100 + d_tp * 10 + heads + page)
    pages, buffers = 6, 3
    model = rng.integers(1, 255, (buffers, pages * page, heads, DIM * ITEM), dtype=np.uint8)
    src_pages = np.array([4, 1, 5], dtype=np.int64)  # the request's pages on the prefill
    dst_pages = np.array([0, 3, 2], dtype=np.int64)  # and where the decode put them
    dst_known = heads if known == "both" else 0  # UNKNOWN HEADS RULE: the decode's may be 0
    for d in range(d_tp):
        dst_lay = _layout(d_tp, d, heads, page, buffers, dst_known)
        dlo, dhi = _layout(d_tp, d, heads, page, buffers, heads).heads()
        dst_bufs = [
            np.zeros(pages * page * (dhi - dlo) * DIM * ITEM, np.uint8) for _ in range(buffers)
        ]
        for p in _targets(p_tp, d_tp, d):
            src_lay = _layout(p_tp, p, heads, page, buffers, heads)
            sl = head_slice(src_lay, dst_lay)
            _move(_rank_buffers(model, src_lay, heads), src_pages, dst_bufs, dst_pages, sl,
                  src_lay.item_lens[0])  # fmt: skip
        for j in range(buffers):
            got = dst_bufs[j].reshape(pages, page, dhi - dlo, DIM * ITEM)
            want = model[j].reshape(pages, page, heads, DIM * ITEM)[:, :, dlo:dhi]
            np.testing.assert_array_equal(got[dst_pages], want[src_pages])
            rest = np.setdiff1d(np.arange(pages), dst_pages)
            assert not got[rest].any(), "a page the request does not own was written"


def _stage_layers(layers: int, stages: int) -> list[range]:
    """SGLang's split of the model's layers over pipeline stages (earlier stages get the
    remainder)."""
    per, extra = divmod(layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = per + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


@pytest.mark.parametrize(("p_pp", "d_pp"), [(2, 1), (3, 1), (2, 2)])
@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [(1, 1, 2), (2, 1, 2), (1, 2, 4)])
def test_pipeline_stages_fill_their_layers_of_the_decode(p_pp, d_pp, p_tp, d_tp, heads):
    """LAYER PAIRING CONTRACT: every prefill stage's K and V buffers land in the decode buffers
    of the same model layers (a decode of one stage holds all of them; one split alike pulls
    from its own stage only), with any TP pair on top."""
    rng = np.random.default_rng(p_pp * 100 + d_pp * 10 + p_tp + d_tp + heads)
    layers, pages, page = 5, 4, 2
    # model[l, 0 or 1]: K or V of layer l, every kv head of every token
    model = rng.integers(1, 255, (layers, 2, pages * page, heads, DIM * ITEM), dtype=np.uint8)
    src_pages, dst_pages = np.array([3, 0], dtype=np.int64), np.array([1, 2], dtype=np.int64)

    def stage(tp, rank, lays):  # K of every local layer, then V, as SGLang's pools list them
        per = max(1, heads // tp)
        lay = RankLayout(tp, rank, heads, page, (page * per * DIM * ITEM,) * (2 * len(lays)),
                         layer_ids=tuple(lays) * 2)  # fmt: skip
        lo, hi = lay.heads()
        bufs = [np.ascontiguousarray(model[lid, kv][:, lo:hi]).reshape(-1)
                for kv in (0, 1) for lid in lays]  # fmt: skip
        return lay, bufs

    p_stages, d_stages = _stage_layers(layers, p_pp), _stage_layers(layers, d_pp)
    for d in range(d_tp):
        for ds, d_lays in enumerate(d_stages):
            dst_lay, want = stage(d_tp, d, d_lays)
            dst_bufs = [np.zeros_like(b) for b in want]
            sources = [p_stages[ds]] if d_pp == p_pp else p_stages  # SGLang's target_pp_ranks
            for p in _targets(p_tp, d_tp, d):
                for p_lays in sources:
                    src_lay, src_bufs = stage(p_tp, p, p_lays)
                    sl = head_slice(src_lay, dst_lay)
                    assert [dst_lay.layer_ids[j] for j in sl.dst_buf] == list(p_lays) * 2
                    _move(src_bufs, src_pages, dst_bufs, dst_pages, sl, src_lay.item_lens[0])
            rows = pages * page
            for got, full in zip(dst_bufs, want, strict=True):
                got = got.reshape(pages, -1)
                np.testing.assert_array_equal(got[dst_pages], full.reshape(pages, -1)[src_pages])
                assert not got[np.setdiff1d(np.arange(pages), dst_pages)].any()
                assert full.size % rows == 0


def test_buffers_pair_by_layer_occurrence_not_position():
    src = RankLayout(1, 0, 2, 1, (64, 64, 64, 64), layer_ids=(4, 5, 4, 5))  # stage 2 of 3
    dst = RankLayout(1, 0, 2, 1, (64,) * 12, layer_ids=tuple(range(6)) * 2)  # every layer
    sl = head_slice(src, dst)
    assert sl.src_buf == (0, 1, 2, 3) and sl.dst_buf == (4, 5, 10, 11)
    segs, blocks = stream_segments(sl, np.array([7]), 64, "dst")
    assert blocks == 4 and segs[:, 2].tolist() == [4, 5, 10, 11]
    assert segs[:, 3].tolist() == [7 * 64] * 4


def test_equal_layouts_send_whole_pages_one_block_each():
    lay = RankLayout(2, 1, 4, 4, (256, 256))
    sl = head_slice(lay, lay)
    segs, blocks = stream_segments(sl, np.array([7, 2, 9]), 256, "src")
    assert blocks == 6
    assert segs.tolist() == [
        [b, 0, j, page * 256, 256] for j in range(2) for b, page in zip(
            range(3 * j, 3 * j + 3), [7, 2, 9], strict=True)
    ]  # fmt: skip


def test_a_decode_rank_gets_only_its_heads_on_the_wire():
    src = RankLayout(1, 0, 4, 2, (2 * 4 * 16,))  # 4 heads of 16 bytes, 2 tokens per page
    dst = RankLayout(2, 1, 4, 2, (2 * 2 * 16,))  # heads 2, 3
    sl = head_slice(src, dst)
    assert sl.heads == (2, 4)
    assert (sl.width, sl.src_off, sl.dst_off) == ((32,), (32,), (0,))
    segs, blocks = stream_segments(sl, np.array([3, 0]), 128, "src")
    assert blocks == 1  # two pages of half rows fill one prefill page
    assert segs[:, 3].tolist() == [3 * 128 + 32, 3 * 128 + 64 + 32, 32, 64 + 32]
    assert segs[:, 1].tolist() == [0, 32, 64, 96]


def test_mla_rows_travel_whole_between_any_tp_sizes():
    src = RankLayout(4, 3, 0, 1, (576, 576), mla=True)
    dst = RankLayout(1, 0, 0, 1, (576, 576), mla=True)
    sl = head_slice(src, dst)
    assert sl.width == (576, 576) and sl.src_off == sl.dst_off == (0, 0)


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        (RankLayout(1, 0, 2, 4, (256,)), RankLayout(1, 0, 2, 8, (512,)), "page sizes differ"),
        (RankLayout(1, 0, 2, 4, (256,)), RankLayout(1, 0, 2, 4, (256, 256)), "buffer counts"),
        (RankLayout(1, 0, 2, 4, (256,)), RankLayout(1, 0, 4, 4, (256,)), "kv heads differ"),
        (RankLayout(1, 0, 2, 4, (256,)), RankLayout(2, 0, 2, 4, (256,)), "not 4 tokens"),
        (RankLayout(2, 0, 6, 1, (48,)), RankLayout(3, 1, 6, 1, (32,)), "not multiples"),
        (RankLayout(1, 0, 0, 4, (256,)), RankLayout(2, 0, 0, 4, (128,)), "neither side knows"),
        (RankLayout(2, 1, 4, 1, (32,)), RankLayout(4, 0, 4, 1, (16,)), "share no kv head"),
        (RankLayout(1, 0, 0, 1, (64,), mla=True), RankLayout(1, 0, 2, 1, (64,)), "MLA"),
        (RankLayout(1, 0, 5, 1, (80,)), RankLayout(5, 0, 5, 1, (16,)), None),
        (RankLayout(2, 0, 5, 1, (40,)), RankLayout(1, 0, 5, 1, (80,)), "do not split"),
        (  # a prefill stage's layer the decode (another stage) does not hold
            RankLayout(1, 0, 2, 1, (32, 32), layer_ids=(2, 2)),
            RankLayout(1, 0, 2, 1, (32, 32), layer_ids=(1, 1)),
            "decode rank: .*no .*row for model layer 2",
        ),
        (  # a layer sent three times, held twice (K and V)
            RankLayout(1, 0, 2, 1, (32,) * 3, layer_ids=(0, 0, 0)),
            RankLayout(1, 0, 2, 1, (32,) * 2, layer_ids=(0, 0)),
            "no .*further",
        ),
        (  # a stage of fewer buffers without layer ids: position cannot pair it
            RankLayout(1, 0, 2, 1, (32, 32)),
            RankLayout(1, 0, 2, 1, (32,) * 4, layer_ids=(0, 1, 0, 1)),
            "the prefill sent no layer ids",
        ),
        (  # paired by layer, but the paired buffers hold pages of other sizes
            RankLayout(1, 0, 2, 1, (32, 64), layer_ids=(0, 1)),
            RankLayout(1, 0, 2, 1, (64, 32), layer_ids=(1, 0)),
            None,
        ),
    ],
)
def test_layouts_that_cannot_pair_are_refused_by_name(src, dst, match):
    if match is None:  # control: a valid pair of the same shapes pairs
        sl = head_slice(src, dst)
        assert sl.heads == (0, 1) or sl.dst_buf == (1, 0)
        return
    with pytest.raises(ValueError, match=match):
        head_slice(src, dst)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"{}",
        b'{"tp": 0, "rank": 0, "total_heads": 2, "page_size": 1, "item_lens": [8], "mla": false}',
        b'{"tp": 2, "rank": 2, "total_heads": 2, "page_size": 1, "item_lens": [8], "mla": false}',
        b'{"tp": 1, "rank": 0, "total_heads": 2, "page_size": 1, "item_lens": [], "mla": false}',
        b'{"tp": 1, "rank": 0, "total_heads": 2, "page_size": 1, "item_lens": [8], "mla": 1}',
        b'{"tp": 1, "rank": 0, "total_heads": -1, "page_size": 1, "item_lens": [8], "mla": false}',
        b'{"tp": 1.5, "rank": 0, "total_heads": 2, "page_size": 1, "item_lens": [8], "mla": false}',
        b'{"tp": 1, "rank": 0, "total_heads": 2, "page_size": 1, "item_lens": [8, 8], "mla": false,'
        b' "layer_ids": [0]}',
        b'{"tp": 1, "rank": 0, "total_heads": 2, "page_size": 1, "item_lens": [8], "mla": false,'
        b' "layer_ids": [-1]}',
        b'{"tp": 1, "rank": 0, "total_heads": 2, "page_size": 1, "item_lens": [8], "mla": false,'
        b' "layer_ids": 3}',
    ],
)
def test_malformed_layouts_are_refused(raw):
    with pytest.raises(ValueError, match="malformed KV layout"):
        RankLayout.from_json(raw)


def test_layout_round_trips():
    lay = RankLayout(4, 3, 8, 16, (4096, 4096), mla=False)
    assert RankLayout.from_json(lay.to_json()) == lay
    staged = RankLayout(1, 0, 8, 16, (4096, 4096), layer_ids=(7, 7))
    assert RankLayout.from_json(staged.to_json()) == staged
    # a peer from before pipeline support sends no layer ids: it pairs by position
    old = b'{"tp": 1, "rank": 0, "total_heads": 2, "page_size": 1, "item_lens": [8], "mla": false}'
    assert RankLayout.from_json(old).layer_ids == ()
