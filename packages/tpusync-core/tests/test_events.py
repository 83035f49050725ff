"""KV-event publisher: real ZMQ PUB/SUB on 127.0.0.1, both encodings, sequence numbers."""

from __future__ import annotations

import struct
import time

import msgpack
import pytest
import zmq

from tpusync.core import InvalidArgumentError, StateError
from tpusync.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    decode_batch,
    encode_batch,
    topic_for,
)

EVENTS = [
    BlockStored([b"\x01" * 32, b"\x02" * 32], None, list(range(64)), 32, None, "CPU"),
    BlockStored([7], 6, [1, 2], 2, 3, "DISK"),
    BlockRemoved([b"\x01" * 32], "REMOTE"),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
def test_roundtrip_both_encodings(encoding):
    ts, events, rank = decode_batch(encode_batch(EVENTS, ts=12.5, dp_rank=1, encoding=encoding))
    assert (ts, rank) == (12.5, 1)
    assert events == EVENTS


def test_wire_shapes_match_the_documented_layouts():
    tagged = msgpack.unpackb(encode_batch(EVENTS[:1], ts=1.0), raw=False)
    assert tagged[0] == 1.0 and tagged[2] is None
    assert tagged[1][0]["type"] == "BlockStored" and tagged[1][0]["medium"] == "CPU"
    positional = msgpack.unpackb(encode_batch(EVENTS[2:3], ts=1.0, encoding="positional"))
    assert positional[1][0] == ["BlockRemoved", [b"\x01" * 32], "REMOTE"]


def test_bad_input_is_rejected():
    with pytest.raises(InvalidArgumentError):
        encode_batch([BlockRemoved([1], "TAPE")])
    with pytest.raises(InvalidArgumentError):
        decode_batch(b"\xc1")
    with pytest.raises(InvalidArgumentError):
        decode_batch(msgpack.packb([1.0, [["NoSuchEvent"]], None]))
    with pytest.raises(InvalidArgumentError):
        topic_for("pod@1", "m")


def _subscriber(endpoint: str, topic: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
def test_pub_sub_over_tcp(encoding):
    with KVEventPublisher(
        "tcp://127.0.0.1:*", pod_id="pod-a", model="tiny", dp_rank=0, encoding=encoding
    ) as pub:
        assert pub.topic == "kv@pod-a@tiny"
        sub = _subscriber(pub.endpoint, "kv@pod-a@")
        try:
            # PUB drops messages until the subscription has propagated ("slow joiner"): probe
            # until one arrives, then check that later messages carry consecutive sequences.
            deadline = time.monotonic() + 10
            first = None
            while first is None and time.monotonic() < deadline:
                pub.publish([AllBlocksCleared()])
                if sub.poll(100):
                    first = sub.recv_multipart()
            assert first is not None, "subscriber never received a message"
            while sub.poll(50):
                first = sub.recv_multipart()
            base = struct.unpack(">Q", first[1])[0]
            assert pub.publish(EVENTS) == base + 1
            assert pub.publish(EVENTS[:1]) == base + 2
            got = [sub.recv_multipart() for _ in range(2)]
        finally:
            sub.close(0)
    assert [m[0] for m in got] == [b"kv@pod-a@tiny"] * 2
    assert [struct.unpack(">Q", m[1])[0] for m in got] == [base + 1, base + 2]
    _, events, rank = decode_batch(got[0][2])
    assert events == EVENTS and rank == 0
    assert decode_batch(got[1][2])[1] == EVENTS[:1]
    with pytest.raises(StateError):
        pub.publish(EVENTS)


def test_empty_batch_is_not_sent_and_bad_endpoint_is_clear():
    with KVEventPublisher("tcp://127.0.0.1:*", pod_id="p", model="m") as pub:
        assert pub.publish([]) is None and pub.sequence == 0
    with pytest.raises(InvalidArgumentError, match="cannot open"):
        KVEventPublisher("nonsense://x", pod_id="p", model="m")
