"""The tpusync HiCache backend built the way SGLang's cache controller builds it (tests only)."""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

# What SGLang's `dynamic` backend loader needs to find tpusync's backend class.
DYNAMIC = {
    "backend_name": "tpusync",
    "module_path": "tpusync.sglang",
    "class_name": "TpusyncHiCacheStorage",
    "interface_v1": 1,
}


def storage_config(
    extra: dict[str, Any] | None = None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    dp_rank: int = 0,
    model: str = "tiny-test",
    mla: bool = False,
    page_first: bool = True,
) -> HiCacheStorageConfig:
    """SGLang's storage config for one rank; ``extra`` goes over :data:`DYNAMIC`."""
    return HiCacheStorageConfig(
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config={**DYNAMIC, **(extra or {})},
    )


def create(host: Any, extra: dict[str, Any] | None = None, *, attach: bool = True, **cfg: Any):
    """What ``HiCacheController.attach_storage_backend`` does: the factory, then the host pool;
    with ``attach`` also the end of registration (a hybrid controller registers its extra pools
    in between, so it passes ``attach=False`` and calls ``on_host_pools_registered`` itself)."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **cfg), host)
    backend.register_mem_pool_host(host)
    if attach:
        backend.on_host_pools_registered()
    return backend
