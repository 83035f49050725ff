"""``tpusync bench tiers``: the tiered KV store against the hardware limits, measured in one run.

* host: KVStore put / get (DRAM tier, engine threads) vs one plain memcpy of the same bytes
  between prefaulted buffers; also put into a /dev/shm tier (``namespace=``), which hashes every
  block (fused copy + XXH3) for the warm-restart check.
* disk: a disk-only KVStore put (write) / get (read, checksum verified) vs ``fio`` sequential
  O_DIRECT write / read of the same bytes, same block size, in the same directory, same run.
* lookup: the store's index holding 10^3, 10^5 and 10^7 keys, random keys over the full set:
  ns per key in 1024-key batches (ratio = cost at 10^3 / cost at N: 1.0 is flat), plus the
  latency of a 32-key request and of a single-key call (see ``_lookup``).
* restart: reopening a full disk tier of 16 KiB blocks (one slot per 4 KiB of ``total_bytes``:
  65536 slots at the default) from its clean-shutdown manifest vs by the header scan (the
  manifest deleted), same files, same run; and the restart after a crash (SIGKILL) from a
  checkpoint manifest plus K journaled slots (``crash_checkpoint``, K = 1024 and slots / 8), the
  files as the kill left them (saved before the clean close). The page cache is not dropped (that needs root and
  disturbs other processes): the scan's header reads are O_DIRECT where ``direct_io`` holds,
  the manifest is read through the page cache.
* checkpoint: put and get latency (p50 / p99 / max) of two callers during one disk checkpoint vs
  just before it, for each manifest write-back mode (``checkpoint_write_back`` "at_fsync" and
  "progressive", the default), interleaved, each against its own reference, at one 4 KiB slot
  per KiB of ``total_bytes`` (262,144 at the default: a 20 MiB manifest), the checkpoint's
  duration, and where in it the slowest calls fell (``_checkpoint``).
* long_session: a synthetic 1M-token KV stream through a "device" buffer holding 10% of it; cold
  blocks are offloaded to the store (DRAM then disk) and the whole stream is read back and
  verified at the end. The device-side footprint is reported and must stay within the budget.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tpusync.core import _native
from tpusync.core.bench.common import measure, progress, result_entry
from tpusync.core.pool import default_engine
from tpusync.core.store import KVStore

MIN_SESSION_TOKENS = 1024
GOAL = {"host_min_ratio": 0.9, "disk_min_ratio": 0.9, "lookup_min_ratio": 0.5}
MEMCPY = "one memcpy of the same bytes between prefaulted buffers, calling thread, same run"


def aligned(nbytes: int, fill: int | None = None) -> np.ndarray:
    """A 4 KiB-aligned, prefaulted uint8 buffer (O_DIRECT can use it without a bounce copy)."""
    raw = np.empty(nbytes + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    buf = raw[off : off + nbytes]
    buf[:] = 0 if fill is None else fill
    return buf


def run(
    total_bytes: int = 256 << 20,
    repeats: int = 3,
    directory: str | None = None,
    block_sizes: list[int] | None = None,
    lookup_sizes: list[int] | None = None,
    session_tokens: int = 1 << 20,
    session_token_bytes: int = 512,
    show_progress: bool = True,
) -> dict:
    block_sizes = block_sizes or [256 << 10, 1 << 20]
    lookup_sizes = lookup_sizes or [10**3, 10**5, 10**7]
    if session_tokens < MIN_SESSION_TOKENS:
        # Fewer tokens leave the 10% device budget a block or two: nothing is offloaded.
        raise ValueError(
            f"bench tiers: session_tokens {session_tokens} is below {MIN_SESSION_TOKENS} (a "
            "stream that short never leaves the device budget)"
        )
    base = Path(directory or tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="tpusync-bench-tiers-", dir=base))
    engine = default_engine()
    out: dict = {"suite": "tiers", "engine_threads": engine.num_threads, "repeats": repeats}
    try:
        with progress(show_progress) as bar:
            task = bar.add_task("bench tiers", total=len(block_sizes) * 2 + 4)
            out["host"] = []
            for b in block_sizes:
                out["host"].append(_host(b, total_bytes, repeats))
                bar.advance(task)
            out["disk"] = []
            for b in block_sizes:
                out["disk"].append(_disk(b, total_bytes, repeats, work))
                bar.advance(task)
            out["lookup"] = _lookup(lookup_sizes)
            bar.advance(task)
            out["restart"] = _restart(max(1024, total_bytes // 4096), repeats, work)
            bar.advance(task)
            out["checkpoint"] = _checkpoint(max(1024, total_bytes // 1024), work)
            bar.advance(task)
            out["long_session"] = _long_session(session_tokens, session_token_bytes, work)
            bar.advance(task)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["goal"] = GOAL
    host_ok = all(
        r[p]["ratio"] >= GOAL["host_min_ratio"] for r in out["host"] for p in ("put", "get")
    )
    disk_ok = all(
        r[p]["ratio"] is not None and r[p]["ratio"] >= GOAL["disk_min_ratio"]
        for r in out["disk"]
        for p in ("write", "read")
    )
    lookup_ok = all(r["ratio"] >= GOAL["lookup_min_ratio"] for r in out["lookup"])
    out["goal_met"] = {
        "host": host_ok,
        "disk": disk_ok,
        "lookup_flat": lookup_ok,
        "long_session_bounded": out["long_session"]["device_footprint_bounded"],
    }
    return out


def _host(block: int, total: int, repeats: int) -> dict:
    """Host put / get / put into /dev/shm against memcpy of the same bytes, INTERLEAVED.

    REFERENCE CONTRACT: every round runs the memcpy reference and each measured path once, in
    turn, on the same prefaulted source and destination buffers, and every figure is the median of
    its rounds (at least 5). A single memcpy timed apart from the paths swung 2-3x between runs on
    a loaded host (ratios of 0.7 and 1.5 for the same code); interleaving puts the reference and
    the path under the same load, and the median drops the rounds a neighbour disturbed.
    """
    n = max(1, total // block)
    nbytes = n * block
    rounds = max(5, repeats)
    src = aligned(nbytes, 7).reshape(n, block)
    dst = aligned(nbytes, 1).reshape(n, block)
    store = KVStore(block, n)
    # A /dev/shm tier (namespace=, warm restart) also hashes every put block for the re-attach
    # check; an anonymous one does not need to (see tier/host_tier.h), so it is measured apart.
    ns = f"bench-{os.getpid()}-{block}"
    shm = KVStore(block, n, namespace=ns)
    # The /dev/shm segment is rebuilt from huge pages on a background thread after open (HostPool
    # HUGE-PAGE CONTRACT): measure the steady state, not the first seconds of a fresh store.
    until = time.monotonic() + 120
    while shm.stats()["tiers"]["host"].get("huge_pages") == "collapsing":
        if time.monotonic() > until:
            raise RuntimeError(
                "bench tiers: /dev/shm tier still collapsing to huge pages after 120 s"
            )
        time.sleep(0.05)
    rnd = iter(range(10**9))
    keys = [b"g%d" % i for i in range(n)]

    def put_into(s: KVStore, prefix: bytes) -> float:
        s.clear()  # not timed
        r = next(rnd)
        ks = [b"%s%d-%d" % (prefix, r, i) for i in range(n)]
        t0 = time.perf_counter()
        s.put(ks, src).result(120)
        return time.perf_counter() - t0

    def get() -> float:
        t0 = time.perf_counter()
        found = store.get(keys, dst).result(120)
        t = time.perf_counter() - t0
        if not all(found):
            raise RuntimeError("bench tiers: host get missed a stored block")
        return t

    times: dict[str, list[float]] = {"ref": [], "put": [], "get": [], "put_shm": []}
    try:
        _native.memcpy_seconds(dst.reshape(-1), src.reshape(-1))  # warm-up, not counted
        for _ in range(rounds):
            times["ref"].append(_native.memcpy_seconds(dst.reshape(-1), src.reshape(-1)))
            times["put"].append(put_into(store, b"h"))
            times["put_shm"].append(put_into(shm, b"s"))
            store.clear()
            store.put(keys, src).result(120)
            times["get"].append(get())
        found = store.get(keys[:1], dst[:1]).result(10)
        if not found[0] or not np.array_equal(dst[0], src[0]):
            raise RuntimeError("bench tiers: host data check failed")
    finally:
        store.close()
        shm.close()
        for suffix in ("host", "host.lock"):
            Path(f"/dev/shm/tpusync-{ns}-{suffix}").unlink(missing_ok=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    how = f"{MEMCPY}, interleaved with the measured paths, median of {rounds} rounds"
    return {
        "block_bytes": block,
        "blocks": n,
        "bytes": nbytes,
        "rounds": rounds,
        "memcpy_spread": round(max(times["ref"]) / min(times["ref"]), 2),
        "put": result_entry(nbytes, med["put"], med["ref"], how),
        "get": result_entry(nbytes, med["get"], med["ref"], how),
        "put_shm_checksummed": result_entry(nbytes, med["put_shm"], med["ref"], how),
    }


def _timed_only(fn, setup) -> float:
    """Seconds of fn() alone (its own clear() excluded from the figure)."""
    setup()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _fio(directory: Path, rw: str, block: int, nbytes: int) -> tuple[float | None, str]:
    """GB/s of one fio sequential O_DIRECT job, or (None, why)."""
    fio = shutil.which("fio")
    if fio is None:
        return None, "fio not installed (ci/apt-deps.sh fio)"
    cmd = [
        fio,
        "--name=tpusync-ref",
        f"--directory={directory}",
        f"--rw={rw}",
        f"--bs={block}",
        f"--size={nbytes}",
        "--direct=1",
        "--ioengine=io_uring",
        "--iodepth=32",
        "--numjobs=1",
        "--end_fsync=0",
        "--output-format=json",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        cmd[cmd.index("--ioengine=io_uring")] = "--ioengine=psync"
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return None, f"fio failed: {r.stderr.strip()[:200]}"
    job = json.loads(r.stdout)["jobs"][0]["read" if rw == "read" else "write"]
    return job["bw_bytes"] / 1e9, " ".join(c for c in cmd[1:] if not c.startswith("--output"))


def _disk(block: int, total: int, repeats: int, work: Path) -> dict:
    n = max(1, total // block)
    nbytes = n * block
    src = aligned(nbytes, 5).reshape(n, block)
    dst = aligned(nbytes, 0).reshape(n, block)
    d = work / f"disk-{block}"
    store = KVStore(block, 0, disk_dir=d, disk_blocks=n * (repeats + 1))
    rounds = iter(range(10**9))
    written: list[list[bytes]] = []

    def write() -> None:
        ks = [b"d%d-%d" % (next(rounds), i) for i in range(n)]
        store.put(ks, src).result(600)
        written.append(ks)

    write_s = measure(write, repeats)
    keys = written[-1]
    read_s = measure(lambda: store.get(keys, dst).result(600) and None, repeats)
    if not all(store.get(keys[:4], dst[:4]).result(60)) or not np.array_equal(dst[0], src[0]):
        raise RuntimeError("bench tiers: disk data check failed")
    tier = store.stats()["tiers"]["disk"]
    store.close()
    shutil.rmtree(d, ignore_errors=True)
    fio_dir = work / f"fio-{block}"
    fio_dir.mkdir()
    fio_w, how_w = _fio(fio_dir, "write", block, nbytes)
    fio_r, how_r = _fio(fio_dir, "read", block, nbytes)
    shutil.rmtree(fio_dir, ignore_errors=True)

    def entry(seconds: float, limit_gbps: float | None, how: str) -> dict:
        how = f"fio {how}" if limit_gbps is not None else how
        if limit_gbps is None:
            return {
                "gbps": round(nbytes / seconds / 1e9, 3),
                "limit_gbps": None,
                "limit": how,
                "ratio": None,
                "better": "higher",
            }
        return result_entry(nbytes, seconds, nbytes / limit_gbps / 1e9, how)

    return {
        "block_bytes": block,
        "blocks": n,
        "bytes": nbytes,
        "directory": str(work),
        "direct_io": tier["direct_io"],
        "io_backend": tier["io_backend"],
        "write": entry(write_s, fio_w, how_w),
        "read": entry(read_s, fio_r, how_r),
    }


def _restart(slots: int, repeats: int, work: Path) -> dict:
    """Open time of a full disk tier: from the clean-shutdown manifest, after a crash from a
    checkpoint manifest plus K journaled slots, and by the header scan - same files, same run."""
    block = 16 << 10
    d = work / "restart"
    src = aligned(min(slots, 2048) * block, 3).reshape(-1, block)

    def open_store() -> KVStore:
        # No periodic checkpoint: the files each open finds are the ones set up below.
        return KVStore(block, 0, disk_dir=d, disk_blocks=slots, checkpoint_s=0, checkpoint_writes=0)

    def fill(store: KVStore, prefix: bytes, first: int, n: int) -> None:
        for at in range(first, first + n, len(src)):
            m = min(len(src), first + n - at)
            if not all(
                store.put([prefix + b"%d" % i for i in range(at, at + m)], src[:m]).result(600)
            ):
                raise RuntimeError("bench tiers: restart fill was not stored")

    store = open_store()
    fill(store, b"r", 0, slots)
    store.close()  # clean close: writes the manifest
    manifest = d / "manifest"
    manifest_bytes = manifest.stat().st_size

    def timed_open(how: str, slots_read: int | None = None) -> float:
        t0 = time.perf_counter()
        store = open_store()
        seconds = time.perf_counter() - t0
        tier = store.stats()["tiers"]["disk"]
        store.close()  # writes the manifest again
        if (
            tier["recovery"] != how
            or tier["recovered"] != slots
            or (slots_read is not None and tier["recovery_slots_read"] != slots_read)
        ):
            raise RuntimeError(f"bench tiers: restart by {how} recovered {tier}")
        return seconds

    # Crash states: K slots re-written after the manifest (K removed, K new keys into their slots),
    # the manifest and journals saved as a SIGKILL would have left them, the store then closed.
    journaled = sorted({k for k in (1024, slots // 8) if 0 < k < slots})
    crash_files: dict[int, Path] = {}
    for k in journaled:
        store = open_store()
        store.remove([b"r%d" % i for i in range(k)])
        fill(store, b"c%d-" % k, 0, k)
        saved = work / f"crash-{k}"
        saved.mkdir()
        for f in d.iterdir():
            if f.name == "manifest" or f.name.startswith("journal-"):
                shutil.copy2(f, saved / f.name)
        store.close()
        crash_files[k] = saved
        store = open_store()  # back to the r-keys for the next K (and the clean-close manifest)
        store.remove([b"c%d-%d" % (k, i) for i in range(k)])
        fill(store, b"r", 0, k)
        store.close()

    def restore(saved: Path) -> None:
        for f in d.iterdir():
            if f.name == "manifest" or f.name.startswith("journal-"):
                f.unlink()
        for f in saved.iterdir():
            shutil.copy2(f, d / f.name)

    times: dict[str, list[float]] = {"manifest": [], "scan": []}
    crash_times: dict[int, list[float]] = {k: [] for k in journaled}
    clean = work / "clean-close"
    clean.mkdir()
    for f in d.iterdir():
        if f.name == "manifest" or f.name.startswith("journal-"):
            shutil.copy2(f, clean / f.name)
    for _ in range(repeats):
        restore(clean)
        times["manifest"].append(timed_open("manifest", 0))
        for k in journaled:
            restore(crash_files[k])
            crash_times[k].append(timed_open("checkpoint", k))
        manifest.unlink()
        times["scan"].append(timed_open("scan", slots))
        restore(clean)
    shutil.rmtree(d, ignore_errors=True)
    m, sc = statistics.median(times["manifest"]), statistics.median(times["scan"])
    crash = []
    for k in journaled:
        c = statistics.median(crash_times[k])
        crash.append(
            {
                "journaled_slots": k,
                "open_s": round(c, 4),
                "speedup_vs_scan": round(sc / c, 1),
            }
        )
    return {
        "slots": slots,
        "block_bytes": block,
        "manifest_bytes": manifest_bytes,
        "manifest_open_s": round(m, 4),
        "scan_open_s": round(sc, 4),
        "scan_us_per_slot": round(sc / slots * 1e6, 2),
        "speedup": round(sc / m, 1),
        "crash_checkpoint": crash,
        "better": "higher",
        "page_cache": "not dropped; scan header reads are O_DIRECT where direct_io holds",
    }


# The checkpoint row's variants (KVStore options), each measured against its own reference.
CHECKPOINT_VARIANTS: dict[str, dict] = {
    "at_fsync": {"checkpoint_write_back": "at_fsync"},
    "progressive": {"checkpoint_write_back": "progressive"},
}
CHECKPOINT_DEFAULT = "progressive"  # the KVStore default: the row's own figure


def _checkpoint(
    slots: int,
    work: Path,
    rounds: int = 8,
    without_s: float = 0.5,
    block: int = 4096,
    variants: dict[str, dict] | None = None,
) -> dict:
    """Put and get latency during one checkpoint vs just before it, per manifest write-back mode.

    A disk-only store of ``block``-byte blocks, every one of its ``slots`` slots full (no
    periodic checkpoints), is opened once per variant and round with that variant's options
    (``CHECKPOINT_VARIANTS``: ``checkpoint_write_back`` "at_fsync" / "progressive"), variants
    interleaved (the order rotates each round),
    the same files re-opened from their clean-close manifest each time. While it is open one
    thread puts one new block (evicting the oldest) every 200 us and another gets one random
    block of the newer half by write order (far from eviction) every 200 us, each call timed (a
    get that misses is counted in ``get_misses``, not timed): for ``without_s`` nothing else
    runs ("without", the reference), then ONE ``KVStore.checkpoint()`` runs (the chunked walk and
    the manifest, ~80 bytes per block, written and fsynced): the calls that started and ended
    inside it are "during". All rounds pooled per variant. A user sees this: a checkpoint (every
    60 s or 65536 changed slots by default) among ongoing disk I/O. Lower is better for the
    ratios (during p99 / without p99 of the same variant, puts and gets apart)."""
    variants = variants or CHECKPOINT_VARIANTS
    d = work / "checkpoint"

    def open_store(options: dict) -> KVStore:
        return KVStore(
            block, 0, disk_dir=d, disk_blocks=slots, checkpoint_s=0, checkpoint_writes=0, **options
        )

    lat = {v: {op: {"without": [], "during": []} for op in ("put", "get")} for v in variants}
    ck: dict[str, list[float]] = {v: [] for v in variants}
    # The slowest calls during a checkpoint: (latency, start after the checkpoint's start, its
    # duration) - whether they fall in the walk or at its end (the fsync, rename, directory fsync).
    worst: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    get_misses = 0
    puts = [0]  # new blocks put so far, across all opens
    rng = np.random.default_rng(0)
    src = aligned(min(slots, 1024) * block, 5).reshape(-1, block)

    def written(n: int) -> bytes:  # the n-th block written: the fill, then the puts
        return b"f%d" % n if n < slots else b"p%d" % (n - slots)

    try:
        store = open_store({})
        try:
            for at in range(0, slots, len(src)):
                m = min(len(src), slots - at)
                keys = [b"f%d" % i for i in range(at, at + m)]
                if not all(store.put(keys, src[:m]).result(600)):
                    raise RuntimeError("bench tiers: checkpoint fill was not stored")
        finally:
            store.close()  # a clean-close manifest: every open below takes it
        names = list(variants)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                store = open_store(variants[name])
                phase = {"v": "without", "t": 0.0}
                during: list[tuple[float, float]] = []
                stop = threading.Event()
                by_op = lat[name]

                def caller(
                    op: str, store=store, phase=phase, stop=stop, by_op=by_op, during=during
                ) -> None:
                    nonlocal get_misses
                    dst = aligned(block).reshape(1, block)
                    while not stop.is_set():
                        before = phase["v"]
                        t0 = time.perf_counter()
                        if op == "put":
                            store.put([written(slots + puts[0])], src[:1]).result(60)
                            puts[0] += 1
                        else:
                            total = slots + puts[0]
                            key = written(int(rng.integers(total - slots // 2, total)))
                            if not store.get([key], dst).result(60)[0]:
                                get_misses += 1
                                before = "miss"  # not timed
                        dt = time.perf_counter() - t0
                        if before == phase["v"] and before in by_op[op]:
                            by_op[op][before].append(dt)
                            if before == "during":
                                during.append((dt, t0 - phase["t"]))
                        time.sleep(200e-6)

                threads = [threading.Thread(target=caller, args=(op,), daemon=True) for op in by_op]
                try:
                    for th in threads:
                        th.start()
                    time.sleep(without_s)
                    t0 = phase["t"] = time.perf_counter()
                    phase["v"] = "during"
                    store.checkpoint()
                    ck[name].append(time.perf_counter() - t0)
                    phase["v"] = "after"
                    worst[name] += [(dt, at, ck[name][-1]) for dt, at in during]
                    worst[name] = sorted(worst[name], reverse=True)[:5]
                finally:
                    stop.set()
                    for th in threads:
                        th.join(60)
                    store.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)

    def pct(v: list[float], q: float) -> float:
        v = sorted(v)
        return round(v[min(len(v) - 1, int(len(v) * q))] * 1e6, 1) if v else 0.0

    def entry(name: str) -> dict:
        e: dict = {
            "options": variants[name],
            "checkpoints": len(ck[name]),
            "checkpoint_s": round(statistics.median(ck[name]), 4),
            "checkpoint_max_s": round(max(ck[name]), 4),
            "slowest_during": [
                {"us": round(dt * 1e6, 1), "start_s": round(at, 4), "checkpoint_s": round(c, 4)}
                for dt, at, c in worst[name]
            ],
        }
        for op, by_phase in lat[name].items():
            for ph, v in by_phase.items():
                e[f"{op}_{ph}"] = {
                    "n": len(v),
                    "p50_us": pct(v, 0.5),
                    "p99_us": pct(v, 0.99),
                    "max_us": round(max(v) * 1e6, 1) if v else 0.0,
                }
            # Bench CONVENTION: the figure (p99 during a checkpoint), the same-run reference (p99
            # of the same caller just before it, same variant), their ratio, which way is better.
            base = e[f"{op}_without"]["p99_us"]
            e[op] = {
                "p99_us": e[f"{op}_during"]["p99_us"],
                "limit_us": base,
                "limit": f"{op} p99 of the same caller without a checkpoint, same store, same run",
                "ratio": round(e[f"{op}_during"]["p99_us"] / base, 2) if base else None,
                "better": "lower",
            }
        return e

    row: dict = {
        "slots": slots,
        "block_bytes": block,
        "rounds": rounds,
        "get_misses": get_misses,
        "variants": {name: entry(name) for name in variants},
    }
    # The row's own figures are the default mode's (put and get; the top-level one the put's).
    default = row["variants"].get(CHECKPOINT_DEFAULT) or next(iter(row["variants"].values()))
    for k in (
        "checkpoints",
        "checkpoint_s",
        "put",
        "get",
        "put_without",
        "put_during",
        "get_without",
        "get_during",
    ):
        row[k] = default[k]
    row.update({k: row["put"][k] for k in ("p99_us", "limit_us", "limit", "ratio", "better")})
    return row


LOOKUP_BATCH = 1024  # keys per call for the per-key figure (the ratio)
LOOKUP_REQUEST = 32  # keys per call for the per-request figure (a 512-token prompt, 16 per block)


def _lookup(sizes: list[int], calls: int = 300) -> list[dict]:
    """Prefix-lookup cost in the store's index (tpusync.core.BlockIndex) at several sizes.

    Keys are 32 bytes (like sha256 block hashes). Every call looks up keys drawn uniformly at
    random from the WHOLE key set (fresh draws per call), so beyond the CPU caches every key
    costs its DRAM misses and nothing is flattered by reuse. Keys go in as one [n, 32] uint8 array
    (``lookup_prefix_array``), so the figure is the index's, plus one binding call per batch.

    * ``ns_per_key``: median call time / LOOKUP_BATCH keys per call (batch form: the index
      prefetches a group of keys ahead, so misses overlap). The ratio is ns_per_key at the
      smallest size / ns_per_key here: 1.0 is flat, 0.5 is 2x slower.
    * ``us_per_request``: median time of one LOOKUP_REQUEST-key call (what a scheduler pays).
    * ``us_single_key``: median time of a one-key call (no overlap possible; mostly the binding
      call at small sizes, the dependent DRAM misses at large ones).
    * ``recency``: the index's recency mode (the default, ``BlockIndex.recency``): with CLOCK a
      touch sets a bit in the key's own entry; with EXACT_LRU it also relinks two neighbours.

    The C++ figure to compare with is ``BlockIndex::LookupPrefix`` called directly on the same
    32-byte keys, uniformly drawn over the whole set, 1024 per call, median call (docs/tiers.md).
    """
    rng = np.random.default_rng(0)
    results = []
    idx = _native.BlockIndex()
    idx.reserve(max(sizes))
    have = 0

    def keys_for(ids: np.ndarray) -> np.ndarray:
        k = np.zeros((len(ids), 32), np.uint8)
        k[:, :8] = ids.astype(np.uint64).view(np.uint8).reshape(-1, 8)
        return k

    def median_ns(idx: _native.BlockIndex, batch: int, n_calls: int) -> float:
        probes = keys_for(rng.integers(0, have, batch * n_calls)).reshape(n_calls, batch, 32)
        t = np.empty(n_calls)
        for c in range(n_calls):
            t0 = time.perf_counter_ns()
            hit = idx.lookup_prefix_array(probes[c])
            t[c] = time.perf_counter_ns() - t0
            if hit != batch:
                raise RuntimeError("bench tiers: lookup missed a stored key")
        return float(np.median(t))

    def random_read_ns(nbytes: int) -> float:
        """Same-run memory reference: ns per independent random 8-byte read (numpy gather) over
        an array as large as the index at this size. A CLOCK hit touches two lines (its bucket
        and its hot record; block_index.h, FLAT LOOKUP CONTRACT), an EXACT_LRU hit five (plus its
        cold record and two LRU neighbours), so flat-in-memory-terms is 2x (5x) this."""
        a = np.ones(max(1, nbytes // 8), np.int64)
        at = rng.integers(0, len(a), 1 << 20)
        best = min(_timed_only(lambda: a.take(at).sum(), lambda: None) for _ in range(3))
        return best / len(at) * 1e9

    for size in sorted(sizes):
        step = 1 << 20
        for first in range(have, size, step):  # insert in slices (bounded temporary memory)
            ids = np.arange(first, min(size, first + step), dtype=np.uint64)
            idx.insert_many(keys_for(ids), _native.Tier.HOST, first)
        have = size
        if not results:
            # WARM-UP: the first timed call pattern of a process ran 20-35% slower than the same
            # calls right after (27-28 ns per key at 10^5 measured below 34-38 at the 10^3
            # reference), which flattered the flat ratio; one untimed round first.
            median_ns(idx, LOOKUP_BATCH, calls)
        results.append(
            {
                "keys": size,
                "recency": idx.recency.name.lower(),
                "batch": LOOKUP_BATCH,
                "ns_per_key": median_ns(idx, LOOKUP_BATCH, calls) / LOOKUP_BATCH,
                "us_per_request": median_ns(idx, LOOKUP_REQUEST, calls * 4) / 1e3,
                "request_keys": LOOKUP_REQUEST,
                "us_single_key": median_ns(idx, 1, calls * 4) / 1e3,
                # 64-byte hot + 64-byte cold records + 8-byte buckets at load <= 0.7 + 8-byte tail
                "random_read_ns": round(random_read_ns(size * 148), 1),
            }
        )
    del idx
    ref = results[0]["ns_per_key"]
    prev = ref
    for r in results:
        r["limit"] = (
            f"ns per key at {results[0]['keys']} keys, {LOOKUP_BATCH}-key batches of random "
            "keys over the full set (flat = ratio 1.0)"
        )
        r["ratio"] = round(ref / r["ns_per_key"], 3)
        r["ratio_vs_previous_size"] = round(prev / r["ns_per_key"], 3)
        r["random_reads_per_key"] = round(r["ns_per_key"] / r["random_read_ns"], 2)
        r["better"] = "higher"
        prev = r["ns_per_key"]
        r["ns_per_key"] = round(r["ns_per_key"], 1)
        r["us_per_request"] = round(r["us_per_request"], 3)
        r["us_single_key"] = round(r["us_single_key"], 3)
    return results


def _long_session(tokens: int, token_bytes: int, work: Path, tokens_per_block: int = 16) -> dict:
    block = tokens_per_block * token_bytes
    nblocks = tokens // tokens_per_block
    budget = max(1, nblocks // 10)  # the device holds 10% of the stream
    batch = max(1, min(256, budget // 4))
    device = aligned(budget * block, 0).reshape(budget, block)
    free = list(range(budget))
    resident: list[tuple[int, int]] = []  # (block id, device slot), oldest first
    store = KVStore(
        block, max(1, nblocks // 5), disk_dir=work / "session", disk_blocks=nblocks + batch
    )
    max_used = 0
    rejected = 0
    offload_s = 0.0  # time inside the store's put (the simulated prefill is not counted)
    for first in range(0, nblocks, batch):
        ids = list(range(first, min(nblocks, first + batch)))
        if len(free) < len(ids):  # offload the oldest resident blocks to the store
            out = resident[: len(ids) - len(free) + batch]
            del resident[: len(out)]
            t0 = time.perf_counter()
            stored = store.put([b"s%d" % b for b, _ in out], device, rows=[s for _, s in out])
            rejected += len(out) - sum(stored.result(120))
            offload_s += time.perf_counter() - t0
            free.extend(s for _, s in out)
        for b in ids:  # "prefill" writes the new block on the device
            slot = free.pop()
            device[slot, :8] = np.frombuffer(b.to_bytes(8, "little"), np.uint8)
            device[slot, 8:16] = 0xA5
            resident.append((b, slot))
        max_used = max(max_used, budget - len(free))
    store.flush(120)
    # Revisit the whole offloaded stream (a long-context re-read), batch by batch, verified.
    reload_s = 0.0
    still_on_device = {r for r, _ in resident}
    offloaded = [b for b in range(nblocks) if b not in still_on_device]
    verified = 0
    scratch = aligned(batch * block, 0).reshape(batch, block)
    for first in range(0, len(offloaded), batch):
        ids = offloaded[first : first + batch]
        t1 = time.perf_counter()
        found = store.get([b"s%d" % b for b in ids], scratch[: len(ids)]).result(120)
        reload_s += time.perf_counter() - t1
        for row, (b, ok) in enumerate(zip(ids, found, strict=True)):
            tag = int.from_bytes(scratch[row, :8].tobytes(), "little")
            if ok and tag == b and (scratch[row, 8:16] == 0xA5).all():
                verified += 1
    s = store.stats()
    store.close()
    moved = len(offloaded) * block
    return {
        "device": "simulated by a host array (the accelerator side is not part of this suite)",
        "tokens": tokens,
        "token_bytes": token_bytes,
        "block_bytes": block,
        "blocks": nblocks,
        "stream_bytes": nblocks * block,
        "device_budget_blocks": budget,
        "device_max_blocks_used": max_used,
        "device_footprint_bounded": max_used <= budget,
        "offloaded_blocks": len(offloaded),
        "offloaded_bytes": moved,
        "reloaded_bytes": verified * block,
        "host_tier_used_blocks_at_end": s["tiers"]["host"]["used_blocks"],
        "disk_blocks_written": s["tiers"]["disk"]["demotions_in"],
        "offload_rejected": rejected,
        "offload_gbps": round(moved / offload_s / 1e9, 3),
        "reload_gbps": round(moved / reload_s / 1e9, 3),
        "verified_blocks": verified,
        "host_tier_blocks": s["tiers"]["host"]["capacity_blocks"],
        "disk_hits": s["tiers"]["disk"]["hits"],
        "host_hits": s["tiers"]["host"]["hits"],
        "evicted": s["evicted"],
    }


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(show_progress=False), indent=2))
    os._exit(0)
