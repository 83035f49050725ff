"""LoRA adapter versions, engine-agnostic (ADAPTER VERSION CONTRACT, tpusync.rl.lora).

A trainer and an :class:`AdapterSync` run in this process over real sockets; the tests read the
PEFT directories it writes. A stand-in loader only injects an engine refusing one version (the
engines' own loaders are tested against live vLLM in test_vllm_lora.py and live SGLang in
integrations/sglang/tests/test_lora_server.py).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("safetensors")

import rl_netutil as U  # noqa: E402
import torch  # noqa: E402
from lora_util import TOY, adapter, pair, params_of, second_refused, step  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tpusync.rl import UpdateRejectedError  # noqa: E402
from tpusync.rl.lora import AdapterSync, AdapterVersion, check_adapter, lora_layouts  # noqa: E402


@pytest.mark.parametrize("planned", [False, True], ids=["reported", "lora_layouts"])
def test_each_adapter_version_is_a_verified_peft_directory_of_its_own(tmp_path, planned):
    dst = lora_layouts(params_of(adapter(0, TOY, 2)[1])) if planned else None
    config, trainer, lora = pair(tmp_path, AdapterSync, dst=dst, keep=2)
    root = lora.dir  # OWN DIRECTORY RULE: a directory of its own under the given root
    assert root.parent == tmp_path / "adapters"
    try:
        with ThreadPoolExecutor(1) as pool:
            for version in (1, 2, 3):
                tensors = adapter(version, TOY, 2)[1]
                rep, pulled = step(pool, trainer, lora, version, tensors)
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
    _config, trainer, lora = pair(tmp_path, AdapterSync, trainer_cls=_DamagingTrainer)
    root = lora.dir
    try:
        with ThreadPoolExecutor(1) as pool:
            rep, pulled = step(pool, trainer, lora, 1, adapter(1, TOY, 2)[1])
            first = pulled.result(60)
            rep, pulled = step(pool, trainer, lora, 2, adapter(2, TOY, 2)[1])
            assert rep.committed == [] and "failed its checksum" in rep.failed["0:0"], rep.failed
            with pytest.raises(UpdateRejectedError, match="adapter version 2 rejected: .*checksum"):
                pulled.result(60)
            assert lora.current == first
            assert [p.name for p in root.iterdir()] == ["tpusync-lora-v1"]
            rep, pulled = step(pool, trainer, lora, 3, adapter(3, TOY, 2)[1])
            assert rep.ok, rep.failed
            assert pulled.result(60).version == 3
    finally:
        lora.close()
        trainer.close()


class _Loader:
    """Stands in for an engine to inject it refusing version 2 (as an engine refuses an adapter
    whose shapes do not fit its model); records what it was asked to load and unload."""

    engine = "TestEngine"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def check(self, rank: int) -> None:
        if rank > 8:
            raise ValueError(f"rank {rank} is above 8")

    def load(self, adapter: AdapterVersion) -> None:
        assert Path(adapter.path, "adapter_model.safetensors").is_file()
        if adapter.version == 2:
            raise RuntimeError("the size of tensor a (129) must match")
        self.calls.append(("load", adapter.name))

    def unload(self, adapter: AdapterVersion) -> None:
        self.calls.append(("unload", adapter.name))


def test_adapter_the_engine_refuses_is_rejected_and_old_ones_are_unloaded(tmp_path):
    loader = _Loader()
    _config, trainer, lora = pair(tmp_path, AdapterSync, loader=loader, id_offset=100, keep=1)
    try:
        second_refused(trainer, lora, "TestEngine did not load adapter version 2: RuntimeError")
        # keep=1: version 3 replaces version 1, which is unloaded after version 3 loaded.
        assert loader.calls == [("load", "tpusync-lora-v1"), ("load", "tpusync-lora-v3"),
                                ("unload", "tpusync-lora-v1")]  # fmt: skip
        assert [p.name for p in lora.dir.iterdir()] == ["tpusync-lora-v3"]
    finally:
        lora.close()
        trainer.close()


def test_a_full_version_without_every_adapter_tensor_is_rejected(tmp_path):
    """WHOLE VERSION RULE (chunks.py): with the layouts the sampler reports (dst_layouts=None),
    a full publish that left a tensor out was written and served with that tensor all zeros
    (version 1) or at its previous value (later versions), reported ok."""
    _config, trainer, lora = pair(tmp_path, AdapterSync)
    try:
        with ThreadPoolExecutor(1) as pool:
            full = adapter(1, TOY, 2)[1]
            gone = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
            rep, pulled = step(pool, trainer, lora, 1, {n: t for n, t in full.items() if n != gone})
            assert rep.committed == [] and "is a full version without" in rep.failed["0:0"]
            with pytest.raises(UpdateRejectedError, match=f"full version without {gone}"):
                pulled.result(60)
            assert lora.current is None and list(lora.dir.iterdir()) == []
            rep, pulled = step(pool, trainer, lora, 2, adapter(2, TOY, 2)[1])
            assert rep.ok, rep.failed
            assert pulled.result(60).version == 2
    finally:
        lora.close()
        trainer.close()


def test_what_is_not_a_lora_adapter_is_refused_before_anything_moves():
    config, tensors = adapter(0, TOY, 1)
    params = params_of(tensors)
    assert check_adapter(config, params) == 8
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    cases = [
        ({**config, "peft_type": "IA3"}, params, "peft_type 'IA3': tpusync's LoRA sync serves"),
        ({**config, "r": 0}, params, "r=0, rank_pattern=None: every LoRA rank must be an integer >= 1"),
        ({**config, "rank_pattern": {"q_proj": 0}}, params, "every LoRA rank must be an integer >= 1"),
        (config, {**params, "model.norm.weight": [[32], "float32"]}, "model.norm.weight: not a LoRA"),
        (config, {**params, stem + ".lora_A.weight": [[4, 32], "float32"]},
         "lora_A.weight: shape [4, 32] does not hold this module's rank 8"),
        (config, {**params, stem + ".lora_B.weight": [[], "float32"]},
         "shape [] does not hold this module's rank 8"),
        ({**config, "rank_pattern": {"q_proj": 4}}, {**params, stem + ".lora_A.weight": [[4, 32], "float32"]},
         f"{stem}.lora_B.weight: shape [32, 8] does not hold this module's rank 4"),
        # RANK RULE: rank 8 where rank_pattern gives q_proj 4 (any config rank passed before, and
        # vLLM served it with rank 4's scaling).
        ({**config, "rank_pattern": {"q_proj": 4}}, params,
         f"{stem}.lora_A.weight: shape [8, 32] does not hold this module's rank 4"),
        ({**config, "target_modules": ["v_proj", "down_proj"]}, params,
         f"module {stem} is not one of the config's target_modules ['down_proj', 'v_proj']"),
        ({**config, "use_dora": True}, params, "asks for DoRA (use_dora), which vLLM and SGLang"),
        ({**config, "modules_to_save": ["lm_head"]}, params, "modules_to_save"),
        ({**config, "bias": "lora_only"}, params, "bias='lora_only': vLLM and SGLang serve"),
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
    # The loader's own check runs before the sampler contacts any trainer (none listens here).
    big = adapter(0, TOY, 1, r=16)
    with pytest.raises(ValueError, match="rank 16 is above 8"):
        AdapterSync(big[0], params_of(big[1]), loader=_Loader(), control="127.0.0.1:1", replica=0)
    with pytest.raises(ValueError, match="keep must be >= 1, not 0"):
        AdapterSync(config, params, keep=0, control="127.0.0.1:1", replica=0)
    for bad in ("team/policy", ".hidden", "", "a b"):  # it names directories and adapters
        with pytest.raises(ValueError, match="adapter name"):
            AdapterSync(config, params, name=bad, control="127.0.0.1:1", replica=0)
