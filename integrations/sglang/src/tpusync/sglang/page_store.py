"""The storage seam under the SGLang backend: one small Protocol and its interim implementation.

A *page* is what one SGLang page hash names: ``segments_per_page`` segments of ``segment_bytes``
each (for an MHA host pool in ``page_first`` layout: the K run and the V run of one page; in
``layer_first``: one K and one V run per layer). Callers describe their memory as a *row table*,
a 2-D ``uint8`` array ``[num_rows, segment_bytes]`` whose rows are contiguous (any row stride), and
name each page's segments by row number, in the page's canonical segment order. Copies go
straight between those rows and the store: no staging buffer, no Python loop per byte.

ROW CONTRACT: ``rows`` has shape ``[len(keys), segments_per_page]``; segment ``j`` of page ``i``
is ``table[rows[i, j]]``. Every row index is range-checked before any byte moves.

KEY CONTRACT: keys are opaque bytes (1..64 bytes, see tpusync's BlockKey); the store never derives
one. The SGLang backend turns page hashes into keys (``tpusync.sglang.hicache.page_key``).

The backend depends only on :class:`PageStore`. :class:`KVStorePageStore` (the default) implements
it on tpusync's tiered ``tpusync.core.KVStore`` (host DRAM tier, optional disk tier, optional
/dev/shm warm restart). :class:`InterimHostPageStore` (``HostBlockPool`` + ``BlockIndex``, host DRAM
only) is kept because it is the one store whose misses leave destination rows untouched; the
backend selects it with ``"store": "interim"``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

import tpusync.core as tc

__all__ = ["InterimHostPageStore", "KVStorePageStore", "PageStore", "check_rows"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


@runtime_checkable
class PageStore(Protocol):
    """Content-addressed page storage that copies into and out of caller row tables.

    Implementations are thread-safe: SGLang calls from its backup and prefetch threads at once.
    """

    @property
    def segment_bytes(self) -> int:
        """Bytes in one segment (one row of the caller's table)."""
        ...

    @property
    def segments_per_page(self) -> int:
        """Segments that make up one page."""
        ...

    def put_pages(
        self, keys: Sequence[bytes], table: np.ndarray, rows: np.ndarray, timeout: float
    ) -> list[bool]:
        """Store page ``i`` from ``table[rows[i]]`` under ``keys[i]``; True per page stored.

        A key already present counts as stored and is not rewritten (pages are immutable by
        content). A page becomes visible to lookups only after all its bytes are in the store.
        """
        ...

    def get_pages(
        self, keys: Sequence[bytes], table: np.ndarray, rows: np.ndarray, timeout: float
    ) -> list[bool]:
        """Copy page ``keys[i]`` into ``table[rows[i]]``; True per page copied.

        A missing page yields False and leaves its destination rows untouched.
        """
        ...

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that are stored."""
        ...

    def remove(self, keys: Sequence[bytes]) -> int:
        """Forget the given keys (absent ones are skipped); returns how many were removed."""
        ...

    def clear(self) -> None:
        """Forget every page."""
        ...


def check_rows(table: np.ndarray, rows: np.ndarray, n_keys: int, segment_bytes: int, spp: int):
    """Validate a row table and row indices against the ROW CONTRACT; returns flat row ids.

    Raises ValueError naming the mismatch, before any byte moves.
    """
    if not isinstance(table, np.ndarray) or table.ndim != 2 or table.dtype != np.uint8:
        raise ValueError(
            f"row table must be a 2-D uint8 numpy array, got {type(table).__name__} "
            f"{getattr(table, 'dtype', None)} ndim={getattr(table, 'ndim', None)}"
        )
    if table.shape[1] != segment_bytes or table.strides[1] != 1:
        raise ValueError(
            f"row table rows must be {segment_bytes} contiguous bytes, got shape {table.shape} "
            f"strides {table.strides}"
        )
    rows = np.asarray(rows)
    if rows.shape != (n_keys, spp):
        raise ValueError(f"rows must have shape ({n_keys}, {spp}), got {rows.shape}")
    if not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"rows must be integers, got {rows.dtype}")
    flat = rows.reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= table.shape[0]):
        raise ValueError(
            f"row index out of range: [{flat.min()}, {flat.max()}] for a table of "
            f"{table.shape[0]} rows"
        )
    return flat


class InterimHostPageStore:
    """INTERIM :class:`PageStore` on one ``HostBlockPool`` and one ``BlockIndex`` (host tier).

    One pool block per segment, so a page takes ``segments_per_page`` blocks; the index maps a
    key to a page slot whose block ids are kept here. When the pool is full, least-recently-used
    unpinned pages are evicted (the index's LRU order; lookups and reads touch).

    PIN CONTRACT: a page being read is pinned in the index for the duration of the copy, so
    eviction can never recycle its blocks under a running read. Rejected alternative: holding the
    store lock across copies, which would serialise SGLang's prefetch and backup threads.

    To be replaced by the tiered KVStore at merge time; nothing outside this module depends on
    this class beyond construction.
    """

    def __init__(
        self,
        segment_bytes: int,
        segments_per_page: int,
        capacity_pages: int,
        *,
        engine: tc.Engine | None = None,
        prefault: bool = True,
    ) -> None:
        if segment_bytes <= 0 or segments_per_page <= 0 or capacity_pages <= 0:
            raise ValueError(
                "segment_bytes, segments_per_page and capacity_pages must be positive, got "
                f"{segment_bytes}, {segments_per_page}, {capacity_pages}"
            )
        self._segment_bytes = int(segment_bytes)
        self._spp = int(segments_per_page)
        self._pool = tc.HostBlockPool(
            segment_bytes, capacity_pages * segments_per_page, prefault=prefault, engine=engine
        )
        # The pool may round its block count up (to whole OS pages); the page budget is ours.
        self._capacity = int(capacity_pages)
        self._held = 0  # pages whose blocks are allocated: stored + reserved by running puts
        self._index = tc.BlockIndex()
        self._slots: dict[int, tuple[bytes, list[int]]] = {}  # slot -> (key, pool block ids)
        self._next_slot = 0
        self._lock = threading.Lock()
        self._stats = {"puts": 0, "gets": 0, "hits": 0, "misses": 0, "evictions": 0}

    @property
    def segment_bytes(self) -> int:
        return self._segment_bytes

    @property
    def segments_per_page(self) -> int:
        return self._spp

    @property
    def capacity_pages(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                **self._stats,
                "pages": len(self._slots),
                "free_pages": self._capacity - self._held,
            }

    # -- PageStore ------------------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        with self._lock:
            n, _ = self._index.lookup_prefix(list(keys))
        return n

    def put_pages(
        self, keys: Sequence[bytes], table: np.ndarray, rows: np.ndarray, timeout: float
    ) -> list[bool]:
        keys = list(keys)
        flat = check_rows(table, rows, len(keys), self._segment_bytes, self._spp)
        ok = [False] * len(keys)
        todo: list[int] = []  # positions to copy
        reserved: dict[bytes, list[int]] = {}
        with self._lock:
            for i, key in enumerate(keys):
                if key in reserved:  # duplicate within the batch: first one wins
                    continue
                if self._index.lookup(key, touch=True) is not None:
                    ok[i] = True
                    continue
                ids = self._alloc_page_locked()
                if ids is None:
                    logger.warning("tpusync page store full: %d page(s) not stored", len(keys) - i)
                    break
                reserved[key] = ids
                todo.append(i)
        if not todo:
            return ok
        ids = [b for i in todo for b in reserved[keys[i]]]
        src_rows = np.concatenate([flat[i * self._spp : (i + 1) * self._spp] for i in todo])
        try:
            self._pool.put(ids, table, rows=src_rows.tolist()).result(timeout=timeout)
        except Exception:
            with self._lock:
                for i in todo:
                    self._free_page_locked(reserved[keys[i]])
            raise
        with self._lock:
            for i in todo:
                slot = self._next_slot
                self._next_slot += 1
                try:
                    self._index.insert(keys[i], tc.Tier.HOST, slot)
                except tc.AlreadyExistsError:  # a concurrent put of the same content won
                    self._free_page_locked(reserved[keys[i]])
                else:
                    self._slots[slot] = (keys[i], reserved[keys[i]])
                ok[i] = True
            self._stats["puts"] += len(todo)
        for i, key in enumerate(keys):  # duplicates inside the batch follow their first copy
            if not ok[i] and key in reserved:
                ok[i] = ok[keys.index(key)]
        return ok

    def get_pages(
        self, keys: Sequence[bytes], table: np.ndarray, rows: np.ndarray, timeout: float
    ) -> list[bool]:
        keys = list(keys)
        flat = check_rows(table, rows, len(keys), self._segment_bytes, self._spp)
        if table.flags.writeable is False:
            raise ValueError("destination row table is read-only")
        ok = [False] * len(keys)
        pinned: list[bytes] = []
        ids: list[int] = []
        dst_rows: list[np.ndarray] = []
        with self._lock:
            for i, key in enumerate(keys):
                placement = self._index.lookup(key, touch=True)
                if placement is None or not placement.has(tc.Tier.HOST):
                    continue
                self._index.pin(key)
                pinned.append(key)
                ids.extend(self._slots[placement.location(tc.Tier.HOST)][1])
                dst_rows.append(flat[i * self._spp : (i + 1) * self._spp])
                ok[i] = True
            self._stats["gets"] += 1
            self._stats["hits"] += len(pinned)
            self._stats["misses"] += len(keys) - len(pinned)
        try:
            if ids:
                self._pool.get(ids, table, rows=np.concatenate(dst_rows).tolist()).result(
                    timeout=timeout
                )
        finally:
            with self._lock:
                for key in pinned:
                    self._index.unpin(key)
        return ok

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                placement = self._index.lookup(key, touch=False)
                if placement is None:
                    continue
                if placement.pins:
                    continue  # being read: it stays until the reader is done
                self._erase_locked(key, placement.location(tc.Tier.HOST))
                removed += 1
        return removed

    def clear(self) -> None:
        """Forget every page except those being read right now (they go with their reader)."""
        with self._lock:
            for slot, (key, _) in list(self._slots.items()):
                placement = self._index.lookup(key, touch=False)
                if placement is not None and placement.pins:
                    continue
                self._erase_locked(key, slot)

    # -- internals ------------------------------------------------------------------------------

    def _alloc_page_locked(self) -> list[int] | None:
        """Blocks for one page, evicting the LRU unpinned page if full; None if nothing can go."""
        while self._held >= self._capacity or self._pool.num_free < self._spp:
            victims = self._index.eviction_candidates(tc.Tier.HOST, 1)
            if not victims:
                return None
            key, slot = victims[0]
            self._erase_locked(key, slot)
            self._stats["evictions"] += 1
        self._held += 1
        return self._pool.alloc(self._spp)

    def _free_page_locked(self, ids: list[int]) -> None:
        self._pool.free(ids)
        self._held -= 1

    def _erase_locked(self, key: bytes, slot: int) -> None:
        self._index.erase(key)
        _, ids = self._slots.pop(slot)
        self._free_page_locked(ids)


_MAX_KEY = 64  # tpusync BlockKey limit


class KVStorePageStore:
    """:class:`PageStore` on tpusync's tiered :class:`tpusync.core.KVStore`.

    SEGMENT KEY CONTRACT: a page of ``segments_per_page`` segments is stored as that many store
    blocks, keyed ``page key + segment number (2 bytes LE)`` (page keys longer than 62 bytes are
    first hashed to 32 bytes with BLAKE2b). A page counts as stored, found or removed only when
    every one of its segments is; ``lookup_prefix`` counts whole pages of the leading run.

    MISS CONTRACT (weaker than the interim store): the destination rows of a page reported
    missing may have been partly written (another segment of it was found). SGLang never uses
    the host slots of a page that ``batch_get_v1`` reports failed, so this is safe for the
    backend; callers that need untouched rows on a miss use :class:`InterimHostPageStore`.

    Eviction, write-back to the disk tier, checksums and warm restart are the KVStore's (see
    docs/tiers.md): a full host tier drops least-recently-used blocks (after their disk copy
    when there is a disk tier). With ``remote`` (store-node addresses, docs/store-node.md) the
    store nodes are the last tier: with ``write_through`` (the default with ``remote``) every
    page newly stored is also copied to the nodes in the background, otherwise pages reach them
    only when the local tiers demote them; any process with the same node list finds them by
    ``lookup_prefix`` and reads them back.
    """

    def __init__(
        self,
        segment_bytes: int,
        segments_per_page: int,
        capacity_pages: int,
        *,
        disk_dir: str | None = None,
        disk_pages: int = 0,
        namespace: str | None = None,
        fingerprint: str = "",
        prefault: bool = True,
        engine: tc.Engine | None = None,
        remote: Sequence[str] | None = None,
        auth_secret_file: str | None = None,
        replicas: int = 1,
        write_through: bool | None = None,
    ) -> None:
        if segment_bytes <= 0 or segments_per_page <= 0 or capacity_pages <= 0:
            raise ValueError(
                "segment_bytes, segments_per_page and capacity_pages must be positive, got "
                f"{segment_bytes}, {segments_per_page}, {capacity_pages}"
            )
        if disk_dir is not None and disk_pages <= 0:
            raise ValueError("a disk tier needs disk_pages > 0")
        self._segment_bytes = int(segment_bytes)
        self._spp = int(segments_per_page)
        self._capacity = int(capacity_pages)
        self.store = tc.KVStore(
            self._segment_bytes,
            self._capacity * self._spp,
            disk_dir=disk_dir,
            disk_blocks=int(disk_pages) * self._spp if disk_dir is not None else 0,
            namespace=namespace,
            fingerprint=fingerprint,
            prefault=prefault,
            engine=engine,
            remote=list(remote) if remote else None,
            auth_secret_file=auth_secret_file,
            replicas=replicas,
            write_through=bool(remote) if write_through is None else write_through,
        )
        self._suffixes = [j.to_bytes(2, "little") for j in range(self._spp)]

    @property
    def segment_bytes(self) -> int:
        return self._segment_bytes

    @property
    def segments_per_page(self) -> int:
        return self._spp

    @property
    def capacity_pages(self) -> int:
        return self._capacity

    def stats(self) -> dict:
        return self.store.stats()

    def __len__(self) -> int:
        """Stored segments divided by segments per page (exact when no page is partial)."""
        return int(self.store.stats()["keys"]) // self._spp

    def _segment_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        out = []
        for key in keys:
            if not isinstance(key, bytes | bytearray) or not key:
                raise ValueError(f"page keys are non-empty bytes, got {key!r}")
            base = bytes(key)
            if len(base) > _MAX_KEY - 2:
                base = hashlib.blake2b(base, digest_size=32).digest()
            out.extend(base + sfx for sfx in self._suffixes)
        return out

    def _pages(self, mask: np.ndarray, n: int) -> list[bool]:
        return [bool(x) for x in np.asarray(mask, dtype=bool).reshape(n, self._spp).all(axis=1)]

    def put_pages(
        self, keys: Sequence[bytes], table: np.ndarray, rows: np.ndarray, timeout: float
    ) -> list[bool]:
        keys = list(keys)
        flat = check_rows(table, rows, len(keys), self._segment_bytes, self._spp)
        if not keys:
            return []
        mask = self.store.put(self._segment_keys(keys), table, rows=flat).mask(timeout)
        return self._pages(mask, len(keys))

    def get_pages(
        self, keys: Sequence[bytes], table: np.ndarray, rows: np.ndarray, timeout: float
    ) -> list[bool]:
        keys = list(keys)
        flat = check_rows(table, rows, len(keys), self._segment_bytes, self._spp)
        if table.flags.writeable is False:
            raise ValueError("destination row table is read-only")
        if not keys:
            return []
        mask = self.store.get(self._segment_keys(keys), table, rows=flat).mask(timeout)
        return self._pages(mask, len(keys))

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        n, _ = self.store.lookup(self._segment_keys(keys))
        return n // self._spp

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            if self.store.remove(self._segment_keys([key])) == self._spp:
                removed += 1
        return removed

    def clear(self) -> None:
        self.store.clear()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until write-back (host -> disk / store nodes) has nothing left to write."""
        self.store.flush(timeout)

    def close(self) -> None:
        self.store.close()
