"""Layouts, geometry, segment plans, formats, weight plans and futures of tpusync.core.kvcache
(framework-free: numpy arrays stand in for device tensors)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tpusync.core as tc
from tpusync.core import _native
from tpusync.core.kvcache import (
    BlockFormat,
    BlockTransport,
    KVLayout,
    PdBlockTransport,
    check_format,
)
from tpusync.core.kvcache import KVStore as KVStoreProtocol
from tpusync.core.kvcache.futures import TransferFuture, from_native, gather
from tpusync.core.kvcache.layout import PieceGeometry
from tpusync.core.kvcache.plan import Piece, check_block_ids, segments_for
from tpusync.core.kvcache.weights import plan_weights, weight_segments
from tpusync.core.store import KVStore


def geometry_of(a: np.ndarray, block_axis: int) -> PieceGeometry:
    axes = [f"a{i}" for i in range(a.ndim)]
    return PieceGeometry.of(a.shape, a.strides, a.itemsize, block_axis, axes)


def byte_region(a: np.ndarray, g: PieceGeometry) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(a, (g.region_bytes // a.itemsize,), (a.itemsize,)).view(
        np.uint8
    )


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    data=st.data(),
)
def test_segment_gather_equals_numpy_take_for_any_axis_order(shape, data):
    """For any shape, block axis and physical axis order (a transposed view), the native segment
    gather yields each block's elements in memory order - what np.take + transpose gives."""
    nd = len(shape)
    perm = data.draw(st.permutations(range(nd)))
    ax = data.draw(st.integers(0, nd - 1))
    phys = np.arange(int(np.prod(shape)), dtype=np.int32).reshape([shape[p] for p in perm])
    a = phys.transpose(np.argsort(perm))  # logical view with permuted strides
    g = geometry_of(a, ax)
    nblocks = a.shape[ax]
    blocks = np.array(data.draw(st.lists(st.integers(0, nblocks - 1), min_size=1, max_size=4)))
    pool = tc.HostBlockPool(max(64, g.block_bytes), len(blocks))
    ids = pool.alloc(len(blocks))
    segs = segments_for(blocks, [Piece(0, g, 0)])
    _native.put_segments(pool.engine, pool.native, ids, [byte_region(a, g)], segs).result(
        timeout=10
    )
    rest = sorted((d for d in range(nd) if d != ax), key=lambda d: (-a.strides[d], d))
    for i, b in enumerate(blocks):
        want = np.take(a, b, axis=ax).transpose([d - (d > ax) for d in rest]).reshape(-1)
        got = pool.view(ids[i], np.int32)[: want.size]
        np.testing.assert_array_equal(got, want)


def test_geometry_merges_contiguous_runs():
    a = np.zeros((2, 10, 4, 8, 16), np.float16)  # [kv, block, token, head, dim]
    g = geometry_of(a, 1)
    assert g.run_bytes == 4 * 8 * 16 * 2 and g.run_offsets.tolist() == [0, 10 * g.run_bytes]
    pages = np.zeros((4, 10, 16, 128), np.float16)  # block axis inside heads
    g = geometry_of(pages, 1)
    assert g.run_bytes == 16 * 128 * 2 and g.run_offsets.size == 4
    with pytest.raises(tc.InvalidArgumentError, match="negative strides"):
        geometry_of(np.zeros((4, 4))[::-1], 0)
    with pytest.raises(tc.InvalidArgumentError, match="zero"):
        geometry_of(np.broadcast_to(np.zeros((1, 4)), (3, 4)).T, 1)


def test_a_size_1_axis_does_not_change_the_memory_order():
    """SIZE-1 AXES: one KV head per rank (GQA under tensor parallelism). torch and numpy / JAX
    give that axis different strides for the same bytes; the formats differed, so a torch
    producer and a JAX consumer refused each other and their store keys missed."""
    a = np.zeros((2, 10, 1, 4, 8), np.float16)  # [kv, block, head=1, token, dim]
    other = np.lib.stride_tricks.as_strided(a, a.shape, (*a.strides[:2], 2, *a.strides[3:]))
    g, h = geometry_of(a, 1), geometry_of(other, 1)
    assert g.memory_order == h.memory_order == ("a0", "a1", "a3", "a4")
    assert g.run_offsets.tolist() == h.run_offsets.tolist() and g.run_bytes == h.run_bytes


def test_blocks_that_share_bytes_are_refused_interleaved_ones_pass():
    """BLOCKS APART RULE: an as_strided cache whose block stride is shorter than a block was
    accepted, and a load into one block changed its neighbour."""
    axes = ("block", "x")

    def geo(stride_block, stride_x, n=2, x=3):
        return PieceGeometry.of((n, x), (stride_block, stride_x), 1, 0, axes)

    with pytest.raises(tc.InvalidArgumentError, match="make blocks overlap"):
        geo(2, 1)  # block 1 starts inside block 0
    with pytest.raises(tc.InvalidArgumentError, match="make blocks overlap"):
        geo(2, 2)  # bytes 0,2,4 and 2,4,6
    geo(3, 1)  # dense
    geo(1, 2)  # interleaved: 0,2,4 and 1,3,5 (the quick test passes)
    geo(3, 2)  # 0,2,4 and 3,5,7: apart, found by the exact test (the quick one fails)
    # The JAX page layout [heads, blocks, tokens, dim] with the block axis inside the heads.
    a = np.zeros((4, 16, 8, 2), np.float32)
    geometry_of(a, 1)


def test_block_id_checks():
    assert check_block_ids([0, 3], 4, "x", unique=True).tolist() == [0, 3]
    with pytest.raises(tc.InvalidArgumentError, match=r"block id 4 \(position 1\)"):
        check_block_ids([0, 4], 4, "x", unique=False)
    with pytest.raises(tc.InvalidArgumentError, match="repeat"):
        check_block_ids([1, 1], 4, "x", unique=True)
    with pytest.raises(tc.InvalidArgumentError, match="integers"):
        check_block_ids([0.5], 4, "x", unique=False)


def test_layout_validation_names_fields():
    with pytest.raises(tc.InvalidArgumentError, match="field 'kv'"):
        KVLayout(("block", "token", "dim"), 4, 4, 1, 8, "float16", "weird")
    with pytest.raises(tc.InvalidArgumentError, match=r"lacks \['head'\]"):
        KVLayout(("block", "token", "dim"), 4, 4, 2, 8, "float16", "fused")
    with pytest.raises(tc.InvalidArgumentError, match="'block_size' must be > 0"):
        KVLayout.nhd(4, 2, 0, 8, "float16")
    lay = KVLayout.vllm_cpu(4, 2, 16, 8, "bfloat16")
    assert lay.shape == (4, 2, 16, 16) and lay.layer_block_bytes == 2 * 16 * 16 * 2
    with pytest.raises(tc.InvalidArgumentError, match="field 'head_dim'"):
        lay.check_tensor((4, 2, 16, 8), "bfloat16", "t")


def test_format_fingerprint_and_mismatch_message():
    a = BlockFormat("float16", 16, 8, 128, "axis", (("kv", "block"),), 4, 1, 64, 64)
    b = BlockFormat.from_dict({**a.to_dict(), "block_size": 32, "dtype": "bfloat16"})
    assert BlockFormat.from_dict(a.to_dict()) == a and a.fingerprint != b.fingerprint
    with pytest.raises(tc.InvalidArgumentError, match="field 'dtype'.*field 'block_size'"):
        check_format(a, b, "peer p")
    with pytest.raises(tc.InvalidArgumentError, match="unreadable"):
        check_format(a, {"dtype": "x"}, "peer p")


def test_format_of_layout_groups_layers_and_refuses_a_group_outside_the_layer_count():
    lay = KVLayout.vllm_cpu(4, 2, 16, 8, "bfloat16")
    order = (("kv", "head", "token", "dim"),)
    f = BlockFormat.of_layout(lay, order, num_layers=6, layers_per_host_block=4)
    assert (f.layer_block_bytes, f.host_block_bytes, f.num_groups) == (1024, 4096, 2)
    assert (f.dtype, f.block_size, f.num_kv_heads, f.head_dim, f.shards) == (
        "bfloat16", 16, 2, 8, ()
    )  # fmt: skip
    for bad in (0, 7):
        with pytest.raises(tc.InvalidArgumentError, match=rf"in \[1, 6\], got {bad}"):
            BlockFormat.of_layout(lay, order, num_layers=6, layers_per_host_block=bad)


def test_weight_plan_buckets_never_split_tensors():
    items = [("a", "float32", (100,), 400), ("b", "uint8", (5000,), 5000), ("c", "int64", (1,), 8)]
    m = plan_weights(items, 1024, 2048)
    assert [e.bucket for e in m.entries] == [0, 1, 2]
    for e in m.entries:
        first, end = m.buckets[e.bucket]
        assert first * 1024 <= e.offset and e.offset + e.nbytes <= end * 1024
        assert e.offset % 64 == 0
    rows = weight_segments(m, 1, [0])
    assert rows[:, 4].sum() == 5000 and rows[0, 3] == 0
    with pytest.raises(tc.InvalidArgumentError, match="repeat"):
        plan_weights([("a", "f", (1,), 1)] * 2, 64, 64)


def test_real_store_and_transport_satisfy_the_protocols():
    store = KVStore(4096, 4)
    assert isinstance(store, KVStoreProtocol)
    pool = tc.HostBlockPool(256, 16)
    t = PdBlockTransport(pool, secret=b"plan-test-secret-0123456789")
    try:
        assert isinstance(t, BlockTransport) and t.meta_blocks == 8  # ceil(2048 / 256)
        with pytest.raises(tc.InvalidArgumentError, match="another host pool"):
            t.publish("x", tc.HostBlockPool(256, 2), [], {})
        with pytest.raises(tc.InvalidArgumentError, match="exceeds"):
            t.publish("x", pool, [], {"big": "y" * 4096})
        assert pool.num_free == 16  # a refused publish takes nothing
    finally:
        t.close()


def test_futures_time_out_and_propagate_errors():
    f = TransferFuture("slow")
    t0 = time.monotonic()
    with pytest.raises(tc.TimeoutError, match="slow not complete after 0.05 s"):
        f.result(timeout=0.05)
    assert time.monotonic() - t0 < 5
    bad: cf.Future = cf.Future()
    g = gather([f, bad], "both")
    bad.set_exception(tc.UnavailableError("peer died"))
    with pytest.raises(tc.UnavailableError):
        g.result(timeout=5)
    f.set_result(None)
    pool = tc.HostBlockPool(4096, 2)
    ids = pool.alloc(1)
    nf = from_native(pool.get(ids, np.zeros(4096, np.uint8)), "get")
    done: list = []
    nf.add_done_callback(done.append)
    assert nf.result(timeout=10) is None and nf.state == "done"
    for _ in range(1000):
        if done:
            break
        time.sleep(0.005)
    assert done == [nf]
