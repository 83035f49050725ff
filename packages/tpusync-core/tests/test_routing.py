"""Prefix-aware routing: real ZMQ publishers (one per pod, both encodings), a real KVStore whose
host and disk tiers announce puts, demotions, evictions and removals, and the llm-d scoring rule."""

from __future__ import annotations

import struct
import time

import msgpack
import numpy as np
import pytest
import zmq

import tpusync.core as tc
from tpusync.core import InvalidArgumentError
from tpusync.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    StoreEventBridge,
    encode_batch,
)
from tpusync.core.routing import (
    DEFAULT_TIER_WEIGHTS,
    KVEventSubscriber,
    PrefixIndex,
    parse_topic,
)

BLOCK = 4096
HASHES = [bytes([i]) * 32 for i in range(8)]


def _publisher(pod: str, encoding: str = "tagged") -> KVEventPublisher:
    return KVEventPublisher("tcp://127.0.0.1:*", pod_id=pod, model="tiny", encoding=encoding)


def _join(sub: KVEventSubscriber, pubs: list[KVEventPublisher]) -> None:
    """Beat ZMQ's slow-joiner drop: probe every publisher until the subscriber hears each pod."""
    deadline = time.monotonic() + 10
    pods = {p.topic.split("@")[1] for p in pubs}
    while time.monotonic() < deadline:
        for p in pubs:
            p.publish([AllBlocksCleared()])
        sub.poll(0.1)
        if pods <= {s.split("@")[0] for s in sub.streams}:
            sub.poll(0.1)
            return
    raise AssertionError("subscriber never heard every publisher")


def test_scoring_rule_is_longest_consecutive_prefix_weighted_by_best_tier():
    idx = PrefixIndex()
    idx.apply("a", [BlockStored(HASHES[:4], None, [], 16, None, "DISK")])
    idx.apply("b", [BlockStored(HASHES[:4], None, [], 16, None, "CPU")])
    idx.apply("c", [BlockStored([HASHES[0], HASHES[1], HASHES[3]], None, [], 16, None, None)])
    # Same block in two tiers of one pod: the best tier counts once.
    idx.apply("a", [BlockStored(HASHES[:1], None, [], 16, None, "GPU")])
    s = idx.score(HASHES)
    assert s == pytest.approx({"a": 1.0 + 3 * 0.5, "b": 4 * 0.8, "c": 2 * 1.0})
    assert idx.best(HASHES, ["a", "b", "c"]) == "b"
    assert idx.score(HASHES[4:]) == {"a": 0.0, "b": 0.0, "c": 0.0}
    # Weights are configuration: a deployment whose "disk" is a fast local NVMe may say so.
    w = dict(DEFAULT_TIER_WEIGHTS, DISK=1.0, CPU=0.1)
    fast_disk = PrefixIndex(w)
    fast_disk.apply("a", [BlockStored(HASHES[:4], None, [], 16, None, "DISK")])
    fast_disk.apply("b", [BlockStored(HASHES[:4], None, [], 16, None, "CPU")])
    assert fast_disk.best(HASHES, ["b", "a"]) == "a"
    # Removal from one tier keeps the other; clear forgets the pod.
    idx.apply("a", [BlockRemoved(HASHES[:1], "GPU")])
    assert idx.media(HASHES[0])["a"] == {"DISK"}
    idx.apply("a", [AllBlocksCleared()])
    assert "a" not in idx.media(HASHES[0]) and "a" not in idx.pods()


def test_bad_configuration_is_refused():
    with pytest.raises(InvalidArgumentError, match="lacks a weight"):
        PrefixIndex({"GPU": 1.0, "CPU": 0.8})  # DISK would silently score like GPU
    with pytest.raises(InvalidArgumentError, match="unknown medium"):
        PrefixIndex(dict(DEFAULT_TIER_WEIGHTS, TAPE=0.1))
    with pytest.raises(InvalidArgumentError):
        parse_topic("kv@only-pod")
    assert parse_topic(b"kv@pod-1@llama") == ("pod-1", "llama")
    with pytest.raises(InvalidArgumentError):
        KVEventSubscriber([], PrefixIndex())
    with pytest.raises(InvalidArgumentError):
        PrefixIndex().best(HASHES, [])


def test_routing_over_real_sockets_prefers_the_pod_whose_host_and_disk_tiers_hold_the_prefix(
    tmp_path,
):
    # pod-gpu: an engine announcing a 2-block prefix in accelerator memory (vLLM events, no
    # medium), positional encoding as older vLLM sends it. pod-store: a real KVStore with a
    # 3-block host tier and a disk tier holding the whole 8-block prefix (most of it demoted).
    store = tc.KVStore(BLOCK, 3, disk_dir=tmp_path / "disk", disk_blocks=64, writeback_batch=1)
    pub_gpu = _publisher("pod-gpu", "positional")
    pub_store = _publisher("pod-store")
    idx = PrefixIndex()
    sub = KVEventSubscriber([pub_gpu.endpoint, pub_store.endpoint], idx, model="tiny")
    bridge = StoreEventBridge(store, pub_store, block_size=16, interval_s=None)
    try:
        _join(sub, [pub_gpu, pub_store])
        pub_gpu.publish([BlockStored(HASHES[:2], None, list(range(32)), 16, None, None)])
        data = np.arange(8 * BLOCK, dtype=np.uint8).reshape(8, BLOCK)
        assert store.put(HASHES, data).result(10) == [True] * 8
        store.flush(30)
        assert bridge.pump() > 0
        placed = store.lookup(HASHES)
        assert placed[0] == 8 and "disk" in placed[1]  # demoted blocks live on disk

        def both_known() -> bool:
            s = idx.score(HASHES, ["pod-gpu", "pod-store"])
            return s["pod-gpu"] > 0 and s["pod-store"] >= 8 * 0.5

        assert sub.wait_for(both_known, 10)
        media = [idx.media(h)["pod-store"] for h in HASHES]
        assert any("DISK" in m for m in media) and any("CPU" in m for m in media)
        scores = idx.score(HASHES, ["pod-gpu", "pod-store"])
        assert scores["pod-gpu"] == pytest.approx(2.0)
        assert scores["pod-store"] > 2.0
        assert idx.best(HASHES, ["pod-gpu", "pod-store"]) == "pod-store"
        # A request sharing only the first two blocks goes to the accelerator copy.
        assert idx.best(HASHES[:2], ["pod-store", "pod-gpu"]) == "pod-gpu"

        # The store forgets the prefix head: the tail alone is no prefix, routing follows.
        assert store.remove(HASHES[:1]) == 1
        bridge.pump()
        assert sub.wait_for(lambda: idx.score(HASHES, ["pod-store"])["pod-store"] == 0.0, 10)
        assert idx.best(HASHES, ["pod-store", "pod-gpu"]) == "pod-gpu"
    finally:
        bridge.close()
        sub.close()
        pub_gpu.close()
        pub_store.close()
        store.close()


def test_store_events_replay_to_the_stores_placement_through_demotion_and_eviction(tmp_path):
    # 2 host + 4 disk blocks, 10 puts: host -> disk demotions and disk LRU evictions happen.
    store = tc.KVStore(BLOCK, 2, disk_dir=tmp_path / "d", disk_blocks=4, writeback_batch=1)
    pub = _publisher("pod-s")
    idx = PrefixIndex()
    sub = KVEventSubscriber([pub.endpoint], idx)
    try:
        _join(sub, [pub])
        with StoreEventBridge(store, pub, block_size=16, interval_s=0.01) as bridge:
            keys = [bytes([0xA0 + i]) * 16 for i in range(10)]
            for i, k in enumerate(keys):
                store.put([k], np.full((1, BLOCK), i, np.uint8)).result(10)
            store.flush(30)
            time.sleep(0.05)
        assert bridge.published_events > 0 and bridge.overflows == 0
        stats = store.stats()
        assert stats["evicted"] > 0 and stats["tiers"]["disk"]["demotions_in"] > 0

        def expected() -> dict[bytes, set[str]]:
            out = {}
            for k in keys:
                n, tiers = store.lookup([k])
                if n:
                    out[k] = {"CPU" if t == "host" else "DISK" for t in tiers}
            return out

        # lookup() reports the fastest tier only; compare that with the index's best medium.
        def index_best() -> dict[bytes, set[str]]:
            out = {}
            for k in keys:
                m = idx.media(k).get("pod-s")
                if m:
                    out[k] = {"CPU"} if "CPU" in m else {"DISK"}
            return out

        assert sub.wait_for(lambda: index_best() == expected(), 10), (index_best(), expected())
        assert len(expected()) < len(keys)  # some keys really were evicted
    finally:
        sub.close()
        pub.close()
        store.close()


def test_bridge_overflow_announces_a_clear_first(tmp_path):
    store = tc.KVStore(BLOCK, 8)
    pub = _publisher("pod-o")
    idx = PrefixIndex()
    sub = KVEventSubscriber([pub.endpoint], idx)
    try:
        _join(sub, [pub])
        bridge = StoreEventBridge(store, pub, block_size=16, capacity=2, interval_s=None)
        store.put(HASHES[:5], np.zeros((5, BLOCK), np.uint8)).result(10)
        idx.apply("pod-o", [BlockStored([b"stale"], None, [], 16, None, "CPU")])
        assert bridge.pump() == 2  # AllBlocksCleared + one BlockStored of the 2 kept
        assert bridge.overflows == 1
        assert sub.wait_for(lambda: idx.media(b"stale") == {} and idx.media(HASHES[4]) != {}, 10)
        assert idx.media(HASHES[0]) == {}  # lost to the overflow: under-estimated, never stale
    finally:
        sub.close()
        pub.close()
        store.close()


def _raw_publisher() -> tuple[zmq.Socket, PrefixIndex, KVEventSubscriber]:
    """A bare ZMQ PUB (to send hand-made messages) and a subscriber feeding a fresh index."""
    raw = zmq.Context.instance().socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    idx = PrefixIndex()
    return raw, idx, KVEventSubscriber([f"tcp://127.0.0.1:{port}"], idx)


def test_a_sequence_gap_clears_the_pod_and_garbage_is_counted():
    raw, idx, sub = _raw_publisher()
    topic = b"kv@pod-g@tiny"

    def send(seq: int, events) -> None:
        raw.send_multipart([topic, struct.pack(">Q", seq), encode_batch(events)])

    try:
        deadline = time.monotonic() + 10
        seq = 0
        while not sub.streams and time.monotonic() < deadline:
            send(seq, [AllBlocksCleared()])
            seq += 1
            sub.poll(0.1)
        assert sub.streams
        sub.poll(0.1)
        seq = sub.streams["pod-g@tiny"].next_seq
        send(seq, [BlockStored(HASHES[:3], None, [], 16, None, "CPU")])
        assert sub.wait_for(lambda: idx.score(HASHES).get("pod-g", 0) > 0, 5)
        send(seq + 5, [BlockStored(HASHES[5:6], None, [], 16, None, "CPU")])  # 4 lost
        assert sub.wait_for(lambda: sub.streams["pod-g@tiny"].gaps == 1, 5)
        assert idx.media(HASHES[0]) == {}  # cleared: the lost messages may have removed it
        assert idx.media(HASHES[5]) == {"pod-g": {"CPU"}}
        raw.send_multipart([topic, b"short", b"x"])
        raw.send_multipart([b"kv@no-model", struct.pack(">Q", 0), encode_batch([])])
        raw.send_multipart([topic, struct.pack(">Q", seq + 6), msgpack.packb([1.0, [["?"]]])])
        assert sub.wait_for(lambda: sub.undecodable == 3, 5)
    finally:
        sub.close()
        raw.close(0)


def test_malformed_events_are_counted_and_the_subscriber_thread_keeps_indexing():
    """WIRE CHECK (events.py): a field of the wrong type or missing, a list used as a hash, a
    non-UTF-8 topic are each one undecodable message - they used to escape as TypeError /
    KeyError and end the subscriber's thread, after which the index never changed again. A
    medium this index has no weight for scores 0 (score() raised KeyError for every request)."""
    raw, idx, sub = _raw_publisher()
    topic = b"kv@pod-m@tiny"
    seq = iter(range(10**6))

    def send(batch, t=topic) -> None:
        payload = batch if isinstance(batch, bytes) else msgpack.packb(batch, use_bin_type=True)
        raw.send_multipart([t, struct.pack(">Q", next(seq)), payload])

    stored = {"type": "BlockStored", "block_hashes": [HASHES[0]], "block_size": 16}
    bad = [
        [None, [], None],
        [1.0, 5, None],
        [1.0, [{**stored, "block_size": None}], None],
        [1.0, [{"type": "BlockStored", "block_size": 16}], None],
        [1.0, [{"type": "BlockRemoved", "block_hashes": None}], None],
        [1.0, [["BlockStored", 7, None, [], 16, None, "CPU"]], None],
        [1.0, [{**stored, "block_hashes": [[1, 2]]}], None],
        [1.0, [{**stored, "token_ids": ["a"]}], None],
    ]
    try:
        deadline = time.monotonic() + 10
        while not sub.streams and time.monotonic() < deadline:
            send(encode_batch([AllBlocksCleared()]))
            sub.poll(0.1)
        assert sub.streams
        sub.poll(0.1)
        sub.start()
        base = sub.undecodable
        for b in bad:
            send(b)
        send(encode_batch([]), t=b"kv@\xff\xfe@tiny")
        send([1.0, [{**stored, "medium": "cpu"}], None])  # a medium with no weight
        send(encode_batch([BlockStored(HASHES[1:2], None, [], 16, None, "CPU")]))
        end = time.monotonic() + 10
        while not idx.media(HASHES[1]) and time.monotonic() < end:
            time.sleep(0.02)
        assert sub._thread is not None and sub._thread.is_alive()
        assert idx.media(HASHES[1]) == {"pod-m": {"CPU"}}
        assert sub.undecodable - base == len(bad) + 1
        # HASHES[0] is held in "cpu": it weighs nothing but keeps the prefix going.
        assert idx.score([HASHES[0], HASHES[1]]) == {"pod-m": DEFAULT_TIER_WEIGHTS["CPU"]}
    finally:
        sub.close()
        raw.close(0)


def test_router_listens_and_pods_connect_like_llm_ds_indexer():
    idx = PrefixIndex()
    sub = KVEventSubscriber(["tcp://127.0.0.1:*"], idx, bind=True)
    assert sub.endpoint and sub.endpoint.startswith("tcp://127.0.0.1:")
    pubs = [
        KVEventPublisher(sub.endpoint, pod_id=f"pod-{i}", model="tiny", bind=False)
        for i in range(2)
    ]
    try:
        _join(sub, pubs)
        pubs[0].publish([BlockStored(HASHES[:3], None, [], 16, None, "DISK")])
        pubs[1].publish([BlockStored(HASHES[:2], None, [], 16, None, "CPU")])
        assert sub.wait_for(lambda: idx.score(HASHES).get("pod-1", 0) > 0, 10)
        assert sub.wait_for(lambda: idx.score(HASHES).get("pod-0", 0) > 0, 10)
        # 3 DISK blocks (1.5) beat 2 CPU blocks (1.6)? No: 1.6 > 1.5 - the weights decide.
        assert idx.best(HASHES, ["pod-0", "pod-1"]) == "pod-1"
        assert idx.best(HASHES, ["pod-0", "pod-1"]) == max(
            idx.score(HASHES), key=idx.score(HASHES).get
        )
    finally:
        for p in pubs:
            p.close()
        sub.close()


def _repo_script(rel: str):
    import os
    from pathlib import Path

    root = os.environ.get("TPUSYNC_REPO_ROOT")
    path = Path(root) / rel if root else None
    if path is None or not path.exists():
        pytest.skip("needs the repository checkout (TPUSYNC_REPO_ROOT, set by nox)")
    return path


def test_llm_d_integration_scripts_run():
    import subprocess
    import sys

    demo = subprocess.run(
        [sys.executable, str(_repo_script("integrations/llm-d/router_demo.py"))],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    assert "route to: warm" in demo.stdout

    # store_publisher.py connects to the router's endpoint, as it would to llm-d's EPP.
    idx = PrefixIndex()
    sub = KVEventSubscriber(["tcp://127.0.0.1:*"], idx, bind=True)
    try:
        proc = subprocess.Popen(
            [sys.executable, str(_repo_script("integrations/llm-d/store_publisher.py")),
             "--epp", sub.endpoint, "--pod", "pod-x", "--model", "m", "--seconds", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        seen = sub.wait_for(lambda: any("DISK" in idx.media(h).get("pod-x", ()) for h in
                                        [i.to_bytes(8, "big") * 4 for i in range(32)]), 60)  # fmt: skip
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert seen, "no DISK-tier BlockStored from store_publisher.py"
    finally:
        sub.close()
