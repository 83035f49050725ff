"""PdBlockTransport: the managers' BlockTransport over the P/D primitive (tpusync.core.pd).

One object per process serves this process's published blocks (a :class:`PdProducer` on
``listen``, authenticated TCP, plus a Unix socket for same-host shm copies with ``unix_path``)
and pulls peers' blocks (a :class:`PdConsumer`), both over the manager's host pool.

META CONTRACT: the P/D primitive moves blocks only, so the transfer's ``meta`` (the producer's
block format and block count) travels in ``meta_blocks`` extra leading blocks: a 4-byte magic, a
4-byte little-endian length and the canonical JSON. ``meta_blocks`` is ``ceil(2048 /
block_bytes)`` on both sides, so peers with equal host block sizes always agree on it; the
consumer hands the decoded meta to the manager, which refuses a format mismatch naming the field
before any device block is written. Meta larger than that is refused at publish.

ID CONTRACT: a transfer id (str) maps to the 63-bit request id ``blake2b-64(id) >> 1``; ids are
live at most once per producer (AlreadyExistsError).

RETRACT CONTRACT: the producer holds its own reference on every published block until the
consumer acknowledged a verified receipt, ``send_deadline`` passed, or :meth:`retract` cancelled
the send (a pull still in flight then fails, and keeps the blocks' memory out of the pool until it
let go: ``PdProducer.cancel``). The caller may free its blocks at once, and may publish the same
id again. Before, retract only forgot the id: the blocks and the id stayed taken until
``send_deadline``.

ABANDON CONTRACT: :meth:`abandon` gives up a fetch in flight (``PdConsumer.abandon``, on a thread
of its own, so it returns at once): its future fails, its local blocks are written no more, and
the id may be fetched again. The manager calls it when its own deadline fires first; before, the
fetch ran on until ``recv_deadline`` and held the id and its blocks until then.

DEAD-PEER CONTRACT: a fetch from a dead producer (refused connection, reset mid-stream, expired
deadline) fails its future with UnavailableError carrying the primitive's code and reason.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tpusync.core.errors import InvalidArgumentError, NotFoundError, TpusyncError, UnavailableError
from tpusync.core.pd import PdConsumer, PdProducer
from tpusync.core.pool import HostBlockPool

__all__ = ["PdBlockTransport"]

log = logging.getLogger(__name__)

_MAGIC = b"TSPM"
_META_BYTES = 2048
_POLL_S = 0.002


def _request_id(transfer_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "big") >> 1


class PdBlockTransport:
    """:class:`~tpusync.core.kvcache.protocols.BlockTransport` over PdProducer / PdConsumer.

    Args:
        pool: the manager's host pool (publish / fetch refuse any other pool).
        listen: ``HOST:PORT`` the producer serves on (port 0: ephemeral, see :attr:`address`).
        unix_path: also serve same-host consumers on this Unix socket (shm copies; the pool
            needs an ``shm_name``).
        secret: the shared secret (default ``$TPUSYNC_AUTH_SECRET``).
        secret_file: a file holding the shared secret, instead of ``secret``.
        send_deadline: seconds a published transfer stays offered.
        recv_deadline: seconds a fetch may take before it fails.
        streams: parallel connections of the consumer.
    """

    def __init__(
        self,
        pool: HostBlockPool,
        *,
        listen: str = "127.0.0.1:0",
        unix_path: str | None = None,
        secret: bytes | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        send_deadline: float = 60.0,
        recv_deadline: float = 30.0,
        streams: int = 2,
        connect_timeout: float = 5.0,
    ) -> None:
        self.pool = pool
        self.meta_blocks = -(-_META_BYTES // pool.block_bytes)
        self.send_deadline = send_deadline
        self.recv_deadline = recv_deadline
        self._producer = PdProducer(
            pool, listen=listen, unix_path=unix_path, secret=secret, secret_file=secret_file
        )
        self._consumer = PdConsumer(
            pool,
            streams=streams,
            secret=secret,
            secret_file=secret_file,
            connect_timeout=connect_timeout,
        )
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._pending: dict[int, tuple[cf.Future, list[int], str]] = {}
        self._poller: threading.Thread | None = None
        self._stats = {"fetched": 0, "fetched_shm": 0, "fetched_bytes": 0, "fetch_failed": 0}

    def stats(self) -> dict[str, int]:
        """Consumer-side counters: completed fetches (``fetched_shm`` of them over the same-host
        shared-memory path), their bytes, and failed fetches."""
        with self._lock:
            return dict(self._stats)

    @property
    def address(self) -> str:
        """``HOST:PORT`` peers fetch from."""
        return self._producer.address

    @property
    def unix_address(self) -> str | None:
        return self._producer.unix_address

    def _check_pool(self, pool: HostBlockPool) -> None:
        if pool is not self.pool:
            raise InvalidArgumentError("this transport serves another host pool than the caller's")

    # -- producer ----------------------------------------------------------------------------
    def publish(
        self,
        transfer_id: str,
        pool: HostBlockPool,
        block_ids: Sequence[int],
        meta: Mapping[str, Any],
    ) -> None:
        self._check_pool(pool)
        blob = json.dumps(dict(meta), sort_keys=True, separators=(",", ":")).encode()
        room = self.meta_blocks * pool.block_bytes - 8
        if len(blob) > room:
            raise InvalidArgumentError(f"transfer meta of {len(blob)} bytes exceeds {room} bytes")
        head = np.frombuffer(_MAGIC + len(blob).to_bytes(4, "little") + blob, dtype=np.uint8)
        meta_ids = pool.alloc(self.meta_blocks)
        try:
            for k, bid in enumerate(meta_ids):
                chunk = head[k * pool.block_bytes : (k + 1) * pool.block_bytes]
                pool.view(bid)[: chunk.size] = chunk
            self._producer.register_send(
                _request_id(transfer_id), meta_ids + list(block_ids), self.send_deadline
            )
        finally:
            pool.free(meta_ids)  # the producer holds its own references (RETRACT CONTRACT)
        with self._lock:
            self._sent.add(transfer_id)
        self._producer.poll()  # drain finished sends (each is reported once)

    def retract(self, transfer_id: str) -> None:
        with self._lock:
            self._sent.discard(transfer_id)
        try:
            self._producer.cancel(_request_id(transfer_id), f"transfer {transfer_id!r} retracted")
        except NotFoundError:
            pass  # it already ended: acknowledged, expired or cancelled
        self._producer.poll()

    def abandon(self, transfer_id: str, reason: str) -> None:
        """Give up fetching ``transfer_id`` (ABANDON CONTRACT); a no-op when it is not pending."""
        rid = _request_id(transfer_id)
        with self._lock:
            if rid not in self._pending:
                return

        def run() -> None:
            try:
                self._consumer.abandon(rid, reason)
            except TpusyncError as e:  # ended meanwhile, or a source was slow to stop: logged
                log.debug("abandon of transfer %r: %s", transfer_id, e)

        threading.Thread(target=run, name="tpusync-pd-abandon", daemon=True).start()

    # -- consumer ----------------------------------------------------------------------------
    def fetch(
        self, peer: str, transfer_id: str, pool: HostBlockPool, block_ids: Sequence[int]
    ) -> cf.Future:
        self._check_pool(pool)
        rid = _request_id(transfer_id)
        meta_ids = pool.alloc(self.meta_blocks)
        fut: cf.Future = cf.Future()
        try:
            with self._lock:
                if rid in self._pending:
                    raise InvalidArgumentError(f"transfer {transfer_id!r} is already being fetched")
                self._consumer.start_recv(
                    rid, peer, meta_ids + list(block_ids), deadline=self.recv_deadline
                )
                self._pending[rid] = (fut, meta_ids, f"{transfer_id!r} from {peer}")
                if self._poller is None:
                    self._poller = threading.Thread(
                        target=self._poll_loop, name="tpusync-pd-fetch", daemon=True
                    )
                    self._poller.start()
        except BaseException:
            pool.free(meta_ids)
            raise
        return fut

    def _poll_loop(self) -> None:
        stop = threading.Event()
        while True:
            for r in self._consumer.poll():
                if not (r.done or r.failed):
                    continue
                with self._lock:
                    entry = self._pending.pop(r.request_id, None)
                if entry is None:
                    continue
                fut, meta_ids, what = entry
                # Meta blocks go back to the pool BEFORE the future completes.
                try:
                    meta = self._read_meta(meta_ids, what) if r.done else None
                except BaseException as e:  # noqa: BLE001 - handed to the waiter
                    meta, err = None, e
                else:
                    err = None
                    if not r.done:
                        err = UnavailableError(f"transfer {what} failed ({r.code}): {r.reason}")
                self.pool.free(meta_ids)
                with self._lock:
                    if err is None:
                        self._stats["fetched"] += 1
                        self._stats["fetched_shm"] += int(bool(r.shm))
                        self._stats["fetched_bytes"] += int(r.bytes)
                    else:
                        self._stats["fetch_failed"] += 1
                if err is None:
                    fut.set_result(meta)
                else:
                    fut.set_exception(err)
            with self._lock:
                if not self._pending:
                    self._poller = None
                    return
            stop.wait(_POLL_S)

    def _read_meta(self, meta_ids: list[int], what: str) -> Mapping[str, Any]:
        raw = b"".join(bytes(self.pool.view(b)) for b in meta_ids)
        n = int.from_bytes(raw[4:8], "little")
        if raw[:4] != _MAGIC or n > len(raw) - 8:
            raise InvalidArgumentError(f"transfer {what}: the peer sent no tpusync meta block")
        return json.loads(raw[8 : 8 + n])

    def close(self) -> None:
        """Stop serving (pending sends end as failed); fetches in flight still complete."""
        self._producer.close()

    def __enter__(self) -> PdBlockTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
