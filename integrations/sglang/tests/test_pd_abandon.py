"""The decode side of the ABORT CONTRACT in tpusync.sglang.pd, in one process: SGLang's abort of
a room abandons that room's fetches in flight (and only those), so the prefill's producer drops
the chunks' blocks at once. Real PdProducer / PdConsumer over loopback; the manager is built bare
(its SGLang constructor needs a bootstrap server), with just the state the abandon path uses."""

from __future__ import annotations

import queue
import threading
import time

import pytest

pytest.importorskip("sglang")

SECRET = b"sglang-abandon-test-secret-0123456789"


def test_abort_abandons_the_rooms_fetches_and_the_prefill_drops_its_blocks():
    import tpusync.core as tc
    from tpusync.core.pd import PdConsumer, PdProducer
    from tpusync.sglang import pd

    ppool, cpool = tc.HostBlockPool(4096, 4), tc.HostBlockPool(4096, 4)
    with PdProducer(ppool, secret=SECRET) as prod:
        src = ppool.alloc(2)
        prod.register_send(777, src, deadline=120.0)  # far beyond this test
        ppool.free(src)
        mgr = object.__new__(pd.TpusyncKVManager)
        mgr._stopped = False
        mgr._lock = threading.Lock()
        mgr._abandon = queue.Queue()
        mgr.consumer = PdConsumer(cpool, streams=1, secret=SECRET)
        # Room 5: a chunk whose receipt failed (one block short: the producer keeps its blocks
        # for a retry) and a chunk still waiting at the producer; room 6: a chunk in flight.
        fetches = {777: (5, cpool.alloc(1)), 778: (5, cpool.alloc(1)), 779: (6, cpool.alloc(1))}
        for rid, (_room, ids) in fetches.items():
            mgr.consumer.start_recv(rid, prod.address, ids, deadline=60.0)
        way = pd._Way(cpool, mgr.consumer)
        mgr._fetching = {
            rid: pd._Fetch(room, 0, way, ids, 0, 1, False, None, 1)
            for rid, (room, ids) in fetches.items()
        }
        assert mgr.consumer.wait(777, timeout=10.0).failed
        assert ppool.num_free == 2 and prod.pending == 1
        worker = threading.Thread(target=mgr._decode_abandon_loop, daemon=True)
        worker.start()
        mgr.abandon_room(5, "aborted by the decode")  # what TpusyncKVReceiver.abort calls
        mgr._abandon.put(None)
        worker.join(timeout=20.0)
        assert not worker.is_alive()
        # The prefill dropped room 5's chunk at once (its deadline is 120 s away).
        end = time.monotonic() + 10.0  # the serving thread lets go of its borrow just after
        while not (ppool.num_free == 4 and prod.pending == 0) and time.monotonic() < end:
            time.sleep(0.01)
        assert ppool.num_free == 4 and prod.pending == 0
        (sent,) = [r for r in prod.poll() if r.request_id == 777]
        assert sent.failed and "released by consumer" in sent.reason, sent
        assert "room 5 aborted by the decode" in sent.reason, sent
        # Room 5's waiting fetch ended at once with the reason; room 6's was left alone.
        states = {r.request_id: r for r in mgr.consumer.poll()}
        assert states[778].failed and states[778].code == "Cancelled", states[778]
        assert states[778].reason.endswith("room 5 aborted by the decode")
        assert states[779].state == "pending"
