"""Random PEFT LoRA adapters for the LoRA sync tests (test_lora.py, test_vllm_lora.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import rl_netutil as U
import torch
from safetensors.torch import save_file

from tpusync.rl import TrainerSync, UpdateRejectedError

BB = 1 << 16  # small blocks: an adapter spans several

# q / v / down projections of a Llama-shaped model: name -> (in, out) features.
TARGETS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.v_proj": ("hidden", "kv"),
           "mlp.down_proj": ("inter", "hidden")}  # fmt: skip
TOY = {"hidden": 32, "q": 32, "kv": 16, "inter": 48}  # feature sizes of a model no engine runs


def adapter(seed: int, sizes: dict[str, int], layers: int, r: int = 8) -> tuple[dict, dict]:
    """A random PEFT LoRA adapter of ``r`` on the q / v / down projections: (config, tensors)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in TARGETS.items():
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


def params_of(tensors: dict) -> dict:
    """``{name: [shape, dtype]}`` of ``tensors`` (what a sampler is built from)."""
    return {n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in tensors.items()}


def pair(tmp_path: Path, sync_cls: type, trainer_cls: type = TrainerSync, dst=None, **lora_kw):
    """A trainer (``dst``: its dst_layouts; None: from the sampler's report) and a ``sync_cls``
    (AdapterSync or an engine's LoraSync) of the toy adapter's shapes: (config, trainer, sync)."""
    config, tensors = adapter(0, TOY, 2)
    trainer = trainer_cls(0, 1, dst, secret=U.SECRET, block_bytes=BB, pool_bytes=8 << 20)
    lora = sync_cls(
        config,
        params_of(tensors),
        root=tmp_path / "adapters",
        control=trainer.control_address,
        replica=0,
        secret=U.SECRET,
        block_bytes=BB,
        pool_bytes=8 << 20,
        **lora_kw,
    )
    return config, trainer, lora


def step(pool, trainer, lora, version: int, tensors: dict):
    """The sampler's update of ``version`` (in a thread of ``pool``) against the trainer's
    publish of it: (the trainer's report, the future of the sampler's AdapterVersion)."""
    pulled = pool.submit(lora.update, 60, version)
    trainer.wait_for_samplers(1, timeout=30)
    return trainer.publish(version, tensors), pulled


def second_refused(trainer, lora, why: str) -> None:
    """Versions 1-3 through ``lora`` (built with ``id_offset=100``) whose engine refuses version
    2: versions 1 and 3 are served under ids 101 and 103; version 2 is rejected with ``why`` in
    the trainer's report, its directory removed, and version 1 stays served meanwhile."""
    with ThreadPoolExecutor(1) as pool:
        for version in (1, 2, 3):
            rep, pulled = step(pool, trainer, lora, version, adapter(version, TOY, 2)[1])
            if version != 2:
                assert rep.ok, rep.failed
                assert pulled.result(60).lora_int_id == 100 + version
                continue
            assert rep.committed == [] and why in rep.failed["0:0"], rep.failed
            with pytest.raises(UpdateRejectedError, match="still serving version 1"):
                pulled.result(60)
            assert lora.current.version == 1
            assert "tpusync-lora-v2" not in {p.name for p in lora.dir.iterdir()}
