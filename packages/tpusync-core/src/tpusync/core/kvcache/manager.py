"""KVCacheManagerBase: the framework-neutral half of tpusync.torch / tpusync.jax KVCacheManager.

A subclass knows its framework's tensors and implements one primitive, ``_transfer`` (gather a
batch of layers' device blocks into host blocks, or scatter them back), returning a
TransferFuture. Everything else lives here once: host block
allocation and the ``[groups, n]`` host-id shape, argument checks, layer-by-layer batching, the
KVStore-backed save/load/lookup and the P/D primitive over an injected BlockTransport.

RANGE CONTRACT: device block ids, host id shapes and counts are checked before any byte moves or
any host block is allocated; a refused call changes nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from tpusync.core.errors import (
    InvalidArgumentError,
    NotFoundError,
    PoolExhaustedError,
    StateError,
)
from tpusync.core.errors import TimeoutError as TpusyncTimeoutError
from tpusync.core.kvcache.futures import (
    LayeredTransfer,
    TransferFuture,
    after,
    default_timeout,
    gather,
    watch,
)
from tpusync.core.kvcache.layout import BlockFormat, KVLayout, check_format
from tpusync.core.kvcache.plan import check_block_ids
from tpusync.core.kvcache.protocols import BlockTransport, KVStore
from tpusync.core.pool import HostBlockPool

__all__ = ["KVCacheManagerBase"]


class KVCacheManagerBase:
    """Shared logic; see tpusync.torch.KVCacheManager / tpusync.jax.KVCacheManager."""

    def __init__(
        self,
        layout: KVLayout,
        num_layers: int,
        fmt: BlockFormat,
        *,
        pool: HostBlockPool | None,
        host_blocks: int | None,
        store: KVStore | None,
        transport: BlockTransport | None,
    ) -> None:
        self.layout = layout
        self.num_layers = num_layers
        self.format = fmt
        if store is not None and not isinstance(store, KVStore):
            raise InvalidArgumentError(f"store {store!r} does not implement the KVStore protocol")
        if transport is not None and not isinstance(transport, BlockTransport):
            raise InvalidArgumentError(
                f"transport {transport!r} does not implement the BlockTransport protocol"
            )
        if pool is None:
            if not host_blocks:
                raise InvalidArgumentError("give a host pool or host_blocks=")
            pool = HostBlockPool(fmt.host_block_bytes, host_blocks)
        if pool.block_bytes != fmt.host_block_bytes:
            raise InvalidArgumentError(
                f"host pool field 'block_bytes' is {pool.block_bytes} but this cache's host "
                f"blocks hold {fmt.host_block_bytes} bytes ({fmt.layers_per_host_block} layer(s) "
                f"x {fmt.layer_block_bytes} bytes)"
            )
        if store is not None and store.block_bytes != fmt.host_block_bytes:
            raise InvalidArgumentError(
                f"store field 'block_bytes' is {store.block_bytes} but this cache's host blocks "
                f"hold {fmt.host_block_bytes} bytes"
            )
        self.pool = pool
        self.store = store
        self.transport = transport
        self._lock = threading.Lock()
        self._sends: dict[str, np.ndarray] = {}
        self._recvs: dict[str, TransferFuture] = {}
        self._key_tag = bytes.fromhex(fmt.fingerprint)
        self._rows_view: np.ndarray | None = None

    # -- host blocks ---------------------------------------------------------------------------
    @property
    def host_block_bytes(self) -> int:
        return self.format.host_block_bytes

    @property
    def num_groups(self) -> int:
        return self.format.num_groups

    def alloc_host(self, n: int) -> np.ndarray:
        """Host blocks for ``n`` device blocks: int array of shape ``[num_groups, n]``."""
        ids = self.pool.alloc(n * self.num_groups)
        return np.asarray(ids, dtype=np.uint64).reshape(self.num_groups, n)

    def free_host(self, host_ids: Any) -> None:
        self.pool.free(np.asarray(host_ids, dtype=np.uint64).reshape(-1).tolist())

    def _host_ids(self, host_ids: Any, n: int) -> np.ndarray:
        raw = np.asarray(host_ids)
        if raw.size and raw.dtype.kind not in "iu":  # a float id was truncated into another block
            raise InvalidArgumentError(f"host ids must be integers, got an array of {raw.dtype}")
        if raw.size and raw.dtype.kind == "i" and int(raw.min()) < 0:
            raise InvalidArgumentError(f"host ids must be >= 0, got {int(raw.min())}")
        arr = raw.astype(np.uint64)
        if arr.ndim == 1 and self.num_groups == 1:
            arr = arr[None, :]
        if arr.shape != (self.num_groups, n):
            raise InvalidArgumentError(
                f"host ids have shape {arr.shape}; expected ({self.num_groups}, {n}): one row per "
                f"group of {self.format.layers_per_host_block} layer(s), one column per device block"
            )
        return arr

    def _checked_host_ids(self, host_ids: Any, n: int, written: bool) -> np.ndarray:
        """:meth:`_host_ids`, and every id refused (one native borrow check, all or none) unless
        it is a live block of the pool: a bulk call moves in several batches, each of which
        borrows only its own rows, so the whole call's ids are checked here before any byte
        moves. Host blocks a call writes (d2h) must also be distinct: two device blocks (or two
        groups) gathered into one host block would race, and one would be lost."""
        arr = self._host_ids(host_ids, n)
        if written:
            values, counts = np.unique(arr, return_counts=True)  # one sort, only for d2h
            if values.size != arr.size:
                raise InvalidArgumentError(
                    f"d2h writes host block {int(values[counts > 1][0])} more than once; each "
                    "(group, device block) needs its own host block (nothing was copied)"
                )
        if arr.size:
            self.pool.borrow(arr.reshape(-1).tolist()).release()
        return arr

    def _batch_ids(self, layers: Sequence[int], host_ids: np.ndarray) -> tuple[list[int], dict]:
        """The host ids one batch of ``layers`` touches - the ``host_ids`` rows of their groups,
        group-major - and each group's row position in that list (a segment of batch position i
        in group g names block ``pos[g] * n + i``). Rejected: passing every row to every batch,
        which made each batch convert and borrow all of the call's ids (num_layers times the
        work on a bulk call with one layer per host block)."""
        groups = sorted({self._where(x)[0] for x in layers})
        return host_ids[groups].reshape(-1).tolist(), {g: k for k, g in enumerate(groups)}

    def _layers(self, layers: Iterable[int] | None) -> list[int]:
        out = list(range(self.num_layers)) if layers is None else list(layers)
        for x in out:
            if isinstance(x, bool) or not isinstance(x, int | np.integer):
                raise InvalidArgumentError(f"layer {x!r} is not an int (int() truncated 0.9 to 0)")
            if not 0 <= x < self.num_layers:
                raise InvalidArgumentError(f"layer {x} out of range (cache has {self.num_layers})")
        return [int(x) for x in out]

    def _where(self, layer: int) -> tuple[int, int]:
        """(group row, byte offset inside the host block) of a layer."""
        per = self.format.layers_per_host_block
        return layer // per, (layer % per) * self.format.layer_block_bytes

    # -- the one primitive a subclass implements ---------------------------------------------
    #: Bulk d2h / h2d put consecutive requested layers into one engine call until it moves at
    #: least this many bytes (fewer, larger batches keep every engine thread busy); 0 = one call
    #: per layer. A layer's future in a LayeredTransfer completes with its batch.
    batch_bytes: int = 32 << 20

    def _transfer(
        self, layers: list[int], blocks: np.ndarray, host_ids: np.ndarray, to_host: bool
    ) -> TransferFuture:
        """Copy ``layers`` between device blocks ``blocks`` and ``host_ids`` ([groups, n], rows
        indexed by :meth:`_where`); arguments are already validated."""
        raise NotImplementedError

    def _batches(self, layers: list[int], n: int) -> list[list[int]]:
        if self.batch_bytes <= 0:
            return [[x] for x in layers]
        per = max(1, n * self.format.layer_block_bytes)
        out, cur = [], []
        for x in layers:
            cur.append(x)
            if len(cur) * per >= self.batch_bytes:
                out.append(cur)
                cur = []
        if cur:
            out.append(cur)
        return out

    # -- device <-> host pool ------------------------------------------------------------------
    def d2h_layer(self, layer: int, device_blocks: Sequence[int], host_ids: Any) -> TransferFuture:
        """Gather ``device_blocks`` of one layer into host blocks (asynchronous)."""
        (layer,) = self._layers([layer])
        blocks = check_block_ids(device_blocks, self.layout.num_blocks, "d2h", unique=False)
        ids = self._checked_host_ids(host_ids, blocks.size, written=True)
        return self._transfer([layer], blocks, ids, True)

    def h2d_layer(self, layer: int, device_blocks: Sequence[int], host_ids: Any) -> TransferFuture:
        """Scatter host blocks into ``device_blocks`` of one layer (asynchronous)."""
        (layer,) = self._layers([layer])
        blocks = check_block_ids(device_blocks, self.layout.num_blocks, "h2d", unique=True)
        ids = self._checked_host_ids(host_ids, blocks.size, written=False)
        return self._transfer([layer], blocks, ids, False)

    def d2h(
        self, device_blocks: Sequence[int], host_ids: Any, layers: Iterable[int] | None = None
    ) -> LayeredTransfer:
        """Gather every (or the given) layer into host blocks; per-layer futures."""
        layers = self._layers(layers)
        blocks = check_block_ids(device_blocks, self.layout.num_blocks, "d2h", unique=False)
        return self._bulk(layers, blocks, self._checked_host_ids(host_ids, blocks.size, True), True)

    def h2d(
        self, device_blocks: Sequence[int], host_ids: Any, layers: Iterable[int] | None = None
    ) -> LayeredTransfer:
        """Scatter host blocks into every (or the given) layer; per-layer futures."""
        layers = self._layers(layers)
        blocks = check_block_ids(device_blocks, self.layout.num_blocks, "h2d", unique=True)
        ids = self._checked_host_ids(host_ids, blocks.size, False)
        return self._bulk(layers, blocks, ids, False)

    def _bulk(
        self, layers: list[int], blocks: np.ndarray, ids: np.ndarray, to_host: bool
    ) -> LayeredTransfer:
        futs: dict[int, TransferFuture] = {}
        batches = []
        for batch in self._batches(layers, blocks.size):
            f = self._transfer(batch, blocks, ids, to_host)
            batches.append(f)
            for x in batch:
                futs[x] = f
        return LayeredTransfer(futs, gather(batches, "d2h" if to_host else "h2d"))

    # -- KVStore-backed save / load ------------------------------------------------------------
    def _need_store(self) -> KVStore:
        if self.store is None:
            raise StateError("this manager has no KVStore (pass store=)")
        return self.store

    def store_keys(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The store keys of ``hashes``, hash-major: ``hash || format fingerprint || group``.

        KEY CONTRACT (see protocols.KVStore): the 8-byte format fingerprint makes a cache of
        another block format miss instead of reading foreign bytes; hashes are 1..54 bytes so a
        key fits the store's 64-byte limit.
        """
        out = []
        for h in hashes:
            if not isinstance(h, bytes | bytearray) or not 1 <= len(h) <= 54:
                raise InvalidArgumentError(
                    f"block hashes are 1..54 bytes (got {type(h).__name__} of "
                    f"{len(h) if isinstance(h, bytes | bytearray) else '?'} bytes)"
                )
            for g in range(self.num_groups):
                out.append(bytes(h) + self._key_tag + g.to_bytes(2, "big"))
        return out

    def _pool_rows(self, ids: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """A [slots, host_block_bytes] view over the whole pool (no copy) and the row of each
        host id in ``ids`` ([groups, n]), hash-major to match :meth:`store_keys`."""
        native = self.pool.native
        stride = native.block_stride  # a pool rounded up to whole pages has spare bytes at its end
        if self._rows_view is None:
            flat = np.ctypeslib.as_array(
                ctypes.cast(native.base_address, ctypes.POINTER(ctypes.c_uint8)),
                shape=(native.pool_bytes,),
            )
            self._rows_view = np.lib.stride_tricks.as_strided(
                flat, shape=(self.pool.num_blocks, self.host_block_bytes), strides=(stride, 1)
            )
        base = native.base_address
        rows = []
        for i in ids.T.reshape(-1).tolist():
            off = self.pool.address(int(i)) - base
            if off % stride:
                raise StateError(f"host block {i} is not on a {stride}-byte slot boundary")
            rows.append(off // stride)
        return self._rows_view, rows

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading ``hashes`` the store holds (every layer group of each)."""
        n, _ = self._need_store().lookup(self.store_keys(list(hashes)))
        return n // self.num_groups

    def save(self, hashes: Sequence[bytes], device_blocks: Sequence[int]) -> LayeredTransfer:
        """Save device blocks under their hashes; the leading run already stored is skipped.

        Device blocks are gathered into staging host blocks (per-layer futures), then copied into
        the store (host DRAM, written down to disk by the store). The overall future fails with
        PoolExhaustedError when the store could not keep every block (full and write-back too
        slow); staging blocks are freed in every case. A key is visible to lookup/load only
        once its bytes are fully in the store (the store's contract).
        """
        store = self._need_store()
        hashes = list(hashes)
        blocks = check_block_ids(device_blocks, self.layout.num_blocks, "save", unique=False)
        if len(hashes) != blocks.size:
            raise InvalidArgumentError(f"{len(hashes)} hashes for {blocks.size} device blocks")
        keys = self.store_keys(hashes)
        skip = store.lookup(keys)[0] // self.num_groups
        if skip == len(hashes):  # everything already stored: nothing to copy
            done = gather([], "save")
            return LayeredTransfer(dict.fromkeys(range(self.num_layers), done), done)
        ids = self.alloc_host(len(hashes) - skip)
        try:
            layered = self.d2h(blocks[skip:], ids)
        except BaseException:
            self.free_host(ids)
            raise
        out = TransferFuture("save")

        # STAGING CONTRACT: staging blocks are freed BEFORE the overall future completes, so a
        # caller woken by it sees them back in the pool.
        def finish(result: Callable[[], Any]) -> None:
            self.free_host(ids)
            out.settle(result)

        def on_gathered(f: cf.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                finish(lambda: f.result(timeout=0))
                return
            try:
                view, rows = self._pool_rows(ids)
                put = store.put(keys[skip * self.num_groups :], view, rows)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                err = e
                finish(lambda: _raise(err))
                return
            put.add_done_callback(lambda g: finish(lambda: _check_flags(g, "save")))

        layered.overall.add_done_callback(on_gathered)
        return LayeredTransfer(layered.layers, out)

    def load(self, hashes: Sequence[bytes], device_blocks: Sequence[int]) -> LayeredTransfer:
        """Load stored blocks into device blocks.

        NotFoundError at once (nothing copied) when the store does not hold every hash; a key
        evicted between that check and the read fails the future with NotFoundError, device
        blocks untouched. Store reads land in staging host blocks (disk hits are promoted by the
        store), then one scatter per layer batch fills the device blocks.
        """
        store = self._need_store()
        hashes = list(hashes)
        blocks = check_block_ids(device_blocks, self.layout.num_blocks, "load", unique=True)
        if len(hashes) != blocks.size:
            raise InvalidArgumentError(f"{len(hashes)} hashes for {blocks.size} device blocks")
        keys = self.store_keys(hashes)
        have = store.lookup(keys)[0] // self.num_groups
        if have < len(hashes):
            raise NotFoundError(
                f"hash {hashes[have].hex()[:16]} (position {have}) is not in the store; "
                f"nothing copied"
            )
        ids = self.alloc_host(len(hashes))
        layers = {x: TransferFuture(f"load layer {x}") for x in range(self.num_layers)}
        out = TransferFuture("load")

        def finish(result: Callable[[], Any]) -> None:  # STAGING CONTRACT as in save
            self.free_host(ids)
            out.settle(result)
            err = out.exception(timeout=0)
            for lf in layers.values():  # a failed read never reached the scatter
                if err is not None:
                    lf.settle(lambda: _raise(err))

        def on_read(g: Any) -> None:
            try:
                _check_flags(g, "load")
                layered = self.h2d(blocks, ids)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                err = e
                finish(lambda: _raise(err))
                return
            for x, f in layered.layers.items():
                f.add_done_callback(lambda h, x=x: layers[x].settle(lambda: h.result(timeout=0)))
            layered.overall.add_done_callback(lambda h: finish(lambda: h.result(timeout=0)))

        try:
            view, rows = self._pool_rows(ids)
            read = store.get(keys, view, rows)
        except BaseException:
            self.free_host(ids)
            raise
        read.add_done_callback(on_read)
        return LayeredTransfer(layers, out)

    # -- P/D over an injected transport --------------------------------------------------------
    def _need_transport(self) -> BlockTransport:
        if self.transport is None:
            raise StateError("this manager has no BlockTransport (pass transport=)")
        return self.transport

    def register_send(self, transfer_id: str, device_blocks: Sequence[int]) -> TransferFuture:
        """Producer side: stage device blocks into host blocks and publish them under
        ``transfer_id``. The future completes once peers can fetch them."""
        transport = self._need_transport()
        blocks = check_block_ids(device_blocks, self.layout.num_blocks, "register_send", False)
        with self._lock:
            if transfer_id in self._sends:
                raise InvalidArgumentError(f"transfer {transfer_id!r} is already registered")
            ids = self.alloc_host(blocks.size)
            self._sends[transfer_id] = ids
        meta = {"format": self.format.to_dict(), "num_blocks": int(blocks.size)}

        def publish(_: Any) -> None:
            transport.publish(transfer_id, self.pool, ids.reshape(-1).tolist(), meta)

        try:
            staged = self.d2h(blocks, ids).overall
        except BaseException:
            self._drop_send(transfer_id)
            raise
        out = after(staged, publish, f"register_send {transfer_id}")
        out.add_done_callback(
            lambda f: None if f.exception() is None else self._drop_send(transfer_id)
        )
        return out

    def _drop_send(self, transfer_id: str) -> None:
        with self._lock:
            ids = self._sends.pop(transfer_id, None)
        if ids is not None:
            self.free_host(ids)

    def finish_send(self, transfer_id: str) -> None:
        """Producer side: the consumer is done (or gave up): retract and free the host blocks."""
        transport = self._need_transport()
        with self._lock:
            if transfer_id not in self._sends:
                raise InvalidArgumentError(f"transfer {transfer_id!r} is not registered")
        transport.retract(transfer_id)
        self._drop_send(transfer_id)

    def start_recv(
        self,
        peer: str,
        transfer_id: str,
        device_blocks: Sequence[int],
        timeout: float | None = None,
    ) -> TransferFuture:
        """Consumer side: fetch ``transfer_id`` from ``peer`` into host blocks, check its format,
        then scatter into ``device_blocks``.

        The future fails with the transport's error (UnavailableError for a dead peer), with
        InvalidArgumentError naming the field on a format mismatch (device blocks untouched), or
        with TimeoutError once ``timeout`` (default TPUSYNC_DEFAULT_TIMEOUT_S) passes.
        """
        transport = self._need_transport()
        blocks = check_block_ids(device_blocks, self.layout.num_blocks, "start_recv", True)
        with self._lock:
            if transfer_id in self._recvs:
                raise InvalidArgumentError(f"transfer {transfer_id!r} is already being received")
        ids = self.alloc_host(blocks.size)
        try:
            fetched = transport.fetch(peer, transfer_id, self.pool, ids.reshape(-1).tolist())
        except BaseException:
            self.free_host(ids)
            raise

        # HOST-BLOCK CONTRACT: the staging blocks are freed only once the transport's own future
        # is complete, even when our deadline fired first (it may still be writing into them);
        # when it is, they are freed BEFORE the returned future completes.
        out = TransferFuture(f"start_recv {transfer_id}")

        def finish(f: cf.Future) -> None:
            if fetched.done():
                self.free_host(ids)
            else:
                fetched.add_done_callback(lambda _g: self.free_host(ids))
            out.settle(lambda: f.result(timeout=0))

        limit = default_timeout() if timeout is None else timeout
        bounded = TransferFuture(f"fetch {transfer_id} from {peer}")
        fetched.add_done_callback(lambda g: bounded.settle(lambda: g.result(timeout=0)))

        def expired() -> None:
            bounded.settle(lambda: _timeout(transfer_id, peer, limit))
            abandon = getattr(transport, "abandon", None)  # optional (pd_transport ABANDON)
            if abandon is not None and not fetched.done():
                abandon(transfer_id, f"start_recv gave up after {limit} s")

        watch(bounded.done, expired, time.monotonic() + limit)

        def scatter(meta: Any) -> Any:
            check_format(self.format, meta.get("format", {}), f"peer {peer}")
            if int(meta.get("num_blocks", -1)) != blocks.size:
                raise InvalidArgumentError(
                    f"peer {peer} sent {meta.get('num_blocks')} blocks for {blocks.size} device "
                    f"blocks (field 'num_blocks')"
                )
            return self.h2d(blocks, ids).overall

        after(bounded, scatter, f"start_recv {transfer_id}", cleanup=None).add_done_callback(finish)
        with self._lock:
            self._recvs[transfer_id] = out
        return out

    def poll(self) -> dict[str, Any]:
        """Finished receives since the last poll: ``{"done": [...ids], "failed": {id: error}}``."""
        done, bad = [], {}
        with self._lock:
            for tid, f in list(self._recvs.items()):
                if f.done():
                    del self._recvs[tid]
                    err = f.exception(timeout=0) if not f.cancelled() else StateError("cancelled")
                    if err is None:
                        done.append(tid)
                    else:
                        bad[tid] = err
        return {"done": done, "failed": bad}


def _check_flags(fut: Any, what: str) -> None:
    """Raise unless every key of a completed store future was stored / found."""
    flags = fut.result(timeout=0)
    missing = len(flags) - sum(bool(x) for x in flags)
    if missing and what == "load":
        raise NotFoundError(f"{missing} of {len(flags)} blocks left the store before the read")
    if missing:
        raise PoolExhaustedError(
            f"the store kept {len(flags) - missing} of {len(flags)} blocks (full, write-back too "
            f"slow)"
        )


def _raise(err: BaseException) -> Any:
    raise err


def _timeout(transfer_id: str, peer: str, limit: float) -> Any:
    raise TpusyncTimeoutError(
        f"transfer {transfer_id!r} from peer {peer} not received after {limit} s"
    )
