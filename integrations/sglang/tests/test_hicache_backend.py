"""Scenario 2 of issue 8: the HiCache backend contract through SGLang's own factory, no server.

Everything SGLang-side is real SGLang 0.5.23: the backend factory (`dynamic` backend), the
HiCacheStorageConfig, the MHA device pool and host pool (all four host layouts), the page-hash
function. Only the copies between the host pool and the device (CUDA kernels) are not exercised.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hicache_backend import create, storage_config
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from tpusync.sglang import InterimHostPageStore, KVStorePageStore
from tpusync.sglang.hicache import TpusyncHiCacheStorage

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]

# the 1 GiB default would prefault 1 GiB per test
EXTRA = {"capacity_pages": 64}


def _config(extra=None, **cfg) -> HiCacheStorageConfig:
    return storage_config({**EXTRA, **(extra or {})}, **cfg)


def _create(host, extra=None, **cfg):
    """Exactly what SGLang's HiCacheController.attach_storage_backend does."""
    return create(host, {**EXTRA, **(extra or {})}, **cfg)


def _page_hashes(n_pages: int, page_size: int, seed: int = 0) -> list[str]:
    tokens = torch.randint(
        0, 50_000, (n_pages * page_size,), generator=torch.Generator().manual_seed(seed)
    )
    return get_hash_str(tokens.tolist(), None, page_size=page_size)


def _fill_random(host, indices: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for start in range(0, indices.numel(), host.page_size):
        page = host.get_data_page(int(indices[start]), flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))


def _pages(host, indices: torch.Tensor) -> list[torch.Tensor]:
    return [
        host.get_data_page(int(indices[s]), flat=True).clone()
        for s in range(0, indices.numel(), host.page_size)
    ]


def test_factory_builds_the_backend_from_dynamic_config(sglang_pools):
    _, host = sglang_pools("page_first")
    backend = _create(host)
    assert type(backend) is TpusyncHiCacheStorage
    assert backend.mem_pool_host is host
    assert isinstance(backend.store, KVStorePageStore)  # the default: tpusync's tiered KVStore
    # page_first: one K run and one V run per page, each page_size * layers * heads * dim * 2 B
    assert backend.store.segments_per_page == 2
    assert backend.store.segment_bytes == 4 * 3 * 2 * 16 * 2


def test_module_path_is_importable_as_sglang_does_it():
    cls = StorageBackendFactory._load_backend_class(
        "tpusync.sglang", "TpusyncHiCacheStorage", "tpusync"
    )
    assert cls is TpusyncHiCacheStorage


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_pages_round_trip_identically_with_leading_run_lookups(sglang_pools, layout):
    _, host = sglang_pools(layout)
    backend = _create(host)
    n = 6
    keys = _page_hashes(n, host.page_size)
    src = host.alloc(n * host.page_size)
    _fill_random(host, src, seed=1)
    expected = _pages(host, src)
    info = HiCacheStorageExtraInfo(prefix_keys=[])

    assert backend.batch_exists(keys, info) == 0
    assert backend.batch_set_v1(keys[:4], src[: 4 * host.page_size], info) == [True] * 4
    assert backend.batch_exists(keys, info) == 4
    assert backend.batch_exists(keys[2:], info) == 2
    assert backend.exists(keys[3]) and not backend.exists(keys[4])
    # a gap: SGLang only ever gets the leading run
    assert backend.batch_set_v1(keys[5:], src[5 * host.page_size :], info) == [True]
    assert backend.batch_exists(keys, info) == 4

    # Read into different host slots after the originals are overwritten.
    host.free(src)
    dst = host.alloc(n * host.page_size)
    _fill_random(host, dst, seed=2)
    got = backend.batch_get_v1(keys, dst, info)
    assert got == [True, True, True, True, False, True]
    for i in (0, 1, 2, 3, 5):
        page = host.get_data_page(int(dst[i * host.page_size]), flat=True)
        assert torch.equal(page, expected[i]), f"page {i} differs after the round trip"


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_miss_leaves_host_pages_untouched(sglang_pools, layout):
    _, host = sglang_pools(layout)
    backend = _create(host)
    dst = host.alloc(2 * host.page_size)
    _fill_random(host, dst, seed=3)
    before = _pages(host, dst)
    assert backend.batch_get_v1(_page_hashes(2, host.page_size, seed=9), dst) == [False, False]
    assert all(torch.equal(a, b) for a, b in zip(before, _pages(host, dst), strict=True))


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_zero_copy_and_legacy_paths_agree_byte_for_byte(sglang_pools, layout):
    _, host = sglang_pools(layout)
    backend = _create(host)
    keys = _page_hashes(2, host.page_size, seed=4)
    idx = host.alloc(2 * host.page_size)
    _fill_random(host, idx, seed=5)
    original = _pages(host, idx)

    # written zero-copy, read through the legacy tensor API into SGLang's own dummy page
    assert backend.batch_set_v1(keys[:1], idx[: host.page_size]) == [True]
    dummy = host.get_dummy_flat_data_page()
    assert backend.get(keys[0], dummy) is dummy
    assert torch.equal(dummy, original[0])

    # written through the legacy API from SGLang's flat page, read zero-copy
    assert backend.set(keys[1], host.get_data_page(int(idx[host.page_size]), flat=True))
    assert backend.batch_get([keys[1], "f" * 64], [host.get_dummy_flat_data_page()] * 2)[1] is None
    out = host.alloc(host.page_size)
    assert backend.batch_get_v1(keys[1:], out) == [True]
    assert torch.equal(host.get_data_page(int(out[0]), flat=True), original[1])


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_pages_round_trip_and_paths_agree(sglang_mla_pools, layout):
    _, host = sglang_mla_pools(layout)
    backend = _create(host, mla=True)
    keys = _page_hashes(3, host.page_size, seed=12)
    src = host.alloc(3 * host.page_size)
    _fill_random(host, src, seed=13)
    expected = _pages(host, src)
    assert backend.batch_set_v1(keys, src) == [True] * 3
    assert backend.batch_exists(keys) == 3
    host.free(src)
    dst = host.alloc(3 * host.page_size)
    _fill_random(host, dst, seed=14)
    assert backend.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(expected, _pages(host, dst), strict=True))
    dummy = host.get_dummy_flat_data_page()
    assert backend.get(keys[2], dummy) is dummy
    assert torch.equal(dummy, expected[2])


def test_same_hash_on_other_tp_rank_is_a_different_page(sglang_pools):
    _, host = sglang_pools("page_first")
    shared = InterimHostPageStore(4 * 3 * 2 * 16 * 2, 2, 16)
    rank0 = TpusyncHiCacheStorage(_config(tp_rank=0, tp_size=2), store=shared)
    rank1 = TpusyncHiCacheStorage(_config(tp_rank=1, tp_size=2), store=shared)
    for backend in (rank0, rank1):
        backend.register_mem_pool_host(host)
    keys = _page_hashes(1, host.page_size)
    idx = host.alloc(host.page_size)
    assert rank0.batch_set_v1(keys, idx) == [True]
    assert rank0.batch_exists(keys) == 1
    assert rank1.batch_exists(keys) == 0


@pytest.mark.parametrize("store", ["kvstore", "interim"])
def test_capacity_evicts_oldest_pages(sglang_pools, store):
    _, host = sglang_pools("page_first")
    backend = _create(host, {"capacity_pages": 3, "store": store})
    keys = _page_hashes(5, host.page_size, seed=6)
    idx = host.alloc(5 * host.page_size)
    for i in range(5):
        assert backend.batch_set_v1([keys[i]], idx[i * host.page_size : (i + 1) * host.page_size])
    assert [backend.exists(k) for k in keys] == [False, False, True, True, True]


def test_get_stats_reports_sglang_storage_metrics_per_interval(sglang_pools):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    _, host = sglang_pools("page_first")
    backend = _create(host)
    keys = _page_hashes(3, host.page_size)
    idx = host.alloc(3 * host.page_size)
    backend.batch_set_v1(keys, idx)
    backend.batch_get_v1(keys[:2], idx[: 2 * host.page_size])
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert (stats.backup_pgs, stats.prefetch_pgs) == ([3], [2])
    assert all(b > 0 for b in stats.backup_bandwidth + stats.prefetch_bandwidth)
    assert backend.get_stats().backup_pgs == []  # reset after each read


def test_clear_forgets_everything(sglang_pools):
    _, host = sglang_pools("layer_first")
    backend = _create(host)
    keys = _page_hashes(3, host.page_size)
    backend.batch_set_v1(keys, host.alloc(3 * host.page_size))
    backend.clear()
    assert backend.batch_exists(keys) == 0


def test_mismatched_host_indices_fail_every_page_and_store_nothing(sglang_pools, caplog):
    _, host = sglang_pools("page_first")
    backend = _create(host)
    keys = _page_hashes(2, host.page_size)
    idx = host.alloc(2 * host.page_size)
    with caplog.at_level(logging.ERROR):
        assert backend.batch_set_v1(keys, idx[:-1]) == [False, False]
        assert backend.batch_get_v1(keys, idx[: host.page_size]) == [False, False]
    assert "host indices" in caplog.text
    assert backend.batch_exists(keys) == 0
    assert len(backend.store) == 0


def test_wrong_sized_legacy_page_is_refused(sglang_pools, caplog):
    _, host = sglang_pools("page_first")
    backend = _create(host)
    key = _page_hashes(1, host.page_size)[0]
    with caplog.at_level(logging.ERROR):
        assert backend.set(key, torch.zeros(7, dtype=torch.bfloat16)) is False
        assert backend.get(key, torch.zeros(7, dtype=torch.bfloat16)) is None
    assert "a page holds" in caplog.text
    assert not backend.exists(key)


def test_unregistered_backend_reports_failures_not_crashes():
    backend = TpusyncHiCacheStorage(_config())
    assert backend.batch_get_v1(["a" * 64], torch.arange(4)) == [False]
    assert backend.batch_exists(["a" * 64]) == 0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"capacity_gb": 0}, "positive"),
        ({"capacity_pages": "lots"}, "not an integer"),
        ({"timeout_s": -1}, "positive"),
        # Read as 1.0, truncated to 2 pages, waited forever, prefaulted 1 GiB: refused now.
        ({"capacity_gb": True}, "not a number"),
        ({"capacity_pages": 2.9}, "not an integer"),
        ({"timeout_s": float("inf")}, "finite"),
        ({"timeout_s": float("nan")}, "finite"),
        ({"prefault": "false"}, "JSON bools"),
        ({"capacty_gb": 1}, "unknown tpusync HiCache option"),
        ({"store": "redis"}, "use 'kvstore' or 'interim'"),
        ({"disk_dir": "/tmp"}, "go together"),
        ({"store": "interim", "disk_dir": "/tmp", "disk_gb": 1}, "needs store='kvstore'"),
    ],
)
def test_bad_extra_config_fails_at_startup(sglang_pools, extra, match):
    _, host = sglang_pools("page_first")
    with pytest.raises(ValueError, match=match):
        _create(host, extra)


def test_factory_errors_name_the_missing_piece(sglang_pools):
    _, host = sglang_pools("page_first")
    cfg = _config({"class_name": "NoSuchBackend"})
    with pytest.raises(AttributeError, match="NoSuchBackend"):
        StorageBackendFactory.create_backend("dynamic", cfg, host)


def test_disk_tier_serves_pages_the_host_tier_dropped(sglang_pools, tmp_path):
    _, host = sglang_pools("layer_first")
    backend = _create(
        host, {"capacity_pages": 2, "disk_dir": str(tmp_path), "disk_gb": 0.01, "prefault": False}
    )
    keys = _page_hashes(6, host.page_size, seed=21)
    src = host.alloc(6 * host.page_size)
    _fill_random(host, src, seed=22)
    expected = _pages(host, src)
    for i in range(6):
        sl = slice(i * host.page_size, (i + 1) * host.page_size)
        assert backend.batch_set_v1([keys[i]], src[sl]) == [True]
    backend.store.store.flush(30)
    assert backend.batch_exists(keys) == 6
    host.free(src)
    dst = host.alloc(6 * host.page_size)
    assert backend.batch_get_v1(keys, dst) == [True] * 6
    assert all(torch.equal(a, b) for a, b in zip(expected, _pages(host, dst), strict=True))
