import subprocess
import sys
import textwrap
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


def _run_alone(code: str, timeout: float = 60.0) -> str:
    """Runs `code` in a fresh interpreter; a hang fails the test (with the child's stacks, dumped
    by faulthandler) instead of stalling the run."""
    dump = f"import faulthandler\nfaulthandler.dump_traceback_later({timeout - 15}, exit=True)\n"
    try:
        done = subprocess.run(
            [sys.executable, "-c", dump + textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {timeout} s; output so far: {e.stdout!r} {e.stderr!r}")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_future_dropped_inside_a_done_callback_does_not_wait_for_its_copy():
    """DROP HAND-OFF: on a one-thread engine the callback runs on the only worker, so a dropped
    follow-up copy that waited could never run (it hung for good). The follow-up must still run
    into live buffers, and its arrays must be released once it has."""
    out = _run_alone(
        """
        import gc, time, weakref
        import numpy as np
        import tpusync.core as tc
        eng = tc.Engine(1)
        first_dst = np.zeros(1 << 20, np.uint8)
        first = tc._native.copy(eng, first_dst, np.ones(1 << 20, np.uint8))
        dst = np.zeros(64 << 20, np.uint8)
        refs = []
        def follow_up(_):
            src = np.full(64 << 20, 7, np.uint8)
            refs.append(weakref.ref(src))
            g = tc._native.copy(eng, dst, src)
            del g, src  # the copy is still queued behind this very callback
            print("callback returned", flush=True)
        first.add_done_callback(follow_up)
        first.result(timeout=30)
        deadline = time.monotonic() + 30
        while (not refs or refs[0]() is not None) and time.monotonic() < deadline:
            time.sleep(0.01)
            gc.collect()
        print("src released", bool(refs) and refs[0]() is None)
        print("copied", bool((dst == 7).all()))
        """
    )
    assert "callback returned" in out
    assert "src released True" in out
    assert "copied True" in out


def test_dropping_an_engine_while_a_copy_with_a_done_callback_runs():
    """GIL-FREE DESTRUCTION: the engine joins its workers with the GIL released, so the running
    copy's callback (which takes the GIL) can finish; holding the GIL there hung for good."""
    out = _run_alone(
        """
        import time
        import numpy as np
        import tpusync.core as tc
        eng = tc.Engine(1)
        src = np.ones(512 << 20, np.uint8)
        dst = np.zeros_like(src)
        f = tc._native.copy(eng, dst, src)
        f.add_done_callback(lambda fut: print("callback", fut.state, flush=True))
        while f.state == "pending":
            time.sleep(0.001)
        del eng
        print("engine dropped", f.state, flush=True)
        """
    )
    assert "callback done" in out or "callback cancelled" in out
    assert "engine dropped" in out


def test_closing_a_store_while_an_engine_callback_runs():
    """GIL-FREE DESTRUCTION: a store's close waits for its queued put, which waits behind a copy
    whose done-callback needs the GIL; closing with the GIL held hung for good."""
    out = _run_alone(
        """
        import numpy as np
        import tpusync.core as tc
        eng = tc.Engine(1)
        big = np.ones(512 << 20, np.uint8)
        copied = tc._native.copy(eng, np.zeros_like(big), big)
        copied.add_done_callback(lambda fut: print("callback", fut.state, flush=True))
        store = tc.KVStore(1 << 20, 8, huge_pages=False, engine=eng)
        put = store.put([b"k" * 32], np.ones((1, 1 << 20), np.uint8))
        store.close()
        print("closed, put", put.result(timeout=30), flush=True)
        """
    )
    assert "callback done" in out
    assert "closed, put [True]" in out


def test_closing_a_store_inside_a_callback_of_its_own_put():
    """GIL-FREE DESTRUCTION: inside a done-callback the store is released on a thread of its own.
    Waiting there for the put queued behind the callback, on the engine's only worker, hung for
    good. The queued put still completes, and the store does close (its disk lock is freed)."""
    out = _run_alone(
        """
        import sys, tempfile, time
        import numpy as np
        import tpusync.core as tc
        B = 1 << 20
        disk = tempfile.mkdtemp()
        eng = tc.Engine(1)
        store = tc.KVStore(B, 400, disk_dir=disk, disk_blocks=8, huge_pages=False, engine=eng)
        first = store.put([i.to_bytes(4, "little") * 8 for i in range(300)], np.ones((300, B), np.uint8))
        first.add_done_callback(lambda _: (store.close(), print("closed in callback", flush=True)))
        queued = store.put([b"z" * 32], np.ones((1, B), np.uint8))
        print("queued put", queued.result(timeout=30), flush=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                tc.KVStore(B, 4, disk_dir=disk, disk_blocks=8, huge_pages=False).close()
                print("reopened", flush=True)
                break
            except tc.TpusyncError as e:
                if time.monotonic() > deadline:
                    sys.exit(f"never closed: {e}")
                time.sleep(0.05)
        """
    )
    assert "closed in callback" in out
    assert "queued put [True]" in out
    assert "reopened" in out


def test_dropping_the_last_reference_to_an_engine_inside_its_own_callback():
    """GIL-FREE DESTRUCTION: the engine's destructor joins its workers, here the very thread that
    runs the callback; it aborted the process (std::system_error: resource deadlock avoided)."""
    out = _run_alone(
        """
        import time
        import numpy as np
        import tpusync.core as tc
        holder = [tc.Engine(1)]
        src = np.ones(256 << 20, np.uint8)
        dst = np.zeros_like(src)
        f = tc._native.copy(holder[0], dst, src)
        f.add_done_callback(lambda _: (holder.clear(), print("dropped", flush=True)))
        f.result(timeout=30)
        time.sleep(0.5)
        print("alive", bool(dst.all()), flush=True)
        """
    )
    assert "dropped" in out
    assert "alive True" in out


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_exit_while_a_done_callback_has_given_up_the_gil_is_clean():
    """EXIT GATE (engine_bindings.cc): the main thread exited while a done-callback slept (GIL
    released) on an engine worker; taking the GIL back during finalization aborted the process
    (rc 134, 5 of 5 runs). The atexit hook now waits for it."""
    for _ in range(3):
        done = _run(
            """
            import time, numpy as np, tpusync.core as tc
            src = np.ones(1 << 20, np.uint8); dst = np.empty_like(src)
            f = tc._native.copy(tc.default_engine(), dst, src)
            f.add_done_callback(lambda f: (time.sleep(0.3), print("callback done", flush=True)))
            f.wait(5)
            time.sleep(0.05)  # the callback now sleeps on an engine worker
            """
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "callback done" in done.stdout


def test_a_forked_child_exits_cleanly_and_is_told_why_it_cannot_use_the_parents_store():
    """FORK RULE (bindings.h, thread_pool.cc): a child forked after a store was used hung at
    exit for good (destroying the parent's engine joined threads the child does not have), and
    its put never ran (its wait timed out without saying why)."""
    done = _run(
        """
        import os, sys, numpy as np, tpusync.core as tc
        s = tc.KVStore(4096, 16)
        s.put([b"a"], np.ones((1, 4096), np.uint8)).result(5)
        pid = os.fork()
        if pid == 0:
            try:
                s.put([b"b"], np.ones((1, 4096), np.uint8)).result(5)
                print("child: put ran", flush=True)
            except tc.StateError as e:
                print("child:", e, flush=True)
            sys.exit(0)  # drops the parent's store and engine
        _, status = os.waitpid(pid, 0)
        print("child status", status, flush=True)
        assert s.lookup([b"a"])[0] == 1  # the parent's store is untouched
        """,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "child: " in done.stdout and "forked this one" in done.stdout, done.stdout
    assert "child status 0" in done.stdout


@pytest.mark.parametrize("call", ["result", "wait", "flush"])
def test_a_nan_timeout_is_refused_by_name(call):
    """WAIT TIMEOUT RULE (bindings.h): NaN acted as 0 ("not complete after nan s")."""
    eng = tc.Engine(1)
    f, _ = big_copy(eng, 8)
    store = tc.KVStore(4096, 4)
    target = {"result": f.result, "wait": f.wait, "flush": store.flush}[call]
    with pytest.raises(tc.InvalidArgumentError, match="a wait timeout must be a number of seconds"):
        target(float("nan"))
    f.result(timeout=30)
