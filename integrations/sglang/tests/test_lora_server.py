"""LoRA adapter versions into a LIVE SGLang server (tpusync.sglang.lora, ADAPTER VERSION CONTRACT).

The server runs the tiny model with ``--enable-lora`` (rank up to 8 on q / v / down, the
``torch_native`` LoRA backend). This process is the trainer (``TrainerSync``) and the RL driver
(``LoraSync(server=...)``, over real sockets and HTTP). Each version's greedy outputs are
compared with those of the same adapter the test wrote to its own directory and had SGLang load
itself, and with the base model's:

1. Versions 1 and 3 are served exactly like their references (and unlike the base model and each
   other, so the comparison can fail).
2. Version 2 reaches the server as a truncated file (a fault injected after the digests were
   checked): SGLang refuses it, the version is rejected with SGLang's reason, its directory is
   removed, and version 1 keeps generating the same.
3. With ``keep=2``, version 4 unloads version 1: it is gone from ``/v1/models`` and from disk, and
   a request still naming it fails instead of running on another version; version 3 (kept)
   still generates as before.
4. A rank-16 adapter is refused against the server's ``--max-lora-rank 8`` before anything moves.

A stub HTTP server stands in for servers this CPU machine cannot run alongside (LoRA off, two
data-parallel replicas) to check those refusals. CPU only through the TEST-ONLY server shim
(``support/live_server.py``; ``support/cpu_server_shim.py`` makes SGLang's LoRA modules' pinned
host tensors plain ones).
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import tiny_model
import torch
from live_server import http, launch
from safetensors.torch import save_file

from tpusync.rl import TrainerSync, UpdateRejectedError
from tpusync.rl.lora import AdapterSync
from tpusync.sglang.lora import LoraSync

SECRET = b"tpusync-sglang-lora-test-secret"
BB = 1 << 16  # small blocks: an adapter spans several
PROMPTS = [[ord(c) for c in "the cache page block host"], [ord(c) for c in "tpusync moves weights"]]
TARGETS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.v_proj": ("hidden", "kv"),
           "mlp.down_proj": ("inter", "hidden")}  # fmt: skip


TOY = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 1}  # fmt: skip


def _adapters(cfg: dict, seeds, r: int = 8) -> tuple[dict, dict[int, dict]]:
    """A PEFT LoRA config and, per seed, random bf16 lora_A / lora_B tensors of rank ``r`` on the
    q / v / down projections of every layer of a model of config ``cfg``."""
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    size = {"hidden": cfg["hidden_size"], "inter": cfg["intermediate_size"],
            "q": cfg["num_attention_heads"] * head, "kv": cfg["num_key_value_heads"] * head}  # fmt: skip
    out = {}
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        out[seed] = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module, (fan_in, fan_out) in TARGETS.items():
                stem = f"base_model.model.model.layers.{layer}.{module}"
                a = torch.randn(r, size[fan_in], generator=g) * 0.5
                b = torch.randn(size[fan_out], r, generator=g) * 0.5
                out[seed][stem + ".lora_A.weight"] = a.to(torch.bfloat16)
                out[seed][stem + ".lora_B.weight"] = b.to(torch.bfloat16)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
              "target_modules": ["q_proj", "v_proj", "down_proj"], "bias": "none"}  # fmt: skip
    return config, out


def _params(tensors: dict) -> dict:
    return {n: [list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in tensors.items()}


# TP=2 (+70 s here) is an extended test (conftest.py): CI's 90 minutes are nearly spent.
@pytest.fixture(
    scope="module", params=[1, pytest.param(2, marks=pytest.mark.extended)], ids=["tp1", "tp2"]
)
def lora_server(request, tmp_path_factory):
    """(server, model directory, work directory); at TP=2 each rank reads its part of every
    adapter directory, one scheduler process per core."""
    tp = request.param
    root = Path(os.environ.get("TPUSYNC_REPO_ROOT", Path(__file__).resolve().parents[3]))
    model = tiny_model.ensure(root)
    work = tmp_path_factory.mktemp(f"sglang-lora-tp{tp}")
    args = ["--enable-lora", "--max-lora-rank", "8", "--lora-backend", "torch_native",
            "--lora-target-modules", "q_proj", "v_proj", "down_proj"]  # fmt: skip
    env = {}
    if tp > 1:
        args += ["--tp-size", str(tp)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"
    server = launch(model, work / "server.log", args, env=env)
    try:
        server.wait_ready()
        yield server, model, work
    finally:
        server.stop()


def _outputs(server, adapter: str | None) -> list[list[int]]:
    extra = {"lora_path": adapter} if adapter else {}
    return [server.generate(p, max_new_tokens=10, **extra)["output_ids"] for p in PROMPTS]


def _reference(server, work: Path, name: str, config: dict, tensors: dict) -> list[list[int]]:
    """The outputs of ``tensors`` written by this test and loaded by SGLang under ``name``."""
    path = work / name
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config))
    http(f"{server.base}/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    return _outputs(server, name)


def _models(server) -> set[str]:
    return {m["id"] for m in json.loads(http(f"{server.base}/v1/models")[1])["data"]}


def test_running_server_serves_each_adapter_version_like_the_same_adapter_from_disk(
    lora_server, monkeypatch
):
    server, model, work = lora_server
    cfg = json.loads((model / "config.json").read_text())
    config, versions = _adapters(cfg, (1, 2, 3, 4))
    base = _outputs(server, None)
    refs = {v: _reference(server, work, f"ref{v}", config, versions[v]) for v in (1, 3, 4)}
    assert len({json.dumps(o) for o in (base, *refs.values())}) == 4  # all four differ

    write = AdapterSync._write

    def truncating(self, version, tensors):  # fault: version 2's file is cut after the digests
        adapter = write(self, version, tensors)
        if version == 2:
            f = Path(adapter.path, "adapter_model.safetensors")
            f.write_bytes(f.read_bytes()[:100])
        return adapter

    monkeypatch.setattr(AdapterSync, "_write", truncating)
    trainer = TrainerSync(0, 1, None, secret=SECRET, block_bytes=BB, pool_bytes=8 << 20)
    adapters, lora, got = work / "adapters", None, {}
    try:
        big = _adapters(cfg, (0,), r=16)
        with pytest.raises(
            ValueError, match="rank 16 is above the SGLang server's max_lora_rank 8"
        ):
            LoraSync(big[0], _params(big[1][0]), server=server.base,
                     control=trainer.control_address, replica=0, secret=SECRET)  # fmt: skip
        lora = LoraSync(
            config, _params(versions[1]), server=server.base, root=adapters, keep=2,
            control=trainer.control_address, replica=0, secret=SECRET, block_bytes=BB,
            pool_bytes=8 << 20,
        )  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            for v in (1, 2, 3, 4):
                pulled = pool.submit(lora.update, 120, v)
                trainer.wait_for_samplers(1, timeout=60)
                rep = trainer.publish(v, versions[v])
                if v == 2:
                    why = "SGLang did not load adapter version 2: RuntimeError: SGLang server"
                    assert rep.committed == [] and why in rep.failed["0:0"], rep.failed
                    with pytest.raises(UpdateRejectedError, match="still serving version 1"):
                        pulled.result(120)
                    assert not (lora.dir / "tpusync-lora-v2").exists()
                    assert "tpusync-lora-v2" not in _models(server)
                    assert _outputs(server, "tpusync-lora-v1") == got[1]
                    continue
                assert rep.ok, rep.failed
                served = pulled.result(120)
                assert served.name == f"tpusync-lora-v{v}" and lora.version == v
                got[v] = _outputs(server, served.name)
                assert got[v] == refs[v], (v, server.tail())
    finally:
        if lora is not None:
            lora.close()
        trainer.close()
    # keep=2: version 4 unloaded version 1; version 3 is still served as it was.
    assert {"tpusync-lora-v3", "tpusync-lora-v4"} <= _models(server)
    assert "tpusync-lora-v1" not in _models(server)
    assert sorted(p.name for p in lora.dir.iterdir()) == ["tpusync-lora-v3", "tpusync-lora-v4"]
    with pytest.raises(urllib.error.HTTPError):
        _outputs(server, "tpusync-lora-v1")
    assert _outputs(server, "tpusync-lora-v3") == refs[3]


class _StubServer(ThreadingHTTPServer):
    """Answers ``/server_info`` with ``info``: SGLang settings this machine cannot run."""

    def __init__(self, info: dict) -> None:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                body = json.dumps(stub.info if self.path == "/server_info" else {}).encode()
                self.send_response(200 if self.path == "/server_info" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.info = info
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.mark.parametrize(
    "info, why",
    [
        ({"enable_lora": False, "max_lora_rank": None, "dp_size": 1}, "runs without LoRA"),
        ({"enable_lora": True, "max_lora_rank": 8, "dp_size": 2}, "runs 2 data-parallel replicas"),
        # LoRA on through --lora-paths alone, settings nested under server_args
        (
            {"server_args": {"enable_lora": None, "lora_paths": {"a": "/a"}, "max_lora_rank": 4}},
            "rank 8 is above the SGLang server's max_lora_rank 4",
        ),
    ],
    ids=["lora-off", "dp2", "lora-paths-rank"],
)
def test_server_that_cannot_serve_the_adapter_is_refused_before_anything_moves(info, why):
    config, tensors = _adapters(TOY, (0,))
    stub = _StubServer(info)
    try:
        # No trainer listens at control: a refusal must come before the sampler contacts it.
        with pytest.raises(ValueError, match=why):
            LoraSync(config, _params(tensors[0]), server=stub.url, control="127.0.0.1:1",
                     replica=0)  # fmt: skip
    finally:
        stub.shutdown()
        stub.server_close()
