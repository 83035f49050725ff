"""Byte regions of torch tensors and CUDA plumbing (pinned host pool, copy stream, events)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np

import torch
from tpusync.core import HostBlockPool, InvalidArgumentError, StateError
from tpusync.core.kvcache.layout import PieceGeometry

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _TORCH_DTYPES[_name] = getattr(torch, _name)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(f"unsupported dtype {name!r} for torch") from None


def geometry(t: torch.Tensor, block_axis: int, axes) -> PieceGeometry:
    item = t.element_size()
    return PieceGeometry.of(t.shape, [s * item for s in t.stride()], item, block_axis, axes)


def byte_region(t: torch.Tensor, g: PieceGeometry) -> torch.Tensor:
    """A 1-D uint8 CPU tensor covering every byte the strided tensor ``t`` can address."""
    elems = g.region_bytes // t.element_size()
    flat = torch.as_strided(t.detach(), (elems,), (1,), t.storage_offset())
    return flat.view(torch.uint8)


def memory_permutation(t: torch.Tensor, block_axis: int) -> list[int]:
    """[block_axis] + the other axes by decreasing stride: the host content order."""
    rest = [d for d in range(t.dim()) if d != block_axis]
    rest.sort(key=lambda d: (-t.stride(d), d))
    return [block_axis, *rest]


def staged_gather(t: torch.Tensor, block_axis: int, idx: torch.Tensor) -> torch.Tensor:
    """Blocks ``idx`` of ``t`` as uint8 ``[n, block_bytes]`` in host content order (any device)."""
    perm = memory_permutation(t, block_axis)
    sel = t.index_select(block_axis, idx).permute(perm).contiguous()
    return sel.view(torch.uint8).reshape(idx.numel(), -1)


def staged_scatter(t: torch.Tensor, block_axis: int, idx: torch.Tensor, data: torch.Tensor) -> None:
    """Inverse of :func:`staged_gather`: write uint8 ``[n, block_bytes]`` into blocks ``idx``."""
    perm = memory_permutation(t, block_axis)
    shape = [idx.numel()] + [t.shape[d] for d in perm[1:]]
    vals = data.contiguous().view(t.dtype).reshape(shape)
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    t.index_copy_(block_axis, idx, vals.permute(inv))


# -- pinned host pools ------------------------------------------------------------------------
_pin_lock = threading.Lock()
_pinned: dict[int, tuple[int, torch.Tensor]] = {}  # base address -> (refcount, uint8 tensor)

CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


def pool_tensor(pool: HostBlockPool) -> torch.Tensor:
    """A uint8 CPU tensor over the whole pool (no copy; valid while the pool lives)."""
    base = pool.native.base_address
    size = pool.native.pool_bytes
    arr = np.ctypeslib.as_array(ctypes.cast(base, ctypes.POINTER(ctypes.c_uint8)), shape=(size,))
    return torch.from_numpy(arr)


def pin_pool(pool: HostBlockPool) -> torch.Tensor:
    """Register the pool's memory with CUDA (page-locked, DMA-able) once per pool.

    PIN CONTRACT: registration is reference counted per pool base address; :func:`unpin_pool`
    unregisters at zero. Memory already registered by someone else is accepted as is.
    """
    base = pool.native.base_address
    with _pin_lock:
        if base in _pinned:
            n, t = _pinned[base]
            _pinned[base] = (n + 1, t)
            return t
        rc = torch.cuda.cudart().cudaHostRegister(base, pool.native.pool_bytes, 0)
        code = int(rc.value) if hasattr(rc, "value") else int(rc)
        if code not in (0, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
            raise StateError(f"cudaHostRegister of the host pool failed with CUDA error {code}")
        t = pool_tensor(pool)
        _pinned[base] = (1, t)
        return t


def unpin_pool(pool: HostBlockPool) -> None:
    base = pool.native.base_address
    with _pin_lock:
        if base not in _pinned:
            return
        n, t = _pinned[base]
        if n > 1:
            _pinned[base] = (n - 1, t)
            return
        del _pinned[base]
        torch.cuda.cudart().cudaHostUnregister(base)


def host_runs(
    pool: HostBlockPool, pool_u8: torch.Tensor, slots: Sequence[int], offset: int, nbytes: int
) -> tuple[np.ndarray, list[tuple[int, int, torch.Tensor]]]:
    """Batch order sorted by pool slot, and (first, count, uint8 host view) runs over that order
    covering ``nbytes`` at ``offset`` of each host block (``slots``: the batch's pool slots, as
    :meth:`HostBlockPool.borrow` gives them).

    Host blocks of consecutive slots coalesce into one DMA when their rows are back to back
    (offset 0 and nbytes == the pool's block stride); sorting by slot first means a batch whose
    blocks were allocated in any order still coalesces when the slots form runs.
    """
    stride = pool.native.block_stride
    slots = np.asarray(slots, dtype=np.int64)
    order = np.argsort(slots, kind="stable")
    slots = slots[order]
    coalesce = offset == 0 and nbytes == stride
    runs = []
    i = 0
    while i < slots.size:
        j = i + 1
        if coalesce:
            while j < slots.size and slots[j] == slots[j - 1] + 1:
                j += 1
        start = int(slots[i]) * stride + offset
        length = (j - i - 1) * stride + nbytes
        runs.append((i, j - i, pool_u8[start : start + length]))
        i = j
    return order, runs
