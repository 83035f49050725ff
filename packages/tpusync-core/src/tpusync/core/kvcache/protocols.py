"""The two injected collaborators of a KV cache manager: a block store and a block transport.

Managers only move bytes between device memory and host pool blocks; WHERE host blocks come from
and go to is somebody else's job, behind these two small protocols:

- :class:`KVStore` (the tiered store: host DRAM, disk, remote nodes) hands out host pool blocks to
  fill on save and pinned host blocks to read on load, keyed by the engine's block hashes.
- :class:`BlockTransport` (the P/D network transport) publishes host blocks under a transfer id
  and fetches a peer's published blocks into local host blocks.

INTERIM: tpusync.core.kvcache.interim_store.InterimHostStore implements KVStore over one
HostBlockPool and a BlockIndex (no disk, no remote). There is no transport implementation in this
package on purpose: the network transport lives in its own component, and tests use an in-process
fake. Both protocols are ``runtime_checkable`` so managers refuse an object lacking a method early.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from tpusync.core.pool import HostBlockPool

__all__ = ["BlockTransport", "KVStore"]


@runtime_checkable
class KVStore(Protocol):
    """Content-addressed host block store.

    KEY CONTRACT: a key names one device block's KV for ALL layers (the engine's chained block
    hash); it maps to ``blocks_per_key`` host blocks of ``pool`` (one per layer group) and to the
    writer's block format dict, returned to readers so they can refuse a mismatch.
    """

    @property
    def pool(self) -> HostBlockPool:
        """The host pool whose blocks reserve/acquire hand out (the manager copies into it)."""
        ...

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that are stored (no pins taken)."""
        ...

    def reserve(
        self, keys: Sequence[bytes], blocks_per_key: int, fmt: Mapping[str, Any]
    ) -> list[list[int] | None]:
        """Host blocks to fill for each key; None for a key already stored (skip it).

        Reserved keys are invisible to lookup/acquire until :meth:`commit`.
        """
        ...

    def commit(self, keys: Sequence[bytes], ok: bool) -> None:
        """Publish reserved keys (``ok``) or drop them and free their blocks (copy failed)."""
        ...

    def acquire(self, keys: Sequence[bytes]) -> list[tuple[list[int], Mapping[str, Any]]]:
        """Pin every key and return its host blocks and format; NotFoundError (nothing pinned)
        if any key is missing."""
        ...

    def release(self, keys: Sequence[bytes]) -> None:
        """Unpin keys acquired earlier."""
        ...


@runtime_checkable
class BlockTransport(Protocol):
    """P/D block transport between engines (implemented by the network transport component).

    DEAD-PEER CONTRACT: ``fetch`` returns a future that FAILS (UnavailableError) when the peer is
    dead or goes away; it never stays pending forever after the transport has noticed. The manager
    adds its own deadline on top, so even a transport that never answers cannot hang a caller.
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
