"""tpusync.core.KVStore: put/get/lookup/pin/remove, the host -> disk cascade, faults, metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

import tpusync.core as tc

BLOCK = 4096


def blocks(ids, block=BLOCK):
    """Deterministic content per key id: block i is a pattern that differs in every byte."""
    out = np.empty((len(ids), block), dtype=np.uint8)
    base = np.arange(block, dtype=np.uint32)
    for row, i in enumerate(ids):
        out[row] = ((base * 7 + i * 131) % 251).astype(np.uint8)
    return out


def keys(ids):
    return [b"blk-%d" % i for i in ids]


@pytest.fixture
def store(tmp_path):
    s = tc.KVStore(BLOCK, 4, disk_dir=tmp_path / "disk", disk_blocks=64, writeback_batch=2)
    yield s
    s.close()


def test_round_trip_lookup_pin_remove_clear(store):
    assert store.put(keys([1, 2, 3]), blocks([1, 2, 3])).result(10) == [True] * 3
    assert store.put(keys([2]), blocks([2])).result(10) == [True]  # already stored
    dst = np.zeros((3, BLOCK), np.uint8)
    assert store.get(keys([3, 9, 1]), dst).result(10) == [True, False, True]
    np.testing.assert_array_equal(dst[0], blocks([3])[0])
    np.testing.assert_array_equal(dst[2], blocks([1])[0])
    n, where = store.lookup(keys([1, 2, 7, 3]))
    assert (n, where) == (2, ["host", "host"])
    store.pin(keys([1]))
    with pytest.raises(tc.StateError, match="pinned"):
        store.remove(keys([1]))
    store.unpin(keys([1]))
    with pytest.raises(tc.StateError, match="unbalanced"):
        store.unpin(keys([1]))
    with pytest.raises(tc.NotFoundError):
        store.pin(keys([42]))
    assert store.remove(keys([1, 42])) == 1
    assert store.lookup(keys([1]))[0] == 0
    store.clear()
    assert store.stats()["keys"] == 0


def test_bad_input_is_refused_and_moves_nothing(store):
    with pytest.raises(tc.InvalidArgumentError, match="does not hold 2 blocks"):
        store.put(keys([1, 2]), np.zeros(BLOCK, np.uint8))
    with pytest.raises(tc.InvalidArgumentError):
        store.put([b"x" * 65], np.zeros(BLOCK, np.uint8)).result(10)
    with pytest.raises(TypeError, match="bytes"):
        store.put(["text-key"], np.zeros(BLOCK, np.uint8))
    assert store.stats()["keys"] == 0
    # DISTINCT ROWS: two keys read into one row raced, and a disk hit promoted from that row
    # could be stored with the other key's bytes.
    store.put(keys([1, 2]), blocks([1, 2])).result(10)
    with pytest.raises(tc.InvalidArgumentError, match="row index 0 is given for keys #0 and #1"):
        store.get(keys([1, 2]), np.zeros((2, BLOCK), np.uint8), rows=[0, 0]).result(10)


def test_empty_batches_and_a_hit_run_into_a_buffer_sized_for_the_request(store):
    """An empty put / get was refused ("buffer of 0 bytes ... does not hold 0 blocks": numpy 2
    gives np.zeros((0, B)) strides (0, 0)), and so was docs/tiers.md's own example, a get of the
    leading hit run into rows sized for the whole request."""
    assert store.put([], np.zeros((0, BLOCK), np.uint8)).result(10) == []
    assert store.get([], np.empty((0, BLOCK), np.uint8)).result(10) == []
    request = keys(range(5))
    store.put(request[:3], blocks(range(3))).result(10)
    n, _ = store.lookup(request)
    dst_rows = np.zeros((len(request), BLOCK), np.uint8)
    assert store.get(request[:n], dst_rows).result(10) == [True] * 3
    np.testing.assert_array_equal(dst_rows[:3], blocks(range(3)))
    assert not dst_rows[3:].any()
    with pytest.raises(tc.InvalidArgumentError, match="does not hold 6 blocks"):
        store.get(keys(range(6)), dst_rows)  # fewer rows than keys is still refused


def test_plausible_mistakes_are_refused_by_name(store):
    """Each of these raised nanobind's "incompatible function arguments" with every signature."""
    dst = np.zeros((2, BLOCK), np.uint8)
    with pytest.raises(TypeError, match="src must be an array .* got list"):
        store.put(keys([1]), [0] * BLOCK)
    with pytest.raises(TypeError, match="dst is bytes, which is read-only"):
        store.get(keys([1]), bytes(BLOCK))
    with pytest.raises(TypeError, match="rows must be integers, got float"):
        store.get(keys([1]), dst, rows=[1.0])
    with pytest.raises(ValueError, match="rows must be < 2"):
        store.get(keys([1]), dst, rows=[2**64])
    with pytest.raises(ValueError, match="max_events must be >= 0"):
        store.take_events(-1)
    with pytest.raises(TypeError, match="fingerprint must be a str"):
        tc.KVStore(BLOCK, 4, fingerprint=5)
    tc.KVStore(BLOCK, 4, fingerprint=None).close()  # None: no fingerprint
    assert store.get(keys([1]), dst, rows=[np.int64(1)]).result(10) == [False]  # numpy ints fine


def test_rows_scatter_gather_and_zero_copy_destinations(store):
    torch = pytest.importorskip("torch")
    cache = blocks(range(6))  # a paged "KV cache" of 6 rows
    assert store.put(keys([10, 11]), cache, rows=[5, 2]).result(10) == [True, True]
    out = torch.zeros((4, BLOCK), dtype=torch.uint8)
    assert store.get(keys([11, 10]), out, rows=[3, 0]).result(10) == [True, True]
    np.testing.assert_array_equal(out[3].numpy(), cache[2])
    np.testing.assert_array_equal(out[0].numpy(), cache[5])
    # A host block pool's block is a valid destination too (no staging copy).
    pool = tc.HostBlockPool(BLOCK, 2)
    (bid,) = pool.alloc(1)
    view = pool.view(bid).reshape(1, BLOCK)
    assert store.get(keys([10]), view).result(10) == [True]
    np.testing.assert_array_equal(pool.view(bid), cache[5])


def test_cascade_demotes_to_disk_and_promotes_hits(store):
    ids = list(range(20))
    for i in ids:  # one at a time: a stream of new blocks through a 4-block DRAM tier
        assert store.put(keys([i]), blocks([i])).result(10) == [True]
    store.flush(30)
    s = store.stats()
    assert s["tiers"]["host"]["used_blocks"] <= 4
    assert s["tiers"]["disk"]["demotions_in"] >= 16
    n, where = store.lookup(keys(ids))
    assert n == 20 and where[0] == "disk" and where[-1] == "host"
    dst = np.zeros((20, BLOCK), np.uint8)
    assert all(store.get(keys(ids), dst).result(10))
    np.testing.assert_array_equal(dst, blocks(ids))
    s = store.stats()
    assert s["tiers"]["disk"]["hits"] >= 16
    assert s["tiers"]["host"]["promotions_in"] > 0
    assert s["evicted"] == 0 and s["corrupted"] == 0
    assert s["tiers"]["disk"]["io_backend"] in ("io_uring", "pread")


def test_second_use_policy_writes_only_reused_blocks(tmp_path):
    s = tc.KVStore(
        BLOCK, 2, disk_dir=tmp_path, disk_blocks=16, policy="second_use", writeback_batch=1
    )
    s.put(keys([1]), blocks([1])).result(10)
    assert s.get(keys([1]), np.zeros((1, BLOCK), np.uint8)).result(10) == [True]
    for i in range(10, 16):
        s.put(keys([i]), blocks([i])).result(10)
    s.flush(30)
    st = s.stats()
    assert st["policy"] == "second_use"
    assert st["tiers"]["disk"]["blocks_written"] == 1
    assert s.lookup(keys([1]))[0] == 1
    assert s.lookup(keys([10]))[0] == 0


def _disk_slot(tmp_path, key_id, store):
    """(segment path, slot offset) of a key that lives only on disk (single segment layout)."""
    seg = sorted((tmp_path / "disk").glob("seg-*.tps"))
    assert len(seg) == 1
    data = seg[0].read_bytes()
    marker = b"blk-%d" % key_id
    slot_bytes = 4096 + BLOCK
    for off in range(0, len(data), slot_bytes):
        hdr = data[off : off + 128]
        if hdr[:4] == b"TSBK" and hdr[40 : 40 + hdr[6]] == marker:
            return seg[0], off
    raise AssertionError(f"key {key_id} not found on disk")


def test_corrupted_disk_block_is_a_counted_miss_and_its_slot_is_reclaimed(tmp_path, store):
    for i in range(12):
        store.put(keys([i]), blocks([i])).result(10)
    store.flush(30)
    assert store.lookup(keys([0]))[1] == ["disk"]
    seg, off = _disk_slot(tmp_path, 0, store)
    with open(seg, "r+b") as f:
        f.seek(off + 4096 + 100)
        b = f.read(1)
        f.seek(off + 4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    used = store.stats()["tiers"]["disk"]["used_blocks"]
    dst = np.zeros((2, BLOCK), np.uint8)
    assert store.get(keys([0, 1]), dst).result(10) == [False, True]
    np.testing.assert_array_equal(dst[1], blocks([1])[0])
    s = store.stats()
    assert s["corrupted"] == 1 and s["tiers"]["disk"]["corrupted"] == 1
    assert s["tiers"]["disk"]["used_blocks"] == used - 1  # key 0's slot reclaimed (1 promoted)
    assert store.lookup(keys([0]))[0] == 0


def test_truncated_segment_is_a_counted_miss(tmp_path, store):
    for i in range(12):
        store.put(keys([i]), blocks([i])).result(10)
    store.flush(30)
    seg, off = _disk_slot(tmp_path, 0, store)
    os.truncate(seg, off + 4096 + 10)
    assert store.get(keys([0]), np.zeros((1, BLOCK), np.uint8)).result(10) == [False]
    assert store.stats()["corrupted"] == 1


def test_unwritable_directory_is_a_clear_error_at_start(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(tc.StorageIOError, match="cannot be created"):
        tc.KVStore(BLOCK, 4, disk_dir=tmp_path / "file" / "sub", disk_blocks=8)
    with pytest.raises(tc.StorageIOError, match="disk tier directory"):
        tc.KVStore(BLOCK, 4, disk_dir="/proc/tpusync-cannot-be-here", disk_blocks=8)


def test_a_refused_open_leaves_no_host_tier_in_dev_shm(tmp_path):
    """FAILED OPEN RULE: a namespaced store whose disk tier or settings were refused (a directory
    locked by another store, an unknown io_backend or policy) left its /dev/shm host segment
    behind, fully allocated, one per namespace tried."""
    owner = tc.KVStore(BLOCK, 4, disk_dir=tmp_path / "taken", disk_blocks=8)
    ns = f"test-failed-open-{uuid.uuid4().hex[:8]}"
    seg = Path(f"/dev/shm/tpusync-{ns}-host")
    try:
        with pytest.raises(tc.StateError, match="in use by another process"):
            tc.KVStore(BLOCK, 64, namespace=ns, disk_dir=tmp_path / "taken", disk_blocks=8)
        assert not seg.exists()
        with pytest.raises(tc.TpusyncError, match="bogus"):
            tc.KVStore(
                BLOCK, 64, namespace=ns, disk_dir=tmp_path / "d", disk_blocks=8, io_backend="bogus"
            )
        assert not seg.exists()
        with pytest.raises(tc.TpusyncError, match="nope"):
            tc.KVStore(BLOCK, 64, namespace=ns, policy="nope")
        assert not seg.exists()
        tc.KVStore(BLOCK, 64, namespace=ns).close()  # the namespace itself is fine
        assert seg.exists()
    finally:
        owner.close()
        for p in (seg, Path(f"{seg}.lock")):
            p.unlink(missing_ok=True)


def test_a_disk_tier_too_large_for_its_bookkeeping_is_refused_by_name(tmp_path):
    """BOOKKEEPING BOUND: disk_blocks=2**31 allocated ~36 bytes of RAM per slot at open, and the
    process was OOM-killed (or saw a bare std::bad_alloc under a memory limit)."""
    with pytest.raises(tc.InvalidArgumentError, match=r"disk_blocks 4294967295 needs about"):
        tc.KVStore(BLOCK, 4, disk_dir=tmp_path, disk_blocks=2**32 - 1)


def test_second_process_on_the_same_directory_gets_a_lock_error(tmp_path):
    s = tc.KVStore(BLOCK, 4, disk_dir=tmp_path, disk_blocks=8)
    code = textwrap.dedent(
        f"""
        import tpusync.core as tc
        try:
            tc.KVStore({BLOCK}, 4, disk_dir={str(tmp_path)!r}, disk_blocks=8)
        except tc.StateError as e:
            print("REFUSED", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "REFUSED" in out.stdout and "in use by another process" in out.stdout, out
    s.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)])
    if r.returncode != 0:
        pytest.skip("mount -t tmpfs refused here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_keeps_serving_from_dram(small_tmpfs):
    block = 64 << 10
    # 64 disk slots of 68 KiB would need 4.3 MiB: the 1 MiB tmpfs fills up after a dozen.
    s = tc.KVStore(block, 4, disk_dir=small_tmpfs, disk_blocks=64, writeback_batch=2)
    for i in range(30):
        assert s.put(keys([i]), blocks([i], block)).result(10) == [True]
    s.flush(30)
    st = s.stats()
    assert st["tiers"]["disk"]["no_space_errors"] > 0
    assert st["writeback_errors"] > 0
    # Still serving: the newest blocks from DRAM, older ones from disk or counted as evicted.
    dst = np.zeros((30, block), np.uint8)
    found = s.get(keys(range(30)), dst).result(10)
    assert all(found[-4:])
    for i, ok in enumerate(found):
        if ok:
            np.testing.assert_array_equal(dst[i], blocks([i], block)[0])
    assert sum(found) + s.stats()["evicted"] >= 30
    assert s.put(keys([99]), blocks([99], block)).result(10) == [True]
    s.close()


def _accepts_o_direct(directory: Path) -> bool:
    """Whether this kernel and filesystem accept open(O_DIRECT) in `directory` (probed directly)."""
    probe = directory / ".odirect-probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def _disk_round_trip(directory, direct_io: bool = True) -> dict:
    """Disk-only store (every put and get goes through the disk tier); returns its disk stats."""
    block = 8192
    s = tc.KVStore(block, 0, disk_dir=directory, disk_blocks=16, direct_io=direct_io)
    try:
        ids = list(range(12))
        assert s.put(keys(ids), blocks(ids, block)).result(30) == [True] * 12
        # An odd row stride: the source and destination rows are not 4 KiB aligned, so an O_DIRECT
        # tier must bounce them while a buffered one must not need to.
        src = np.zeros((3, block + 8), np.uint8)[:, 8:]
        src[:] = blocks([100, 101, 102], block)
        assert s.put(keys([100, 101, 102]), src).result(30) == [True] * 3
        dst = np.zeros((15, block + 8), np.uint8)[:, 8:]
        assert all(s.get(keys(ids + [100, 101, 102]), dst).result(30))
        assert np.array_equal(dst, blocks(ids + [100, 101, 102], block))
        st = s.stats()["tiers"]["disk"]
        assert st["hits"] == 15 and st["read_errors"] == 0 and st["write_errors"] == 0
        return st
    finally:
        s.close()


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs mount: a filesystem that refuses O_DIRECT with EINVAL on every kernel."""
    if os.geteuid() != 0:
        pytest.skip("mounting a ramfs needs root (CI runs as root)")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)]).returncode != 0:
        pytest.skip("mount -t ramfs refused here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_tier_falls_back_to_buffered_io_where_o_direct_is_refused(ramfs):
    assert not _accepts_o_direct(ramfs)  # the premise: this filesystem refuses O_DIRECT
    st = _disk_round_trip(ramfs / "kv")
    assert st["direct_io"] is False


def test_disk_tier_on_dev_shm_works_and_reports_its_mode(tmp_path):
    # tmpfs refused O_DIRECT before Linux 6.6 and accepts it since: either way the tier works and
    # reports the mode the kernel actually gave it.
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    d = shm / f"tpusync-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        expected = _accepts_o_direct(d)
        assert _disk_round_trip(d / "kv")["direct_io"] is expected
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_direct_io_false_is_honoured(tmp_path):
    assert _disk_round_trip(tmp_path / "kv", direct_io=False)["direct_io"] is False


def test_prometheus_metrics(store):
    prometheus_client = pytest.importorskip("prometheus_client")
    store.put(keys([1]), blocks([1])).result(10)
    store.get(keys([1, 2]), np.zeros((2, BLOCK), np.uint8)).result(10)
    registry = prometheus_client.CollectorRegistry()
    store.prometheus(registry=registry)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'tpusync_store_tier_hits_total{tier="host"} 1.0' in text
    assert "tpusync_store_misses_total 1.0" in text
    assert 'tpusync_store_tier_capacity_blocks{tier="disk"} 64.0' in text
    assert 'tpusync_store_get_latency_seconds{stat="count"} 1.0' in text


WARM = textwrap.dedent(
    """
    import sys, time, numpy as np, tpusync.core as tc
    sys.path.insert(0, {here!r})
    from test_store import blocks, keys
    mode, ns, disk, fp = sys.argv[1:5]
    s = tc.KVStore({block}, 4, disk_dir=disk, disk_blocks=64, namespace=ns, fingerprint=fp,
                   writeback_batch=2)
    ids = list(range(14))
    if mode == "fill":
        for i in ids:
            s.put(keys([i]), blocks([i])).result(10)
        s.flush(30)
        print("READY", flush=True)
        time.sleep(120)
    else:
        n, where = s.lookup(keys(ids))
        dst = np.zeros((14, {block}), np.uint8)
        found = s.get(keys(ids), dst).result(10)
        good = all(found) and bool((dst == blocks(ids)).all())
        st = s.stats()["tiers"]
        print("RESULT", n, sum(found), good, st["host"]["recovered"], st["disk"]["recovered"])
    """
)


def test_sigkill_warm_restart_and_fingerprint_cold_start(tmp_path):
    ns = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "warm.py"
    script.write_text(WARM.format(here=str(Path(__file__).parent), block=BLOCK))
    disk = str(tmp_path / "disk")
    try:
        filler = subprocess.Popen(
            [sys.executable, str(script), "fill", ns, disk, "model-1"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert filler.stdout.readline().strip() == "READY"
        filler.kill()  # SIGKILL: no destructor, no unlink, no flush
        assert filler.wait(30) == -9

        again = subprocess.run(
            [sys.executable, str(script), "check", ns, disk, "model-1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        words = again.stdout.split()
        assert words[:4] == ["RESULT", "14", "14", "True"], again
        assert int(words[4]) == 4 and int(words[5]) >= 10  # DRAM re-attached + disk rebuilt

        other = subprocess.run(
            [sys.executable, str(script), "check", ns, disk, "model-2"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.stdout.split()[:3] == ["RESULT", "0", "0"], other
        assert "model fingerprint changed ('model-1' -> 'model-2'): cold start" in other.stderr
    finally:
        tc.KVStore.unlink_namespace(ns)
    assert not Path(f"/dev/shm/tpusync-{ns}-host").exists()


@pytest.mark.parametrize(("recency", "survivor"), [("exact_lru", 0), ("clock", 1)])
def test_recency_mode_is_honoured(recency, survivor):
    """``recency=`` reaches the index: the two modes evict in different orders.

    Four blocks in a four-block host tier (no disk), then lookups of 1 and then 0. Exact LRU
    orders them 2, 3, 1, 0, so three new puts evict 2, 3, 1 and keep 0. CLOCK only marks 0 and 1
    as referenced; the first eviction gives both a second chance (relinked in list order, 0
    before 1), so three puts evict 2, 3, 0 and keep 1.
    """
    s = tc.KVStore(BLOCK, 4, recency=recency)
    try:
        assert s.recency == recency
        for i in range(4):
            assert s.put(keys([i]), blocks([i])).result(timeout=10) == [True]
        assert s.lookup(keys([1]))[0] == 1
        assert s.lookup(keys([0]))[0] == 1
        for i in range(4, 7):
            assert s.put(keys([i]), blocks([i])).result(timeout=10) == [True]
        kept = [i for i in range(4) if s.lookup(keys([i]))[0] == 1]
        assert kept == [survivor]
    finally:
        s.close()


def test_recency_accepts_the_enum_and_rejects_unknown_names():
    s = tc.KVStore(BLOCK, 2, recency=tc._native.Recency.EXACT_LRU)
    try:
        assert s.recency == "exact_lru"
    finally:
        s.close()
    with pytest.raises(ValueError, match="recency"):
        tc.KVStore(BLOCK, 2, recency="lfu")
    s = tc.KVStore(BLOCK, 2)
    try:
        assert s.recency == "clock"  # the index default (BlockIndex.kDefaultRecency)
    finally:
        s.close()
