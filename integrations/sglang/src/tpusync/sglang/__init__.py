"""tpusync.sglang: tpusync for SGLang.

- :class:`TpusyncHiCacheStorage` (``tpusync.sglang.hicache``): a HiCache storage backend (L3),
  loaded with ``--hicache-storage-backend dynamic`` (see docs/sglang.md).
- :class:`PageStore` (``tpusync.sglang.page_store``): the storage seam under it, today served by
  the INTERIM :class:`InterimHostPageStore` (host DRAM of this process).

The P/D transfer backend is NOT IMPLEMENTED: it waits for tpusync's P/D primitive
(docs/sglang-pd-plan.md).

``TpusyncHiCacheStorage`` is imported lazily so that the page store can be used (and tested)
without SGLang installed.
"""

from __future__ import annotations

from typing import Any

from tpusync.core import require_api
from tpusync.sglang.page_store import InterimHostPageStore, PageStore

MIN_CORE_API = 2
require_api(MIN_CORE_API, "tpusync-sglang")

__all__ = ["MIN_CORE_API", "InterimHostPageStore", "PageStore", "TpusyncHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name in ("TpusyncHiCacheStorage", "HostPoolRows", "page_key"):
        from tpusync.sglang import hicache

        return getattr(hicache, name)
    raise AttributeError(f"module 'tpusync.sglang' has no attribute {name!r}")
