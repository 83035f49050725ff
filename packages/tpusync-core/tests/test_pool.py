import threading

import numpy as np
import pytest

import tpusync.core as tc


@pytest.fixture
def pool():
    return tc.HostBlockPool(4096, 8)


def test_put_get_round_trip(pool):
    ids = pool.alloc(4)
    src = np.random.default_rng(0).integers(0, 255, (4, 4096), dtype=np.uint8)
    pool.put(ids, src).result(timeout=10)
    dst = np.zeros_like(src)
    pool.get(list(reversed(ids)), dst).result(timeout=10)
    np.testing.assert_array_equal(dst[::-1], src)


def test_rows_gather_scatter(pool):
    cache = np.arange(6 * 1024, dtype=np.float32).reshape(6, 1024)  # 6 rows of 4 KiB
    ids = pool.alloc(2)
    pool.put(ids, cache, rows=[5, 2]).result(timeout=10)
    out = np.zeros_like(cache)
    pool.get(ids, out, rows=[0, 1]).result(timeout=10)
    np.testing.assert_array_equal(out[0], cache[5])
    np.testing.assert_array_equal(out[1], cache[2])
    assert not out[2:].any()


def test_out_of_range_row_moves_nothing(pool):
    ids = pool.alloc(2)
    dst = np.full((3, 4096), 9, np.uint8)
    with pytest.raises(tc.InvalidArgumentError, match="out of range"):
        pool.get(ids, dst, rows=[0, 3]).result(timeout=10)
    assert (dst == 9).all()


def test_exhaustion_is_clear_and_harmless(pool):
    ids = pool.alloc(6)
    with pytest.raises(tc.PoolExhaustedError, match=r"requested 3 blocks of 4096 bytes.*2 of 8"):
        pool.alloc(3)
    with pytest.raises(MemoryError):  # also a builtin MemoryError
        pool.alloc(3)
    assert pool.num_free == 2
    pool.free(ids)
    assert pool.num_free == 8


def test_double_free_unknown_and_stale_ids(pool):
    (a,) = pool.alloc(1)
    pool.free([a])
    with pytest.raises(tc.StateError, match="already freed"):
        pool.free([a])
    with pytest.raises(tc.InvalidArgumentError, match="unknown block id"):
        pool.free([12345])
    (b,) = pool.alloc(1)  # may reuse a's slot with a new generation
    assert b != a
    with pytest.raises(tc.StateError):
        pool.address(a)


def test_view_is_zero_copy_and_writable(pool):
    (a,) = pool.alloc(1)
    v = pool.view(a, np.float16, (2, 1024))
    assert v.ctypes.data == pool.address(a)
    v[1, 3] = 2.5
    out = np.zeros((1, 4096), np.uint8)
    pool.get([a], out).result(timeout=10)
    assert out.view(np.float16)[0, 1024 + 3] == 2.5


def test_view_of_freed_block_refused_and_live_view_keeps_memory(pool):
    (a,) = pool.alloc(1)
    v = pool.view(a)
    v[:] = 3
    pool.free([a])
    with pytest.raises(tc.StateError):
        pool.view(a)
    # The slot is not recycled while the view lives.
    assert pool.num_free == 7
    assert (v == 3).all()
    del v
    assert pool.num_free == 8


def test_batch_borrow_is_all_or_nothing_and_delays_recycling(pool):
    ids = pool.alloc(3)
    (dead,) = pool.alloc(1)
    pool.free([dead])
    with pytest.raises(tc.StateError):
        pool.borrow([*ids, dead])  # one freed id: nothing borrowed
    assert pool.stats()["num_borrowed"] == 0
    b = pool.borrow(ids)
    assert len(b) == 3 and b.active
    assert list(b.slots) == [pool.native.slot_of(i) for i in ids]
    pool.free(ids)
    assert pool.num_free == 5  # the borrowed slots are not recycled yet
    b.release()
    b.release()  # idempotent
    assert not b.active and pool.num_free == 8


def test_view_with_wrong_dtype_or_shape(pool):
    (a,) = pool.alloc(1)
    with pytest.raises(
        tc.InvalidArgumentError, match=r"shape \(3, 3\) and dtype float32 covers 36"
    ):
        pool.view(a, "float32", (3, 3))
    with pytest.raises(tc.InvalidArgumentError, match="unsupported dtype"):
        pool.view(a, "complex64")
    with pytest.raises(tc.InvalidArgumentError, match="unsupported dtype 'complex64'"):
        pool.view(a, np.dtype("c8"))  # numpy knows it, tpusync views do not


def test_buffer_size_mismatch(pool):
    ids = pool.alloc(2)
    with pytest.raises(tc.InvalidArgumentError, match="does not hold 2 blocks of 4096 bytes"):
        pool.put(ids, np.zeros(4096, np.uint8))
    with pytest.raises(TypeError, match="src must be an array .* got list"):
        pool.put(ids, [0] * 8192)  # nanobind printed its signatures
    with pytest.raises(TypeError, match="dst is bytes, which is read-only"):
        pool.get(ids, bytes(8192))


def test_read_only_source_is_accepted_destination_refused(pool):
    ids = pool.alloc(1)
    src = np.ones(4096, np.uint8)
    src.flags.writeable = False
    pool.put(ids, src).result(timeout=10)
    with pytest.raises(TypeError, match="the destination array is read-only"):
        pool.get(ids, src)


def test_many_threads_share_a_pool():
    pool = tc.HostBlockPool(8192, 64)
    errors = []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(50):
                ids = pool.alloc(4)
                src = rng.integers(0, 255, (4, 8192), dtype=np.uint8)
                pool.put(ids, src).result(timeout=10)
                dst = np.empty_like(src)
                pool.get(ids, dst).result(timeout=10)
                np.testing.assert_array_equal(src, dst)
                pool.free(ids)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.num_free == 64


def test_shm_pool_persists_and_reattaches(tmp_path):
    name = f"tpusync-pytest-{np.random.default_rng().integers(1 << 30)}"
    a = tc.HostBlockPool(4096, 4, shm_name=name, persist=True)
    (blk,) = a.alloc(1)
    a.view(blk)[:4] = [1, 2, 3, 4]
    slot = a.native.slot_of(blk)
    del a
    b = tc.HostBlockPool(4096, 4, shm_name=name)
    try:
        assert b.native.attached
        claimed = b.native.claim(slot)
        assert list(b.view(claimed)[:4]) == [1, 2, 3, 4]
    finally:
        b.native.unlink()


def test_exit_removes_segments_of_pools_never_destroyed():
    """EXIT CONTRACT (host_pool.cc): a process that exits normally with a non-persistent /dev/shm
    pool still alive (its destructor never runs) leaves no segment; a persistent one stays."""
    import os
    import subprocess
    import sys

    tag = f"tpusync-pytest-exit-{os.getpid()}-{np.random.default_rng().integers(1 << 30)}"
    script = (
        "import ctypes, tpusync.core as tc\n"
        f"a = tc.HostBlockPool(4096, 4, shm_name='{tag}-temp')\n"
        f"b = tc.HostBlockPool(4096, 4, shm_name='{tag}-kept', persist=True)\n"
        # An extra reference nobody drops: the pools outlive the interpreter.
        "ctypes.pythonapi.Py_IncRef(ctypes.py_object(a))\n"
        "ctypes.pythonapi.Py_IncRef(ctypes.py_object(b))\n"
        "import os; assert os.path.exists('/dev/shm/' + a.native.shm_name)\n"
    )
    try:
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
        assert not os.path.exists(f"/dev/shm/{tag}-temp")
        assert os.path.exists(f"/dev/shm/{tag}-kept")
    finally:
        for suffix in ("-temp", "-kept"):
            if os.path.exists(f"/dev/shm/{tag}{suffix}"):
                os.unlink(f"/dev/shm/{tag}{suffix}")


def test_reclaim_removes_only_segments_of_killed_owners(caplog):
    """OWNER LOCK CONTRACT (shm_reclaim.h): a pool of a process killed by SIGKILL leaves its
    segment (no exit handler ran); reclaim_stale_segments removes it and nothing a live pool owns."""
    import logging
    import os
    import signal
    import subprocess
    import sys

    prefix = f"tpusync-pytest-reclaim-{os.getpid()}-{np.random.default_rng().integers(1 << 30)}-"
    live = tc.HostBlockPool(4096, 4, shm_name=prefix + "live")
    script = (
        "import os, signal, tpusync.core as tc\n"
        f"p = tc.HostBlockPool(4096, 4, shm_name='{prefix}killed')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", script], timeout=120)
        assert proc.returncode == -signal.SIGKILL
        assert os.path.exists(f"/dev/shm/{prefix}killed")
        with caplog.at_level(logging.INFO, logger="tpusync.core.pool"):
            gone = tc.reclaim_stale_segments(prefix)
        assert [name for name, _bytes in gone] == [prefix + "killed"]
        assert gone[0][1] == live.native.pool_bytes
        assert "reclaimed 1 /dev/shm segment(s)" in caplog.text
        assert not os.path.exists(f"/dev/shm/{prefix}killed")
        assert os.path.exists(f"/dev/shm/{prefix}live")
        assert tc.reclaim_stale_segments(prefix) == []
        with pytest.raises(tc.InvalidArgumentError, match="prefix"):
            tc.reclaim_stale_segments("tpusync")  # too short: could sweep other programs' names
    finally:
        live.native.unlink()
        if os.path.exists(f"/dev/shm/{prefix}killed"):
            os.unlink(f"/dev/shm/{prefix}killed")


def test_a_segment_a_live_pool_owns_is_refused_to_a_second_pool_in_another_process():
    """ONE POOL PER SEGMENT (host_pool.cc): the second process attached silently, and its block
    0 was the first process's block 0 (each pool has its own allocator over the same memory)."""
    import subprocess
    import sys

    name = f"tpusync-pytest-owned-{np.random.default_rng().integers(1 << 30)}"
    a = tc.HostBlockPool(4096, 4, shm_name=name, persist=True)
    try:
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import tpusync.core as tc; tc.HostBlockPool(4096, 4, shm_name='{name}')",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert other.returncode != 0
        assert "is in use by a live pool" in other.stderr, other.stderr
        with pytest.raises(tc.StateError, match="is in use by a live pool"):
            tc.HostBlockPool(4096, 4, shm_name=name)
    finally:
        a.native.unlink()
        del a
