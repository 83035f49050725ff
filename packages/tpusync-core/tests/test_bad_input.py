"""Bad input found by an audit of the Python API (2026-12-07): each case gets a clear error or the
documented meaning, never a crash, a hang or a silently wrong result."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tpusync.core as tc
from tpusync.core import _native

INF = float("inf")
BLOCK = 4096


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(8, "little") for i in range(n)]


def test_infinite_timeouts_wait_instead_of_expiring_at_once():
    """SECONDS CONTRACT (native/include/tpusync/base/seconds.h): inf means "for ever". It used to
    overflow to a negative duration, so wait(inf) returned False and result(inf) raised
    TimeoutError while the operation was still running."""
    engine = _native.Engine(1)
    pool = tc.HostBlockPool(BLOCK, 4, engine=engine)
    ids = pool.alloc(2)
    release = time.monotonic() + 0.5

    def hold_the_engine(_f):  # runs on the engine's only thread: the next put stays queued
        while time.monotonic() < release:
            time.sleep(0.01)

    first = pool.put(ids[:1], np.zeros(BLOCK, np.uint8))
    first.add_done_callback(hold_the_engine)
    queued = pool.put(ids[1:], np.ones(BLOCK, np.uint8))
    assert not queued.done()
    assert queued.wait(INF) is True and queued.done()
    queued.result(INF)
    assert time.monotonic() >= release - 0.05
    assert pool.native.wait_huge_pages(INF) is True  # no collapse runs on this pool


def test_infinite_put_wait_and_flush_wait_for_the_disk(tmp_path):
    """put_wait_s=inf waits for write-back to make room (it stored 2 of 32 before, against 32 of
    32 with put_wait_s=5); flush(inf) waits for the queue (it raised TimeoutError at once)."""
    store = tc.KVStore(
        BLOCK, 2, disk_dir=tmp_path, disk_blocks=64, put_wait_s=INF, huge_pages=False
    )
    stored = store.put(_keys(32), np.zeros((32, BLOCK), np.uint8)).result(60)
    assert sum(stored) == 32
    store.flush(INF)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"writeback_batch": 0}, "writeback_batch must be > 0"),
        ({"put_wait_s": math.nan}, "must be numbers"),
    ],
)
def test_store_settings_that_would_hang_are_refused(tmp_path, kwargs, message):
    """writeback_batch=0 looped for ever under the store's lock at the first write-back."""
    with pytest.raises(tc.InvalidArgumentError, match=message):
        tc.KVStore(BLOCK, 4, disk_dir=tmp_path, disk_blocks=8, huge_pages=False, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"remote_timeout": 0}, "remote_timeout must be > 0 seconds"),
        ({"remote_timeout": -1}, "remote_timeout must be > 0 seconds"),
        ({"lease_s": math.nan}, "lease_s must be > 0 seconds"),
    ],
)
def test_remote_store_timeouts_must_be_positive(kwargs, message):
    """A zero timeout made every request to the nodes fail: puts said True, then demotion lost
    the blocks. Refused before anything connects."""
    with pytest.raises(tc.InvalidArgumentError, match=message):
        tc.KVStore(BLOCK, 4, remote=["127.0.0.1:1"], auth_secret=b"s" * 32, **kwargs)


def test_memcpy_seconds_refuses_strided_arrays():
    """It checked only byte counts, then copied from data(): a reversed view wrote past it."""
    big = np.zeros(3 << 16, np.uint8)
    dst = big[1 << 16 : 2 << 16][::-1]
    with pytest.raises(tc.InvalidArgumentError, match="C-contiguous"):
        _native.memcpy_seconds(dst, np.ones(1 << 16, np.uint8))
    src = np.broadcast_to(np.ones(1, np.uint8), (1 << 16,))
    with pytest.raises(tc.InvalidArgumentError, match="C-contiguous"):
        _native.memcpy_seconds(np.zeros(1 << 16, np.uint8), src)
    assert not big.any()


def test_pool_sizes_that_wrap_around_are_refused():
    with pytest.raises(tc.InvalidArgumentError, match="2\\^32 blocks"):
        tc.HostBlockPool(BLOCK, 2**52 + 1)
    with pytest.raises(tc.InvalidArgumentError, match="do not fit in one address space"):
        tc.HostBlockPool(1 << 62, 8)


def test_index_key_arrays_must_be_uint8():
    """Other dtypes were cast element by element to uint8: 257 became 1, a false hit."""
    index = _native.BlockIndex()
    index.insert(bytes([1]), _native.Tier.HOST, 0)
    with pytest.raises(TypeError):
        index.lookup_prefix_array(np.array([[257]], dtype=np.int64))
    with pytest.raises(TypeError):
        index.insert_many(np.array([[1.9, 300.5]]), _native.Tier.HOST, 1)
    assert index.lookup_prefix_array(np.array([[1]], dtype=np.uint8)) == 1


def test_float_and_negative_ids_and_rows_are_refused():
    """A float array was truncated (1.7 -> row 1) and a negative entry wrapped to 2**64 - 1."""
    pool = tc.HostBlockPool(BLOCK, 4)
    ids = pool.alloc(1)
    src = np.zeros((3, BLOCK), np.uint8)
    with pytest.raises(TypeError, match="rows must be integers"):
        pool.put(ids, src, rows=np.array([1.7]))
    with pytest.raises(ValueError, match="block ids must be >= 0, got -1"):
        pool.free(np.array([-1]))
    with pytest.raises(TypeError, match="block ids must be integers"):
        pool.free(np.array(ids, dtype=np.float64))
    pool.put(np.array(ids, dtype=np.int64), src, rows=np.array([2], np.int32)).result(10)
    pool.free(np.array(ids, dtype=np.uint64))
    assert pool.num_free == 4


def test_a_read_only_destination_is_named_as_such():
    """nanobind's own error only listed the signatures it expected."""
    store = tc.KVStore(BLOCK, 4, huge_pages=False)
    store.put(_keys(1), np.zeros((1, BLOCK), np.uint8)).result(10)
    dst = np.zeros((1, BLOCK), np.uint8)
    dst.flags.writeable = False
    with pytest.raises(TypeError, match="the destination array is read-only"):
        store.get(_keys(1), dst)


@pytest.mark.parametrize("bad", [b"", b"k" * 65], ids=["empty", "65-bytes"])
def test_a_get_refuses_the_keys_a_put_refuses(bad):
    """An empty or over-long key was a silent miss in a get while a put raised."""
    store = tc.KVStore(BLOCK, 4, huge_pages=False)
    with pytest.raises(tc.InvalidArgumentError, match="key"):
        store.put([bad], np.zeros((1, BLOCK), np.uint8)).result(10)
    store.put(_keys(1), np.zeros((1, BLOCK), np.uint8)).result(10)
    with pytest.raises(tc.InvalidArgumentError, match="key"):
        store.get([*_keys(1), bad], np.zeros((2, BLOCK), np.uint8)).result(10)
    assert store.stats()["misses"] == 0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: tc.KVStore(-BLOCK, 4), "KVStore: block_bytes must be >= 0, got -4096"),
        (lambda: tc.KVStore(BLOCK, 4, disk_blocks=-1), "KVStore: disk_blocks must be >= 0"),
        (lambda: tc.KVStore(BLOCK, 4, io_threads=-2), "KVStore: io_threads must be >= 0"),
        (lambda: tc.HostBlockPool(BLOCK, -4), "HostBlockPool: num_blocks must be >= 0"),
        (lambda: tc.HostBlockPool(BLOCK, 4).alloc(-1), "alloc: n must be >= 0"),
        (lambda: tc.HostBlockPool(BLOCK, 4).free([0, -1]), "block ids must be >= 0, got -1"),
        (lambda: tc.Engine(-1), "Engine threads must be >= 0"),
    ],
    ids=["block_bytes", "disk_blocks", "io_threads", "num_blocks", "alloc", "free", "engine"],
)
def test_negative_counts_are_refused_by_name(make, message):
    """nanobind's error for a negative int only listed the signatures it expected."""
    with pytest.raises(ValueError, match=message):
        make()


def test_store_mask_is_read_only():
    store = tc.KVStore(BLOCK, 4, huge_pages=False)
    mask = store.put(_keys(2), np.zeros((2, BLOCK), np.uint8)).mask(10)
    assert mask.tolist() == [1, 1]
    with pytest.raises(ValueError):
        mask[0] = 0


def test_an_invalid_namespace_leaves_nothing_in_dev_shm():
    """The lock file was made before the name was checked."""
    name = f"bad name {os.getpid()}"
    with pytest.raises(tc.InvalidArgumentError, match="invalid host tier namespace"):
        tc.KVStore(BLOCK, 4, namespace=name)
    assert not [f for f in os.listdir("/dev/shm") if name in f]


def test_an_engine_that_cannot_start_its_threads_raises_instead_of_aborting():
    """Under an address-space limit, thread 1000 cannot be started: the engine stops the threads
    it started and raises (it called std::terminate: SIGABRT)."""
    script = textwrap.dedent(
        """
        import resource
        from tpusync.core import _native
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        try:
            _native.Engine(1000)
        except RuntimeError as e:
            print("raised:", e)
        else:
            print("started")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout.strip()
    assert out == "started" or out.startswith("raised: starting engine thread "), out
    if out == "started":
        pytest.skip("1000 threads fit in 3 GiB of address space here: nothing to refuse")
