"""The tiered KVStore's event stream (StoreEventBridge) decoded with vLLM's own event classes.

Runs in the integration-vllm session (skipped without vLLM): puts, host->disk demotions, LRU
drops, a remove and a clear of a real KVStore, published over real ZMQ, received and decoded with
``vllm.distributed.kv_events.KVEventBatch``; the media must name the tiers.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_events import KVEventBatch  # noqa: E402

import tpusync.core as tc  # noqa: E402
from tpusync.core.events import AllBlocksCleared, KVEventPublisher, StoreEventBridge  # noqa: E402


def test_store_bridge_stream_decodes_with_vllms_classes(tmp_path):
    store = tc.KVStore(4096, 2, disk_dir=tmp_path, disk_blocks=4, writeback_batch=1)
    pub = KVEventPublisher("tcp://127.0.0.1:*", pod_id="pod-s", model="tiny")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@pod-s@")
    sub.connect(pub.endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(100):  # the slow joiner: probe until the subscription is live
            assert time.monotonic() < deadline, "subscriber never joined"
            pub.publish([AllBlocksCleared()])
        while sub.poll(200):
            sub.recv_multipart()
        bridge = StoreEventBridge(store, pub, block_size=32, interval_s=None)
        keys = [bytes([i]) * 32 for i in range(8)]
        for i, k in enumerate(keys):
            store.put([k], np.full((1, 4096), i, np.uint8)).result(10)
        store.flush(30)
        store.remove(keys[-1:])
        bridge.pump()
        store.clear()
        bridge.pump()
        seen = []
        while sub.poll(500):
            topic, _seq, payload = sub.recv_multipart()
            assert topic == b"kv@pod-s@tiny"
            for ev in decoder.decode(payload).events:
                seen.append((type(ev).__name__, getattr(ev, "medium", None)))
                if type(ev).__name__ == "BlockStored":
                    assert ev.block_size == 32 and list(ev.token_ids) == []
                    assert all(h in keys for h in ev.block_hashes)
        assert ("BlockStored", "CPU") in seen  # puts
        assert ("BlockStored", "DISK") in seen  # host -> disk demotions
        assert ("BlockRemoved", "CPU") in seen  # DRAM copies dropped for room
        assert ("BlockRemoved", "DISK") in seen  # disk LRU evictions / the remove
        assert seen[-1] == ("AllBlocksCleared", None)
    finally:
        sub.close(0)
        pub.close()
        store.close()
