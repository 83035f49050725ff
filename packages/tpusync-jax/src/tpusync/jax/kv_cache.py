"""tpusync.jax.KVCacheManager: device <-> host block transfers over a paged JAX KV cache.

The manager OWNS the cache arrays: callers must not keep other references to them (or to
numpy arrays they alias). On CPU devices a load writes the loaded blocks into the arrays' buffers
in place (native segment scatter through DLPack); on other devices, or with ``staged=True``, it
produces new arrays (a jitted scatter with the old buffer donated, so XLA updates it in place
where the backend can). Either way :attr:`kv_caches` holds the current arrays after a load's
future completes: read them from there.

Sharded arrays: each addressable shard is a piece of the layer; the host block holds the shards
in ascending shard-index order (replicas saved once, loaded into every replica). The shard
layout is part of the BlockFormat (field 'shards'). Sharding the block axis itself is refused.

Paths: on CPU devices the shards are read zero-copy through DLPack and gathered by the native
segment copy; on other devices (GPU, TPU) blocks are gathered on device with a jitted ``take``
and moved to / from the host (``staged=True`` forces that path on CPU) through the device's
``pinned_host`` memory kind where it has one, else through pageable numpy buffers
(``host_memory``, see KVCacheManager).
A PjRt path that DMAs straight between device buffers and pinned pool blocks is described in
docs/jax.md; it would replace ``_stage_*`` without changing this class's API.

Every operation runs on one manager-owned worker thread in submission order (so a load queued
after a save of the same layer sees it), and returns a TransferFuture at once. On the CPU path
the worker prepares the next operation while the engine still copies the current one (ORDER
CONTRACT in ``_launch``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from tpusync.core import InvalidArgumentError, _native
from tpusync.core.errors import StateError
from tpusync.core.errors import TimeoutError as TpusyncTimeoutError
from tpusync.core.kvcache.futures import TransferFuture, default_timeout, watch
from tpusync.core.kvcache.layout import (
    BlockFormat,
    KVLayout,
    PieceGeometry,
    check_unshared,
    split_layers,
)
from tpusync.core.kvcache.manager import KVCacheManagerBase
from tpusync.core.kvcache.plan import Piece, segments_for
from tpusync.core.kvcache.protocols import BlockTransport, KVStore
from tpusync.core.pool import HostBlockPool
from tpusync.core.procmaps import check_writable

__all__ = ["KVCacheManager"]

LayerArrays = jax.Array | Sequence[jax.Array]


def _c_geometry(shape: Sequence[int], itemsize: int, block_axis: int, axes) -> PieceGeometry:
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= int(n)
    return PieceGeometry.of(shape, list(reversed(strides)), itemsize, block_axis, axes)


def _has_pinned(dev) -> bool:
    try:
        return any(m.kind == "pinned_host" for m in dev.addressable_memories())
    except Exception:  # noqa: BLE001 - backends without memory kinds
        return False


@functools.lru_cache(maxsize=64)
def _pinned_zeros_fn(shape: tuple[int, ...], dtype, dev):
    return jax.jit(
        lambda: jnp.zeros(shape, dtype),
        out_shardings=SingleDeviceSharding(dev, memory_kind="pinned_host"),
    )


def _pinned_zeros(shape: tuple[int, ...], dtype, dev) -> jax.Array:
    """A new zero-filled array in ``dev``'s pinned host memory (one compile per shape)."""
    return _pinned_zeros_fn(shape, np.dtype(dtype), dev)()


def _shard_key(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s.indices(n)[0] for s, n in zip(index, shape, strict=True))


@functools.partial(jax.jit, static_argnums=(2,))
def _take(x: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    return jnp.take(x, idx, axis=axis)


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _put(x: jax.Array, idx: jax.Array, vals: jax.Array, axis: int) -> jax.Array:
    """Scatter ``vals`` into blocks ``idx``; out-of-range ids (the padding) are dropped."""
    where = (slice(None),) * axis + (idx,)
    return x.at[where].set(vals, mode="drop")


def _bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _padded(blocks: np.ndarray) -> np.ndarray:
    """Block ids padded to a power-of-two count by repeating the last one, so the jitted
    take / scatter compile once per size bucket instead of once per batch size (repeating an
    index with its own value is idempotent)."""
    out = np.empty(_bucket(blocks.size), np.int32)
    out[: blocks.size] = blocks
    out[blocks.size :] = blocks[-1]
    return out


def _padded_drop(blocks: np.ndarray, num_blocks: int) -> np.ndarray:
    """Block ids padded to a power-of-two count with an out-of-range id, which the scatter
    drops: the padding rows of a staging buffer are never written to the cache."""
    out = np.full(_bucket(blocks.size), num_blocks, np.int32)
    out[: blocks.size] = blocks
    return out


_PREV_WAIT_S = 300.0  # bound on the wait for the previous copy (a copy never blocks on a peer)


class _Chained(TransferFuture):
    """A worker job's future, then (when the job returned one) its native copy's.

    Waiters wait on the native future directly (GIL released, no polling latency); callbacks
    (LayeredTransfer's gather) fire from the watcher thread once the copy is done."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._native: Any = None
        self._inner: cf.Future | None = None  # the worker job (set by _submit)

    def chain(self, job: cf.Future) -> None:
        err = job.exception()
        if err is not None:
            with contextlib.suppress(cf.InvalidStateError):
                self.set_exception(err)
            return
        nf = job.result()
        if nf is None:
            self.settle(lambda: None)
            return
        self.keepalive.append(nf)
        self._native = nf
        watch(nf.done, self._settle_native)

    def _settle_native(self) -> None:
        nf = self._native
        self.settle(lambda: (nf.result(timeout=0), None)[1])

    def result(self, timeout: float | None = None) -> Any:
        t = default_timeout() if timeout is None else timeout
        t0 = time.monotonic()
        inner = self._inner
        if inner is not None and not cf.Future.done(self):
            # The job's own value, not self._native: chain() may not have run yet when the
            # inner future reads done (concurrent.futures wakes waiters before callbacks).
            cf.wait([inner], timeout=t)
            ok = inner.done() and not inner.cancelled() and inner.exception(0) is None
            nf = inner.result(timeout=0) if ok else None
            if nf is not None and nf.wait(max(0.0, t - (time.monotonic() - t0))):
                self.settle(lambda: (nf.result(timeout=0), None)[1])
        left = max(0.0, t - (time.monotonic() - t0))  # one budget for both waits, not two
        return super().result(timeout=0 if cf.Future.done(self) else left)


class _Part:
    """One array of a layer: its unique shards (primary per index) and their geometry."""

    def __init__(self, arr: jax.Array, layout: KVLayout) -> None:
        ax = layout.block_axis
        shards = sorted(arr.addressable_shards, key=lambda s: _shard_key(s.index, arr.shape))
        self.keys = []
        self.primaries = []  # first shard of each distinct index
        for s in shards:
            k = _shard_key(s.index, arr.shape)
            if s.index[ax].indices(arr.shape[ax]) != (0, arr.shape[ax], 1):
                raise InvalidArgumentError(
                    f"the block axis is sharded ({s.index}); shard the heads axis instead"
                )
            if k not in self.keys:
                self.keys.append(k)
                self.primaries.append(s)
        local = self.primaries[0].data.shape
        self.geometry = _c_geometry(local, arr.dtype.itemsize, ax, layout.axes)
        self.shard_desc = [
            "x".join(str(n) for n in s.data.shape) + "@" + ",".join(map(str, k))
            for s, k in zip(self.primaries, self.keys, strict=True)
        ]


class KVCacheManager(KVCacheManagerBase):
    """Moves blocks of a paged KV cache between JAX arrays (optionally sharded) and host blocks.

    Arguments as for :class:`tpusync.torch.KVCacheManager`; ``staged`` forces the device-side
    gather + device_get / device_put path even on CPU devices.

    ``host_memory`` (staged path only): where the gathered blocks land on the host side.
    ``"pinned_host"`` moves them through JAX's pinned-host memory kind (page-locked, so the
    backend can DMA at full speed instead of bouncing through its own staging buffer);
    ``"unpinned"`` uses plain ``copy_to_host_async`` / ``device_put`` of numpy arrays;
    ``"auto"`` (default) takes ``"pinned_host"`` when every device offers that memory kind
    and falls back to ``"unpinned"`` for good (see :attr:`host_memory`) the first time a pinned
    transfer raises. Asking for ``"pinned_host"`` on devices without it is refused.
    """

    def __init__(
        self,
        kv_caches: Sequence[LayerArrays] | Mapping[str, LayerArrays],
        layout: KVLayout,
        *,
        pool: HostBlockPool | None = None,
        host_blocks: int | None = None,
        layers_per_host_block: int = 1,
        store: KVStore | None = None,
        transport: BlockTransport | None = None,
        staged: bool | None = None,
        host_memory: str = "auto",
    ) -> None:
        if host_memory not in ("auto", "pinned_host", "unpinned"):
            raise InvalidArgumentError(
                f"host_memory must be 'auto', 'pinned_host' or 'unpinned', got {host_memory!r}"
            )
        self.layer_names, self._arrays = split_layers(
            kv_caches, layout, lambda e: isinstance(e, jax.Array), "array"
        )
        entries = self._arrays
        self._parts = [[_Part(a, layout) for a in parts] for parts in self._arrays]
        shard_descs = {tuple(d for p in parts for d in p.shard_desc) for parts in self._parts}
        orders = {tuple(p.geometry.memory_order for p in parts) for parts in self._parts}
        if len(shard_descs) != 1 or len(orders) != 1:
            raise InvalidArgumentError("layers differ in sharding (field 'shards')")
        shards = shard_descs.pop() if any(len(p.keys) > 1 for p in self._parts[0]) else ()
        fmt = BlockFormat.of_layout(
            layout, orders.pop(), len(entries), layers_per_host_block, shards
        )
        super().__init__(
            layout,
            len(entries),
            fmt,
            pool=pool,
            host_blocks=host_blocks,
            store=store,
            transport=transport,
        )
        platforms = {d.platform for parts in self._arrays for a in parts for d in a.devices()}
        self.staged = bool(staged) if staged is not None else platforms != {"cpu"}
        if not self.staged:  # loads write these buffers in place (IN-PLACE CONTRACT)
            check_unshared(
                [
                    (s.data.unsafe_buffer_pointer(), f"layer {name} part {k} shard {s.index}")
                    for name, parts in zip(self.layer_names, self._arrays, strict=True)
                    for k, arr in enumerate(parts)
                    for s in arr.addressable_shards
                ]
            )
        devices = {d for parts in self._arrays for a in parts for d in a.devices()}
        offered = all(_has_pinned(d) for d in devices)
        if host_memory == "pinned_host" and not offered:
            raise InvalidArgumentError(
                "host_memory='pinned_host': the devices "
                f"{sorted({d.platform for d in devices})} offer no 'pinned_host' memory kind"
            )
        self._pinned_auto = host_memory == "auto"
        #: The host side of the staged path in use: "pinned_host" or "unpinned".
        self.host_memory = "pinned_host" if host_memory != "unpinned" and offered else "unpinned"
        self._pieces: list[list[Piece]] = []  # per layer: one piece per (part, shard)
        for parts in self._parts:
            off, pieces = 0, []
            for p in parts:
                for _ in p.primaries:
                    pieces.append(Piece(len(pieces), p.geometry, off))
                    off += p.geometry.block_bytes
            self._pieces.append(pieces)
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="tpusync-jax-kv")
        # Native copies started and maybe running, with their request's token (worker only).
        self._inflight: list[tuple[object, Any]] = []
        self._job_token: object = None  # the running job's request token (worker only)
        self._request = threading.local()
        self._writable_checked = False  # WRITABLE MEMORY CHECK at the first in-place load

    @property
    def kv_caches(self) -> list[list[jax.Array]]:
        """Current cache arrays, per layer (replaced by every load)."""
        return self._arrays

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        for _, nf in self._inflight:
            nf.wait(_PREV_WAIT_S)

    def _submit(self, name: str, fn) -> TransferFuture:
        """Run ``fn`` on the worker; the future completes when ``fn`` has and, if ``fn`` returned
        a native copy future (CPU path, see :meth:`_launch`), when that copy has too."""
        out = _Chained(name)
        try:
            inner = self._worker.submit(fn)
        except RuntimeError as e:  # the executor's "cannot schedule new futures after shutdown"
            raise StateError(f"{name}: this KVCacheManager is closed") from e
        out._inner = inner
        out.keepalive.append(inner)
        inner.add_done_callback(out.chain)
        return out

    def _launch(self, call, ids: list[int], regions: list, segs: np.ndarray) -> Any:
        """Start one native segment copy and return its future without waiting for it.

        ORDER CONTRACT: operations keep submission order (a load queued after a save of the same
        blocks sees the save). Copies of one request (the batches of one d2h / h2d call: distinct
        layers, so disjoint cache bytes and disjoint host-block bytes) are queued on the engine
        back to back; a copy of a later request starts only once every copy of earlier requests
        is done. The worker prepares the next batch (shards, segment plan) while the engine still
        copies. Rejected alternative: waiting for each copy inside the worker before preparing
        the next, which left the engine idle for every batch's Python preparation and thread
        hand-off (the CPU bench read 0.71-0.77x of memcpy on a quiet machine)."""
        token = self._job_token
        live = []
        for tok, prev in self._inflight:
            if tok is not token:
                prev.wait(_PREV_WAIT_S)  # its own error belongs to its own future
                if not prev.done():
                    raise TpusyncTimeoutError(
                        f"previous copy still running after {_PREV_WAIT_S} s; nothing was copied"
                    )
            elif not prev.done():
                live.append((tok, prev))
        nf = call(self.pool.engine, self.pool.native, ids, regions, segs)
        live.append((token, nf))
        self._inflight = live
        return nf

    def _bulk(self, layers, blocks, ids, to_host):
        self._request.token = object()  # one token for every batch of this call (see _launch)
        try:
            return super()._bulk(layers, blocks, ids, to_host)
        finally:
            self._request.token = None

    # -- the transfer primitive ---------------------------------------------------------------
    def _transfer(self, layers, blocks, host_ids, to_host) -> TransferFuture:
        # Unknown / stale / freed host ids were refused for the whole call before any byte
        # moves (KVCacheManagerBase._checked_host_ids).
        if not to_host and not self.staged and not self._writable_checked:
            # An aligned numpy array jax.device_put on CPU is aliased, not copied, even over a
            # read-only mapping (np.load(path, mmap_mode="r")): an in-place load would crash.
            check_writable(
                [
                    (s.data.unsafe_buffer_pointer(), s.data.nbytes, f"layer {n} part {k}")
                    for n, parts in zip(self.layer_names, self._arrays, strict=True)
                    for k, arr in enumerate(parts)
                    for s in arr.addressable_shards
                ],
                "a load (h2d)",
            )
            self._writable_checked = True
        name = f"{'d2h' if to_host else 'h2d'} layers {layers[0]}..{layers[-1]}"
        job = self._d2h_now if to_host else self._h2d_now
        token = getattr(self._request, "token", None) or object()

        def run():
            self._job_token = token
            return job(layers, blocks, host_ids)

        return self._submit(name, run)

    def _segments(self, layers, blocks, host_ids, piece_for, staged_rows: bool):
        """Regions and segment rows of one native call over ``layers``; ``piece_for(layer, k,
        piece)`` returns (region array, Piece geometry to use) for piece k of a layer."""
        n = int(blocks.size)
        _, pos = self._batch_ids(layers, host_ids)
        regions, segs = [], []
        for layer in layers:
            g, off = self._where(layer)
            pieces = []
            for k, piece in enumerate(self._pieces[layer]):
                region, geom = piece_for(layer, k, piece)
                pieces.append(Piece(len(regions), geom, piece.host_offset))
                regions.append(region)
            rows = segments_for(np.arange(n) if staged_rows else blocks, pieces, off)
            rows[:, 0] += np.uint64(pos[g] * n)
            segs.append(rows)
        return regions, np.ascontiguousarray(np.concatenate(segs))

    # -- save: device -> host ------------------------------------------------------------------
    def _d2h_now(self, layers: list[int], blocks: np.ndarray, host_ids: np.ndarray) -> Any:
        if blocks.size == 0:
            return None  # nothing to move (the staged path's padding needs one block)
        ax = self.layout.block_axis
        shards_of = {}
        for layer in layers:
            keyed = []
            for arr, part in zip(self._arrays[layer], self._parts[layer], strict=True):
                by_key = {_shard_key(s.index, arr.shape): s.data for s in arr.addressable_shards}
                keyed.extend(by_key[k] for k in part.keys)
            shards_of[layer] = keyed

        taken: dict[tuple[int, int], jax.Array] = {}
        if self.staged:
            # Every layer's device gather is dispatched and its device -> host copy started
            # before the first is waited on, so transfers overlap each other and the gathers.
            idx_on: dict = {}
            for layer in layers:
                for k, data in enumerate(shards_of[layer]):
                    dev = next(iter(data.devices()))
                    if dev not in idx_on:
                        idx_on[dev] = jax.device_put(_padded(blocks), dev)
                    taken[(layer, k)] = self._to_host(_take(data, idx_on[dev], ax), dev)

        def piece_for(layer, k, piece):
            if self.staged:
                # The padded gather as is: rows >= blocks.size (padding) are never read.
                host = self._host_view(taken.pop((layer, k)))
                geom = _c_geometry(host.shape, host.itemsize, ax, self.layout.axes)
                return host.reshape(-1).view(np.uint8), geom
            # Zero-copy: the native binding imports the shard through DLPack (any dtype,
            # bfloat16 included) and keeps it alive until the copy is done.
            data = shards_of[layer][k]
            data.block_until_ready()
            return data, piece.geometry

        regions, segs = self._segments(layers, blocks, host_ids, piece_for, self.staged)
        ids = self._batch_ids(layers, host_ids)[0]
        return self._launch(_native.put_segments, ids, regions, segs)

    # -- load: host -> device ------------------------------------------------------------------
    def _h2d_now(self, layers: list[int], blocks: np.ndarray, host_ids: np.ndarray) -> Any:
        if blocks.size == 0:
            return None
        if not self.staged:
            return self._h2d_in_place(layers, blocks, host_ids)
        ax = self.layout.block_axis
        n = int(blocks.size)
        ids = self._batch_ids(layers, host_ids)[0]
        while True:
            pinned = self.host_memory == "pinned_host"
            staging: dict[tuple[int, int], np.ndarray | jax.Array] = {}

            def piece_for(layer, k, piece, pinned=pinned, staging=staging):
                arr_i, part, j = self._part_of(layer, k)
                local = list(part.primaries[0].data.shape)
                local[ax] = _bucket(n)  # padding rows are dropped by the scatter (_padded_drop)
                dtype = self._arrays[layer][arr_i].dtype
                geom = _c_geometry(local, dtype.itemsize, ax, self.layout.axes)
                if pinned:
                    # The engine scatters straight into a fresh pinned-host array (DLPack,
                    # GIL released); nothing else holds it until it is moved to the device.
                    buf = _pinned_zeros(tuple(local), dtype, part.primaries[j].device)
                    staging[(layer, k)] = buf
                    return buf, geom
                buf = np.empty(local, dtype=dtype)
                staging[(layer, k)] = buf
                return buf.reshape(-1).view(np.uint8), geom

            if not pinned:
                regions, segs = self._segments(layers, blocks, host_ids, piece_for, True)
                self._launch(_native.get_segments, ids, regions, segs).result()
                break
            try:
                regions, segs = self._segments(layers, blocks, host_ids, piece_for, True)
                self._launch(_native.get_segments, ids, regions, segs).result()
                break
            except Exception as e:  # noqa: BLE001 - e.g. DLPack refusing pinned memory as CPU
                # Only staging buffers were written: retrying unpinned reports a real error
                # (bad ids, freed blocks) again, by itself.
                self._pinned_failed(e)
        idx_on: dict = {}
        for layer in layers:
            new_parts, k = [], 0
            for arr, part in zip(self._arrays[layer], self._parts[layer], strict=True):
                by_key = {key: staging[(layer, k + j)] for j, key in enumerate(part.keys)}
                k += len(part.keys)
                singles = []
                for s in arr.addressable_shards:
                    vals = self._from_host(by_key[_shard_key(s.index, arr.shape)], s.device)
                    if s.device not in idx_on:
                        size = s.data.shape[ax]
                        idx_on[s.device] = jax.device_put(_padded_drop(blocks, size), s.device)
                    singles.append(_put(s.data, idx_on[s.device], vals, ax))
                if len(singles) == 1 and not isinstance(arr.sharding, jax.sharding.NamedSharding):
                    new = singles[0]
                else:
                    new = jax.make_array_from_single_device_arrays(arr.shape, arr.sharding, singles)
                new_parts.append(new)
            self._arrays[layer] = new_parts

    def _h2d_in_place(self, layers: list[int], blocks: np.ndarray, host_ids: np.ndarray) -> Any:
        """CPU devices: scatter straight into every shard's buffer (replicas included) with one
        native segment call - the same bytes a donated jitted scatter would produce, without
        XLA's element-wise scatter loop or a staging copy.

        IN-PLACE CONTRACT: the manager owns the cache buffers (see the module docstring); the
        blocks being loaded must not be read by a computation still running, exactly as on the
        torch CUDA path where the copy stream writes blocks while compute runs."""
        n = int(blocks.size)
        ids, pos = self._batch_ids(layers, host_ids)
        regions, segs = [], []
        for layer in layers:
            g, off = self._where(layer)
            pieces = []
            k0 = 0
            for arr, part in zip(self._arrays[layer], self._parts[layer], strict=True):
                for s in arr.addressable_shards:
                    k = k0 + part.keys.index(_shard_key(s.index, arr.shape))
                    piece = self._pieces[layer][k]
                    s.data.block_until_ready()
                    pieces.append(Piece(len(regions), piece.geometry, piece.host_offset))
                    regions.append(s.data)
                k0 += len(part.keys)
            rows = segments_for(blocks, pieces, off)
            rows[:, 0] += np.uint64(pos[g] * n)
            segs.append(rows)
        segs_all = np.ascontiguousarray(np.concatenate(segs))
        return self._launch(_native.get_segments, ids, regions, segs_all)

    # -- staged path: the host side --------------------------------------------------------------
    def _pinned_failed(self, err: Exception) -> None:
        """``auto``: a pinned transfer raised; use unpinned transfers from now on."""
        if not self._pinned_auto:
            raise err
        self.host_memory = "unpinned"

    def _to_host(self, t: jax.Array, dev) -> jax.Array:
        """Start moving a gathered device array to the host (asynchronous).

        PINNED CONTRACT: with ``pinned_host`` the result is a new JAX array in the device's
        page-locked host memory (a DMA the backend runs without a bounce buffer); it is only read
        (DLPack / numpy view) and dropped once the native copy into the pool is done."""
        if self.host_memory == "pinned_host":
            try:
                return jax.device_put(t, SingleDeviceSharding(dev, memory_kind="pinned_host"))
            except Exception as e:  # noqa: BLE001 - backend without a working pinned kind
                self._pinned_failed(e)
        t.copy_to_host_async()
        return t

    @staticmethod
    def _host_view(h: jax.Array) -> np.ndarray:
        """A host-resident (or being copied to host) array as numpy: zero-copy through DLPack where the backend exports host memory as CPU memory, else the
        backend's own device_get."""
        h.block_until_ready()
        try:
            host = np.from_dlpack(h)
        except Exception:  # noqa: BLE001 - device memory, or a DLPack device numpy rejects
            host = np.asarray(h)
        return host

    @staticmethod
    def _from_host(buf: np.ndarray | jax.Array, dev) -> jax.Array:
        """A device array holding ``buf`` (asynchronous device_put): from a pinned-host staging
        array a DMA, from numpy the backend's pageable path."""
        if isinstance(buf, jax.Array):
            return jax.device_put(buf, SingleDeviceSharding(dev, memory_kind="device"))
        return jax.device_put(buf, dev)

    def _part_of(self, layer: int, k: int) -> tuple[int, _Part, int]:
        """(array index, part, shard index in the part) of piece k of a layer."""
        for i, part in enumerate(self._parts[layer]):
            if k < len(part.keys):
                return i, part, k
            k -= len(part.keys)
        raise IndexError(k)
