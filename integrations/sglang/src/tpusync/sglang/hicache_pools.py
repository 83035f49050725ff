"""HiCache v2: the state pools of hybrid models (Mamba, SWA, DSA indexer, ...) in tpusync.

SGLang's hybrid cache controller gives a storage backend the KV host pool first (the *anchor*,
``register_mem_pool_host``, served by the v1 zero-copy path in :mod:`tpusync.sglang.hicache`) and
then one host pool per extra state kind (``register_mem_host_pool_v2(pool, name)``). It moves
those pools' pages with ``batch_set_v2`` / ``batch_get_v2`` (one ``PoolTransfer`` per pool: page
hashes plus host slots) and asks ``batch_exists_v2`` how much of a prefix is restorable across
the KV pages and every extra pool.

SIDECAR CONTRACT (one :class:`SidecarPool` per extra pool):
- a page of the pool is its *flat data page*, the bytes of ``get_data_page(slot, flat=True)``,
  read back with ``set_from_flat_data_page``: the one page accessor every SGLang host pool class
  implements, whatever its buffers (a Mamba pool keeps one buffer per state tensor, so there is
  no single row table to copy from). Pages move through one staging tensor per call, one copy
  each way on top of the store's own; a page already stored is not staged again.
- each pool has its own page store (one store holds one block size), keyed by
  ``page_key(pool namespace, page hash)``. The pool namespace digests the KV namespace's parts,
  the pool's name and page size, and the TP rank: state pools are TP-sharded even where the KV
  is not (MLA).
- a transfer's ``host_indices`` hold ``pool.page_size`` slots per key (SGLang zips keys against
  the head of the buffer); any other count fails the whole transfer, logged, never partly.

VERDICT CONTRACT (``restorable``): a KV prefix of ``p`` pages is restorable from a pool when
- ``ALL_PAGES``: each of its first ``p`` pages is stored;
- ``TRAILING_PAGES`` (Mamba / SWA: state at the end of the prefix only): the last
  ``window`` pages before ``p`` are stored, ``window`` being the transfer's key count (at least 1).
  The set of such ``p`` may have holes (state checkpoints exist only at some page boundaries);
  SGLang intersects these sets across ranks, so the whole set is returned, not its maximum.
- ``BLOCK_GROUPS`` (no SGLang 0.5.23 pool uses it): no verdict; the pool does not gate the hit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tpusync.sglang.page_store import PageStore

__all__ = ["SidecarPool", "restorable", "stored"]

logger = logging.getLogger(__name__)


def stored(store: PageStore, keys: Sequence[bytes]) -> list[bool]:
    """Which of ``keys`` are stored, by leading-run lookups over windows that double while they
    hit and restart at one key after a miss: each key is looked at about once."""
    out = [False] * len(keys)
    i, width = 0, 1
    while i < len(keys):
        window = keys[i : i + width]
        run = store.lookup_prefix(window)
        out[i : i + run] = [True] * run
        if run == len(window):
            i, width = i + run, min(2 * width, 4096)
        else:
            i, width = i + run + 1, 1
    return out


def restorable(present: Sequence[bool], policy: str, window: int) -> set[int] | None:
    """Prefix lengths ``p`` (1..len(present)) a pool can restore, per the VERDICT CONTRACT;
    None for a policy that gives no verdict."""
    n = len(present)
    if policy == "all_pages":
        boundary = next((i for i, ok in enumerate(present) if not ok), n)
        return set(range(1, boundary + 1))
    if policy == "trailing_pages":
        window = max(1, int(window))
        missing = np.concatenate([[0], np.cumsum(~np.asarray(present, dtype=bool))])
        return {p for p in range(1, n + 1) if missing[p] == missing[max(0, p - window)]}
    return None


class SidecarPool:
    """One extra SGLang host pool and the page store that keeps its pages (SIDECAR CONTRACT)."""

    def __init__(
        self,
        name: str,
        host_pool: Any,
        namespace: bytes,
        make_store: Callable[[int], PageStore],
        key: Callable[[bytes, str], bytes],
    ) -> None:
        dummy = host_pool.get_dummy_flat_data_page()
        if not isinstance(dummy, torch.Tensor) or dummy.numel() == 0:
            raise ValueError(
                f"SGLang host pool {name!r} ({type(host_pool).__name__}) gives no flat data page"
            )
        self.name = str(name)
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        self.dtype = dummy.dtype
        self.page_bytes = dummy.numel() * dummy.element_size()
        self._pool = host_pool
        self._namespace = namespace
        self._key = key
        self.store = make_store(self.page_bytes)  # one segment of page_bytes per page

    def keys(self, hashes: Sequence[str]) -> list[bytes]:
        return [self._key(self._namespace, h) for h in hashes]

    def stored(self, hashes: Sequence[str]) -> list[bool]:
        return stored(self.store, self.keys(hashes))

    def _slots(self, hashes: Sequence[str], host_indices: torch.Tensor | None) -> list[int]:
        """The first host slot of each key's page."""
        if host_indices is None:
            raise ValueError(f"pool {self.name!r}: a transfer without host_indices")
        flat = host_indices.reshape(-1)
        if flat.numel() != len(hashes) * self.page_size:
            raise ValueError(
                f"pool {self.name!r}: {len(hashes)} keys need {len(hashes) * self.page_size} "
                f"host indices (page size {self.page_size}), got {flat.numel()}"
            )
        return [int(s) for s in flat[:: self.page_size].tolist()]

    def put(self, hashes: Sequence[str], host_indices: torch.Tensor, timeout: float) -> list[bool]:
        """Store the pages in ``host_indices`` under ``hashes``; True per page stored."""
        slots = self._slots(hashes, host_indices)
        keys = self.keys(hashes)
        done = stored(self.store, keys)
        todo = [i for i, ok in enumerate(done) if not ok]
        if not todo:
            return done
        staging = torch.empty((len(todo), self.page_bytes), dtype=torch.uint8)
        for row, i in enumerate(todo):
            page = self._pool.get_data_page(slots[i], flat=True).contiguous().view(torch.uint8)
            if page.numel() != self.page_bytes:
                raise ValueError(
                    f"pool {self.name!r}: a data page of {page.numel()} B, expected {self.page_bytes}"
                )
            staging[row].copy_(page.reshape(-1))
        rows = np.arange(len(todo), dtype=np.int64).reshape(-1, 1)
        ok = self.store.put_pages([keys[i] for i in todo], staging.numpy(), rows, timeout)
        for i, page_ok in zip(todo, ok, strict=True):
            done[i] = page_ok
        return done

    def get(self, hashes: Sequence[str], host_indices: torch.Tensor, timeout: float) -> list[bool]:
        """Copy the pages named ``hashes`` into ``host_indices``; True per page restored."""
        slots = self._slots(hashes, host_indices)
        if not slots:
            return []
        staging = torch.empty((len(slots), self.page_bytes), dtype=torch.uint8)
        rows = np.arange(len(slots), dtype=np.int64).reshape(-1, 1)
        ok = self.store.get_pages(self.keys(hashes), staging.numpy(), rows, timeout)
        for i, page_ok in enumerate(ok):
            if page_ok:
                self._pool.set_from_flat_data_page(slots[i], staging[i].view(self.dtype))
        return ok
