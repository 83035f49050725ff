"""The network path of RL weight sync: trainer ranks publish versions, sampler ranks pull them.

Pieces (see :mod:`tpusync.rl.pack`) are packed into host pool blocks and moved by tpusync's P/D
streaming primitive (authenticated TCP with several streams per link, or a same-host /dev/shm
copy: :mod:`tpusync.rl.endpoint`); a small signed control channel (:mod:`tpusync.rl.control`) on
trainer rank 0 carries membership, version announcements and commit reports. This module is the
trainer side (:class:`TrainerSync`); :mod:`tpusync.rl.sampler` is the sampler side.

Where the other contracts of the network path live: FAN-OUT CONTRACT (the tree of each sampler
rank, request ids) in :mod:`tpusync.rl.topology`; SHARED-SEGMENT CONTRACT in
:mod:`tpusync.rl.sharing`; HEARTBEAT, EXIT WATCH and RE-PARENTING CONTRACTS in
:mod:`tpusync.rl.membership`; AGREEMENT CONTRACT (stated on :class:`TrainerSync`) in
:mod:`tpusync.rl.agreement`; ACK LEDGER CONTRACT in :mod:`tpusync.rl.endpoint`.

PIPELINE CONTRACT: a trainer rank fills bucket ``i + 1`` (device -> host copy and digests) while
the wire carries bucket ``i``: each bucket is registered with the transport the moment it is
filled, and samplers have already asked for the next ``window`` buckets (a pull waits for its
registration). A sampler stages bucket ``i`` (digest check, dtype cast, name mapping, shadow
copy) while buckets ``i + 1 ..`` are on the wire.

RESHARD CONTRACT: trainer rank ``t`` sends sampler rank ``r`` only the intersections of its
shards with ``r``'s shards (:class:`tpusync.rl.plan.ReshardPlan`); no process ever holds more of
a tensor than its own shard plus the buckets in flight.

FAULT CONTRACT: every wait has a deadline. A sampler that dies or fails an update is reported by
trainer rank 0 (:class:`PublishReport`) and dropped from the next version's tree until it polls
again; the others commit, its descendants in the fan-out tree included (RE-PARENTING CONTRACT: its
children get the rest of the version from the trainer). When the trainer dies, samplers' pulls fail
by their deadline and they keep serving the version they have. A digest mismatch or a stale block
rejects the update (logged, nothing committed); an announcement that does not follow the sampler's
version is refused."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tpusync.core import Checksum64Stream, PoolExhaustedError, StateError
from tpusync.core.pd import load_secret
from tpusync.rl.agreement import _Agreement, _partial
from tpusync.rl.chunks import WeightPublisher, _as_torch, _torch_dtype
from tpusync.rl.control import ControlClient, ControlServer
from tpusync.rl.endpoint import FILL_THREADS, _Endpoint, _process_gone, check_args
from tpusync.rl.layout import Box, ShardLayout, _layout_from_wire, _layout_to_wire
from tpusync.rl.manifest import Manifest
from tpusync.rl.membership import _Membership
from tpusync.rl.pack import TRAILER, StreamPlan, pack_streams
from tpusync.rl.reports import PublishReport, listed
from tpusync.rl.sharing import _SharedBuckets
from tpusync.rl.tensors import _first, _normalize
from tpusync.rl.topology import _children, _key, request_id

log = logging.getLogger("tpusync.rl")

__all__ = ["TrainerSync"]

# RE-PARENTING CONTRACT: buckets a trainer rank keeps registered, unacknowledged, per adopted
# orphan and stream (the orphan pulls them in order; more would only pin the trainer's pool).
REFILL_AHEAD = 3


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


def _gone_here(addr: Mapping[str, Any], mine: Mapping[str, Any]) -> bool:
    """Whether the process behind a member's address runs on this host and has exited (a
    restarted sampler then takes its key at once, not after the silence timeout)."""
    proc = addr.get("proc") or {}
    return (
        bool(proc)
        and addr.get("host") == mine.get("host")
        and proc.get("pidns") == (mine.get("proc") or {}).get("pidns")
        and _process_gone(proc)
    )


class TrainerSync:
    """One trainer rank's publisher. Rank 0 also runs the control channel.

    ``dst_layouts`` is the sampler group's layout of every tensor, keyed by trainer name (a tensor
    missing from it is not sent); None: the layouts the samplers report (SAMPLER LAYOUTS CONTRACT
    below; only rank 0's matters, the other ranks take rank 0's announcement). ``control`` is the
    address to listen on (rank 0, default an ephemeral loopback port) or rank 0's
    :attr:`control_address` (other ranks).

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

    SAMPLER LAYOUTS CONTRACT (``dst_layouts=None``): each sampler reports its group's layouts,
    keyed by trainer name, with its polls until rank 0 acknowledges them (a
    :class:`~tpusync.rl.sampler.SamplerSync` built with ``layouts=``, or whose subscriber uses the
    trainer's names; a vLLM engine's workers report the slices vLLM's own loaders keep, so no
    model-specific plan is needed on the trainer). Each version is planned for the layouts most of
    its live members reported (a tie: those of the smallest "replica:rank" key); a member that
    reported others is logged and refuses the version as with a wrong ``dst_layouts`` (its
    layouts disagree with the plan), so nothing is ever loaded wrong. ``publish`` raises
    ValueError before it prepares anything when no member has reported layouts (call
    :meth:`wait_for_samplers` first; the same version can then be published, and the other
    trainer ranks, waiting for its announcement until their deadline, take it); if the members
    that had reported leave before the announcement, the version fails and the other ranks are
    told at once. Rejected: the
    trainer computing the engine's slices from its config (``tpusync.rl.vllm.tp_layouts``, kept
    for planning ahead of the samplers: it knows only the Llama-family names, and a model whose
    checkpoint names it misreads is refused by every worker).

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
        dst_layouts: Mapping[str, ShardLayout] | None,
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
        check_args(
            "TrainerSync",
            {"silence": silence, "deadline": deadline},
            rank=rank,
            world=world,
            fanout=fanout,
            block_bytes=block_bytes,
            bucket_blocks=bucket_blocks,
            pool_bytes=pool_bytes,
        )
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
        self.block_bytes, self.bucket_blocks = block_bytes, bucket_blocks
        self._dst = None if dst_layouts is None else dict(dst_layouts)
        self._secret = secret if secret is not None else load_secret()
        self._ep = _Endpoint(self._secret, block_bytes, pool_bytes, listen, same_host, 1)
        self._fillers = concurrent.futures.ThreadPoolExecutor(
            FILL_THREADS, thread_name_prefix="tpusync-rl-fill"
        )
        # CHUNK DELTA CONTRACT (tpusync.rl.chunks): a delta chunk is about one block of rows.
        self._pub = WeightPublisher(rank, chunk_bytes=block_bytes)
        self._lock = threading.Lock()
        self._trainers: dict[int, dict] = {r: self._ep.address for r in ranks}
        self._force_full = False
        self._delta_used = False
        # AGREEMENT CONTRACT state (rank 0), under _lock.
        self._agreement = _Agreement(self._lock, self._pub, rank, world, ranks)
        # SHARED-SEGMENT CONTRACT state (rank 0 = the only process when sharing), under _lock.
        self._share = share and same_host and len(ranks) == world
        self._shares = _SharedBuckets(self._lock, self._ep.pool)
        # Rank 0's sampler group (members, HEARTBEAT CONTRACT, reports, RE-PARENTING CONTRACT),
        # under _lock.
        self._group = _Membership(self._lock, silence, self._ep.address, self._shares)
        # Ranks > 0: when rank 0 was last asked (and answered) about the version in flight, and
        # its answer: {"keys": failed samplers, "adopted": orphans, "over": bool}.
        self._asked: tuple[float, dict[str, Any]] = (0.0, {})
        self._answered = 0.0
        # Every rank, while it publishes: what it needs to fill an orphan's buckets again.
        self._refill: _Refill | None = None
        self._progress = 0.0  # ranks > 0: when a send was last registered or acknowledged
        self.metrics = {"versions_published": 0, "bytes_sent": 0, "last_publish_s": 0.0}
        # STAGE TIMES of the last publish (seconds on this rank's publishing thread): waiting for
        # free pool blocks, packing (device -> host copy into the pool + block hash), waiting for
        # the last acknowledgements. Where the time goes, for the bench and for tuning.
        self.stages = {"pool_wait_s": 0.0, "fill_s": 0.0, "ack_wait_s": 0.0}
        self._closed = False
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
    def silence(self) -> float:
        """Seconds without a heartbeat after which a sampler in an update is presumed dead (rank
        0, HEARTBEAT CONTRACT); the announcements carry it to the samplers."""
        return self._group.silence

    @silence.setter
    def silence(self, value: float) -> None:
        self._group.silence = value

    @property
    def samplers(self) -> list[str]:
        with self._lock:
            return sorted(self._group.members)

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
                if msg.get("layouts") is not None:  # SAMPLER LAYOUTS CONTRACT
                    try:
                        self._group.set_layouts(key, msg["layouts"])
                    except ValueError as e:
                        log.error("trainer rank 0: %s", e)
                        return {"op": "error", "reason": str(e)}
                held = self._group.members.get(key)
                heard = self._group.alive.get(key, 0.0)
                if (
                    held is not None
                    and held != msg["addr"]
                    and time.monotonic() - heard < self.silence
                    and not _gone_here(held, self._ep.address)
                ):
                    # ONE PROCESS PER KEY: a second sampler under a live sampler's (replica,
                    # rank) took its place in the announcements, and one of the two failed
                    # every version while publish reported success. A restarted sampler gets
                    # the key once the old one is silent for `silence` seconds.
                    return {
                        "op": "error",
                        "reason": f"sampler {key} is already a live member at "
                        f"{held.get('tcp')} (pid {(held.get('proc') or {}).get('pid')}): every "
                        "sampler process needs its own (replica, rank)",
                    }
                self._group.members[key] = msg["addr"]
                self._group.have[key] = have
                self._group.alive[key] = time.monotonic()
                newer = [v for v in self._group.announced if v > have]
                if newer:
                    ann = self._group.announced[max(newer)]
                    if key in ann["members"]:
                        return ann
                # The beat interval, for the sampler's heartbeat from its first poll on; whether
                # its layouts are known (it stops sending them).
                known = key in self._group.layouts
                return {"op": "none", "silence": self.silence, "layouts_known": known}
            if op == "bye":  # a sampler closed cleanly: it leaves, it did not die (HEARTBEAT)
                key = _key(int(msg["replica"]), int(msg["rank"]))
                self._group.leave(key)
                return {"op": "ok"}
            if op == "beat":  # HEARTBEAT CONTRACT
                key = _key(int(msg["replica"]), int(msg["rank"]))
                version = int(msg["version"])
                if key in self._group.members:
                    self._group.alive[key] = time.monotonic()
                if version == 0:  # idle: alive, applying nothing
                    return {"op": "ok"}
                failed = self._group.failed(version)
                mine = self._group.reports.get(version, {}).get(key)
                if mine is not None:  # reported (a committed parent still serves its children)
                    if mine.get("ok"):
                        return {"op": "ok", "failed": sorted(failed)}
                    why = mine.get("reason") or "failed"
                    return {"op": "abort", "reason": f"trainer rank 0 counts {key} failed: {why}"}
                why = self._group.orphaned(version, key, failed)
                if why:  # RE-PARENTING CONTRACT: the sampler asks for a new source (``adopt``)
                    return {"op": "adopt", "reason": why, "failed": sorted(failed)}
                return {"op": "ok", "failed": sorted(failed)}
            if op == "adopt":  # RE-PARENTING CONTRACT: an orphan asks for a new source
                return self._group.adopt(msg)
            if op == "failed":  # a trainer rank > 0 asks which samplers to stop sending to
                version = int(msg["version"])
                return {
                    "op": "failed",
                    "keys": self._group.failed(version),
                    # RE-PARENTING CONTRACT: orphans it serves too, and whether it may stop.
                    "adopted": self._group.adoptions.get(version, {}),
                    "over": self._group.over(version),
                }
            if op == "get":
                version = int(msg["version"])
                if version in self._agreement.aborted:
                    return {"op": "abort", "reason": self._agreement.aborted[version]}
                ann = self._group.announced.get(version)
                return ann if ann is not None else {"op": "none"}
            if op == "delta":  # a trainer process's changed set (AGREEMENT CONTRACT)
                return self._agreement.record(msg)
            if op == "report":
                key = _key(int(msg["replica"]), int(msg["rank"]))
                if key in self._group.members:
                    self._group.alive[key] = time.monotonic()
                self._group.record_report(int(msg["version"]), key, msg)
                return {"op": "ok"}
            if op in ("bucket", "release"):
                return self._shares.request(op, msg, _answer)
        return {"op": "error", "reason": f"unknown op {op!r}"}

    def _delta_possible(self, version: int) -> bool:
        """Rank 0: whether ``version`` may be a delta on this process's base: there is a base, no
        failure forces a full update, and every sampler polling for updates holds the base
        (LAGGING SAMPLERS; logged when one does not)."""
        base = self._pub.base_version
        if self._force_full or base is None:
            return False
        with self._lock:
            lagging = sorted(k for k in self._group.members if self._group.have.get(k, 0) != base)
        if lagging:
            log.info("version %d: samplers %s lack base %s: full update", version, lagging, base)
        return not lagging

    def _drop_failed(self, ann: dict, outstanding: dict[int, str], report: PublishReport) -> None:
        """HEARTBEAT CONTRACT: cancel this rank's sends to samplers that failed the version
        (found dead, or reported a failure), so their blocks are free again at once."""
        self._watch_exits(ann)
        version = int(ann["version"])
        if self._server is not None:
            with self._lock:
                failed = self._group.failed(version)
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
                return self._group.over(version)
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
                return dict(self._group.adoptions.get(version, {}))
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
        """EXIT WATCH and HEARTBEAT CONTRACTS, rank 0 only (:meth:`_Membership.watch_exits`)."""
        if self._server is not None:
            self._group.watch_exits(ann)

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

    def _check_layouts_known(self, version: int) -> None:
        """SAMPLER LAYOUTS CONTRACT: refuse ``version`` before anything is prepared (so the same
        version can be published again once samplers reported) when no member reported layouts."""
        with self._lock:
            members = sorted(self._group.members)
            known = any(k in self._group.layouts for k in members)
        if not known:
            raise ValueError(
                f"version {version}: dst_layouts=None, and none of the {len(members)} samplers "
                f"in the group {members} has reported its layouts (call wait_for_samplers first, "
                "or pass dst_layouts)"
            )

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
                k: self._group.have.get(k, 0)
                for k in self._group.members
                if self._group.have.get(k, 0) >= manifest.version
            }
            members = {k: a for k, a in self._group.members.items() if k not in skewed}
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
            silent = {k for k in members if now - self._group.alive.get(k, now) > self.silence}
            for key in members:
                if key in silent:
                    continue
                replica, rank = (int(x) for x in key.split(":"))
                (readers if key in shared else topo)[rank].append(replica)
            dst = self._dst
            if dst is None:  # SAMPLER LAYOUTS CONTRACT
                dst, odd = self._group.group_layouts(k for k in members if k not in silent)
                if dst is None:
                    raise ValueError(
                        f"version {manifest.version}: dst_layouts=None, and none of the "
                        f"{len(members) - len(silent)} live samplers has reported its layouts "
                        "(call wait_for_samplers first, or pass dst_layouts)"
                    )
                if odd:
                    log.warning(
                        "version %d: samplers %s reported layouts other than the group's; they "
                        "will refuse this version",
                        manifest.version,
                        odd,
                    )
            ann = {
                "op": "announce",
                "version": manifest.version,
                "manifest": manifest.to_bytes(),
                "dst": {n: _layout_to_wire(lay) for n, lay in dst.items()},
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
                self._shares.sharing = manifest.version
            self._group.announced[manifest.version] = ann
            for old in [v for v in self._group.announced if v < manifest.version - 4]:
                del self._group.announced[old]
            for old in [v for v in self._group.failed_past if v < manifest.version - 4]:
                del self._group.failed_past[old]
            for old in [v for v in self._group.adoptions if v < manifest.version - 4]:
                del self._group.adoptions[old]
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
        if self._closed:
            raise StateError(f"TrainerSync rank {self.rank} is closed: publish({version}) refused")
        if self.rank == 0 and self._dst is None:
            self._check_layouts_known(version)
        tensors = _normalize(tensors, self.world, self.ranks)
        if not delta and self._dst is not None:
            # FULL UPDATE RULE: a full version is the whole model dst_layouts plans. A tensor it
            # names but this publish lacks was simply not sent, and every sampler committed the
            # version with that tensor at its old value beside the new ones, reporting success.
            missing = sorted(set(self._dst) - set(tensors))
            if missing:
                raise ValueError(
                    f"publish({version}): dst_layouts plans {listed(missing)}, which this full "
                    "update does not hold (the samplers would keep their old values): publish "
                    "them too, leave them out of dst_layouts, or use delta=True"
                )
        for name, (_, layout) in tensors.items():  # before anything is announced
            theirs = (self._dst or {}).get(name)
            if theirs is not None and tuple(theirs.shape) != tuple(layout.shape):
                raise ValueError(
                    f"{name}: the trainer publishes shape {tuple(layout.shape)}, dst_layouts "
                    f"plans the samplers for {tuple(theirs.shape)}"
                )
        view = _first(tensors)
        agree = delta and len(self.ranks) < self.world  # other processes hold ranks
        # Digests of every local tensor are only worth a pass over the model once deltas are
        # used; they are taken before anything is read for the send (SNAPSHOT RULE, chunks.py).
        keep = self._delta_used or delta
        taken = self._pub.digests(tensors) if keep else None
        if not agree:
            # One process holds every rank: its own changed set, over all of its shards.
            use = delta and self._delta_possible(version)
            mine = self._pub.changed_rows(tensors, taken) if use else {}
            manifest = self._pub.prepare(
                version, view, delta=use, changed=set(mine), rows=_partial(mine)
            )
        elif self.rank == 0:
            self._pub.check_next(version)  # before the agreement: an old version stays decided
            try:
                mine = self._pub.changed_rows(tensors, taken)
                union = self._agreement.agree(
                    version,
                    mine,
                    set(tensors),
                    t0 + self.deadline,
                    self.deadline,
                    self._delta_possible,
                )
                manifest = self._pub.prepare(
                    version,
                    view,
                    delta=union is not None,
                    changed=None if union is None else set(union),
                    rows=None if union is None else _partial(union),
                )
            except Exception as e:
                self._agreement.end(version, f"{type(e).__name__}: {e}")
                raise
            self._agreement.end(version, None)
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
            assert self._client is not None
            self._agreement.report(
                self._client,
                version,
                self._pub.changed_rows(tensors, taken),
                t0 + self.deadline,
                self.deadline,
                self._force_full,
            )
        if self.rank == 0:
            try:
                ann = self._announce(manifest)
            except Exception as e:
                # The other ranks wait for this announcement: they are told at once.
                self._agreement.end(version, f"{type(e).__name__}: {e}")
                raise
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
        except BaseException:
            # Announced, then failed: in-place samplers may hold part of it (dirty), so the next
            # version goes out whole, never as a delta on the old base (DIRTY RULE, chunks.py).
            self._force_full = True
            raise
        finally:
            self._refill = None
            for key in self._shares.end(version):
                report.failed.setdefault(key, "did not read every shared bucket by the deadline")
        if self.rank == 0:
            self._collect(ann, report, t0 + self.deadline)
        self._delta_used = keep
        self._pub.published(manifest, tensors, digests=keep, taken=taken)
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
                    self._shares.offer((manifest.version, s, r, b), ids, sums, readers)
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
            return bool(left) or bool(self._shares.holding(version)) or not self._version_over(ann)

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
            if left or self._shares.holding(version):
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
                got = set(self._group.reports[version])
            if expected <= got:
                break
            self._watch_exits(ann)
            time.sleep(0.005)
        for key, have in ann.get("skewed", {}).items():
            report.failed[key] = (
                f"refused: version skew: sampler {key} already has version {have} >= {version}"
            )
        with self._lock:
            self._group.collected = max(self._group.collected, int(version))
            reports = self._group.reports.pop(version, {})
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
                self._group.members.pop(key, None)  # out of the next tree until it polls again
                self._group.alive.pop(key, None)
            report.reparented = {
                k: str(a["parent"]) for k, a in self._group.adoptions.pop(version, {}).items()
            }
            # Parents still serving their children ask after the version ended (HEARTBEAT CONTRACT).
            self._group.failed_past[version] = {k: str(w) for k, w in report.failed.items()}

    def close(self) -> None:
        """Stop serving and release the pool (idempotent); publish afterwards raises."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        if self._client is not None:
            self._client.close()
        self._fillers.shutdown(wait=True)
        self._ep.close()
        # The server holds self._handle (a bound method): drop it so a closed trainer is freed
        # by reference counting, not at the next garbage collection. The shared-bucket ledger
        # (also held by the membership) is the pool's last holder.
        self._server = None
        self._shares.drop_pool()
