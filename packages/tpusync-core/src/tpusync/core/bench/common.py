"""Helpers shared by the benchmark suites."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def progress(enabled: bool = True) -> Progress:
    """A progress bar on stderr (disabled when stderr is not a terminal or when asked)."""
    console = Console(file=sys.stderr)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        disable=not enabled or not console.is_terminal,
        transient=True,
    )


def measure(fn: Callable[[], float | None], repeats: int) -> float:
    """Median seconds of ``repeats`` runs; ``fn`` may return its own timing (else wall time)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        own = fn()
        times.append(own if own is not None else time.perf_counter() - t0)
    return statistics.median(times)


def measure_paired(fns: dict[str, Callable[[], float | None]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``fns``, run in turn within every repeat (a reference and the
    paths it bounds see the same moments of a shared machine's load, not consecutive minutes)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            own = fn()
            times[k].append(own if own is not None else time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def paired_with_memcpy(
    nbytes: int, d2h: Callable[[], float | None], h2d: Callable[[], float | None], repeats: int
) -> tuple[float, float, float]:
    """(d2h, h2d, memcpy) median seconds, the memcpy of ``nbytes`` between prefaulted buffers
    timed in turn with a save and a load in every repeat (:func:`measure_paired`)."""
    import numpy as np

    from tpusync.core import _native

    a = np.full(nbytes, 3, np.uint8)
    b = np.full(nbytes, 4, np.uint8)
    t = measure_paired(
        {"ref": lambda: _native.memcpy_seconds(b, a), "d2h": d2h, "h2d": h2d}, repeats
    )
    return t["d2h"], t["h2d"], t["ref"]


def result_entry(nbytes: int, seconds: float, limit_seconds: float, limit: str) -> dict:
    """One measured throughput path against its same-run limit."""
    gbps = nbytes / seconds / 1e9
    limit_gbps = nbytes / limit_seconds / 1e9
    return {
        "gbps": round(gbps, 3),
        "limit_gbps": round(limit_gbps, 3),
        "limit": limit,
        "ratio": round(gbps / limit_gbps, 3),
        "better": "higher",
    }


def run_suite(suite: str, *args: str, timeout: float = 300.0) -> dict:
    """``tpusync bench SUITE --json --quiet ARGS`` in a child interpreter (faulthandler on, so a
    crash prints its Python stacks), its JSON parsed. RuntimeError with the child's exit status and
    the tail of its stderr when it fails; subprocess.TimeoutExpired after ``timeout`` seconds."""
    cmd = [sys.executable, "-X", "faulthandler", "-m", "tpusync.core.cli", "bench", suite]
    proc = subprocess.run(
        [*cmd, "--json", "--quiet", *args], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"tpusync bench {suite} exited with {proc.returncode}:\n{proc.stderr[-6000:]}"
        )
    return json.loads(proc.stdout)
