"""HiCache v2 for hybrid models: a real SGLang Mamba host pool and an SWA host pool beside the KV.

The backend is built by SGLang's own factory; the extra pools are SGLang's own ``MambaPoolHost``
(one buffer per state tensor, page size 1) and ``MHATokenToKVPoolHost`` (the SWA layers' KV),
registered through ``register_mem_host_pool_v2`` as SGLang's hybrid cache controller does. No
server: the tiny test model is a Llama, which has no hybrid layers in SGLang.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hicache_backend import create
from hypothesis import given
from hypothesis import strategies as st
from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    count_pool_hits,
)
from sglang.srt.mem_cache.utils import get_hash_str

from tpusync.core import KVStore
from tpusync.sglang.hicache_pools import restorable

MAMBA, SWA = PoolName.MAMBA, PoolName.SWA
TRAILING, ALL = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES


def _mamba_host(slots: int = 8, layers: int = 2):
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros((layers, slots, 2, 8, 4), dtype=torch.float32),
        conv=(torch.zeros((layers, slots, 12, 3), dtype=torch.bfloat16),),
    )
    return MambaPoolHost(
        info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first"
    )


@pytest.fixture
def hybrid(sglang_pools, request):
    """(backend, kv host, mamba host, swa host); ``request.param``: extra config."""
    extra = getattr(request, "param", {})
    _, kv = sglang_pools("page_first")
    _, swa = sglang_pools("page_first", layers=1)
    mamba = _mamba_host()
    backend = _backend(kv, mamba, swa, extra)
    yield backend, kv, mamba, swa
    backend.close()


def _backend(kv, mamba, swa, extra, tp_rank=0, tp_size=1):
    """As SGLang's hybrid cache controller attaches a backend: the KV pool, then every pool of
    its group through v2 (the KV pool included), then the end of registration."""
    extra = {"prefault": False, "capacity_pages": 32, **extra}
    backend = create(kv, extra, tp_rank=tp_rank, tp_size=tp_size, model="tiny-hybrid", attach=False)
    for pool, name in ((kv, PoolName.KV), (mamba, MAMBA), (swa, SWA)):
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def _hashes(n: int, page_size: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50_000, (n * page_size,), generator=g).tolist()
    return get_hash_str(ids, None, page_size=page_size)


def _fill(host, slots: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Random bytes in each page of ``slots``; returns each page's flat bytes."""
    g = torch.Generator().manual_seed(seed)
    ps = int(host.page_size)
    out = []
    for s in slots.reshape(-1)[::ps].tolist():
        page = host.get_data_page(s, flat=True)
        noise = torch.randint(0, 255, (page.numel() * page.element_size(),), generator=g)
        host.set_from_flat_data_page(s, noise.to(torch.uint8).view(page.dtype))
        out.append(_bytes(host, s))
    return out


def _bytes(host, slot: int) -> torch.Tensor:
    return host.get_data_page(slot, flat=True).contiguous().view(torch.uint8).clone()


def _slots(host, pages: int) -> torch.Tensor:
    return host.alloc(pages * int(host.page_size))


def _store_request(backend, kv, mamba, swa, hashes, seed, mamba_at=None, swa_window=2):
    """Back up a request as SGLang does: every KV page, the Mamba state at the pages in
    ``mamba_at`` (default: the last), the SWA KV of the last ``swa_window`` pages."""
    n = len(hashes)
    kv_slots = _slots(kv, n)
    _fill(kv, kv_slots, seed)
    assert backend.batch_set_v1(hashes, kv_slots) == [True] * n
    mamba_at = [n] if mamba_at is None else mamba_at
    m_slots = _slots(mamba, len(mamba_at))
    states = _fill(mamba, m_slots, seed + 1)
    w_slots = _slots(swa, swa_window)
    windows = _fill(swa, w_slots, seed + 2)
    results = backend.batch_set_v2(
        [
            PoolTransfer(MAMBA, host_indices=m_slots, keys=[hashes[p - 1] for p in mamba_at]),
            PoolTransfer(SWA, host_indices=w_slots, keys=hashes[n - swa_window :]),
        ]
    )
    assert results == {MAMBA: [True] * len(mamba_at), SWA: [True] * swa_window}
    return states, windows


def _query(window_mamba=1, window_swa=2):
    return [
        PoolTransfer(MAMBA, keys=[""] * window_mamba, hit_policy=TRAILING),
        PoolTransfer(SWA, keys=[""] * window_swa, hit_policy=TRAILING),
    ]


def test_state_pools_round_trip_byte_for_byte(hybrid):
    backend, kv, mamba, swa = hybrid
    n = 5
    hashes = _hashes(n, kv.page_size, seed=1)
    states, windows = _store_request(backend, kv, mamba, swa, hashes, seed=10)

    hit = backend.batch_exists_v2(hashes, _query())
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (n, [n])
    assert hit.extra_pool_hit_pages == {PoolName.KV: n, MAMBA: n, SWA: n}

    m_dst, w_dst = _slots(mamba, 1), _slots(swa, 2)
    results = backend.batch_get_v2(
        [
            PoolTransfer(MAMBA, host_indices=m_dst, keys=hashes[n - 1 :]),
            PoolTransfer(SWA, host_indices=w_dst, keys=hashes[n - 2 :]),
        ]
    )
    assert count_pool_hits(results) == {MAMBA: 1, SWA: 2}
    assert torch.equal(_bytes(mamba, int(m_dst[0])), states[0])
    got = [_bytes(swa, s) for s in w_dst[:: swa.page_size].tolist()]
    assert all(torch.equal(a, b) for a, b in zip(got, windows, strict=True))
    # each pool's pages live in that pool's own store, one block per page
    assert len(backend._sidecars["mamba"].store) == 1
    assert len(backend._sidecars["swa"].store) == 2


def test_restorable_prefixes_have_holes_where_no_state_was_saved(hybrid):
    backend, kv, mamba, swa = hybrid
    n = 6
    hashes = _hashes(n, kv.page_size, seed=2)
    _store_request(backend, kv, mamba, swa, hashes, seed=20, mamba_at=[2, 4, 6], swa_window=6)

    hit = backend.batch_exists_v2(hashes, _query())
    assert hit.restorable_prefix_pages == [2, 4, 6]
    assert hit.kv_hit_pages == 6
    # the KV run is the cap: with page 5's KV gone only stops 2 and 4 remain
    backend.store.remove(backend._keys(hashes[4:5]))
    hit = backend.batch_exists_v2(hashes, _query())
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [2, 4])
    # an SWA window of 3 needs pages p-2..p: all stored, so it removes nothing more
    assert backend.batch_exists_v2(hashes, _query(window_swa=3)).restorable_prefix_pages == [2, 4]
    # a pool that needs all pages (ALL_PAGES) stops where its first page is missing
    all_pages = [PoolTransfer(MAMBA, keys=[], hit_policy=ALL)]
    hit = backend.batch_exists_v2(hashes, all_pages)
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages[PoolName.KV]) == (0, 4)
    assert MAMBA not in hit.extra_pool_hit_pages


def test_a_prefix_without_state_is_no_hit(hybrid):
    backend, kv, _mamba, _swa = hybrid
    hashes = _hashes(3, kv.page_size, seed=3)
    slots = _slots(kv, 3)
    _fill(kv, slots, seed=30)
    assert backend.batch_set_v1(hashes, slots) == [True] * 3
    hit = backend.batch_exists_v2(hashes, _query())
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (0, [])
    assert hit.extra_pool_hit_pages == {PoolName.KV: 3}
    assert backend.batch_exists_v2(hashes, []).kv_hit_pages == 3  # no pools: the KV run


def test_wrong_slot_counts_and_unknown_pools_fail_clearly_and_store_nothing(hybrid, caplog):
    backend, kv, mamba, swa = hybrid
    hashes = _hashes(2, kv.page_size, seed=4)
    swa_slots = _slots(swa, 2)
    with caplog.at_level(logging.ERROR):
        results = backend.batch_set_v2(
            [
                PoolTransfer(SWA, host_indices=swa_slots[:-1], keys=hashes),
                PoolTransfer(PoolName.INDEXER, host_indices=swa_slots, keys=hashes),
            ]
        )
    assert results == {SWA: [False, False], PoolName.INDEXER: [False, False]}
    assert "need 8 host indices (page size 4), got 7" in caplog.text
    assert "pool 'indexer' was never registered" in caplog.text
    assert len(backend._sidecars["swa"].store) == 0
    kv_slots = _slots(kv, 2)
    _fill(kv, kv_slots, seed=40)
    assert backend.batch_set_v1(hashes, kv_slots) == [True, True]
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        hit = backend.batch_exists_v2(hashes, [PoolTransfer(PoolName.INDEXER, keys=[""])])
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (0, [])
    assert "batch_exists_v2 failed: pool 'indexer' was never registered" in caplog.text


def test_a_state_page_already_stored_is_not_staged_again(hybrid, monkeypatch):
    backend, kv, mamba, swa = hybrid
    hashes = _hashes(1, kv.page_size, seed=5)
    slot = _slots(mamba, 1)
    _fill(mamba, slot, seed=50)
    put = [PoolTransfer(MAMBA, host_indices=slot, keys=hashes)]
    assert backend.batch_set_v2(put) == {MAMBA: [True]}
    calls = []
    real = mamba.get_data_page
    monkeypatch.setattr(mamba, "get_data_page", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert backend.batch_set_v2(put) == {MAMBA: [True]}
    assert calls == []


@pytest.mark.parametrize("hybrid", [{"sidecar_capacity_gb": 3e-6}], indirect=True)
def test_state_pages_beyond_host_capacity_are_evicted_not_corrupted(hybrid):
    backend, kv, mamba, swa = hybrid
    pool = backend._sidecars["mamba"]
    capacity = pool.store.capacity_pages
    assert capacity < 8
    hashes = _hashes(capacity + 2, kv.page_size, seed=6)
    slots = _slots(mamba, capacity + 2)
    states = _fill(mamba, slots, seed=60)
    assert backend.batch_set_v2([PoolTransfer(MAMBA, host_indices=slots, keys=hashes)])[MAMBA] == [
        True
    ] * (capacity + 2)
    present = pool.stored(hashes)
    assert sum(present) == capacity and present[-capacity:] == [True] * capacity
    dst = _slots(mamba, capacity + 2)
    got = backend.batch_get_v2([PoolTransfer(MAMBA, host_indices=dst, keys=hashes)])[MAMBA]
    assert got == present
    for i, ok in enumerate(got):
        if ok:
            assert torch.equal(_bytes(mamba, int(dst[i])), states[i])


def test_state_pools_get_their_own_disk_directory_and_shm_namespace(sglang_pools, tmp_path):
    """The disk tier and the /dev/shm host tier of each pool survive the process's stores:
    a second backend over the same directory and namespace serves the states warm."""
    namespace = f"tpusync-hybrid-{tmp_path.name[-12:]}"
    extra = {
        "disk_dir": str(tmp_path / "disk"),
        "disk_gb": 0.01,
        "namespace": namespace,
        "sidecar_capacity_gb": 0.001,
    }
    _, kv = sglang_pools("page_first")
    _, swa = sglang_pools("page_first", layers=1)
    mamba = _mamba_host()
    first = _backend(kv, mamba, swa, extra)
    try:
        n = 3
        hashes = _hashes(n, kv.page_size, seed=7)
        states, windows = _store_request(first, kv, mamba, swa, hashes, seed=70)
        for pool in first._sidecars.values():
            pool.store.flush(30)
        first.store.flush(30)
        assert (tmp_path / "disk" / "pool-mamba").is_dir()
        assert (tmp_path / "disk" / "pool-swa").is_dir()
        first._store.close()
        for pool in first._sidecars.values():
            pool.store.close()

        second = _backend(kv, mamba, swa, extra)
        try:
            hit = second.batch_exists_v2(hashes, _query())
            assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (n, [n])
            dst = _slots(mamba, 1)
            ok = second.batch_get_v2([PoolTransfer(MAMBA, host_indices=dst, keys=hashes[-1:])])
            assert ok == {MAMBA: [True]}
            assert torch.equal(_bytes(mamba, int(dst[0])), states[0])
        finally:
            second.close()
    finally:
        for suffix in ("", "-mamba", "-swa"):
            KVStore.unlink_namespace(namespace + suffix)


def test_state_pools_are_per_tp_rank(sglang_pools):
    """Two TP ranks store the same hash in different namespaces (their shards differ)."""
    _, kv = sglang_pools("page_first")
    _, swa = sglang_pools("page_first", layers=1)
    mamba = _mamba_host()
    a = _backend(kv, mamba, swa, {}, tp_rank=0, tp_size=2)
    b = _backend(kv, mamba, swa, {}, tp_rank=1, tp_size=2)
    try:
        hashes = _hashes(1, kv.page_size, seed=8)
        assert a._sidecars["mamba"].keys(hashes) != b._sidecars["mamba"].keys(hashes)
        assert a._sidecars["mamba"].keys(hashes) != a._sidecars["swa"].keys(hashes)
    finally:
        a.close()
        b.close()


@given(
    present=st.lists(st.booleans(), max_size=40),
    window=st.integers(min_value=0, max_value=6),
)
def test_trailing_verdict_matches_its_definition(present, window):
    w = max(1, window)
    expected = {p for p in range(1, len(present) + 1) if all(present[max(0, p - w) : p])}
    assert restorable(present, "trailing_pages", window) == expected
    first_miss = present.index(False) if False in present else len(present)
    assert restorable(present, "all_pages", window) == set(range(1, first_miss + 1))
    assert restorable(present, "block_groups", window) is None
