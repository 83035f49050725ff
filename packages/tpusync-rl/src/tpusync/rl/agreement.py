"""Delta agreement between trainer processes: which tensors (and rows) a multi-process delta
version sends.

Implements the AGREEMENT CONTRACT stated on :class:`tpusync.rl.trainer.TrainerSync`: ranks > 0
hand rank 0 their changed sets (:meth:`_Agreement.report`), rank 0 records them as they arrive on
the control channel (:meth:`_Agreement.record`), waits for every process and decides once for
all (:meth:`_Agreement.agree`), then closes the version (:meth:`_Agreement.end`): later reports of
it are refused, and one given up on is answered with why (``aborted``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tpusync.rl.chunks import WeightPublisher, merge_runs
from tpusync.rl.control import ControlClient

log = logging.getLogger("tpusync.rl")


def _partial(changed: Mapping[str, Any]) -> dict[str, tuple[tuple[int, int], ...]]:
    """The tensors of a changed set sent in part: name -> row runs (whole ones left out)."""
    return {n: tuple(runs) for n, runs in changed.items() if runs is not None}


class _Agreement:
    """AGREEMENT CONTRACT state and steps of one trainer process (``rank``, holding ``ranks`` of
    ``world``; ``pub`` knows its delta base). Rank 0's state is under the trainer's ``lock``:
    version -> {process rank: report}; versions given up on (-> why, told to the ranks that
    ask); the newest version decided; decided version -> the processes that reported."""

    def __init__(
        self,
        lock: threading.Lock,
        pub: WeightPublisher,
        rank: int,
        world: int,
        ranks: Sequence[int],
    ) -> None:
        self._lock = lock
        self._pub = pub
        self.rank, self.world, self.ranks = rank, world, tuple(ranks)
        self._changed: dict[int, dict[int, dict]] = collections.defaultdict(dict)
        self.aborted: dict[int, str] = {}
        self._decided = 0
        self._settled: dict[int, set[int]] = {}

    def record(self, msg: dict) -> dict:
        """A trainer process's delta report (lock held); a repeated one is accepted again."""
        version, rank = int(msg["version"]), int(msg["rank"])
        got = self._changed.get(version, {})
        if rank in self._settled.get(version, ()):
            return {"op": "ok"}  # a retry whose first reply was lost
        if version in self.aborted:
            return {
                "op": "error",
                "reason": f"trainer rank 0 gave up on version {version}: {self.aborted[version]}",
            }
        if version <= self._decided and rank not in got:
            return {
                "op": "error",
                "reason": f"trainer rank 0 already decided version {version} (its newest is "
                f"{self._decided}): publish versions in the same order on every rank",
            }
        self._changed[version][rank] = msg
        return {"op": "ok"}

    def agree(
        self,
        version: int,
        mine: Mapping[str, Any],
        names: set[str],
        deadline: float,
        seconds: float,
        delta_possible: Callable[[int], bool],
    ) -> dict[str, tuple[tuple[int, int], ...] | None] | None:
        """Rank 0: the union of every process's changed set (tensor -> changed row runs, None:
        whole), or None for a full update (AGREEMENT CONTRACT). Raises TimeoutError when a
        process did not report by ``deadline`` (``seconds`` after the publish began);
        ``delta_possible(version)``: whether rank 0's own view allows a delta (LAGGING SAMPLERS)."""
        want = set(range(self.world)) - set(self.ranks)
        while True:
            with self._lock:
                got = dict(self._changed.get(version, {}))
            covered = {int(r) for m in got.values() for r in m.get("ranks", ())}
            if want <= covered:
                break
            if time.monotonic() >= deadline:
                missing = sorted(want - covered)
                raise TimeoutError(
                    f"delta agreement on version {version}: trainer ranks {missing} did not report "
                    f"their changed tensors within {seconds:.1f} s (every rank must call "
                    "publish with the same version and delta=True)"
                )
            time.sleep(0.005)
        base = self._pub.base_version
        full = not delta_possible(version)
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

    def end(self, version: int, why: str | None) -> None:
        """Rank 0: ``version`` is decided (or given up on: ``why``); later reports are refused."""
        with self._lock:
            self._decided = max(self._decided, version)
            if why is not None:
                self.aborted[version] = why
            self._settled[version] = set(self._changed.get(version, {}))
            for v in [v for v in self._changed if v <= version]:
                del self._changed[v]
            for old in (self.aborted, self._settled):
                for v in [v for v in old if v < version - 4]:
                    del old[v]

    def report(
        self,
        client: ControlClient,
        version: int,
        changed: Mapping[str, Any],
        deadline: float,
        seconds: float,
        full: bool,
    ) -> None:
        """Ranks > 0: hand rank 0 this process's changed set (AGREEMENT CONTRACT) with the row
        runs of tensors changed only in part (CHUNK DELTA CONTRACT) over ``client``, until
        ``deadline`` (``seconds`` after the publish began); ``full``: it wants a full update."""
        msg = {
            "op": "delta",
            "version": version,
            "rank": self.rank,
            "ranks": list(self.ranks),
            "changed": sorted(changed),
            "rows": {n: [list(r) for r in runs] for n, runs in _partial(changed).items()},
            "base": self._pub.base_version,
            "full": full,
        }
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"trainer rank {self.rank}: rank 0 did not take the changed tensors of "
                    f"version {version} within {seconds:.1f} s"
                )
            try:
                client.request(msg, timeout=min(2.0, left))
                return
            except TimeoutError:
                continue
