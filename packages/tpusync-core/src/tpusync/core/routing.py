"""Prefix-cache-aware routing over tpusync KV events (the rule llm-d's precise prefix scorer uses).

A router subscribes to the KV-event streams of several serving pods (:class:`KVEventSubscriber`),
keeps which pods hold which block in which tier (:class:`PrefixIndex`), and scores a request by
its block hashes (:meth:`PrefixIndex.score`):

SCORING RULE: for each pod, walk the request's block hashes in order and stop at the first block
the pod does not hold in any tier (a prefix cache can only reuse a consecutive prefix); the score
is the sum, over that prefix, of the weight of the best tier holding each block. Default weights:
GPU 1.0, CPU 0.8, DISK 0.5, REMOTE 0.3 (``medium=None`` counts as GPU, as vLLM's own events
have no medium). The rejected alternative, counting blocks regardless of tier, ranks a pod that
must read a prefix back from a shared filesystem level with one that has it in HBM; the rejected
alternative of summing weights over all held blocks (not just the prefix) rewards blocks that a
prefix cache cannot use.

This is a reference implementation for tests, examples and small deployments; with llm-d, point
its kv-cache-manager at the same publishers instead (integrations/llm-d/README.md).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import zmq

from tpusync.core.errors import InvalidArgumentError, StateError
from tpusync.core.events import (
    MEDIUMS,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_batch,
)

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "KVEventSubscriber",
    "PrefixIndex",
    "parse_topic",
]

#: Weight of a block hit per medium; None (no medium) is the accelerator.
DEFAULT_TIER_WEIGHTS: Mapping[str | None, float] = {
    None: 1.0,
    "GPU": 1.0,
    "CPU": 0.8,
    "DISK": 0.5,
    "REMOTE": 0.3,
}


def parse_topic(topic: str | bytes) -> tuple[str, str]:
    """``kv@<pod-id>@<model>`` -> ``(pod_id, model)``; anything else is InvalidArgumentError."""
    try:
        text = topic.decode() if isinstance(topic, bytes) else topic
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"KV-event topic {topic!r:.80} is not UTF-8") from None
    parts = text.split("@")
    if len(parts) != 3 or parts[0] != "kv" or not parts[1] or not parts[2]:
        raise InvalidArgumentError(f"KV-event topic {text!r} is not kv@<pod-id>@<model>")
    return parts[1], parts[2]


def _key(h: BlockHash) -> BlockHash:
    # msgpack gives bytes for bin and int for ints; lists (never hashes) are refused upstream.
    return bytes(h) if isinstance(h, bytearray) else h


class PrefixIndex:
    """block hash -> pod -> set of media holding it; scores requests (see the module docstring).

    THREAD CONTRACT: every method takes one lock, so a subscriber thread may :meth:`apply` while
    request threads :meth:`score`.
    """

    def __init__(self, tier_weights: Mapping[str | None, float] | None = None) -> None:
        weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        for medium, w in weights.items():
            if medium is not None and medium not in MEDIUMS:
                raise InvalidArgumentError(f"tier weight for unknown medium {medium!r}")
            if not 0.0 <= float(w):
                raise InvalidArgumentError(f"tier weight for {medium!r} must be >= 0, not {w}")
        missing = [m for m in (None, *MEDIUMS) if m not in weights]
        if missing:
            # An unweighted medium would silently score like GPU (llm-d's pitfall): refuse.
            raise InvalidArgumentError(f"tier_weights lacks a weight for {missing}")
        self.tier_weights: dict[str | None, float] = {k: float(v) for k, v in weights.items()}
        self._lock = threading.Lock()
        self._blocks: dict[BlockHash, dict[str, set[str | None]]] = {}
        self._pod_blocks: dict[str, set[BlockHash]] = defaultdict(set)

    def apply(self, pod: str, events: Iterable[KVEvent]) -> None:
        """Update the index with one pod's events, in order."""
        with self._lock:
            for ev in events:
                if isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        k = _key(h)
                        self._blocks.setdefault(k, {}).setdefault(pod, set()).add(ev.medium)
                        self._pod_blocks[pod].add(k)
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        self._remove(pod, _key(h), ev.medium)
                elif isinstance(ev, AllBlocksCleared):
                    self._clear_pod(pod)

    def _remove(self, pod: str, k: BlockHash, medium: str | None) -> None:
        holders = self._blocks.get(k)
        if holders is None or pod not in holders:
            return
        holders[pod].discard(medium)
        if not holders[pod]:
            del holders[pod]
            self._pod_blocks[pod].discard(k)
        if not holders:
            del self._blocks[k]

    def _clear_pod(self, pod: str) -> None:
        for k in self._pod_blocks.pop(pod, set()):
            holders = self._blocks.get(k)
            if holders is not None:
                holders.pop(pod, None)
                if not holders:
                    del self._blocks[k]

    def clear_pod(self, pod: str) -> None:
        """Forget everything about a pod (it left, or its stream lost messages)."""
        with self._lock:
            self._clear_pod(pod)

    def media(self, block_hash: BlockHash) -> dict[str, set[str | None]]:
        """Which pods hold a block, and in which media (a copy)."""
        with self._lock:
            return {p: set(m) for p, m in self._blocks.get(_key(block_hash), {}).items()}

    def pods(self) -> list[str]:
        with self._lock:
            return sorted(p for p, b in self._pod_blocks.items() if b)

    def score(
        self, block_hashes: Sequence[BlockHash], pods: Iterable[str] | None = None
    ) -> dict[str, float]:
        """Per pod: weighted length of the longest consecutive prefix it holds (0.0 if none).

        ``pods`` (the candidates, e.g. the pods the router may pick) defaults to every pod seen.
        """
        with self._lock:
            candidates = list(pods) if pods is not None else sorted(self._pod_blocks)
            scores = dict.fromkeys(candidates, 0.0)
            alive = set(candidates)
            for h in block_hashes:
                if not alive:
                    break
                holders = self._blocks.get(_key(h), {})
                for pod in list(alive):
                    held = holders.get(pod)
                    if not held:
                        alive.discard(pod)
                        continue
                    # A medium outside MEDIUMS (another publisher's name) scores 0: the pod
                    # holds the block somewhere this index has no weight for.
                    scores[pod] += max(self.tier_weights.get(m, 0.0) for m in held)
            return scores

    def best(self, block_hashes: Sequence[BlockHash], pods: Sequence[str]) -> str:
        """The highest-scoring pod of ``pods``; ties go to the earliest in ``pods``."""
        if not pods:
            raise InvalidArgumentError("best() needs at least one candidate pod")
        scores = self.score(block_hashes, pods)
        return max(pods, key=lambda p: (scores[p], -pods.index(p)))


@dataclass
class _Stream:
    next_seq: int | None = None
    gaps: int = 0
    messages: int = 0
    models: set[str] = field(default_factory=set)


class KVEventSubscriber:
    """A ZMQ SUB connected to several pods' KV-event publishers, feeding a :class:`PrefixIndex`.

    ``bind=False`` connects to every publisher's endpoint (publishers bind, tpusync's default);
    ``bind=True`` listens on ``endpoints`` and publishers connect to it (``bind=False`` on
    :class:`~tpusync.core.events.KVEventPublisher`), which is how llm-d's indexer is deployed
    (one ``zmqEndpoint`` that every pod connects to). Subscribes to ``kv@`` (every pod and model) or to ``kv@<pod>@<model>`` prefixes given as
    ``topics``. Call :meth:`poll` from one thread (ZMQ sockets are single-threaded), or
    :meth:`start` a daemon thread that polls until :meth:`close`.

    The index is keyed by pod only: keep one :class:`PrefixIndex` (and pass ``model``) per model
    when pods serve several models.

    GAP CONTRACT: every topic's sequence numbers must be consecutive; after a gap (the publisher
    dropped messages at its high-water mark, or the subscriber joined late) the pod's entries
    cannot be trusted, so the pod is cleared from the index and rebuilt from later events. A
    pod's very first message sets the baseline (a late joiner misses what came before: the
    rejected alternative, a replay request, needs a side channel llm-d's format does not have).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        index: PrefixIndex,
        *,
        topics: Sequence[str] = ("kv@",),
        model: str | None = None,
        bind: bool = False,
    ) -> None:
        if not endpoints:
            raise InvalidArgumentError("KVEventSubscriber needs at least one endpoint")
        self.index = index
        self.model = model
        self.streams: dict[str, _Stream] = defaultdict(_Stream)
        self.undecodable = 0
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        for t in topics:
            self._sock.setsockopt_string(zmq.SUBSCRIBE, t)
        try:
            for ep in endpoints:
                if bind:
                    self._sock.bind(ep)
                else:
                    self._sock.connect(ep)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._sock = None
            raise InvalidArgumentError(f"cannot open KV event endpoint: {exc}") from exc
        #: The endpoint actually bound (``tcp://127.0.0.1:*`` resolved), when ``bind``.
        self.endpoint: str | None = (
            self._sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else None
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self, timeout: float = 0.0, max_messages: int = 10_000) -> int:
        """Apply every message that arrives within ``timeout`` seconds; returns how many."""
        if self._sock is None:
            raise StateError("KVEventSubscriber is closed")
        n = 0
        wait_ms = int(timeout * 1000)
        while n < max_messages and self._sock.poll(wait_ms):
            self._handle(self._sock.recv_multipart())
            n += 1
            wait_ms = 0
        return n

    def _handle(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise InvalidArgumentError("a KV-event message is [topic, seq(8 bytes), payload]")
            pod, model = parse_topic(frames[0])
            (seq,) = struct.unpack(">Q", frames[1])
            _, events, _ = decode_batch(frames[2])
        except InvalidArgumentError:
            self.undecodable += 1
            return
        if self.model is not None and model != self.model:
            return
        stream = self.streams[f"{pod}@{model}"]
        if stream.next_seq is not None and seq != stream.next_seq:
            stream.gaps += 1
            self.index.clear_pod(pod)
        stream.next_seq = seq + 1
        stream.messages += 1
        self.index.apply(pod, events)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Poll until ``predicate()`` is true or ``timeout`` seconds passed (no thread running)."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(min(left, 0.05))

    def start(self) -> None:
        """Poll on a daemon thread until :meth:`close`."""
        if self._thread is not None:
            raise StateError("KVEventSubscriber already started")
        self._thread = threading.Thread(target=self._loop, name="tpusync-kv-sub", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(0.05)
            except (StateError, zmq.ZMQError):
                return
            except Exception:  # noqa: BLE001 - one message must not end the index's updates
                self.undecodable += 1
                log.exception("tpusync: a KV-event message could not be applied; skipped")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (bounded join) and close the socket; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
