"""tpusync.jax.KVCacheManager on CPU: layouts, sharded arrays, staged path, store, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tpusync.core as tc
from tpusync.jax import KVCacheManager, KVLayout, KVStore, flatten_weights, restore_weights

N, H, B, D = 10, 4, 4, 8


def layouts():
    return {
        "jax_pages": KVLayout.jax_pages(N, H, B, D, jnp.float32),
        "vllm_cpu": KVLayout.vllm_cpu(N, H, B, D, jnp.bfloat16),
        "nhd": KVLayout.nhd(N, H, B, D, jnp.float16),
        "hnd": KVLayout.hnd(N, H, B, D, jnp.float32),
    }


def host_cache(lay, layers, seed=0):
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(lay.dtype)
    return [
        [rng.standard_normal(lay.shape).astype(dt) for _ in range(lay.parts_per_layer)]
        for _ in range(layers)
    ]


def to_device(host, sharding=None):
    # Copies first: on CPU jax may alias a numpy array, and loads write cache buffers in place.
    return [[jax.device_put(np.array(a, copy=True), sharding) for a in parts] for parts in host]


def check_moved(mgr, host, lay, src, dst):
    ax = lay.block_axis
    for parts, hparts in zip(mgr.kv_caches, host, strict=True):
        for a, h in zip(parts, hparts, strict=True):
            a = np.asarray(a)
            for s, d in zip(src, dst, strict=True):
                np.testing.assert_array_equal(np.take(a, d, axis=ax), np.take(h, s, axis=ax))
            keep = [b for b in range(N) if b not in dst]
            np.testing.assert_array_equal(np.take(a, keep, axis=ax), np.take(h, keep, axis=ax))


@pytest.mark.parametrize("name", list(layouts()))
@pytest.mark.parametrize("staged", [False, True])
def test_round_trip(name, staged):
    lay = layouts()[name]
    host = host_cache(lay, 3)
    mgr = KVCacheManager(
        to_device(host), lay, host_blocks=32, staged=staged, layers_per_host_block=3
    )
    ids = mgr.alloc_host(3)
    mgr.d2h([6, 1, 9], ids).result(timeout=30)
    mgr.h2d([0, 2, 4], ids).result(timeout=30)
    check_moved(mgr, host, lay, [6, 1, 9], [0, 2, 4])


def test_sharded_heads_across_four_devices_and_staged_interop():
    assert len(jax.devices()) >= 4, "conftest must set --xla_force_host_platform_device_count=4"
    lay = KVLayout.jax_pages(N, H, B, D, jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    sharding = NamedSharding(mesh, P("tp"))
    host = host_cache(lay, 2, seed=1)
    direct = KVCacheManager(to_device(host, sharding), lay, host_blocks=16)
    assert len(direct.format.shards) == 8  # 4 shards x (K, V)
    ids = direct.alloc_host(2)
    direct.d2h([3, 8], ids).result(timeout=30)
    # A second manager on the staged path reads the same host blocks: identical content format.
    staged = KVCacheManager(to_device(host, sharding), lay, pool=direct.pool, staged=True)
    assert staged.format == direct.format
    staged.h2d([5, 0], ids).result(timeout=30)
    check_moved(staged, host, lay, [3, 8], [5, 0])
    for parts in staged.kv_caches:
        assert all(a.sharding == sharding for a in parts)


def test_replicated_and_sharded_mesh():
    lay = KVLayout.hnd(N, H, B, D, jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    sharding = NamedSharding(mesh, P(None, None, "tp"))  # heads split over tp, replicated on dp
    host = host_cache(lay, 1, seed=2)
    mgr = KVCacheManager(to_device(host, sharding), lay, host_blocks=8)
    ids = mgr.alloc_host(1)
    mgr.d2h([7], ids).result(timeout=30)
    mgr.h2d([2], ids).result(timeout=30)
    check_moved(mgr, host, lay, [7], [2])
    for s in mgr.kv_caches[0][0].addressable_shards:  # every replica updated
        np.testing.assert_array_equal(
            np.asarray(s.data)[:, 2], np.asarray(host[0][0])[s.index][:, 7]
        )


def test_sharded_block_axis_refused():
    lay = KVLayout.nhd(N, H, B, D, jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    arr = jax.device_put(np.zeros((2, N, B, H, D), np.float32), NamedSharding(mesh, P(None, "x")))
    with pytest.raises(tc.InvalidArgumentError, match="block axis is sharded"):
        KVCacheManager([arr], lay, host_blocks=2)


def test_bad_input_and_format_mismatch():
    lay = KVLayout.jax_pages(N, H, B, D, jnp.float32)
    host = host_cache(lay, 2)
    store_probe = KVCacheManager(to_device(host), lay, host_blocks=1)
    store = KVStore(store_probe.host_block_bytes, 16)
    mgr = KVCacheManager(to_device(host), lay, host_blocks=8, store=store)
    with pytest.raises(tc.InvalidArgumentError, match="out of range"):
        mgr.save([b"a" * 32], [N])
    with pytest.raises(tc.InvalidArgumentError, match="field 'dtype'"):
        KVCacheManager(to_device(host), KVLayout.jax_pages(N, H, B, D, jnp.float16), host_blocks=1)
    mgr.save([b"a" * 32, b"b" * 32], [1, 2]).result(timeout=30)
    assert mgr.lookup([b"a" * 32, b"b" * 32, b"c" * 32]) == 2
    mgr.load([b"b" * 32, b"a" * 32], [0, 3]).result(timeout=30)
    check_moved(mgr, host, lay, [2, 1], [0, 3])
    # Same block bytes, sharded differently: another format, so the store keys miss.
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    other = KVCacheManager(
        to_device(host, NamedSharding(mesh, P("tp"))), lay, host_blocks=8, store=store
    )
    assert other.format.host_block_bytes == mgr.format.host_block_bytes
    assert other.format.shards != mgr.format.shards and other.lookup([b"a" * 32]) == 0
    with pytest.raises(tc.NotFoundError):
        other.load([b"a" * 32], [0])


def test_pytree_weights_round_trip_keeps_sharding():
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    sh = NamedSharding(mesh, P("tp"))
    tree = {
        "w": jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), sh),
        "b": [jnp.ones(5, jnp.bfloat16), jnp.int32(3)],
    }
    pool = tc.HostBlockPool(4096, 16)
    host, futs = flatten_weights(tree, pool, bucket_bytes=1024)
    [f.result(timeout=30) for f in futs]
    like = jax.tree_util.tree_map(jnp.zeros_like, tree)
    out = restore_weights(host, like, timeout=30)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding
    with pytest.raises(tc.InvalidArgumentError, match="field 'shape'"):
        restore_weights(host, {**like, "w": jnp.zeros((8, 64))})
    # A numpy leaf has no sharding to restore onto: refused by name before any copy (it was an
    # AttributeError after every bucket had been copied).
    with pytest.raises(TypeError, match=r"leaf \['w'\] of `like` is a ndarray"):
        restore_weights(host, {**like, "w": np.zeros((64, 8), np.float32)})
    host.free()


@pytest.mark.parametrize("name", ["jax_pages", "vllm_cpu"])
@pytest.mark.parametrize("host_memory", ["unpinned", "pinned_host"])
def test_staged_host_memory_round_trip(name, host_memory):
    # The CPU backend offers the pinned_host memory kind: the pinned path runs for real here
    # (device gather -> pinned-host array -> pool; pool -> pinned-host staging -> device).
    lay = layouts()[name]
    host = host_cache(lay, 2, seed=3)
    mgr = KVCacheManager(to_device(host), lay, host_blocks=16, staged=True, host_memory=host_memory)
    ids = mgr.alloc_host(3)
    mgr.d2h([6, 1, 9], ids).result(timeout=30)
    mgr.h2d([0, 2, 4], ids).result(timeout=30)
    check_moved(mgr, host, lay, [6, 1, 9], [0, 2, 4])
    assert mgr.host_memory == host_memory  # no silent fallback on a backend that has the kind


def test_pinned_host_sharded_matches_direct_format():
    lay = KVLayout.jax_pages(N, H, B, D, jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    sharding = NamedSharding(mesh, P("tp"))
    host = host_cache(lay, 2, seed=4)
    direct = KVCacheManager(to_device(host, sharding), lay, host_blocks=16)
    pinned = KVCacheManager(
        to_device(host, sharding), lay, pool=direct.pool, staged=True, host_memory="pinned_host"
    )
    a, b = direct.alloc_host(2), direct.alloc_host(2)
    direct.d2h([3, 8], a).result(timeout=30)
    pinned.d2h([3, 8], b).result(timeout=30)
    for x, y in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(), strict=True):
        assert bytes(direct.pool.view(x)) == bytes(direct.pool.view(y))
    pinned.h2d([5, 0], a).result(timeout=30)
    check_moved(pinned, host, lay, [3, 8], [5, 0])
    for parts in pinned.kv_caches:
        assert all(p.sharding == sharding for p in parts)


def test_host_memory_choice_and_fallback(monkeypatch):
    import tpusync.jax.kv_cache as kc

    lay = KVLayout.jax_pages(N, H, B, D, jnp.float32)
    host = host_cache(lay, 1, seed=5)
    with pytest.raises(tc.InvalidArgumentError, match="host_memory must be"):
        KVCacheManager(to_device(host), lay, staged=True, host_memory="pinned")
    monkeypatch.setattr(kc, "_has_pinned", lambda dev: False)
    with pytest.raises(tc.InvalidArgumentError, match="no 'pinned_host' memory kind"):
        KVCacheManager(to_device(host), lay, host_blocks=4, staged=True, host_memory="pinned_host")
    assert KVCacheManager(to_device(host), lay, host_blocks=4, staged=True).host_memory == (
        "unpinned"
    )
    monkeypatch.undo()

    # auto: a pinned staging buffer the native copy cannot import (TypeError, nothing copied)
    # switches the manager to unpinned transfers for good, and the load still lands.
    mgr = KVCacheManager(to_device(host), lay, host_blocks=8, staged=True)
    assert mgr.host_memory == "pinned_host"
    ids = mgr.alloc_host(2)
    mgr.d2h([1, 7], ids).result(timeout=30)
    monkeypatch.setattr(kc, "_pinned_zeros", lambda shape, dtype, dev: [0])
    mgr.h2d([4, 2], ids).result(timeout=30)
    assert mgr.host_memory == "unpinned"
    check_moved(mgr, host, lay, [1, 7], [4, 2])
    # Asked for explicitly, the same failure is the caller's error, not a silent fallback.
    strict = KVCacheManager(
        to_device(host), lay, host_blocks=8, staged=True, host_memory="pinned_host"
    )
    sid = strict.alloc_host(1)
    strict.d2h([3], sid).result(timeout=30)
    with pytest.raises(TypeError):
        strict.h2d([5], sid).result(timeout=30)


@pytest.mark.parametrize("staged", [False, True])
def test_queued_operations_keep_submission_order(staged):
    # Many one-layer native copies queued at once (batch_bytes = 0): each must see the previous.
    lay = KVLayout.jax_pages(N, H, B, D, jnp.float32)
    host = host_cache(lay, 4, seed=6)
    mgr = KVCacheManager(to_device(host), lay, host_blocks=16, staged=staged)
    mgr.batch_bytes = 0
    a, b = mgr.alloc_host(2), mgr.alloc_host(2)
    f1 = mgr.d2h([2, 9], a)  # blocks 2, 9 -> a
    f2 = mgr.h2d([0, 5], a)  # a -> blocks 0, 5
    f3 = mgr.d2h([0, 5], b)  # blocks 0, 5 (just loaded) -> b
    f4 = mgr.h2d([3, 7], b)  # b -> blocks 3, 7
    for f in (f4, f3, f2, f1):
        f.result(timeout=30)
    for parts, hparts in zip(mgr.kv_caches, host, strict=True):
        for arr, h in zip(parts, hparts, strict=True):
            arr = np.asarray(arr)
            for s, d in ((2, 0), (9, 5), (2, 3), (9, 7)):
                np.testing.assert_array_equal(arr[:, d], h[:, s])


@pytest.mark.parametrize("name", ["jax_pages", "vllm_cpu"])
def test_consecutive_blocks_per_layer_batches_and_late_bad_id(name):
    """One engine call per layer (each passes only its own host ids) over consecutive blocks and
    slots (runs the native copy coalesces) and reversed slots (runs that must not merge); then a
    freed id in the last layer's row refuses the whole call before any byte moves."""
    lay = layouts()[name]
    host = host_cache(lay, 3)
    mgr = KVCacheManager(to_device(host), lay, host_blocks=32)
    mgr.batch_bytes = 0
    src = [2, 3, 4]
    fwd = mgr.alloc_host(len(src))
    mgr.d2h(src, fwd).result(timeout=30)
    mgr.h2d([5, 6, 7], fwd).result(timeout=30)
    mgr.h2d([9, 8, 1], fwd[:, ::-1].copy()).result(timeout=30)
    moved = [[h.copy() for h in parts] for parts in host]
    for parts in moved:
        for h in parts:
            for s, d in zip(src * 2, [5, 6, 7, 1, 8, 9], strict=True):
                idx = [slice(None)] * h.ndim
                idx[lay.block_axis] = d
                h[tuple(idx)] = np.take(h, s, axis=lay.block_axis)
    check_moved(mgr, moved, lay, [], [])
    mgr.pool.free([int(fwd[-1][-1])])
    with pytest.raises(tc.TpusyncError):
        mgr.h2d([0, 1, 2], fwd)
    with pytest.raises(tc.TpusyncError):
        mgr.d2h([0, 1, 2], fwd)
    check_moved(mgr, moved, lay, [], [])
    mgr.close()


def test_arrays_shared_between_layers_are_refused_on_the_in_place_path():
    """ALIAS RULE: one zeros array for every layer's K and V (a common JAX idiom) was accepted;
    a load into layer 0 then changed every layer, and the caller's own array."""
    lay = KVLayout.jax_pages(N, H, B, D, jnp.float32)
    zeros = jnp.zeros(lay.shape, jnp.float32)
    with pytest.raises(tc.InvalidArgumentError, match="is the same memory as layer 0 part 0"):
        KVCacheManager([(zeros, zeros) for _ in range(3)], lay, host_blocks=8)
    # The staged path replaces the arrays it loads into, so sharing is harmless there.
    KVCacheManager([(zeros, zeros) for _ in range(3)], lay, host_blocks=8, staged=True)


def test_freed_weights_are_refused_not_restored_from_uninitialised_memory():
    pool = tc.HostBlockPool(4096, 8)
    tree = {"w": jnp.arange(64, dtype=jnp.float32)}
    host, futs = flatten_weights(tree, pool)
    [f.result(timeout=30) for f in futs]
    host.free()
    with pytest.raises(tc.StateError, match="freed"):
        restore_weights(host, tree)


@pytest.mark.parametrize("staged", [False, True])
def test_empty_transfers_and_use_after_close(staged):
    """The staged path's d2h of no block raised a bare IndexError; a closed manager raised the
    executor's RuntimeError."""
    lay = KVLayout.jax_pages(N, H, B, D, jnp.float32)
    mgr = KVCacheManager(to_device(host_cache(lay, 2)), lay, host_blocks=8, staged=staged)
    empty = mgr.alloc_host(0)
    mgr.d2h([], empty).result(timeout=30)
    mgr.h2d([], empty).result(timeout=30)
    mgr.close()
    with pytest.raises(tc.StateError, match="closed"):
        mgr.d2h([1], mgr.alloc_host(1))


def test_a_load_into_read_only_memory_is_refused_not_a_segfault(tmp_path):
    """WRITABLE MEMORY CHECK: jax.device_put of an aligned numpy array on CPU aliases it, also over
    a read-only mapping; an in-place load then killed the process with SIGSEGV. The staged path
    (which replaces the arrays it loads) and saves still work."""
    lay = KVLayout.jax_pages(N, H, B, D, jnp.float32)
    host = host_cache(lay, 2)
    np.save(tmp_path / "v.npy", host[1][1])
    ro = jax.device_put(np.load(tmp_path / "v.npy", mmap_mode="r"))
    caches = to_device(host)
    caches[1][1] = ro
    mgr = KVCacheManager(caches, lay, host_blocks=8)
    ids = mgr.alloc_host(2)
    mgr.d2h([6, 1], ids).result(timeout=30)
    with pytest.raises(tc.InvalidArgumentError, match=r"layer 1 part 1: .* is read-only"):
        mgr.h2d([0, 2], ids)
    staged = KVCacheManager(caches, lay, host_blocks=8, staged=True)
    sids = staged.alloc_host(2)
    staged.d2h([6, 1], sids).result(timeout=30)
    staged.h2d([0, 2], sids).result(timeout=30)
    check_moved(staged, host, lay, [6, 1], [0, 2])
