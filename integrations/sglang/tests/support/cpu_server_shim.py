"""TEST-ONLY CPU stand-ins for the CUDA plumbing a live SGLang HiCache server touches on CPU.

NOTHING HERE IS PART OF tpusync-sglang, and nothing here touches tpusync: the server under test
runs tpusync's HiCache backend unmodified. What this replaces is SGLang's *device* plumbing that
has no CPU build in 0.5.23:

- ``sgl_kernel.kvcacheio.transfer_kv_direct``: the host <-> device page copy of HiCache's
  ``direct`` io backend (layer_first layout). SGLang imports it only on CUDA / ROCm / XPU, so on a
  CPU-only host the host pool's ``load_to_device_per_layer`` / ``backup_from_device_all_layer``
  would raise NameError. The stand-in is the same gather/scatter written with torch indexing.
- ``cudaHostRegister`` / ``cudaHostUnregister`` of the host pool buffer (page-locking host memory
  for DMA; SGLang calls them whenever the host pool is pinned, which it always is in a server):
  with no device there is no DMA, so the stand-ins do nothing. The buffer itself is allocated by
  SGLang's own allocator as usual.
- the rotary embedding's fallback-kernel lookup: off CUDA and off SGLang's CPU engine (which
  needs the sgl_kernel CPU wheel) ``RotaryEmbedding.__init__`` imports ``vllm._custom_ops`` for a
  kernel that only ``forward_cuda`` would call. On this platform the op dispatches to
  ``forward_native`` (pure torch), so the stand-in tells the module it is on a CPU host
  (``_is_cpu = True``), which skips that import and nothing else in the module.
- page-locked ("pinned") host tensors in SGLang's LoRA modules (``--enable-lora``): the layers
  and the ``torch_native`` LoRA backend allocate their small index / offset tensors with
  ``pin_memory=True`` and call ``Tensor.pin_memory()`` unconditionally, which a CPU-only torch
  refuses ("no pinned memory allocator"). Pinning only serves DMA to a device; the stand-in
  makes those modules' tensor factories ignore ``pin_memory`` and ``Tensor.pin_memory()``
  return the tensor itself, in a process without an accelerator. The latter is process-wide,
  and every server process imports those modules (LoRA on or off): where a CPU-only torch
  would have raised, the tensor stays unpinned, which no CPU code path can tell apart.
- the ``torchvision`` import stand-in from :mod:`cpu_shim`.

The model kernels (RMSNorm, SiLU-and-mul, rotary, attention) need no stand-in: without
sgl_kernel SGLang's own ``forward_native`` / torch_native attention backend run on CPU.

Installed in every server process (SGLang spawns its scheduler and detokenizer) by the
``sitecustomize`` in ``support/server_site`` when ``TPUSYNC_SGLANG_CPU_SHIM=1``.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

import cpu_shim


def transfer_kv_direct(
    src_layers: list[Any],
    dst_layers: list[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """CPU stand-in: ``dst_layers[i][dst_indices] = src_layers[i][src_indices]`` for every i.

    Token-indexed (page_size only states that indices come in whole pages), exactly the
    contract of the CUDA op the ``direct`` io backend calls for the layer_first layout.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers vs {len(dst_layers)} destination")
    if src_indices.numel() != dst_indices.numel() or src_indices.numel() % page_size:
        raise ValueError("index lists must have equal length, a whole number of pages")
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device, non_blocking=False)] = src[
            src_indices.to(src.device, non_blocking=False)
        ].to(dst.device)


def _patch_host_pool(module: Any) -> None:
    if "transfer_kv_direct" not in module.__dict__:  # never shadow a real kernel
        module.transfer_kv_direct = transfer_kv_direct


def _host_register(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
    """CPU stand-in for cudaHostRegister of a host pool buffer: no device, no DMA, nothing to do."""


def _host_unregister(buffer: Any) -> None:
    """CPU stand-in for cudaHostUnregister (pairs with :func:`_host_register`)."""


def _patch_host_memory(module: Any) -> None:
    module._cuda_host_register = _host_register
    module._cuda_host_unregister = _host_unregister


def _patch_rotary(module: Any) -> None:
    module._is_cpu = True


_FACTORIES = ("tensor", "zeros", "empty", "ones", "arange")


class _UnpinnedTorch:
    """``torch`` as SGLang's LoRA modules see it on CPU: the tensor factories ignore
    ``pin_memory``; everything else is torch's own."""

    def __init__(self) -> None:
        import torch

        for name in _FACTORIES:  # made once: the LoRA backend calls them for every batch
            setattr(self, name, self._unpinned(getattr(torch, name)))

    @staticmethod
    def _unpinned(factory: Any) -> Any:
        def unpinned(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
            return factory(*args, **kwargs)

        return unpinned

    def __getattr__(self, name: str) -> Any:  # only names not set in __init__
        import torch

        return getattr(torch, name)


def _patch_lora(module: Any) -> None:
    import torch

    if torch.cuda.is_available():  # a real device: pinning is real, nothing to stand in for
        return
    module.torch = _UnpinnedTorch()
    if not getattr(torch.Tensor.pin_memory, "__tpusync_test_shim__", False):

        def pin_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self

        pin_memory.__tpusync_test_shim__ = True  # type: ignore[attr-defined]
        torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]


_PATCHES = {
    "sglang.srt.lora.layers": _patch_lora,
    "sglang.srt.lora.backend.torch_backend": _patch_lora,
    "sglang.srt.mem_cache.pool_host.mha": _patch_host_pool,
    "sglang.srt.layers.rotary_embedding.base": _patch_rotary,
    "sglang.srt.mem_cache.pool_host.common": _patch_host_memory,
}
PATCHED_MODULES = tuple(_PATCHES)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):  # noqa: ANN001 - importlib API
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001 - importlib API
        self._inner.exec_module(module)
        _PATCHES[module.__name__](module)
        module.__tpusync_test_shim__ = True


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib API
        if fullname not in PATCHED_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


_FINDER = _PatchingFinder()


def install() -> None:
    """Register the stand-ins (idempotent); call before anything imports sglang."""
    cpu_shim.install()
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
