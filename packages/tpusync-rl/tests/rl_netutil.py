"""Processes for the network tests: trainer ranks and sampler ranks as real spawned processes.

Kept in a module of its own so that ``multiprocessing``'s spawn start method can import the
process entry points by name (fork would copy the native engine's threads in a broken state).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch

from tpusync.rl import TrainerSync

SECRET = b"tpusync-rl-test-secret-0123456789"
SHAPES = {
    "embed": (256, 160),
    "layers.0.w": (192, 256),
    "layers.0.b": (192,),
    "layers.1.w": (256, 192),
    "scale": (),
}


def full_weights(seed: int, bumps=()) -> dict[str, torch.Tensor]:
    """The model of ``seed``; ``bumps``: ``(name, index, amount)`` added to single elements (a
    change confined to the trainer shard that holds ``index``)."""
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    for name, index, amount in bumps:
        out[name][tuple(index)] += amount
    return out


def engine_name(name: str) -> str:
    return "model." + name


def ctx():
    return mp.get_context("spawn")


def shard(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=True))]


def weights_digest(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    from tpusync.core import checksum64

    return {
        n: checksum64(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        for n, t in weights.items()
    }


def expected_digest(full, layouts, rank, dtype) -> dict[str, int]:
    """What sampler ``rank`` must hold: its box of every tensor, cast to ``dtype``."""
    out = {}
    for name, t in full.items():
        lay = layouts[engine_name(name)]
        out[engine_name(name)] = shard(t, lay.box_of(rank)).to(dtype)
    return weights_digest(out)


class TamperingTrainer(TrainerSync):
    """Fault injection: flips one byte of the first block of version 2 sent to sampler rank
    ``damaged_rank`` (stream 0 -> that rank; 1 unless a subclass says), after its checksum was
    taken."""

    damaged_rank = 1

    def _fill(self, block, plan, index, version, *a):
        checksum = super()._fill(block, plan, index, version, *a)
        if version == 2 and plan.dst == self.damaged_rank and index == 0:
            self._ep.pool.view(block)[0] ^= 0xFF
        return checksum


def sampler_main(spec: dict, q) -> None:
    """One sampler rank: apply ``spec['updates']`` updates, reporting each on ``q``."""
    torch.set_num_threads(1)
    from tpusync.rl import SamplerSync, UpdateRejectedError, WeightSubscriber

    dtype = getattr(torch, spec.get("dtype", "bfloat16"))
    layouts = spec["layouts"]  # by engine name
    rank = spec["rank"]
    weights = {n: torch.zeros(lay.box_of(rank).shape, dtype=dtype) for n, lay in layouts.items()}
    sub = WeightSubscriber(
        rank,
        weights,
        layouts,
        name_map=engine_name,
        mode=spec.get("mode", "shadow"),
        version=spec.get("start_version", 0),
    )
    sampler = SamplerSync(
        sub,
        replica=spec["replica"],
        control=spec["control"],
        secret=SECRET,
        block_bytes=spec["block_bytes"],
        pool_bytes=spec.get("pool_bytes", 4 << 20),
        same_host=spec.get("same_host", False),
        window=spec.get("window", 3),
        layouts=spec.get("report_layouts"),  # by trainer name (SAMPLER LAYOUTS CONTRACT)
    )
    reject = spec.get("reject_at_version")
    if reject is not None:  # fault injection: pull all of `reject`, then refuse to commit it
        commit = sub.commit

        def rejecting_commit():
            if sub._pending is not None and sub._pending.manifest.version == reject:
                sub.abort("test: injected rejection")
                raise UpdateRejectedError(f"test: version {reject} rejected on purpose")
            return commit()

        sub.commit = rejecting_commit
    die = spec.get("die_at_version")
    if die is not None:  # fault injection: exit hard after staging the first block of `die`
        stage = sampler._stage_view  # every path stages through it

        def dying_stage(version, *a, **kw):
            stage(version, *a, **kw)
            if version == die:
                os._exit(3)

        sampler._stage_view = dying_stage
    kill = spec.get("kill_at_version")
    if kill is not None:  # fault injection: SIGKILL (or SIGSTOP: hung, sockets open, silent)
        # itself after staging the first block of `kill`
        kstage = sampler._stage_view

        def killed_stage(version, *a, **kw):
            kstage(version, *a, **kw)
            if version == kill:
                import signal

                if spec.get("kill_stamp"):  # when it died, for the test's figures
                    with open(spec["kill_stamp"], "w") as f:
                        f.write(repr(time.time()))
                os.kill(os.getpid(), getattr(signal, spec.get("kill_signal", "SIGKILL")))

        sampler._stage_view = killed_stage
    staged: dict[int, int] = {}  # version -> blocks staged (each must be staged exactly once)
    cstage = sampler._stage_view

    def counted_stage(version, *a, **kw):
        cstage(version, *a, **kw)
        staged[version] = staged.get(version, 0) + 1

    sampler._stage_view = counted_stage
    delay = spec.get("stage_delay")
    if delay:  # a slow sampler: sleeps after staging each block
        slow_stage = sampler._stage_view

        def sleepy_stage(*a, **kw):
            slow_stage(*a, **kw)
            time.sleep(delay)

        sampler._stage_view = sleepy_stage
    refuse = spec.get("group_refuses")  # GROUP COMMIT CONTRACT: version -> the group's reason
    confirmed: list[int] = []  # the versions this rank's confirm callback was asked about
    confirm = None
    if refuse is not None:

        def confirm(version: int) -> str | None:
            confirmed.append(version)
            return refuse.get(version)

    q.put(("joined", spec["replica"], rank, None))
    timeouts = spec.get("timeouts", [spec.get("timeout", 30)] * spec["updates"])
    idle = spec.get("idle_before", {})  # update index -> seconds without polling first
    for i in range(spec["updates"]):
        if idle.get(i):
            q.put(("idle", spec["replica"], rank, i))
            time.sleep(idle[i])
        t0 = time.monotonic()
        if spec.get("paused"):
            with sub.paused():
                res = sampler.update(timeout=timeouts[i], confirm=confirm)
        else:
            res = sampler.update(timeout=timeouts[i], confirm=confirm)
        info = None
        if res is not None:
            info = {
                "version": res.version,
                "ok": res.ok,
                "reason": res.reason,
                "forwarded": res.forwarded_to,
                "path": res.path,
                "bytes": res.bytes,
                "serving": sub.version,
                "digest": weights_digest(sub.weights),
                "fused": sub.metrics["bytes_fused"],
                "waited": time.monotonic() - t0,
                "staged": staged.get(res.version, 0),
                "done_at": time.time(),
                "pending_pulls": pending_pulls(sampler),
                "pulls_abandoned": sampler.pulls_abandoned,
                "confirmed": list(confirmed),
            }
        q.put(("update", spec["replica"], rank, info))
    sampler.close()
    q.put(("closed", spec["replica"], rank, None))


def pending_pulls(sampler, wait_s: float = 10.0) -> int:
    """Pulls still pending on the sampler's consumer once its update returned, after up to
    ``wait_s`` for given-up ones to end (their abandons run on other threads): 0 unless a pull
    outlives its update (a hung parent's pulls used to stay until the version's deadline)."""
    end = time.monotonic() + wait_s
    while True:
        left = sum(1 for r in sampler._ep.consumer.poll() if r.state == "pending")
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def trainer_rank_main(spec: dict, q) -> None:
    """A trainer rank > 0 (or a trainer rank 0 that may die): publishes ``spec['versions']``."""
    torch.set_num_threads(1)
    from tpusync.rl import TrainerSync

    t = TrainerSync(
        spec["rank"],
        spec["world"],
        spec["dst_layouts"],
        control=spec.get("control"),
        secret=SECRET,
        fanout=spec.get("fanout", 1),
        block_bytes=spec["block_bytes"],
        bucket_blocks=spec.get("bucket_blocks", 2),
        pool_bytes=spec.get("pool_bytes", 8 << 20),
        deadline=spec.get("deadline", 20.0),
    )
    die = spec.get("die_at_version")
    if die is not None:
        fill = t._fill

        def dying_fill(block, plan, index, version, *a):
            checksum = fill(block, plan, index, version, *a)
            if version == die and index == 1:
                time.sleep(1.0)  # the samplers see the announcement and pull bucket 0 first
                os._exit(4)
            return checksum

        t._fill = dying_fill
    if spec["rank"] == 0:
        q.put(("control", t.control_address))
        t.wait_for_samplers(spec["samplers"], timeout=60)
    for v, seed, *opts in spec["versions"]:
        opt = opts[0] if opts else {}  # {"delta": bool, "bumps": [...]}
        full = full_weights(seed, opt.get("bumps", ()))
        tensors = {}
        for name, tensor in full.items():
            lay = spec["src_layouts"][name]
            tensors[name] = (shard(tensor, lay.box_of(spec["rank"])).clone(), lay)
        try:
            rep = t.publish(v, tensors, delta=opt.get("delta", False))
        except Exception as e:  # noqa: BLE001 - the test checks what went wrong
            q.put(("publish_error", v, f"{type(e).__name__}: {e}"))
            continue
        info = {
            "failed": rep.failed,
            "committed": rep.committed,
            "bytes": rep.bytes_sent,
            "seconds": rep.seconds,
        }
        q.put(("published", v, info))
    t.close()


def jax_trainer_main(spec: dict, q) -> None:
    """One multi-controller JAX process (2 CPU devices): publishes ``spec['versions']`` of a
    pytree sharded over a 2 x 2 mesh spanning both processes."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    torch.set_num_threads(1)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.distributed.initialize(
        coordinator_address=spec["coordinator"],
        num_processes=spec["processes"],
        process_id=spec["process"],
        initialization_timeout=60,
    )
    from tpusync.rl.jaxsync import JaxTrainerSync, device_ranks

    devices = np.array(sorted(jax.devices(), key=lambda d: d.id)).reshape(2, 2)
    mesh = Mesh(devices, ("x", "y"))
    specs = {2: PartitionSpec("x", "y"), 1: PartitionSpec("y"), 0: PartitionSpec()}

    def tree(seed: int, bumps=()) -> dict:
        out = {}
        for name, t in full_weights(seed, bumps).items():
            host = t.numpy()
            sharding = NamedSharding(mesh, specs[t.dim()])
            out[name] = jax.make_array_from_callback(host.shape, sharding, lambda i, h=host: h[i])
        return out

    # jax.distributed.initialize returns once every process joined: only then can process 0
    # hand its control address to the others (here through the test's queue).
    ranks = device_ranks()
    is_control = any(ranks[d] == 0 for d in jax.local_devices())
    control = None if is_control else spec["control_q"].get(timeout=120)
    t = JaxTrainerSync(
        spec["dst_layouts"],
        control=control,
        secret=SECRET,
        block_bytes=spec["block_bytes"],
        bucket_blocks=2,
        pool_bytes=8 << 20,
        deadline=30.0,
    )
    if t.is_control:
        q.put(("control", t.control_address))
        t.wait_for_samplers(spec["samplers"], timeout=120)
    else:  # publish together with process 0 (a training step would line them up)
        assert spec["control_q"].get(timeout=180) == "go"
    from tpusync.rl.jaxsync import pytree_shards

    held = sorted(t.sync.ranks)
    for v, seed, *opts in spec["versions"]:
        opt = opts[0] if opts else {}  # {"delta": bool, "bumps": [...]}
        params = tree(seed, opt.get("bumps", ()))
        layouts = {n: lay for n, (_, lay) in pytree_shards(params).items()}
        rep = t.publish(v, params, delta=opt.get("delta", False))
        q.put(
            (
                "published",
                spec["process"],
                {"failed": rep.failed, "committed": rep.committed, "bytes": rep.bytes_sent},
                held,
                layouts,
                v,
            )
        )
    t.close()
    jax.distributed.shutdown()
