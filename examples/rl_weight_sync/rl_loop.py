"""A toy RL loop: one trainer process updates a small torch model each step and publishes every
version; two sampler processes (a chain: trainer -> sampler 0 -> sampler 1) pick up each version,
verify it, cast it to bf16 under the engine's names and commit it atomically.

Run: python examples/rl_weight_sync/rl_loop.py [--steps 3] [--same-host]
Prints, per version, what each sampler serves, a digest of its weights and how long it took; the
trainer prints its commit report. Exits non-zero if any sampler missed a version or disagrees.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import torch

VOCAB, DIM = 512, 256


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, DIM),
        torch.nn.Linear(DIM, 4 * DIM),
        torch.nn.GELU(),
        torch.nn.Linear(4 * DIM, DIM),
        torch.nn.Linear(DIM, VOCAB),
    )


def engine_name(trainer_name: str) -> str:
    return "engine." + trainer_name  # the sampler's naming (a name-mapping hook)


def digest(weights: dict[str, torch.Tensor]) -> str:
    from tpusync.core import checksum64

    h = 0
    for name in sorted(weights):
        t = weights[name].contiguous().reshape(-1).view(torch.uint8).numpy()
        h = checksum64(t, seed=h)
    return f"{h:016x}"


def sampler(replica: int, control: str, secret: bytes, steps: int, same_host: bool, q) -> None:
    torch.set_num_threads(1)
    from tpusync.rl import SamplerSync, ShardLayout, WeightSubscriber

    shapes = {engine_name(n): tuple(p.shape) for n, p in model().state_dict().items()}
    layouts = {n: ShardLayout.replicated(s, [0]) for n, s in shapes.items()}
    weights = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    sub = WeightSubscriber(0, weights, layouts, name_map=engine_name)  # shadow commit
    s = SamplerSync(
        sub,
        replica=replica,
        control=control,
        secret=secret,
        same_host=same_host,
        block_bytes=1 << 20,
        pool_bytes=16 << 20,
    )
    for _ in range(steps):
        res = s.update(timeout=60)
        if res is None:
            print(f"sampler {replica}: no new version within 60 s", flush=True)
            break
        state = "committed" if res.ok else f"REJECTED ({res.reason})"
        print(
            f"sampler {replica}: version {res.version} {state} in {res.seconds * 1e3:.1f} ms, "
            f"serving {sub.version}, digest {digest(sub.weights)}, path {res.path}, forwarded "
            f"{res.forwarded_to} buckets",
            flush=True,
        )
        q.put((replica, sub.version, digest(sub.weights)))
    s.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--same-host", action="store_true", help="samplers read the trainer's /dev/shm pool"
    )
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: at least 1")
    torch.set_num_threads(1)
    from tpusync.rl import ShardLayout, TrainerSync

    secret = os.urandom(32)  # shared with the samplers through their arguments, never argv
    net = model()
    dst = {n: ShardLayout.replicated(tuple(p.shape), [0]) for n, p in net.state_dict().items()}
    trainer = TrainerSync(
        0,
        1,
        dst,
        secret=secret,
        same_host=args.same_host,
        block_bytes=1 << 20,
        pool_bytes=16 << 20,
        deadline=30.0,
    )
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(
            target=sampler, args=(r, trainer.control_address, secret, args.steps, args.same_host, q)
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    ok = True
    try:
        trainer.wait_for_samplers(2, timeout=60)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(1, args.steps + 1):
            tokens = torch.randint(0, VOCAB, (8, 16))
            loss = net(tokens).logsumexp(-1).mean()  # a stand-in for the RL objective
            opt.zero_grad()
            loss.backward()
            opt.step()
            t0 = time.monotonic()
            state = {n: t.detach() for n, t in net.state_dict().items()}
            rep = trainer.publish(step, state)
            want = digest({engine_name(n): t.to(torch.bfloat16) for n, t in state.items()})
            print(
                f"trainer: step {step} loss {loss.item():.4f} published version {step} "
                f"({rep.bytes_sent >> 10} KiB served by the trainer) in {(time.monotonic() - t0) * 1e3:.1f} "
                f"ms; committed {rep.committed}, failed {rep.failed}; expected digest {want}",
                flush=True,
            )
            got = [q.get(timeout=60) for _ in procs]
            ok &= rep.ok and all(v == step and d == want for _, v, d in got)
    finally:
        for p in procs:
            p.join(60)
        trainer.close()
    print("all samplers served every version" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
