"""One sampler rank's side of RL weight sync: poll trainer rank 0, pull, forward, verify, commit.

:class:`SamplerSync` pulls each version over the fan-out tree (FAN-OUT CONTRACT in
:mod:`tpusync.rl.topology`) or, on the trainer's host, straight out of the trainer's pool
(SHARED-SEGMENT CONTRACT in :mod:`tpusync.rl.sharing`); it beats to trainer rank 0 while it lives
(HEARTBEAT CONTRACT) and asks it for a new source when its parent is lost (RE-PARENTING CONTRACT,
both in :mod:`tpusync.rl.membership`). PIPELINE and FAULT CONTRACTS: :mod:`tpusync.rl.trainer`.

GROUP COMMIT CONTRACT: ranks that serve only together (the tensor- and pipeline-parallel workers
of one inference engine) pass :meth:`SamplerSync.update` a ``confirm`` callback. It is called
once this rank's whole version arrived and verified, before anything is committed, and says
whether every rank of the group verified it too (None) or why not (a reason). On a reason the
version is rejected here exactly like a failed pull: nothing committed, the rank keeps serving
its version, its forwarded sends are cancelled (RE-PARENTING CONTRACT), and trainer rank 0 is
told it failed, with that reason. So the trainer's report never counts a rank committed whose
group kept the old version, and the next version is not a delta on one it never served. Without
``confirm`` a verified version is committed at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import mmap
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tpusync.core import (
    Checksum64Stream,
    NotFoundError,
    PoolExhaustedError,
    StateError,
    TpusyncError,
    checksum64,
)
from tpusync.core.pd import load_secret
from tpusync.rl.chunks import Chunk, UpdateRejectedError, WeightSubscriber
from tpusync.rl.control import ControlClient
from tpusync.rl.endpoint import FILL_THREADS, _Endpoint, check_args
from tpusync.rl.layout import ShardLayout, _layout_from_wire, _layout_to_wire
from tpusync.rl.manifest import Manifest
from tpusync.rl.pack import TRAILER, StreamPlan, pack_streams
from tpusync.rl.reports import UpdateResult
from tpusync.rl.topology import _children, _key, _parent, request_id

log = logging.getLogger("tpusync.rl")

__all__ = ["SamplerSync"]


class _ParentLost(Exception):
    """A sampler's parent in the fan-out tree no longer serves the version (RE-PARENTING)."""


def _may_pull(head: Any, in_flight: list[Any], window: int) -> bool:
    """Whether the next bucket in plan order, from source ``head``, may be pulled now, given the
    sources of the pulls in flight (HOP LAG CONTRACT: at most ``window`` per source)."""
    return sum(p == head for p in in_flight) < window


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
        window: int = 1,
        poll_interval: float = 0.01,
        layouts: Mapping[str, ShardLayout] | None = None,
    ) -> None:
        """``layouts``: the group's layouts keyed by trainer name, reported to a trainer that
        plans from its samplers (``TrainerSync(dst_layouts=None)``, SAMPLER LAYOUTS CONTRACT);
        by default the subscriber's own when it uses the trainer's names. ``window``: bucket
        pulls in flight per source process (HOP LAG CONTRACT)."""
        check_args(
            "SamplerSync",
            {"poll_interval": poll_interval} if poll_interval else {},
            replica=replica,
            block_bytes=block_bytes,
            pool_bytes=pool_bytes,
            streams=streams,
            window=window,
        )
        if window < 1:
            raise ValueError(f"SamplerSync: window must be >= 1, got {window}")
        self.sub = subscriber
        self.replica = replica
        self._secret = secret if secret is not None else load_secret()
        self._ep = _Endpoint(self._secret, block_bytes, pool_bytes, listen, same_host, streams)
        self._client = ControlClient(self._secret, control)
        # HOP LAG CONTRACT: buckets are pulled in plan order, at most ``window`` at a time from
        # each source process (the parent, or each trainer rank). Pulls in flight from one source
        # share its link, so each lands only when all of them do. When a child forwarded a bucket
        # only once it had landed, a chain of n hops added ``window`` bucket-times n - 1 times
        # (2 Gbit/s emulated hosts, 1 GiB, trainer -> 4 samplers: 5.19-5.34 s with 1, 5.54 s with
        # 2, 6.32 s with 4; one link alone 4.52 s; docs/rl.md). Now each block goes on as it lands
        # (RELAY CONTRACT, pd_stream.h): 4.68-4.95 s with 1 and 5.02-5.05 s with 2, the last
        # sampler done 45-140 ms per hop after the first (links that send small packets first,
        # as hosts do): a block is handed on once it landed whole, and it shares the link with
        # the other ``window x streams`` connections' blocks, so a hop lags by
        # window x streams x block_bytes / link rate (docs/rl.md, Sizing: 10-50 ms with one
        # stream, 2-8 ms with 1 MiB blocks). With 1 the link idles one round trip per bucket (a
        # 32 MiB bucket: 1-4% at 100 Gbit/s and 20-100 us). Several sources (trainer ranks of
        # another layout) are pulled at once.
        self._window = max(window, 1)
        self._poll = poll_interval
        # SAMPLER LAYOUTS CONTRACT: sent with the polls until trainer rank 0 says it has them.
        mine = dict(layouts) if layouts is not None else subscriber.trainer_layouts()
        self._layouts = {n: _layout_to_wire(lay) for n, lay in (mine or {}).items()} or None
        self._layouts_known = False
        self.history: list[UpdateResult] = []
        self._seen = subscriber.version  # newest version attempted (never retried)
        self._segment: tuple[str, np.ndarray, mmap.mmap] | None = None  # the trainer's pool
        self._hashers = concurrent.futures.ThreadPoolExecutor(
            FILL_THREADS, thread_name_prefix="tpusync-rl-hash"
        )
        # ABANDON (_abandon): given-up pulls are abandoned here, one thread each, off the
        # pulling thread; pulls_abandoned counts the pulls given up (pulling thread only).
        self._abandoner = concurrent.futures.ThreadPoolExecutor(
            self._window, thread_name_prefix="tpusync-rl-abandon"
        )
        self.pulls_abandoned = 0
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
        self._closed = False
        self._refused: str | None = None  # the reason rank 0 last refused this sampler's poll
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

    def update(
        self, timeout: float, confirm: Callable[[int], str | None] | None = None
    ) -> UpdateResult | None:
        """Wait up to ``timeout`` s for a version newer than ours and apply it.

        Returns None when none was announced in time (or trainer rank 0 is unreachable): the
        current version keeps being served. Never raises for a failed update; the result says why.
        ``confirm(version)``: the GROUP COMMIT CONTRACT, called at most once, only for a version
        that verified on this rank (an exception it raises rejects the version like a reason).
        """
        if self._closed:
            raise StateError(f"SamplerSync {self.replica}:{self.sub.rank} is closed")
        end = time.monotonic() + timeout
        msg = {
            "op": "next",
            "replica": self.replica,
            "rank": self.sub.rank,
            "addr": self._ep.address,
        }
        while time.monotonic() < end:
            try:
                layouts = None if self._layouts_known else self._layouts
                reply = self._client.request(
                    {**msg, "have": max(self.version, self._seen), "layouts": layouts},
                    timeout=min(2.0, max(end - time.monotonic(), 0.05)),
                )
            except TimeoutError as e:  # rank 0 gone or slow
                log.debug("sampler %d:%d: poll failed: %s", self.replica, self.sub.rank, e)
                time.sleep(self._poll)
                continue
            except RuntimeError as e:  # refused, e.g. its key taken (ONE PROCESS PER KEY)
                if str(e) != self._refused:  # logged once per reason, not per poll
                    self._refused = str(e)
                    log.error("sampler %d:%d: %s", self.replica, self.sub.rank, e)
                time.sleep(max(self._poll, 0.1))
                continue
            self._refused = None
            self._joined = True
            if "layouts_known" in reply:  # a restarted rank 0 asks for them again
                self._layouts_known = bool(reply["layouts_known"])
            self._start_beats(reply.get("silence"))  # HEARTBEAT CONTRACT: from the first poll
            if reply.get("op") == "announce":
                self._seen = max(self._seen, int(reply["version"]))
                result = self._apply(reply, confirm)
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

    def _apply(self, ann: dict, confirm: Callable[[int], str | None] | None) -> UpdateResult:
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
        except Exception as e:  # noqa: BLE001 - a name_map that raises too: reported, not raised
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
                if self._ep.pool.num_blocks < ann["bucket_blocks"]:
                    # A pull lands a whole bucket in this pool: it would wait for room that can
                    # never come, until the version's deadline, on this side and the trainer's.
                    raise UpdateRejectedError(
                        f"this sampler's pool holds {self._ep.pool.num_blocks} blocks, less than "
                        f"one bucket ({ann['bucket_blocks']} blocks of {ann['block_bytes']} "
                        "bytes): give SamplerSync a larger pool_bytes"
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
            if confirm is not None:  # GROUP COMMIT CONTRACT
                self.sub.verify()
                why = confirm(version)
                if why is not None:
                    raise UpdateRejectedError(why)
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
        # RELAY CONTRACT (pd_stream.h): each bucket's sends to the children are registered before
        # it is pulled, once, and the receive hands every block on as it lands (a retried or
        # re-sourced pull of the bucket feeds the same relays).
        relays: dict[tuple[int, int], list[int]] = {}
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
                relay(s, b, len(ids))
                recv(s, b, rid, ids)
            except Exception:
                ep.pool.free(ids)
                raise
            flight.append((s, b, rid, ids))
            return True

        def recv(s: int, b: int, rid: int, ids: list[int]) -> None:
            """Pulls bucket ``b`` of source ``s`` into ``ids``, handing it on to its relays."""
            ep.consumer.start_recv(
                rid,
                source["peers"][s],
                ids,
                deadline=max(deadline - time.monotonic(), 0),
                relay=ep.producer,
                relay_ids=relays[(s, b)],
            )

        def relay(s: int, b: int, n: int) -> None:
            """Registers bucket ``b`` of source ``s`` for every live child, once."""
            nonlocal forwarded
            if (s, b) in relays:
                return
            t1 = time.monotonic()
            rids = relays[(s, b)] = []
            for j, _child in enumerate(children):
                with self._fwd_lock:
                    if j in self._dead_children:
                        continue  # failed this version (HEARTBEAT CONTRACT)
                    fwd_rid = request_id(version, s, me, j, b)
                    ep.producer.register_relay(fwd_rid, n, max(deadline - time.monotonic(), 0))
                    self._fwd[j].append(fwd_rid)
                rids.append(fwd_rid)
                forwarded += 1
            stages["forward_s"] += time.monotonic() - t1

        def room() -> bool:
            peers = source["peers"]
            return bool(queue) and _may_pull(
                peers[queue[0][0]], [peers[f[0]] for f in flight], self._window
            )

        try:
            while queue or flight:
                try:
                    if not flight:
                        start(block=True)
                    while room() and start():
                        pass
                    s, b, rid, ids = flight[0]
                    t1 = time.monotonic()
                    st = self._wait(rid, finished, deadline)
                    stages["wire_wait_s"] += time.monotonic() - t1
                    if st.code == "NotFound" and time.monotonic() < deadline:
                        # A pull waits ~10 s for its registration; a sender still busy (a loaded
                        # host, a slow device -> host copy) is asked again until the deadline.
                        recv(s, b, rid, ids)
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
                    self._abandon([rid for _s, _b, rid, _i in flight], f"re-parented: {lost}")
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
                while room() and start():
                    pass
                # The children already have the bucket's blocks (RELAY CONTRACT, with the
                # trainer's checksums: every hop checks the origin's hash); stage it.
                t2 = time.monotonic()
                try:
                    first, _ = streams[s].buckets[b]
                    for k, block in enumerate(ids):
                        self._stage(version, me, s, streams[s], first + k, block)
                finally:
                    ep.pool.free(ids)
                stages["stage_s"] += time.monotonic() - t2
        finally:
            # A version given up with pulls in flight (rejected, deadline, abort): their sources
            # drop those blocks now rather than at the deadline.
            self._abandon([rid for _s, _b, rid, _i in flight], "the sampler gave up the version")
            for _s, _b, _rid, ids in flight:
                ep.pool.free(ids)  # the transport borrows them until the receive ends
        return forwarded

    def _abandon(self, rids: list[int], reason: str) -> None:
        """ABANDON CONTRACT (pd_stream.h) for pulls this sampler gave up: each ends locally at
        once (the transport's borrow on its destination blocks returns, so they go back to the
        pool), then its producer is told to drop its copy. Each runs on its own thread of
        ``_abandoner``: telling a hung parent (SIGSTOP, a host gone without a FIN) costs that
        thread the consumer's ``abandon_timeout``, never the pulling thread. A pull that ended
        meanwhile is not found or already complete: nothing to do. Rejected: leaving them to the
        version's deadline, the old behaviour (a hung parent kept ``window`` pool blocks of this
        sampler, and its own copies, borrowed for minutes)."""

        def one(rid: int) -> None:
            try:
                self._ep.consumer.abandon(rid, reason)
            except (NotFoundError, StateError) as e:  # ended on its own meanwhile
                log.debug("sampler %d: pull %#x already ended: %s", self.replica, rid, e)
            except TpusyncError as e:  # a source slow to stop: the request's end frees it
                log.warning("sampler %d: abandoning pull %#x: %s", self.replica, rid, e)

        self.pulls_abandoned += len(rids)
        for rid in rids:
            self._abandoner.submit(one, rid)

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
            # HOLD CHECK (see _SharedBuckets.request, sharing.py): the last bucket too must still
            # have been held by the trainer when this sampler finished staging it.
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
        connection" and it rejected a version its parent had committed). Idempotent; update()
        afterwards raises StateError."""
        if self._closed:
            return
        self._closed = True
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
        self._abandoner.shutdown(wait=True)  # each abandon is bounded by abandon_timeout
        self._unmap()
        self._client.close()
        if self._beat_client is not None:
            self._beat_client.close()
        self._ep.close()
