"""tpusync.torch.KVCacheManager: device <-> host block transfers over a paged torch KV cache.

CPU tensors: one native segment gather/scatter per layer on the engine's threads (GIL released),
straight between the cache's strided memory and host pool blocks: no staging copy. ORDER
CONTRACT (CPU): operations run concurrently on the engine's threads, in no guaranteed order; a
caller that saves and then loads (or loads and then saves) the same device or host blocks waits
for the first operation's future before issuing the second. Rejected: serialising every CPU
operation behind the previous one (independent saves and loads would lose the engine's overlap).
CUDA operations, by contrast, keep submission order (STREAM CONTRACT below).

CUDA tensors: STREAM CONTRACT - every copy runs on the manager's own copy stream. A copy first
makes the copy stream wait for an event recorded on the caller's current stream (GPU-side; the
host never blocks and the compute stream never waits for the copy), gathers the blocks with
``index_select`` into a staging buffer and DMAs it into the host pool, which is registered as
pinned memory (cudaHostRegister). Loads DMA into staging and ``index_copy_`` into the cache.
Completion is a CUDA event: the future completes when it has fired, and :meth:`wait_layer`
makes the compute stream wait for a layer's load without blocking the host.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import torch
from tpusync.core import InvalidArgumentError, StateError, _native
from tpusync.core.kvcache.futures import (
    TransferFuture,
    default_timeout,
    from_native,
    watch,
)
from tpusync.core.kvcache.layout import BlockFormat, KVLayout, check_unshared, split_layers
from tpusync.core.kvcache.manager import KVCacheManagerBase
from tpusync.core.kvcache.plan import Piece, segments_for
from tpusync.core.kvcache.protocols import BlockTransport, KVStore
from tpusync.core.pool import HostBlockPool
from tpusync.core.procmaps import check_writable
from tpusync.torch import _regions as R

__all__ = ["KVCacheManager"]

LayerTensors = torch.Tensor | Sequence[torch.Tensor]


class KVCacheManager(KVCacheManagerBase):
    """Moves blocks of a paged KV cache between torch tensors and host pool blocks.

    ``kv_caches``: one entry per layer (a list, or a mapping layer name -> entry in layer order);
    an entry is one tensor, or a (K, V) pair when ``layout.kv == "separate"``. Every tensor must
    match ``layout`` (shape, dtype) and live on one device; any strides are accepted.

    ``layers_per_host_block``: layers packed into one host block (1 = one host block per layer
    and device block; ``num_layers`` = one host block holds a device block's KV for all layers).

    Host (staging) blocks come from ``pool`` (``block_bytes`` must equal
    :attr:`host_block_bytes`) or from a new pool of ``host_blocks`` blocks. ``store``: the tiered
    :class:`tpusync.core.KVStore` (``block_bytes`` = :attr:`host_block_bytes`); ``transport``: a
    :class:`~tpusync.core.kvcache.PdBlockTransport` over the same pool.
    """

    def __init__(
        self,
        kv_caches: Sequence[LayerTensors] | Mapping[str, LayerTensors],
        layout: KVLayout,
        *,
        pool: HostBlockPool | None = None,
        host_blocks: int | None = None,
        layers_per_host_block: int = 1,
        store: KVStore | None = None,
        transport: BlockTransport | None = None,
    ) -> None:
        self.layer_names, self._parts = split_layers(
            kv_caches, layout, lambda e: isinstance(e, torch.Tensor), "tensor"
        )
        entries = self._parts
        check_unshared(
            [
                (p.data_ptr(), f"layer {name} part {k}")
                for name, parts in zip(self.layer_names, self._parts, strict=True)
                for k, p in enumerate(parts)
            ]
        )
        devices = {p.device for parts in self._parts for p in parts}
        if len(devices) != 1:
            raise InvalidArgumentError(
                f"KV tensors live on several devices: {sorted(map(str, devices))}"
            )
        self.device = devices.pop()
        ax = layout.block_axis
        self._geoms = [[R.geometry(p, ax, layout.axes) for p in parts] for parts in self._parts]
        orders = {tuple(g.memory_order for g in gs) for gs in self._geoms}
        if len(orders) != 1:
            raise InvalidArgumentError("layers differ in memory order (field 'memory_order')")
        fmt = BlockFormat.of_layout(layout, orders.pop(), len(entries), layers_per_host_block)
        super().__init__(
            layout,
            len(entries),
            fmt,
            pool=pool,
            host_blocks=host_blocks,
            store=store,
            transport=transport,
        )
        self._pieces: list[list[Piece]] = []
        for gs in self._geoms:
            off, pieces = 0, []
            for k, g in enumerate(gs):
                pieces.append(Piece(k, g, off))
                off += g.block_bytes
            self._pieces.append(pieces)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self.batch_bytes = 0  # events give per-layer completion for free
            # Two streams so that layer i+1's gather / scatter kernels overlap layer i's DMA:
            # kernels run on _kernel_stream, DMAs on _stream, ordered per layer by events.
            self._stream = torch.cuda.Stream(device=self.device)
            self._kernel_stream = torch.cuda.Stream(device=self.device)
            self._pool_u8 = R.pin_pool(self.pool)
            # Unpinned at close() or when the manager is collected, whichever comes first.
            self._unpin = weakref.finalize(self, R.unpin_pool, self.pool)
            self._load_events: dict[int, torch.cuda.Event] = {}
        else:
            if self.device.type != "cpu":
                raise InvalidArgumentError(f"device {self.device} is not supported (cpu, cuda)")
            self._regions = [
                [R.byte_region(p, g) for p, g in zip(parts, gs, strict=True)]
                for parts, gs in zip(self._parts, self._geoms, strict=True)
            ]
            # Checked at the first load, so a save-only manager may sit on read-only memory.
            self._writable_checked = False

    @property
    def kv_caches(self) -> list[list[torch.Tensor]]:
        return self._parts

    def close(self) -> None:
        """Release the CUDA pinning of the host pool (no-op on CPU)."""
        if self._cuda and self._pool_u8 is not None:
            self._stream.synchronize()
            self._kernel_stream.synchronize()
            self._unpin()
            self._pool_u8 = None

    # -- the transfer primitive ---------------------------------------------------------------
    def _transfer(self, layers, blocks, host_ids, to_host) -> TransferFuture:
        if self._cuda:
            futs = []
            for layer in layers:
                g, off = self._where(layer)
                ids = host_ids[g].tolist()
                futs.append(
                    (self._cuda_d2h if to_host else self._cuda_h2d)(layer, blocks, ids, off)
                )
            if len(futs) == 1:
                return futs[0]
            # One stream, in order: a batch is complete when its last layer's event has fired.
            return _CudaEventFuture("cuda batch", futs[-1].event, futs)
        return self._cpu_transfer(layers, blocks, host_ids, to_host)

    def _cpu_transfer(self, layers, blocks, host_ids, to_host) -> TransferFuture:
        """One native segment call for the whole batch of layers (engine threads, GIL released).

        The call's id list is the rows of ``host_ids`` of the batch's groups (group-major, see
        ``_batch_ids``); a layer's segments point at its group's row and at its byte offset
        inside those host blocks.
        """
        if not to_host and not self._writable_checked:
            check_writable(
                [
                    (r.data_ptr(), r.numel(), f"layer {name} part {k}")
                    for name, rs in zip(self.layer_names, self._regions, strict=True)
                    for k, r in enumerate(rs)
                ],
                "a load (h2d)",
            )
            self._writable_checked = True
        n = int(blocks.size)
        ids, pos = self._batch_ids(layers, host_ids)
        regions: list[torch.Tensor] = []
        segs = []
        for layer in layers:
            g, off = self._where(layer)
            base = len(regions)
            regions.extend(self._live_regions(layer))
            pieces = [
                Piece(base + p.region, p.geometry, p.host_offset) for p in self._pieces[layer]
            ]
            rows = segments_for(blocks, pieces, off)
            rows[:, 0] += np.uint64(pos[g] * n)
            segs.append(rows)
        call = _native.put_segments if to_host else _native.get_segments
        nf = call(
            self.pool.engine,
            self.pool.native,
            ids,
            regions,
            np.ascontiguousarray(np.concatenate(segs)),
        )
        return from_native(nf, f"{'d2h' if to_host else 'h2d'} layers {layers[0]}..{layers[-1]}")

    def _live_regions(self, layer: int) -> list[torch.Tensor]:
        """The byte regions of ``layer``, refused when the engine moved or freed a tensor's memory
        since construction (``t.set_(...)``, ``t.untyped_storage().resize_(0)`` as sleep-mode
        offload and FSDP do): a copy then wrote into a stale storage, or segfaulted."""
        out = self._regions[layer]
        for k, (part, r) in enumerate(zip(self._parts[layer], out, strict=True)):
            if part.data_ptr() != r.data_ptr() or r.untyped_storage().nbytes() < (
                r.storage_offset() + r.numel()
            ):
                raise StateError(
                    f"layer {self.layer_names[layer]} part {k}: its memory was moved or freed "
                    "since this KVCacheManager was made (set_, resize_ of its storage); make a "
                    "new manager over the current tensors"
                )
        return out

    # -- CUDA: copy stream + pinned pool + events ----------------------------------------------
    def _borrow(self, host_ids: list[int]) -> Any:
        """BORROW CONTRACT (as on the native path): one batch borrow of the host blocks, held by
        the future until the DMA is done, so a block freed mid-copy is recycled only afterwards;
        unknown, stale or freed ids raise here, before any byte moves."""
        return self.pool.borrow(host_ids)

    def _device_index(self, blocks) -> torch.Tensor:
        """Block ids on the GPU without a host sync: a pageable H2D copy would synchronise the
        copy stream (which may be waiting on compute), so stage through pinned memory."""
        host = torch.as_tensor(blocks, dtype=torch.int64)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _cuda_future(self, name: str, event: torch.cuda.Event, keep: list[Any]) -> TransferFuture:
        return _CudaEventFuture(name, event, keep)

    # STREAM CONTRACT: each layer's work waits for an event of the caller's stream, then runs
    # gather kernel -> DMA (save) or DMA -> scatter kernel (load). Kernels of all layers run in
    # submission order on _kernel_stream, DMAs in submission order on _stream, so any two
    # operations on the same device or host blocks keep their submission order; staging tensors
    # are held by the future until its last event fires (no allocator reuse while in flight).
    def _cuda_d2h(self, layer, blocks, host_ids, offset) -> TransferFuture:
        borrows = self._borrow(host_ids)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        gathered, done = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(self._kernel_stream):
            self._kernel_stream.wait_event(ready)
            staged, idx, runs = self._staged_gather(layer, blocks, borrows.slots, offset)
            gathered.record(self._kernel_stream)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(gathered)
            self._dma_to_host(staged, runs)
            done.record(self._stream)
        return self._cuda_future(f"d2h layer {layer}", done, [staged, idx, borrows])

    def _cuda_h2d(self, layer, blocks, host_ids, offset) -> TransferFuture:
        borrows = self._borrow(host_ids)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        landed, done = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            staged, idx = self._dma_from_host(layer, blocks, borrows.slots, offset)
            landed.record(self._stream)
        with torch.cuda.stream(self._kernel_stream):
            self._kernel_stream.wait_event(landed)
            self._staged_scatter(layer, staged, idx)
            done.record(self._kernel_stream)
        self._load_events[layer] = done
        return self._cuda_future(f"h2d layer {layer}", done, [staged, idx, borrows])

    # The device-agnostic data path of the CUDA copies (on CPU tensors - where non_blocking copies
    # are synchronous - tests run it against the native path).
    def _staged_gather(self, layer, blocks, slots, offset):
        """Blocks of ``layer`` as uint8 rows in host-slot order, the index used, and the DMA runs."""
        nbytes = self.format.layer_block_bytes
        order, runs = R.host_runs(self.pool, self._pool_u8, slots, offset, nbytes)
        idx = self._device_index(blocks[order])  # staged rows in host-slot order
        parts = [R.staged_gather(p, self.layout.block_axis, idx) for p in self._parts[layer]]
        staged = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return staged, idx, runs

    @staticmethod
    def _dma_to_host(staged: torch.Tensor, runs) -> None:
        for first, count, dst in runs:
            dst.copy_(staged[first : first + count].reshape(-1), non_blocking=True)

    def _dma_from_host(self, layer, blocks, slots, offset):
        nbytes = self.format.layer_block_bytes
        order, runs = R.host_runs(self.pool, self._pool_u8, slots, offset, nbytes)
        idx = self._device_index(blocks[order])  # staged rows in host-slot order
        staged = torch.empty((len(slots), nbytes), dtype=torch.uint8, device=self.device)
        for first, count, src in runs:
            staged[first : first + count].reshape(-1).copy_(src, non_blocking=True)
        return staged, idx

    def _staged_scatter(self, layer, staged: torch.Tensor, idx: torch.Tensor) -> None:
        off = 0
        for p, g in zip(self._parts[layer], self._geoms[layer], strict=True):
            R.staged_scatter(p, self.layout.block_axis, idx, staged[:, off : off + g.block_bytes])
            off += g.block_bytes

    def _staged_d2h(self, layer, blocks, slots, offset) -> list[torch.Tensor]:
        staged, idx, runs = self._staged_gather(layer, blocks, slots, offset)
        self._dma_to_host(staged, runs)
        return [staged, idx]

    def _staged_h2d(self, layer, blocks, slots, offset) -> list[torch.Tensor]:
        staged, idx = self._dma_from_host(layer, blocks, slots, offset)
        self._staged_scatter(layer, staged, idx)
        return [staged, idx]

    def wait_layer(self, layer: int) -> None:
        """CUDA: make the current stream wait (GPU-side) for the last load into ``layer``.
        CPU: no-op (wait on the layer's future instead)."""
        if self._cuda:
            ev = self._load_events.get(layer)
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)


class _CudaEventFuture(TransferFuture):
    """Complete when a CUDA event has fired.

    Callbacks are driven by the shared watcher thread; a caller blocked in :meth:`result` polls
    the event itself in 10-200 us steps (GIL released while sleeping), because the watcher's
    back-off reaches 1 ms and would add that much to every waited transfer. Rejected
    alternative: ``event.synchronize()``, which cannot honour a timeout.
    """

    def __init__(self, name: str, event: torch.cuda.Event, keep: list[Any]) -> None:
        super().__init__(name)
        self.event = event
        self.keepalive.extend(keep)
        watch(event.query, lambda: self.settle(lambda: None))

    def result(self, timeout: float | None = None) -> Any:
        t = default_timeout() if timeout is None else timeout
        deadline = time.monotonic() + t
        delay = 10e-6
        while not self.done():
            if self.event.query():
                self.settle(lambda: None)
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 200e-6)
        return super().result(timeout=max(0.0, deadline - time.monotonic()))
