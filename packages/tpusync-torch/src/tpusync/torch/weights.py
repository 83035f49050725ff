"""Weight-sync device side for torch: flatten a state dict into buckets of host pool blocks and
restore host blocks into existing tensors in place (the layer tpusync-rl builds on).

CPU tensors move through the native segment copy (engine threads, GIL released); CUDA tensors
through the pinned host pool on a dedicated copy stream (see tpusync.torch.kv_cache).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tpusync.core import InvalidArgumentError, _native, dtype_name
from tpusync.core.kvcache.futures import TransferFuture, from_native, gather, watch
from tpusync.core.kvcache.weights import (
    HostWeights,
    WeightManifest,
    plan_weights,
    weight_segments,
)
from tpusync.core.pool import HostBlockPool
from tpusync.core.procmaps import check_writable
from tpusync.torch import _regions as R

__all__ = ["HostWeights", "flatten_weights", "restore_weights"]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _copy_bucket(
    pool: HostBlockPool,
    manifest: WeightManifest,
    bucket: int,
    ids: list[int],
    tensors: list[torch.Tensor],
    to_host: bool,
    stream: torch.cuda.Stream | None,
    pool_u8: torch.Tensor | None,
) -> TransferFuture:
    regions = [_bytes_of(t) for t in tensors]
    segs = weight_segments(manifest, bucket, list(range(len(regions))))
    name = f"{'flatten' if to_host else 'restore'} bucket {bucket}"
    if not tensors or tensors[0].device.type == "cpu":
        call = _native.put_segments if to_host else _native.get_segments
        return from_native(call(pool.engine, pool.native, ids, regions, segs), name)
    stride = pool.native.block_stride
    slots = [pool.native.slot_of(i) for i in ids]
    # A view per block borrows it until the DMA is done; stale / freed ids raise here, before
    # any byte moves (the native path's BORROW CONTRACT).
    borrows = [pool.view(i) for i in ids]
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensors[0].device))
    done = torch.cuda.Event()
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        for blk, boff, reg, roff, n in segs.tolist():
            host = pool_u8[slots[blk] * stride + boff : slots[blk] * stride + boff + n]
            dev = regions[reg][roff : roff + n]
            if to_host:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
        done.record(stream)
    f = TransferFuture(name)
    f.keepalive.extend([regions, done, borrows])
    watch(done.query, lambda: f.settle(lambda: None))
    return f


def flatten_weights(
    state_dict: Mapping[str, torch.Tensor],
    pool: HostBlockPool,
    bucket_bytes: int = 64 << 20,
) -> tuple[HostWeights, list[TransferFuture]]:
    """Copy every tensor into host blocks, bucket by bucket; one future per bucket.

    A bucket's blocks are complete when its future is, so a sender can push bucket i while later
    buckets are still being copied. Non-contiguous tensors are copied through a contiguous
    temporary. The caller frees the blocks (``HostWeights.free``).
    """
    stream = _stream_for(state_dict)
    items = [
        (k, dtype_name(v.dtype), tuple(v.shape), v.numel() * v.element_size())
        for k, v in state_dict.items()
    ]
    manifest = plan_weights(items, pool.block_bytes, bucket_bytes)
    tensors = {k: v if v.is_contiguous() else v.contiguous() for k, v in state_dict.items()}
    host = HostWeights.alloc(pool, manifest)
    pool_u8 = R.pin_pool(pool) if stream is not None else None
    futures = []
    try:
        for b, ids in host.ids_of():
            ts = [tensors[e.name] for e in manifest.entries if e.bucket == b]
            futures.append(_copy_bucket(pool, manifest, b, ids, ts, True, stream, pool_u8))
    except BaseException:
        host.free()  # a block still being filled is recycled only once its copy ends (BORROW)
        raise
    finally:
        if pool_u8 is not None:  # one pinning for the call, released when its copies are done
            gather(futures, "flatten_weights").add_done_callback(lambda _f: R.unpin_pool(pool))
    return host, futures


def restore_weights(
    host: HostWeights, state_dict: Mapping[str, torch.Tensor], buckets: list[int] | None = None
) -> TransferFuture:
    """Copy host blocks into the existing tensors of ``state_dict`` in place.

    Names, dtypes and shapes must match the manifest (refused naming the tensor and field before
    any byte moves); target tensors must be contiguous.
    """
    m = host.manifest
    m.check_targets([(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in state_dict.items()])
    for k, v in state_dict.items():
        if not v.is_contiguous():
            raise InvalidArgumentError(f"weight {k!r}: restore target must be contiguous")
    check_writable(
        [
            (v.data_ptr(), v.numel() * v.element_size(), f"weight {k!r}")
            for k, v in state_dict.items()
            if v.device.type == "cpu"
        ],
        "restore_weights",
    )
    chosen = host.ids_of(buckets)
    stream = _stream_for(state_dict)
    pool_u8 = R.pin_pool(host.pool) if stream is not None else None
    futures = []
    for b, ids in chosen:
        ts = [state_dict[e.name] for e in m.entries if e.bucket == b]
        futures.append(_copy_bucket(host.pool, m, b, ids, ts, False, stream, pool_u8))
    out = gather(futures, "restore_weights")
    if pool_u8 is not None:
        out.add_done_callback(lambda _f: R.unpin_pool(host.pool))
    return out


def _stream_for(tensors: Mapping[str, torch.Tensor]) -> torch.cuda.Stream | None:
    """A copy stream for CUDA weights, None for CPU ones; refuses (before anything is allocated)
    anything else, or weights on several devices."""
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"weight {k!r} is a {type(t).__name__}, not a torch.Tensor")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise InvalidArgumentError(f"weights live on several devices: {sorted(map(str, devices))}")
    dev = next(iter(devices), torch.device("cpu"))
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"weights on a {dev.type!r} device: only cpu and cuda are supported"
        )
    return torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
