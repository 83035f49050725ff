"""InterimHostStore: the INTERIM KVStore - one HostBlockPool plus a BlockIndex, host tier only.

It exists so KV cache managers can be built and tested before the tiered store lands; it has no
disk tier, no remote tier and no warm restart. It evicts least-recently-used unpinned keys when
the pool is full (PIN CONTRACT of BlockIndex: an acquired key is never evicted).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tpusync.core._native import BlockIndex, Tier
from tpusync.core.errors import InvalidArgumentError, NotFoundError, PoolExhaustedError
from tpusync.core.pool import HostBlockPool

__all__ = ["InterimHostStore"]


class InterimHostStore:
    """Host-only :class:`~tpusync.core.kvcache.protocols.KVStore` (interim implementation)."""

    def __init__(self, pool: HostBlockPool) -> None:
        self._pool = pool
        self._index = BlockIndex()
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[list[int], Mapping[str, Any]]] = {}
        self._reserved: dict[bytes, tuple[list[int], Mapping[str, Any]]] = {}
        self._next = 0

    @property
    def pool(self) -> HostBlockPool:
        return self._pool

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n, _ = self._index.lookup_prefix(list(keys))
            return n

    def reserve(
        self, keys: Sequence[bytes], blocks_per_key: int, fmt: Mapping[str, Any]
    ) -> list[list[int] | None]:
        if blocks_per_key <= 0:
            raise InvalidArgumentError("blocks_per_key must be > 0")
        with self._lock:
            out: list[list[int] | None] = []
            fresh = []
            for k in keys:
                if k in self._reserved or k in fresh:
                    raise InvalidArgumentError(f"key {k.hex()[:16]} is already being saved")
                if self._index.lookup(k, touch=False) is not None:
                    out.append(None)
                else:
                    out.append([])
                    fresh.append(k)
            need = len(fresh) * blocks_per_key
            self._make_room(need)
            ids = self._pool.alloc(need) if need else []
            it = iter(ids)
            for i, k in enumerate(keys):
                if out[i] is not None:
                    blocks = [next(it) for _ in range(blocks_per_key)]
                    out[i] = blocks
                    self._reserved[k] = (blocks, dict(fmt))
            return out

    def _make_room(self, need: int) -> None:
        short = need - self._pool.num_free
        if short <= 0:
            return
        for key, loc in self._index.eviction_candidates(Tier.HOST, len(self._index)):
            if short <= 0:
                break
            self._index.erase(key)
            blocks, _ = self._entries.pop(loc)
            self._pool.free(blocks)
            short -= len(blocks)
        if short > 0:
            raise PoolExhaustedError(
                f"store pool of {self._pool.num_blocks} blocks cannot take {need} more blocks "
                f"(everything else is pinned or being saved)"
            )

    def commit(self, keys: Sequence[bytes], ok: bool) -> None:
        with self._lock:
            for k in keys:
                entry = self._reserved.pop(k, None)
                if entry is None:
                    continue
                if ok:
                    loc = self._next
                    self._next += 1
                    self._entries[loc] = entry
                    self._index.insert(k, Tier.HOST, loc)
                else:
                    self._pool.free(entry[0])

    def acquire(self, keys: Sequence[bytes]) -> list[tuple[list[int], Mapping[str, Any]]]:
        with self._lock:
            found = []
            for k in keys:
                p = self._index.lookup(k)
                if p is None:
                    raise NotFoundError(f"key {k.hex()[:16]} is not in the store; nothing pinned")
                found.append(p.location(Tier.HOST))
            for k in keys:
                self._index.pin(k)
            return [self._entries[loc] for loc in found]

    def release(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._index.unpin(k)
