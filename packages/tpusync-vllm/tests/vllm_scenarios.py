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
):
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    events = None
    if vllm_events:  # vLLM's own publisher: carries what the connector's take_events() returns
        events = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=vllm_events, topic="kv"
        )

    ktc = KVTransferConfig(
        kv_connector="TpusyncConnector",  # by name: proves the vllm.general_plugins entry point
        kv_role="kv_both",
        kv_load_failure_policy=policy,
        kv_connector_extra_config={"host_bytes": 32 << 20, **(extra or {})},
    )
    return LLM(
        model=model,
        tokenizer=model,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_transfer_config=ktc,
        kv_events_config=events,
        seed=0,
    )


def params():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def generate(llm, ids: list[int]) -> dict:
    t0 = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": ids}], params(), use_tqdm=False)
    return {
        "tokens": list(out.outputs[0].token_ids),
        "cached": out.num_cached_tokens,
        "finish": out.outputs[0].finish_reason,
        "seconds": time.perf_counter() - t0,
    }


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


def scenario_inproc(model: str) -> dict:
    """Reuse, proof that loaded bytes are used, load failures, abort and preemption."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
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
    r["pins_after_warm"] = sched.num_pins

    # Same prompt, vLLM's own prefix cache kept: the hit is local, tpusync is not asked to load.
    before = sched.stats["hit_blocks"]
    r["local"] = generate(llm, ids)
    r["local_hit_blocks"] = sched.stats["hit_blocks"] - before

    # Overwrite the host copy of every stored block with noise (keys still valid): a run that
    # really uses tpusync's bytes must now produce different tokens.
    import numpy as np

    slots = worker.slots
    saved = [slots.pool.view(i).copy() for i in slots._ids]
    rng = np.random.default_rng(0)
    for i in slots._ids:
        v = slots.pool.view(i, "float32")
        v[:] = rng.normal(0, 50, v.shape).astype(np.float32)
    llm.reset_prefix_cache()
    r["corrupt"] = generate(llm, ids)
    for i, b in zip(slots._ids, saved, strict=True):
        slots.pool.view(i)[:] = b

    # Loads that fail (slots no longer hold their keys) -> reported, recomputed, same tokens.
    slots.invalidate()
    llm.reset_prefix_cache()
    errs_before = sched.stats["load_errors_seen"]
    saves_before = sched.stats["planned_saves"]
    r["failed_load"] = generate(llm, ids)
    r["resaved_after_failure"] = sched.stats["planned_saves"] - saves_before
    r["load_errors_seen"] = sched.stats["load_errors_seen"] - errs_before
    r["pins_after_failure"] = sched.num_pins

    # Abort a request right after its load step (the recompute above stored the blocks again).
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    hits0 = sched.stats["hit_blocks"]
    engine.add_request("abort-me", {"prompt_token_ids": ids}, params())
    engine.step()  # schedules the load (and runs it) plus the first forward
    r["abort_loaded_blocks"] = sched.stats["hit_blocks"] - hits0
    r["pins_during_request"] = sched.num_pins
    engine.abort_request(["abort-me"])  # the caller's id (add_request returns the internal one)
    for _ in range(5):
        engine.step()
        if not engine.has_unfinished_requests():
            break
    r["pins_after_abort"] = sched.num_pins

    # Preemption while the request runs: vLLM moves it back to waiting, it loads again on resume.
    llm.reset_prefix_cache()
    hits0 = sched.stats["hit_blocks"]
    engine.add_request("preempt-me", {"prompt_token_ids": ids}, params())
    engine.step()
    r["pins_before_preempt"] = sched.num_pins
    r["preempt_reset"] = llm.reset_prefix_cache(reset_running_requests=True)
    tokens: list[int] = []
    for _ in range(200):
        for out in engine.step():
            if out.finished and out.request_id == "preempt-me":
                tokens = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    r["preempted_tokens"] = tokens
    r["pins_after_preempt"] = sched.num_pins
    r["preempt_loaded_blocks"] = sched.stats["hit_blocks"] - hits0
    r["stats_final"] = dict(sched.stats)
    r["worker_totals"] = dict(worker.totals.data)
    r["events_late"] = sub.drain()
    return r


def scenario_fail_policy(model: str) -> dict:
    """kv_load_failure_policy='fail': a failed load fails the request, the engine lives on."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = make_llm(model, policy="fail")
    sched, worker = connectors(llm)
    ids = prompt(1)
    r: dict = {"cold": generate(llm, ids)}
    worker.slots.invalidate()
    llm.reset_prefix_cache()
    r["failed"] = generate(llm, ids)
    r["pins_after_failure"] = sched.num_pins
    llm.reset_prefix_cache()
    r["after"] = generate(llm, prompt(2))  # the engine still serves
    return r


def scenario_multiprocess(model: str) -> dict:
    """vLLM's default engine: frontend, engine core (scheduler) and worker in three processes."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Subscriber(endpoint)
    vllm_port = free_port()
    # vLLM's PUB binds only wildcard endpoints (it connects to host:port ones).
    vllm_sub = Subscriber(f"tcp://127.0.0.1:{vllm_port}", topic="kv")
    llm = make_llm(
        model,
        extra={"kv_events_endpoint": endpoint, "pod_id": "pod-mp"},
        vllm_events=f"tcp://*:{vllm_port}",
    )
    ids = prompt(3)
    generate(llm, prompt(98))
    llm.reset_prefix_cache()
    r = {"cold": generate(llm, ids)}
    llm.reset_prefix_cache()
    r["warm"] = generate(llm, ids)
    r["events"] = sub.drain(2.0)
    r["vllm_events"] = vllm_sub.drain(1.0)
    llm.llm_engine.engine_core.shutdown(timeout=30)  # stops the engine-core and worker processes
    return r


SCENARIOS = {
    "inproc": scenario_inproc,
    "fail_policy": scenario_fail_policy,
    "multiprocess": scenario_multiprocess,
}

if __name__ == "__main__":
    name, model, out = sys.argv[1:4]
    t0 = time.perf_counter()
    result = SCENARIOS[name](model)
    result["scenario_seconds"] = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump(result, f, default=repr)
    os._exit(0)  # skip vLLM's slow interpreter teardown; the result is written
