"""Trainer side of the same-host path: sharing filled buckets with readers that map the pool.

SHARED-SEGMENT CONTRACT (same host, one trainer process): samplers that run on the trainer's
host with ``same_host=True`` do not take part in the tree. They map the trainer's ``/dev/shm``
pool read-only and read every bucket straight out of the trainer's blocks: a long-poll
``bucket`` request on the control channel returns the bucket's segment offsets and the trainer's
block checksums once the bucket is filled; the sampler verifies each block's checksum and stages
its pieces into the shadow (or live) tensors directly from the segment, then ``release``s the
bucket. The trainer holds one pool reference per shared bucket until every reader released it,
reported a failure, or the version's deadline passed, so a block is never refilled while a
reader may still read it. Per byte and sampler this costs one pass in shadow mode (the staging
copy hashes the block as it goes, FUSED STAGING in :meth:`SamplerSync._pull_shared`) and a hash
pass plus the staging copy in in-place mode (verified before written); the chain over the
same-host P/D path costs a fused copy into the sampler's pool, the staging copy and, for the next
hop, the same again. Rejected: a chain hop per sampler (each hop copies
every byte once more and the hops serialize on 2 vCPUs), and a trainer-side push into each
sampler's pool (the trainer process would do every copy for every sampler).

HOLD CHECK: see :meth:`_SharedBuckets.request`.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from tpusync.core.pool import HostBlockPool


class _SharedBuckets:
    """SHARED-SEGMENT CONTRACT state of trainer rank 0 (the only process when sharing), under the
    trainer's ``lock``: the buckets shared with their readers, the long-polled ``bucket``
    requests not yet answerable, the version being published (``sharing``, set when it is
    announced with readers), the readers that reported a failure of it (``quit``) and the
    releases already done (so a retried request releases twice)."""

    def __init__(self, lock: threading.Lock, pool: HostBlockPool) -> None:
        self._lock = lock
        self._pool = pool
        # (version, src, dst, bucket) -> {"ids", "offsets", "sums", "readers": set of keys};
        # long-polled bucket requests not yet answerable; the version being published.
        self._shared: dict[tuple[int, int, int, int], dict] = {}
        self._waiters: dict[tuple[int, int, int, int], list] = collections.defaultdict(list)
        self.sharing: int | None = None
        self.quit: set[str] = set()  # readers that reported a failure of the shared version
        self._released: set[tuple[tuple[int, int, int, int], str]] = set()  # (slot, reader)

    def drop_pool(self) -> None:
        """The owner closed: let go of its pool (its memory goes once nothing else holds it)."""
        self._pool = None  # type: ignore[assignment]

    def request(self, op: str, msg: dict, answer: Any) -> dict | None:
        """A shared reader's ``bucket`` long poll or ``release`` (lock held)."""
        version, key = int(msg["version"]), str(msg["key"])
        # HOLD CHECK: a released bucket the trainer had already dropped (its deadline passed) may
        # have been refilled while the reader staged it; the reader is told and rejects the update.
        lost = [
            [src, dst, bucket]
            for src, dst, bucket in msg.get("release", ())
            if not self.release(version, int(src), int(dst), int(bucket), key)
        ]
        if op == "release":
            return {"op": "ok", "lost": lost}
        if lost:
            return {
                "op": "lost",
                "reason": f"the trainer dropped buckets {lost} before {key} "
                "released them (deadline passed): their bytes may have been reused",
            }
        slot = (version, int(msg["src"]), int(msg["dst"]), int(msg["bucket"]))
        entry = self._shared.get(slot)
        if entry is not None and key in entry["readers"]:
            return {"op": "bucket", "offsets": entry["offsets"], "sums": entry["sums"]}
        if entry is None and self.sharing == version:
            self._waiters[slot].append((key, answer))  # answered when the bucket is filled
            return None
        return {"op": "gone", "reason": f"bucket {slot} is not shared with {key} (any more)"}

    def release(self, version: int, src: int, dst: int, bucket: int, key: str) -> bool:
        """Reader ``key`` is done with a shared bucket; the last one frees its blocks (lock held).
        False when ``key`` held no such bucket (any more)."""
        slot = (version, src, dst, bucket)
        entry = self._shared.get(slot)
        if entry is None or key not in entry["readers"]:
            return (slot, key) in self._released  # a retried request releases twice
        self._released.add((slot, key))
        entry["readers"].discard(key)
        if not entry["readers"]:
            del self._shared[slot]
            self._pool.free(entry["ids"])
        return True

    def release_reader(self, version: int, key: str) -> None:
        for v, s, r, b in [k for k in self._shared if k[0] == version]:
            self.release(v, s, r, b, key)

    def offer(
        self, slot: tuple[int, int, int, int], ids: list[int], sums: list[int], readers: list[str]
    ) -> None:
        """Share a filled bucket with its same-host readers (SHARED-SEGMENT CONTRACT)."""
        pool = self._pool
        # A HostBlockPool carves its blocks from offset 0 of its segment, one per stride.
        borrow = pool.borrow(ids)
        slots = list(borrow.slots)
        borrow.release()
        stride = pool.native.block_stride
        entry = {
            "ids": ids,
            "offsets": [slot * stride for slot in slots],
            "sums": sums,
            "readers": set(readers),
        }
        with self._lock:
            entry["readers"] -= self.quit
            waiting = self._waiters.pop(slot, [])
            if entry["readers"]:
                pool.retain(ids)  # the sharing reference, dropped by the last release
                self._shared[slot] = entry
        reply = {"op": "bucket", "offsets": entry["offsets"], "sums": sums}
        for key, answer in waiting:
            answer(reply if key in entry["readers"] else {"op": "gone", "reason": "not a reader"})

    def end(self, version: int) -> list[str]:
        """Drop every shared bucket of ``version``; returns the readers that still held one."""
        with self._lock:
            self.sharing = None
            self.quit.clear()
            self._released.clear()
            left = sorted(
                {k for s, e in self._shared.items() if s[0] == version for k in e["readers"]}
            )
            for slot in [s for s in self._shared if s[0] == version]:
                self._pool.free(self._shared.pop(slot)["ids"])
            waiting = [a for ws in self._waiters.values() for _k, a in ws]
            self._waiters.clear()
        for answer in waiting:
            answer({"op": "gone", "reason": f"version {version} is over"})
        return left

    def holding(self, version: int) -> set[str]:
        with self._lock:
            return {k for s, e in self._shared.items() if s[0] == version for k in e["readers"]}
