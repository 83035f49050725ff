"""The worker-owned store and the scheduler's lookups (direct and over the socket), without vLLM."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch

import tpusync.core as tc
from tpusync.vllm.store import (
    LookupClient,
    LookupServer,
    WorkerStore,
    lookup_endpoint,
    model_fingerprint,
    share_salt,
)


def keys(*names: str) -> list[bytes]:
    return [n.encode().ljust(32, b"\0") for n in names]


def layers(blocks: int = 8, row_bytes: int = 256, n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 255, (blocks, row_bytes), generator=g, dtype=torch.uint8) for _ in range(n)
    ]


def test_save_load_roundtrip_across_layers_and_missing_blocks():
    src = layers()
    store = WorkerStore(src, host_blocks=4)
    k1, k2, k3 = keys("k1", "k2", "k3")
    assert store.save([k1, k2], [5, 1], timeout=10) == 2
    assert store.save([k1], [5], timeout=10) == 1  # already stored: counted, nothing copied
    dst = [torch.zeros_like(a) for a in src]
    store.bind(dst)  # the same store serves a "fresh" set of vLLM tensors
    failed = store.load([k1, k3, k2], [6, 0, 3], timeout=10)
    assert failed == [0]  # k3 was never stored: its block is reported, the others land
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(b[6], a[5]) and torch.equal(b[3], a[1])
        assert not b[0].any()
    store.close()


def test_layered_load_lands_layer_by_layer_and_reports_missing_blocks():
    src = layers(n=4)
    store = WorkerStore(src, host_blocks=4)
    k1, k2, k3 = keys("k1", "k2", "k3")
    assert store.save([k1, k2], [5, 1], timeout=10) == 2
    assert store.lookup("req", [k1, k2]).hit == 2 and store.num_pins == 2
    dst = [torch.zeros_like(a) for a in src]
    store.bind(dst)
    # Two "attention layers" of two row arrays each (K and V).
    load = store.start_load([k1, k3, k2], [6, 0, 3], 10, [[0, 1], [2, 3]], release=["req"])
    assert load.wait_layer(0)
    for j in (0, 1):  # layer 0's rows are in place once its wait returned
        assert torch.equal(dst[j][6], src[j][5]) and torch.equal(dst[j][3], src[j][1])
    assert load.wait_layer(1)
    failed, in_time = load.finish()
    assert (failed, in_time) == ([0], True)  # k3 was never stored
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(b[6], a[5]) and torch.equal(b[3], a[1]) and not b[0].any()
    assert store.num_pins == 0 and load.load_seconds > 0  # the lease ended with the get
    empty = store.start_load([], [], 10, release=[])
    assert empty.wait_layer(0) and empty.finish() == ([], True)
    store.close()


def test_fingerprint_and_salt_come_from_one_identity():
    ident = {"model": "m", "dtype": "float32", "block_size": 32, "rank": 0, "world": 1}
    # The salt is the first 16 bytes of the identity's digest, the fingerprint its hex form:
    # one set of fields, so they cannot drift apart; the fingerprint alone adds the shapes.
    assert share_salt(**ident).hex() == model_fingerprint(**ident)
    assert model_fingerprint(**ident, shapes=[(2, 8)]) != model_fingerprint(**ident)
    assert share_salt(**{**ident, "rank": 1}) != share_salt(**ident)


def test_lookup_leases_pin_and_release():
    store = WorkerStore(layers(), host_blocks=2, put_wait_s=0.1)
    a, b, c = keys("a", "b", "c")
    store.save([a, b], [0, 1], timeout=10)
    r = store.lookup("req-1", [a, b, c], pin_above=0)
    assert (r.hit, r.tiers) == (2, ("host", "host")) and store.num_pins == 2
    # Pinned keys survive a full store: the put of c is refused, a and b stay.
    assert store.save([c], [2], timeout=10) == 0
    assert store.lookup("req-2", [a, b], pin_above=2).hit == 2
    assert store.leases == ["req-1"]  # no lease when the hit is not longer than vLLM's own
    store.lookup("req-1", [a], pin_above=0)  # a new lookup replaces the request's lease
    assert store.num_pins == 1
    store.release(["req-1", "unknown"])
    assert store.num_pins == 0
    assert store.save([c], [2], timeout=10) == 1  # unpinned: LRU made room
    store.close()


def test_expired_lease_is_released():
    store = WorkerStore(layers(), host_blocks=2, lease_s=0.01)
    (a,) = keys("a")
    store.save([a], [0], timeout=10)
    store.lookup("r", [a])
    assert store.num_pins == 1
    import time

    time.sleep(0.05)
    store.lookup("other", [])  # every lookup expires stale leases first
    assert store.num_pins == 0
    store.close()


def test_warm_restart_through_namespace(tmp_path):
    ns = f"vllm-test-{uuid.uuid4().hex[:8]}"
    src = layers()
    a, b = keys("a", "b")
    try:
        s1 = WorkerStore(src, host_blocks=4, namespace=ns, fingerprint="fp1")
        s1.save([a, b], [2, 3], timeout=10)
        s1.close()
        dst = [torch.zeros_like(x) for x in src]
        s2 = WorkerStore(dst, host_blocks=4, namespace=ns, fingerprint="fp1")
        assert s2.lookup("r", [a, b]).hit == 2
        assert s2.load([a, b], [0, 1], timeout=10) == []
        assert all(
            torch.equal(d[0], x[2]) and torch.equal(d[1], x[3])
            for d, x in zip(dst, src, strict=True)
        )
        s2.close()
        s3 = WorkerStore(dst, host_blocks=4, namespace=ns, fingerprint="other-model")
        assert s3.lookup("r", [a]).hit == 0  # another fingerprint: cold start
        s3.close()
    finally:
        tc.KVStore.unlink_namespace(ns)


def test_lookup_sockets_are_named_by_the_whole_engine_id_and_never_taken_from_a_live_engine():
    """SOCKET NAME RULE: DP engines <uuid>_dp1 and <uuid>_dp10 shared one socket name (the id was
    cut to 40 characters), the second unlinked the first's live socket, and its scheduler then
    asked the other engine's worker. Now the names differ, a live socket is refused, and close()
    removes the socket file."""
    base = uuid.uuid4().hex + uuid.uuid4().hex[:4]
    one, ten = lookup_endpoint(f"{base}_dp1", 0), lookup_endpoint(f"{base}_dp10", 0)
    assert one != ten
    server = LookupServer(None, one, {"who": "dp1"})
    try:
        with pytest.raises(tc.StateError, match="served by another live process"):
            LookupServer(None, one, {"who": "intruder"})
        path = one.removeprefix("ipc://")
        assert os.path.exists(path)
    finally:
        server.close()
    assert not os.path.exists(path)


def test_lookup_over_the_socket_and_direct():
    store = WorkerStore(layers(), host_blocks=4)
    a, b = keys("a", "b")
    store.save([a, b], [0, 1], timeout=10)
    ep = lookup_endpoint(f"test-{uuid.uuid4().hex[:8]}", 0)
    server = LookupServer(store, ep)
    try:
        direct = LookupClient([ep])
        assert direct.lookup("r1", [a, b], pin_above=0).hit == 2  # same process: direct call
        import tpusync.vllm.store as st

        with st._LOCAL_LOCK:
            del st._LOCAL[ep]  # force the socket path, as from the engine-core process
        remote = LookupClient([ep], timeout_s=5)
        r = remote.lookup("r2", [a, b, *keys("x")], pin_above=0)
        assert (r.hit, r.tiers) == (2, ("host", "host"))
        assert store.leases == ["r1", "r2"]
        remote.lookup("r3", [a], pin_above=1)  # not longer than pin_above: no lease kept
        remote.release(["r1", "r2"])
        assert store.num_pins == 0
        remote.close()
    finally:
        server.close()
        store.close()


def test_unanswered_lookup_is_a_miss():
    ep = lookup_endpoint(f"nobody-{uuid.uuid4().hex[:8]}", 0)
    client = LookupClient([ep], timeout_s=0.2)
    assert client.lookup("r", keys("a")).hit == 0
    client.close()


def test_bad_arguments():
    with pytest.raises(tc.InvalidArgumentError):
        WorkerStore([], host_blocks=1)


def test_store_nodes_share_blocks_between_worker_stores_with_salted_keys(tmp_path):
    """Two WorkerStores over one in-process store node: the first's saves are written through,
    the second (empty host tier) loads them; another salt (another model / layout) never does;
    events name the plain block hashes."""
    from tpusync.core.store_node import StoreNode

    secret = tmp_path / "secret"
    secret.write_text("worker-store-node-secret-0123456789")
    src = layers()
    row = int(src[0].shape[1]) * len(src)
    node = StoreNode(
        listen="127.0.0.1:0", capacity=64 * row, block_bytes=row, secret_file=str(secret)
    )
    common = dict(store_nodes=[node.address], auth_secret_file=str(secret), key_salt=b"s" * 16)
    try:
        # 64 host blocks: write-back stays idle (3 used + 32 headroom < 64), so only
        # write-through can have put the blocks on the node.
        a = WorkerStore(src, host_blocks=64, events=True, **common)
        k = keys("a", "b", "c")
        assert a.save(k, [1, 2, 3], timeout=10) == 3
        a.flush(30)
        assert a.stats()["write_through"] == 3
        events, dropped = a.take_events()
        assert dropped == 0 and {key for _, _, key in events} == set(k)  # salt stripped
        assert ("stored", "remote") in {(kind, tier) for kind, tier, _ in events}
        dst = layers(seed=1)
        b = WorkerStore(dst, host_blocks=8, **common)
        r = b.lookup("req", k)
        assert (r.hit, r.tiers) == (3, ("remote",) * 3)
        assert b.load(k, [5, 6, 7], timeout=10) == []
        b.release(["req"])
        for layer_a, layer_b in zip(src, dst, strict=True):
            assert torch.equal(layer_b[[5, 6, 7]], layer_a[[1, 2, 3]])
        other = WorkerStore(layers(), host_blocks=8, **{**common, "key_salt": b"o" * 16})
        assert other.lookup("req", k).hit == 0  # another model's blocks are never offered
        for s in (a, b, other):
            s.close()
    finally:
        node.stop()


class _Late:
    """A future whose wait times out while the native operation still owns its buffer."""

    def mask(self, timeout):
        raise tc.TimeoutError("not done in time (injected)")


def test_a_wait_that_times_out_gives_up_the_staging_buffer(monkeypatch):
    """STAGING RULE: a get whose wait timed out still writes into the buffer it was given; the
    next save must stage into another one (reused, the late get's blocks were stored under the
    save's keys). The same for the layered load's thread and for a put."""
    src = layers()
    store = WorkerStore(src, host_blocks=8)
    given = []

    def late(keys, stage):
        given.append(stage)
        return _Late()

    monkeypatch.setattr(store.store, "get", late)
    with pytest.raises(tc.TimeoutError):
        store.load(keys("a"), [0], timeout=0.01)
    load = store.start_load(keys("b"), [1], 0.01)
    failed, in_time = load.finish()
    assert failed == [1] and in_time and isinstance(load.error, tc.TimeoutError)
    monkeypatch.setattr(store.store, "put", late)
    with pytest.raises(tc.TimeoutError):
        store.save(keys("c"), [2], timeout=0.01)
    monkeypatch.undo()
    assert store.save(keys("d"), [3], timeout=10) == 1
    assert len(given) == 3
    for old in given:  # none of the buffers a late operation holds is staged into again
        assert not np.shares_memory(old, store._stage(1))
    store.close()
