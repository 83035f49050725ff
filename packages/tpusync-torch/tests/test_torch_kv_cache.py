"""tpusync.torch.KVCacheManager on CPU: every layout variant, packing, store, P/D, bad input."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import socket
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import tpusync.core as tc
from tpusync.core.kvcache import KVLayout
from tpusync.torch import KVCacheManager, KVStore, PdBlockTransport
from tpusync.torch import _regions as R

N, H, B, D = 12, 2, 4, 8


def _vllm_hnd_view(dtype):
    # vLLM's stride-permuted HND: logical [2, N, B, H, D] over physical [2, N, H, B, D].
    phys = torch.randn(2, N, H, B, D).to(dtype)
    return phys.permute(0, 1, 3, 2, 4), KVLayout.nhd(N, H, B, D, dtype)


def make_layer(variant: str, dtype=torch.float16):
    """One layer's tensors (tuple) and the layout describing them."""
    if variant == "vllm_cpu":
        lay = KVLayout.vllm_cpu(N, H, B, D, dtype)
        return (torch.randn(lay.shape).to(dtype),), lay
    if variant == "nhd":
        lay = KVLayout.nhd(N, H, B, D, dtype)
        return (torch.randn(lay.shape).to(dtype),), lay
    if variant == "hnd":
        lay = KVLayout.hnd(N, H, B, D, dtype)
        return (torch.randn(lay.shape).to(dtype),), lay
    if variant == "hnd_strided":
        t, lay = _vllm_hnd_view(dtype)
        return (t,), lay
    if variant == "block_inside_heads":  # [H, N, B, D] K and V separate (JAX-style pages)
        lay = KVLayout.jax_pages(N, H, B, D, dtype)
        return (torch.randn(lay.shape).to(dtype), torch.randn(lay.shape).to(dtype)), lay
    if variant == "kv_inner":  # flashinfer-like [N, 2, B, H, D]
        lay = KVLayout(("block", "kv", "token", "head", "dim"), N, B, H, D, dtype, "axis")
        return (torch.randn(lay.shape).to(dtype),), lay
    raise AssertionError(variant)


VARIANTS = ["vllm_cpu", "nhd", "hnd", "hnd_strided", "block_inside_heads", "kv_inner"]


def make_cache(variant, layers=3, dtype=torch.float16):
    layer_list, lay = [], None
    for _ in range(layers):
        parts, lay = make_layer(variant, dtype)
        layer_list.append(parts if len(parts) > 1 else parts[0])
    return layer_list, lay


def parts_of(mgr):
    return mgr.kv_caches


def block(t, ax, b):
    return t.select(ax, b)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("per_host", [1, 3])
@pytest.mark.parametrize("batch_bytes", [0, 32 << 20])
def test_round_trip_every_layout(variant, per_host, batch_bytes):
    """Per-layer engine calls (batch_bytes=0) and one call for all layers give the same bytes."""
    caches, lay = make_cache(variant)
    mgr = KVCacheManager(caches, lay, host_blocks=64, layers_per_host_block=per_host)
    mgr.batch_bytes = batch_bytes
    src = [7, 2, 11, 2]
    dst = [0, 5, 9, 3]
    ids = mgr.alloc_host(len(src))
    before = [[p.clone() for p in parts] for parts in parts_of(mgr)]
    mgr.d2h(src, ids).result(timeout=10)
    for parts in parts_of(mgr):
        for p in parts:
            p.zero_()
    mgr.h2d(dst, ids).result(timeout=10)
    ax = lay.block_axis
    for parts, orig in zip(parts_of(mgr), before, strict=True):
        for p, o in zip(parts, orig, strict=True):
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(block(p, ax, d), block(o, ax, s))
            untouched = [b for b in range(N) if b not in dst]
            assert not p.index_select(ax, torch.tensor(untouched)).any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_staged_path_bytes_equal_native_bytes(variant):
    """The CUDA path's device-side gather/scatter (index_select + permute) produces exactly the
    host block bytes of the native segment path, so both ends interoperate."""
    caches, lay = make_cache(variant, layers=1, dtype=torch.bfloat16)
    mgr = KVCacheManager(caches, lay, host_blocks=8)
    ids = mgr.alloc_host(3)
    mgr.d2h([4, 0, 9], ids).result(timeout=10)
    native = np.stack([mgr.pool.view(int(i)) for i in ids[0]])
    idx = torch.tensor([4, 0, 9])
    staged = torch.cat(
        [R.staged_gather(p, lay.block_axis, idx) for p in mgr.kv_caches[0]], dim=1
    ).numpy()
    np.testing.assert_array_equal(native, staged)
    # And the inverse: scatter those bytes elsewhere with the staged path, compare natively.
    copies = [p.clone() for p in mgr.kv_caches[0]]
    off = 0
    for p in copies:
        nb = R.geometry(p, lay.block_axis, lay.axes).block_bytes
        R.staged_scatter(
            p, lay.block_axis, torch.tensor([1, 2, 3]), torch.from_numpy(native[:, off : off + nb])
        )
        off += nb
    for p, c in zip(mgr.kv_caches[0], copies, strict=True):
        for s, d in ((4, 1), (0, 2), (9, 3)):
            assert torch.equal(block(c, lay.block_axis, d), block(p, lay.block_axis, s))


def test_layer_by_layer_futures_and_packed_offsets():
    caches, lay = make_cache("nhd", layers=4)
    mgr = KVCacheManager(caches, lay, host_blocks=16, layers_per_host_block=2)
    assert mgr.num_groups == 2 and mgr.host_block_bytes == 2 * lay.layer_block_bytes
    ids = mgr.alloc_host(2)
    futs = [mgr.d2h_layer(layer, [3, 4], ids) for layer in range(4)]
    for f in futs:
        assert f.result(timeout=10) is None and f.state == "done"
    # Layer 3 lives in group 1 at offset 1 * layer_block_bytes of host block ids[1][0].
    raw = mgr.pool.view(int(ids[1][0]), torch.float16 and "float16")
    half = lay.layer_block_bytes // 2
    k3 = caches[3][0, 3].reshape(-1).numpy()
    np.testing.assert_array_equal(raw[half : half + k3.size], k3)


def test_store_save_lookup_load_and_dedup_through_disk_tier(tmp_path):
    caches, lay = make_cache("vllm_cpu", layers=2)
    probe = KVCacheManager(caches, lay, host_blocks=1)
    store = KVStore(probe.host_block_bytes, 4, disk_dir=tmp_path, disk_blocks=256, direct_io=False)
    cap = store.stats()["tiers"]["host"]["capacity_blocks"]
    n = max(cap, 8)  # the load below reads 6 of them
    mgr = KVCacheManager(caches, lay, host_blocks=4 * n, store=store)
    # n hashes x 2 layer groups: at least twice what DRAM holds, so the oldest are read from disk.
    hashes = [i.to_bytes(4, "big") * 8 for i in range(n)]
    src = [i % N for i in range(n)]
    assert mgr.lookup(hashes) == 0
    saved = mgr.save(hashes, src)
    saved.result(timeout=30)
    store.flush(timeout=30)
    assert mgr.lookup(hashes) == n and mgr.lookup([b"zz" * 16, *hashes]) == 0
    assert mgr.pool.num_free == mgr.pool.num_blocks  # staging blocks returned
    again = mgr.save(hashes[:2], [1, 1])  # already stored: skipped, nothing copied
    again.layer(1).result(timeout=10)
    again.result(timeout=10)
    orig = [c.clone() for c in caches]
    dst = [0, 1, 2, 3, 4, 11]
    out = mgr.load(hashes[:6], dst)
    out.layer(0).result(timeout=30)
    out.result(timeout=30)
    for c, o in zip(caches, orig, strict=True):
        for d, s in zip(dst, src[:6], strict=True):
            assert torch.equal(c[d], o[s])
    assert mgr.pool.num_free == mgr.pool.num_blocks
    assert store.stats()["tiers"]["disk"]["hits"] >= 6  # the oldest keys left DRAM
    with pytest.raises(tc.NotFoundError, match="position 0"):
        mgr.load([b"missing" * 4], [0])
    with pytest.raises(tc.InvalidArgumentError, match="1..54 bytes"):
        mgr.lookup([b"x" * 55])


def test_store_warm_restart_serves_a_new_manager(tmp_path):
    caches, lay = make_cache("nhd", layers=2)
    bb = KVCacheManager(caches, lay, host_blocks=1).host_block_bytes
    ns = f"integ-{tmp_path.name}"[:40]
    kw = dict(disk_dir=tmp_path, disk_blocks=16, namespace=ns, fingerprint="m1", direct_io=False)
    try:
        with KVStore(bb, 8, **kw) as store:
            KVCacheManager(caches, lay, host_blocks=4, store=store).save([b"w" * 32], [3]).result(
                timeout=30
            )
            store.flush(timeout=30)
        dst = [torch.zeros_like(c) for c in caches]
        with KVStore(bb, 8, **kw) as store:
            mgr = KVCacheManager(dst, lay, host_blocks=4, store=store)
            assert mgr.lookup([b"w" * 32]) == 1
            mgr.load([b"w" * 32], [0]).result(timeout=30)
        for c, d in zip(caches, dst, strict=True):
            assert torch.equal(d[:, 0], c[:, 3])
    finally:
        KVStore.unlink_namespace(ns)


def test_store_keys_carry_the_format_so_other_formats_miss():
    caches, lay = make_cache("vllm_cpu", layers=2)
    probe = KVCacheManager(caches, lay, host_blocks=1)
    store = KVStore(probe.host_block_bytes, 8)
    writer = KVCacheManager(caches, lay, host_blocks=4, store=store)
    writer.save([b"k" * 32], [1]).result(timeout=10)
    # Same bytes per block, different block_size / heads split: a miss, never foreign bytes.
    other = KVLayout.vllm_cpu(N, H * 2, B // 2, D, torch.float16)
    reader = KVCacheManager(
        [torch.zeros(other.shape, dtype=torch.float16) for _ in range(2)],
        other,
        host_blocks=4,
        store=store,
    )
    assert reader.format.host_block_bytes == writer.format.host_block_bytes
    assert writer.lookup([b"k" * 32]) == 1 and reader.lookup([b"k" * 32]) == 0
    with pytest.raises(tc.NotFoundError):
        reader.load([b"k" * 32], [0])
    assert not reader.kv_caches[0][0].any()
    with pytest.raises(tc.InvalidArgumentError, match="store field 'block_bytes'"):
        KVCacheManager(caches, lay, host_blocks=4, store=KVStore(probe.host_block_bytes * 2, 2))


def test_bad_input_refused_before_any_byte_moves():
    caches, lay = make_cache("hnd", layers=2)
    mgr = KVCacheManager(caches, lay, host_blocks=8)
    ids = mgr.alloc_host(2)
    snap = mgr.pool.view(int(ids[0][0])).copy()
    with pytest.raises(
        tc.InvalidArgumentError, match=r"block id 12 \(position 1\) is out of range"
    ):
        mgr.d2h([0, 12], ids)
    with pytest.raises(tc.InvalidArgumentError, match="out of range"):
        mgr.h2d([-1, 0], ids)
    with pytest.raises(tc.InvalidArgumentError, match="repeat"):
        mgr.h2d([3, 3], ids)
    with pytest.raises(tc.InvalidArgumentError, match=r"expected \(2, 3\)"):
        mgr.d2h([0, 1, 2], ids)
    with pytest.raises(tc.InvalidArgumentError, match="layer 5 out of range"):
        mgr.d2h_layer(5, [0, 1], ids)
    # Float ids were truncated (into another block), negative ones overflowed, layer 0.9 was 0.
    with pytest.raises(tc.InvalidArgumentError, match="host ids must be integers"):
        mgr.d2h([0, 1], ids.astype(np.float64) + 0.7)
    with pytest.raises(tc.InvalidArgumentError, match="host ids must be >= 0"):
        mgr.d2h([0, 1], -np.ones((2, 2), np.int64))
    with pytest.raises(tc.InvalidArgumentError, match="is not an int"):
        mgr.d2h([0, 1], ids, layers=[0.9])
    np.testing.assert_array_equal(mgr.pool.view(int(ids[0][0])), snap)
    mgr.free_host(ids)
    with pytest.raises(tc.TpusyncError):  # freed host ids: refused by the native borrow check
        mgr.d2h([0, 1], ids).result(timeout=10)


def test_layout_mismatches_name_the_field():
    lay = KVLayout.nhd(N, H, B, D, torch.float16)
    with pytest.raises(tc.InvalidArgumentError, match="field 'dtype'"):
        KVCacheManager([torch.zeros(lay.shape, dtype=torch.float32)], lay, host_blocks=2)
    with pytest.raises(tc.InvalidArgumentError, match="field 'block_size'"):
        KVCacheManager([torch.zeros(2, N, B + 1, H, D, dtype=torch.float16)], lay, host_blocks=2)
    with pytest.raises(tc.InvalidArgumentError, match="field 'num_kv_heads'"):
        KVCacheManager([torch.zeros(2, N, B, H + 1, D, dtype=torch.float16)], lay, host_blocks=2)
    with pytest.raises(tc.InvalidArgumentError, match="field 'kv'"):
        KVCacheManager(
            [torch.zeros(lay.shape, dtype=torch.float16)] * 1,
            KVLayout.jax_pages(N, H, B, D, "float16"),
            host_blocks=2,
        )
    with pytest.raises(tc.InvalidArgumentError, match="field 'block_bytes'"):
        KVCacheManager(
            [torch.zeros(lay.shape, dtype=torch.float16)], lay, pool=tc.HostBlockPool(4096, 2)
        )
    with pytest.raises(tc.InvalidArgumentError, match="field 'axes'"):
        KVLayout(("block", "token"), N, B, H, D, "float16", "fused")


class FakeTransport:
    """In-process stand-in for the network transport (a test double, not a transport)."""

    def __init__(self, dead: bool = False, silent: bool = False) -> None:
        self.published: dict[str, tuple] = {}
        self.dead, self.silent = dead, silent
        self.pending: list[cf.Future] = []

    def publish(self, transfer_id, pool, block_ids, meta):
        self.published[transfer_id] = (pool, list(block_ids), dict(meta))

    def retract(self, transfer_id):
        self.published.pop(transfer_id)

    def fetch(self, peer, transfer_id, pool, block_ids):
        f: cf.Future = cf.Future()
        if self.dead:
            threading.Timer(
                0.01, lambda: f.set_exception(tc.UnavailableError(f"peer {peer} is dead"))
            ).start()
            return f
        if self.silent:
            self.pending.append(f)
            return f
        src_pool, src_ids, meta = peer.published[transfer_id]
        for s, d in zip(src_ids, block_ids, strict=True):
            pool.view(d)[:] = src_pool.view(s)
        f.set_result(meta)
        return f


SECRET = b"integ-test-secret-0123456789"


def test_pd_register_send_start_recv_poll_over_tcp():
    caches, lay = make_cache("hnd_strided", layers=2)
    pool = tc.HostBlockPool(KVCacheManager(caches, lay, host_blocks=1).host_block_bytes, 8)
    with PdBlockTransport(pool, secret=SECRET) as prod_t:
        prod = KVCacheManager(caches, lay, pool=pool, transport=prod_t)
        dst_caches = [torch.zeros_like(c) for c in caches]
        cpool = tc.HostBlockPool(pool.block_bytes, 8)
        cons = KVCacheManager(
            dst_caches, lay, pool=cpool, transport=PdBlockTransport(cpool, secret=SECRET)
        )
        prod.register_send("req-1", [3, 8]).result(timeout=10)
        f = cons.start_recv(prod_t.address, "req-1", [0, 1])
        f.result(timeout=20)
        assert cons.poll() == {"done": ["req-1"], "failed": {}}
        for c, d in zip(caches, dst_caches, strict=True):
            assert torch.equal(d[:, 0], c[:, 3]) and torch.equal(d[:, 1], c[:, 8])
        prod.finish_send("req-1")
        assert cpool.num_free == cpool.num_blocks  # staging and meta blocks returned


def test_pd_mismatched_peer_format_refused_by_field():
    caches, lay = make_cache("nhd", layers=2)
    pool = tc.HostBlockPool(KVCacheManager(caches, lay, host_blocks=1).host_block_bytes, 8)
    with PdBlockTransport(pool, secret=SECRET) as prod_t:
        prod = KVCacheManager(caches, lay, pool=pool, transport=prod_t)
        prod.register_send("r", [1]).result(timeout=10)
        hnd = KVLayout.hnd(N, H, B, D, torch.float16)
        cpool = tc.HostBlockPool(pool.block_bytes, 8)
        cons = KVCacheManager(
            [torch.zeros(hnd.shape, dtype=torch.float16) for _ in range(2)],
            hnd,
            pool=cpool,
            transport=PdBlockTransport(cpool, secret=SECRET),
        )
        f = cons.start_recv(prod_t.address, "r", [0])
        with pytest.raises(tc.InvalidArgumentError, match="field 'memory_order'"):
            f.result(timeout=20)
        assert not cons.kv_caches[0][0].any()
        assert "r" in cons.poll()["failed"]


def test_pd_wrong_secret_or_no_producer_fails_the_future():
    caches, lay = make_cache("nhd", layers=1)
    pool = tc.HostBlockPool(KVCacheManager(caches, lay, host_blocks=1).host_block_bytes, 8)
    prod_t = PdBlockTransport(pool, secret=SECRET)
    prod = KVCacheManager(caches, lay, pool=pool, transport=prod_t)
    prod.register_send("s", [2]).result(timeout=10)
    cpool = tc.HostBlockPool(pool.block_bytes, 8)
    bad = PdBlockTransport(cpool, secret=b"another-secret-0123456789")
    cons = KVCacheManager([torch.zeros_like(caches[0])], lay, pool=cpool, transport=bad)
    with pytest.raises(tc.UnavailableError):
        cons.start_recv(prod_t.address, "s", [0]).result(timeout=20)
    addr = prod_t.address
    prod_t.close()
    good = PdBlockTransport(cpool, secret=SECRET)
    cons2 = KVCacheManager([torch.zeros_like(caches[0])], lay, pool=cpool, transport=good)
    with pytest.raises(tc.UnavailableError):
        cons2.start_recv(addr, "s", [0]).result(timeout=20)


def test_dead_or_silent_peer_is_a_failed_future_not_a_hang():
    caches, lay = make_cache("nhd", layers=1)
    cons = KVCacheManager(caches, lay, host_blocks=8, transport=FakeTransport(dead=True))
    f = cons.start_recv("peer-a", "x", [0])
    with pytest.raises(tc.UnavailableError, match="dead"):
        f.result(timeout=10)
    silent = FakeTransport(silent=True)
    cons2 = KVCacheManager(caches, lay, host_blocks=8, transport=silent)
    g = cons2.start_recv("peer-b", "y", [1], timeout=0.2)
    with pytest.raises(tc.TimeoutError, match="not received after 0.2 s"):
        g.result(timeout=10)
    # The staging block stays held while the transport may still write into it.
    assert cons2.pool.num_free == cons2.pool.num_blocks - 1
    silent.pending[0].set_exception(tc.UnavailableError("gone"))
    assert cons2.pool.num_free == cons2.pool.num_blocks


def test_protocols_are_checked():
    caches, lay = make_cache("nhd", layers=1)
    with pytest.raises(tc.InvalidArgumentError, match="KVStore protocol"):
        KVCacheManager(caches, lay, host_blocks=2, store=object())
    with pytest.raises(tc.InvalidArgumentError, match="BlockTransport protocol"):
        KVCacheManager(caches, lay, host_blocks=2, transport=object())


def test_save_the_store_could_not_keep_fails_and_frees_staging():
    caches, lay = make_cache("nhd", layers=2)
    bb = KVCacheManager(caches, lay, host_blocks=1).host_block_bytes

    class FullStore:
        """A KVStore double whose put keeps nothing (a store full of pinned blocks)."""

        block_bytes = bb

        def lookup(self, keys):
            return 0, []

        def put(self, keys, src, rows=None):
            f: cf.Future = cf.Future()
            f.set_result([False] * len(keys))
            return f

        def get(self, keys, dst, rows=None):
            raise AssertionError("not used")

    mgr = KVCacheManager(caches, lay, host_blocks=4, store=FullStore())
    with pytest.raises(tc.PoolExhaustedError, match="kept 0 of 2"):
        mgr.save([b"k" * 32], [1]).result(timeout=10)
    assert mgr.pool.num_free == mgr.pool.num_blocks


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("per_host", [1, 3])
def test_cuda_data_path_on_cpu_tensors_matches_native_path(variant, per_host):
    """The CUDA path's data movement (sorted-slot runs, staging, index_select / index_copy_,
    coalesced DMA slices of the whole-pool tensor), run on CPU tensors, writes the same host
    bytes as the native path and loads them back exactly. Streams, events and pinning are what
    only ci/device/gpu_check.sh covers."""
    caches, lay = make_cache(variant)
    mgr = KVCacheManager(caches, lay, host_blocks=64, layers_per_host_block=per_host)
    mgr._pool_u8 = R.pool_tensor(mgr.pool)
    scratch = mgr.alloc_host(8)
    mgr.free_host(scratch[:, ::2])  # later allocations get out-of-order, gapped slots
    src = np.array([9, 1, 4, 1])
    native, staged = mgr.alloc_host(4), mgr.alloc_host(4)
    mgr.d2h(src, native).result(timeout=10)
    for layer in range(mgr.num_layers):
        g, off = mgr._where(layer)
        mgr._staged_d2h(layer, src, mgr._borrow(staged[g].tolist()).slots, off)
    for a, b in zip(native.reshape(-1), staged.reshape(-1), strict=True):
        np.testing.assert_array_equal(mgr.pool.view(int(a)), mgr.pool.view(int(b)))
    before = [[p.clone() for p in parts] for parts in mgr.kv_caches]
    dst = np.array([0, 2, 3, 11])
    for layer in range(mgr.num_layers):
        g, off = mgr._where(layer)
        mgr._staged_h2d(layer, dst, mgr._borrow(staged[g].tolist()).slots, off)
    ax = lay.block_axis
    for parts, orig in zip(mgr.kv_caches, before, strict=True):
        for p, o in zip(parts, orig, strict=True):
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(block(p, ax, d), block(o, ax, s))
            assert torch.equal(block(p, ax, 5), block(o, ax, 5))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("per_host", [1, 3])
def test_consecutive_blocks_and_slots_per_layer_batches(variant, per_host):
    """Consecutive device blocks into consecutive pool slots (runs the native copy coalesces)
    and the same blocks into reversed slots (runs that must not merge), one engine call per
    layer (each batch passes only its own group's host ids): every block lands in its own place."""
    caches, lay = make_cache(variant)
    mgr = KVCacheManager(caches, lay, host_blocks=64, layers_per_host_block=per_host)
    mgr.batch_bytes = 0
    before = [[p.clone() for p in parts] for parts in parts_of(mgr)]
    src = [3, 4, 5, 6]
    fwd = mgr.alloc_host(len(src))
    rev = fwd[:, ::-1].copy()
    mgr.d2h(src, fwd).result(timeout=10)
    for dst, ids in (([0, 1, 2, 3], fwd), ([8, 9, 10, 11], rev)):
        mgr.h2d(dst, ids).result(timeout=10)
    ax = lay.block_axis
    for parts, orig in zip(parts_of(mgr), before, strict=True):
        for p, o in zip(parts, orig, strict=True):
            for s, d_fwd, d_rev in zip(src, [0, 1, 2, 3], [11, 10, 9, 8], strict=True):
                assert torch.equal(block(p, ax, d_fwd), block(o, ax, s))
                assert torch.equal(block(p, ax, d_rev), block(o, ax, s))


def test_freed_host_id_in_a_later_batch_refused_before_any_byte_moves():
    """A bulk call moves in batches that each borrow only their own rows; a freed id in the last
    layer's row is still refused for the whole call before the first layer moves."""
    caches, lay = make_cache("block_inside_heads")
    mgr = KVCacheManager(caches, lay, host_blocks=64)
    mgr.batch_bytes = 0
    ids = mgr.alloc_host(2)
    mgr.d2h([1, 2], ids).result(timeout=10)
    snap = [mgr.pool.view(int(i)).copy() for i in ids[0]]
    cache_before = [p.clone() for p in mgr.kv_caches[0]]
    mgr.pool.free([int(ids[-1][-1])])
    with pytest.raises(tc.TpusyncError):
        mgr.d2h([5, 6], ids).result(timeout=10)
    with pytest.raises(tc.TpusyncError):
        mgr.h2d([5, 6], ids).result(timeout=10)
    for i, s in zip(ids[0], snap, strict=True):
        np.testing.assert_array_equal(mgr.pool.view(int(i)), s)
    for p, o in zip(mgr.kv_caches[0], cache_before, strict=True):
        assert torch.equal(p, o)


def test_store_save_and_load_when_the_pool_is_rounded_up_to_whole_pages():
    """768-byte host blocks: the pool's size is rounded up to whole pages, so pool_bytes //
    num_blocks is not the slot stride; every save of a block past slot 0 was refused."""
    lay = KVLayout.hnd(6, 3, 4, 8, torch.float32)
    caches = [torch.randn(lay.shape)]
    mgr = KVCacheManager(caches, lay, host_blocks=8, store=KVStore(768, 64, huge_pages=False))
    assert mgr.host_block_bytes == 768
    assert mgr.pool.native.pool_bytes // mgr.pool.num_blocks != mgr.pool.native.block_stride
    mgr.save([b"a", b"b", b"c"], [0, 1, 2]).result(timeout=10)
    assert mgr.lookup([b"a", b"b", b"c"]) == 3
    orig = caches[0].clone()
    mgr.load([b"c", b"a"], [4, 5]).result(timeout=10)
    assert torch.equal(caches[0][:, 4], orig[:, 2]) and torch.equal(caches[0][:, 5], orig[:, 0])


def test_d2h_refuses_a_host_block_written_twice():
    """Two device blocks (or two layer groups) gathered into one host block raced; one was lost."""
    caches, lay = make_cache("hnd", layers=2)
    mgr = KVCacheManager(caches, lay, host_blocks=8)
    ids = mgr.alloc_host(2)
    snap = mgr.pool.view(int(ids[0][0])).copy()
    twice = ids.copy()
    twice[0, 1] = twice[0, 0]
    with pytest.raises(tc.InvalidArgumentError, match="more than once"):
        mgr.d2h([1, 2], twice)
    across = ids.copy()
    across[1, 0] = across[0, 1]  # layer group 1 writes layer group 0's host block
    with pytest.raises(tc.InvalidArgumentError, match="more than once"):
        mgr.d2h_layer(0, [1, 2], across)
    np.testing.assert_array_equal(mgr.pool.view(int(ids[0][0])), snap)
    mgr.h2d([1, 2], twice).result(timeout=10)  # reading one host block twice is fine


def test_cache_parts_that_share_memory_are_refused():
    """ALIAS RULE: one tensor as K and V, or as two layers, was accepted; a load into one part
    then changed the other."""
    lay = KVLayout.jax_pages(N, H, B, D, torch.float16)
    kv = torch.zeros(lay.shape, dtype=torch.float16)
    with pytest.raises(tc.InvalidArgumentError, match="layer 0 part 1 is the same memory"):
        KVCacheManager([(kv, kv)], lay, host_blocks=4)
    hnd = KVLayout.hnd(N, H, B, D, torch.float16)
    one = torch.zeros(hnd.shape, dtype=torch.float16)
    with pytest.raises(tc.InvalidArgumentError, match="layer 1 part 0 is the same memory"):
        KVCacheManager([one, one], hnd, host_blocks=4)
    # K and V as the two halves of one tensor share no byte: accepted.
    both = torch.zeros((2, *lay.shape), dtype=torch.float16)
    KVCacheManager([(both[0], both[1])], lay, host_blocks=4)


def test_a_cache_whose_blocks_overlap_is_refused():
    """BLOCKS APART RULE: an as_strided cache with a block stride of half a block was accepted;
    a load into block 1 then changed block 0."""
    lay = KVLayout.hnd(N, H, B, D, torch.float16)
    blk = H * B * D
    base = torch.zeros(2 * N * blk, dtype=torch.float16)
    t = base.as_strided(lay.shape, (N * blk, blk // 2, B * D, D, 1))
    with pytest.raises(tc.InvalidArgumentError, match="make blocks overlap"):
        KVCacheManager([t], lay, host_blocks=4)


def test_pd_finish_send_cancels_the_send_so_its_blocks_and_id_come_back_at_once():
    """RETRACT CONTRACT: the native send was only forgotten; its blocks and its id stayed taken
    until send_deadline (60 s by default)."""
    caches, lay = make_cache("hnd", layers=2)
    pool = tc.HostBlockPool(KVCacheManager(caches, lay, host_blocks=1).host_block_bytes, 16)
    with PdBlockTransport(pool, secret=SECRET, send_deadline=600.0) as t:
        mgr = KVCacheManager(caches, lay, pool=pool, transport=t)
        mgr.register_send("req-9", [1, 2, 3]).result(timeout=10)
        mgr.finish_send("req-9")
        assert pool.num_free == pool.num_blocks
        mgr.register_send("req-9", [1, 2, 3]).result(timeout=10)  # the id is free again
        mgr.finish_send("req-9")


def test_pd_start_recv_that_times_out_abandons_its_fetch():
    """ABANDON CONTRACT: after start_recv's own timeout the fetch ran on until recv_deadline,
    holding its staging blocks and refusing a retry of the same id."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []  # accepted connections that never get an answer (a hung producer)
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        caches, lay = make_cache("hnd", layers=1)
        pool = tc.HostBlockPool(KVCacheManager(caches, lay, host_blocks=1).host_block_bytes, 16)
        t = PdBlockTransport(pool, secret=SECRET, recv_deadline=600.0)
        mgr = KVCacheManager(caches, lay, pool=pool, transport=t)
        peer = f"127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(tc.TimeoutError):
            mgr.start_recv(peer, "req-1", [0, 1, 2], timeout=1.0).result(timeout=30)
        deadline = time.monotonic() + 20
        while pool.num_free != pool.num_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.num_free == pool.num_blocks
        assert "req-1" in mgr.poll()["failed"]
        with pytest.raises(tc.TimeoutError):  # the same id may be fetched again
            mgr.start_recv(peer, "req-1", [0, 1, 2], timeout=0.5).result(timeout=30)
    finally:
        stop.set()
        listener.close()
        for c in held:
            c.close()


def test_a_tensor_whose_memory_was_moved_or_freed_is_refused():
    """The byte regions were captured once: after resize_(0) of a tensor's storage (sleep-mode
    offload, FSDP) a d2h segfaulted; after set_() an h2d wrote into the old storage."""
    caches, lay = make_cache("hnd", layers=2)
    mgr = KVCacheManager(caches, lay, host_blocks=8)
    ids = mgr.alloc_host(1)
    mgr.d2h([1], ids).result(timeout=10)
    caches[1].set_(torch.zeros_like(caches[1]))
    with pytest.raises(tc.StateError, match="layer 1 part 0: its memory was moved or freed"):
        mgr.h2d([2], ids)
    caches[0].untyped_storage().resize_(0)
    with pytest.raises(tc.StateError, match="layer 0 part 0: its memory was moved or freed"):
        mgr.d2h([1], ids, layers=[0])


def _read_only_tensor(tmp_path, like: torch.Tensor) -> torch.Tensor:
    """A tensor over a read-only file mapping (torch keeps no read-only flag; it only warns)."""
    path = tmp_path / "cache.npy"
    np.save(path, like.numpy())
    with warnings.catch_warnings():  # torch warns once per process
        warnings.simplefilter("ignore")
        return torch.from_numpy(np.load(path, mmap_mode="r"))


def test_a_load_into_read_only_memory_is_refused_not_a_segfault(tmp_path):
    """WRITABLE MEMORY CHECK: an h2d into a cache over a read-only mapping killed the process with
    SIGSEGV in the native copy. A save from it still works."""
    caches, lay = make_cache("hnd", layers=2)
    ro = _read_only_tensor(tmp_path, caches[1])
    mgr = KVCacheManager([caches[0], ro], lay, host_blocks=8)
    ids = mgr.alloc_host(2)
    mgr.d2h([1, 2], ids).result(timeout=10)  # reading read-only memory is fine
    with pytest.raises(tc.InvalidArgumentError, match=r"layer 1 part 0: .* is read-only"):
        mgr.h2d([1, 2], ids)
    with pytest.raises(tc.InvalidArgumentError, match="is read-only"):
        mgr.h2d_layer(0, [1, 2], ids)  # checked for the whole cache, not only the layer loaded
    fine = KVCacheManager([torch.zeros_like(c) for c in caches], lay, pool=mgr.pool)
    fine.h2d([1, 2], ids).result(timeout=10)
    ax = lay.block_axis
    for b in (1, 2):
        assert torch.equal(block(fine.kv_caches[1][0], ax, b), block(ro, ax, b))
