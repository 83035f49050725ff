"""The storage seam of the vLLM connector: one small Protocol and its INTERIM implementation.

SPLIT CONTRACT. vLLM runs the connector twice: a SCHEDULER instance that only decides, and one
WORKER instance per worker process that moves bytes; on CPU (and for tensor parallelism on GPUs)
these are different processes. So the store has two halves that never share memory:

- the *directory* (scheduler process): which keys are stored, where (a slot number), pins, LRU
  eviction, events. ``lookup``/``pin``/``unpin``/``reserve``/``remove``/``clear``.
- the *data* (each worker process): slot-addressed host memory that the worker fills and reads.
  ``save``/``load`` return futures; the engine threads gather/scatter vLLM's block rows directly.

The scheduler puts slot numbers into the step's KVConnectorMetadata; each worker applies them.
Workers execute steps in order, so a slot the directory evicts at step N+1 is only overwritten by
step N+1's saves, after step N's loads have read it: PIN CONTRACT: a key is pinned from the moment
a request is promised a load (update_state_after_alloc) until the request finishes (or is
aborted); pinned keys are never evicted. The worker also remembers which key each slot holds, so
a load of a slot that holds anything else (a failed save, a restarted worker) fails loudly and
vLLM recomputes or fails the request (kv_load_failure_policy) instead of reading wrong KV.

Rejected alternative: one shared in-process object queried from both sides. It cannot work on
vLLM's default CPU engine, where scheduler and worker are different processes.

INTERIM: :class:`HostDirectory` + :class:`HostSlots` implement this on tpusync.core's BlockIndex
and HostBlockPool in process-local memory. The tiered KVStore (disk tier, /dev/shm warm restart,
store nodes) replaces them at merge time behind the same two Protocols.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import tpusync.core as tc

__all__ = [
    "DirectoryEvent",
    "HostDirectory",
    "HostSlots",
    "KVDirectory",
    "KVSlotData",
    "StoreFuture",
]


class StoreFuture(Protocol):
    """What save/load return: tpusync.core.Future or anything with the same two methods."""

    def result(self, timeout: float | None = None) -> None: ...

    def done(self) -> bool: ...


@dataclass(frozen=True)
class DirectoryEvent:
    """A change of the directory: ``kind`` is 'stored', 'removed' or 'cleared'."""

    kind: str
    keys: tuple[bytes, ...]
    medium: str


class KVDirectory(Protocol):
    """Scheduler-side half: decisions only, never bytes."""

    medium: str

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that is stored (no side effects)."""

    def slots(self, keys: Sequence[bytes]) -> list[int]:
        """Slots of stored keys (NotFoundError for a key that is not stored)."""

    def pin(self, keys: Sequence[bytes]) -> None:
        """Protect stored keys from eviction (counted; NotFoundError if one is missing)."""

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo one pin per key; keys removed meanwhile are ignored."""

    def reserve(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Assign slots to the keys not yet stored (evicting LRU unpinned keys) and mark them
        stored; returns (key, slot) for each newly placed key, possibly fewer when full."""

    def remove(self, keys: Sequence[bytes]) -> int:
        """Forget keys (pinned or not); returns how many were stored."""

    def clear(self) -> None: ...

    def take_events(self) -> list[DirectoryEvent]: ...

    @property
    def num_pins(self) -> int: ...


class KVSlotData(Protocol):
    """Worker-side half: slot-addressed storage for whole blocks across all layers."""

    def save(
        self,
        slots: Sequence[int],
        keys: Sequence[bytes],
        layers: Sequence[Any],
        rows: Sequence[int],
    ) -> StoreFuture:
        """Copy row ``rows[i]`` of every array in ``layers`` into slot ``slots[i]`` for key
        ``keys[i]``; the slot answers loads for that key only once the future succeeded."""

    def load(
        self,
        slots: Sequence[int],
        keys: Sequence[bytes],
        layers: Sequence[Any],
        rows: Sequence[int],
    ) -> StoreFuture:
        """Copy slot ``slots[i]`` into row ``rows[i]`` of every array in ``layers``; fails with
        NotFoundError (before any byte moves) when a slot does not hold ``keys[i]``."""


class HostDirectory:
    """INTERIM directory on tpusync.core.BlockIndex (Tier.HOST, location = slot number).

    Thread-safe (one lock); capacity is fixed at ``num_slots``.
    """

    medium = "CPU"

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise tc.InvalidArgumentError(f"num_slots must be positive, got {num_slots}")
        self._index = tc.BlockIndex()
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._events: list[DirectoryEvent] = []
        self._pins: dict[bytes, int] = {}
        self.num_slots = num_slots
        self.evictions = 0

    def lookup(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n, _ = self._index.lookup_prefix(list(keys))
            return n

    def slots(self, keys: Sequence[bytes]) -> list[int]:
        with self._lock:
            out = []
            for k in keys:
                p = self._index.lookup(k, touch=False)
                if p is None or not p.has(tc.Tier.HOST):
                    raise tc.NotFoundError(f"key {k.hex()[:16]} is not stored")
                out.append(int(p.location(tc.Tier.HOST)))
            return out

    def pin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            done: list[bytes] = []
            try:
                for k in keys:
                    self._index.pin(k)
                    self._pins[k] = self._pins.get(k, 0) + 1
                    done.append(k)
            except Exception:
                for k in done:  # all or nothing
                    self._unpin_locked(k)
                raise

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._unpin_locked(k)

    def _unpin_locked(self, k: bytes) -> None:
        n = self._pins.get(k, 0)
        if n == 0:
            return  # removed (or never pinned): nothing to undo
        if n == 1:
            del self._pins[k]
        else:
            self._pins[k] = n - 1
        self._index.unpin(k)

    def reserve(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        placed: list[tuple[bytes, int]] = []
        with self._lock:
            seen: set[bytes] = set()
            for k in keys:
                if k in seen or self._index.lookup(k, touch=True) is not None:
                    continue
                seen.add(k)
                if not self._free and not self._evict_one_locked():
                    break  # everything pinned: the rest is simply not offloaded
                slot = self._free.pop()
                self._index.insert(k, tc.Tier.HOST, slot)
                placed.append((k, slot))
            if placed:
                self._events.append(
                    DirectoryEvent("stored", tuple(k for k, _ in placed), self.medium)
                )
        return placed

    def _evict_one_locked(self) -> bool:
        victims = self._index.eviction_candidates(tc.Tier.HOST, 1)
        if not victims:
            return False
        key, slot = victims[0]
        self._index.erase(key)
        self._free.append(int(slot))
        self.evictions += 1
        self._events.append(DirectoryEvent("removed", (key,), self.medium))
        return True

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = []
        with self._lock:
            for k in keys:
                p = self._index.lookup(k, touch=False)
                if p is None:
                    continue
                self._index.erase(k)
                self._pins.pop(k, None)
                self._free.append(int(p.location(tc.Tier.HOST)))
                removed.append(k)
            if removed:
                self._events.append(DirectoryEvent("removed", tuple(removed), self.medium))
        return len(removed)

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._pins.clear()
            self._free = list(range(self.num_slots - 1, -1, -1))
            self._events.append(DirectoryEvent("cleared", (), self.medium))

    def take_events(self) -> list[DirectoryEvent]:
        with self._lock:
            out, self._events = self._events, []
            return out

    @property
    def num_pins(self) -> int:
        with self._lock:
            return sum(self._pins.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)


class _AllOf:
    """One future over several tpusync futures (result raises the first failure)."""

    def __init__(self, futures: Sequence[Any], on_success: Any = None) -> None:
        self._futures = list(futures)
        self._on_success = on_success
        self._settled = False

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None = None) -> None:
        error: tc.TpusyncError | None = None
        for f in self._futures:
            try:
                f.result(timeout)
            except tc.TpusyncError as exc:  # keep waiting for the others: no copy left running
                if error is None:
                    error = exc
        if error is not None:
            raise error
        if not self._settled:
            self._settled = True
            if self._on_success is not None:
                self._on_success()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> None:
        raise self._error


class HostSlots:
    """INTERIM worker-side data on one tpusync.core.HostBlockPool.

    A slot is ``rows_per_key`` pool blocks of ``row_bytes`` each (one per layer row array). The
    pool is allocated whole at construction, so saves never fail for space (the directory already
    decided). SLOT CONTRACT: ``_holder[slot]`` is the key whose bytes the slot holds, set only
    after a save's copies all succeeded and cleared before a slot is rewritten.
    """

    def __init__(
        self, num_slots: int, row_bytes: int, rows_per_key: int, *, prefault: bool = True
    ) -> None:
        self.pool = tc.HostBlockPool(row_bytes, num_slots * rows_per_key, prefault=prefault)
        self._ids = self.pool.alloc(num_slots * rows_per_key)
        self.num_slots = num_slots
        self.rows_per_key = rows_per_key
        self._holder: list[bytes | None] = [None] * num_slots
        self._lock = threading.Lock()

    def _pool_ids(self, slots: Sequence[int], row: int) -> list[int]:
        r = self.rows_per_key
        return [self._ids[s * r + row] for s in slots]

    def _check(self, slots: Sequence[int], keys: Sequence[bytes], layers: Sequence[Any], rows):
        if not (len(slots) == len(keys) == len(rows)):
            raise tc.InvalidArgumentError("slots, keys and rows must have the same length")
        if len(layers) != self.rows_per_key:
            raise tc.InvalidArgumentError(
                f"expected {self.rows_per_key} layer row arrays, got {len(layers)}"
            )
        for s in slots:
            if not 0 <= s < self.num_slots:
                raise tc.InvalidArgumentError(f"slot {s} out of range [0, {self.num_slots})")

    def save(self, slots, keys, layers, rows) -> StoreFuture:
        self._check(slots, keys, layers, rows)
        with self._lock:
            for s in slots:
                self._holder[s] = None
        futures = [
            self.pool.put(self._pool_ids(slots, j), arr, rows=list(rows))
            for j, arr in enumerate(layers)
        ]

        def commit() -> None:
            with self._lock:
                for s, k in zip(slots, keys, strict=True):
                    self._holder[s] = k

        return _AllOf(futures, commit)

    def load(self, slots, keys, layers, rows) -> StoreFuture:
        self._check(slots, keys, layers, rows)
        with self._lock:
            for s, k in zip(slots, keys, strict=True):
                if self._holder[s] != k:
                    return _Failed(
                        tc.NotFoundError(f"slot {s} does not hold key {bytes(k).hex()[:16]}")
                    )
        return _AllOf(
            [
                self.pool.get(self._pool_ids(slots, j), arr, rows=list(rows))
                for j, arr in enumerate(layers)
            ]
        )

    def invalidate(self, slots: Sequence[int] | None = None) -> None:
        """Forget what slots hold (all by default): later loads of them fail (tests, reset)."""
        with self._lock:
            for s in range(self.num_slots) if slots is None else slots:
                self._holder[s] = None
