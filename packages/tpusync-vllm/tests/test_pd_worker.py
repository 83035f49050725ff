"""The connector's P/D worker half (PdWorker) without vLLM: the ABANDON CONTRACT glue that
get_finished relies on for requests finished (aborted) while their KV is still loading."""

from __future__ import annotations

import time

import pytest
import torch

from tpusync.vllm.pd import PdWorker

SECRET = "pd-worker-test-secret-0123456789"


def layers(blocks: int = 8, row_bytes: int = 256, n: int = 2, fill: int | None = None):
    g = torch.Generator().manual_seed(3)
    if fill is not None:
        return [torch.full((blocks, row_bytes), fill, dtype=torch.uint8) for _ in range(n)]
    return [
        torch.randint(0, 255, (blocks, row_bytes), generator=g, dtype=torch.uint8) for _ in range(n)
    ]


def until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    prod = PdWorker(layers(), producer=True, pool_blocks=8, same_host=False, timeout_s=120.0)
    cons = PdWorker(layers(fill=0), producer=False, pool_blocks=8, timeout_s=120.0)
    yield prod, cons
    cons.close()
    prod.close()


def test_abandon_drops_loading_receives_and_frees_both_pools(pair):
    """A request finished while loading: its receive is dropped at once (never scattered into
    vLLM's blocks, never reported by poll), the producer is told to drop its copy of the prefill
    (its pool is whole again long before its 120 s deadline) and the staging blocks come back."""
    prod, cons = pair
    prod.publish(11, [1, 2, 3])  # held by the producer until acknowledged or released
    assert prod.pool.num_free == 5
    # A receipt that fails (one block short): the producer keeps its blocks for a retry.
    cons.start("req-a", 11, prod.address, [4, 5])
    # A receive whose prefill was never published: still waiting at the producer.
    cons.start("req-b", 12, prod.address, [6])
    assert cons.pool.num_free == 5 and cons.pending == 2
    time.sleep(0.2)  # req-a's refusal arrived; nothing polled it yet
    gone = cons.abandon({"req-a", "req-b", "req-unknown"}, "aborted by the client")
    assert gone == {"req-a", "req-b"}
    assert cons.pending == 0
    # The staging blocks come back once the background abandons returned; poll reports nothing
    # for the abandoned requests, and vLLM's blocks were never written.
    seen: list[tuple[set[str], dict[str, list[int]]]] = []

    def drained() -> bool:
        seen.append(cons.poll())
        return cons.abandoning == 0

    assert until(drained)
    assert cons.pool.num_free == 8
    assert all(not done and not failed for done, failed in seen)
    assert all(int(t.sum()) == 0 for t in cons.layers)
    # The producer dropped its reference at once (its deadline is 120 s away).
    assert until(lambda: (prod.poll(), prod.pool.num_free)[1] == 8)
    assert prod.producer.pending == 0
    # Abandoning again (or a request that never loaded) is a no-op.
    assert cons.abandon({"req-a"}) == set()


def test_a_receive_that_completed_is_not_abandoned_twice(pair):
    prod, cons = pair
    prod.publish(21, [0, 7])
    cons.start("req-c", 21, prod.address, [2, 3])
    assert until(lambda: "req-c" in cons.poll()[0])
    for j, t in enumerate(cons.layers):  # scattered into vLLM's blocks
        assert torch.equal(t[[2, 3]], prod.layers[j][[0, 7]])
    assert cons.abandon({"req-c"}) == set()
    assert until(lambda: (prod.poll(), prod.pool.num_free)[1] == 8)


def test_a_killed_producers_segment_is_reclaimed_by_the_next_producer(monkeypatch):
    """A vLLM worker killed by SIGKILL (OOM kill, crash) leaves its P/D pool in /dev/shm; the next
    producer on the host removes it (OWNER LOCK CONTRACT) and keeps live producers' pools."""
    import os
    import signal
    import subprocess
    import sys

    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    live = PdWorker(layers(), producer=True, pool_blocks=8, name="live", timeout_s=120.0)
    script = (
        "import os, signal, sys, torch\n"
        "from tpusync.vllm.pd import PdWorker\n"
        "w = PdWorker([torch.zeros(8, 256, dtype=torch.uint8)] * 2, producer=True, pool_blocks=8,\n"
        "             name='killed')\n"
        "print(w.pool.native.shm_name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    killed = proc.stdout.strip()
    assert killed.startswith("tpusync-pd-killed-") and os.path.exists(f"/dev/shm/{killed}")
    try:
        assert live.pool.native.shm_name and os.path.exists(f"/dev/shm/{live.pool.native.shm_name}")
        new = PdWorker(layers(), producer=True, pool_blocks=8, name="next", timeout_s=120.0)
        try:
            assert not os.path.exists(f"/dev/shm/{killed}")
            assert os.path.exists(f"/dev/shm/{live.pool.native.shm_name}")
            assert os.path.exists(f"/dev/shm/{new.pool.native.shm_name}")
        finally:
            new.close()
    finally:
        live.close()
        if os.path.exists(f"/dev/shm/{killed}"):
            os.unlink(f"/dev/shm/{killed}")
