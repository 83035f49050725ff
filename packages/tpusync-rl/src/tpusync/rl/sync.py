"""The network path of RL weight sync: trainer ranks publish versions, sampler ranks pull them.

Pieces (see :mod:`tpusync.rl.pack`) are packed into host pool blocks and moved by tpusync's P/D
streaming primitive (authenticated TCP with several streams per link, or a same-host /dev/shm
copy); a small signed control channel (:mod:`tpusync.rl.control`) on trainer rank 0 carries
membership, version announcements and commit reports.

PIPELINE CONTRACT: a trainer rank fills bucket ``i + 1`` (device -> host copy and digests) while
the wire carries bucket ``i``: each bucket is registered with the transport the moment it is
filled, and samplers have already asked for the next ``window`` buckets (a pull waits for its
registration). A sampler stages bucket ``i`` (digest check, dtype cast, name mapping, shadow
copy) while buckets ``i + 1 ..`` are on the wire.

FAN-OUT CONTRACT: for each sampler rank ``r`` the live replicas form a tree of degree ``fanout``
(``fanout=1``: a chain). Only the tree's first level pulls from the trainer; every other replica
pulls the same blocks from its parent, which registers each bucket for its children as soon as
it landed (forwarding while receiving), so the trainer sends each byte ``fanout`` times, not N.
A replica whose parent is lost in the middle of a version is re-parented to the trainer for the
rest of that version (RE-PARENTING CONTRACT below); its own subtree stays below it.

RESHARD CONTRACT: trainer rank ``t`` sends sampler rank ``r`` only the intersections of its
shards with ``r``'s shards (:class:`tpusync.rl.plan.ReshardPlan`); no process ever holds more of
a tensor than its own shard plus the buckets in flight.

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

FAULT CONTRACT: every wait has a deadline. A sampler that dies or fails an update is reported by
trainer rank 0 (:class:`PublishReport`) and dropped from the next version's tree until it polls
again; the others commit, its descendants in the fan-out tree included (RE-PARENTING CONTRACT:
its children get the rest of the version from the trainer). When the trainer dies, samplers'
pulls fail by their deadline and they keep serving the version they have. A digest mismatch or a stale block rejects the update (logged,
nothing committed); an announcement that does not follow the sampler's version is refused.

HEARTBEAT CONTRACT (a sampler dying, idle or mid-update, on any host): from its first poll until
it closes, a sampler sends a ``beat`` to trainer rank 0 on the control channel every
``silence / 4`` seconds, from a thread of its own (so a slow but live sampler keeps beating while
its pulling thread waits or copies, and an idle one keeps beating while nobody calls
:meth:`SamplerSync.update`): an idle beat names no version, a beat while it applies a version (and
while it still forwards that version to children) names it. One small message per sampler per
``silence / 4``; the poll reply tells a sampler ``silence``. Rank 0 counts a member of the version
in flight that has not reported and was not heard from (poll, beat or report) for ``silence``
seconds (``TrainerSync(silence=)``, default 10 s, well below the deadline) as having reported a
failure, like a process exit on the same host (EXIT WATCH CONTRACT): whether it died in the middle
of the update or before it fetched the announcement (a sampler killed while idle is found out
within ``silence`` of its last beat, not at the deadline; one already silent when a version is
announced is put in no fan-out tree, so no live sampler waits on it as a parent, and a sampler
that fetches an announcement leaving it out rejects that version). A sampler that closes cleanly says
``bye`` and leaves the group: it is not counted as dead, and a version in flight that counted on
it records that it left. A sampler that failed
either way has every transport send registered for it cancelled at once
(``PdProducer.cancel``, CANCEL CONTRACT in pd_stream.h): each trainer rank cancels its own (ranks
> 0 ask rank 0 which samplers failed), and a forwarding sampler cancels what it registered for a
failed child when a beat reply names that child, so no pool stays held for a dead peer and the
next version starts on free pools. Its fan-out children are re-parented to the trainer within the
same version (RE-PARENTING CONTRACT below) and commit it with the others; the next version's
tree leaves the dead sampler out until it polls again (a restarted sampler rejoins by polling). A live sampler that is idle
for a long time is still a member: a version it has not fetched waits for it until the deadline
(it is alive, it may poll). Rejected: connection loss seen by
the producer (a host that died sends no FIN, links are pooled and idle between pulls, and the
death of a forwarded-to child is seen by its parent sampler's producer, not by the trainer, so it
would need relaying anyway), a progress timeout on the pulling thread (it fires on a sampler
that is slow, e.g. staging a large bucket, but alive), and judging liveness by polls (a live
sampler whose engine does not call ``update`` for a while would be presumed dead).

RE-PARENTING CONTRACT (a tree or chain member lost in the middle of a version): a replica whose
parent sampler is gone (the parent failed the version: heartbeat silence, exit watch, its own
failure report; or it committed and then went silent, left, or its same-host process exited)
gets the rest of that version from the TRAINER, as a late direct child. It learns of the loss
from a failed pull from the parent or from a beat reply (``adopt``), drops its pulls from the
parent and sends rank 0 an ``adopt`` request naming, per trainer rank, the first bucket it has
not staged yet (buckets are staged in pull order, so what it lacks is a suffix of every stream).
Rank 0 grants it a child slot at or above ``fanout`` (unique per version and sampler rank; slots
end at 63) once it counts the parent gone, answers ``wait`` while the parent may still serve it,
and records the adoption; every trainer rank (ranks > 0 learn adoptions with the failed samplers
from rank 0) fills those buckets again from the version's tensors, which ``publish`` holds until
it returns, and registers them at that slot, at most ``REFILL_AHEAD`` unacknowledged per orphan
and stream, never blocking on its pool. The orphan pulls them, verifies each against the fresh
block checksums, forwards each to its own children under the same request ids as before (its
subtree does not notice) and stages it: every bucket is staged exactly once, all of one version
(the block trailer names it), so the COMMIT and DIGEST checks hold as for any update. Deltas and
resharding need nothing more: the buckets come from the same plan. To serve orphans every trainer
rank's ``publish`` returns only once every member reported (ranks > 0 ask rank 0; one that hears
nothing from rank 0 for ``silence`` stops waiting). Every wait has its deadline: an orphan whose
parent stays alive for ``2 * silence`` after a failed pull (it failed for another reason), or
that rank 0 cannot re-parent (version over, no slot left) or does not by the deadline, fails the
version with that reason, as before. A forwarding sampler that fails a version cancels what it
forwarded, so its children move at once. Shared-segment readers have no parent (they read the
trainer's pool) and are never orphans. Rejected: the dead node's parent or another ancestor
forwarding the missing buckets (an ancestor frees a forwarded bucket once its own children
acknowledged it, DRAIN CONTRACT, so it may no longer hold the orphan's buckets, and a second
forwarding path per sampler would need its own flow control); re-forming the whole tree within
the version (every live member would change parent mid-stream); and failing the descendants,
the old behaviour (samplers that did nothing wrong miss a version).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import mmap
import os
import re
import socket
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tpusync.core import Checksum64Stream, NotFoundError, PoolExhaustedError, checksum64
from tpusync.core.pd import PdConsumer, PdProducer, load_secret
from tpusync.core.pool import HostBlockPool
from tpusync.rl.chunks import (
    Chunk,
    UpdateRejectedError,
    VersionSkewError,
    WeightPublisher,
    WeightSubscriber,
    _as_torch,
    _torch_dtype,
    merge_runs,
)
from tpusync.rl.control import ControlClient, ControlServer
from tpusync.rl.layout import Box, ShardLayout
from tpusync.rl.manifest import Manifest
from tpusync.rl.pack import TRAILER, StreamPlan, pack_streams

log = logging.getLogger("tpusync.rl")

__all__ = ["PublishReport", "SamplerSync", "TrainerSync", "UpdateResult", "request_id"]

# Threads that pack and hash a trainer's blocks, and that hash an in-place shared-segment
# reader's blocks ahead of its staging copy: two keeps both cores of a 2-vCPU host busy while the
# samplers or the transport wait; more buys nothing once the copies saturate memory bandwidth.
FILL_THREADS = 2

_VERSION_BITS, _RANK_BITS, _CHILD_BITS, _BUCKET_BITS = 20, 10, 6, 18

# RE-PARENTING CONTRACT: buckets a trainer rank keeps registered, unacknowledged, per adopted
# orphan and stream (the orphan pulls them in order; more would only pin the trainer's pool).
REFILL_AHEAD = 3


def request_id(version: int, src: int, dst: int, child: int, bucket: int) -> int:
    """The transport request id of one bucket of stream (src -> dst) for one child of a sender.

    Unique per sender for 2**20 consecutive versions; ranks < 1024, fanout < 64, buckets < 2**18.
    """
    if not (0 <= src < 1 << _RANK_BITS and 0 <= dst < 1 << _RANK_BITS):
        raise ValueError(f"ranks must be below {1 << _RANK_BITS}: {src}, {dst}")
    if not 0 <= child < 1 << _CHILD_BITS:
        raise ValueError(f"fanout must be below {1 << _CHILD_BITS}")
    if not 0 <= bucket < 1 << _BUCKET_BITS:
        raise ValueError(f"a stream has more than {1 << _BUCKET_BITS} buckets: raise bucket size")
    v = version & ((1 << _VERSION_BITS) - 1)
    return (
        v << 44
        | src << (_CHILD_BITS + _BUCKET_BITS + _RANK_BITS)
        | dst << (_CHILD_BITS + _BUCKET_BITS)
        | child << _BUCKET_BITS
        | bucket
    )


def _decode_dst(rid: int) -> int:
    return (rid >> (_CHILD_BITS + _BUCKET_BITS)) & ((1 << _RANK_BITS) - 1)


def _decode_child(rid: int) -> int:
    return (rid >> _BUCKET_BITS) & ((1 << _CHILD_BITS) - 1)


def _layout_to_wire(layout: ShardLayout) -> list:
    return [list(layout.shape), [[r, list(b.lo), list(b.hi)] for r, b in layout.shards]]


def _layout_from_wire(raw: list) -> ShardLayout:
    shape, shards = raw
    return ShardLayout(tuple(shape), tuple((r, Box(tuple(lo), tuple(hi))) for r, lo, hi in shards))


def _key(replica: int, rank: int) -> str:
    return f"{replica}:{rank}"


def _process_identity() -> dict[str, Any]:
    """This process as a same-host peer can check it: pid, pid namespace and start time (clock
    ticks since boot, so a reused pid is told apart). Empty where /proc is not readable."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return {}
    return {"pid": os.getpid(), "pidns": ns, "started": started}


def _process_gone(ident: Mapping[str, Any]) -> bool:
    """True when the process ``ident`` (from :func:`_process_identity` in this pid namespace)
    has exited: no such pid, a zombie, or the pid now names a younger process."""
    try:
        with open(f"/proc/{int(ident['pid'])}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    except (OSError, ValueError, KeyError):
        return False  # cannot tell: the deadline decides, as for a remote sampler
    return fields[0] in ("Z", "X") or int(fields[19]) != int(ident.get("started", -1))


def _children(topo: list[int], replica: int | None, fanout: int) -> list[int]:
    """Replicas pulling from ``replica`` (None: the trainer) in a tree of degree ``fanout``."""
    first = 0 if replica is None else fanout * (topo.index(replica) + 1)
    return topo[first : first + fanout]


def _parent(topo: list[int], replica: int, fanout: int) -> tuple[int | None, int]:
    """(parent replica or None for the trainer, this replica's child index at the parent)."""
    i = topo.index(replica)
    if i < fanout:
        return None, i
    return topo[i // fanout - 1], i % fanout


class _Endpoint:
    """A host pool plus a P/D producer serving it (TCP, and a Unix socket for same-host peers)."""

    def __init__(
        self,
        secret: bytes,
        block_bytes: int,
        pool_bytes: int,
        listen: str,
        same_host: bool,
        streams: int,
    ) -> None:
        num = max(pool_bytes // block_bytes, 4)
        self._dir = tempfile.mkdtemp(prefix="tpusync-rl-") if same_host else None
        shm = f"tpusync-rl-{os.getpid()}-{uuid.uuid4().hex[:8]}" if same_host else None
        self.pool = HostBlockPool(block_bytes, num, shm_name=shm)
        unix = os.path.join(self._dir, "pd.sock") if self._dir else None
        self.producer = PdProducer(self.pool, listen=listen, unix_path=unix, secret=secret)
        self.consumer = PdConsumer(self.pool, streams=streams, secret=secret)
        self.address = {
            "tcp": self.producer.address,
            "unix": self.producer.unix_address,
            "host": socket.gethostname(),
            # Same-host peers may map this pool (SHARED-SEGMENT CONTRACT in the module doc).
            "shm": shm,
            # ...and notice at once when this process exits (EXIT WATCH CONTRACT, TrainerSync).
            "proc": _process_identity(),
        }
        # ACK LEDGER CONTRACT: the producer reports a terminal (done / failed) send once, to
        # whichever caller polls first. Every poll of this endpoint's producer goes through
        # :meth:`poll_sends`, which keeps terminal statuses here until their owner takes them
        # (:meth:`take_send`) or a new version starts (:meth:`forget_sends`). Rejected: polling
        # the producer directly from several places (the pool wait used to drop acknowledgements
        # that the trainer's ack wait then waited for until the version's deadline: the 61 s
        # stall of a 1 GiB publish whose data outgrew the trainer's pool).
        self._sent: dict[int, Any] = {}

    def peer(self, addr: Mapping[str, Any]) -> str:
        if addr.get("unix") and addr.get("host") == self.address["host"] and self._dir:
            return addr["unix"]
        return addr["tcp"]

    def poll_sends(self) -> list[Any]:
        """Poll the producer; terminal statuses go to the ledger. Returns the pending ones."""
        pending = []
        for st in self.producer.poll():
            if st.state == "pending":
                pending.append(st)
            else:
                self._sent[st.request_id] = st
        return pending

    def cancel_send(self, rid: int, why: str) -> None:
        """End send ``rid`` as failed now (CANCEL CONTRACT); one that already ended (acknowledged
        or expired) has nothing left to free."""
        try:
            self.producer.cancel(rid, why)
        except NotFoundError:
            pass

    def take_send(self, rid: int) -> Any | None:
        """The terminal status of send ``rid`` (removed from the ledger), None while pending."""
        return self._sent.pop(rid, None)

    def forget_sends(self) -> None:
        """Drop the ledger (statuses of earlier versions nobody waits for any more)."""
        self.poll_sends()
        self._sent.clear()

    def alloc(self, n: int, deadline: float, on_wait: Any = None) -> list[int]:
        """``n`` blocks, waiting for in-flight ones to be released until ``deadline``
        (``on_wait()`` runs in every round of the wait)."""
        while True:
            try:
                return self.pool.alloc(n)
            except PoolExhaustedError:
                if time.monotonic() >= deadline:
                    raise
                self.poll_sends()  # never drops an acknowledgement (ACK LEDGER CONTRACT)
                if on_wait is not None:
                    on_wait()
                time.sleep(0.002)

    def drain(self, timeout: float) -> int:
        """Serve registered sends until none is pending or ``timeout`` passes; returns how many
        are still pending (their consumers then see the producer go away)."""
        end = time.monotonic() + max(timeout, 0.0)
        while True:
            left = len(self.poll_sends())
            if left == 0 or time.monotonic() >= end:
                return left
            time.sleep(0.005)

    def close(self) -> None:
        self.producer.close()
        if self._dir:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
            self._dir = None


@dataclass
class _Refill:
    """What a publishing trainer rank needs to fill a bucket again for an adopted orphan: the
    version, its stream plans ``(src, dst) -> plan``, the local shards and their boxes per
    source rank; cursors and registrations per ``(orphan key, src)``."""

    version: int
    plans: Mapping[tuple[int, int], StreamPlan]
    local: Mapping[int, Mapping[str, torch.Tensor]]
    boxes: Mapping[int, Mapping[str, Box]]
    cursor: dict[tuple[str, int], int] = field(default_factory=dict)
    rids: dict[int, tuple[str, int]] = field(default_factory=dict)


@dataclass
class PublishReport:
    """What happened to one version: ``failed`` maps ``"replica:rank"`` to a reason."""

    version: int
    committed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    # Block bytes the trainer served: sent to its direct tree children (adopted orphans
    # included), plus read by each shared-segment reader.
    bytes_sent: int = 0
    # RE-PARENTING CONTRACT (rank 0): orphan "replica:rank" -> the failed parent it was moved
    # away from; the orphan got the rest of the version from the trainer.
    reparented: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class UpdateResult:
    version: int
    ok: bool
    reason: str | None = None
    seconds: float = 0.0
    bytes: int = 0
    forwarded_to: int = 0
    # How the bytes came: "shared-segment" (read from the trainer's /dev/shm pool), "unix" (P/D
    # same-host copy into this sampler's pool) or "tcp"; "" when nothing was pulled.
    path: str = ""


def _normalize(
    tensors: Mapping[str, Any], world: int, ranks: tuple[int, ...]
) -> dict[str, tuple[dict[int, Any], ShardLayout]]:
    """Every tensor as ``({local rank: local shard}, layout)``.

    A value is a plain tensor (held whole by every rank), ``(shard, layout)`` (this process holds
    one layout rank) or ``({rank: shard}, layout)`` (one shard per local layout rank).
    """
    out = {}
    for name, v in tensors.items():
        if isinstance(v, tuple):
            local, layout = v
        else:  # a plain tensor: every trainer rank holds all of it
            local, layout = v, ShardLayout.replicated(tuple(v.shape), range(world))
        if not isinstance(local, Mapping):
            local = {r: local for r in ranks}
        held = {r for r, _ in layout.shards}
        missing = [r for r in ranks if r in held and r not in local]
        if missing:
            raise ValueError(f"{name}: no local shard given for layout ranks {missing}")
        out[name] = ({r: local[r] for r in ranks if r in held}, layout)
    return out


def _partial(changed: Mapping[str, Any]) -> dict[str, tuple[tuple[int, int], ...]]:
    """The tensors of a changed set sent in part: name -> row runs (whole ones left out)."""
    return {n: tuple(runs) for n, runs in changed.items() if runs is not None}


def _first(tensors: Mapping[str, tuple[dict[int, Any], ShardLayout]]) -> dict[str, tuple]:
    """``(one local shard, layout)`` per tensor: what the manifest and delta digests look at."""
    out = {}
    for name, (local, layout) in tensors.items():
        if not local:
            raise ValueError(f"{name}: this process holds no shard of it")
        out[name] = (local[min(local)], layout)
    return out


class _ParentLost(Exception):
    """A sampler's parent in the fan-out tree no longer serves the version (RE-PARENTING)."""


class TrainerSync:
    """One trainer rank's publisher. Rank 0 also runs the control channel.

    ``dst_layouts`` is the sampler group's layout of every tensor, keyed by trainer name (a tensor
    missing from it is not sent). ``control`` is the address to listen on (rank 0, default an
    ephemeral loopback port) or rank 0's :attr:`control_address` (other ranks).

    MULTI-RANK CONTRACT: ``world`` counts the ranks of the trainer layouts. A process may hold
    several of them (``local_ranks``, e.g. one per device of a multi-controller JAX process; the
    default is ``(rank,)``); ``rank`` is then the smallest of them and the process holding layout
    rank 0 serves the control channel. Each process sends only the streams of its own ranks, from
    the shards it holds (:mod:`tpusync.rl.jax` builds these arguments from a pytree).

    AGREEMENT CONTRACT (``publish(..., delta=True)`` with several trainer processes): a tensor is
    in a delta when ANY rank's shard of it changed, and every rank sends its pieces of exactly
    that set. Each process digests all of its local shards and sends rank 0, over the signed
    control channel, its changed names, the version its digests describe (its last published
    version: the delta base) and whether it wants a full update (its own publish failed for
    someone). Rank 0 waits for every other process, until the version's deadline, then decides
    once for all: a delta of the union against its base only when every rank reported that same
    base, nobody (rank 0 included, which alone sees every sampler's report) asked for a full
    update, and every sampler polling for updates holds that base (LAGGING SAMPLERS below);
    otherwise a full update. It announces the decision as the manifest; the other ranks
    build theirs from it and refuse to send when they disagree. A rank that does not report in
    time fails the version on rank 0 (TimeoutError naming it), and the ranks waiting for the
    announcement are told at once (``abort``) instead of waiting for their deadline; no sampler
    is offered that version. Versions only grow on every rank; a report of a version rank 0
    already decided is refused. Rejected: each rank sending its own changed set (samplers would
    get pieces of a tensor from one rank but not the other, and commit a mix), and an all-gather
    through torch.distributed or jax (the trainer may use neither; the control channel is there).

    LAGGING SAMPLERS (rank 0, single- or multi-process): a sampler that polls with a version other
    than the delta base (it joined late, restarted, or missed a version) could not apply a delta
    (VersionSkewError), so rank 0 sends a full update instead and logs which samplers forced it.
    Rejected: sending the delta anyway (the sampler refuses it, and the full update that follows
    a failure may be announced before the sampler polls again, so it could lag version after
    version) and a full update for the laggard alone next to a delta for the rest (a second plan
    and set of buckets per version for a case that ends after one version).
    """

    def __init__(
        self,
        rank: int,
        world: int,
        dst_layouts: Mapping[str, ShardLayout],
        *,
        control: str | None = None,
        secret: bytes | None = None,
        fanout: int = 1,
        listen: str = "127.0.0.1:0",
        same_host: bool = False,
        block_bytes: int = 4 << 20,
        bucket_blocks: int = 8,
        pool_bytes: int = 512 << 20,
        deadline: float = 60.0,
        local_ranks: Sequence[int] | None = None,
        share: bool = True,
        silence: float = 10.0,
    ) -> None:
        """``share`` (with ``same_host``): same-host samplers read this process's pool directly
        (SHARED-SEGMENT CONTRACT) when it holds every trainer rank; False keeps them in the tree.
        ``silence`` (rank 0): seconds without a heartbeat after which a sampler in the middle of
        an update is presumed dead (HEARTBEAT CONTRACT); keep it well below ``deadline``."""
        if not silence > 0:
            raise ValueError(f"silence must be > 0 seconds, got {silence}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world {world}")
        if fanout < 1:
            raise ValueError("fanout must be >= 1")
        if bucket_blocks < 1 or max(pool_bytes // block_bytes, 4) < bucket_blocks:
            raise ValueError(
                f"a bucket of {bucket_blocks} blocks of {block_bytes} bytes does not fit the "
                f"{pool_bytes}-byte pool: raise pool_bytes or lower bucket_blocks"
            )
        ranks = tuple(sorted({int(r) for r in local_ranks})) if local_ranks else (rank,)
        if ranks[0] != rank or not all(0 <= r < world for r in ranks):
            raise ValueError(
                f"local ranks {ranks} must lie in [0, {world}) with {rank} the smallest"
            )
        self.rank, self.world, self.fanout = rank, world, fanout
        self.ranks = ranks
        self.deadline = deadline
        self.silence = silence
        self.block_bytes, self.bucket_blocks = block_bytes, bucket_blocks
        self._dst = dict(dst_layouts)
        self._secret = secret if secret is not None else load_secret()
        self._ep = _Endpoint(self._secret, block_bytes, pool_bytes, listen, same_host, 1)
        self._fillers = concurrent.futures.ThreadPoolExecutor(
            FILL_THREADS, thread_name_prefix="tpusync-rl-fill"
        )
        # CHUNK DELTA CONTRACT (tpusync.rl.chunks): a delta chunk is about one block of rows.
        self._pub = WeightPublisher(rank, chunk_bytes=block_bytes)
        self._lock = threading.Lock()
        self._members: dict[str, dict] = {}  # rank 0: "replica:rank" -> address
        self._have: dict[str, int] = {}  # rank 0: the version each sampler last said it has
        self._trainers: dict[int, dict] = {r: self._ep.address for r in ranks}
        self._announced: dict[int, dict] = {}
        self._reports: dict[int, dict[str, dict]] = collections.defaultdict(dict)
        self._force_full = False
        self._delta_used = False
        # AGREEMENT CONTRACT state (rank 0), under _lock: version -> {process rank: report};
        # versions given up on (-> why, told to the ranks that ask); the newest version decided.
        self._agreement: dict[int, dict[int, dict]] = collections.defaultdict(dict)
        self._aborted: dict[int, str] = {}
        self._decided = 0
        self._settled: dict[int, set[int]] = {}  # decided version -> the processes that reported
        # SHARED-SEGMENT CONTRACT state (rank 0 = the only process when sharing), under _lock:
        # (version, src, dst, bucket) -> {"ids", "offsets", "sums", "readers": set of keys};
        # long-polled bucket requests not yet answerable; the version being published.
        self._share = share and same_host and len(ranks) == world
        self._shared: dict[tuple[int, int, int, int], dict] = {}
        self._waiters: dict[tuple[int, int, int, int], list] = collections.defaultdict(list)
        self._sharing: int | None = None
        self._quit: set[str] = set()  # readers that reported a failure of the shared version
        self._next_watch = 0.0  # EXIT WATCH CONTRACT: when to look at same-host samplers again
        # HEARTBEAT CONTRACT (rank 0, under _lock): key -> when the sampler was last heard from
        # (a poll, a beat, idle or applying, or a report). Ranks > 0: when rank 0 was last asked
        # which samplers failed, and its answer.
        self._alive: dict[str, float] = {}
        self._collected = 0  # rank 0: the newest version whose reports were collected
        self._failed_past: dict[int, dict[str, str]] = {}  # failed samplers of collected versions
        # Ranks > 0: when rank 0 was last asked (and answered) about the version in flight, and
        # its answer: {"keys": failed samplers, "adopted": orphans, "over": bool}.
        self._asked: tuple[float, dict[str, Any]] = (0.0, {})
        self._answered = 0.0
        # RE-PARENTING CONTRACT (rank 0, under _lock): version -> orphan key -> {"slot", "rank",
        # "resume": {trainer rank: first bucket it lacks}, "parent": the failed parent's key}.
        self._adoptions: dict[int, dict[str, dict]] = collections.defaultdict(dict)
        # Every rank, while it publishes: what it needs to fill an orphan's buckets again.
        self._refill: _Refill | None = None
        self._progress = 0.0  # ranks > 0: when a send was last registered or acknowledged
        self._released: set[tuple[tuple[int, int, int, int], str]] = set()  # (slot, reader)
        self.metrics = {"versions_published": 0, "bytes_sent": 0, "last_publish_s": 0.0}
        # STAGE TIMES of the last publish (seconds on this rank's publishing thread): waiting for
        # free pool blocks, packing (device -> host copy into the pool + block hash), waiting for
        # the last acknowledgements. Where the time goes, for the bench and for tuning.
        self.stages = {"pool_wait_s": 0.0, "fill_s": 0.0, "ack_wait_s": 0.0}
        self._server: ControlServer | None = None
        self._client: ControlClient | None = None
        if rank == 0:
            self._server = ControlServer(
                self._secret, self._handle, listen=control or "tcp://127.0.0.1:0"
            )
        else:
            if not control:
                raise ValueError("trainer ranks > 0 need rank 0's control address")
            self._client = ControlClient(self._secret, control)
            for r in ranks:
                self._client.request(
                    {"op": "join", "kind": "trainer", "rank": r, "addr": self._ep.address},
                    timeout=deadline,
                )

    @property
    def control_address(self) -> str:
        if self._server is None:
            raise ValueError("only trainer rank 0 serves the control channel")
        return self._server.address

    @property
    def samplers(self) -> list[str]:
        with self._lock:
            return sorted(self._members)

    # ------------------------------------------------------------------ control (rank 0 only)

    def _handle(self, msg: dict, _answer: Any) -> dict | None:
        op = msg.get("op")
        with self._lock:
            if op == "join" and msg.get("kind") == "trainer":
                self._trainers[int(msg["rank"])] = msg["addr"]
                return {"op": "ok"}
            if op == "next":  # a sampler's poll; it (re)joins the group as a side effect
                key = _key(int(msg["replica"]), int(msg["rank"]))
                have = int(msg["have"])
                self._members[key] = msg["addr"]
                self._have[key] = have
                self._alive[key] = time.monotonic()
                newer = [v for v in self._announced if v > have]
                if newer:
                    ann = self._announced[max(newer)]
                    if key in ann["members"]:
                        return ann
                # The beat interval, for the sampler's heartbeat from its first poll on.
                return {"op": "none", "silence": self.silence}
            if op == "bye":  # a sampler closed cleanly: it leaves, it did not die (HEARTBEAT)
                key = _key(int(msg["replica"]), int(msg["rank"]))
                self._leave(key)
                return {"op": "ok"}
            if op == "beat":  # HEARTBEAT CONTRACT
                key = _key(int(msg["replica"]), int(msg["rank"]))
                version = int(msg["version"])
                if key in self._members:
                    self._alive[key] = time.monotonic()
                if version == 0:  # idle: alive, applying nothing
                    return {"op": "ok"}
                failed = self._failed(version)
                mine = self._reports.get(version, {}).get(key)
                if mine is not None:  # reported (a committed parent still serves its children)
                    if mine.get("ok"):
                        return {"op": "ok", "failed": sorted(failed)}
                    why = mine.get("reason") or "failed"
                    return {"op": "abort", "reason": f"trainer rank 0 counts {key} failed: {why}"}
                why = self._orphaned(version, key, failed)
                if why:  # RE-PARENTING CONTRACT: the sampler asks for a new source (``adopt``)
                    return {"op": "adopt", "reason": why, "failed": sorted(failed)}
                return {"op": "ok", "failed": sorted(failed)}
            if op == "adopt":  # RE-PARENTING CONTRACT: an orphan asks for a new source
                return self._adopt(msg)
            if op == "failed":  # a trainer rank > 0 asks which samplers to stop sending to
                version = int(msg["version"])
                return {
                    "op": "failed",
                    "keys": self._failed(version),
                    # RE-PARENTING CONTRACT: orphans it serves too, and whether it may stop.
                    "adopted": self._adoptions.get(version, {}),
                    "over": self._over(version),
                }
            if op == "get":
                version = int(msg["version"])
                if version in self._aborted:
                    return {"op": "abort", "reason": self._aborted[version]}
                ann = self._announced.get(version)
                return ann if ann is not None else {"op": "none"}
            if op == "delta":  # a trainer process's changed set (AGREEMENT CONTRACT)
                return self._record_changed(msg)
            if op == "report":
                key = _key(int(msg["replica"]), int(msg["rank"]))
                if key in self._members:
                    self._alive[key] = time.monotonic()
                self._record_report(int(msg["version"]), key, msg)
                return {"op": "ok"}
            if op in ("bucket", "release"):
                return self._shared_request(op, msg, _answer)
        return {"op": "error", "reason": f"unknown op {op!r}"}

    def _record_changed(self, msg: dict) -> dict:
        """A trainer process's delta report (lock held); a repeated one is accepted again."""
        version, rank = int(msg["version"]), int(msg["rank"])
        got = self._agreement.get(version, {})
        if rank in self._settled.get(version, ()):
            return {"op": "ok"}  # a retry whose first reply was lost
        if version in self._aborted:
            return {
                "op": "error",
                "reason": f"trainer rank 0 gave up on version {version}: {self._aborted[version]}",
            }
        if version <= self._decided and rank not in got:
            return {
                "op": "error",
                "reason": f"trainer rank 0 already decided version {version} (its newest is "
                f"{self._decided}): publish versions in the same order on every rank",
            }
        self._agreement[version][rank] = msg
        return {"op": "ok"}

    def _delta_possible(self, version: int) -> bool:
        """Rank 0: whether ``version`` may be a delta on this process's base: there is a base, no
        failure forces a full update, and every sampler polling for updates holds the base
        (LAGGING SAMPLERS; logged when one does not)."""
        base = self._pub.base_version
        if self._force_full or base is None:
            return False
        with self._lock:
            lagging = sorted(k for k in self._members if self._have.get(k, 0) != base)
        if lagging:
            log.info("version %d: samplers %s lack base %s: full update", version, lagging, base)
        return not lagging

    def _agree(
        self, version: int, mine: Mapping[str, Any], names: set[str], deadline: float
    ) -> dict[str, tuple[tuple[int, int], ...] | None] | None:
        """Rank 0: the union of every process's changed set (tensor -> changed row runs, None:
        whole), or None for a full update (AGREEMENT CONTRACT). Raises TimeoutError when a
        process did not report by ``deadline``."""
        want = set(range(self.world)) - set(self.ranks)
        while True:
            with self._lock:
                got = dict(self._agreement.get(version, {}))
            covered = {int(r) for m in got.values() for r in m.get("ranks", ())}
            if want <= covered:
                break
            if time.monotonic() >= deadline:
                missing = sorted(want - covered)
                raise TimeoutError(
                    f"delta agreement on version {version}: trainer ranks {missing} did not report "
                    f"their changed tensors within {self.deadline:.1f} s (every rank must call "
                    "publish with the same version and delta=True)"
                )
            time.sleep(0.005)
        base = self._pub.base_version
        full = not self._delta_possible(version)
        union: dict[str, Any] = dict(mine)
        for rank, m in sorted(got.items()):
            theirs = {str(n) for n in m.get("changed", ())}
            unknown = sorted(theirs - names)
            if unknown:
                raise ValueError(
                    f"delta agreement on version {version}: trainer rank {rank} changed tensors "
                    f"rank 0 does not publish: {unknown}"
                )
            # CHUNK DELTA CONTRACT: the row runs unite; whole on any rank is whole.
            rows = m.get("rows") or {}
            for name in theirs:
                runs = rows.get(name)
                if runs is None or (name in union and union[name] is None):
                    union[name] = None
                else:
                    union[name] = merge_runs([*(union.get(name) or ()), *map(tuple, runs)])
            if m.get("full") or m.get("base") != base:
                log.info(
                    "version %d: trainer rank %d has base %s, wants full %s (rank 0: base %s): "
                    "full update",
                    version,
                    rank,
                    m.get("base"),
                    bool(m.get("full")),
                    base,
                )
                full = True
        return None if full else union

    def _end_agreement(self, version: int, why: str | None) -> None:
        """Rank 0: ``version`` is decided (or given up on: ``why``); later reports are refused."""
        with self._lock:
            self._decided = max(self._decided, version)
            if why is not None:
                self._aborted[version] = why
            self._settled[version] = set(self._agreement.get(version, {}))
            for v in [v for v in self._agreement if v <= version]:
                del self._agreement[v]
            for old in (self._aborted, self._settled):
                for v in [v for v in old if v < version - 4]:
                    del old[v]

    def _report_changed(self, version: int, changed: Mapping[str, Any], deadline: float) -> None:
        """Ranks > 0: hand rank 0 this process's changed set (AGREEMENT CONTRACT) with the row
        runs of tensors changed only in part (CHUNK DELTA CONTRACT)."""
        assert self._client is not None
        msg = {
            "op": "delta",
            "version": version,
            "rank": self.rank,
            "ranks": list(self.ranks),
            "changed": sorted(changed),
            "rows": {n: [list(r) for r in runs] for n, runs in _partial(changed).items()},
            "base": self._pub.base_version,
            "full": self._force_full,
        }
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"trainer rank {self.rank}: rank 0 did not take the changed tensors of "
                    f"version {version} within {self.deadline:.1f} s"
                )
            try:
                self._client.request(msg, timeout=min(2.0, left))
                return
            except TimeoutError:
                continue

    def _leave(self, key: str) -> None:
        """Sampler ``key`` said goodbye (lock held): out of the group, not counted as dead; a
        version in flight that counted on it is told it left (it will not report)."""
        self._members.pop(key, None)
        self._have.pop(key, None)
        self._alive.pop(key, None)
        for version, ann in self._announced.items():
            if key in ann["members"] and key not in self._reports.get(version, {}):
                if version > self._collected:
                    why = f"sampler {key} closed (left the group) before applying version {version}"
                    self._record_report(version, key, {"ok": False, "reason": why})

    def _record_report(self, version: int, key: str, msg: dict) -> None:
        """Sampler ``key``'s outcome of ``version`` (lock held)."""
        self._reports[version][key] = msg
        if msg.get("ok"):  # it serves `version` now, before it polls again (LAGGING SAMPLERS)
            self._have[key] = max(self._have.get(key, 0), version)
        else:  # a reader that gave up holds no shared bucket any more
            self._release_reader(version, key)
            if self._sharing == version:
                self._quit.add(key)  # nor is it offered the buckets still to come

    def _failed(self, version: int) -> dict[str, str]:
        """Samplers that reported (or were found to have) failed ``version`` (lock held)."""
        return {
            **self._failed_past.get(version, {}),
            **{
                k: str(m.get("reason") or "failed")
                for k, m in self._reports.get(version, {}).items()
                if not m.get("ok")
            },
        }

    def _tree_parent(self, version: int, key: str) -> str | None:
        """``key``'s parent sampler in ``version``'s fan-out tree (None: the trainer, or not in
        the tree) (lock held)."""
        ann = self._announced.get(version)
        if ann is None:
            return None
        replica, rank = (int(x) for x in key.split(":"))
        topo = [int(x) for x in ann["topo"].get(rank, [])]
        if replica not in topo:
            return None
        parent, _slot = _parent(topo, replica, int(ann["fanout"]))
        return None if parent is None else _key(parent, rank)

    def _parent_gone(self, version: int, pkey: str, failed: Mapping[str, str]) -> str | None:
        """Why parent ``pkey`` no longer serves ``version`` to its children, None while it may
        (lock held): it failed the version; or it committed but is gone since (silent for
        ``silence``, left the group, or its same-host process exited: EXIT WATCH CONTRACT)."""
        if pkey in failed:
            return failed[pkey]
        ann = self._announced[version]
        last = self._alive.get(pkey)
        if last is None:
            return f"{pkey} left the group"
        if time.monotonic() - last > self.silence:
            return f"no heartbeat from {pkey} for {time.monotonic() - last:.1f} s"
        addr = ann["members"].get(pkey) or {}
        proc = addr.get("proc") or {}
        mine = self._ep.address
        if (
            proc
            and addr.get("host") == mine["host"]
            and proc.get("pidns") == mine["proc"].get("pidns")
            and _process_gone(proc)
        ):
            why = f"sampler process {proc['pid']} exited during the update"
            if pkey not in self._reports.get(version, {}):
                self._record_report(version, pkey, {"ok": False, "reason": why})
            return why
        return None

    def _orphaned(self, version: int, key: str, failed: Mapping[str, str]) -> str | None:
        """Why ``key`` must ask for a new source of ``version`` (lock held): its parent in the
        fan-out tree is gone and it was not re-parented yet. A failed grandparent is no reason:
        the parent itself is re-parented (RE-PARENTING CONTRACT)."""
        if key in self._adoptions.get(version, {}):
            return None
        pkey = self._tree_parent(version, key)
        if pkey is None:
            return None
        why = self._parent_gone(version, pkey, failed)
        return (
            f"its parent {pkey} in the fan-out tree failed version {version}: {why}"
            if why
            else None
        )

    def _adopt(self, msg: dict) -> dict:
        """RE-PARENTING CONTRACT (rank 0, lock held): an orphan's request for a new source.
        ``adopted`` with its child slot at every trainer rank once its parent is gone, ``wait``
        while the parent may still serve it, ``abort`` (with the reason) when it cannot be."""
        version = int(msg["version"])
        key = _key(int(msg["replica"]), int(msg["rank"]))
        ann = self._announced.get(version)
        if key in self._members:
            self._alive[key] = time.monotonic()
        if ann is None or version <= self._collected:
            return {"op": "abort", "reason": f"version {version} is over on trainer rank 0"}
        have = self._adoptions[version].get(key)
        if have is not None:  # a retry whose first reply was lost
            return {"op": "adopted", **have}
        if key in self._reports[version]:
            return {"op": "abort", "reason": f"{key} already reported version {version}"}
        pkey = self._tree_parent(version, key)
        if pkey is None:
            return {
                "op": "abort",
                "reason": f"{key} pulls version {version} from the trainer: no parent to replace",
            }
        why = self._parent_gone(version, pkey, self._failed(version))
        if why is None:
            return {"op": "wait"}
        rank = int(msg["rank"])
        slot = int(ann["fanout"]) + sum(
            1 for a in self._adoptions[version].values() if a["rank"] == rank
        )
        if slot >= 1 << _CHILD_BITS:
            return {
                "op": "abort",
                "reason": f"too many orphans of version {version} at sampler rank {rank} "
                f"(child slots end at {(1 << _CHILD_BITS) - 1})",
            }
        adoption = {
            "slot": slot,
            "rank": rank,
            "resume": {int(s): int(b) for s, b in msg["resume"].items()},
            "parent": pkey,
        }
        self._adoptions[version][key] = adoption
        log.warning(
            "version %d: sampler %s re-parented to the trainer (child slot %d): its parent %s is "
            "gone: %s",
            version,
            key,
            slot,
            pkey,
            why,
        )
        return {"op": "adopted", **adoption}

    def _over(self, version: int) -> bool:
        """Rank 0: every member of ``version`` reported (or it was collected): no orphan can
        need its buckets any more (lock held)."""
        ann = self._announced.get(version)
        if version <= self._collected or ann is None:
            return True
        return set(ann["members"]) <= set(self._reports.get(version, {}))

    def _watch_silence(self, ann: dict) -> None:
        """HEARTBEAT CONTRACT (rank 0): a member of ``ann``'s version that has not reported and
        has been silent for ``silence`` seconds (no poll, beat or report; whether it fetched the
        version or not) counts as failed."""
        if self._server is None:
            return
        version = int(ann["version"])
        now = time.monotonic()
        with self._lock:
            got = self._reports[version]
            for key in ann["members"]:
                last = self._alive.get(key)
                if key in got or last is None or now - last <= self.silence:
                    continue
                why = (
                    f"no heartbeat for {now - last:.1f} s (silence timeout {self.silence:g} s, "
                    "idle or during the update): sampler presumed dead"
                )
                self._record_report(version, key, {"ok": False, "reason": why})

    def _drop_failed(self, ann: dict, outstanding: dict[int, str], report: PublishReport) -> None:
        """HEARTBEAT CONTRACT: cancel this rank's sends to samplers that failed the version
        (found dead, or reported a failure), so their blocks are free again at once."""
        self._watch_exits(ann)
        version = int(ann["version"])
        if self._server is not None:
            with self._lock:
                failed = self._failed(version)
        else:
            failed = self._ask_failed(version)
        for rid in [r for r, k in outstanding.items() if k in failed]:
            key = outstanding.pop(rid)
            report.failed.setdefault(key, failed[key])
            self._ep.cancel_send(rid, f"sampler {key} failed version {version}")

    def _ask_failed(self, version: int) -> dict[str, str]:
        """Ranks > 0: rank 0's failed samplers of ``version`` (see :meth:`_ask_rank0`)."""
        return {str(k): str(v) for k, v in self._ask_rank0(version).get("keys", {}).items()}

    def _ask_rank0(self, version: int) -> dict[str, Any]:
        """Ranks > 0: rank 0's word on ``version``: failed samplers, adopted orphans and whether
        every member reported. Asked at most every 0.2 s, and while this rank's sends make
        progress (a registration or an acknowledgement in the last 0.5 s: a round trip to rank 0
        is not worth more while everyone keeps pulling) only every second, so an orphan waits at
        most about a second for this rank's first re-filled bucket (RE-PARENTING CONTRACT)."""
        when, last = self._asked
        now = time.monotonic()
        busy = now - self._progress < 0.5
        if now - when < (1.0 if busy else 0.2) or self._client is None:
            return last
        try:
            last = self._client.request({"op": "failed", "version": version}, timeout=1.0)
            self._answered = time.monotonic()
        except (TimeoutError, RuntimeError) as e:
            log.debug("trainer rank %d: asking rank 0 for failed samplers: %s", self.rank, e)
        self._asked = (time.monotonic(), last)
        return last

    def _version_over(self, ann: dict) -> bool:
        """Whether no orphan can need this rank's buckets of ``ann``'s version any more
        (RE-PARENTING CONTRACT): every member reported. A rank > 0 that has not heard from rank 0
        for the version's ``silence`` stops waiting (rank 0 gone: nobody can adopt)."""
        version = int(ann["version"])
        if self._server is not None:
            with self._lock:
                return self._over(version)
        if self._ask_rank0(version).get("over"):
            return True
        quiet = time.monotonic() - self._answered
        if quiet > float(ann.get("silence") or 10.0):
            log.warning(
                "trainer rank %d: no word from trainer rank 0 on version %d for %.1f s: "
                "stops serving orphans",
                self.rank,
                version,
                quiet,
            )
            return True
        return False

    def _adoptions_of(self, version: int) -> dict[str, dict]:
        """The orphans of ``version`` this rank serves (RE-PARENTING CONTRACT)."""
        if self._server is not None:
            with self._lock:
                return dict(self._adoptions.get(version, {}))
        return dict(self._ask_rank0(version).get("adopted") or {})

    def _serve_orphans(
        self, ann: dict, outstanding: dict[int, str], report: PublishReport, deadline: float
    ) -> None:
        """RE-PARENTING CONTRACT: fill again and register, as a late direct child at its child
        slot, the buckets each adopted orphan lacks, in bucket order, at most
        ``REFILL_AHEAD`` unacknowledged per orphan and stream. Never blocks on the pool: a round
        without free blocks leaves the rest to the next round (the main sends and
        acknowledgements free them)."""
        ctx = self._refill
        if ctx is None:
            return
        version = int(ann["version"])
        for key, ad in sorted(self._adoptions_of(version).items()):
            if key in report.failed:
                continue
            rank, slot = int(ad["rank"]), int(ad["slot"])
            resume = {int(s): int(b) for s, b in (ad.get("resume") or {}).items()}
            for s in self.ranks:
                plan = ctx.plans.get((s, rank))
                if plan is None or s not in resume:
                    continue
                cur = ctx.cursor.setdefault((key, s), resume[s])
                busy = sum(
                    1 for rid, ks in ctx.rids.items() if ks == (key, s) and rid in outstanding
                )
                while cur < len(plan.buckets) and busy < REFILL_AHEAD:
                    first, end = plan.buckets[cur]
                    try:
                        ids = self._ep.pool.alloc(end - first)
                    except PoolExhaustedError:
                        return
                    try:
                        sums = self._fill_bucket(
                            ids, plan, first, ctx.version, ctx.local[s], ctx.boxes[s]
                        )
                        rid = request_id(version, s, rank, slot, cur)
                        self._ep.producer.register_send(
                            rid, ids, max(deadline - time.monotonic(), 0), checksums=sums
                        )
                    finally:
                        self._ep.pool.free(ids)  # the producer holds its own reference
                    outstanding[rid] = key
                    ctx.rids[rid] = (key, s)
                    report.bytes_sent += (end - first) * self.block_bytes
                    self._progress = time.monotonic()
                    cur += 1
                    busy += 1
                    ctx.cursor[(key, s)] = cur

    def _watch_exits(self, ann: dict) -> None:
        """EXIT WATCH CONTRACT (rank 0): while a version is in flight, a shared-segment reader
        (same host and pid namespace) that has not reported is checked about every 50 ms; once
        its process has exited (gone, a zombie, or its pid reused: :func:`_process_gone`) it
        counts as having reported a failure at once, so the buckets it held are freed and the
        version ends without waiting for its deadline. Every other sampler, on any host, is found
        dead by its heartbeat silence (HEARTBEAT CONTRACT, checked here too) and its registered
        transport sends are cancelled, so the next version never starts on a pool still held for
        it. Rejected for shared readers: the heartbeat alone (its timeout waits seconds for a dead
        reader; the kernel knows at once)."""
        now = time.monotonic()
        if self._server is None or now < self._next_watch:
            return
        self._next_watch = now + 0.05
        self._watch_silence(ann)
        if not ann.get("shared"):
            return
        mine = self._ep.address
        version = int(ann["version"])
        readers = {_key(replica, int(r)) for r, reps in ann["shared"].items() for replica in reps}
        with self._lock:
            got = self._reports[version]
            for key, addr in ann["members"].items():
                proc = addr.get("proc") or {}
                if (
                    key not in readers
                    or key in got
                    or addr.get("host") != mine["host"]
                    or not proc
                    or proc.get("pidns") != mine["proc"].get("pidns")
                    or not _process_gone(proc)
                ):
                    continue
                why = f"sampler process {proc['pid']} exited during the update"
                self._record_report(version, key, {"ok": False, "reason": why})

    def _shared_request(self, op: str, msg: dict, answer: Any) -> dict | None:
        """A shared reader's ``bucket`` long poll or ``release`` (lock held)."""
        version, key = int(msg["version"]), str(msg["key"])
        # HOLD CHECK: a released bucket the trainer had already dropped (its deadline passed) may
        # have been refilled while the reader staged it; the reader is told and rejects the update.
        lost = [
            [src, dst, bucket]
            for src, dst, bucket in msg.get("release", ())
            if not self._release(version, int(src), int(dst), int(bucket), key)
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
        if entry is None and self._sharing == version:
            self._waiters[slot].append((key, answer))  # answered when the bucket is filled
            return None
        return {"op": "gone", "reason": f"bucket {slot} is not shared with {key} (any more)"}

    def _release(self, version: int, src: int, dst: int, bucket: int, key: str) -> bool:
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
            self._ep.pool.free(entry["ids"])
        return True

    def _release_reader(self, version: int, key: str) -> None:
        for v, s, r, b in [k for k in self._shared if k[0] == version]:
            self._release(v, s, r, b, key)

    def _offer(
        self, slot: tuple[int, int, int, int], ids: list[int], sums: list[int], readers: list[str]
    ) -> None:
        """Share a filled bucket with its same-host readers (SHARED-SEGMENT CONTRACT)."""
        pool = self._ep.pool
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
            entry["readers"] -= self._quit
            waiting = self._waiters.pop(slot, [])
            if entry["readers"]:
                pool.retain(ids)  # the sharing reference, dropped by the last release
                self._shared[slot] = entry
        reply = {"op": "bucket", "offsets": entry["offsets"], "sums": sums}
        for key, answer in waiting:
            answer(reply if key in entry["readers"] else {"op": "gone", "reason": "not a reader"})

    def _end_sharing(self, version: int) -> list[str]:
        """Drop every shared bucket of ``version``; returns the readers that still held one."""
        with self._lock:
            self._sharing = None
            self._quit.clear()
            self._released.clear()
            left = sorted(
                {k for s, e in self._shared.items() if s[0] == version for k in e["readers"]}
            )
            for slot in [s for s in self._shared if s[0] == version]:
                self._ep.pool.free(self._shared.pop(slot)["ids"])
            waiting = [a for ws in self._waiters.values() for _k, a in ws]
            self._waiters.clear()
        for answer in waiting:
            answer({"op": "gone", "reason": f"version {version} is over"})
        return left

    def _holding(self, version: int) -> set[str]:
        with self._lock:
            return {k for s, e in self._shared.items() if s[0] == version for k in e["readers"]}

    def wait_for_samplers(self, count: int, timeout: float) -> list[str]:
        """Block until ``count`` sampler ranks joined (TimeoutError after ``timeout`` s)."""
        end = time.monotonic() + timeout
        while len(self.samplers) < count:
            if time.monotonic() >= end:
                raise TimeoutError(
                    f"{len(self.samplers)} of {count} samplers joined: {self.samplers}"
                )
            time.sleep(0.01)
        return self.samplers

    def _announce(self, manifest: Manifest) -> dict:
        end = time.monotonic() + self.deadline
        while True:
            with self._lock:
                if len(self._trainers) == self.world:
                    break
            if time.monotonic() >= end:
                raise TimeoutError(f"only trainer ranks {sorted(self._trainers)} joined")
            time.sleep(0.01)
        with self._lock:
            # VERSION CONTRACT: a sampler that already has this version or a newer one is refused
            # (reported, left out of the tree) instead of being sent an older model.
            skewed = {
                k: self._have.get(k, 0)
                for k in self._members
                if self._have.get(k, 0) >= manifest.version
            }
            members = {k: a for k, a in self._members.items() if k not in skewed}
            mine = self._ep.address
            shared = {
                k
                for k, a in members.items()
                if self._share and mine["shm"] and a.get("shm") and a.get("host") == mine["host"]
            }
            topo: dict[int, list[int]] = collections.defaultdict(list)
            readers: dict[int, list[int]] = collections.defaultdict(list)
            # HEARTBEAT CONTRACT: a member already silent for `silence` (it died while idle) is
            # in no tree and no reader set, so no live sampler waits on it as a parent; it stays
            # a member, to be reported failed by the first silence check.
            now = time.monotonic()
            silent = {k for k in members if now - self._alive.get(k, now) > self.silence}
            for key in members:
                if key in silent:
                    continue
                replica, rank = (int(x) for x in key.split(":"))
                (readers if key in shared else topo)[rank].append(replica)
            ann = {
                "op": "announce",
                "version": manifest.version,
                "manifest": manifest.to_bytes(),
                "dst": {n: _layout_to_wire(lay) for n, lay in self._dst.items()},
                "block_bytes": self.block_bytes,
                "bucket_blocks": self.bucket_blocks,
                "deadline": self.deadline,
                "silence": self.silence,
                "fanout": self.fanout,
                "trainers": {t: a for t, a in self._trainers.items()},
                "members": members,
                "skewed": skewed,
                "topo": {r: sorted(v) for r, v in topo.items()},
                "shared": {r: sorted(v) for r, v in readers.items()},
            }
            if readers:
                self._sharing = manifest.version
            self._announced[manifest.version] = ann
            for old in [v for v in self._announced if v < manifest.version - 4]:
                del self._announced[old]
            for old in [v for v in self._failed_past if v < manifest.version - 4]:
                del self._failed_past[old]
            for old in [v for v in self._adoptions if v < manifest.version - 4]:
                del self._adoptions[old]
            return ann

    # ---------------------------------------------------------------------------- publishing

    def publish(
        self, version: int, tensors: Mapping[str, Any], delta: bool = False
    ) -> PublishReport:
        """Send ``version`` to every live sampler; returns when all are done or the deadline passed.

        ``tensors`` maps trainer names to ``(local shard, ShardLayout)`` or to plain tensors (held
        whole by every trainer rank). Every trainer rank calls this with the same version and the
        same ``delta``. With ``delta`` only tensors changed since the last published version are
        sent: on several trainer processes, those whose shard changed on ANY rank (AGREEMENT
        CONTRACT); a full update instead after a version some sampler failed, or when the ranks
        do not share one base.
        """
        t0 = time.monotonic()
        tensors = _normalize(tensors, self.world, self.ranks)
        view = _first(tensors)
        agree = delta and len(self.ranks) < self.world  # other processes hold ranks
        if not agree:
            # One process holds every rank: its own changed set, over all of its shards.
            use = delta and self._delta_possible(version)
            mine = self._pub.changed_rows(tensors) if use else {}
            manifest = self._pub.prepare(
                version, view, delta=use, changed=set(mine), rows=_partial(mine)
            )
        elif self.rank == 0:
            self._pub.check_next(version)  # before the agreement: an old version stays decided
            try:
                mine = self._pub.changed_rows(tensors)
                union = self._agree(version, mine, set(tensors), t0 + self.deadline)
                manifest = self._pub.prepare(
                    version,
                    view,
                    delta=union is not None,
                    changed=None if union is None else set(union),
                    rows=None if union is None else _partial(union),
                )
            except Exception as e:
                self._end_agreement(version, f"{type(e).__name__}: {e}")
                raise
            self._end_agreement(version, None)
            log.info(
                "version %d: %s",
                version,
                "full update"
                if manifest.base_version is None
                else f"delta of {len(manifest.tensors)} of {len(view)} tensors "
                f"({len(manifest.rows)} in changed rows only) on {manifest.base_version}",
            )
        else:
            self._pub.check_next(version)
            self._report_changed(version, self._pub.changed_rows(tensors), t0 + self.deadline)
        if self.rank == 0:
            ann = self._announce(manifest)
        else:
            ann = self._fetch_announcement(version, t0 + self.deadline)
            theirs = Manifest.from_bytes(ann["manifest"])
            if agree:  # build ours from rank 0's decision (AGREEMENT CONTRACT)
                names = {m.name for m in theirs.tensors}
                if not names <= set(view):
                    raise ValueError(
                        f"trainer rank {self.rank} disagrees with rank 0 on version {version}: "
                        f"rank 0 sends tensors this rank does not hold: {sorted(names - set(view))}"
                    )
                is_delta = theirs.base_version is not None
                manifest = self._pub.prepare(
                    version,
                    view,
                    delta=is_delta,
                    changed=names if is_delta else None,
                    rows=theirs.rows if is_delta else None,
                )
            if (
                [(m.name, m.dtype, m.layout) for m in theirs.tensors]
                != [(m.name, m.dtype, m.layout) for m in manifest.tensors]
                or theirs.base_version != manifest.base_version
                or theirs.rows != manifest.rows
            ):
                raise ValueError(
                    f"trainer rank {self.rank} disagrees with rank 0 on version {version}"
                )
        report = PublishReport(version)
        self._answered = time.monotonic()
        self.stages = dict.fromkeys(self.stages, 0.0)
        try:
            outstanding = self._send(ann, manifest, tensors, report, t0 + self.deadline)
            t1 = time.monotonic()
            self._wait_sent(outstanding, ann, report, t0 + self.deadline)
            self.stages["ack_wait_s"] = time.monotonic() - t1
        finally:
            self._refill = None
            for key in self._end_sharing(version):
                report.failed.setdefault(key, "did not read every shared bucket by the deadline")
        if self.rank == 0:
            self._collect(ann, report, t0 + self.deadline)
        # Digests of every local tensor are only worth a pass over the model once deltas are used.
        self._delta_used = self._delta_used or delta
        self._pub.published(manifest, tensors, digests=self._delta_used)
        self._force_full = bool(report.failed)
        report.seconds = time.monotonic() - t0
        self.metrics["versions_published"] += 1
        self.metrics["bytes_sent"] += report.bytes_sent
        self.metrics["last_publish_s"] = report.seconds
        for key, why in report.failed.items():
            log.error(
                "trainer rank %d: sampler %s failed version %d: %s", self.rank, key, version, why
            )
        return report

    def _fetch_announcement(self, version: int, end: float) -> dict:
        assert self._client is not None
        while time.monotonic() < end:
            try:
                reply = self._client.request(
                    {"op": "get", "version": version},
                    timeout=min(2.0, max(end - time.monotonic(), 0.05)),
                )
            except TimeoutError:
                continue
            if reply.get("op") == "announce":
                return reply
            if reply.get("op") == "abort":
                raise RuntimeError(
                    f"trainer rank 0 gave up on version {version}: {reply.get('reason')}"
                )
            time.sleep(0.005)
        raise TimeoutError(f"trainer rank 0 never announced version {version}")

    def _send(
        self,
        ann: dict,
        manifest: Manifest,
        tensors: Mapping[str, tuple[dict[int, Any], ShardLayout]],
        report: PublishReport,
        deadline: float,
    ) -> dict[int, str]:
        dst = {n: _layout_from_wire(raw) for n, raw in ann["dst"].items()}
        plans = pack_streams(manifest, dst, ann["block_bytes"], ann["bucket_blocks"])
        mine = {(s, r): p for (s, r), p in plans.items() if s in self.ranks}
        topo = {int(r): v for r, v in ann["topo"].items()}
        shared = {int(r): v for r, v in ann.get("shared", {}).items()}
        outstanding: dict[int, str] = {}
        self._ep.forget_sends()  # acknowledgements of earlier versions nobody waits for
        self._asked, self._progress = (0.0, {}), time.monotonic()
        # Round-robin over streams so every sampler rank progresses at once.
        # FLOW CONTROL CONTRACT (no wait cycle between trainer pools and sampler windows): every
        # trainer rank registers its buckets in the order (bucket index, destination rank) and
        # every sampler rank pulls in the order (bucket index, source rank), starting up to
        # ``window`` pulls at once; a started pull is acknowledged (and frees the trainer's
        # blocks) when its data landed, whatever the sampler's head is waiting for. A trainer
        # blocks in ``alloc`` only while its pool holds registered, unacknowledged buckets, i.e.
        # buckets beyond some sampler's window; that sampler waits on a bucket of a trainer whose
        # registered prefix is strictly shorter. Following these waits never returns to a trainer
        # already visited, so the trainer with the shortest registered prefix is never blocked
        # (every bucket in its pool lies inside a window and is being pulled) and the whole group
        # progresses. Rejected: one FIFO over all senders without this ordering (a window full of
        # one sender's far-ahead buckets could pin the pool another sender needs). The stall
        # seen at 1 GiB resharded was not such a cycle but lost acknowledgements (ACK LEDGER
        # CONTRACT in :class:`_Endpoint`).
        order = [
            (s, r, b)
            for b in range(max((len(p.buckets) for p in mine.values()), default=0))
            for (s, r) in sorted(mine)
            if b < len(mine[(s, r)].buckets) and (topo.get(r) or shared.get(r))
        ]
        local = {
            s: {n: _as_torch(shards[s]) for n, (shards, _) in tensors.items() if s in shards}
            for s in self.ranks
        }
        boxes = {
            s: {n: lay.box_of(s) for n, (shards, lay) in tensors.items() if s in shards}
            for s in self.ranks
        }
        # RE-PARENTING CONTRACT: until publish returns, this rank can fill any bucket again.
        self._refill = _Refill(manifest.version, mine, local, boxes)

        def between() -> None:
            self._drop_failed(ann, outstanding, report)
            self._serve_orphans(ann, outstanding, report, deadline)

        for n, (s, r, b) in enumerate(order):
            between()
            plan = mine[(s, r)]
            first, end = plan.buckets[b]
            t1 = time.monotonic()
            try:
                ids = self._ep.alloc(end - first, deadline, between)
            except PoolExhaustedError:
                # Children that never acknowledged hold the pool until the deadline: whoever has
                # not got every bucket by now fails this version (reported), nobody waits longer.
                for _s2, r2, _b2 in order[n:]:
                    for replica in _children(topo.get(r2, []), None, ann["fanout"]) + shared.get(
                        r2, []
                    ):
                        report.failed.setdefault(
                            _key(replica, r2), "trainer pool stayed full until the deadline"
                        )
                break
            t2 = time.monotonic()
            self.stages["pool_wait_s"] += t2 - t1
            try:
                # FILL CONTRACT: the blocks of a bucket are packed and hashed on FILL_THREADS
                # threads (the copy and the hash release the GIL), each block by one thread, so
                # a block's checksum is still taken right after that block was filled.
                sums = self._fill_bucket(ids, plan, first, manifest.version, local[s], boxes[s])
                self.stages["fill_s"] += time.monotonic() - t2
                readers = [_key(replica, r) for replica in shared.get(r, [])]
                if readers:
                    self._offer((manifest.version, s, r, b), ids, sums, readers)
                    report.bytes_sent += len(readers) * (end - first) * self.block_bytes
                for j, replica in enumerate(_children(topo.get(r, []), None, ann["fanout"])):
                    if _key(replica, r) in report.failed:
                        continue  # found dead or failed (HEARTBEAT CONTRACT): nobody would pull it
                    rid = request_id(manifest.version, s, r, j, b)
                    self._ep.producer.register_send(
                        rid, ids, max(deadline - time.monotonic(), 0), checksums=sums
                    )
                    outstanding[rid] = _key(replica, r)
                    report.bytes_sent += (end - first) * self.block_bytes
                    self._progress = time.monotonic()
            finally:
                self._ep.pool.free(ids)  # the producer holds its own reference until acked
        return outstanding

    def _fill_bucket(
        self,
        ids: list[int],
        plan: StreamPlan,
        first: int,
        version: int,
        local: Mapping[str, torch.Tensor],
        boxes: Mapping[str, Box],
    ) -> list[int]:
        """Fill pool blocks ``ids`` with blocks ``first ..`` of ``plan`` (FILL CONTRACT)."""
        n_blk = len(ids)
        return list(
            self._fillers.map(
                self._fill,
                ids,
                [plan] * n_blk,
                range(first, first + n_blk),
                [version] * n_blk,
                [local] * n_blk,
                [boxes] * n_blk,
            )
        )

    def _fill(
        self,
        block: int,
        plan: StreamPlan,
        index: int,
        version: int,
        local: Mapping[str, torch.Tensor],
        boxes: Mapping[str, Box],
    ) -> int:
        """Pack block ``index`` of ``plan`` into pool block ``block``; returns its checksum.

        BLOCK CHECKSUM CONTRACT: the one hash of the whole block (pieces, the padding between
        them and the trailer), checked at every hop. FUSED FILL: it is one streaming XXH3 fed in
        block order, and a piece whose source is a CPU tensor with contiguous rows (a whole
        tensor, or a resharded box: a gather) is copied into the block and hashed in the same
        pass (``Checksum64Stream.copy_update``); other sources (accelerator tensors, a strided
        innermost dimension) are copied by torch, then hashed from the block.
        Rejected: copy every piece, then ``checksum64`` of the block (a second read of every byte,
        a third of the trainer's CPU time on the shared same-host path).
        """
        bb = self.block_bytes
        arr = self._ep.pool.view(block)
        u8 = torch.from_numpy(arr)
        pieces = plan.blocks[index]
        h = Checksum64Stream()
        pos = 0
        for p in pieces:
            if p.offset > pos:
                h.update(arr[pos : p.offset])  # padding between pieces: whatever the block held
            src = local[p.name][boxes[p.name].local_slices(p.box)].detach()
            end = p.offset + p.nbytes
            dtype = _torch_dtype(p.dtype)
            if (
                src.device.type == "cpu"
                and src.dtype == dtype
                and (src.dim() == 0 or src.stride(-1) == 1 or src.shape[-1] == 1)
                and not (src.is_conj() or src.is_neg())  # lazy views: torch must resolve them
            ):
                # KEEP-IN-CACHE: the readers (shared segment, transport) read it right after.
                h.copy_update(arr[p.offset : end], src, keep_in_cache=True)
            else:
                out = u8[p.offset : end].view(dtype).view(p.box.shape)
                out.copy_(src)  # device -> host for accelerator tensors, gather for strided ones
                h.update(arr[p.offset : end])
            pos = end
        arr[bb - TRAILER :].view(np.uint64)[:] = (version, len(pieces))
        h.update(arr[pos:])
        return h.digest()

    def _wait_sent(
        self, outstanding: dict[int, str], ann: dict, report: PublishReport, deadline: float
    ) -> None:
        # Registrations for adopted orphans join ``outstanding`` as they are made.
        left = outstanding
        version = int(ann["version"])

        def busy() -> bool:
            # RE-PARENTING CONTRACT: until every member reported, an orphan may still need this
            # rank's buckets (the tensors are only held until publish returns).
            return bool(left) or bool(self._holding(version)) or not self._version_over(ann)

        while busy() and time.monotonic() < deadline + 1.0:
            # A sampler that reported a failure or was found dead gave up: its sends are cancelled.
            self._drop_failed(ann, left, report)
            self._serve_orphans(ann, left, report, deadline)
            self._ep.poll_sends()
            for rid in list(left):
                st = self._ep.take_send(rid)
                if st is None:
                    continue
                self._progress = time.monotonic()
                key = left.pop(rid)
                if st.failed and key not in report.failed:
                    report.failed[key] = f"transfer failed: {st.reason}"
            if left or self._holding(version):
                time.sleep(0.002)
            elif busy():
                time.sleep(0.01)  # only waiting for reports: no send to poll
        for key in left.values():
            report.failed.setdefault(key, "transfer not acknowledged by the deadline")

    def _collect(self, ann: dict, report: PublishReport, deadline: float) -> None:
        expected = set(ann["members"])
        version = ann["version"]
        while time.monotonic() < deadline:
            with self._lock:
                got = set(self._reports[version])
            if expected <= got:
                break
            self._watch_exits(ann)
            time.sleep(0.005)
        for key, have in ann.get("skewed", {}).items():
            report.failed[key] = (
                f"refused: version skew: sampler {key} already has version {have} >= {version}"
            )
        with self._lock:
            self._collected = max(self._collected, int(version))
            reports = self._reports.pop(version, {})
            for key in sorted(expected):
                rep = reports.get(key)
                if rep is not None and rep.get("ok"):
                    report.committed.append(key)
                    report.failed.pop(key, None)
                    continue
                why = (
                    rep.get("reason")
                    if rep is not None
                    else report.failed.get(key, "no report by the deadline (sampler presumed dead)")
                )
                report.failed[key] = why
                self._members.pop(key, None)  # out of the next tree until it polls again
                self._alive.pop(key, None)
            report.reparented = {
                k: str(a["parent"]) for k, a in self._adoptions.pop(version, {}).items()
            }
            # Parents still serving their children ask after the version ended (HEARTBEAT CONTRACT).
            self._failed_past[version] = {k: str(w) for k, w in report.failed.items()}

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._client is not None:
            self._client.close()
        self._fillers.shutdown(wait=True)
        self._ep.close()


class SamplerSync:
    """One sampler rank's receiver: polls trainer rank 0, pulls, forwards, verifies, commits.

    ``replica`` numbers this rank's sampler group (all ranks of one engine share it); the rank
    is ``subscriber.rank``. ``block_bytes`` must equal the trainer's.
    """

    def __init__(
        self,
        subscriber: WeightSubscriber,
        *,
        replica: int,
        control: str,
        secret: bytes | None = None,
        listen: str = "127.0.0.1:0",
        same_host: bool = False,
        block_bytes: int = 4 << 20,
        pool_bytes: int = 256 << 20,
        streams: int = 4,
        window: int = 4,
        poll_interval: float = 0.01,
    ) -> None:
        self.sub = subscriber
        self.replica = replica
        self._secret = secret if secret is not None else load_secret()
        self._ep = _Endpoint(self._secret, block_bytes, pool_bytes, listen, same_host, streams)
        self._client = ControlClient(self._secret, control)
        self._window = max(window, 1)
        self._poll = poll_interval
        self.history: list[UpdateResult] = []
        self._seen = subscriber.version  # newest version attempted (never retried)
        self._segment: tuple[str, np.ndarray, mmap.mmap] | None = None  # the trainer's pool
        self._hashers = concurrent.futures.ThreadPoolExecutor(
            FILL_THREADS, thread_name_prefix="tpusync-rl-hash"
        )
        # STAGE TIMES of the last update (seconds on the pulling thread): waiting for the head
        # bucket to land and verify (wire + transport), registering it for the children, staging
        # it (digest-free copy into the shadow / live weights, dtype cast, name mapping).
        # On the shared-segment path wire_wait_s is the wait for the trainer to fill a bucket
        # and stage_s includes verifying the trainer's blocks (shadow mode: in the staging pass).
        self.stages = {"wire_wait_s": 0.0, "forward_s": 0.0, "stage_s": 0.0}
        # HEARTBEAT CONTRACT: beats go over a client of their own (the pulling thread's long polls
        # and reports must not delay them); a beat reply may abort the update (_abort) or name
        # failed children, whose forwarded sends are then cancelled (state under _fwd_lock).
        self._control = control
        self._beat_client: ControlClient | None = None
        self._abort: str | None = None
        # RE-PARENTING CONTRACT: why this sampler's parent no longer serves the version in flight
        # (from a beat reply), until it was re-parented to the trainer.
        self._orphaned: str | None = None
        self._adopted = 0  # the version this sampler was re-parented in
        self._beating: tuple[threading.Thread, threading.Event] | None = None
        self._beat_lock = threading.Lock()
        self._beat_for: tuple[int, float, bool] | None = None  # (version, deadline, applied)
        self._beat_interval = 1.0
        self._joined = False  # polled trainer rank 0 at least once: say goodbye on close
        self._fwd_lock = threading.Lock()
        self._fwd: dict[int, list[int]] = {}  # child index -> request ids registered for it
        self._child_keys: dict[int, str] = {}
        self._dead_children: set[int] = set()
        self._fwd_version = 0

    @property
    def version(self) -> int:
        return self.sub.version

    def _start_beats(self, silence: Any) -> None:
        """HEARTBEAT CONTRACT: from this sampler's first poll until :meth:`close`, one thread
        beats every ``silence / 4`` seconds (the trainer's ``silence``, from its poll reply or
        announcement): an idle beat (version 0) while nothing is applied, a beat for the version
        while :meth:`_apply` runs and, after it, while forwarded sends are pending or until the
        version's deadline. A reply to a version's beat may abort that update (``_abort``) or
        name failed children, whose forwarded sends are then cancelled. Nothing when the trainer
        announced no silence timeout."""
        if not silence:
            return
        self._beat_interval = float(silence) / 4
        if self._beating is not None:
            return
        if self._beat_client is None:
            self._beat_client = ControlClient(self._secret, self._control)
        client, stop = self._beat_client, threading.Event()
        who = {"replica": self.replica, "rank": self.sub.rank}

        def run() -> None:
            while not stop.wait(self._beat_interval):
                with self._beat_lock:
                    cur = self._beat_for
                    if cur is not None and (
                        time.monotonic() >= cur[1] or (cur[2] and self._ep.producer.pending == 0)
                    ):
                        cur = self._beat_for = None  # the version is over here: idle beats
                version = cur[0] if cur is not None else 0
                try:
                    reply = client.request(
                        {"op": "beat", "version": version, **who},
                        timeout=max(self._beat_interval, 0.5),
                    )
                except (TimeoutError, RuntimeError) as e:
                    log.debug("sampler %d:%d: beat failed: %s", self.replica, self.sub.rank, e)
                    continue
                if not version:
                    continue
                if reply.get("op") == "abort":
                    with self._beat_lock:
                        if self._beat_for is not None and self._beat_for[0] == version:
                            self._abort = str(reply.get("reason") or "aborted by trainer rank 0")
                    continue
                if reply.get("op") == "adopt":  # RE-PARENTING CONTRACT: the parent is gone
                    with self._beat_lock:
                        if (
                            self._beat_for is not None
                            and self._beat_for[0] == version
                            and self._adopted != version
                        ):
                            self._orphaned = str(reply.get("reason") or "its parent is gone")
                if reply.get("failed"):
                    self._cancel_children(version, {str(k) for k in reply["failed"]})

        thread = threading.Thread(target=run, name="tpusync-rl-beat", daemon=True)
        thread.start()
        self._beating = (thread, stop)

    def _beat_version(self, version: int, deadline: float) -> None:
        """Beats name ``version`` from now until :meth:`_beat_done` and its forwarded sends end."""
        with self._beat_lock:
            self._abort = None
            self._orphaned = None
            self._beat_for = (version, deadline, False)

    def _beat_done(self) -> None:
        with self._beat_lock:
            if self._beat_for is not None:
                self._beat_for = (*self._beat_for[:2], True)

    def _stop_beats(self) -> None:
        if self._beating is not None:
            thread, stop = self._beating
            self._beating = None
            stop.set()
            thread.join(timeout=5)

    def _cancel_children(self, version: int, failed: set[str]) -> None:
        """Cancel every send forwarded to a child that failed ``version`` and forward it no more
        (HEARTBEAT CONTRACT): the blocks held for it go back to this sampler's pool at once."""
        with self._fwd_lock:
            for j, key in self._child_keys.items():
                if key not in failed or j in self._dead_children:
                    continue
                self._dead_children.add(j)
                for rid in self._fwd.get(j, ()):
                    self._ep.cancel_send(rid, f"child {key} failed version {version}")
                log.warning(
                    "sampler %d:%d: child %s failed version %d: forwarding to it stopped",
                    self.replica,
                    self.sub.rank,
                    key,
                    version,
                )

    def _check_abort(self) -> None:
        if self._abort is not None:
            raise UpdateRejectedError(self._abort)
        if self._orphaned is not None:
            raise _ParentLost(self._orphaned)

    def _cancel_forwards(self, version: int, why: str) -> None:
        """This sampler failed ``version``: end every send it forwarded, so its children stop
        waiting on it and ask trainer rank 0 for a new source (RE-PARENTING CONTRACT)."""
        with self._fwd_lock:
            if self._fwd_version != version:
                return
            for j, rids in self._fwd.items():
                if j in self._dead_children:
                    continue
                self._dead_children.add(j)
                for rid in rids:
                    self._ep.cancel_send(rid, f"forwarding sampler failed version {version}: {why}")

    def _adopt(
        self,
        version: int,
        me: int,
        parent: str,
        rest: list[tuple[int, int]],
        why: str,
        deadline: float,
    ) -> dict:
        """RE-PARENTING CONTRACT: ask trainer rank 0 for a new source of ``version``: the rest
        ``rest`` (``(source rank, bucket)`` in pull order) comes from the trainer ranks. Returns
        rank 0's adoption; raises UpdateRejectedError when the parent stays alive (rank 0 still
        hears from it ``2 * silence`` seconds on: the pull failed for another reason), when rank 0
        refuses, or at the deadline."""
        resume: dict[int, int] = {}
        for s, b in rest:
            resume.setdefault(s, b)
        silence = self._beat_interval * 4
        give_up = min(deadline, time.monotonic() + 2 * silence + 1.0)
        msg = {
            "op": "adopt",
            "version": version,
            "replica": self.replica,
            "rank": me,
            "resume": resume,
        }
        while True:
            if self._abort is not None:
                raise UpdateRejectedError(self._abort)
            left = deadline - time.monotonic()
            if left <= 0:
                raise UpdateRejectedError(
                    f"version {version}: lost its parent {parent} ({why}) and trainer rank 0 did "
                    "not re-parent it by the deadline"
                )
            try:
                reply = self._client.request(msg, timeout=min(2.0, left))
            except TimeoutError:
                continue
            except RuntimeError as e:
                raise UpdateRejectedError(f"version {version}: re-parenting refused: {e}") from e
            op = reply.get("op")
            if op == "adopted":
                with self._beat_lock:
                    self._orphaned = None
                    self._adopted = version
                log.warning(
                    "sampler %d:%d: parent %s lost (%s): pulls the rest of version %d from the "
                    "trainer",
                    self.replica,
                    me,
                    parent,
                    why,
                    version,
                )
                return reply
            if op != "wait":
                raise UpdateRejectedError(
                    f"version {version}: lost its parent {parent} ({why}) and trainer rank 0 "
                    f"cannot re-parent it: {reply.get('reason', reply)}"
                )
            if time.monotonic() >= give_up:
                raise UpdateRejectedError(
                    f"version {version}: pulling from parent {parent} failed ({why}) but trainer "
                    f"rank 0 still hears from it after {2 * silence + 1.0:.1f} s: not re-parented"
                )
            time.sleep(0.05)

    def update(self, timeout: float) -> UpdateResult | None:
        """Wait up to ``timeout`` s for a version newer than ours and apply it.

        Returns None when none was announced in time (or trainer rank 0 is unreachable): the
        current version keeps being served. Never raises for a failed update; the result says why.
        """
        end = time.monotonic() + timeout
        msg = {
            "op": "next",
            "replica": self.replica,
            "rank": self.sub.rank,
            "addr": self._ep.address,
        }
        while time.monotonic() < end:
            try:
                reply = self._client.request(
                    {**msg, "have": max(self.version, self._seen)},
                    timeout=min(2.0, max(end - time.monotonic(), 0.05)),
                )
            except (TimeoutError, RuntimeError) as e:  # rank 0 gone, slow, or refusing
                log.debug("sampler %d:%d: poll failed: %s", self.replica, self.sub.rank, e)
                time.sleep(self._poll)
                continue
            self._joined = True
            self._start_beats(reply.get("silence"))  # HEARTBEAT CONTRACT: from the first poll
            if reply.get("op") == "announce":
                self._seen = max(self._seen, int(reply["version"]))
                result = self._apply(reply)
                self.history.append(result)
                return result
            time.sleep(self._poll)
        return None

    def _report(self, result: UpdateResult) -> None:
        try:
            self._client.request(
                {
                    "op": "report",
                    "version": result.version,
                    "replica": self.replica,
                    "rank": self.sub.rank,
                    "ok": result.ok,
                    "reason": result.reason,
                    "seconds": result.seconds,
                },
                timeout=5.0,
            )
        except TimeoutError as e:
            log.warning(
                "sampler %d:%d: report of version %d lost: %s",
                self.replica,
                self.sub.rank,
                result.version,
                e,
            )

    def _apply(self, ann: dict) -> UpdateResult:
        t0 = time.monotonic()
        version = int(ann["version"])
        deadline = t0 + float(ann["deadline"])
        me = self.sub.rank
        try:
            manifest = Manifest.from_bytes(ann["manifest"])
            if ann["block_bytes"] != self._ep.pool.block_bytes:
                raise ValueError(
                    f"trainer block size {ann['block_bytes']} != this sampler's {self._ep.pool.block_bytes}"
                )
            self.sub.begin(manifest)
        except (VersionSkewError, ValueError, RuntimeError) as e:
            log.error("sampler %d:%d refuses version %d: %s", self.replica, me, version, e)
            result = UpdateResult(version, False, f"refused: {e}", time.monotonic() - t0)
            self._report(result)
            return result
        forwarded = 0
        path = ""
        self._start_beats(ann.get("silence"))
        self._beat_version(version, deadline)
        # Children of the previous version that are no members of this one failed it or left:
        # what was forwarded to them will not be pulled (HEARTBEAT CONTRACT).
        self._cancel_children(
            self._fwd_version, set(self._child_keys.values()) - set(ann["members"])
        )
        try:
            dst = {n: _layout_from_wire(raw) for n, raw in ann["dst"].items()}
            mine = self.sub.layouts_by_trainer_name(manifest)
            for name, lay in mine.items():
                if name in dst and dst[name] != lay:
                    raise UpdateRejectedError(
                        f"{name}: the trainer plans for sampler layout {dst[name]}, this group has {lay}"
                    )
            plans = pack_streams(manifest, dst, ann["block_bytes"], ann["bucket_blocks"])
            streams = {s: p for (s, r), p in plans.items() if r == me}
            if self.replica in ann.get("shared", {}).get(me, ()):
                path = "shared-segment"
                self._pull_shared(version, me, streams, ann["trainers"], deadline)
            else:
                topo = [int(x) for x in ann["topo"].get(me, [])]
                if self.replica not in topo:
                    raise UpdateRejectedError(
                        f"trainer rank 0 left this sampler out of version {version}'s tree "
                        "(it had not heard from it for its silence timeout: presumed dead)"
                    )
                parent, slot = _parent(topo, self.replica, ann["fanout"])
                children = _children(topo, self.replica, ann["fanout"])
                if parent is None:
                    peers = {s: self._ep.peer(ann["trainers"][s]) for s in streams}
                else:
                    addr = self._ep.peer(ann["members"][_key(parent, me)])
                    peers = {s: addr for s in streams}
                path = "unix" if any(p.startswith("unix:") for p in peers.values()) else "tcp"
                forwarded = self._pull(
                    version,
                    me,
                    streams,
                    peers,
                    slot,
                    children,
                    deadline,
                    parent=None if parent is None else _key(parent, me),
                    trainers=ann["trainers"],
                )
            committed = self.sub.commit()
            result = UpdateResult(
                committed,
                True,
                None,
                time.monotonic() - t0,
                sum(p.nbytes for p in streams.values()),
                forwarded,
                path,
            )
            log.info(
                "sampler %d:%d committed version %d in %.3f s",
                self.replica,
                me,
                version,
                result.seconds,
            )
        except Exception as e:  # noqa: BLE001 - any failure rejects this update, never the sampler
            self._cancel_forwards(version, str(e))  # RE-PARENTING CONTRACT: children move on
            self.sub.abort(str(e))
            log.error("sampler %d:%d rejects version %d: %s", self.replica, me, version, e)
            result = UpdateResult(version, False, str(e), time.monotonic() - t0, 0, forwarded, path)
        self._report(result)
        self._beat_done()  # beats name the version while forwarded sends are pending
        return result

    def _pull(
        self,
        version: int,
        me: int,
        streams: dict[int, StreamPlan],
        peers: dict[int, str],
        slot: int,
        children: list[int],
        deadline: float,
        parent: str | None = None,
        trainers: Mapping[Any, Mapping[str, Any]] | None = None,
    ) -> int:
        """Pull every bucket of ``streams`` from ``peers`` (the trainer ranks, or ``parent``'s
        endpoint), forwarding each to ``children`` and staging it. RE-PARENTING CONTRACT: when
        the parent sampler is lost (a pull from it failed, or a beat reply says it is gone), the
        buckets not staged yet are pulled again from ``trainers`` at the child slot trainer rank 0
        gives; a bucket is forwarded and staged once, whichever source it came from."""
        items = [
            (s, b)
            for b in range(max((len(p.buckets) for p in streams.values()), default=0))
            for s in sorted(streams)
            if b < len(streams[s].buckets)
        ]
        queue = collections.deque(items)
        flight: collections.deque = collections.deque()
        ep = self._ep
        ep.forget_sends()  # forwarded sends of earlier versions: nobody reads their statuses
        forwarded = 0
        stages = self.stages = dict.fromkeys(self.stages, 0.0)
        finished: dict[int, Any] = {}  # terminal statuses polled before their turn
        source = {"peers": dict(peers), "slot": slot, "parent": parent}
        with self._fwd_lock:
            self._fwd_version = version
            self._fwd = {j: [] for j in range(len(children))}
            self._child_keys = {j: _key(child, me) for j, child in enumerate(children)}
            self._dead_children = set()

        def start(block: bool = False) -> bool:
            s, b = queue[0]
            first, end = streams[s].buckets[b]
            # POOL CONTRACT: with buckets in flight, never block on the pool (only finishing them
            # frees blocks); with none, wait for the children's pulls to release forwarded ones.
            try:
                ids = (
                    ep.alloc(end - first, deadline, self._check_abort)
                    if block
                    else ep.pool.alloc(end - first)
                )
            except PoolExhaustedError:
                if block:
                    raise
                return False
            queue.popleft()
            rid = request_id(version, s, me, source["slot"], b)
            try:
                ep.consumer.start_recv(
                    rid, source["peers"][s], ids, deadline=max(deadline - time.monotonic(), 0)
                )
            except Exception:
                ep.pool.free(ids)
                raise
            flight.append((s, b, rid, ids))
            return True

        try:
            while queue or flight:
                try:
                    if not flight:
                        start(block=True)
                    while queue and len(flight) < self._window and start():
                        pass
                    s, b, rid, ids = flight[0]
                    t1 = time.monotonic()
                    st = self._wait(rid, finished, deadline)
                    stages["wire_wait_s"] += time.monotonic() - t1
                    if st.code == "NotFound" and time.monotonic() < deadline:
                        # A pull waits ~10 s for its registration; a sender still busy (a loaded
                        # host, a slow device -> host copy) is asked again until the deadline.
                        ep.consumer.start_recv(
                            rid,
                            source["peers"][s],
                            ids,
                            deadline=max(deadline - time.monotonic(), 0),
                        )
                        continue
                    if not st.done or len(st.checksums) != len(ids):
                        why = st.reason or st.state if not st.done else "no origin checksums"
                        if source["parent"] is not None:
                            raise _ParentLost(f"bucket {b} from {source['parent']}: {why}")
                        flight.popleft()
                        ep.pool.free(ids)
                        first, end = streams[s].buckets[b]
                        names = sorted(
                            {p.name for i in range(first, end) for p in streams[s].blocks[i]}
                        )
                        raise UpdateRejectedError(
                            f"bucket {b} ({', '.join(names)}) from trainer rank {s} via "
                            f"{source['peers'][s]}: {why}"
                        )
                    flight.popleft()
                except _ParentLost as lost:
                    if source["parent"] is None or trainers is None:
                        raise UpdateRejectedError(str(lost)) from None
                    # RE-PARENTING CONTRACT: drop the pulls from the lost parent (the transport
                    # keeps its own reference to their blocks until each receive ends) and pull
                    # what was not staged yet from the trainer ranks.
                    rest = [(s2, b2) for s2, b2, _r, _i in flight] + list(queue)
                    for _s, _b, _rid, old in flight:
                        ep.pool.free(old)
                    flight.clear()
                    adoption = self._adopt(
                        version, me, str(source["parent"]), rest, str(lost), deadline
                    )
                    queue.clear()
                    queue.extend(rest)
                    source["peers"] = {s2: ep.peer(trainers[s2]) for s2 in streams}
                    source["slot"] = int(adoption["slot"])
                    source["parent"] = None
                    continue
                while queue and len(flight) < self._window and start():
                    pass
                # Forward first (the children's pulls overlap our staging), then stage.
                t1 = time.monotonic()
                for j, _child in enumerate(children):
                    with self._fwd_lock:
                        if j in self._dead_children:
                            continue  # failed this version (HEARTBEAT CONTRACT)
                        # The trainer's checksums travel on: every hop checks the origin's hash.
                        fwd_rid = request_id(version, s, me, j, b)
                        ep.producer.register_send(
                            fwd_rid,
                            ids,
                            max(deadline - time.monotonic(), 0),
                            checksums=st.checksums,
                        )
                        self._fwd[j].append(fwd_rid)
                    forwarded += 1
                t2 = time.monotonic()
                stages["forward_s"] += t2 - t1
                try:
                    first, _ = streams[s].buckets[b]
                    for k, block in enumerate(ids):
                        self._stage(version, me, s, streams[s], first + k, block)
                finally:
                    ep.pool.free(ids)
                stages["stage_s"] += time.monotonic() - t2
        finally:
            for _s, _b, _rid, ids in flight:
                ep.pool.free(ids)  # the transport borrows them until the receive ends
        return forwarded

    def _wait(self, rid: int, finished: dict[int, Any], deadline: float) -> Any:
        """The terminal status of request ``rid`` (a consumer forgets a request once polled)."""
        while rid not in finished:
            self._check_abort()  # HEARTBEAT CONTRACT: a failed ancestor ends the wait at once
            try:
                st = self._ep.consumer.wait(
                    rid, timeout=min(max(deadline - time.monotonic(), 0.0), 0.2)
                )
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                continue
            except NotFoundError:
                if rid not in finished:
                    raise
            else:
                finished[rid] = st
            for other in self._ep.consumer.poll():  # forget terminal requests, keep their status
                if other.state != "pending":
                    finished[other.request_id] = other
        return finished.pop(rid)

    def _map_segment(self, name: str) -> np.ndarray:
        """The trainer's pool segment, mapped read-only once and kept across versions."""
        if self._segment is not None and self._segment[0] == name:
            return self._segment[1]
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name or ""):
            raise UpdateRejectedError(f"the trainer announced a bad shared segment name {name!r}")
        fd = os.open(os.path.join("/dev/shm", name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            seg = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._unmap()
        arr = np.frombuffer(seg, dtype=np.uint8)
        self._segment = (name, arr, seg)
        return arr

    def _unmap(self) -> None:
        if self._segment is not None:
            _name, arr, seg = self._segment
            self._segment = None
            del arr
            try:
                seg.close()
            except BufferError:  # a staged view still points into it: the GC unmaps it later
                pass

    def _pull_shared(
        self,
        version: int,
        me: int,
        streams: dict[int, StreamPlan],
        trainers: Mapping[Any, Mapping[str, Any]],
        deadline: float,
    ) -> None:
        """Stage every bucket straight out of the trainer's pool (SHARED-SEGMENT CONTRACT)."""
        key = _key(self.replica, me)
        bb = self._ep.pool.block_bytes
        stages = self.stages = dict.fromkeys(self.stages, 0.0)
        items = [
            (s, b)
            for b in range(max((len(p.buckets) for p in streams.values()), default=0))
            for s in sorted(streams)
            if b < len(streams[s].buckets)
        ]
        release: list[list[int]] = []

        def ask(msg: dict) -> dict:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"version {version}: the trainer's buckets did not come in time")
            return self._client.request(msg, timeout=min(2.0, left))

        try:
            with warnings.catch_warnings():
                # The segment is mapped read-only on purpose: staging only reads it.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                for s, b in items:
                    seg = self._map_segment(str(trainers[s].get("shm") or ""))
                    t1 = time.monotonic()
                    msg = {"op": "bucket", "version": version, "key": key, "src": s, "dst": me}
                    while True:
                        try:
                            reply = ask({**msg, "bucket": b, "release": release})
                        except TimeoutError:
                            if time.monotonic() >= deadline:
                                raise
                            continue  # a long poll outlived its request timeout: ask again
                        release = []
                        break
                    if reply.get("op") != "bucket":
                        raise UpdateRejectedError(
                            f"bucket {b} from trainer rank {s}: {reply.get('reason', reply)}"
                        )
                    release = [[s, me, b]]
                    t2 = time.monotonic()
                    stages["wire_wait_s"] += t2 - t1
                    first, _ = streams[s].buckets[b]
                    offsets = [int(off) for off in reply["offsets"]]
                    if any(not 0 <= off <= seg.nbytes - bb for off in offsets):
                        raise UpdateRejectedError(f"shared offsets {offsets} leave the segment")
                    # VERIFY CONTRACT of the shared segment. Shadow mode (staged bytes are not
                    # live before commit): FUSED STAGING, each block is staged and hashed in one
                    # pass (the staging copy feeds a streaming XXH3 of the whole block) and
                    # compared at the block's end; a mismatch raises and the update is aborted
                    # before commit, so unverified bytes only ever sit in shadow buffers.
                    # In-place mode (live weights): HASH-AHEAD, the bucket's blocks are hashed
                    # on worker threads while the blocks before them are staged, and a block is
                    # staged only after its own checksum matched. Rejected for shadow mode: the
                    # hash-ahead order (two reads of every byte per sampler).
                    fused = self.sub.mode == "shadow"
                    hashes = (
                        []
                        if fused
                        else [self._hashers.submit(checksum64, seg[o : o + bb]) for o in offsets]
                    )
                    for k, (off, want) in enumerate(zip(offsets, reply["sums"], strict=True)):
                        arr = seg[off : off + bb]
                        if fused:
                            h = Checksum64Stream()
                            self._stage_view(version, me, s, streams[s], first + k, arr, hasher=h)
                            ok = h.digest() == want
                        else:
                            ok = hashes[k].result() == want
                            if ok:
                                self._stage_view(version, me, s, streams[s], first + k, arr)
                        if not ok:
                            plan = streams[s]
                            names = sorted({p.name for p in plan.blocks[first + k]})
                            raise UpdateRejectedError(
                                f"bucket {b} ({', '.join(names)}) from trainer rank {s}: block "
                                f"{k} failed its checksum on the shared segment"
                            )
                    stages["stage_s"] += time.monotonic() - t2
            # HOLD CHECK (see TrainerSync._shared_request): the last bucket too must still have
            # been held by the trainer when this sampler finished staging it.
            done, release = release, []
            reply = ask({"op": "release", "version": version, "key": key, "release": done})
            if reply.get("op") != "ok" or reply.get("lost"):
                raise UpdateRejectedError(
                    f"the trainer did not hold buckets {reply.get('lost') or done} until this "
                    f"sampler released them: {reply.get('reason', 'deadline passed')}"
                )
        finally:
            if release:
                try:
                    self._client.request(
                        {"op": "release", "version": version, "key": key, "release": release},
                        timeout=2.0,
                    )
                except (TimeoutError, RuntimeError) as e:  # the trainer frees it by the deadline
                    log.debug("sampler %s: release of version %d lost: %s", key, version, e)

    def _stage(
        self, version: int, me: int, src: int, plan: StreamPlan, index: int, block: int
    ) -> None:
        self._stage_view(version, me, src, plan, index, self._ep.pool.view(block))

    def _stage_view(
        self,
        version: int,
        me: int,
        src: int,
        plan: StreamPlan,
        index: int,
        arr: np.ndarray,
        hasher: Checksum64Stream | None = None,
    ) -> None:
        """Stage the pieces of block ``index`` (the whole block ``arr``).

        Without ``hasher`` the block was verified already (transport, or hash-ahead). With it
        (shadow mode only) every byte of the block, pieces, padding and trailer, is fed to
        ``hasher`` in block order, each piece in the same pass as its staging copy where the
        subscriber can (see :meth:`WeightSubscriber.receive`); the caller compares the digest
        with the trainer's checksum and rejects the update on a mismatch.
        """
        bb = arr.nbytes
        pieces = plan.blocks[index]
        got_version, count = (int(x) for x in arr[bb - TRAILER :].view(np.uint64))
        if got_version != version or count != len(pieces):
            raise UpdateRejectedError(
                f"block {index} from trainer rank {src} carries version {got_version} with {count} "
                f"pieces, expected version {version} with {len(pieces)} (stale or foreign data)"
            )
        pos = 0
        for p in pieces:
            data = arr[p.offset : p.offset + p.nbytes]
            if hasher is not None and p.offset > pos:
                hasher.update(arr[pos : p.offset])
            pos = p.offset + p.nbytes
            if not self.sub.expects(p.name):
                if hasher is not None:
                    hasher.update(data)
                continue
            self.sub.receive(
                Chunk(
                    version,
                    p.name,
                    src,
                    me,
                    p.box,
                    p.dtype,
                    data,
                    None,  # verified as a whole block: by the transport, or through `hasher`
                ),
                hasher=hasher,
            )
        if hasher is not None:
            hasher.update(arr[pos:])

    def close(self, timeout: float = 30.0) -> None:
        """Stop. DRAIN CONTRACT: buckets this rank forwards to its children stay served until each
        child acknowledged them or ``timeout`` seconds pass (each send also ends at its version's
        deadline), so a parent that commits and closes first never cuts off a child still pulling
        the last buckets. Rejected: closing at once (the child's pull failed with "peer closed the
        connection" and it rejected a version its parent had committed)."""
        left = self._ep.drain(timeout)
        if left:
            log.warning(
                "sampler %s:%s: closing with %d forwarded sends unacknowledged",
                self.replica,
                self.sub.rank,
                left,
            )
        self._stop_beats()
        if self._joined:  # HEARTBEAT CONTRACT: a clean close leaves the group, it did not die
            try:
                self._client.request(
                    {"op": "bye", "replica": self.replica, "rank": self.sub.rank}, timeout=2.0
                )
            except (TimeoutError, RuntimeError) as e:  # rank 0 gone: nobody to tell
                log.debug("sampler %d:%d: goodbye lost: %s", self.replica, self.sub.rank, e)
        self._hashers.shutdown(wait=True)
        self._unmap()
        self._client.close()
        if self._beat_client is not None:
            self._beat_client.close()
        self._ep.close()
