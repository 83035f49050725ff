"""The two injected collaborators of a KV cache manager: a block store and a block transport.

Managers only move bytes between device memory and host pool blocks; WHERE host blocks come from
and go to is somebody else's job, behind these two small protocols:

- :class:`KVStore` (the tiered store, :class:`tpusync.core.KVStore`: host DRAM and disk) copies
  host pool blocks in on save and out on load, keyed by the engine's block hashes.
- :class:`BlockTransport` (the P/D network transport) publishes host blocks under a transfer id
  and fetches a peer's published blocks into local host blocks.

Implementations: :class:`tpusync.core.KVStore` satisfies :class:`KVStore` directly (no adapter);
:class:`tpusync.core.kvcache.pd_transport.PdBlockTransport` implements :class:`BlockTransport`
over the P/D primitive (:mod:`tpusync.core.pd`). Both protocols are ``runtime_checkable`` so
managers refuse an object lacking a method early.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from tpusync.core.pool import HostBlockPool

__all__ = ["BlockTransport", "KVStore"]


@runtime_checkable
class KVStore(Protocol):
    """Content-addressed block store; :class:`tpusync.core.KVStore` (host DRAM + disk tiers)
    implements it as is.

    COPY CONTRACT: the store copies between its tiers and caller memory (here: rows of the
    manager's host pool), so the manager never hands pool blocks to the store and the store never
    hands its blocks out. ``block_bytes`` must equal the manager's host block size.

    KEY CONTRACT (kept by the manager, see KVCacheManagerBase.store_keys): one engine block hash
    maps to one store key per host block group, ``hash || format fingerprint (8 bytes) ||
    group (2 bytes)``, so caches of different block formats sharing a store never read each
    other's bytes (a different format is a miss).
    """

    @property
    def block_bytes(self) -> int:
        """Size of every stored block."""
        ...

    def put(self, keys: Sequence[bytes], src: Any, rows: Sequence[int] | None = None) -> Any:
        """Store row ``rows[i]`` of ``src`` under ``keys[i]``; a future whose ``result(timeout)``
        is one bool per key (stored)."""
        ...

    def get(self, keys: Sequence[bytes], dst: Any, rows: Sequence[int] | None = None) -> Any:
        """Read ``keys[i]`` into row ``rows[i]`` of ``dst``; ``result(timeout)`` is one bool per
        key (found: False for a miss, whose row is then unspecified)."""
        ...

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str]]:
        """Length of the leading run of stored ``keys`` and the fastest tier of each."""
        ...


@runtime_checkable
class BlockTransport(Protocol):
    """P/D block transport between engines (:class:`~tpusync.core.kvcache.pd_transport.PdBlockTransport`).

    DEAD-PEER CONTRACT: ``fetch`` returns a future that FAILS (UnavailableError) when the peer is
    dead or goes away; it never stays pending forever after the transport has noticed. The manager
    adds its own deadline on top, so even a transport that never answers cannot hang a caller;
    when that deadline fires first, the manager calls the transport's optional
    ``abandon(transfer_id, reason)`` so the fetch stops and its id can be fetched again.
    """

    def publish(
        self,
        transfer_id: str,
        pool: HostBlockPool,
        block_ids: Sequence[int],
        meta: Mapping[str, Any],
    ) -> None:
        """Make host blocks readable by peers under ``transfer_id`` with ``meta``."""
        ...

    def retract(self, transfer_id: str) -> None:
        """Stop serving ``transfer_id`` (the producer may then free its blocks)."""
        ...

    def fetch(
        self, peer: str, transfer_id: str, pool: HostBlockPool, block_ids: Sequence[int]
    ) -> cf.Future:
        """Copy the peer's blocks of ``transfer_id`` into local ``block_ids``; the future's
        result is the producer's ``meta``."""
        ...
