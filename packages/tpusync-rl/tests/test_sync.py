"""The network path: real processes, real sockets (tpusync's P/D transport + the control channel).

Trainer rank 0 runs in the test process (or in a child where it must die); trainer rank 1 and
every sampler rank run in spawned processes. Small blocks (64 KiB) force tensors to be cut into
pieces across blocks and buckets, so the packing, pipelining and window paths all run.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time

import pytest
import rl_netutil as U
import torch

from tpusync.core import StateError
from tpusync.rl import ShardLayout, TrainerSync
from tpusync.rl.layout import Box
from tpusync.rl.manifest import Manifest, TensorMeta
from tpusync.rl.pack import TRAILER, pack_streams

BB = 64 << 10


def tp_layouts(world: int, dims: dict[str, int], names=None) -> dict[str, ShardLayout]:
    """TP=world layouts (scalars and 1-D biases replicated); keyed by ``names(trainer_name)``."""
    names = names or (lambda n: n)
    out = {}
    for name, shape in U.SHAPES.items():
        if len(shape) < 2 or world == 1:
            out[names(name)] = ShardLayout.replicated(shape, range(world))
        else:
            out[names(name)] = ShardLayout.split(shape, dims.get(name, 0), world)
    return out


def rank0(dst, world=1, cls=TrainerSync, **kw):
    """Trainer rank 0 of a ``world``-rank trainer with the tests' secret (and block size unless
    given), plus ``dst`` keyed by engine names, as the samplers are started with."""
    kw.setdefault("block_bytes", BB)
    trainer = cls(0, world, dst, secret=U.SECRET, **kw)
    return trainer, {U.engine_name(n): lay for n, lay in dst.items()}


def get(q, kind, timeout=60.0, match=None):
    """The next item of ``kind`` from ``q`` (for which ``match(item)`` holds, if given); other
    items wait for their own get. Items from different processes arrive in no set order (each
    process's queue feeder thread writes when it gets to run), so tests that expect one item per
    process and version say which with ``match``."""
    if not hasattr(q, "tpusync_stash"):
        q.tpusync_stash = []
    stash = q.tpusync_stash

    def wanted(item):
        return item[0] == kind and (match is None or match(item))

    for i, item in enumerate(stash):
        if wanted(item):
            return stash.pop(i)
    while True:
        item = q.get(timeout=timeout)
        if wanted(item):
            return item
        stash.append(item)


def coordinator_port() -> int:
    """A port for JAX's coordinator, which binds ``[::]:port`` (every address) itself: picked
    BELOW the kernel's ephemeral range, so no other test's connection (ports from that range)
    can take it between this check and the coordinator's bind (a port from ``bind(0)`` could:
    seen once as "Failed to add port to server"). Checked bindable on ``[::]``."""
    import random
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        try:  # [::] is dual-stack here (bindv6only=0): it covers 0.0.0.0 too
            with socket.socket(socket.AF_INET6) as sock:
                sock.bind(("::", port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port below the ephemeral range (from {low})")


def start_jax_trainers(q, dst, versions, updates):
    """Two multi-controller JAX trainer processes (``jax.distributed``, 2 CPU devices each) that
    publish ``versions`` to ``dst`` layouts, and four float32 torch sampler ranks (one replica)
    taking ``updates`` versions; returns every process once the trainers were told to go."""
    base = {
        "coordinator": f"127.0.0.1:{coordinator_port()}",
        "processes": 2,
        "dst_layouts": dst,
        "block_bytes": BB,
        "samplers": 4,
        "versions": versions,
    }
    control_q = U.ctx().Queue()
    procs = [
        U.ctx().Process(
            target=U.jax_trainer_main,
            args=({**base, "process": i, "control_q": control_q}, q),
            daemon=True,
        )
        for i in range(2)
    ]
    for p in procs:
        p.start()
    try:
        control = get(q, "control", timeout=180)[1]
        control_q.put(control)
        eng = {U.engine_name(n): lay for n, lay in dst.items()}
        procs += start_samplers(q, control, eng, 1, 4, updates, common={"dtype": "float32"})
        control_q.put("go")
    except BaseException:
        join_all(procs, timeout=10)
        raise
    return procs


def published_by_each_process(q, version, processes=2):
    """The multi-controller JAX trainers' ("published", process, info, held, layouts, version)
    item of ``version`` from each process, in process order."""
    return [
        get(q, "published", timeout=60, match=lambda it, p=p: it[1] == p and it[5] == version)
        for p in range(processes)
    ]


def start_samplers(q, control, layouts_by_engine, replicas, world, updates, per=None, common=None):
    procs = []
    for replica in range(replicas):
        for rank in range(world):
            spec = {
                "replica": replica,
                "rank": rank,
                "layouts": layouts_by_engine,
                "control": control,
                "block_bytes": BB,
                "updates": updates,
                **(common or {}),
                **(per or {}).get((replica, rank), {}),
            }
            p = U.ctx().Process(target=U.sampler_main, args=(spec, q), daemon=True)
            p.start()
            procs.append(p)
    for _ in procs:
        get(q, "joined")
    return procs


def trainer_rank1(q, **spec):
    """Rank 1 of a 2-rank trainer in its own process (not started yet)."""
    spec = {"rank": 1, "world": 2, **spec}
    return U.ctx().Process(target=U.trainer_rank_main, args=(spec, q), daemon=True)


def collect(q, n, timeout=60.0):
    """The next update of ``n`` different samplers (a sampler's later updates wait their turn)."""
    out: dict = {}
    later = []
    while len(out) < n:
        item = get(q, "update", timeout)
        key = (item[1], item[2])
        if key in out:
            later.append(item)
        else:
            out[key] = item[3]
    q.tpusync_stash[:0] = later
    return out


def join_all(procs, timeout=30):
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()


def test_chain_of_two_samplers_picks_up_each_version_bf16_named():
    """Trainer -> sampler 0 -> sampler 1 (chain): each version lands on both, cast to bf16 under
    engine names; the trainer sends each byte once (sampler 0 forwards to sampler 1)."""
    q = U.ctx().Queue()
    dst = tp_layouts(1, {})
    trainer, eng = rank0(dst, bucket_blocks=2, pool_bytes=1 << 20, deadline=30.0)
    procs = start_samplers(q, trainer.control_address, eng, 2, 1, 2)
    try:
        trainer.wait_for_samplers(2, timeout=30)
        for v, seed in ((1, 11), (2, 12)):
            full = U.full_weights(seed)
            rep = trainer.publish(v, full)
            assert rep.ok, rep.failed
            assert sorted(rep.committed) == ["0:0", "1:0"]
            got = collect(q, 2)
            want = U.expected_digest(full, eng, 0, torch.bfloat16)
            for key, info in got.items():
                assert info["ok"] and info["version"] == v and info["serving"] == v, (key, info)
                assert info["digest"] == want, key
            assert got[(0, 0)]["forwarded"] > 0 and got[(1, 0)]["forwarded"] == 0
            payload = sum(t.numel() * 4 for t in full.values())
            # One copy of the model (plus block padding) left the trainer, not two.
            assert payload <= rep.bytes_sent < 1.5 * payload
    finally:
        join_all(procs)
        trainer.close()


def test_forwarding_sampler_that_finishes_first_keeps_serving_its_slow_child():
    """DRAIN CONTRACT: sampler 0 commits and closes while sampler 1 (slow staging) still pulls
    the last buckets from it; the close waits for those pulls, so both commit the version."""
    q = U.ctx().Queue()
    dst = tp_layouts(1, {})
    trainer, eng = rank0(dst, bucket_blocks=1, pool_bytes=1 << 20)
    per = {(1, 0): {"stage_delay": 0.25, "window": 1}}
    procs = start_samplers(q, trainer.control_address, eng, 2, 1, 1, per=per)
    try:
        trainer.wait_for_samplers(2, timeout=30)
        full = U.full_weights(21)
        rep = trainer.publish(1, full)
        assert rep.ok, rep.failed
        got = collect(q, 2)
        want = U.expected_digest(full, eng, 0, torch.bfloat16)
        for key, info in got.items():
            assert info["ok"] and info["serving"] == 1 and info["digest"] == want, (key, info)
        assert got[(0, 0)]["forwarded"] > 0
        # The slow child staged long after its parent committed (the parent's close waited).
        assert got[(1, 0)]["waited"] > got[(0, 0)]["waited"] + 1.0, got
    finally:
        join_all(procs)
        trainer.close()


def test_reshard_tp2_trainer_to_tp4_samplers_without_gathering():
    """Two trainer processes (TP=2 on dim 0) -> one sampler group of four ranks (TP=4, some
    tensors split on dim 1): every rank ends with exactly its shard and received only it."""
    q = U.ctx().Queue()
    src = tp_layouts(2, {})
    dst = tp_layouts(4, {"embed": 1, "layers.1.w": 1})
    trainer, eng = rank0(dst, 2, bucket_blocks=2, pool_bytes=2 << 20, deadline=30.0)
    procs = start_samplers(q, trainer.control_address, eng, 1, 4, 1, common={"dtype": "float32"})
    rank1 = trainer_rank1(
        q,
        dst_layouts=dst,
        src_layouts=src,
        control=trainer.control_address,
        block_bytes=BB,
        pool_bytes=2 << 20,
        versions=[(1, 21)],
    )
    rank1.start()
    try:
        trainer.wait_for_samplers(4, timeout=30)
        full = U.full_weights(21)
        mine = {n: (U.shard(t, src[n].box_of(0)).clone(), src[n]) for n, t in full.items()}
        rep = trainer.publish(1, mine)
        assert rep.ok, rep.failed
        got = collect(q, 4)
        for (_replica, rank), info in got.items():
            assert info["ok"], info
            assert info["digest"] == U.expected_digest(full, eng, rank, torch.float32), rank
            own = sum(eng[U.engine_name(n)].box_of(rank).size * 4 for n in full)
            assert info["bytes"] == own  # only its own shard came over the wire
        assert get(q, "published")[1] == 1
    finally:
        join_all(procs + [rank1])
        trainer.close()


def test_trainer_without_dst_layouts_plans_for_the_layouts_its_samplers_report(caplog):
    """SAMPLER LAYOUTS CONTRACT: a trainer built with ``dst_layouts=None`` refuses to publish
    before any sampler reported layouts (and that version number stays usable), rejects a
    malformed report, then plans every version for the layouts its members report. Two replicas
    of TP=2 that disagree (a tie: the smallest key's replica wins): replica 0 commits exactly its
    shards, replica 1 refuses the plan and nothing of it is loaded wrong."""
    from tpusync.rl.control import ControlClient

    q = U.ctx().Queue()
    dst = tp_layouts(2, {"embed": 1})  # replica 0: the embedding split on dim 1
    odd = tp_layouts(2, {})  # replica 1: on dim 0
    trainer = TrainerSync(0, 1, None, secret=U.SECRET, block_bytes=BB, deadline=30.0)
    full = U.full_weights(31)
    with pytest.raises(ValueError, match="none of the 0 samplers .* has reported its layouts"):
        trainer.publish(1, full)
    client = ControlClient(U.SECRET, trainer.control_address)
    bad = {"op": "next", "replica": 9, "rank": 0, "addr": {}, "have": 0, "layouts": {"w": [[4]]}}
    with pytest.raises(RuntimeError, match="sampler 9:0 reported malformed layouts"):
        client.request(bad, timeout=10)
    client.close()
    per = {}
    for replica, lay in ((0, dst), (1, odd)):
        for rank in range(2):
            per[(replica, rank)] = {
                "layouts": {U.engine_name(n): v for n, v in lay.items()},
                "report_layouts": lay,
            }
    procs = start_samplers(
        q, trainer.control_address, None, 2, 2, 1, per=per, common={"dtype": "float32"}
    )
    try:
        assert trainer.wait_for_samplers(4, timeout=30) == ["0:0", "0:1", "1:0", "1:1"]
        with caplog.at_level(logging.WARNING, logger="tpusync.rl"):
            rep = trainer.publish(1, full)  # the same version as the refused one
        assert sorted(rep.committed) == ["0:0", "0:1"], rep.failed
        assert sorted(rep.failed) == ["1:0", "1:1"]
        assert "samplers ['1:0', '1:1'] reported layouts other than the group's" in caplog.text
        got = collect(q, 4)
        eng = {U.engine_name(n): v for n, v in dst.items()}
        for (replica, rank), info in got.items():
            if replica == 1:
                assert not info["ok"] and "the trainer plans for sampler layout" in info["reason"]
                assert info["serving"] == 0
                continue
            assert info["ok"], info
            assert info["digest"] == U.expected_digest(full, eng, rank, torch.float32), rank
            assert info["bytes"] == sum(dst[n].box_of(rank).size * 4 for n in full)
    finally:
        join_all(procs)
        trainer.close()


def test_resharded_publish_larger_than_the_trainer_pools_never_waits_for_the_deadline():
    """Regression (1 GiB resharded stall): 2 trainer ranks -> 2 sampler ranks split on another
    dim, each trainer's data several times its pool (4 blocks), two versions. Waiting for pool
    blocks used to swallow the transport's acknowledgements, so every trainer rank then waited
    for them until the version's deadline (and rank > 0 reported the samplers as failed)."""
    deadline = 6.0
    q = U.ctx().Queue()
    src = tp_layouts(2, {})
    dst = tp_layouts(2, {"embed": 1, "layers.0.w": 1, "layers.1.w": 1})
    bb = 16 << 10  # one block per bucket, 4 blocks per pool: the trainers block on every bucket
    small = {"block_bytes": bb, "bucket_blocks": 1, "pool_bytes": 4 * bb, "deadline": deadline}
    per_trainer = sum(4 * src[n].box_of(0).size for n in U.SHAPES)
    assert per_trainer > 3 * small["pool_bytes"]  # the premise: a version outgrows the pools
    trainer, eng = rank0(dst, 2, **small)
    procs = start_samplers(
        q,
        trainer.control_address,
        eng,
        1,
        2,
        2,
        common={"dtype": "float32", "block_bytes": bb, "pool_bytes": 4 * bb},
    )
    rank1 = trainer_rank1(
        q,
        dst_layouts=dst,
        src_layouts=src,
        control=trainer.control_address,
        versions=[(1, 41), (2, 42)],
        **small,
    )
    try:
        trainer.wait_for_samplers(2, timeout=30)
        # Rank 1 waits only `deadline` s for rank 0's announcement: start it once the samplers
        # are up and publish as soon as it joined (a loaded host spawns processes slowly).
        rank1.start()
        end = time.monotonic() + 60
        while len(trainer._trainers) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        for version, seed in [(1, 41), (2, 42)]:
            full = U.full_weights(seed)
            mine = {n: (U.shard(t, src[n].box_of(0)).clone(), src[n]) for n, t in full.items()}
            rep = trainer.publish(version, mine)
            assert rep.ok, rep.failed
            # Every bucket was acknowledged long before the deadline; a lost acknowledgement
            # makes publish return only at deadline + 1 s.
            assert rep.seconds < deadline, rep.seconds
            got = collect(q, 2)
            for (_replica, rank), info in got.items():
                assert info["ok"] and info["version"] == version, info
                assert info["digest"] == U.expected_digest(full, eng, rank, torch.float32), rank
            published = get(q, "published")
            assert published[1] == version
            assert published[2]["failed"] == {}, published  # rank 1 saw every acknowledgement
    finally:
        join_all(procs + ([rank1] if rank1.pid is not None else []))
        trainer.close()


def test_inplace_update_while_paused():
    q = U.ctx().Queue()
    dst = tp_layouts(1, {})
    trainer, eng = rank0(dst, pool_bytes=1 << 20)
    procs = start_samplers(
        q,
        trainer.control_address,
        eng,
        1,
        1,
        1,
        common={"mode": "inplace", "paused": True, "dtype": "float32"},
    )
    try:
        trainer.wait_for_samplers(1, timeout=30)
        full = U.full_weights(31)
        assert trainer.publish(1, full).ok
        info = collect(q, 1)[(0, 0)]
        assert info["ok"] and info["digest"] == U.expected_digest(full, eng, 0, torch.float32)
    finally:
        join_all(procs)
        trainer.close()


def three_committed(q, trainer, eng, updates, seed, **kw):
    """Three single-rank sampler replicas of ``trainer`` (``start_samplers`` options ``kw``)
    taking ``updates`` versions, version 1 (``U.full_weights(seed)``) published and committed by
    all three; the processes. On a failure everything started is stopped, the trainer closed."""
    procs = start_samplers(q, trainer.control_address, eng, 3, 1, updates, **kw)
    try:
        trainer.wait_for_samplers(3, timeout=30)
        assert trainer.publish(1, U.full_weights(seed)).ok
        collect(q, 3)
    except BaseException:
        join_all(procs)
        trainer.close()
        raise
    return procs


def three_replicas_one_dying(q, fanout, dying, seed):
    """Trainer rank 0 (60 s deadline, 2 s silence timeout, one-block buckets) and three
    single-rank sampler replicas taking 3 updates, replica ``dying`` exiting after its first
    block of version 2; version 1 (``U.full_weights(seed)``) is committed everywhere. Returns
    the trainer, the sampler processes and the engine-name layouts."""
    trainer, eng = rank0(
        tp_layouts(1, {}),
        bucket_blocks=1,
        fanout=fanout,
        pool_bytes=2 << 20,
        deadline=60.0,
        silence=2.0,
    )
    procs = three_committed(q, trainer, eng, 3, seed, per={(dying, 0): {"die_at_version": 2}})
    return trainer, procs, eng


def test_sampler_dying_mid_update_is_reported_and_others_commit(caplog):
    """Three replicas, fanout 3 (all pull from the trainer over TCP): replica 2 dies after its
    first block of version 2. Its silence gives it away (HEARTBEAT CONTRACT) long before the 60 s
    deadline: the trainer names it, cancels the sends registered for it (its pool is free again
    at once), replicas 0 and 1 commit, and version 3 goes out to the survivors only."""
    q = U.ctx().Queue()
    trainer, procs, _eng = three_replicas_one_dying(q, fanout=3, dying=2, seed=1)
    try:
        with caplog.at_level(logging.ERROR, logger="tpusync.rl"):
            rep = trainer.publish(2, U.full_weights(2))
        assert sorted(rep.committed) == ["0:0", "1:0"]
        assert list(rep.failed) == ["2:0"]
        assert "no heartbeat" in rep.failed["2:0"], rep.failed
        assert "presumed dead" in rep.failed["2:0"], rep.failed
        assert rep.seconds < 30.0, f"waited {rep.seconds:.1f} s for a dead sampler"
        assert "sampler 2:0 failed version 2" in caplog.text
        # Cancelled, not held until the deadline: the next version starts on a free pool.
        assert trainer._ep.producer.pending == 0
        assert trainer._ep.pool.num_free == trainer._ep.pool.num_blocks
        got = collect(q, 2)
        assert all(i["ok"] and i["version"] == 2 for i in got.values())
        assert procs[2].exitcode == 3 or not procs[2].is_alive()
        rep3 = trainer.publish(3, U.full_weights(3))
        assert rep3.ok and sorted(rep3.committed) == ["0:0", "1:0"]
        assert rep3.seconds < 30.0
        collect(q, 2)
    finally:
        join_all(procs)
        trainer.close()


def test_slow_live_sampler_keeps_beating_and_is_not_presumed_dead():
    """HEARTBEAT CONTRACT: beats come from a thread of their own, so a sampler whose staging
    takes several times the 1 s silence timeout (0.3 s per block) is not presumed dead."""
    q = U.ctx().Queue()
    dst = tp_layouts(1, {})
    trainer, eng = rank0(dst, bucket_blocks=1, deadline=60.0, silence=1.0)
    procs = start_samplers(q, trainer.control_address, eng, 1, 1, 1, common={"stage_delay": 0.3})
    try:
        trainer.wait_for_samplers(1, timeout=30)
        rep = trainer.publish(1, U.full_weights(5))
        assert rep.ok and rep.committed == ["0:0"], rep
        assert rep.seconds > 2.0  # it really was slower than the silence timeout
        assert get(q, "update")[3]["ok"]
    finally:
        join_all(procs)
        trainer.close()


def three_idle_replicas(q, silence, per=None, updates=2, fanout=3):
    """Trainer rank 0 (60 s deadline, ``silence``) and three single-rank float32 replicas
    (``fanout``) that committed version 1 (``U.full_weights(41)``); returns the trainer, the
    processes and the engine-name layouts."""
    trainer, eng = rank0(tp_layouts(1, {}), fanout=fanout, deadline=60.0, silence=silence)
    procs = three_committed(q, trainer, eng, updates, 41, per=per, common={"dtype": "float32"})
    return trainer, procs, eng


@pytest.mark.parametrize("fanout, dead, pause", [(3, 2, 0.0), (1, 0, 2.5)])
def test_sampler_killed_while_idle_is_reported_by_its_silence_not_the_deadline(
    caplog, fanout, dead, pause
):
    """HEARTBEAT CONTRACT: a replica is SIGKILLed while idle (waiting for version 2, before the
    trainer announces it: it never fetches the announcement). Its idle beats stop, so version 2
    reports it within seconds of the 2 s silence, not at the 60 s deadline, and the others
    commit. Fanout 3, published at once: the trainer cancels the sends it registered for the
    dead replica. A chain (fanout 1) whose head dies, published after the silence: the dead
    replica is in no tree, so the chain trainer -> 1 -> 2 still delivers."""
    import os
    import signal

    q = U.ctx().Queue()
    trainer, procs, eng = three_idle_replicas(q, silence=2.0, updates=3, fanout=fanout)
    live = sorted(f"{r}:0" for r in range(3) if r != dead)
    try:
        os.kill(procs[dead].pid, signal.SIGKILL)
        procs[dead].join(10)
        time.sleep(pause)
        with caplog.at_level(logging.ERROR, logger="tpusync.rl"):
            rep = trainer.publish(2, U.full_weights(42))
        assert sorted(rep.committed) == live, rep
        assert list(rep.failed) == [f"{dead}:0"], rep.failed
        assert "no heartbeat" in rep.failed[f"{dead}:0"], rep.failed
        assert rep.seconds < 30.0, f"waited {rep.seconds:.1f} s for a sampler killed while idle"
        assert f"sampler {dead}:0 failed version 2" in caplog.text
        assert trainer._ep.producer.pending == 0  # nothing held for the dead replica
        assert trainer._ep.pool.num_free == trainer._ep.pool.num_blocks
        full = U.full_weights(42)
        for info in collect(q, 2).values():
            assert info["ok"] and info["digest"] == U.expected_digest(full, eng, 0, torch.float32)
        assert trainer.samplers == live
        rep3 = trainer.publish(3, U.full_weights(43))
        assert rep3.ok and sorted(rep3.committed) == live, rep3
        collect(q, 2)
    finally:
        join_all(procs)
        trainer.close()


def test_idle_live_sampler_that_does_not_poll_is_not_presumed_dead():
    """HEARTBEAT CONTRACT: replica 1 stays idle for 4 s (4x the 1 s silence) without polling
    while version 2 is in flight; its idle beats keep it alive, so it is not reported: it polls,
    fetches version 2 late and commits, like the others."""
    q = U.ctx().Queue()
    trainer, procs, eng = three_idle_replicas(
        q, silence=1.0, per={(1, 0): {"idle_before": {1: 4.0}}}
    )
    try:
        get(q, "idle", match=lambda it: it[1] == 1)
        rep = trainer.publish(2, U.full_weights(44))
        assert rep.ok and sorted(rep.committed) == ["0:0", "1:0", "2:0"], rep
        assert rep.seconds > 2.0  # replica 1 really was silent on the poll path for > silence
        full = U.full_weights(44)
        for info in collect(q, 3).values():
            assert info["ok"] and info["digest"] == U.expected_digest(full, eng, 0, torch.float32)
    finally:
        join_all(procs)
        trainer.close()


def test_cleanly_closed_sampler_says_goodbye_and_is_not_reported_dead():
    """HEARTBEAT CONTRACT: replica 2 takes one update and closes cleanly (it says ``bye``); the
    next version, published after more than the silence timeout, goes to replicas 0 and 1 only
    and reports nobody: the closed sampler is neither presumed dead nor waited for."""
    q = U.ctx().Queue()
    trainer, procs, _eng = three_idle_replicas(q, silence=1.0, per={(2, 0): {"updates": 1}})
    try:
        get(q, "closed", match=lambda it: it[1] == 2)
        procs[2].join(20)
        assert procs[2].exitcode == 0
        time.sleep(1.5)  # longer than the silence: a sampler that merely vanished would be dead
        assert trainer.samplers == ["0:0", "1:0"]
        rep = trainer.publish(2, U.full_weights(45))
        assert rep.ok and sorted(rep.committed) == ["0:0", "1:0"], rep
        assert rep.seconds < 30.0
        collect(q, 2)
    finally:
        join_all(procs)
        trainer.close()


def test_dead_middle_of_a_chain_is_reported_and_its_child_is_reparented():
    """Chain trainer -> 0 -> 1 -> 2 (fanout 1, TCP): replica 1 dies after its first block of
    version 2. Replica 0 commits (and cancels what it forwarded to 1 once a beat reply names 1),
    replica 2 is re-parented to the trainer within the version and commits it too
    (RE-PARENTING CONTRACT), all well before the 60 s deadline; version 3 then runs over the
    chain 0 -> 2 and both commit."""
    q = U.ctx().Queue()
    trainer, procs, eng = three_replicas_one_dying(q, fanout=1, dying=1, seed=11)
    try:
        rep = trainer.publish(2, U.full_weights(12))
        assert sorted(rep.committed) == ["0:0", "2:0"], rep
        assert sorted(rep.failed) == ["1:0"], rep.failed
        assert "no heartbeat" in rep.failed["1:0"] or "exited" in rep.failed["1:0"], rep.failed
        assert rep.reparented == {"2:0": "1:0"}, rep.reparented
        assert rep.seconds < 30.0, f"waited {rep.seconds:.1f} s for a dead chain member"
        got = collect(q, 2)
        full = U.full_weights(12)
        for key in ((0, 0), (2, 0)):
            assert got[key]["ok"] and got[key]["version"] == 2, got[key]
            assert got[key]["digest"] == U.expected_digest(full, eng, 0, torch.bfloat16)
        # Each block staged exactly once on the orphan, as on its live parent.
        assert got[(2, 0)]["staged"] == got[(0, 0)]["staged"] > 0, got
        assert got[(2, 0)]["waited"] < 30.0
        assert trainer.wait_for_samplers(2, timeout=30) == ["0:0", "2:0"]
        rep3 = trainer.publish(3, U.full_weights(13))
        assert rep3.ok and sorted(rep3.committed) == ["0:0", "2:0"], rep3
        assert not rep3.reparented
        got = collect(q, 2)
        full = U.full_weights(13)
        for key in ((0, 0), (2, 0)):
            assert got[key]["ok"] and got[key]["version"] == 3
            assert got[key]["digest"] == U.expected_digest(full, eng, 0, torch.bfloat16)
        # Replica 0 cancelled what it had forwarded to the dead replica 1, so its close does not
        # wait for those sends (DRAIN CONTRACT: up to 30 s) and it exits cleanly.
        procs[0].join(20)
        assert procs[0].exitcode == 0
    finally:
        join_all(procs)
        trainer.close()


def chain_with_killed_head(q, trainer_world, seed, stamp, signal="SIGKILL"):
    """Trainer (``trainer_world`` processes: rank 0 here, rank 1 spawned) -> replica 0 -> 1 -> 2
    (fanout 1, float32, 60 s deadline, 2 s silence, one-block buckets); replica 0 SIGKILLs
    itself after staging its first block of version 2. Version 1 (``seed``) is committed
    everywhere. Returns (trainer, rank 1 process or None, sampler processes, engine layouts,
    ``mine(seed)``: rank 0's tensors of a version)."""
    src = tp_layouts(trainer_world, {})
    dst = tp_layouts(1, {})
    kw = {"bucket_blocks": 1, "fanout": 1, "pool_bytes": 2 << 20, "deadline": 60.0}
    trainer, eng = rank0(dst, trainer_world, silence=2.0, **kw)
    procs = start_samplers(
        q,
        trainer.control_address,
        eng,
        3,
        1,
        3,
        common={"dtype": "float32"},
        per={(0, 0): {"kill_at_version": 2, "kill_stamp": stamp, "kill_signal": signal}},
    )
    rank1 = None
    if trainer_world == 2:
        rank1 = trainer_rank1(
            q,
            dst_layouts=dst,
            src_layouts=src,
            control=trainer.control_address,
            block_bytes=BB,
            versions=[(1, seed), (2, seed + 1), (3, seed + 2)],
            **kw,
        )
        rank1.start()

    def mine(v_seed):
        full = U.full_weights(v_seed)
        if trainer_world == 1:
            return full
        return {n: (U.shard(t, src[n].box_of(0)).clone(), src[n]) for n, t in full.items()}

    try:
        trainer.wait_for_samplers(3, timeout=30)
        assert trainer.publish(1, mine(seed)).ok
        collect(q, 3)
        if rank1 is not None:
            assert get(q, "published")[1] == 1
    except BaseException:
        join_all(procs + ([rank1] if rank1 else []))
        trainer.close()
        raise
    return trainer, rank1, procs, eng, mine


@pytest.mark.parametrize("trainer_world, signal", [(1, "SIGKILL"), (2, "SIGKILL"), (1, "SIGSTOP")])
def test_chain_head_killed_mid_update_its_descendants_commit_the_version(
    trainer_world, signal, tmp_path
):
    """RE-PARENTING CONTRACT: chain trainer -> A (0) -> B (1) -> C (2); A is SIGKILLed after its
    first block of version 2. B is re-parented to the trainer (with two trainer processes, TP=2,
    both ranks serve it their pieces), C keeps pulling from B; both commit version 2 bit-equal to
    the trainer's tensors, each block staged once; A is reported; everything ends well before the
    60 s deadline; version 3 then goes down the chain B -> C as usual. SIGSTOP: A hangs with its
    sockets open (like a host gone without a FIN), so B's pulls hang instead of failing: B learns
    from a beat reply, once A's heartbeat silence (2 s) counts it failed."""
    import os

    q = U.ctx().Queue()
    stamp = str(tmp_path / "killed_at")
    trainer, rank1, procs, eng, mine = chain_with_killed_head(q, trainer_world, 51, stamp, signal)
    everyone = procs + ([rank1] if rank1 else [])
    try:
        rep = trainer.publish(2, mine(52))
        assert sorted(rep.committed) == ["1:0", "2:0"], rep
        assert list(rep.failed) == ["0:0"], rep.failed
        if signal == "SIGSTOP":
            assert "no heartbeat" in rep.failed["0:0"], rep.failed
        assert rep.reparented == {"1:0": "0:0"}, rep.reparented
        assert rep.seconds < 30.0, f"waited {rep.seconds:.1f} s for a dead chain head"
        full = U.full_weights(52)
        got = collect(q, 2)
        for key in ((1, 0), (2, 0)):
            assert got[key]["ok"] and got[key]["version"] == 2, got[key]
            assert got[key]["digest"] == U.expected_digest(full, eng, 0, torch.float32)
        # B resumed where it stood: every block staged exactly once, as on C.
        assert got[(1, 0)]["staged"] == got[(2, 0)]["staged"] > 0, got
        # B's pulls from A did not outlive the version: those in flight were abandoned (a hung
        # A's would otherwise stay pending, holding B's pool blocks, until the 60 s deadline).
        assert got[(1, 0)]["pending_pulls"] == 0, got[(1, 0)]
        if signal == "SIGSTOP":
            assert got[(1, 0)]["pulls_abandoned"] > 0, got[(1, 0)]
        if signal == "SIGSTOP":
            os.kill(procs[0].pid, 9)
        procs[0].join(10)
        assert procs[0].exitcode == -9
        killed_at = float(open(stamp).read())
        death_to_commit = max(got[k]["done_at"] for k in got) - killed_at
        print(
            f"{trainer_world} trainer(s), {signal}: A -> B, C committed in {death_to_commit:.2f} s"
        )
        assert 0 < death_to_commit < 30.0
        if rank1 is not None:
            _, v, info = get(q, "published")
            assert v == 2 and list(info["failed"]) == ["0:0"], info
            assert info["seconds"] < 30.0, f"rank 1 waited {info['seconds']:.1f} s"
        assert trainer.samplers == ["1:0", "2:0"]
        rep3 = trainer.publish(3, mine(53))
        assert rep3.ok and sorted(rep3.committed) == ["1:0", "2:0"], rep3
        assert not rep3.reparented
        full = U.full_weights(53)
        got = collect(q, 2)
        for key in ((1, 0), (2, 0)):
            assert got[key]["ok"] and got[key]["version"] == 3, got[key]
            assert got[key]["digest"] == U.expected_digest(full, eng, 0, torch.float32)
        assert got[(1, 0)]["forwarded"] > 0 and got[(2, 0)]["forwarded"] == 0  # B -> C again
        if rank1 is not None:
            _, v, info = get(q, "published")
            assert v == 3 and not info["failed"], info
    finally:
        join_all(everyone)
        trainer.close()


def test_tree_inner_node_killed_mid_update_both_children_commit():
    """RE-PARENTING CONTRACT in a tree (fanout 2): replicas 0 and 1 pull from the trainer, 2 and
    3 from replica 0. Version 2 is a per-chunk delta (rows changed in every tensor, several
    buckets). Replica 0 is SIGKILLed after its first block of it: its two children are
    re-parented to the trainer (two child slots), get the rest of the delta re-filled and commit
    version 2 bit-equal with replica 1; replica 0 is reported, all well before the 60 s
    deadline."""
    q = U.ctx().Queue()
    trainer, eng = rank0(
        tp_layouts(1, {}),
        bucket_blocks=1,
        fanout=2,
        pool_bytes=2 << 20,
        deadline=60.0,
        silence=2.0,
    )
    procs = start_samplers(
        q,
        trainer.control_address,
        eng,
        4,
        1,
        2,
        common={"dtype": "float32"},
        per={(0, 0): {"kill_at_version": 2}},
    )
    try:
        trainer.wait_for_samplers(4, timeout=30)
        assert trainer.publish(1, U.full_weights(61), delta=True).ok  # the delta base
        v1 = collect(q, 4)
        bumps = [
            ("embed", (0, 3), 1.0),
            ("embed", (200, 7), 2.0),
            ("layers.0.w", (5, 1), 3.0),
            ("layers.0.w", (150, 2), 4.0),
            ("layers.1.w", (9, 4), 5.0),
            ("layers.1.w", (220, 5), 6.0),
        ]
        rep = trainer.publish(2, U.full_weights(61, bumps), delta=True)
        assert sorted(rep.committed) == ["1:0", "2:0", "3:0"], rep
        assert list(rep.failed) == ["0:0"], rep.failed
        assert rep.reparented == {"2:0": "0:0", "3:0": "0:0"}, rep.reparented
        assert rep.seconds < 30.0, f"waited {rep.seconds:.1f} s for a dead inner node"
        full = U.full_weights(61, bumps)
        got = collect(q, 3)
        assert got[(1, 0)]["bytes"] < v1[(1, 0)]["bytes"], (got, v1)  # a chunk delta indeed
        for key in ((1, 0), (2, 0), (3, 0)):
            assert got[key]["ok"] and got[key]["version"] == 2, got[key]
            assert got[key]["digest"] == U.expected_digest(full, eng, 0, torch.float32)
            assert got[key]["staged"] == got[(1, 0)]["staged"] > 0, got
        assert trainer._ep.producer.pending == 0
    finally:
        join_all(procs)
        trainer.close()


def test_dead_sampler_is_cancelled_by_every_trainer_rank():
    """Two trainer processes (TP=2) -> replicas 0 and 1 (fanout 2, both pull from both ranks):
    replica 1 dies mid-version 2. Rank 0 finds its silence; rank 1, which has sends registered
    for it too, learns it from rank 0 and cancels them, so both ranks return well before the
    60 s deadline, and version 3 commits on replica 0."""
    q = U.ctx().Queue()
    src = tp_layouts(2, {})
    dst = tp_layouts(1, {})
    trainer, eng = rank0(
        dst, 2, bucket_blocks=1, fanout=2, pool_bytes=2 << 20, deadline=60.0, silence=2.0
    )
    procs = start_samplers(
        q,
        trainer.control_address,
        eng,
        2,
        1,
        3,
        common={"dtype": "float32"},
        per={(1, 0): {"die_at_version": 2}},
    )
    rank1 = trainer_rank1(
        q,
        dst_layouts=dst,
        src_layouts=src,
        control=trainer.control_address,
        block_bytes=BB,
        bucket_blocks=1,
        fanout=2,
        pool_bytes=2 << 20,
        deadline=60.0,
        versions=[(1, 31), (2, 32), (3, 33)],
    )
    rank1.start()

    def mine(seed):
        full = U.full_weights(seed)
        return {n: (U.shard(t, src[n].box_of(0)).clone(), src[n]) for n, t in full.items()}

    try:
        trainer.wait_for_samplers(2, timeout=30)
        assert trainer.publish(1, mine(31)).ok
        collect(q, 2)
        assert get(q, "published")[1] == 1
        rep = trainer.publish(2, mine(32))
        assert rep.committed == ["0:0"] and list(rep.failed) == ["1:0"], rep
        assert "no heartbeat" in rep.failed["1:0"]
        assert rep.seconds < 30.0, f"rank 0 waited {rep.seconds:.1f} s"
        _, v, info = get(q, "published")
        assert v == 2 and list(info["failed"]) == ["1:0"], info
        assert info["seconds"] < 30.0, f"rank 1 waited {info['seconds']:.1f} s"
        got = collect(q, 1)
        assert got[(0, 0)]["ok"] and got[(0, 0)]["version"] == 2
        rep3 = trainer.publish(3, mine(33))
        assert rep3.ok and rep3.committed == ["0:0"], rep3
        full = U.full_weights(33)
        info = collect(q, 1)[(0, 0)]
        assert info["ok"] and info["digest"] == U.expected_digest(full, eng, 0, torch.float32)
        _, v, info = get(q, "published")
        assert v == 3 and not info["failed"], info
    finally:
        join_all(procs + [rank1])
        trainer.close()


def test_trainer_dying_leaves_samplers_on_the_old_version():
    q = U.ctx().Queue()
    dst = tp_layouts(1, {})
    spec = {
        "rank": 0,
        "world": 1,
        "dst_layouts": dst,
        "src_layouts": tp_layouts(1, {}),
        "block_bytes": BB,
        "bucket_blocks": 1,
        "pool_bytes": 4 << 20,
        "deadline": 10.0,
        "samplers": 2,
        "versions": [(1, 41), (2, 42)],
        "die_at_version": 2,
    }
    tp = U.ctx().Process(target=U.trainer_rank_main, args=(spec, q), daemon=True)
    tp.start()
    control = get(q, "control")[1]
    eng = {U.engine_name(n): lay for n, lay in dst.items()}
    procs = start_samplers(q, control, eng, 2, 1, 3, common={"timeouts": [60, 60, 3], "window": 1})
    try:
        first = collect(q, 2)
        want1 = U.expected_digest(U.full_weights(41), eng, 0, torch.bfloat16)
        assert all(i["ok"] and i["digest"] == want1 for i in first.values())
        second = collect(q, 2)  # the trainer died mid-version-2
        for info in second.values():
            assert not info["ok"] and info["version"] == 2
            assert info["serving"] == 1 and info["digest"] == want1
        third = collect(q, 2)  # nobody announces anything any more: each wait times out
        assert all(info is None for info in third.values())
        tp.join(10)
        assert tp.exitcode == 4
    finally:
        join_all(procs + [tp])


def test_damaged_block_rejects_update_others_commit(caplog):
    q = U.ctx().Queue()
    dst = tp_layouts(2, {})
    trainer, eng = rank0(dst, cls=U.TamperingTrainer, pool_bytes=2 << 20, deadline=15.0)
    procs = start_samplers(q, trainer.control_address, eng, 1, 2, 2)
    try:
        trainer.wait_for_samplers(2, timeout=30)
        full1 = U.full_weights(51)
        assert trainer.publish(1, full1).ok
        collect(q, 2)
        rep = trainer.publish(2, U.full_weights(52))
        assert rep.committed == ["0:0"]
        # The transport checked the block against the trainer's checksum and refused it; the
        # sampler names the tensors of the bucket.
        assert "failed its checksum" in rep.failed["0:1"] and "embed" in rep.failed["0:1"]
        assert rep.seconds < 10.0  # the trainer stopped waiting once the sampler reported
        got = collect(q, 2)
        assert got[(0, 0)]["ok"] and got[(0, 0)]["serving"] == 2
        bad = got[(0, 1)]
        assert not bad["ok"] and "failed its checksum" in bad["reason"] and bad["serving"] == 1
        assert bad["digest"] == U.expected_digest(full1, eng, 1, torch.bfloat16)
    finally:
        join_all(procs)
        trainer.close()


def test_group_that_did_not_verify_a_version_keeps_every_rank_off_it():
    """GROUP COMMIT CONTRACT: ranks 0 and 1 serve together (one engine). Version 2's block to
    rank 1 is damaged; rank 0 verifies all of it, but its group (the callback standing in for
    the engine's exchange) says rank 1 failed. Rank 0 then commits nothing and the trainer counts
    it failed with the group's reason; the group's confirm is asked only about versions that
    verified on that rank; version 3, asked for as a delta, reaches both (the failure made it a
    full update, the base rank 0 would lack)."""
    q = U.ctx().Queue()
    dst = tp_layouts(2, {})
    trainer, eng = rank0(dst, cls=U.TamperingTrainer, pool_bytes=2 << 20, deadline=15.0)
    why = "test: rank 1 of this group failed version 2"
    group = {"group_refuses": {2: why}}
    procs = start_samplers(q, trainer.control_address, eng, 1, 2, 3, common=group)
    try:
        trainer.wait_for_samplers(2, timeout=30)
        full1, full3 = U.full_weights(61), U.full_weights(63)
        assert trainer.publish(1, full1).ok
        collect(q, 2)
        rep = trainer.publish(2, U.full_weights(62))
        assert rep.committed == [], rep.failed
        assert rep.failed["0:0"] == why
        assert "failed its checksum" in rep.failed["0:1"]
        got = collect(q, 2)
        for rank, info in ((0, got[(0, 0)]), (1, got[(0, 1)])):
            assert not info["ok"] and info["version"] == 2 and info["serving"] == 1, rank
            assert info["digest"] == U.expected_digest(full1, eng, rank, torch.bfloat16), rank
        assert got[(0, 0)]["reason"] == why
        assert got[(0, 0)]["confirmed"] == [1, 2] and got[(0, 1)]["confirmed"] == [1]
        trainer.wait_for_samplers(2, timeout=30)  # both back in the group once they polled
        rep3 = trainer.publish(3, full3, delta=True)
        assert rep3.ok and rep3.committed == ["0:0", "0:1"], rep3.failed
        for (_replica, rank), info in collect(q, 2).items():
            assert info["ok"] and info["serving"] == 3, rank
            assert info["digest"] == U.expected_digest(full3, eng, rank, torch.bfloat16), rank
    finally:
        join_all(procs)
        trainer.close()


def test_version_skew_is_refused():
    """A sampler already at version 5 refuses version 3 and keeps serving 5."""
    q = U.ctx().Queue()
    dst = tp_layouts(1, {})
    trainer, eng = rank0(dst, pool_bytes=1 << 20, deadline=5.0)
    procs = start_samplers(
        q, trainer.control_address, eng, 1, 1, 1, common={"start_version": 5, "timeout": 4}
    )
    try:
        trainer.wait_for_samplers(1, timeout=30)
        rep = trainer.publish(3, U.full_weights(3))
        assert "refused" in rep.failed["0:0"] and "already has version 5" in rep.failed["0:0"]
        assert collect(q, 1)[(0, 0)] is None  # never offered version 3: still serving 5
    finally:
        join_all(procs)
        trainer.close()


def test_control_channel_drops_messages_with_a_wrong_secret():
    from tpusync.rl.control import ControlClient

    trainer = TrainerSync(
        0, 1, tp_layouts(1, {}), secret=U.SECRET, block_bytes=BB, pool_bytes=1 << 20
    )
    try:
        bad = ControlClient(b"x" * 32, trainer.control_address)
        with pytest.raises(TimeoutError):
            bad.request({"op": "next", "replica": 0, "rank": 0, "have": 0, "addr": {}}, 0.5)
        assert trainer.samplers == []
        good = ControlClient(U.SECRET, trainer.control_address)
        assert good.request({"op": "get", "version": 1}, 5.0) == {"op": "none"}
        bad.close()
        good.close()
    finally:
        trainer.close()


def test_a_control_server_made_where_a_closed_one_was_gets_its_own_wake_endpoint():
    """zmq unbinds a closed socket's inproc endpoint later, in its reaper thread: a server whose
    wake endpoint was named after id(self) collided now and then with a closed one freed at the
    same address ("Address already in use", seen in CI). Names are never reused now."""
    import gc

    from tpusync.rl.control import ControlServer

    seen: dict[int, str] = {}
    reused = 0
    for _ in range(50):
        server = ControlServer(U.SECRET, lambda msg, answer: {"op": "ok"})
        if id(server) in seen:
            reused += 1
            assert server._wake_addr != seen[id(server)]
        seen[id(server)] = server._wake_addr
        server.close()
        del server
        gc.collect()
    assert reused  # CPython gave a closed server's address to a new one: the check ran


def test_a_sampler_pulls_in_plan_order_at_most_window_buckets_per_source():
    """HOP LAG CONTRACT: pulls from one source share its link, so each lands only when all of
    them do; one at a time from a parent lets a chain forward each bucket as soon as it can,
    while the trainer ranks of another layout (several sources) are still pulled at once."""
    from tpusync.rl.sampler import _may_pull

    assert _may_pull("parent", [], 1)
    assert not _may_pull("parent", ["parent"], 1)
    assert _may_pull("parent", ["parent"], 2) and not _may_pull("parent", ["parent"] * 2, 2)
    assert _may_pull("rank 1", ["rank 0"], 1)
    assert not _may_pull("rank 0", ["rank 0", "rank 1"], 1)


def test_pack_streams_tile_every_transfer_inside_blocks():
    src = tp_layouts(2, {})
    dst = tp_layouts(4, {"embed": 1, "layers.1.w": 1})
    metas = tuple(TensorMeta(n, "float32", src[n]) for n in U.SHAPES)
    plans = pack_streams(Manifest(1, metas), dst, 8192, 2)
    from tpusync.rl.plan import ReshardPlan

    for (s, r), plan in plans.items():
        want = {
            (n, t.box)
            for n in U.SHAPES
            for t in ReshardPlan.build(src[n], dst[n]).transfers
            if t.src_rank == s and t.dst_rank == r
        }
        covered: dict = {}
        for i, block in enumerate(plan.blocks):
            end = 0
            for slot, p in enumerate(block):
                assert p.block == i and p.slot == slot and p.offset % 64 == 0
                assert p.offset >= end
                end = p.offset + p.nbytes
                assert p.transfer.contains(p.box) and p.nbytes == p.box.size * 4
                covered.setdefault((p.name, p.transfer), []).append(p.box)
            assert end <= 8192 - 16
        assert set(covered) == want
        for (_n, tbox), boxes in covered.items():
            assert sum(b.size for b in boxes) == tbox.size
            assert all(a.intersect(b) is None for a in boxes for b in boxes if a is not b)


def test_trainer_refuses_a_bad_configuration():
    with pytest.raises(ValueError, match="rank 2 outside world 2"):
        TrainerSync(2, 2, {}, secret=U.SECRET)
    with pytest.raises(ValueError, match="control address"):
        TrainerSync(1, 2, {}, secret=U.SECRET)
    with pytest.raises(ValueError, match="local ranks"):
        TrainerSync(0, 4, {}, secret=U.SECRET, local_ranks=[1, 2])  # rank 0 not among them
    with pytest.raises(ValueError, match="local ranks"):
        TrainerSync(2, 4, {}, secret=U.SECRET, local_ranks=[2, 4])  # 4 outside the world
    with pytest.raises(ValueError, match="does not fit"):  # no wait for the deadline to say so
        TrainerSync(0, 1, {}, secret=U.SECRET, block_bytes=BB, bucket_blocks=8, pool_bytes=4 * BB)


def test_multicontroller_jax_2x2_mesh_to_tp4_torch_samplers():
    """Two JAX processes (jax.distributed, 2 CPU devices each) hold a pytree sharded over a 2 x 2
    mesh; each sends only its own devices' shards; four torch sampler ranks (a 1 x 4 split on
    dim 1, a different layout) end with exactly their shards, for two versions."""
    pytest.importorskip("jax")
    q = U.ctx().Queue()
    dst = tp_layouts(4, {n: 1 for n, shape in U.SHAPES.items() if len(shape) == 2})
    eng = {U.engine_name(n): lay for n, lay in dst.items()}
    versions = [(1, 61), (2, 62)]
    procs = start_jax_trainers(q, dst, versions, updates=2)
    try:
        for v, seed in versions:
            got = collect(q, 4, timeout=120)
            full = U.full_weights(seed)
            for (_replica, rank), info in got.items():
                assert info["ok"] and info["version"] == v, info
                assert info["digest"] == U.expected_digest(full, eng, rank, torch.float32), rank
            pubs = published_by_each_process(q, v)
            held = {p[1]: p[3] for p in pubs}
            assert sorted(held[0] + held[1]) == [0, 1, 2, 3]  # each process: its two devices
            sent = {p[1]: p[2]["bytes"] for p in pubs}
            assert all(p[2]["failed"] == {} for p in pubs)
            src = pubs[0][4]
            assert src["embed"].shards != dst["embed"].shards  # a real reshard (2 x 2 -> 1 x 4)
            metas = tuple(TensorMeta(n, "float32", src[n]) for n in U.SHAPES)
            plans = pack_streams(Manifest(v, metas), dst, BB, 2)
            for proc, ranks in held.items():
                # Exactly the streams whose source is one of this process's devices, once.
                mine = sum(len(pl.blocks) for (s, _r), pl in plans.items() if s in ranks)
                assert sent[proc] == mine * BB > 0, (proc, ranks)
            for (_replica, rank), info in got.items():  # each sampler got only its own shard
                assert info["bytes"] == sum(
                    eng[U.engine_name(n)].box_of(rank).size * 4 for n in full
                )
    finally:
        join_all(procs, timeout=60)


# ------------------------------------------------------- delta updates from a multi-rank trainer


def own_bytes(eng, rank, names, rows=None):
    """Bytes of sampler ``rank``'s shards of trainer tensors ``names`` (fp32); a tensor in
    ``rows`` only in those row runs (a per-chunk delta)."""
    total = 0
    for n in names:
        box = eng[U.engine_name(n)].box_of(rank)
        runs = (rows or {}).get(n)
        if runs is None:
            total += box.size * 4
            continue
        for r0, r1 in runs:
            part = box.intersect(Box((r0, *box.lo[1:]), (r1, *box.hi[1:])))
            total += 0 if part is None else part.size * 4
    return total


def bump_rows(src, bumps, before=()):
    """The rows a per-chunk delta sends for the ``bumps`` not in ``before`` (CHUNK DELTA
    CONTRACT with BB-byte chunks of fp32 rows): the chunk of each bumped row, clipped to the
    rows of the trainer shard holding the element."""
    out: dict = {}
    for name, index, _ in [b for b in bumps if b not in before]:
        shape = U.SHAPES[name]
        per = max(1, BB // (math.prod(shape[1:]) * 4))
        c = index[0] // per
        at = Box(tuple(index), tuple(i + 1 for i in index))
        box = next(b for _, b in src[name].shards if b.contains(at))
        out.setdefault(name, set()).add((max(c * per, box.lo[0]), min((c + 1) * per, box.hi[0])))
    return {n: tuple(sorted(r)) for n, r in out.items()}


def tp2_delta_group(q, dst, versions, rank1_deadline=30.0, src_dims=None, **rank0_kw):
    """Trainer rank 0 here and rank 1 in its own process (TP=2 on dim 0, or ``src_dims``), two
    fp32 sampler ranks; rank 1 publishes ``versions`` ((v, seed, {"delta", "bumps"}) each) once
    it joined."""
    src = tp_layouts(2, src_dims or {})
    rank0_kw.setdefault("deadline", 30.0)
    trainer, eng = rank0(dst, 2, bucket_blocks=2, pool_bytes=2 << 20, **rank0_kw)
    return (
        src,
        trainer,
        eng,
        trainer_rank1(
            q,
            dst_layouts=dst,
            src_layouts=src,
            control=trainer.control_address,
            block_bytes=BB,
            pool_bytes=2 << 20,
            deadline=rank1_deadline,
            versions=versions,
        ),
    )


def start_rank1(trainer, rank1):
    """Start trainer rank 1 once the samplers are up and wait until it joined (it waits only its
    deadline for rank 0, and a loaded host spawns processes slowly)."""
    rank1.start()
    end = time.monotonic() + 60
    while len(trainer._trainers) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    assert len(trainer._trainers) == 2


def rank0_shards(src, full):
    return {n: (U.shard(t, src[n].box_of(0)).clone(), src[n]) for n, t in full.items()}


# Rank 1 of the TP=2 trainer holds rows 96..191 of layers.0.w and 128..255 of embed.
ONLY_RANK1 = [("layers.0.w", (150, 3), 1.0)]
ONLY_RANK0 = [("embed", (5, 7), -2.0)]


def test_tp2_trainer_delta_sends_the_union_of_the_ranks_changed_sets():
    """AGREEMENT CONTRACT with per-chunk deltas (CHUNK DELTA CONTRACT): embed is split by columns
    on both sides (trainer rank r -> sampler rank r), layers.0.w by rows. Version 2 changes one
    element in rank 1's rows of layers.0.w: only that chunk's rows (128..191) go out, from rank 1.
    Version 3 changes one element of embed in rank 0's columns: the union is embed rows 0..101,
    and rank 1 sends its columns of them too although its shard did not change (sampler 1 gets
    them only from rank 1). Version 4 changes nothing (an empty delta). The samplers end bit-equal
    to a full update of each version and received exactly the agreed rows."""
    q = U.ctx().Queue()
    dst = tp_layouts(2, {"embed": 1})
    seed = 71
    bump0 = [("embed", (5, 7), -2.0)]  # column 7: trainer rank 0's half of embed
    steps = [  # version, rank 0's bumps = rank 1's bumps, tensors expected in the delta
        (1, [], sorted(U.SHAPES)),  # no published base yet: full
        (2, ONLY_RANK1, ["layers.0.w"]),
        (3, ONLY_RANK1 + bump0, ["embed"]),
        (4, ONLY_RANK1 + bump0, []),
    ]
    versions = [(v, seed, {"delta": True, "bumps": bumps}) for v, bumps, _ in steps]
    src, trainer, eng, rank1 = tp2_delta_group(q, dst, versions, src_dims={"embed": 1})
    procs = start_samplers(q, trainer.control_address, eng, 1, 2, 4, common={"dtype": "float32"})
    try:
        trainer.wait_for_samplers(2, timeout=30)
        start_rank1(trainer, rank1)
        sent, before = {}, []
        for v, bumps, names in steps:
            full = U.full_weights(seed, bumps)
            rows = {} if v == 1 else bump_rows(src, bumps, before)
            before = bumps
            rep = trainer.publish(v, rank0_shards(src, full), delta=True)
            assert rep.ok, rep.failed
            sent[v] = rep.bytes_sent
            got = collect(q, 2)
            for (_replica, rank), info in got.items():
                assert info["ok"] and info["serving"] == v, (v, info)
                want = U.expected_digest(full, eng, rank, torch.float32)
                assert info["digest"] == want, (v, rank)
                assert info["bytes"] == own_bytes(eng, rank, names, rows), (v, rank, names)
            pub = get(q, "published")
            assert pub[1] == v and pub[2]["failed"] == {}, pub
            if v == 3:  # rank 1's embed shard did not change, yet it sent its columns (union)
                assert got[(0, 1)]["bytes"] == 102 * 80 * 4, got
                assert pub[2]["bytes"] > 0, pub
        # Rank 0 (this process) sent nothing of version 2: the changed rows are rank 1's.
        assert rows == {} and sent[2] == sent[4] == 0 and 0 < sent[3] < sent[1], sent
        assert bump_rows(src, ONLY_RANK1) == {"layers.0.w": ((128, 192),)}
    finally:
        join_all(procs + ([rank1] if rank1.pid is not None else []))
        trainer.close()


@pytest.mark.parametrize("trainer_processes", [1, 2])
def test_sampler_that_joins_late_gets_a_full_update_instead_of_a_delta_it_cannot_apply(
    trainer_processes,
):
    """LAGGING SAMPLERS: a sampler replica that joins after version 1 holds no base for a delta
    on version 1, so rank 0 turns version 2 (one element changed, delta=True) into a full update
    and every sampler commits it, the late ones included; version 3 is a delta again (every
    sampler now holds version 2). With one trainer process and with two (AGREEMENT CONTRACT)."""
    q = U.ctx().Queue()
    dst = tp_layouts(2, {"embed": 1})
    seed = 73
    steps = [(1, []), (2, ONLY_RANK1), (3, ONLY_RANK1 + ONLY_RANK0)]
    if trainer_processes == 2:
        versions = [(v, seed, {"delta": True, "bumps": b}) for v, b in steps]
        src, trainer, eng, rank1 = tp2_delta_group(q, dst, versions)
        mine = functools.partial(rank0_shards, src)
    else:
        (trainer, eng), rank1 = rank0(dst, deadline=30.0), None
        mine = dict  # one process holds every tensor whole
    procs = start_samplers(q, trainer.control_address, eng, 1, 2, 3, common={"dtype": "float32"})
    try:
        trainer.wait_for_samplers(2, timeout=30)
        if rank1 is not None:
            start_rank1(trainer, rank1)
        assert trainer.publish(1, mine(U.full_weights(seed)), delta=True).ok
        assert all(i["ok"] for i in collect(q, 2).values())
        late = {"dtype": "float32", "replica": 1}
        procs += start_samplers(q, trainer.control_address, eng, 1, 2, 2, common=late)
        trainer.wait_for_samplers(4, timeout=30)
        for v, bumps in steps[1:]:
            full = U.full_weights(seed, bumps)
            rep = trainer.publish(v, mine(full), delta=True)
            assert rep.ok and len(rep.committed) == 4, rep
            names = sorted(U.SHAPES) if v == 2 else ["embed"]  # full, then a delta again
            rows = {} if v == 2 else bump_rows(tp_layouts(2, {}), bumps, ONLY_RANK1)
            for (_replica, rank), info in collect(q, 4).items():
                assert info["ok"] and info["serving"] == v, (v, info)
                assert info["digest"] == U.expected_digest(full, eng, rank, torch.float32)
                assert info["bytes"] == own_bytes(eng, rank, names, rows), (v, rank, info)
    finally:
        join_all(procs + ([rank1] if rank1 is not None and rank1.pid is not None else []))
        trainer.close()


def test_chunk_delta_from_one_trainer_to_shadow_and_inplace_samplers_is_bit_equal(capsys):
    """CHUNK DELTA CONTRACT, one trainer process -> TP=2 samplers (embed resharded by columns):
    a shadow replica pulling over TCP and an in-place replica (engine paused) reading the
    trainer's shared segment on the same host. Version 2 changes one element of layers.1.w (row 200) and one of embed (row 250):
    only the 64 KiB chunks holding them go out (rows 170..254 and 204..255), every sampler ends
    bit-equal to the trainer's tensors (full-tensor digests) and the trainer puts fewer blocks
    on the wire than a per-tensor delta of the same two tensors would."""
    q = U.ctx().Queue()
    dst = tp_layouts(2, {"embed": 1})
    trainer, eng = rank0(dst, fanout=2, bucket_blocks=2, deadline=30.0, same_host=True)
    inplace = {"mode": "inplace", "paused": True, "dtype": "float32", "same_host": True}
    per = {(1, 0): inplace, (1, 1): inplace}
    procs = start_samplers(
        q, trainer.control_address, eng, 2, 2, 3, per=per, common={"dtype": "float32"}
    )
    seed = 75
    bumps = [("layers.1.w", (200, 1), 0.5), ("embed", (250, 3), 1.0)]
    try:
        trainer.wait_for_samplers(4, timeout=30)
        assert trainer.publish(1, U.full_weights(seed), delta=True).ok
        collect(q, 4)
        full = U.full_weights(seed, bumps)
        rep = trainer.publish(2, full, delta=True)
        assert rep.ok and len(rep.committed) == 4, rep
        rows = bump_rows(tp_layouts(1, {}), bumps)
        assert rows == {"layers.1.w": ((170, 255),), "embed": ((204, 256),)}
        for (replica, rank), info in collect(q, 4).items():
            assert info["ok"] and info["serving"] == 2, info
            assert info["path"] == ("shared-segment" if replica else "tcp"), info
            assert info["digest"] == U.expected_digest(full, eng, rank, torch.float32), rank
            assert info["bytes"] == own_bytes(eng, rank, rows, rows), (rank, info)
        # A per-tensor delta of the same two tensors: its blocks, once per replica.
        layout = tp_layouts(1, {})
        whole = Manifest(
            2, tuple(TensorMeta(n, "float32", layout[n]) for n in sorted(rows)), base_version=1
        )
        plans = pack_streams(whole, dst, BB, 2)
        per_tensor = 2 * sum(len(p.blocks) for p in plans.values()) * BB
        assert 0 < rep.bytes_sent < per_tensor, (rep.bytes_sent, per_tensor)
        with capsys.disabled():
            print(
                f"\nchunk delta: {rep.bytes_sent} bytes on the wire, per-tensor delta "
                f"{per_tensor} ({rep.bytes_sent / per_tensor:.2f}x)"
            )
        # Nothing changed: an empty delta (no bytes), still committed everywhere.
        rep3 = trainer.publish(3, full, delta=True)
        assert rep3.ok and rep3.bytes_sent == 0, rep3
        assert all(i["ok"] and i["serving"] == 3 for i in collect(q, 4).values())
    finally:
        join_all(procs)
        trainer.close()


def test_a_tensor_stepped_during_publish_is_resent_by_the_next_delta(monkeypatch):
    """SNAPSHOT RULE (chunks.py): the optimizer steps layers.1.w while version 1 is on the wire,
    after the send read it (the fault is injected right after the trainer's send). The sampler
    commits the old value; version 2, a delta of the same (stepped) tensors, must bring it to
    the trainer's bytes. With the base digested after the send, version 2 was an empty delta and
    the sampler kept the old row for good."""
    q = U.ctx().Queue()
    dst = tp_layouts(1, {})
    trainer, eng = rank0(dst, bucket_blocks=2, deadline=30.0)
    procs = start_samplers(q, trainer.control_address, eng, 1, 1, 2, common={"dtype": "float32"})
    full = U.full_weights(77)
    send = TrainerSync._send

    def send_then_step(self, *a, **kw):
        out = send(self, *a, **kw)
        if self._pub.base_version is None:  # version 1 only
            full["layers.1.w"][200, 1] += 0.5
        return out

    monkeypatch.setattr(TrainerSync, "_send", send_then_step)
    try:
        trainer.wait_for_samplers(1, timeout=30)
        assert trainer.publish(1, full, delta=True).ok
        (info,) = collect(q, 1).values()
        assert info["ok"] and info["digest"] != U.expected_digest(full, eng, 0, torch.float32)
        rep = trainer.publish(2, full, delta=True)
        assert rep.ok and rep.bytes_sent > 0, rep
        (info,) = collect(q, 1).values()
        assert info["ok"] and info["serving"] == 2, info
        assert info["digest"] == U.expected_digest(full, eng, 0, torch.float32)
    finally:
        join_all(procs)
        trainer.close()


def test_failed_version_forces_the_next_one_full_on_every_trainer_rank():
    """Sampler rank 1 pulls all of delta version 2, then rejects it: trainer rank 1 saw every
    acknowledgement (no failure of its own), only rank 0 knows. Version 3 (a one-element change)
    still goes out full from BOTH ranks and the lagging sampler catches up bit-equal; version 4
    is a delta again."""
    q = U.ctx().Queue()
    dst = tp_layouts(2, {"embed": 1})
    seed = 72
    bumps3 = ONLY_RANK1 + [("layers.1.w", (200, 1), 0.5)]
    bumps4 = bumps3 + ONLY_RANK0
    steps = [
        (1, [], sorted(U.SHAPES)),
        (2, ONLY_RANK1, ["layers.0.w"]),
        (3, bumps3, sorted(U.SHAPES)),  # forced full
        (4, bumps4, ["embed"]),
    ]
    versions = [(v, seed, {"delta": True, "bumps": b}) for v, b, _ in steps]
    src, trainer, eng, rank1 = tp2_delta_group(q, dst, versions)
    per = {(0, 1): {"reject_at_version": 2}}
    procs = start_samplers(
        q, trainer.control_address, eng, 1, 2, 4, per=per, common={"dtype": "float32"}
    )
    try:
        trainer.wait_for_samplers(2, timeout=30)
        start_rank1(trainer, rank1)
        before: list = []
        for v, bumps, names in steps:
            full_update = names == sorted(U.SHAPES)
            rows, before = ({} if full_update else bump_rows(src, bumps, before)), bumps
            # The sampler that failed version 2 is back in the group once it polled again.
            end = time.monotonic() + 30
            while len(trainer.samplers) < 2 and time.monotonic() < end:
                time.sleep(0.01)
            full = U.full_weights(seed, bumps)
            rep = trainer.publish(v, rank0_shards(src, full), delta=True)
            got = collect(q, 2)
            pub = get(q, "published")
            assert pub[1] == v and pub[2]["failed"] == {}, pub  # rank 1 saw no failure, ever
            if v == 2:
                assert list(rep.failed) == ["0:1"] and "on purpose" in rep.failed["0:1"], rep
                assert got[(0, 1)]["serving"] == 1 and not got[(0, 1)]["ok"]
                got = {(0, 0): got[(0, 0)]}
            else:
                assert rep.ok, rep.failed
            for (_replica, rank), info in got.items():
                assert info["ok"] and info["serving"] == v, (v, info)
                want = U.expected_digest(full, eng, rank, torch.float32)
                assert info["digest"] == want, (v, rank)
                assert info["bytes"] == own_bytes(eng, rank, names, rows), (v, rank, names)
    finally:
        join_all(procs + ([rank1] if rank1.pid is not None else []))
        trainer.close()


def test_trainer_rank_missing_from_the_delta_agreement_fails_the_version_in_time():
    """Rank 1 publishes version 2 without delta (it never reports a changed set): rank 0 gives
    up at its deadline naming rank 1, rank 1 is told at once (not at its own, longer deadline),
    and no sampler is offered version 2."""
    q = U.ctx().Queue()
    dst = tp_layouts(2, {"embed": 1})
    versions = [(1, 73, {"delta": True}), (2, 74, {"delta": False})]
    src, trainer, eng, rank1 = tp2_delta_group(q, dst, versions, rank1_deadline=60.0)
    procs = start_samplers(
        q,
        trainer.control_address,
        eng,
        1,
        2,
        2,
        common={"dtype": "float32", "timeouts": [60, 8]},  # 8 s: past rank 0's 4 s
    )
    try:
        trainer.wait_for_samplers(2, timeout=30)
        start_rank1(trainer, rank1)
        assert trainer.publish(1, rank0_shards(src, U.full_weights(73)), delta=True).ok
        assert all(i["ok"] for i in collect(q, 2).values())
        assert get(q, "published")[1] == 1
        trainer.deadline = 4.0
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"trainer ranks \[1\] did not report"):
            trainer.publish(2, rank0_shards(src, U.full_weights(74)), delta=True)
        assert time.monotonic() - t0 < 4.0 + 2.0
        err = get(q, "publish_error", timeout=30)
        assert err[1] == 2 and "gave up on version 2" in err[2], err
        assert all(info is None for info in collect(q, 2, timeout=30).values())
    finally:
        join_all(procs + ([rank1] if rank1.pid is not None else []))
        trainer.close()


def test_delta_agreement_decisions_for_stale_reset_and_racing_ranks():
    """Rank 0's side of the AGREEMENT CONTRACT against a scripted rank 1 (a control client; no
    sampler, so nothing moves): the announced manifest is the union against the shared base,
    and a full update whenever a rank's base differs (its state was reset or is stale) or it
    asks for one; reports of versions already decided are refused, a repeated one is not; a
    report naming an unknown tensor fails the version on both sides."""
    from tpusync.rl.control import ControlClient

    src = tp_layouts(2, {})
    trainer, _eng = rank0(tp_layouts(2, {}), 2, pool_bytes=1 << 20, deadline=5.0)
    fake = ControlClient(U.SECRET, trainer.control_address)
    try:
        fake.request({"op": "join", "kind": "trainer", "rank": 1, "addr": {}}, 5.0)
        full = U.full_weights(81)

        def step(version, base, changed=(), wants_full=False, bumps=()):
            report = {"op": "delta", "version": version, "rank": 1, "ranks": [1]}
            report |= {"changed": list(changed), "base": base, "full": wants_full}
            assert fake.request(report, 5.0) == {"op": "ok"}
            mine = rank0_shards(src, U.full_weights(81, bumps))
            assert trainer.publish(version, mine, delta=True).ok
            ann = fake.request({"op": "get", "version": version}, 5.0)
            m = Manifest.from_bytes(ann["manifest"])
            return m.base_version, sorted(t.name for t in m.tensors)

        every = sorted(full)
        assert step(1, None, every) == (None, every)  # nothing published yet: full
        assert step(2, 1, ["layers.1.w"]) == (1, ["layers.1.w"])  # rank 0 changed nothing
        assert step(3, 2, [], bumps=ONLY_RANK0) == (2, ["embed"])  # rank 1 changed nothing
        row10 = ONLY_RANK0 + [("layers.0.w", (10, 3), 1.0)]  # rank 0's rows of layers.0.w
        assert step(4, 3, ["layers.1.w"], bumps=row10) == (3, ["layers.0.w", "layers.1.w"])
        assert step(5, None, []) == (None, every)  # rank 1 was reset (no base): full
        assert step(6, 4, []) == (None, every)  # rank 1 is stale (missed version 5): full
        assert step(7, 6, [], wants_full=True) == (None, every)  # rank 1 saw a failure: full
        assert step(8, 7, []) == (7, [])  # nothing changed anywhere: an empty delta
        # Racing versions: a retry of a decided report is fine, a new one for it is refused.
        again = {"op": "delta", "version": 8, "rank": 1, "ranks": [1], "changed": [], "base": 7}
        assert fake.request(again, 5.0) == {"op": "ok"}
        with pytest.raises(RuntimeError, match="already decided version 8"):
            fake.request({**again, "rank": 3, "ranks": [3]}, 5.0)
        with pytest.raises(RuntimeError, match="already decided version 7"):
            fake.request({**again, "version": 7, "rank": 3, "ranks": [3]}, 5.0)
        # A report naming a tensor rank 0 does not publish fails the version on both sides.
        bad = {**again, "version": 9, "changed": ["nope"], "base": 8}
        assert fake.request(bad, 5.0) == {"op": "ok"}
        with pytest.raises(ValueError, match=r"rank 0 does not publish: \['nope'\]"):
            trainer.publish(9, rank0_shards(src, full), delta=True)
        reply = fake.request({"op": "get", "version": 9}, 5.0)
        assert reply["op"] == "abort" and "nope" in reply["reason"], reply
        with pytest.raises(RuntimeError, match="gave up on version 9"):
            fake.request({**bad, "rank": 3, "ranks": [3]}, 5.0)
    finally:
        fake.close()
        trainer.close()


def test_multicontroller_jax_delta_sees_a_change_on_any_local_device():
    """Two JAX processes, 2 x 2 mesh: version 2 changes one element held by device 3 only (the
    second local device of process 1; its first device's shards are unchanged), version 3 one
    element of device 0. Each delta carries just that leaf from both processes (AGREEMENT
    CONTRACT over every local shard), and the four torch samplers end bit-equal."""
    pytest.importorskip("jax")
    q = U.ctx().Queue()
    dst = tp_layouts(4, {n: 1 for n, shape in U.SHAPES.items() if len(shape) == 2})
    eng = {U.engine_name(n): lay for n, lay in dst.items()}
    dev3 = [("layers.0.w", (150, 200), 1.0)]  # mesh (x=1, y=1): rows 96.., columns 128..
    dev0 = dev3 + [("embed", (3, 4), -1.0)]  # mesh (0, 0)
    steps = [(1, [], sorted(U.SHAPES)), (2, dev3, ["layers.0.w"]), (3, dev0, ["embed"])]
    versions = [(v, 63, {"delta": True, "bumps": b}) for v, b, _ in steps]
    procs = start_jax_trainers(q, dst, versions, updates=3)
    try:
        before: list = []
        for v, bumps, names in steps:
            # The 2 x 2 mesh splits the rows of every 2-D leaf in halves, as TP=2 on dim 0.
            rows, before = ({} if v == 1 else bump_rows(tp_layouts(2, {}), bumps, before)), bumps
            got = collect(q, 4, timeout=120)
            full = U.full_weights(63, bumps)
            for (_replica, rank), info in got.items():
                assert info["ok"] and info["version"] == v, info
                assert info["digest"] == U.expected_digest(full, eng, rank, torch.float32), rank
                assert info["bytes"] == own_bytes(eng, rank, names, rows), (v, rank, names)
            pubs = published_by_each_process(q, v)
            assert all(p[2]["failed"] == {} for p in pubs), pubs
    finally:
        join_all(procs, timeout=60)


# ------------------------------------------------------------------ shared-segment path (same host)


def test_same_host_samplers_read_the_trainer_segment_next_to_a_tcp_sampler():
    """Replicas 0 and 1 (TP=2 each, same host) stage straight out of the trainer's /dev/shm pool
    (SHARED-SEGMENT CONTRACT), replica 2 pulls over TCP; the trainer's pool holds 4 blocks, far
    less than a version, so every block is reused only after both readers released it."""
    q = U.ctx().Queue()
    dst = tp_layouts(2, {"layers.1.w": 1})
    trainer, eng = rank0(dst, bucket_blocks=1, pool_bytes=4 * BB, same_host=True, deadline=30.0)
    local = {"same_host": True}
    per = {(r, k): local for r in (0, 1) for k in (0, 1)}
    procs = start_samplers(q, trainer.control_address, eng, 3, 2, 2, per=per)
    try:
        trainer.wait_for_samplers(6, timeout=30)
        for v, seed in ((1, 61), (2, 62)):
            full = U.full_weights(seed)
            rep = trainer.publish(v, full)
            assert rep.ok, rep.failed
            assert len(rep.committed) == 6
            got = collect(q, 6)
            for (replica, rank), info in got.items():
                assert info["ok"] and info["serving"] == v, (replica, rank, info)
                assert info["digest"] == U.expected_digest(full, eng, rank, torch.bfloat16)
                want = "shared-segment" if replica < 2 else "tcp"
                assert info["path"] == want and info["forwarded"] == 0, (replica, rank, info)
            assert trainer._ep.pool.num_free == trainer._ep.pool.num_blocks  # all released
    finally:
        join_all(procs)
        trainer.close()


def test_damaged_block_on_the_shared_segment_rejects_update_others_commit():
    q = U.ctx().Queue()
    dst = tp_layouts(2, {})
    trainer, eng = rank0(
        dst, cls=U.TamperingTrainer, pool_bytes=2 << 20, same_host=True, deadline=15.0
    )
    procs = start_samplers(q, trainer.control_address, eng, 1, 2, 2, common={"same_host": True})
    try:
        trainer.wait_for_samplers(2, timeout=30)
        full1 = U.full_weights(71)
        assert trainer.publish(1, full1).ok
        collect(q, 2)
        rep = trainer.publish(2, U.full_weights(72))
        assert rep.committed == ["0:0"]
        assert "failed its checksum on the shared segment" in rep.failed["0:1"]
        assert "embed" in rep.failed["0:1"]
        assert rep.seconds < 10.0  # the reader's failure report released its buckets
        got = collect(q, 2)
        assert got[(0, 0)]["ok"] and got[(0, 0)]["path"] == "shared-segment"
        bad = got[(0, 1)]
        assert not bad["ok"] and bad["serving"] == 1
        assert bad["digest"] == U.expected_digest(full1, eng, 1, torch.bfloat16)
        assert trainer._ep.pool.num_free == trainer._ep.pool.num_blocks
    finally:
        join_all(procs)
        trainer.close()


class BlockTamperingTrainer(TrainerSync):
    """Flips one byte of stream (0 -> rank 1) of version 2 after the block's checksum was taken:
    byte 0 of block 0 (``where="piece"``), or the last byte before the trailer of the first block
    whose pieces end before it (``where="padding"``: a byte no piece covers)."""

    where = "piece"

    def _fill(self, block, plan, index, version, *a):
        checksum = super()._fill(block, plan, index, version, *a)
        if version == 2 and plan.dst == 1:
            arr = self._ep.pool.view(block)
            if self.where == "piece" and index == 0:
                arr[0] ^= 0xFF
            padded = next(
                i
                for i, blk in enumerate(plan.blocks)
                if blk[-1].offset + blk[-1].nbytes < BB - TRAILER
            )
            if self.where == "padding" and index == padded:
                arr[BB - TRAILER - 1] ^= 0xFF
        return checksum


def _shared_fp32_group(trainer_cls, mode: str, where: str = "piece"):
    """A same-host TP=2 fp32 sampler group reading ``trainer_cls``'s segment; versions 1 (seed
    91) and 2 (seed 92, damaged for rank 1 by a tampering trainer). Returns both versions'
    reports and the samplers' update infos."""
    q = U.ctx().Queue()
    dst = tp_layouts(2, {"layers.1.w": 1})
    trainer, eng = rank0(
        dst, cls=trainer_cls, bucket_blocks=2, pool_bytes=2 << 20, same_host=True, deadline=15.0
    )
    trainer.where = where
    common = {"same_host": True, "dtype": "float32", "mode": mode, "paused": mode == "inplace"}
    procs = start_samplers(q, trainer.control_address, eng, 1, 2, 2, common=common)
    try:
        trainer.wait_for_samplers(2, timeout=30)
        full1, full2 = U.full_weights(91), U.full_weights(92)
        rep1 = trainer.publish(1, full1)
        got1 = collect(q, 2)
        rep2 = trainer.publish(2, full2)
        got2 = collect(q, 2)
        assert trainer._ep.pool.num_free == trainer._ep.pool.num_blocks
        return eng, (full1, full2), (rep1, rep2), (got1, got2)
    finally:
        join_all(procs)
        trainer.close()


@pytest.mark.parametrize("where", ["piece", "padding"])
def test_fused_shadow_staging_rejects_a_damaged_shared_block_before_commit(where):
    """Shadow mode stages each shared block in one pass (staging copy + streaming hash of the
    whole block, FUSED STAGING in sampler.py): a byte flipped on the trainer's segment after the
    checksum was taken, in a piece or in padding no piece covers, still rejects the update before
    commit, and the sampler keeps serving exactly the previous version."""
    eng, (full1, full2), (rep1, rep2), (got1, got2) = _shared_fp32_group(
        BlockTamperingTrainer, "shadow", where
    )
    assert rep1.ok, rep1.failed
    for rank in (0, 1):
        info = got1[(0, rank)]
        assert info["ok"] and info["path"] == "shared-segment"
        assert info["digest"] == U.expected_digest(full1, eng, rank, torch.float32)
        assert info["fused"] > 0, "fp32 -> fp32 shadow staging must take the fused path"
    assert rep2.committed == ["0:0"]
    assert "failed its checksum on the shared segment" in rep2.failed["0:1"]
    assert got2[(0, 0)]["ok"]
    assert got2[(0, 0)]["digest"] == U.expected_digest(full2, eng, 0, torch.float32)
    bad = got2[(0, 1)]
    assert not bad["ok"] and bad["serving"] == 1
    assert bad["digest"] == U.expected_digest(full1, eng, 1, torch.float32)


def test_inplace_shared_reader_never_writes_an_unverified_block():
    """In-place mode writes the live weights, so each shared block is verified before any of its
    bytes is written (HASH-AHEAD, not the fused pass): the damaged first block of rank 1's
    stream is refused before rank 1 wrote a byte of version 2, so its weights still equal
    version 1 exactly (dirty, but nothing of the damaged block or after it landed)."""
    eng, (full1, full2), (rep1, rep2), (got1, got2) = _shared_fp32_group(
        BlockTamperingTrainer, "inplace"
    )
    assert rep1.ok, rep1.failed
    for rank in (0, 1):
        info = got1[(0, rank)]
        assert info["ok"] and info["path"] == "shared-segment" and info["fused"] == 0
        assert info["digest"] == U.expected_digest(full1, eng, rank, torch.float32)
    assert rep2.committed == ["0:0"]
    assert got2[(0, 0)]["digest"] == U.expected_digest(full2, eng, 0, torch.float32)
    bad = got2[(0, 1)]
    assert not bad["ok"] and "failed its checksum on the shared segment" in bad["reason"]
    assert bad["digest"] == U.expected_digest(full1, eng, 1, torch.float32)


def test_fused_fill_checksum_is_the_whole_block_hash_for_plain_and_strided_pieces():
    """BLOCK CHECKSUM CONTRACT with the fused fill: whether a piece is copied and hashed in one
    pass (contiguous source) or gathered by torch then hashed (a strided resharded box), the
    returned checksum is checksum64 of the whole block, padding and trailer included."""
    from tpusync.core import checksum64
    from tpusync.rl.layout import ShardLayout as SL

    shapes = {"a": (96, 80), "b": (33, 70), "c": ()}
    src = {n: SL.replicated(s, [0]) for n, s in shapes.items()}
    trainer = TrainerSync(0, 1, {}, secret=U.SECRET, block_bytes=BB, pool_bytes=8 * BB)
    try:
        g = torch.Generator().manual_seed(3)
        local = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        local["a"] = local["a"].t().contiguous().t()  # a non-contiguous (strided) source
        boxes = {n: lay.box_of(0) for n, lay in src.items()}
        metas = tuple(TensorMeta(n, "float32", src[n]) for n in shapes)
        for dst in (
            {n: SL.replicated(s, [0]) for n, s in shapes.items()},
            {n: SL.split(s, 1, 2) if s else SL.replicated(s, [0, 1]) for n, s in shapes.items()},
        ):
            plans = pack_streams(Manifest(5, metas), dst, BB, 2)
            for plan in plans.values():
                for index in range(len(plan.blocks)):
                    (block,) = trainer._ep.pool.alloc(1)
                    try:
                        trainer._ep.pool.view(block)[:] = 0xA5  # stale bytes in the padding
                        got = trainer._fill(block, plan, index, 5, local, boxes)
                        arr = trainer._ep.pool.view(block)
                        assert got == checksum64(arr), (plan.dst, index)
                        for p in plan.blocks[index]:
                            want = local[p.name][boxes[p.name].local_slices(p.box)]
                            piece = arr[p.offset : p.offset + p.nbytes].view("float32")
                            assert torch.equal(
                                torch.from_numpy(piece.copy()).view(p.box.shape), want
                            )
                    finally:
                        trainer._ep.pool.free([block])
    finally:
        trainer.close()


def test_shared_reader_dying_mid_update_is_reported_and_others_commit(caplog):
    """Replica 1 dies after staging its first block of version 2 out of the trainer's segment:
    the trainer sees its process exit (EXIT WATCH CONTRACT), frees what it held at once instead
    of at the 60 s deadline, names it, and replica 0 commits."""
    q = U.ctx().Queue()
    dst = tp_layouts(1, {})
    trainer, eng = rank0(dst, bucket_blocks=1, pool_bytes=2 << 20, same_host=True, deadline=60.0)
    procs = start_samplers(
        q,
        trainer.control_address,
        eng,
        2,
        1,
        3,
        common={"same_host": True},
        per={(1, 0): {"same_host": True, "die_at_version": 2}},
    )
    try:
        trainer.wait_for_samplers(2, timeout=30)
        assert trainer.publish(1, U.full_weights(81)).ok
        collect(q, 2)
        with caplog.at_level(logging.ERROR, logger="tpusync.rl"):
            rep = trainer.publish(2, U.full_weights(82))
        assert rep.committed == ["0:0"] and list(rep.failed) == ["1:0"]
        assert "exited during the update" in rep.failed["1:0"], rep.failed
        assert rep.seconds < 30.0, f"waited {rep.seconds:.1f} s for a dead reader"
        assert "sampler 1:0 failed version 2" in caplog.text
        assert get(q, "update")[3]["ok"]
        assert trainer._ep.pool.num_free == trainer._ep.pool.num_blocks
        rep3 = trainer.publish(3, U.full_weights(83))
        assert rep3.ok and rep3.committed == ["0:0"]
    finally:
        join_all(procs)
        trainer.close()


def test_shared_bucket_hold_check_and_idempotent_release():
    """HOLD CHECK: a release the trainer can no longer honour (it dropped the bucket at the
    deadline) is reported as lost, so the reader rejects the update; a retried release (its
    first request's reply was lost) is not; a bucket is freed only by its last reader."""
    dst = tp_layouts(1, {})
    trainer = TrainerSync(
        0, 1, dst, secret=U.SECRET, block_bytes=BB, pool_bytes=8 * BB, same_host=True
    )
    pool = trainer._ep.pool
    try:
        shares = trainer._shares  # SHARED-SEGMENT CONTRACT state (tpusync.rl.sharing)
        with trainer._lock:
            shares.sharing = 7
        ids = pool.alloc(2)
        shares.offer((7, 0, 0, 0), ids, [1, 2], ["0:0", "1:0"])
        pool.free(ids)  # the publishing reference; the sharing one keeps the blocks
        assert pool.num_free == pool.num_blocks - 2
        req = {"version": 7, "key": "0:0", "src": 0, "dst": 0, "bucket": 0}
        got = shares.request("bucket", req, None)
        assert got["op"] == "bucket" and got["sums"] == [1, 2] and len(got["offsets"]) == 2
        rel = {"version": 7, "key": "0:0", "release": [[0, 0, 0]]}
        assert shares.request("release", rel, None) == {"op": "ok", "lost": []}
        assert shares.request("release", rel, None) == {"op": "ok", "lost": []}
        assert pool.num_free == pool.num_blocks - 2  # reader 1:0 still holds them
        assert shares.end(7) == ["1:0"]
        assert pool.num_free == pool.num_blocks
        late = {"version": 7, "key": "1:0", "release": [[0, 0, 0]]}
        assert shares.request("release", late, None)["lost"] == [[0, 0, 0]]
        gone = shares.request("bucket", {**req, "bucket": 1}, None)
        assert gone["op"] == "gone"
    finally:
        trainer.close()


def test_a_killed_trainers_pool_is_reclaimed_by_the_next_same_host_endpoint():
    """A same-host trainer killed by SIGKILL leaves its pool in /dev/shm (nothing ran at exit);
    the next same-host trainer or sampler on the host removes it (OWNER LOCK CONTRACT,
    tpusync.core.reclaim_stale_segments) and keeps the pools of live processes."""
    import os
    import signal
    import subprocess
    import sys

    script = (
        "import os, signal\n"
        "from tpusync.rl import ShardLayout, TrainerSync\n"
        "t = TrainerSync(0, 1, {'w': ShardLayout.replicated((4, 4), [0])}, secret=b'x' * 32,\n"
        "                same_host=True, block_bytes=1 << 16, pool_bytes=1 << 20)\n"
        "print(t._ep.address['shm'], flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    killed = proc.stdout.strip()
    assert killed.startswith("tpusync-rl-") and os.path.exists(f"/dev/shm/{killed}")
    try:
        dst = {"w": ShardLayout.replicated((4, 4), [0])}
        first, _ = rank0(dst, same_host=True, pool_bytes=1 << 20)
        try:
            mine = first._ep.address["shm"]
            assert not os.path.exists(f"/dev/shm/{killed}")
            second, _ = rank0(dst, same_host=True, pool_bytes=1 << 20)
            try:  # a live process's pool survives the next endpoint's sweep
                assert os.path.exists(f"/dev/shm/{mine}")
            finally:
                second.close()
        finally:
            first.close()
    finally:
        if os.path.exists(f"/dev/shm/{killed}"):
            os.unlink(f"/dev/shm/{killed}")


def test_closed_trainer_and_sampler_refuse_use_and_free_their_pools_at_once():
    """publish() after close() reported success with no samplers left; update() after close()
    waited out its timeout; a closed TrainerSync kept its pool (and /dev/shm segment) until the
    next garbage collection (its control server held a bound method of it)."""
    import gc
    import weakref

    from tpusync.rl import SamplerSync, WeightSubscriber

    dst = tp_layouts(1, {n: 0 for n in U.SHAPES})
    trainer, eng = rank0(dst, same_host=True, pool_bytes=1 << 20)
    sub = WeightSubscriber(
        0, {n: torch.zeros(lay.shape) for n, lay in eng.items()}, eng, name_map=U.engine_name
    )
    sampler = SamplerSync(
        sub, replica=0, control=trainer.control_address, secret=U.SECRET, block_bytes=BB
    )
    sampler.close()
    sampler.close()  # idempotent
    with pytest.raises(StateError, match="SamplerSync 0:0 is closed"):
        sampler.update(0.1)
    shm = trainer._ep.address["shm"]
    pool = weakref.ref(trainer._ep.pool)
    gc.disable()  # what frees the pool must be close(), not a collection
    try:
        trainer.close()
        trainer.close()
        assert pool() is None
        assert not os.path.exists(f"/dev/shm/{shm}")
        with pytest.raises(
            StateError, match="TrainerSync rank 0 is closed: publish\\(1\\) refused"
        ):
            trainer.publish(1, U.full_weights(1))
    finally:
        gc.enable()


def test_bad_sizes_and_durations_are_refused_by_name_before_anything_starts():
    """block_bytes=0 divided by zero; a float bucket_blocks, block_bytes=100 or a negative pool
    failed only in publish, after the version was announced; silence=inf killed the sampler's
    heartbeat thread; deadline=0 was accepted."""
    dst = tp_layouts(1, {n: 0 for n in U.SHAPES})
    for kw, err, match in [
        ({"block_bytes": 0}, ValueError, "block_bytes must be at least 8192, got 0"),
        ({"block_bytes": 100}, ValueError, "block_bytes must be at least 8192"),
        ({"bucket_blocks": 2.5}, TypeError, "bucket_blocks must be an int, got float"),
        ({"fanout": 1.5}, TypeError, "fanout must be an int"),
        ({"pool_bytes": -1}, ValueError, "pool_bytes must be >= 0"),
        ({"deadline": 0}, ValueError, "deadline must be a finite number of seconds > 0"),
        ({"silence": math.inf}, ValueError, "silence must be a finite number"),
    ]:
        with pytest.raises(err, match=match):
            rank0(dst, **kw)
    trainer, eng = rank0(dst)
    try:
        from tpusync.rl import SamplerSync, WeightSubscriber

        sub = WeightSubscriber(
            0, {n: torch.zeros(lay.shape) for n, lay in eng.items()}, eng, name_map=U.engine_name
        )
        for kw, match in [({"window": 0}, "window must be >= 1"), ({"poll_interval": -1}, "poll")]:
            with pytest.raises(ValueError, match=match):
                SamplerSync(sub, replica=0, control=trainer.control_address, secret=U.SECRET, **kw)
    finally:
        trainer.close()


def test_a_second_sampler_under_a_live_samplers_key_is_refused(caplog):
    """ONE PROCESS PER KEY: two samplers started with the same (replica, rank) took turns as the
    member; one failed every version while publish reported success. The second is refused
    (logged) while the first is alive, and the first takes the version."""
    import threading

    from tpusync.rl import SamplerSync, WeightSubscriber

    dst = tp_layouts(1, {n: 0 for n in U.SHAPES})
    trainer, eng = rank0(dst, pool_bytes=8 << 20)

    def sampler():
        sub = WeightSubscriber(
            0, {n: torch.zeros(lay.shape) for n, lay in eng.items()}, eng, name_map=U.engine_name
        )
        return SamplerSync(
            sub,
            replica=0,
            control=trainer.control_address,
            secret=U.SECRET,
            block_bytes=BB,
            pool_bytes=8 << 20,
        )

    a, b = sampler(), sampler()
    try:
        assert a.update(0.3) is None  # joined; nothing published yet
        with caplog.at_level(logging.ERROR, logger="tpusync.rl"):
            assert b.update(0.5) is None
        assert "sampler 0:0 is already a live member" in caplog.text
        assert trainer.samplers == ["0:0"]
        got = []
        t = threading.Thread(target=lambda: got.append(a.update(30.0)))
        t.start()
        rep = trainer.publish(1, U.full_weights(1))
        t.join(30)
        assert rep.ok and rep.committed == ["0:0"], rep
        assert got and got[0].ok and a.version == 1 and b.version == 0
    finally:
        a.close()
        b.close()
        trainer.close()


def test_a_sampler_pool_smaller_than_a_bucket_fails_the_version_at_once():
    """Both sides waited out the version's deadline (every version) before reporting the pool."""
    import threading

    from tpusync.rl import SamplerSync, WeightSubscriber

    dst = tp_layouts(1, {n: 0 for n in U.SHAPES})
    trainer, eng = rank0(dst, pool_bytes=8 << 20, bucket_blocks=8, deadline=30.0)
    sub = WeightSubscriber(
        0, {n: torch.zeros(lay.shape) for n, lay in eng.items()}, eng, name_map=U.engine_name
    )
    small = SamplerSync(
        sub,
        replica=0,
        control=trainer.control_address,
        secret=U.SECRET,
        block_bytes=BB,
        pool_bytes=4 * BB,
    )
    try:
        assert small.update(0.3) is None
        got = []
        t = threading.Thread(target=lambda: got.append(small.update(30.0)))
        t.start()
        rep = trainer.publish(1, U.full_weights(1))
        t.join(30)
        assert not rep.ok and rep.seconds < 10.0, rep
        assert "pool holds 4 blocks, less than one bucket (8 blocks" in rep.failed["0:0"]
        assert got and not got[0].ok and small.version == 0
    finally:
        small.close()
        trainer.close()
