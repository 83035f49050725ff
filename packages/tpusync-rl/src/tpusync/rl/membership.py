"""Trainer rank 0's record of the sampler group: who is a member, who was heard from when,
what each member reported of each version, and who was re-parented.

HEARTBEAT CONTRACT (a sampler dying, idle or mid-update, on any host): from its first poll until it
closes, a sampler sends a ``beat`` to trainer rank 0 on the control channel every ``silence / 4``
seconds, from a thread of its own (so a slow but live sampler keeps beating while its pulling
thread waits or copies, and an idle one keeps beating while nobody calls
:meth:`SamplerSync.update`): an idle beat names no version, a beat while it applies a version (and
while it still forwards that version to children) names it. One small message per sampler per
``silence / 4``; the poll reply tells a sampler ``silence``. Rank 0 counts a member of the version
in flight that has not reported and was not heard from (poll, beat or report) for ``silence``
seconds (``TrainerSync(silence=)``, default 10 s, well below the deadline) as having reported a
failure, like a process exit on the same host (EXIT WATCH CONTRACT): whether it died in the middle
of the update or before it fetched the announcement (a sampler killed while idle is found out
within ``silence`` of its last beat, not at the deadline; one already silent when a version is
announced is put in no fan-out tree, so no live sampler waits on it as a parent, and a sampler that
fetches an announcement leaving it out rejects that version). A sampler that closes cleanly says
``bye`` and leaves the group: it is not counted as dead, and a version in flight that counted on it
records that it left. A sampler that failed either way has every transport send registered for it
cancelled at once (``PdProducer.cancel``, CANCEL CONTRACT in pd_stream.h): each trainer rank
cancels its own (ranks > 0 ask rank 0 which samplers failed), and a forwarding sampler cancels what
it registered for a failed child when a beat reply names that child, so no pool stays held for a
dead peer and the next version starts on free pools. Its fan-out children are re-parented to the
trainer within the same version (RE-PARENTING CONTRACT below) and commit it with the others; the
next version's tree leaves the dead sampler out until it polls again (a restarted sampler rejoins
by polling). A live sampler that is idle for a long time is still a member: a version it has not
fetched waits for it until the deadline (it is alive, it may poll). Rejected: connection loss seen
by the producer (a host that died sends no FIN, links are pooled and idle between pulls, and the
death of a forwarded-to child is seen by its parent sampler's producer, not by the trainer, so it
would need relaying anyway), a progress timeout on the pulling thread (it fires on a sampler that
is slow, e.g. staging a large bucket, but alive), and judging liveness by polls (a live sampler
whose engine does not call ``update`` for a while would be presumed dead).

RE-PARENTING CONTRACT (a tree or chain member lost in the middle of a version): a replica whose
parent sampler is gone (the parent failed the version: heartbeat silence, exit watch, its own
failure report; or it committed and then went silent, left, or its same-host process exited) gets
the rest of that version from the TRAINER, as a late direct child. It learns of the loss from a
failed pull from the parent or from a beat reply (``adopt``), abandons its pulls from the parent
(their blocks come back at once; sampler.py ``_abandon``) and sends rank 0 an ``adopt`` request
naming, per trainer rank, the first bucket it has not staged yet (buckets are staged in pull order,
so what it lacks is a suffix of every stream). Rank 0 grants it a child slot at or above ``fanout``
(unique per version and sampler rank; slots end at 63) once it counts the parent gone, answers
``wait`` while the parent may still serve it, and records the adoption; every trainer rank (ranks >
0 learn adoptions with the failed samplers from rank 0) fills those buckets again from the
version's tensors, which ``publish`` holds until it returns, and registers them at that slot, at
most ``REFILL_AHEAD`` unacknowledged per orphan and stream, never blocking on its pool. The orphan
pulls them, verifies each against the fresh block checksums, forwards each to its own children
under the same request ids as before (its subtree does not notice) and stages it: every bucket is
staged exactly once, all of one version (the block trailer names it), so the COMMIT and DIGEST
checks hold as for any update. Deltas and resharding need nothing more: the buckets come from the
same plan. To serve orphans every trainer rank's ``publish`` returns only once every member
reported (ranks > 0 ask rank 0; one that hears nothing from rank 0 for ``silence`` stops waiting).
Every wait has its deadline: an orphan whose parent stays alive for ``2 * silence`` after a failed
pull (it failed for another reason), or that rank 0 cannot re-parent (version over, no slot left)
or does not by the deadline, fails the version with that reason, as before. A forwarding sampler
that fails a version cancels what it forwarded, so its children move at once. Shared-segment
readers have no parent (they read the trainer's pool) and are never orphans. Rejected: the dead
node's parent or another ancestor forwarding the missing buckets (an ancestor frees a forwarded
bucket once its own children acknowledged it, DRAIN CONTRACT, so it may no longer hold the orphan's
buckets, and a second forwarding path per sampler would need its own flow control); re-forming the
whole tree within the version (every live member would change parent mid-stream); and failing the
descendants, the old behaviour (samplers that did nothing wrong miss a version)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from tpusync.rl.endpoint import _process_gone
from tpusync.rl.layout import ShardLayout, _layout_from_wire
from tpusync.rl.sharing import _SharedBuckets
from tpusync.rl.topology import _CHILD_BITS, _key, _parent

log = logging.getLogger("tpusync.rl")


class _Membership:
    """Rank 0's sampler group, under the trainer's ``lock``: the members ("replica:rank" ->
    address) and the version each last said it has; when each was last heard from; the versions
    announced and the reports of each; the adoptions (RE-PARENTING CONTRACT). ``silence`` is the
    heartbeat timeout, ``address`` this trainer's endpoint address (its host and pid namespace:
    EXIT WATCH CONTRACT), ``shares`` its shared buckets (a failed reader holds none any more)."""

    def __init__(
        self,
        lock: threading.Lock,
        silence: float,
        address: Mapping[str, Any],
        shares: _SharedBuckets,
    ) -> None:
        self._lock = lock
        self.silence = silence
        self._address = address
        self._shares = shares
        self.members: dict[str, dict] = {}  # "replica:rank" -> address
        self.have: dict[str, int] = {}  # the version each sampler last said it has
        self.announced: dict[int, dict] = {}
        self.reports: dict[int, dict[str, dict]] = collections.defaultdict(dict)
        self._next_watch = 0.0  # EXIT WATCH CONTRACT: when to look at same-host samplers again
        # HEARTBEAT CONTRACT: key -> when the sampler was last heard from (a poll, a beat, idle or
        # applying, or a report).
        self.alive: dict[str, float] = {}
        self.collected = 0  # the newest version whose reports were collected
        self.failed_past: dict[int, dict[str, str]] = {}  # failed samplers of collected versions
        # RE-PARENTING CONTRACT: version -> orphan key -> {"slot", "rank", "resume": {trainer
        # rank: first bucket it lacks}, "parent": the failed parent's key}.
        self.adoptions: dict[int, dict[str, dict]] = collections.defaultdict(dict)
        # SAMPLER LAYOUTS CONTRACT: key -> its reported layouts, as ((trainer name, layout), ...)
        # sorted by name (hashable: equal reports are one vote).
        self.layouts: dict[str, tuple[tuple[str, ShardLayout], ...]] = {}

    def set_layouts(self, key: str, wire: Any) -> None:
        """Sampler ``key`` reports its group's layouts, ``{trainer name: wire layout}`` (lock
        held); a later report replaces it (a restarted engine). ValueError when malformed."""
        try:
            got = {str(n): _layout_from_wire(raw) for n, raw in dict(wire).items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"sampler {key} reported malformed layouts: {e}") from None
        self.layouts[key] = tuple(sorted(got.items(), key=lambda kv: kv[0]))

    def group_layouts(self, keys: Any) -> tuple[dict[str, ShardLayout] | None, list[str]]:
        """SAMPLER LAYOUTS CONTRACT (lock held): the layouts most of ``keys`` reported (a tie goes
        to the layouts of the smallest key) and the keys that reported others; None when none of
        them reported any."""
        votes: dict[tuple, list[str]] = collections.defaultdict(list)
        for key in sorted(keys):
            if key in self.layouts:
                votes[self.layouts[key]].append(key)
        if not votes:
            return None, []
        best = max(votes, key=lambda c: len(votes[c]))  # the first of equals: smallest key
        odd = sorted(k for c, ks in votes.items() if c != best for k in ks)
        return dict(best), odd

    def leave(self, key: str) -> None:
        """Sampler ``key`` said goodbye (lock held): out of the group, not counted as dead; a
        version in flight that counted on it is told it left (it will not report)."""
        self.members.pop(key, None)
        self.have.pop(key, None)
        self.alive.pop(key, None)
        self.layouts.pop(key, None)
        for version, ann in self.announced.items():
            if key in ann["members"] and key not in self.reports.get(version, {}):
                if version > self.collected:
                    why = f"sampler {key} closed (left the group) before applying version {version}"
                    self.record_report(version, key, {"ok": False, "reason": why})

    def record_report(self, version: int, key: str, msg: dict) -> None:
        """Sampler ``key``'s outcome of ``version`` (lock held)."""
        self.reports[version][key] = msg
        if msg.get("ok"):  # it serves `version` now, before it polls again (LAGGING SAMPLERS)
            self.have[key] = max(self.have.get(key, 0), version)
        else:  # a reader that gave up holds no shared bucket any more
            self._shares.release_reader(version, key)
            if self._shares.sharing == version:
                self._shares.quit.add(key)  # nor is it offered the buckets still to come

    def failed(self, version: int) -> dict[str, str]:
        """Samplers that reported (or were found to have) failed ``version`` (lock held)."""
        return {
            **self.failed_past.get(version, {}),
            **{
                k: str(m.get("reason") or "failed")
                for k, m in self.reports.get(version, {}).items()
                if not m.get("ok")
            },
        }

    def tree_parent(self, version: int, key: str) -> str | None:
        """``key``'s parent sampler in ``version``'s fan-out tree (None: the trainer, or not in
        the tree) (lock held)."""
        ann = self.announced.get(version)
        if ann is None:
            return None
        replica, rank = (int(x) for x in key.split(":"))
        topo = [int(x) for x in ann["topo"].get(rank, [])]
        if replica not in topo:
            return None
        parent, _slot = _parent(topo, replica, int(ann["fanout"]))
        return None if parent is None else _key(parent, rank)

    def parent_gone(self, version: int, pkey: str, failed: Mapping[str, str]) -> str | None:
        """Why parent ``pkey`` no longer serves ``version`` to its children, None while it may
        (lock held): it failed the version; or it committed but is gone since (silent for
        ``silence``, left the group, or its same-host process exited: EXIT WATCH CONTRACT)."""
        if pkey in failed:
            return failed[pkey]
        ann = self.announced[version]
        last = self.alive.get(pkey)
        if last is None:
            return f"{pkey} left the group"
        if time.monotonic() - last > self.silence:
            return f"no heartbeat from {pkey} for {time.monotonic() - last:.1f} s"
        addr = ann["members"].get(pkey) or {}
        proc = addr.get("proc") or {}
        mine = self._address
        if (
            proc
            and addr.get("host") == mine["host"]
            and proc.get("pidns") == mine["proc"].get("pidns")
            and _process_gone(proc)
        ):
            why = f"sampler process {proc['pid']} exited during the update"
            if pkey not in self.reports.get(version, {}):
                self.record_report(version, pkey, {"ok": False, "reason": why})
            return why
        return None

    def orphaned(self, version: int, key: str, failed: Mapping[str, str]) -> str | None:
        """Why ``key`` must ask for a new source of ``version`` (lock held): its parent in the
        fan-out tree is gone and it was not re-parented yet. A failed grandparent is no reason:
        the parent itself is re-parented (RE-PARENTING CONTRACT)."""
        if key in self.adoptions.get(version, {}):
            return None
        pkey = self.tree_parent(version, key)
        if pkey is None:
            return None
        why = self.parent_gone(version, pkey, failed)
        return (
            f"its parent {pkey} in the fan-out tree failed version {version}: {why}"
            if why
            else None
        )

    def adopt(self, msg: dict) -> dict:
        """RE-PARENTING CONTRACT (rank 0, lock held): an orphan's request for a new source.
        ``adopted`` with its child slot at every trainer rank once its parent is gone, ``wait``
        while the parent may still serve it, ``abort`` (with the reason) when it cannot be."""
        version = int(msg["version"])
        key = _key(int(msg["replica"]), int(msg["rank"]))
        ann = self.announced.get(version)
        if key in self.members:
            self.alive[key] = time.monotonic()
        if ann is None or version <= self.collected:
            return {"op": "abort", "reason": f"version {version} is over on trainer rank 0"}
        have = self.adoptions[version].get(key)
        if have is not None:  # a retry whose first reply was lost
            return {"op": "adopted", **have}
        if key in self.reports[version]:
            return {"op": "abort", "reason": f"{key} already reported version {version}"}
        pkey = self.tree_parent(version, key)
        if pkey is None:
            return {
                "op": "abort",
                "reason": f"{key} pulls version {version} from the trainer: no parent to replace",
            }
        why = self.parent_gone(version, pkey, self.failed(version))
        if why is None:
            return {"op": "wait"}
        rank = int(msg["rank"])
        slot = int(ann["fanout"]) + sum(
            1 for a in self.adoptions[version].values() if a["rank"] == rank
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
        self.adoptions[version][key] = adoption
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

    def over(self, version: int) -> bool:
        """Rank 0: every member of ``version`` reported (or it was collected): no orphan can
        need its buckets any more (lock held)."""
        ann = self.announced.get(version)
        if version <= self.collected or ann is None:
            return True
        return set(ann["members"]) <= set(self.reports.get(version, {}))

    def watch_silence(self, ann: dict) -> None:
        """HEARTBEAT CONTRACT (rank 0): a member of ``ann``'s version that has not reported and
        has been silent for ``silence`` seconds (no poll, beat or report; whether it fetched the
        version or not) counts as failed."""
        version = int(ann["version"])
        now = time.monotonic()
        with self._lock:
            got = self.reports[version]
            for key in ann["members"]:
                last = self.alive.get(key)
                if key in got or last is None or now - last <= self.silence:
                    continue
                why = (
                    f"no heartbeat for {now - last:.1f} s (silence timeout {self.silence:g} s, "
                    "idle or during the update): sampler presumed dead"
                )
                self.record_report(version, key, {"ok": False, "reason": why})

    def watch_exits(self, ann: dict) -> None:
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
        if now < self._next_watch:
            return
        self._next_watch = now + 0.05
        self.watch_silence(ann)
        if not ann.get("shared"):
            return
        mine = self._address
        version = int(ann["version"])
        readers = {_key(replica, int(r)) for r, reps in ann["shared"].items() for replica in reps}
        with self._lock:
            got = self.reports[version]
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
                self.record_report(version, key, {"ok": False, "reason": why})
