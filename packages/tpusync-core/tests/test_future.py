import threading

import numpy as np
import pytest

import tpusync.core as tc


def big_copy(engine, mib=256):
    src = np.ones(mib << 20, np.uint8)
    dst = np.zeros_like(src)
    return tc._native.copy(engine, dst, src), dst


def test_result_and_state():
    eng = tc.Engine(2)
    f, dst = big_copy(eng, 8)
    f.result(timeout=30)
    assert f.done() and f.state == "done"
    assert dst.all()


def test_wait_times_out_and_result_raises_timeout():
    eng = tc.Engine(1)
    f, _ = big_copy(eng, 512)
    # 512 MiB cannot be copied in 0 s: wait reports not-done, result raises the builtin-compatible
    # TimeoutError, and the copy still completes afterwards.
    assert f.wait(0) is False or f.done()
    if not f.done():
        with pytest.raises(TimeoutError):
            f.result(timeout=0)
    f.result(timeout=60)


def test_cancel_pending_never_runs():
    eng = tc.Engine(1)
    blocker, _ = big_copy(eng, 512)
    src = np.ones(1 << 20, np.uint8)
    dst = np.zeros_like(src)
    victim = tc._native.copy(eng, dst, src)
    cancelled = victim.cancel()
    blocker.result(timeout=60)
    if cancelled:
        assert victim.state == "cancelled"
        with pytest.raises(tc.CancelledError):
            victim.result(timeout=1)
        assert not dst.any()
    else:  # the engine was faster than us; it must then have completed normally
        victim.result(timeout=10)


def test_done_callback_runs_once_with_future():
    eng = tc.Engine(2)
    seen = []
    ev = threading.Event()
    f, _ = big_copy(eng, 16)
    f.add_done_callback(lambda fut: (seen.append(fut.state), ev.set()))
    assert ev.wait(30)
    f.result(timeout=10)
    late = threading.Event()
    f.add_done_callback(lambda fut: late.set())  # already done: runs inline
    assert late.is_set()
    assert seen == ["done"]


def test_failed_operation_raises_mapped_error():
    pool = tc.HostBlockPool(4096, 2)
    with pytest.raises(tc.InvalidArgumentError):
        pool.put([99], np.zeros(4096, np.uint8)).result(timeout=10)


def test_dropping_a_future_waits_for_its_copy():
    eng = tc.Engine(1)
    src = np.ones(64 << 20, np.uint8)
    dst = np.zeros_like(src)
    f = tc._native.copy(eng, dst, src)
    del f  # must not free anything the worker still writes
    del src
    g = tc._native.copy(eng, np.zeros(8, np.uint8), np.ones(8, np.uint8))
    g.result(timeout=30)
    assert dst.all()
