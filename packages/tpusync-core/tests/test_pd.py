"""P/D streaming across real processes and sockets (127.0.0.1, ephemeral ports)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tpusync.core as tc
from tpusync.core.pd import PdConsumer, PdProducer, load_secret, pair_layers

SECRET = b"pd-python-test-secret-0123456789"
BLOCK = 64 << 10

PRODUCER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import tpusync.core as tc
    from tpusync.core.pd import PdProducer

    pool = tc.HostBlockPool(BLOCK, N, shm_name=SHM)
    ids = pool.alloc(N)
    for i, b in enumerate(ids):
        pool.view(b)[:] = np.arange(BLOCK, dtype=np.uint64).astype(np.uint8) + i
    prod = PdProducer(pool, unix_path=UNIX)  # secret from $TPUSYNC_AUTH_SECRET
    prod.register_send(42, ids, deadline=60.0, blocks_per_group=4)
    pool.free(ids)  # the producer holds its own reference until the consumer acks
    print(prod.address, prod.unix_address or "", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for r in prod.poll():
            if r.request_id == 42 and r.state != "pending":
                print(r.state, pool.num_free, flush=True)
                prod.close()
                sys.exit(0)
        time.sleep(0.01)
    sys.exit(3)
    """
)


def expected(i: int) -> np.ndarray:
    return np.arange(BLOCK, dtype=np.uint64).astype(np.uint8) + i


def start_producer(n: int, shm: str, unix: str) -> tuple[subprocess.Popen, str, str]:
    code = f"BLOCK={BLOCK}\nN={n}\nSHM={shm!r}\nUNIX={unix!r}\n" + PRODUCER
    env = dict(os.environ, TPUSYNC_AUTH_SECRET=SECRET.decode())
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    line = proc.stdout.readline().split()
    assert line, "producer did not start"
    return proc, line[0], (line[1] if len(line) > 1 else "")


@pytest.mark.parametrize("same_host_shm", [False, True])
def test_pd_between_two_processes(tmp_path, same_host_shm):
    n = 12
    shm = f"tpusync-pytest-pd-{os.getpid()}-{int(same_host_shm)}"
    unix = str(tmp_path / "p.sock") if same_host_shm else ""
    proc, tcp_addr, unix_addr = start_producer(n, shm, unix)
    try:
        pool = tc.HostBlockPool(BLOCK, n)
        dst = pool.alloc(n)
        consumer = PdConsumer(pool, streams=3, secret=SECRET)
        peer = unix_addr if same_host_shm else tcp_addr
        consumer.start_recv(42, peer, dst, deadline=30.0)
        first = consumer.wait(42, groups=1, timeout=30.0)  # layer 0 usable early
        assert first.groups_ready >= 1 and first.groups_total == 3
        res = consumer.wait(42, timeout=30.0)
        assert res.done, res.reason
        assert res.shm is same_host_shm
        assert res.bytes == n * BLOCK
        for i, b in enumerate(dst):
            np.testing.assert_array_equal(pool.view(b), expected(i))
        out, _ = proc.communicate(timeout=30)
        state, free = out.split()
        assert state == "done" and int(free) == n  # producer freed every block after the ack
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_wrong_secret_fails_with_auth_error_and_data_stays_untouched():
    pool = tc.HostBlockPool(4096, 4)
    with PdProducer(pool, secret=SECRET) as prod:
        src = pool.alloc(2)
        prod.register_send(1, src, deadline=0.5)
        cpool = tc.HostBlockPool(4096, 4)
        dst = cpool.alloc(2)
        cpool.view(dst[0])[:] = 7
        consumer = PdConsumer(cpool, streams=1, secret=b"a-different-secret-0123456789")
        consumer.start_recv(1, prod.address, dst, deadline=5.0)
        res = consumer.wait(1, timeout=10.0)
        assert res.failed and res.code == "PermissionDenied", res
        assert (cpool.view(dst[0]) == 7).all()
        # Nobody acknowledged: the deadline releases the producer's reference.
        for _ in range(500):
            done = [r for r in prod.poll() if r.request_id == 1 and r.state != "pending"]
            if done:
                break
            time.sleep(0.01)
        assert done and done[0].code == "Timeout"


def test_register_send_errors_are_typed():
    pool = tc.HostBlockPool(4096, 4)
    with PdProducer(pool, secret=SECRET) as prod:
        ids = pool.alloc(1)
        prod.register_send(5, ids, deadline=10.0)
        with pytest.raises(tc.AlreadyExistsError):
            prod.register_send(5, ids, deadline=10.0)
        with pytest.raises(tc.InvalidArgumentError):
            prod.register_send(6, [], deadline=10.0)
        with pytest.raises(tc.StateError):
            prod.register_send(7, [ids[0] + (1 << 40)], deadline=10.0)


def test_consumer_arguments_are_refused_by_name_and_close_is_final():
    """A float block id was truncated into another block; streams=0 was accepted and failed every
    striped pull later; a PdConsumer had no close()."""
    pool = tc.HostBlockPool(4096, 4)
    with pytest.raises(tc.InvalidArgumentError, match="streams must be 1..64, got 0"):
        PdConsumer(pool, secret=SECRET, streams=0)
    with PdProducer(pool, secret=SECRET) as prod, PdConsumer(pool, secret=SECRET) as cons:
        ids = pool.alloc(2)
        with pytest.raises(TypeError, match="destination block ids must be integers, got float"):
            cons.start_recv(1, prod.address, [float(ids[0]), float(ids[1])])
        with pytest.raises(ValueError, match="readers\\[0\\] must be >= 0"):
            cons.recv_multi(1, [(prod.address, ids, -1)])
    with pytest.raises(tc.StateError, match="closed"):
        cons.poll()


def test_a_unix_path_that_is_not_a_stale_socket_is_left_alone(tmp_path):
    """UNIX PATH RULE: a producer unlinked whatever was at its unix path (a user's file became a
    socket, then vanished at close) and took over a live producer's socket."""
    pool = tc.HostBlockPool(4096, 4)
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    with pytest.raises(tc.AlreadyExistsError, match="is not a socket"):
        PdProducer(pool, secret=SECRET, unix_path=str(notes))
    assert notes.read_text() == "keep me"
    path = str(tmp_path / "p.sock")
    with PdProducer(pool, secret=SECRET, unix_path=path):
        with pytest.raises(tc.AlreadyExistsError, match="a live process listens on it"):
            PdProducer(pool, secret=SECRET, unix_path=path)
        assert os.path.exists(path)
    assert not os.path.exists(path)


def test_cancel_ends_a_send_at_once_reports_it_once_and_frees_its_blocks():
    """CANCEL CONTRACT: a cancelled send is failed (code Cancelled, the caller's reason) in the
    next poll only, its blocks are free again, and it cannot be cancelled twice (a pull of it is
    refused: PdStream.CancelEndsASendAtOnceAndReportsItOnce in C++)."""
    pool = tc.HostBlockPool(4096, 4)
    with PdProducer(pool, secret=SECRET) as prod:
        ids = pool.alloc(2)
        prod.register_send(9, ids, deadline=60.0)
        pool.free(ids)
        assert pool.num_free == 2
        with pytest.raises(ValueError, match="cancel needs a reason"):
            prod.cancel(9, "")
        prod.cancel(9, "sampler 1:0 presumed dead")
        assert pool.num_free == 4
        (st,) = prod.poll()
        assert (st.request_id, st.state, st.code) == (9, "failed", "Cancelled")
        assert st.reason.endswith("sampler 1:0 presumed dead"), st.reason
        assert prod.poll() == [] and prod.pending == 0
        with pytest.raises(tc.NotFoundError, match="cannot cancel request 9"):
            prod.cancel(9, "again")


def test_a_relay_forwards_a_receive_block_by_block_with_the_origins_checksums():
    """RELAY CONTRACT: origin -> middle (its consumer hands every landed block to its own
    producer's relay) -> end, across three pools. The end gets the origin's bytes and checksums;
    the middle may free its blocks at once (the relay holds its own references until the end
    acknowledged)."""
    n = 6
    opool, mpool, epool = (tc.HostBlockPool(BLOCK, n) for _ in range(3))
    src = opool.alloc(n)
    for i, b in enumerate(src):
        opool.view(b)[:] = expected(i)
    sums = [tc.checksum64(opool.view(b)) for b in src]
    with (
        PdProducer(opool, secret=SECRET) as origin,
        PdProducer(mpool, secret=SECRET) as middle_out,
    ):
        origin.register_send(1, src, deadline=30.0, checksums=sums)
        opool.free(src)
        middle_out.register_relay(2, n, deadline=30.0, blocks_per_group=1)
        middle_out.register_relay(3, n, deadline=30.0)  # a second child of the same bucket
        middle_in = PdConsumer(mpool, streams=2, secret=SECRET)
        mid = mpool.alloc(n)
        end = PdConsumer(epool, streams=2, secret=SECRET)
        dst, dst2 = epool.alloc(n), None
        end.start_recv(2, middle_out.address, dst, deadline=30.0)  # waits for the blocks
        middle_in.start_recv(
            1, origin.address, mid, deadline=30.0, relay=middle_out, relay_ids=[2, 3]
        )
        assert middle_in.wait(1, timeout=30.0).done
        mpool.free(mid)
        res = end.wait(2, timeout=30.0)
        assert res.done, res.reason
        assert list(res.checksums) == sums
        for i, b in enumerate(dst):
            np.testing.assert_array_equal(epool.view(b), expected(i))
        epool.free(dst)
        dst2 = epool.alloc(n)
        res2 = end.recv(3, middle_out.address, dst2, deadline=30.0)
        assert res2.done and list(res2.checksums) == sums, res2.reason
        for _ in range(500):
            if mpool.num_free == n:
                break
            time.sleep(0.01)
        assert mpool.num_free == n  # both relays let go once acknowledged


def test_relay_open_errors_are_typed():
    pool = tc.HostBlockPool(4096, 4)
    with PdProducer(pool, secret=SECRET) as prod:
        ids = pool.alloc(2)
        sums = [tc.checksum64(pool.view(b)) for b in ids]
        with pytest.raises(tc.NotFoundError, match="relay 4 is not live"):
            prod.open(4, 0, ids, sums)
        prod.register_send(5, ids[:1], deadline=10.0)
        with pytest.raises(tc.InvalidArgumentError, match="not as a relay"):
            prod.open(5, 0, ids[:1], sums[:1])
        prod.register_relay(4, 2, deadline=10.0)
        with pytest.raises(tc.AlreadyExistsError):
            prod.register_relay(4, 2, deadline=10.0)
        with pytest.raises(tc.InvalidArgumentError, match="which has 2"):
            prod.open(4, 1, ids, sums)
        with pytest.raises(tc.InvalidArgumentError, match="one per block"):
            prod.open(4, 0, ids, sums[:1])
        with pytest.raises(tc.InvalidArgumentError):
            prod.register_relay(6, 0, deadline=10.0)


def test_secret_comes_from_file_or_env(tmp_path, monkeypatch):
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    assert load_secret(f) == SECRET
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", "env-secret-0123456789")
    assert load_secret() == b"env-secret-0123456789"
    monkeypatch.delenv("TPUSYNC_AUTH_SECRET")
    with pytest.raises(ValueError, match="TPUSYNC_AUTH_SECRET"):
        load_secret()
    f.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16"):
        load_secret(f)


def test_recv_pulls_on_the_calling_thread_and_is_not_polled_again():
    pool = tc.HostBlockPool(16 << 10, 4)
    cpool = tc.HostBlockPool(16 << 10, 4)
    with PdProducer(pool, secret=SECRET) as prod:
        src = pool.alloc(1)
        pool.view(src[0])[:] = np.arange(16 << 10, dtype=np.uint64).astype(np.uint8)
        consumer = PdConsumer(cpool, secret=SECRET)  # 4 streams: a 16 KiB pull takes 1
        dst = cpool.alloc(1)
        for rid in range(1, 6):
            cpool.view(dst[0])[:] = 0
            prod.register_send(rid, src, deadline=10.0)
            res = consumer.recv(rid, prod.address, dst, deadline=10.0)
            assert res.done and res.bytes == 16 << 10, res
            assert np.array_equal(cpool.view(dst[0]), pool.view(src[0]))
        assert consumer.poll() == []
        assert consumer.idle_links == 1
        # Never registered: a failure by the deadline (plus a socket's moment), not a hang.
        t0 = time.monotonic()
        res = consumer.recv(99, prod.address, dst, deadline=0.3)
        assert res.failed and res.code in ("NotFound", "Timeout"), res
        assert time.monotonic() - t0 < 2.3


RELEASED_PRODUCER = textwrap.dedent(
    """
    import sys, time
    import tpusync.core as tc
    from tpusync.core.pd import PdProducer

    pool = tc.HostBlockPool(BLOCK, N + 2)
    ids = pool.alloc(N)
    prod = PdProducer(pool)  # secret from $TPUSYNC_AUTH_SECRET
    prod.register_send(50, ids, deadline=120.0)  # far beyond this test's waits
    pool.free(ids)
    print(prod.address, pool.num_free, flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for r in prod.poll():
            if r.request_id == 50 and r.state != "pending":
                print(r.state, r.code, pool.num_free, r.reason, flush=True)
                prod.close()
                sys.exit(0)
        time.sleep(0.01)
    sys.exit(3)
    """
)


def test_abandon_tells_the_producer_process_to_free_its_blocks_at_once():
    """ABANDON CONTRACT across two processes: a failed receipt alone leaves the producer holding
    the blocks for a retry (until its 120 s deadline); abandon() makes it drop them at once."""
    n = 4
    code = f"BLOCK={BLOCK}\nN={n}\n" + RELEASED_PRODUCER
    env = dict(os.environ, TPUSYNC_AUTH_SECRET=SECRET.decode())
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        addr, free_before = proc.stdout.readline().split()
        assert int(free_before) == 2  # the producer's reference holds n blocks
        pool = tc.HostBlockPool(BLOCK, n)
        dst = pool.alloc(n - 1)  # one block short: the producer refuses, keeps its blocks
        consumer = PdConsumer(pool, streams=1, secret=SECRET)
        consumer.start_recv(50, addr, dst, deadline=30.0)
        res = consumer.wait(50, timeout=30.0)
        assert res.failed and res.code == "InvalidArgument", res
        (rel,) = consumer.abandon(50, "decode request aborted")
        assert rel.released and rel.peer == addr, rel
        out, _ = proc.communicate(timeout=30)
        state, code_name, free_after, reason = out.split(maxsplit=3)
        assert (state, code_name, int(free_after)) == ("failed", "Cancelled", n + 2)
        assert "released by consumer" in reason and "decode request aborted" in reason, reason
        assert proc.returncode == 0
        # Reported once, with the failure that came first.
        (st,) = consumer.poll()
        assert st.request_id == 50 and st.code == "InvalidArgument"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_abandon_ends_a_waiting_receive_and_refuses_bad_calls():
    """A receive still waiting for the producer to register ends at once as Cancelled with the
    reason; the producer, which never had the request, answers NotFound. Unknown, completed and
    reason-less abandons are refused with typed errors."""
    pool = tc.HostBlockPool(4096, 4)
    cpool = tc.HostBlockPool(4096, 4)
    with PdProducer(pool, secret=SECRET) as prod:
        consumer = PdConsumer(cpool, streams=1, secret=SECRET)
        dst = cpool.alloc(2)
        consumer.start_recv(7, prod.address, dst, deadline=60.0)
        time.sleep(0.05)  # the pull is (most likely) waiting at the producer for a registration
        (rel,) = consumer.abandon(7, "client went away")
        assert not rel.released and rel.code == "NotFound", rel
        res = consumer.wait(7, timeout=10.0)
        assert res.failed and res.code == "Cancelled" and res.reason.endswith("client went away")
        with pytest.raises(tc.NotFoundError):
            consumer.abandon(7, "again")
        assert [r.request_id for r in consumer.poll()] == [7]
        assert consumer.poll() == []
        with pytest.raises(tc.NotFoundError):
            consumer.abandon(8, "never started")
        with pytest.raises(ValueError, match="abandon needs a reason"):
            consumer.abandon(8, "")
        src = pool.alloc(1)
        prod.register_send(9, src, deadline=10.0)
        dst1 = dst[:1]
        consumer.start_recv(9, prod.address, dst1, deadline=10.0)
        assert consumer.wait(9, timeout=10.0).done
        with pytest.raises(tc.StateError, match="already completed"):
            consumer.abandon(9, "too late")
        assert [r.state for r in consumer.poll()] == ["done"]


def test_pair_layers_sends_each_stage_row_to_the_same_layer_in_order():
    """LAYER PAIRING CONTRACT: K of layers 0..3 then V of them on the destination; a source stage
    holding layers 2 and 3 (K, K, V, V) lands on exactly those rows; a layer's second row goes to
    the destination's second row of it."""
    dst = [0, 1, 2, 3, 0, 1, 2, 3]
    assert pair_layers([2, 3, 2, 3], dst) == [2, 3, 6, 7]
    assert pair_layers([0, 1], dst) == [0, 1]
    assert pair_layers([3, 3], dst) == [3, 7]
    assert pair_layers([], dst) == []


def test_pair_layers_refuses_a_layer_the_destination_lacks_by_name():
    with pytest.raises(
        ValueError, match=r"no \(further\) row for model layer 4 \(its layers: 0..3, 4"
    ):
        pair_layers([4], [0, 1, 2, 3])
    with pytest.raises(ValueError, match="model layer 1 "):
        pair_layers([1, 1, 1], [0, 1, 0, 1])  # a third row of layer 1: the destination has two
    with pytest.raises(ValueError, match="its layers: none"):
        pair_layers([0], [])


@given(
    st.lists(st.integers(0, 6), max_size=24).flatmap(
        lambda dst: st.tuples(
            st.just(dst),
            st.permutations(dst).flatmap(lambda p: st.integers(0, len(p)).map(lambda n: p[:n])),
        )
    )
)
def test_pair_layers_pairs_any_subset_by_layer_and_occurrence(case):
    """Any sub-multiset of the destination's layers, in any order, pairs: every index distinct,
    each on a row of its own layer, and a layer's k-th source row on its k-th destination row."""
    dst, src = case
    out = pair_layers(src, dst)
    assert len(out) == len(src) == len(set(out))
    assert [dst[j] for j in out] == list(src)
    for layer in set(src):
        mine = [j for s, j in zip(src, out, strict=True) if s == layer]
        assert mine == [j for j, d in enumerate(dst) if d == layer][: len(mine)]
