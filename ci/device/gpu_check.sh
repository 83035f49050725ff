#!/usr/bin/env bash
# CUDA check of tpusync.torch.KVCacheManager (run on a machine with an NVIDIA GPU; <= 5 minutes).
#
# 1. correctness: for every layout variant, CUDA d2h (copy stream + pinned pool) must write the
#    very bytes the CPU path (native segment copy) writes for the same data - one host block
#    format on both - and h2d must restore them into other device blocks, bit-exact;
# 2. the compute stream is not synchronised: a d2h issued behind a long kernel returns at once;
# 3. `tpusync bench device --json`: D2H / H2D GB/s against torch's own pinned copy_ of the same
#    bytes, same run (the "cuda" rows).
# JAX on the GPU (staged path, host_memory "pinned_host" vs "unpinned", against JAX's own pageable
# and pinned copies of the same bytes) is ci/device/jax_gpu_check.py, which ci/device/run_all.sh
# runs right after this script (its own 240 s limit).
#
# Needs: python3 with a CUDA build of torch and numpy (PYTHON=... to choose), and either
# tpusync-core/tpusync-torch installed, or what building them needs (nanobind, scikit-build-core,
# ninja, cmake, libxxhash-dev): then they are built into build/gpu-check-site (pip --target).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
deadline=${GPU_CHECK_TIMEOUT_S:-290}

if ! "$py" -c "import tpusync.core, tpusync.torch" 2>/dev/null; then
  # --target, not a venv: a venv made from a venv's python sees the base interpreter's packages.
  site=build/gpu-check-site
  [ "$(id -u)" = 0 ] && bash ci/apt-deps.sh libxxhash-dev libssl-dev || true
  "$py" -m pip install -q --no-deps --no-build-isolation --upgrade --target "$site" \
    -Cbuild-dir=build/gpu-check-skbuild packages/tpusync-core
  "$py" -m pip install -q --no-deps --upgrade --target "$site" packages/tpusync-torch
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"

timeout "$deadline" "$py" - <<'PY'
import time

import numpy as np
import torch

from tpusync.core.kvcache import KVLayout
from tpusync.torch import KVCacheManager

torch.manual_seed(0)
N, H, B, D = 64, 8, 16, 128
dt = torch.bfloat16


def variants():
    yield "vllm_cpu", KVLayout.vllm_cpu(N, H, B, D, dt), lambda lay: (torch.randn(lay.shape).to(dt),)
    yield "nhd", KVLayout.nhd(N, H, B, D, dt), lambda lay: (torch.randn(lay.shape).to(dt),)
    yield "hnd", KVLayout.hnd(N, H, B, D, dt), lambda lay: (torch.randn(lay.shape).to(dt),)
    yield "hnd_strided", KVLayout.nhd(N, H, B, D, dt), lambda lay: (
        torch.randn(2, N, H, B, D).to(dt).permute(0, 1, 3, 2, 4),
    )
    yield "pages", KVLayout.jax_pages(N, H, B, D, dt), lambda lay: (
        torch.randn(lay.shape).to(dt),
        torch.randn(lay.shape).to(dt),
    )


def on_cuda(parts):
    out = []
    for p in parts:
        if p.is_contiguous():
            out.append(p.cuda())
        else:  # keep the strided view's physical layout on the GPU too
            base = p.permute(0, 1, 3, 2, 4).contiguous().cuda()
            out.append(base.permute(0, 1, 3, 2, 4))
    return out


layers, src, dst = 4, [5, 17, 3, 40, 41], [0, 1, 2, 60, 63]
for name, lay, make in variants():
    for per_host in (1, layers):
        cpu = [make(lay) for _ in range(layers)]
        gpu = [on_cuda(parts) for parts in cpu]
        arg = lambda xs: [x if len(x) > 1 else x[0] for x in xs]  # noqa: E731
        mc = KVCacheManager(arg(cpu), lay, host_blocks=64, layers_per_host_block=per_host)
        mg = KVCacheManager(arg(gpu), lay, host_blocks=64, layers_per_host_block=per_host)
        assert mc.format == mg.format, (mc.format, mg.format)
        ic, ig = mc.alloc_host(len(src)), mg.alloc_host(len(src))
        mc.d2h(src, ic).result(timeout=60)
        mg.d2h(src, ig).result(timeout=60)
        for a, b in zip(ic.reshape(-1), ig.reshape(-1)):
            np.testing.assert_array_equal(mc.pool.view(int(a)), mg.pool.view(int(b)))
        mg.h2d(dst, ig).result(timeout=60)
        torch.cuda.synchronize()
        ax = lay.block_axis
        for parts_c, parts_g in zip(cpu, mg.kv_caches):
            for pc, pg in zip(parts_c, parts_g):
                for s, d in zip(src, dst):
                    assert torch.equal(pg.select(ax, d).cpu(), pc.select(ax, s)), (name, s, d)
        mg.close()
    print(f"correctness {name}: CUDA bytes == CPU bytes, h2d exact")

# The compute stream is never synchronised: a d2h issued behind ~0.5 s of queued GPU work
# returns at once (it only enqueues work on the copy stream) and completes after that work.
lay = KVLayout.nhd(N, H, B, D, dt)
m = KVCacheManager([torch.randn(lay.shape, device="cuda").to(dt)], lay, host_blocks=8)
ids = m.alloc_host(2)
m.d2h([1, 2], ids).result(timeout=60)  # warm-up: kernels loaded, pinned index buffer cached
x = torch.randn(4096, 4096, device="cuda")
x @ x
torch.cuda.synchronize()
t0 = time.perf_counter()
x @ x
torch.cuda.synchronize()
matmul_s = time.perf_counter() - t0
reps = max(10, int(0.5 / max(matmul_s, 1e-4)))
t0 = time.perf_counter()
for _ in range(reps):
    x = x @ x / 4096
issued = time.perf_counter()
f = m.d2h([1, 2], ids)
call_s = time.perf_counter() - issued
f.result(timeout=60)
done_s = time.perf_counter() - t0
print(f"d2h call returned in {call_s * 1e3:.2f} ms; completed after {done_s * 1e3:.0f} ms of compute")
assert call_s < 0.1, "d2h blocked the host behind the compute stream"
assert done_s > 0.5 * reps * matmul_s, "d2h completed before the compute it must follow"
m.close()

# Weight sync device side on CUDA: flatten into host buckets, restore in place, bit-exact.
import tpusync.core as tc
from tpusync.torch import flatten_weights, restore_weights

sd = {f"w{i}": torch.randn(257, 129, device="cuda").to(dt) for i in range(6)}
pool = tc.HostBlockPool(64 << 10, 64)
host, futures = flatten_weights(sd, pool, bucket_bytes=128 << 10)
for f in futures:
    f.result(timeout=60)
targets = {k: torch.zeros_like(v) for k, v in sd.items()}
restore_weights(host, targets).result(timeout=60)
torch.cuda.synchronize()
assert all(torch.equal(targets[k], sd[k]) for k in sd), "weight restore mismatch"
print(f"weights: {len(sd)} tensors in {len(futures)} buckets restored exactly")
print("gpu_check correctness: OK")
PY

for mib in 512 2048; do  # per-call overheads weigh less on bigger batches: both sizes reported
  timeout 200 "$py" -m tpusync.core.cli bench device --json --quiet --total-mib $mib --repeats 5
done
