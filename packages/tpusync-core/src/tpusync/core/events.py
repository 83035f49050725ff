"""KV-cache events for prefix-cache-aware routers (llm-d's KV-events wire format).

One publisher for every tpusync tier. WIRE CONTRACT (what a router subscribes to):

- ZMQ PUB socket; every message is multipart ``[topic, seq, payload]``.
- ``topic`` is ``kv@<pod-id>@<model>`` (UTF-8), so a SUB can filter by pod or model prefix.
- ``seq`` is an 8-byte big-endian unsigned counter, +1 per message, so a subscriber detects gaps.
- ``payload`` is a msgpack batch ``[ts, events, dp_rank]`` (ts: float seconds since the epoch).
- Each event is one of BlockStored / BlockRemoved / AllBlocksCleared, encoded either as a tagged
  map (``{"type": "BlockStored", "block_hashes": [...], ...}``, what current vLLM emits) or as a
  positional array (``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
  medium]``, what older vLLM emits). The publisher emits one encoding (tagged by default);
  :func:`decode_batch` reads both.
- ``medium`` names the tier that holds the block (``CPU``, ``DISK``, ``REMOTE``); a router must be
  given a weight per medium, otherwise it scores a tier hit like an accelerator hit.
- Block hashes are the serving engine's own hashes (bytes or int), never re-derived here.

Publishing never blocks the caller on a slow subscriber: ZMQ drops at the high-water mark (a PUB
socket's documented behaviour) and the sequence gap tells the router to resynchronise. The
rejected alternative, a blocking PUSH socket, would let one stuck router stall the engine.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import msgpack
import zmq

from tpusync.core.errors import InvalidArgumentError, StateError

if TYPE_CHECKING:
    from tpusync.core.store import KVStore

__all__ = [
    "MEDIUMS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventPublisher",
    "StoreEventBridge",
    "TIER_MEDIUM",
    "decode_batch",
    "encode_batch",
    "topic_for",
]

MEDIUMS = ("GPU", "CPU", "DISK", "REMOTE")
BlockHash = bytes | int


@dataclass(frozen=True)
class BlockStored:
    """Blocks became available in ``medium``; ``parent_block_hash`` chains the first one."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left ``medium`` (evicted or deleted)."""

    block_hashes: list[BlockHash]
    medium: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the publisher is gone (cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
Encoding = Literal["tagged", "positional"]


def topic_for(pod_id: str, model: str) -> str:
    """``kv@<pod-id>@<model>``; neither part may contain '@' (it would break prefix filters)."""
    if not pod_id or not model or "@" in pod_id or "@" in model:
        raise InvalidArgumentError(
            f"topic parts must be non-empty and free of '@': pod_id={pod_id!r} model={model!r}"
        )
    return f"kv@{pod_id}@{model}"


def _check_medium(medium: str | None) -> None:
    if medium is not None and medium not in MEDIUMS:
        raise InvalidArgumentError(f"medium {medium!r} is not one of {MEDIUMS}")


def _event_to_wire(event: KVEvent, encoding: Encoding) -> Any:
    if isinstance(event, BlockStored):
        _check_medium(event.medium)
        if encoding == "positional":
            return [
                "BlockStored",
                list(event.block_hashes),
                event.parent_block_hash,
                list(event.token_ids),
                event.block_size,
                event.lora_id,
                event.medium,
            ]
        out = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": None,
        }
        out.update(event.extra)
        return out
    if isinstance(event, BlockRemoved):
        _check_medium(event.medium)
        if encoding == "positional":
            return ["BlockRemoved", list(event.block_hashes), event.medium]
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"] if encoding == "positional" else {"type": "AllBlocksCleared"}
    raise InvalidArgumentError(f"not a KV event: {event!r}")


def _hashes(raw: Any, what: str = "block_hashes") -> list[BlockHash]:
    """A list of block hashes (bytes or int) from the wire; anything else is refused (a list
    used as a hash broke the index half way through a batch)."""
    if not isinstance(raw, list | tuple):
        raise InvalidArgumentError(f"{what} must be a list, got {type(raw).__name__}")
    for h in raw:
        if isinstance(h, bool) or not isinstance(h, bytes | int):
            raise InvalidArgumentError(f"a block hash must be bytes or int, got {type(h).__name__}")
    return list(raw)


def _optional(raw: Any, kinds: type | tuple[type, ...], what: str) -> Any:
    if raw is not None and (isinstance(raw, bool) or not isinstance(raw, kinds)):
        raise InvalidArgumentError(f"{what} has the wrong type: {type(raw).__name__}")
    return raw


def _stored(hashes, parent, tokens, size, lora, medium, extra=None) -> BlockStored:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidArgumentError(f"block_size must be an int >= 0, got {size!r:.40}")
    tokens = [] if tokens is None else tokens
    if not isinstance(tokens, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise InvalidArgumentError("token_ids must be a list of ints")
    return BlockStored(
        block_hashes=_hashes(hashes),
        parent_block_hash=_optional(parent, (bytes, int), "parent_block_hash"),
        token_ids=list(tokens),
        block_size=size,
        lora_id=_optional(lora, int, "lora_id"),
        medium=_optional(medium, str, "medium"),
        extra=extra or {},
    )


def _event_from_wire(raw: Any) -> KVEvent:
    """One event from its wire form (either encoding); InvalidArgumentError for anything
    malformed (WIRE CHECK: a missing field or a wrong type used to escape as KeyError /
    TypeError and end a subscriber's thread)."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "BlockStored":
            known = {
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
            }
            return _stored(
                raw.get("block_hashes"),
                raw.get("parent_block_hash"),
                raw.get("token_ids"),
                raw.get("block_size"),
                raw.get("lora_id"),
                raw.get("medium"),
                extra={k: v for k, v in raw.items() if k not in known},
            )
        if kind == "BlockRemoved":
            return BlockRemoved(
                block_hashes=_hashes(raw.get("block_hashes")),
                medium=_optional(raw.get("medium"), str, "medium"),
            )
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    elif isinstance(raw, list | tuple) and raw:
        kind = raw[0]
        if kind == "BlockStored" and len(raw) >= 6:
            return _stored(raw[1], raw[2], raw[3], raw[4], raw[5], raw[6] if len(raw) > 6 else None)
        if kind == "BlockRemoved" and len(raw) >= 2:
            medium = _optional(raw[2] if len(raw) > 2 else None, str, "medium")
            return BlockRemoved(block_hashes=_hashes(raw[1]), medium=medium)
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    raise InvalidArgumentError(f"undecodable KV event: {raw!r:.200}")


def encode_batch(
    events: Sequence[KVEvent],
    *,
    ts: float | None = None,
    dp_rank: int | None = None,
    encoding: Encoding = "tagged",
) -> bytes:
    """msgpack ``[ts, events, dp_rank]`` (the payload frame of one message)."""
    if encoding not in ("tagged", "positional"):
        raise InvalidArgumentError(f"encoding must be 'tagged' or 'positional', not {encoding!r}")
    wire = [_event_to_wire(e, encoding) for e in events]
    return msgpack.packb([time.time() if ts is None else ts, wire, dp_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """Inverse of :func:`encode_batch`, for both encodings (and batches without dp_rank)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated classes
        raise InvalidArgumentError(f"KV event batch is not msgpack: {exc}") from exc
    if (
        not isinstance(raw, list | tuple)
        or len(raw) < 2
        or isinstance(raw[0], bool)
        or not isinstance(raw[0], int | float)
        or not isinstance(raw[1], list | tuple)
    ):
        raise InvalidArgumentError("KV event batch must be [ts, events, dp_rank]")
    dp_rank = _optional(raw[2] if len(raw) > 2 else None, int, "dp_rank")
    return float(raw[0]), [_event_from_wire(e) for e in raw[1]], dp_rank


class KVEventPublisher:
    """ZMQ PUB of KV events (see the module docstring for the wire contract).

    THREAD CONTRACT: :meth:`publish` may be called from any thread; a lock serialises the socket
    (ZMQ sockets are not thread-safe) and the sequence counter, so sequence numbers are gapless
    in publish order. :meth:`close` is idempotent; publishing after close raises StateError.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        pod_id: str,
        model: str,
        dp_rank: int | None = None,
        encoding: Encoding = "tagged",
        bind: bool = True,
        high_water_mark: int = 100_000,
    ) -> None:
        if encoding not in ("tagged", "positional"):
            raise InvalidArgumentError(
                f"encoding must be 'tagged' or 'positional', not {encoding!r}"
            )
        self.topic = topic_for(pod_id, model)
        self._topic_bytes = self.topic.encode()
        self._dp_rank = dp_rank
        self._encoding: Encoding = encoding
        self._lock = threading.Lock()
        self._seq = 0
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, high_water_mark)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if bind:
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._sock = None
            raise InvalidArgumentError(
                f"cannot open KV event endpoint {endpoint!r}: {exc}"
            ) from exc
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint

    @property
    def sequence(self) -> int:
        """The sequence number the next message will carry."""
        return self._seq

    def publish(self, events: Iterable[KVEvent], *, ts: float | None = None) -> int | None:
        """Send one batch; returns its sequence number (None when ``events`` is empty)."""
        batch = list(events)
        if not batch:
            return None
        payload = encode_batch(batch, ts=ts, dp_rank=self._dp_rank, encoding=self._encoding)
        with self._lock:
            if self._sock is None:
                raise StateError("KVEventPublisher is closed")
            seq = self._seq
            self._sock.send_multipart([self._topic_bytes, struct.pack(">Q", seq), payload])
            self._seq += 1
        return seq

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The ``medium`` string each KVStore tier announces.
TIER_MEDIUM = {"device": "GPU", "host": "CPU", "disk": "DISK", "remote": "REMOTE"}


class StoreEventBridge:
    """Publishes a :class:`~tpusync.core.KVStore`'s placement changes as KV events.

    Every put, write-back demotion (host -> disk), promotion (disk -> host), LRU eviction,
    corruption drop, ``remove`` and ``clear`` becomes a BlockStored / BlockRemoved /
    AllBlocksCleared with the tier as ``medium`` (host ``CPU``, disk ``DISK``, remote ``REMOTE``).
    Consecutive changes of one kind and tier share one event.

    ORDER CONTRACT: events are published in the order the store's index changed (the native queue
    is filled under the store lock), so a subscriber replaying them holds the store's placement.
    LOSS CONTRACT: when the native queue overflowed (``capacity`` events behind), the bridge
    publishes AllBlocksCleared first: a router then under-estimates this pod until new events
    arrive, which costs a cache hit but never routes to a block that is gone. Rejected
    alternative: re-announcing the whole store after a loss - the store has no cheap snapshot and
    a burst of millions of events would hit the publisher's high-water mark anyway.

    Store keys are announced as block hashes as is, unless ``key_to_hash`` maps them (keys must be
    the serving engine's own block hashes for a router to match them). Token ids are not known at
    this level: events carry ``token_ids=[]``, ``parent_block_hash=None`` and ``block_size``.

    With ``interval_s`` set, a daemon thread drains every ``interval_s`` seconds; otherwise call
    :meth:`pump`. :meth:`close` stops the thread (bounded join) and drains once more.
    """

    def __init__(
        self,
        store: KVStore,
        publisher: KVEventPublisher,
        *,
        block_size: int,
        capacity: int = 65536,
        interval_s: float | None = 0.05,
        key_to_hash: Callable[[bytes], BlockHash] | None = None,
    ) -> None:
        if block_size <= 0:
            raise InvalidArgumentError(f"block_size must be > 0, not {block_size}")
        if interval_s is not None and interval_s <= 0:
            raise InvalidArgumentError(f"interval_s must be > 0 or None, not {interval_s}")
        self._store = store
        self._publisher = publisher
        self._block_size = block_size
        self._key_to_hash = key_to_hash or (lambda k: k)
        self._lock = threading.Lock()
        self.published_events = 0
        self.overflows = 0
        store.enable_events(capacity)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s is not None:
            self._thread = threading.Thread(
                target=self._loop, args=(interval_s,), name="tpusync-store-events", daemon=True
            )
            self._thread.start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.pump()
            except StateError:  # store or publisher closed underneath us
                return

    def pump(self) -> int:
        """Drain the store's queue once and publish; returns the number of events published."""
        with self._lock:
            raw, dropped = self._store.take_events()
            events: list[KVEvent] = []
            if dropped:
                self.overflows += 1
                events.append(AllBlocksCleared())
            run_kind, run_tier = "", ""
            run_keys: list[bytes] = []

            def flush_run() -> None:
                if not run_keys:
                    return
                medium = TIER_MEDIUM[run_tier]
                hashes = [self._key_to_hash(k) for k in run_keys]
                if run_kind == "stored":
                    events.append(BlockStored(hashes, None, [], self._block_size, None, medium))
                else:
                    events.append(BlockRemoved(hashes, medium))

            for kind, tier, key in raw:
                if kind == "cleared":
                    flush_run()
                    run_keys = []
                    events.append(AllBlocksCleared())
                    continue
                if (kind, tier) != (run_kind, run_tier):
                    flush_run()
                    run_kind, run_tier, run_keys = kind, tier, []
                run_keys.append(key)
            flush_run()
            if events:
                self._publisher.publish(events)
                self.published_events += len(events)
            return len(events)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the polling thread (waits at most ``timeout``), then drain what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        try:
            self.pump()
        except StateError:
            pass

    def __enter__(self) -> StoreEventBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
