"""tpusync.sglang: tpusync for SGLang.

- :class:`TpusyncHiCacheStorage` (``tpusync.sglang.hicache``): a HiCache storage backend (L3),
  loaded with ``--hicache-storage-backend dynamic`` (see docs/sglang.md).
- :class:`PageStore` (``tpusync.sglang.page_store``): the storage seam under it, served by
  :class:`KVStorePageStore` (tpusync's tiered KVStore: host DRAM + optional disk tier) or
  :class:`InterimHostPageStore` (host DRAM of this process, untouched rows on a miss).
- ``tpusync.sglang.pd``: the P/D (prefill/decode disaggregation) transfer backend on tpusync's P/D
  primitive, hooked into SGLang by ``tpusync.sglang.pd_plugin`` (entry point group
  ``sglang.srt.plugins``); select it with ``--disaggregation-transfer-backend tpusync``.
- ``tpusync.sglang.weight_sync`` (client) and ``tpusync.sglang.weight_loader`` (server, SGLang's
  ``--custom-weight-loader``): a running SGLang server as a tpusync-rl sampler, taking versioned
  weight updates from RL trainers (needs tpusync-rl: ``pip install tpusync-sglang[rl]``);
  ``tpusync.sglang.lora``: LoRA adapter versions from RL trainers into a server started with
  ``--enable-lora``.

``TpusyncHiCacheStorage`` is imported lazily so that the page store can be used (and tested)
without SGLang installed.
"""

from __future__ import annotations

from typing import Any

from tpusync.core import require_api
from tpusync.sglang.page_store import InterimHostPageStore, KVStorePageStore, PageStore

# 15: pd.pair_layers; 14: pd.host_id; 12: reclaim_stale_segments; 10: PdConsumer.abandon
MIN_CORE_API = 15
require_api(MIN_CORE_API, "tpusync-sglang")

__all__ = [
    "MIN_CORE_API",
    "InterimHostPageStore",
    "KVStorePageStore",
    "PageStore",
    "TpusyncHiCacheStorage",
]


def __getattr__(name: str) -> Any:
    if name in ("TpusyncHiCacheStorage", "HostPoolRows", "page_key"):
        from tpusync.sglang import hicache

        return getattr(hicache, name)
    raise AttributeError(f"module 'tpusync.sglang' has no attribute {name!r}")
