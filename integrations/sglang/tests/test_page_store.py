"""PageStore contract, run against the KVStore-backed store and the interim host store (no SGLang
needed). Tests that name one store test a contract only that store gives."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tpusync.sglang.page_store import InterimHostPageStore, KVStorePageStore, PageStore

SEG = 256
SPP = 2


def _table(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(rows, SEG), dtype=np.uint8)


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:04d}".encode() for i in range(n)]


STORES = {
    "kvstore": lambda seg, spp, cap: KVStorePageStore(seg, spp, cap, prefault=False),
    "interim": lambda seg, spp, cap: InterimHostPageStore(seg, spp, cap, prefault=False),
}


@pytest.fixture(params=sorted(STORES))
def make(request):
    return STORES[request.param]


def test_kvstore_store_satisfies_protocol():
    assert isinstance(KVStorePageStore(SEG, SPP, 4), PageStore)


def test_interim_store_satisfies_protocol():
    assert isinstance(InterimHostPageStore(SEG, SPP, 4), PageStore)


def test_round_trip_through_scattered_rows_is_byte_identical(make):
    store = make(SEG, SPP, 16)
    src = _table(40)
    keys = _keys(5)
    src_rows = np.array([[7, 30], [2, 3], [39, 0], [11, 12], [20, 21]])
    assert store.put_pages(keys, src, src_rows, 10) == [True] * 5
    dst = np.zeros((10, SEG), dtype=np.uint8)
    dst_rows = np.array([[9, 8], [0, 1], [2, 3], [4, 5], [6, 7]])
    assert store.get_pages(keys, dst, dst_rows, 10) == [True] * 5
    for page in range(5):
        for seg in range(SPP):
            np.testing.assert_array_equal(dst[dst_rows[page, seg]], src[src_rows[page, seg]])


def test_lookup_prefix_counts_the_leading_run_only(make):
    store = make(SEG, SPP, 16)
    keys = _keys(6)
    present = [0, 1, 2, 4, 5]  # key 3 missing
    store.put_pages([keys[i] for i in present], _table(10), np.arange(10).reshape(5, 2), 10)
    assert store.lookup_prefix(keys) == 3
    assert store.lookup_prefix(keys[4:]) == 2
    assert store.lookup_prefix([b"nope", *keys]) == 0
    assert store.lookup_prefix([]) == 0


def test_miss_reports_false_and_leaves_destination_untouched():
    store = InterimHostPageStore(SEG, SPP, 4)
    src = _table(2)
    store.put_pages([b"a"], src, np.array([[0, 1]]), 10)
    dst = np.full((4, SEG), 0xAB, dtype=np.uint8)
    assert store.get_pages([b"a", b"b"], dst, np.array([[0, 1], [2, 3]]), 10) == [True, False]
    np.testing.assert_array_equal(dst[:2], src)
    assert (dst[2:] == 0xAB).all()


def test_existing_key_is_not_rewritten(make):
    store = make(SEG, SPP, 4)
    first, second = _table(2, seed=1), _table(2, seed=2)
    assert store.put_pages([b"a"], first, np.array([[0, 1]]), 10) == [True]
    assert store.put_pages([b"a", b"a"], second, np.array([[0, 1], [0, 1]]), 10) == [True, True]
    dst = np.zeros((2, SEG), dtype=np.uint8)
    store.get_pages([b"a"], dst, np.array([[0, 1]]), 10)
    np.testing.assert_array_equal(dst, first)
    assert store.lookup_prefix([b"a"]) == 1


def test_full_store_evicts_least_recently_used_pages():
    store = InterimHostPageStore(SEG, SPP, 3)
    src = _table(2 * 5)
    rows = np.arange(10).reshape(5, 2)
    keys = _keys(5)
    store.put_pages(keys[:3], src, rows[:3], 10)
    assert store.lookup_prefix([keys[0]]) == 1  # touch k0: k1 is now the oldest
    store.put_pages(keys[3:4], src, rows[3:4], 10)
    assert [store.lookup_prefix([k]) for k in keys[:4]] == [1, 0, 1, 1]
    assert store.stats()["evictions"] == 1
    assert len(store) == 3


@pytest.mark.parametrize(
    ("table", "rows", "match"),
    [
        (np.zeros((4, SEG), np.uint8), np.array([[0, 4]]), "out of range"),
        (np.zeros((4, SEG), np.uint8), np.array([[0, -1]]), "out of range"),
        (np.zeros((4, SEG), np.uint8), np.array([0, 1]), "shape"),
        (np.zeros((4, SEG), np.uint8), np.array([[0.0, 1.0]]), "integers"),
        (np.zeros((4, SEG), np.float32), np.array([[0, 1]]), "uint8"),
        (np.zeros((4, SEG + 1), np.uint8), np.array([[0, 1]]), "contiguous bytes"),
        (np.zeros((4, 2 * SEG), np.uint8)[:, ::2], np.array([[0, 1]]), "contiguous bytes"),
    ],
)
def test_bad_rows_are_rejected_before_anything_moves(make, table, rows, match):
    store = make(SEG, SPP, 4)
    with pytest.raises(ValueError, match=match):
        store.put_pages([b"a"], table, rows, 10)
    with pytest.raises(ValueError, match=match):
        store.get_pages([b"a"], table, rows, 10)
    assert store.lookup_prefix([b"a"]) == 0


def test_bad_geometry_is_rejected(make):
    with pytest.raises(ValueError, match="positive"):
        make(0, SPP, 4)
    with pytest.raises(ValueError, match="positive"):
        make(SEG, SPP, 0)


def test_remove_and_clear_release_space(make):
    store = make(SEG, SPP, 4)
    keys = _keys(4)
    store.put_pages(keys, _table(8), np.arange(8).reshape(4, 2), 10)
    assert store.remove([keys[1], b"absent"]) == 1
    assert store.lookup_prefix(keys) == 1
    store.clear()
    assert store.lookup_prefix(keys) == 0


def test_concurrent_writers_and_readers_see_only_whole_pages(make):
    store = make(SEG, SPP, 64)
    n_threads, per_thread = 2, 40
    errors: list[str] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        for i in range(per_thread):
            key = f"t{t}-{i}".encode()
            page = np.full((SPP, SEG), (t * per_thread + i) % 251, dtype=np.uint8)
            store.put_pages([key], page, np.array([[0, 1]]), 10)
            probe = f"t{1 - t}-{rng.integers(per_thread)}".encode()
            dst = np.zeros((SPP, SEG), dtype=np.uint8)
            if store.get_pages([probe], dst, np.array([[0, 1]]), 10)[0]:
                if len(np.unique(dst)) != 1:
                    errors.append(f"torn page {probe!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors
    assert not any(th.is_alive() for th in threads)
    # 80 pages offered, capacity 64: the LRU ones went
    assert (
        sum(store.lookup_prefix([f"t{t}-{i}".encode()]) for t in range(2) for i in range(40)) == 64
    )


def test_kvstore_full_host_tier_drops_least_recently_used_pages():
    store = KVStorePageStore(SEG, SPP, 3, prefault=False)
    src = _table(2 * 5)
    rows = np.arange(10).reshape(5, 2)
    keys = _keys(5)
    assert store.put_pages(keys[:3], src, rows[:3], 10) == [True] * 3
    dst = np.zeros((2, SEG), dtype=np.uint8)
    assert store.get_pages([keys[0]], dst, np.array([[0, 1]]), 10) == [True]  # k1 now oldest
    assert store.put_pages(keys[3:4], src, rows[3:4], 10) == [True]
    assert [store.lookup_prefix([k]) for k in keys[:4]] == [1, 0, 1, 1]


def test_kvstore_disk_tier_keeps_pages_the_host_tier_dropped(tmp_path):
    store = KVStorePageStore(SEG, SPP, 2, disk_dir=str(tmp_path), disk_pages=16, prefault=False)
    src = _table(2 * 8, seed=3)
    keys = _keys(8)
    for i in range(8):  # one page at a time: the write-back worker makes room behind them
        assert store.put_pages([keys[i]], src, np.array([[2 * i, 2 * i + 1]]), 10) == [True]
    store.store.flush(30)
    assert store.lookup_prefix(keys) == 8
    dst = np.zeros((16, SEG), dtype=np.uint8)
    assert store.get_pages(keys, dst, np.arange(16).reshape(8, 2), 30) == [True] * 8
    np.testing.assert_array_equal(dst, src)
    assert store.stats()["tiers"]["disk"]["used_blocks"] >= 12


def test_kvstore_long_page_keys_are_hashed_not_refused():
    store = KVStorePageStore(SEG, SPP, 4, prefault=False)
    long_key = b"n" * 8 + bytes(range(60))  # 68 bytes > 62
    assert store.put_pages([long_key], _table(2), np.array([[0, 1]]), 10) == [True]
    assert store.lookup_prefix([long_key]) == 1
    with pytest.raises(ValueError, match="non-empty bytes"):
        store.lookup_prefix([b""])
