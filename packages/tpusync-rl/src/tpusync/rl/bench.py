"""``tpusync bench weights``: trainer -> samplers weight sync against same-run references.

Paths (every process is a real process, every byte crosses a real socket):

- ``chain``: one trainer process publishes a ``total_bytes`` fp32 state dict to two sampler
  processes chained over loopback TCP (trainer -> sampler 0 -> sampler 1), shadow commit into
  recycled (double) buffers; the
  time runs from ``publish`` to both samplers' commit reports. References, same run:
  ``torch.distributed`` gloo ``broadcast`` of the same tensors from rank 0 to two ranks, and
  ``iperf3`` moving the same bytes over loopback with the same parallel streams.
- ``chain_same_host``: the same chain over the same-host P/D path (Unix socket; each sampler
  copies its parent's /dev/shm blocks into its own pool, then stages them).
- ``shared_same_host``: the same-host samplers read the trainer's /dev/shm pool directly
  (SHARED-SEGMENT CONTRACT in :mod:`tpusync.rl.sharing`): no chain, no copy into a sampler pool.

Every row names the path its samplers reported (``UpdateResult.path``) and carries the stage
times of the last version (trainer rank 0 and each sampler; docs/rl.md explains them).
- ``resharded`` vs ``plain``: two trainer processes (TP=2, dim 0) to one sampler group of two
  ranks, split on dim 1 (resharded: every piece is a strided box) or on dim 0 (plain: shards map
  one to one); the figure is the time ratio (lower is better).

- ``delta_*_chunk_vs_tensor``: bytes a ``delta=True`` publish puts on the wire per sampler when
  1% of the model's rows changed, per-chunk deltas (CHUNK DELTA CONTRACT in
  :mod:`tpusync.rl.chunks`, 4 MiB chunks) against per-tensor deltas (every changed tensor whole):
  ``contiguous`` (each tensor's changed rows in one run, like a few updated embedding rows) and
  ``scattered`` (1% of the rows picked at random: nearly every chunk holds one, so per-chunk
  deltas save little). Counted from the digests and the packing plan the trainer uses (the
  blocks it registers), not timed.

- ``shared_same_host_vs_cpu_floor`` and ``cpu_floor_vs_gloo``: the CPU floor of the shared path,
  measured in the same run: the three fused copy + hash passes a version costs there (the
  trainer's fill, each reader's staging) run as three concurrent threads of this process over
  prefaulted memory, with nothing else (no control messages, no waits, no pipeline). The first
  row says how close the shared path gets to it, the second the best ratio against gloo that any
  pipeline of these passes could reach on this machine (``docs/rl.md``, "Passes over each byte").

- ``chain_links_vs_gloo`` and ``chain_links_vs_iperf3``: the chain, gloo's broadcast and iperf3
  again, each process on its own emulated host (a network namespace whose link carries
  ``link_gbit`` Gbit/s each way, HOSTS CONTRACT in :mod:`tpusync.core.bench.hosts`), so that a
  link, not this machine's CPU, sets the rates, as between the hosts of a cluster. There the
  root of a broadcast sends every byte once per receiver through its one link, a chain's trainer
  once: no path can beat gloo by more than the ratio of gloo's time to one link's (about 2 with
  two samplers). Skipped, with the reason in ``links.skipped``, without root, iproute2 or iperf3.

The loopback rows (``chain``, ``chain_same_host``, ``shared_same_host``, gloo, iperf3 and the CPU floor) run in
``repeats`` rounds, each path and reference once per round, and each row's ``ratio`` is the
median of its per-round ratios (``ratio_rounds``; PAIRED ROUNDS in :func:`_loopback_rounds`);
``gbps`` and ``limit_gbps`` are the medians of the rounds' figures, ``rounds`` has them all.

GOALS: chain >= 2x gloo, chain >= 0.8x iperf3, resharded <= 1.3x plain.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import sys
import time

import torch

from tpusync.core.bench import hosts
from tpusync.core.bench.common import result_entry

GOAL = {"vs_gloo": 2.0, "vs_iperf3": 0.8, "resharded_over_plain": 1.3}
STREAMS = 4
LINK_GBIT = 2.0  # the emulated hosts' link rate (``--link-gbit``; 0 skips those rows)
BLOCK = 4 << 20
COLS = 1024


def _shapes(total_bytes: int, n: int = 16) -> dict[str, tuple[int, int]]:
    rows = max(total_bytes // (n * COLS * 4), 2)
    return {f"layer{i}.w": (rows, COLS) for i in range(n)}


def _log(msg: str) -> None:
    print(f"bench weights: {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sampler(spec: dict, q, stop) -> None:
    if spec.get("netns"):  # before any socket or thread (HOSTS CONTRACT)
        hosts.enter(spec["netns"])
    torch.set_num_threads(1)
    from tpusync.rl import SamplerSync, WeightSubscriber

    rank, layouts = spec["rank"], spec["layouts"]
    weights = {n: torch.zeros(lay.box_of(rank).shape) for n, lay in layouts.items()}
    sub = WeightSubscriber(rank, weights, layouts, recycle=True)  # double-buffered shadow commit
    s = SamplerSync(
        sub,
        replica=spec["replica"],
        control=spec["control"],
        secret=spec["secret"],
        same_host=spec["same_host"],
        block_bytes=BLOCK,
        pool_bytes=spec["pool_bytes"],
        streams=STREAMS,
        listen=f"{spec['addr']}:0",
    )
    q.put("joined")
    # Until the bench sets ``stop`` (every version was reported committed): then a normal exit,
    # which removes this sampler's /dev/shm pool (a killed process would leave it behind).
    while not stop.is_set():
        res = s.update(timeout=0.5)
        if res is None:
            continue
        if not res.ok:
            q.put(f"failed: {res.reason}")
        q.put(("stages", spec["replica"], rank, res.version, dict(s.stages), res.path))
    s.close()


def _trainer_rank(spec: dict, q) -> None:
    torch.set_num_threads(1)
    from tpusync.rl import TrainerSync

    t = TrainerSync(
        spec["rank"],
        spec["world"],
        spec["dst"],
        control=spec["control"],
        secret=spec["secret"],
        block_bytes=BLOCK,
        pool_bytes=spec["pool_bytes"],
    )
    tensors = _local(spec["shapes"], spec["src"], spec["rank"])
    for v in range(1, spec["versions"] + 1):
        t.publish(v, tensors)
    q.put("done")
    t.close()


def _local(shapes, src, rank):
    out = {}
    for name in shapes:
        box = src[name].box_of(rank)
        out[name] = (torch.rand(box.shape), src[name])
    return out


def _run_sync(
    shapes,
    src,
    dst,
    trainers: int,
    samplers: list[tuple[int, int]],
    repeats,
    same_host,
    pool_bytes: int | None = None,
    share: bool = True,
    on: list[hosts.Host] | None = None,
) -> tuple[list[float], dict]:
    """Seconds per version (median-ready list) of one topology, and what the last version did
    (sampler paths, stage times); trainer rank 0 is this process. ``on``: emulated hosts, the
    first for this process (which must already be in it), one more per sampler."""
    from tpusync.rl import TrainerSync

    addr = [h.addr for h in on] if on else ["127.0.0.1"] * (len(samplers) + 1)

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    total = sum(4 * r * c for r, c in shapes.values())
    pool = pool_bytes or min(max(total // 4, 256 << 20), 512 << 20)
    secret = os.urandom(32)  # children get it through their spec (never a command line)
    t0 = TrainerSync(
        0,
        trainers,
        dst,
        secret=secret,
        block_bytes=BLOCK,
        pool_bytes=pool,
        same_host=same_host,
        share=share,
        listen=f"{addr[0]}:0",
        control=f"tcp://{addr[0]}:0",
    )
    procs = []
    stop = ctx.Event()
    tensors = _local(shapes, src, 0)
    try:
        for i, (replica, rank) in enumerate(samplers):
            spec = {
                "netns": on[1 + i].ns if on else None,
                "addr": addr[1 + i],
                "replica": replica,
                "rank": rank,
                "layouts": dst,
                "control": t0.control_address,
                "secret": secret,
                "same_host": same_host,
                "pool_bytes": pool,
            }
            procs.append(ctx.Process(target=_sampler, args=(spec, q, stop), daemon=True))
        for r in range(1, trainers):
            spec = {
                "rank": r,
                "world": trainers,
                "dst": dst,
                "src": src,
                "shapes": shapes,
                "control": t0.control_address,
                "secret": secret,
                "pool_bytes": pool,
                "versions": repeats + 1,
            }
            procs.append(ctx.Process(target=_trainer_rank, args=(spec, q), daemon=True))
        for p in procs:
            p.start()
        for _ in samplers:
            msg = q.get(timeout=120)
            if msg != "joined":
                raise RuntimeError(msg)
        t0.wait_for_samplers(len(samplers), timeout=120)
        times = []
        info: dict = {}
        for v in range(1, repeats + 2):  # version 1 warms pools, links and staging memory
            rep = t0.publish(v, tensors)
            if not rep.ok:
                raise RuntimeError(f"version {v} failed: {rep.failed}")
            if v > 1:
                times.append(rep.seconds)
                split = {k: round(x, 3) for k, x in t0.stages.items()}
                info["trainer_stages"] = split
                _log(f"version {v}: {rep.seconds:.3f} s; trainer rank 0 stages {split}")
        info.update(_log_sampler_stages(q, repeats + 1, len(samplers)))
        return times, info
    finally:
        t0.close()
        stop.set()  # idle samplers: every version was reported committed
        started = [p for p in procs if p.pid is not None]
        for p in started:
            p.join(30)
            if p.is_alive():
                p.kill()


def _hosted(ns: str, fn, args: tuple, q) -> None:
    hosts.enter(ns)  # first: every socket and thread of ``fn`` lives on that host
    try:
        q.put(("ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        q.put(("error", f"{type(e).__name__}: {e}"))


def _on_host(host: hosts.Host, fn, *args, timeout: float = 1800.0):
    """``fn(*args)`` in a fresh process on emulated ``host``; its result (picklable)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # Not daemonic: ``fn`` may start processes of its own (a daemonic process may not).
    p = ctx.Process(target=_hosted, args=(host.ns, fn, args, q))
    p.start()
    end = time.monotonic() + timeout
    try:
        while True:
            try:
                kind, value = q.get(timeout=1.0)
                break
            except queue.Empty:
                if not p.is_alive() and q.empty():  # died without a word (signal, os._exit)
                    kind, value = "error", f"the process exited with {p.exitcode}"
                    break
                if time.monotonic() > end:
                    kind, value = "error", f"no result within {timeout:.0f} s"
                    break
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    if kind != "ok":
        raise RuntimeError(f"bench weights on emulated host {host.addr}: {value}")
    return value


def _log_sampler_stages(q, last: int, samplers: int) -> dict:
    """Log each sampler's stage split of the last version (reported right after its commit);
    returns them with the paths the samplers took."""
    end = time.monotonic() + 10.0
    seen = 0
    out: dict = {"sampler_stages": {}, "paths": []}
    while seen < samplers and time.monotonic() < end:
        try:
            msg = q.get(timeout=max(end - time.monotonic(), 0.01))
        except Exception:  # noqa: BLE001 - queue.Empty: a sampler's stages are only informative
            break
        if isinstance(msg, tuple) and msg[0] == "stages" and msg[3] == last:
            seen += 1
            split = {k: round(x, 3) for k, x in msg[4].items()}
            out["sampler_stages"][f"{msg[1]}:{msg[2]}"] = split
            out["paths"] = sorted({*out["paths"], msg[5]})
            _log(f"version {last}: sampler {msg[1]}:{msg[2]} path {msg[5]} stages {split}")
    return out


def _gloo_rank(rank: int, port: int, shapes, repeats: int, q, on: list | None) -> None:
    if on:  # rank r on emulated host r (HOSTS CONTRACT), gloo on its one interface
        hosts.enter(on[rank].ns)
        os.environ["GLOO_SOCKET_IFNAME"] = hosts.IFNAME
    torch.set_num_threads(1)
    import torch.distributed as dist

    root = on[0].addr if on else "127.0.0.1"
    dist.init_process_group("gloo", init_method=f"tcp://{root}:{port}", rank=rank, world_size=3)
    tensors = [torch.rand(s) if rank == 0 else torch.zeros(s) for s in shapes.values()]
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, src=0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        q.put(times[1:])
    dist.destroy_process_group()


def _gloo(shapes, repeats: int, on: list[hosts.Host] | None = None) -> list[float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()  # on emulated hosts: free on the host's own stack, which is fresh
    procs = [
        ctx.Process(target=_gloo_rank, args=(r, port, shapes, repeats, q, on), daemon=True)
        for r in range(3)
    ]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _delta_bytes(shapes: dict[str, tuple[int, int]], scattered: bool) -> dict:
    """Wire bytes per sampler of a 1%-of-rows delta: per-chunk vs per-tensor (module doc)."""
    from tpusync.rl import ShardLayout
    from tpusync.rl.chunks import WeightPublisher
    from tpusync.rl.pack import pack_streams

    layouts = {n: ShardLayout.replicated(s, [0]) for n, s in shapes.items()}
    g = torch.Generator().manual_seed(7)
    tensors = {n: (torch.randn(s, generator=g), layouts[n]) for n, s in shapes.items()}
    pub = WeightPublisher(0, chunk_bytes=BLOCK)
    pub.published(pub.prepare(1, tensors), tensors)
    for t, _ in tensors.values():
        k = max(t.shape[0] // 100, 1)
        rows = torch.randperm(t.shape[0], generator=g)[:k] if scattered else torch.arange(k) + 7
        t[rows, 0] += 1.0
    changed = pub.changed_rows(tensors)
    rows = {n: r for n, r in changed.items() if r is not None}

    def wire(manifest) -> int:
        plans = pack_streams(manifest, layouts, BLOCK, 8)
        return sum(len(p.blocks) for p in plans.values()) * BLOCK

    chunk = wire(pub.prepare(2, tensors, delta=True, changed=set(changed), rows=rows))
    tensor = wire(pub.prepare(3, tensors, delta=True, changed=set(changed)))
    return {
        "bytes": chunk,
        "limit_bytes": tensor,
        "limit": "a per-tensor delta of the same change (every changed tensor whole), same run",
        "ratio": round(chunk / tensor, 4),
        "better": "lower",
        "path": f"per-chunk delta, 1% of rows changed "
        f"({'random rows' if scattered else 'one run per tensor'}), {BLOCK >> 20} MiB chunks "
        "and blocks, bytes per sampler stream",
    }


def _cpu_floor(nbytes: int, passes: int = 3, chunk: int = 256 << 20) -> float:
    """Seconds for ``passes`` concurrent fused copy + hash passes over ``nbytes`` each (best of
    3): each thread copies a ``chunk``-byte fp32 tensor into prefaulted memory in BLOCK-sized
    blocks, one ``Checksum64Stream`` per block (as the fill and the fused staging do), as many
    times as ``nbytes`` needs; the copies release the GIL."""
    import threading

    import numpy as np

    from tpusync.core import Checksum64Stream

    chunk = min(chunk, nbytes)
    rounds = max(1, round(nbytes / chunk))
    src = [torch.rand(chunk // 4).view(torch.uint8) for _ in range(passes)]
    dst = [np.ones(chunk, np.uint8) for _ in range(passes)]

    def one(i: int) -> None:
        for _ in range(rounds):
            for o in range(0, chunk, BLOCK):
                h = Checksum64Stream()
                h.copy_update(dst[i][o : o + BLOCK], src[i][o : o + BLOCK], keep_in_cache=True)
                h.digest()

    best = float("inf")
    for _ in range(3):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(passes)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return best * nbytes / (rounds * chunk)


def _links(
    shapes, whole, chain, repeats: int, nbytes: int, gbit: float, iperf: str, row
) -> tuple[dict, dict, str | None]:
    """The chain, gloo and iperf3 between three emulated hosts whose links carry ``gbit`` Gbit/s
    each way (HOSTS CONTRACT, :mod:`tpusync.core.bench.hosts`): trainer, sampler 0, sampler 1
    each on its own host, so the link, not this machine's CPU, sets the rates. Returns the two
    rows, the seconds of each path and the links' egress queues (``Host.queue``)."""
    from tpusync.core.bench.transport import _iperf3

    with hosts.emulated_hosts(3, gbit) as on:
        link_queue = on[0].queue
        _log(
            f"emulated hosts ({gbit:g} Gbit/s links, {link_queue} queues): "
            "chain trainer -> sampler 0 -> sampler 1"
        )
        times, info = _on_host(
            on[0], _run_sync, shapes, whole, whole, 1, chain, repeats, False, None, True, on
        )
        chain_s = statistics.median(times)
        _log(f"emulated hosts: chain {chain_s:.3f} s, paths {info.get('paths')}")
        _log("emulated hosts: gloo broadcast to 2 ranks")
        gloo = statistics.median(_gloo(shapes, repeats, on))
        _log("emulated hosts: iperf3 trainer host -> sampler 0 host")
        one_link = statistics.median(
            _iperf3(iperf, STREAMS, nbytes, server=on[1], client=on[0]) for _ in range(repeats)
        )
    path = f"chain trainer -> sampler 0 -> sampler 1, one emulated host each ({gbit:g} Gbit/s)"
    seconds = {"chain": chain_s, "gloo": gloo, "iperf3": one_link}
    rows = {
        "chain_links_vs_gloo": row(
            chain_s,
            gloo,
            "torch.distributed gloo broadcast to 2 ranks on the same emulated hosts, same run",
            info,
            path,
        ),
        "chain_links_vs_iperf3": row(
            chain_s,
            one_link,
            f"iperf3 between two of the emulated hosts, {STREAMS} streams, same bytes, same run",
            info,
            path,
        ),
    }
    return rows, seconds, link_queue


def _loopback_rounds(
    shapes, whole, chain, nbytes: int, rounds: int, iperf: str | None
) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Seconds of every loopback path and reference, one figure each per round, and the stage
    info of each path's last round.

    PAIRED ROUNDS: on a shared machine the references swing between minutes (gloo's loopback
    broadcast measured 1.06 to 2.14 GB/s in runs of the same day) and a reference timed once,
    minutes away from the path it divides, made ratios that moved 2x between runs. So every
    round times each path and each reference once (a sync of one version after a warm-up
    version, one broadcast after a warm-up broadcast, one iperf3 run, one CPU floor), in an order
    rotated by one each round, and a row's ratio is the median of its per-round ratios
    (``ratio_rounds``): each divides figures taken within the same minute or so."""

    def sync(*a, **kw) -> tuple[float, dict]:
        times, info = _run_sync(shapes, whole, whole, 1, chain, 1, *a, **kw)
        return times[0], info

    jobs = {
        "chain_tcp": lambda: sync(False),
        "chain_same_host": lambda: sync(True, share=False),
        "shared_same_host": lambda: sync(True),
        "gloo": lambda: (_gloo(shapes, 1)[0], {}),
        "cpu_floor": lambda: (_cpu_floor(nbytes), {}),
    }
    if iperf:
        from tpusync.core.bench.transport import _iperf3

        jobs["iperf3"] = lambda: (_iperf3(iperf, STREAMS, nbytes), {})
    names = list(jobs)
    secs: dict[str, list[float]] = {n: [] for n in names}
    infos: dict[str, dict] = {}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        _log(f"round {r + 1} of {rounds}, {nbytes >> 20} MiB: {', '.join(order)}")
        for name in order:
            seconds, info = jobs[name]()
            secs[name].append(seconds)
            infos[name] = info
            _log(f"round {r + 1}: {name} {seconds:.3f} s, paths {info.get('paths', '-')}")
    return secs, infos


def run(
    total_bytes: int, repeats: int, show_progress: bool = True, link_gbit: float = LINK_GBIT
) -> dict:
    from tpusync.rl import ShardLayout

    torch.set_num_threads(1)  # every process of every path copies on one thread
    shapes = _shapes(total_bytes)
    nbytes = sum(4 * r * c for r, c in shapes.values())
    whole = {n: ShardLayout.replicated(s, [0]) for n, s in shapes.items()}
    chain = [(0, 0), (1, 0)]
    result: dict = {"suite": "weights", "bytes": nbytes, "tensors": len(shapes), "goal": GOAL}

    def sync(label: str, *a, **kw) -> tuple[float, dict]:
        times, info = _run_sync(*a, **kw)
        _log(f"{label}: {statistics.median(times):.3f} s, paths {info.get('paths')}")
        return statistics.median(times), info

    def row(seconds: float, ref: float, limit: str, info: dict, path: str) -> dict:
        entry = result_entry(nbytes, seconds, ref, limit)
        entry["path"] = f"{path} (samplers reported: {', '.join(info.get('paths', [])) or '?'})"
        entry["stages"] = {k: info[k] for k in ("trainer_stages", "sampler_stages") if k in info}
        return entry

    iperf = shutil.which("iperf3")
    secs, infos = _loopback_rounds(shapes, whole, chain, nbytes, repeats, iperf)

    def paired(name: str, ref: str, limit: str, path: str) -> dict:
        """PAIRED ROUNDS: the row's ratio is the median of the per-round ratios."""
        entry = row(
            statistics.median(secs[name]), statistics.median(secs[ref]), limit, infos[name], path
        )
        ratios = [r / s for s, r in zip(secs[name], secs[ref], strict=True)]
        entry["ratio"] = round(statistics.median(ratios), 3)
        entry["ratio_rounds"] = [round(x, 3) for x in ratios]
        return entry

    gloo_ref = "torch.distributed gloo broadcast to 2 ranks, same tensors, same rounds"
    tcp_path = "chain trainer -> sampler 0 -> sampler 1, loopback TCP"
    shared_path = "both samplers read the trainer's /dev/shm pool"
    floor_ref = (
        "3 concurrent fused copy + hash passes of the same bytes in one process, same rounds"
    )
    paths = {
        "chain_tcp_vs_gloo": paired("chain_tcp", "gloo", gloo_ref, tcp_path),
        "chain_same_host_vs_gloo": paired(
            "chain_same_host",
            "gloo",
            gloo_ref,
            "chain over the same-host P/D path (Unix socket + shm)",
        ),
        "shared_same_host_vs_gloo": paired("shared_same_host", "gloo", gloo_ref, shared_path),
        "shared_same_host_vs_cpu_floor": paired(
            "shared_same_host", "cpu_floor", floor_ref, shared_path
        ),
    }
    floor_row = paired("cpu_floor", "gloo", gloo_ref, "")
    floor_row.pop("stages")
    floor_row["path"] = floor_ref + ": the best any pipeline of the shared path's passes could do"
    paths["cpu_floor_vs_gloo"] = floor_row
    if iperf:
        paths["chain_tcp_vs_iperf3"] = paired(
            "chain_tcp",
            "iperf3",
            f"iperf3 over loopback TCP, {STREAMS} streams, same bytes, same rounds",
            tcp_path,
        )
    why = hosts.unavailable() if link_gbit > 0 else "--link-gbit 0"
    if why is None and not iperf:
        why = "iperf3 not found (the link rows' reference)"
    result["links"] = {"gbit": link_gbit, "skipped": why}
    if why is None:
        rows, link_secs, link_queue = _links(
            shapes, whole, chain, repeats, nbytes, link_gbit, iperf, row
        )
        paths.update(rows)
        # A chain's trainer sends each byte once, gloo's root once per sampler: the best ratio
        # against gloo that any path could reach on these links.
        result["links"].update(
            queue=link_queue,
            seconds=link_secs,
            best_possible_vs_gloo=round(link_secs["gloo"] / link_secs["iperf3"], 3),
        )
    else:
        _log(f"emulated hosts skipped: {why}")
    _log("resharded vs plain: 2 trainer ranks (dim 0) -> 2 sampler ranks (dim 1 / dim 0)")
    src = {n: ShardLayout.split(s, 0, 2) for n, s in shapes.items()}
    plain_dst = {n: ShardLayout.split(s, 0, 2) for n, s in shapes.items()}
    resh_dst = {n: ShardLayout.split(s, 1, 2) for n, s in shapes.items()}
    group = [(0, 0), (0, 1)]
    plain, _ = sync("plain", shapes, src, plain_dst, 2, group, repeats, False)
    resh, resh_info = sync("resharded", shapes, src, resh_dst, 2, group, repeats, False)
    paths["resharded_vs_plain"] = {
        "seconds": round(resh, 4),
        "limit_seconds": round(plain, 4),
        "limit": "the same bytes, 2 -> 2 ranks with identical shards (plain), same run",
        "ratio": round(resh / plain, 3),
        "better": "lower",
        "path": f"2 trainer processes -> 2 sampler ranks, loopback TCP (samplers reported: "
        f"{', '.join(resh_info.get('paths', [])) or '?'})",
    }
    for kind in ("contiguous", "scattered"):
        _log(f"delta bytes, 1% of rows changed ({kind}): per-chunk vs per-tensor")
        paths[f"delta_{kind}_chunk_vs_tensor"] = _delta_bytes(shapes, kind == "scattered")
    result["paths"] = paths
    result["seconds"] = {k: statistics.median(v) for k, v in secs.items()}
    result["rounds"] = {k: [round(x, 4) for x in v] for k, v in secs.items()}
    result["iperf3"] = iperf is not None
    return result
