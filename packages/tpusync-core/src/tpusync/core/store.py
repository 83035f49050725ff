"""KVStore: the tiered KV block store (host DRAM -> local/shared disk), with futures.

Keys are engine block hashes (``bytes``, 1..64 bytes, used as is); values are fixed-size blocks of
``block_bytes``. One store holds one block shape - several shapes use several stores.

Contracts (the native core enforces them; see docs/tiers.md):

* ``put`` / ``get`` copy straight between caller memory (numpy, torch or jax CPU arrays, or
  ``HostBlockPool`` block views) and the tiers on engine threads; they return a
  :class:`StoreFuture` whose ``result()`` is a per-key list of booleans (stored / found).
* A key is visible only once its bytes are fully written; a put of a stored key writes nothing.
* A full host tier drops LRU blocks that already have a disk copy; dirty ones are written down by a
  background write-back worker, and a put waits for it at most ``put_wait_s``. Disk hits are
  promoted to DRAM. Pinned keys are never evicted.
* Every block carries an XXH3 checksum, verified on every disk read and when a /dev/shm host tier
  is re-attached; a bad block is a counted miss, never data.
* With ``namespace`` (and ``fingerprint``), a replacement process re-attaches the host tier in
  /dev/shm and the disk tier; another fingerprint is a cold start with one stderr line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tpusync.core import _native
from tpusync.core.pool import _array, _counts, _ids, _writable, default_engine

__all__ = ["KVStore", "StoreFuture"]


class StoreFuture:
    """Completion of a store ``put`` or ``get``: ``result()`` gives one bool per key.

    Store operations cannot be cancelled once submitted (bytes may already be moving into the
    caller's buffer); ``wait`` and ``result`` take timeouts like every tpusync wait.
    """

    __slots__ = ("_future", "_mask")

    def __init__(self, future: _native.Future, mask: np.ndarray) -> None:
        self._future = future
        self._mask = mask

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when complete."""
        return self._future.wait(timeout)

    def result(self, timeout: float | None = None) -> list[bool]:
        """Wait, raise the batch's error if any, then return the per-key flags."""
        self._future.result(timeout)
        return [bool(x) for x in self._mask]

    def mask(self, timeout: float | None = None) -> np.ndarray:
        """Like :meth:`result` but as a read-only uint8 numpy array (no per-key Python objects)."""
        self._future.result(timeout)
        view = self._mask.view()
        view.flags.writeable = False
        return view

    @property
    def state(self) -> str:
        return self._future.state

    def add_done_callback(self, fn: Callable[[StoreFuture], Any]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))


def _keys(keys: Sequence[bytes]) -> list[bytes]:
    out = list(keys)
    for k in out:
        if not isinstance(k, bytes | bytearray):
            raise TypeError(f"store keys are bytes (engine block hashes), got {type(k).__name__}")
    return [bytes(k) for k in out]


def _rows(rows: Sequence[int] | None) -> list[int] | None:
    return None if rows is None else _ids(rows, "rows")


def _text(value: str | None, what: str) -> str:
    """A string option; None means none (nanobind listed its signatures for None)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"KVStore: {what} must be a str, got {type(value).__name__}")
    return value


def _recency(recency: str | _native.Recency) -> _native.Recency:
    if isinstance(recency, _native.Recency):
        return recency
    names = {r.name.lower(): r for r in _native.Recency}
    if not isinstance(recency, str) or recency.lower() not in names:
        raise ValueError(f"recency must be one of {sorted(names)}, got {recency!r}")
    return names[recency.lower()]


CHECKPOINT_WRITE_BACKS = ("progressive", "at_fsync")


def _write_back(mode: str) -> bool:
    if not isinstance(mode, str) or mode not in CHECKPOINT_WRITE_BACKS:
        raise ValueError(
            f"checkpoint_write_back must be one of {list(CHECKPOINT_WRITE_BACKS)}, got {mode!r}"
        )
    return mode == "progressive"


class KVStore:
    """A tiered, content-addressed store of fixed-size KV blocks.

    Args:
        block_bytes: size of every block.
        host_blocks: capacity of the host DRAM tier in blocks (0: disk only).
        disk_dir: directory of the disk tier (local SSD or shared filesystem); None: no disk tier.
        disk_blocks: capacity of the disk tier in blocks.
        namespace: put the host tier in /dev/shm under this name so a restarted process
            re-attaches it (with the disk tier); None: private anonymous memory.
        fingerprint: model fingerprint; a restart with another one is a cold start.
        policy: ``"lru"`` (every block cascades to disk) or ``"second_use"`` (only blocks used
            twice are written to disk).
        io_backend: ``"auto"`` (io_uring where the kernel allows it), ``"io_uring"`` or ``"pread"``.
        put_wait_s: the longest one put call waits, in all, for write-back to free DRAM before
            it reports its remaining blocks not stored.
        remote: store nodes (``HOST:PORT`` each, ``tpusync store-node``) forming a last, shared
            tier: the host tier demotes to disk first (when there is one), then to the nodes;
            lookups try local tiers first, then the nodes (blocks other processes stored there
            count as hits and are leased on the nodes until read or ``lease_s`` passes).
        auth_secret: the nodes' shared secret (bytes); with neither this nor
            ``auth_secret_file``: ``$TPUSYNC_AUTH_SECRET``.
        auth_secret_file: a file holding the nodes' shared secret.
        replicas: copies of each block on distinct nodes (reads fall back to the next replica).
        remote_blocks: remote blocks this store indexes at once.
        remote_timeout: seconds a new link's connect, and then one request, to one node may take;
            the nodes of one replica round are asked at once, so a call waits at most
            ``2 * replicas`` times this however many nodes are down.
        write_through: also copy every newly put block to the LAST tier (the store nodes, else the
            disk tier), asynchronously, so that other processes sharing that tier find it at once
            instead of when this store's DRAM overflows. ``put`` completes when the fastest tier
            holds the block; the copy is best effort (bounded queue; after a failed copy - a dead
            node - copies pause for a back-off of 1 s doubling to 30 s); ``flush`` waits for
            queued copies. Counters: ``stats()["write_through"]``, ``write_through_dropped``,
            ``write_through_errors``. Needs a tier below the host tier.
        recency: how the index orders blocks for eviction: ``"clock"`` (the default: a lookup sets
            a reference bit; eviction gives a referenced block a second chance) or
            ``"exact_lru"`` (every lookup moves the block to the most-recent end: exact LRU order,
            more memory traffic per lookup). A ``tpusync.core._native.Recency`` is accepted too.
            Read it back from :attr:`recency`.
        checkpoint_s: disk tier checkpoints while the store serves (docs/tiers.md "Crash
            semantics"): a manifest of the disk tier's blocks is written in the background when
            any slot changed and ``checkpoint_s`` seconds passed since the last one (0: never by
            time).
        checkpoint_writes: a checkpoint is also written when ``checkpoint_writes`` slots changed
            since the last one (0: never by count; with both 0 there are no checkpoints). A disk
            tier without a checkpoint on disk (a cold start, an open by scan) gets one at once: at
            open when it is empty, else in the background. Every later slot change
            is journaled, so a restart after a crash (SIGKILL) reads the manifest plus the headers
            of only the journaled slots instead of every slot header. ``stats()["tiers"]["disk"]``
            reports ``recovery`` ("cold", "scan", "manifest" or "checkpoint"),
            ``recovery_slots_read``, ``checkpoints``, ``manifest_errors`` and ``journaled``.
        checkpoint_write_back: how a checkpoint's manifest (~80 bytes per disk block) reaches the
            disk: ``"progressive"`` (the default: each MiB is handed to the disk as it is written
            and the MiB before it waited for, so at most ~2 MiB of it queue ahead of the store's
            own disk puts and gets) or ``"at_fsync"`` (the whole file left to the final fsync, as
            before; puts and gets during a checkpoint wait longer: docs/tiers.md "Checkpoints
            and the slot journal"). Same file either way; ``stats()["tiers"]["disk"]``
            reports it as ``manifest_write_back``.
    """

    def __init__(
        self,
        block_bytes: int,
        host_blocks: int,
        *,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_blocks: int = 0,
        namespace: str | None = None,
        fingerprint: str = "",
        policy: str = "lru",
        io_backend: str = "auto",
        io_threads: int = 4,
        direct_io: bool = True,
        segment_blocks: int = 0,
        writeback_batch: int = 32,
        writeback_headroom: int = 0,
        put_wait_s: float = 5.0,
        prefault: bool = True,
        huge_pages: bool = True,
        engine: _native.Engine | None = None,
        remote: str | Sequence[str] | None = None,
        auth_secret: bytes | None = None,
        auth_secret_file: str | os.PathLike[str] | None = None,
        replicas: int = 1,
        remote_blocks: int = 1 << 16,
        remote_timeout: float = 10.0,
        lease_s: float = 10.0,
        write_through: bool = False,
        recency: str | _native.Recency = "clock",
        checkpoint_s: float = 60.0,
        checkpoint_writes: int = 1 << 16,
        checkpoint_write_back: str = "progressive",
    ) -> None:
        _counts(
            "KVStore",
            block_bytes=block_bytes,
            host_blocks=host_blocks,
            disk_blocks=disk_blocks,
            segment_blocks=segment_blocks,
            io_threads=io_threads,
            writeback_batch=writeback_batch,
            writeback_headroom=writeback_headroom,
            replicas=replicas,
            remote_blocks=remote_blocks,
            checkpoint_writes=checkpoint_writes,
        )
        self._engine = engine or default_engine()
        self._block_bytes = block_bytes
        local = dict(  # the host / disk tiers, the same with or without store nodes
            name_space=namespace or "",
            fingerprint=_text(fingerprint, "fingerprint"),
            disk_dir=os.fspath(disk_dir) if disk_dir is not None else "",
            disk_blocks=disk_blocks,
            disk_segment_blocks=segment_blocks,
            disk_direct_io=direct_io,
            io_backend=io_backend,
            io_threads=io_threads,
            policy=policy,
            writeback_batch=writeback_batch,
            writeback_headroom=writeback_headroom,
            put_wait_s=put_wait_s,
            prefault=prefault,
            huge_pages=huge_pages,
            write_through=write_through,
            index_recency=_recency(recency),
            disk_checkpoint_s=checkpoint_s,
            disk_checkpoint_writes=checkpoint_writes,
            disk_manifest_progressive_write_back=_write_back(checkpoint_write_back),
        )
        if remote:
            from tpusync.core.pd import _secret
            from tpusync.core.store_node import node_list

            secret = _secret(auth_secret, auth_secret_file)
            self._native = _native.open_remote_kv_store(
                self._engine,
                block_bytes,
                host_blocks,
                node_list(remote, "KVStore remote"),
                secret,
                replicas=replicas,
                remote_blocks=remote_blocks,
                lease=lease_s,
                timeout=remote_timeout,
                **local,
            )
        else:
            self._native = _native.KVStoreNative.open(
                self._engine, block_bytes, host_blocks, **local
            )

    @property
    def native(self) -> _native.KVStoreNative:
        if self._native is None:
            from tpusync.core.errors import StateError

            raise StateError("the KVStore is closed")
        return self._native

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def recency(self) -> str:
        """The index's recency mode: ``"clock"`` or ``"exact_lru"`` (see ``recency=``)."""
        return self.native.index_recency.name.lower()

    def put(
        self, keys: Sequence[bytes], src: Any, rows: Sequence[int] | None = None
    ) -> StoreFuture:
        """Store row ``i`` of ``src`` (or row ``rows[i]``) under ``keys[i]``, asynchronously."""
        fut, mask = self.native.put(_keys(keys), _array(src, "src", False), _rows(rows))
        return StoreFuture(fut, mask)

    def get(
        self, keys: Sequence[bytes], dst: Any, rows: Sequence[int] | None = None
    ) -> StoreFuture:
        """Read ``keys[i]`` into row ``i`` of ``dst`` (or row ``rows[i]``), asynchronously.

        ``result()[i]`` is False for a miss (absent, evicted, or corrupted on disk); that row's
        bytes are then unspecified.
        """
        fut, mask = self.native.get(_keys(keys), _writable(_array(dst, "dst", True)), _rows(rows))
        return StoreFuture(fut, mask)

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str]]:
        """Length of the leading run of stored keys, and the fastest tier of each ("host", "disk",
        "remote"). With store nodes, keys past the local run are looked up on the nodes."""
        n, tiers = self.native.lookup(_keys(keys))
        return n, [t.name.lower() for t in tiers]

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep keys from eviction (counted; all keys must be stored, else nothing is pinned)."""
        self.native.pin(_keys(keys))

    def unpin(self, keys: Sequence[bytes]) -> None:
        self.native.unpin(_keys(keys))

    def remove(self, keys: Sequence[bytes]) -> int:
        """Forget keys in every tier; returns how many were stored. Pinned keys are refused."""
        return self.native.remove(_keys(keys))

    def clear(self) -> None:
        """Forget every key (pins included)."""
        self.native.clear()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until write-back (and write-through) have nothing left to write."""
        self.native.flush(timeout)

    def checkpoint(self) -> None:
        """Write a checkpoint of the disk tier now, whatever ``checkpoint_s`` /
        ``checkpoint_writes`` say (docs/tiers.md "Crash semantics"): puts and gets go on while it
        runs (the index is walked in chunks). Raises when the manifest cannot be written (the
        previous one and its journals stay valid). A store without a disk tier does nothing."""
        self.native.checkpoint()

    def stats(self) -> dict[str, Any]:
        """Counters: hits / misses per tier, bytes moved, evictions, errors, queues, latencies."""
        return self.native.stats()

    def enable_events(self, capacity: int = 65536) -> None:
        """Record every placement change (put, demotion, promotion, eviction, remove, clear).

        The native queue keeps at most ``capacity`` events (oldest dropped first, counted);
        ``0`` turns recording off. :class:`tpusync.core.events.StoreEventBridge` drains it onto a
        KV-event publisher.
        """
        if capacity < 0:
            from tpusync.core.errors import InvalidArgumentError

            raise InvalidArgumentError(f"event capacity must be >= 0, not {capacity}")
        self.native.enable_events(capacity)

    def take_events(self, max_events: int = 65536) -> tuple[list[tuple[str, str, bytes]], int]:
        """Oldest recorded events as ``(kind, tier, key)`` and the count dropped since last call.

        ``kind`` is ``"stored"``, ``"removed"`` or ``"cleared"``; ``tier`` is ``"host"``,
        ``"disk"`` or ``"remote"`` (meaningless for ``"cleared"``).
        """
        _counts("take_events", max_events=max_events)
        raw, dropped = self.native.take_events(max_events)
        return [(k, t.name.lower(), key) for k, t, key in raw], int(dropped)

    def prometheus(self, registry: Any = None, prefix: str = "tpusync_store") -> Any:
        """Register this store's metrics with a prometheus-client registry (default: global)."""
        from tpusync.core.metrics import register_store

        return register_store(self, registry=registry, prefix=prefix)

    @staticmethod
    def unlink_namespace(namespace: str) -> None:
        """Delete the /dev/shm host tier of a namespace (no process may be using it)."""
        for suffix in ("", ".lock"):
            path = f"/dev/shm/tpusync-{namespace}-host{suffix}"
            if os.path.exists(path):
                os.unlink(path)

    def close(self) -> None:
        """Release the store (waits for operations in flight). A /dev/shm host tier persists.

        A disk tier then writes its clean-shutdown manifest, so the next store on ``disk_dir``
        takes its blocks without reading every slot header (docs/tiers.md); a process that dies
        without closing leaves none and the next open scans the headers.

        Inside a done-callback, close returns at once and the store is released on a thread of
        its own once its operations complete (the callback's thread is an engine worker they may
        be queued behind); its namespace and ``disk_dir`` stay locked until then.
        """
        self._native = None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if getattr(self, "_native", None) is None:  # closed, or its __init__ failed
            return "KVStore(closed)"
        s = self.stats()
        tiers = ", ".join(
            f"{name}={t['used_blocks']}/{t['capacity_blocks']}" for name, t in s["tiers"].items()
        )
        return f"KVStore(block_bytes={self._block_bytes}, keys={s['keys']}, {tiers})"
