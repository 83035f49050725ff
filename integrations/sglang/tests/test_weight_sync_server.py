"""RL weight sync into a LIVE SGLang server (real processes, real HTTP, real sockets).

Server A serves a tiny model with ``--custom-weight-loader tpusync.sglang.weight_loader.load``.
The "trained" version is the same model with perturbed weights, in a second model directory; A
itself gives the reference outputs of each weight set first, through SGLang's own
``/update_weights_from_disk`` (the perturbed directory, then its own again). This process is the
trainer (``TrainerSync``, samplers report their layouts).

The tiny Llama servers (TP=1 and TP=2) run the whole scenario:

1. Version 1 = the perturbed weights, whose load fails half way (a fault injected in rank 0's
   ``load_weights``, ``support/weight_faults.py``): the server reads its checkpoint again, its
   outputs are its own from before, and the trainer counts no rank committed (LOAD FAILURE
   RULE of the loader).
2. Version 2 = the perturbed weights: A's greedy outputs equal the reference (and differ from A's
   own before, so the comparison can fail).
3. Faults: an update with nothing published times out and A keeps serving; asking for a version
   A already has is refused; version 3, damaged in transit (one flipped byte after the trainer
   took its checksum), is rejected and A keeps serving version 2.
4. Version 4 (the original weights), posted while a streamed generation is in flight: the
   generation ends with the tokens version 2 gave it alone (SERVER UPDATE CONTRACT), and A's
   outputs are its first ones again.
5. Version 5's load fails the same way and every rank loads version 4 again; version 6 then
   loads.
6. TP=2 only: a new trainer session whose ranks take whole tensors (``sharded=False``), version 7.

The other families (TP=2: Qwen2, Qwen3, Qwen3 MoE, a Phi-3 and a GLM-4 whose fused gate/up
tensors the trainer splits, FUSED SPLIT RULE) run what depends on the model's loaders: the shape
and coverage refusals, version 2 and version 4 (nothing in flight). Qwen2 and Qwen3 are extended
tests (``TPUSYNC_EXTENDED_TESTS=1``). The faults of steps 1, 3 and
5 do not depend on the model; the Llama cases cover them.

The server's weight version follows every loaded version. At TP=2 the ranks pull only their
slices of each tensor (SLICE CONTRACT of the loader), or with ``sharded=False`` whole tensors
each; the trainer's byte count tells which happened, and every sliced server's dry run must tell
every tensor's part (``ServerSetup.whole`` empty), but for a Phi-3's fused q/k/v and gate/up
tensors published as they are: those go whole to every rank, the setup saying why.
The TP=1 server guards its weight-update endpoints with ``--admin-api-key``: without the key
``init_server`` fails with SGLang's 401 and says which key to pass; every call after that passes
it (KEYS RULE of ``weight_sync``).

CPU only through the TEST-ONLY server shim (``support/live_server.py``, LIVE SERVER CONTRACT).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import tiny_model
import torch
import weight_faults
from live_server import http, launch, model_modules_except

from tpusync.rl import TrainerSync
from tpusync.rl.fused import split_fused
from tpusync.rl.vllm import checkpoint_params
from tpusync.sglang import weight_sync
from tpusync.sglang.weight_sync import UpdateRejectedError

SECRET = "tpusync-sglang-weight-sync-test-secret"
ADMIN_KEY = "tpusync-sglang-admin-key"
PROMPTS = [[ord(c) for c in "the cache page block host"], [ord(c) for c in "tpusync moves weights"]]


class DamagingTrainer(TrainerSync):
    """Fault injection: flips one byte of the first block of version ``damaged`` that goes to
    the last sampler rank, after its checksum was taken (the other ranks get it intact)."""

    last_rank = 0
    damaged = 3

    def _fill(self, block, plan, index, version, *a):
        checksum = super()._fill(block, plan, index, version, *a)
        if version == self.damaged and index == 0 and plan.dst == self.last_rank:
            self._ep.pool.view(block)[0] ^= 0xFF
        return checksum


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (st,) = sorted(model_dir.glob("*.safetensors"))
    return load_file(st)


def _perturbed(model_dir: Path, dst: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    shutil.copytree(model_dir, dst)
    (st,) = sorted(dst.glob("*.safetensors"))
    g = torch.Generator().manual_seed(99)
    new = {
        n: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype).contiguous()
        for n, t in _weights(model_dir).items()
    }
    save_file(new, st, metadata={"format": "pt"})
    return new


# Tiny random models besides the tiny Llama: transformers class prefix and config beyond the
# shared one below.
OTHERS = {
    "qwen2": ("Qwen2", {}),  # biased q/k/v projections: SGLang's Qwen2ForCausalLM
    "qwen3": ("Qwen3", {"head_dim": 16}),  # q/k norms, no biases: Qwen3ForCausalLM
    "qwen3_moe": (  # 4 experts, 2 per token, in every layer: Qwen3MoeForCausalLM
        "Qwen3Moe",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128},
    ),
    # q / k / v fused into one qkv_proj tensor, gate / up into gate_up_proj: SGLang's
    # Phi3ForCausalLM (in its llama module)
    "phi3": ("Phi3", {"original_max_position_embeddings": 512}),
    # gate / up fused into gate_up_proj, biased q / k / v, half-rotary heads, two extra norms per
    # layer: SGLang's Glm4ForCausalLM
    "glm4": ("Glm4", {"head_dim": 16}),
}


def _other(arch: str, llama: Path, dst: Path) -> Path:
    """A tiny random model of ``arch`` (:data:`OTHERS`) with the tiny Llama's byte-level
    tokenizer."""
    import transformers
    from transformers import AutoTokenizer

    from tpusync.core.tinymodel import tiny_model_of

    prefix, extra = OTHERS[arch]
    tok = AutoTokenizer.from_pretrained(llama)
    tiny_model_of(
        dst,
        getattr(transformers, f"{prefix}ForCausalLM"),
        getattr(transformers, f"{prefix}Config"),
        **extra,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.unk_token_id,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama / name, dst / name)
    return dst


CASES = {  # id: (tensor-parallel size, architecture)
    "tp1": (1, "llama"),
    "tp2": (2, "llama"),
    "tp2-qwen2": (2, "qwen2"),
    "tp2-qwen3": (2, "qwen3"),
    "tp2-qwen3-moe": (2, "qwen3_moe"),
    # The trainer publishes the checkpoint's fused tensors as they are, or split (FUSED SPLIT
    # RULE; Phi-3's split parts load through the Llama loader the tiny Llama cases test).
    "tp2-phi3": (2, "phi3"),
    "tp2-glm4-split": (2, "glm4-split"),
}
# Extended tests (conftest.py; about 45 s each here): GLM-4 has Qwen2's biased q / k / v, the
# Qwen3 MoE has Qwen3's q / k norms, and CI runs both.
EXTENDED = {"tp2-qwen2", "tp2-qwen3"}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(case, marks=pytest.mark.extended) if name in EXTENDED else case
        for name, case in CASES.items()
    ],
    ids=list(CASES),
)
def server(request, tmp_path_factory):
    """(A, A's model directory, the perturbed weights' directory and tensors, A's
    tensor-parallel size, A's SGLang keys, the architecture). A at TP=2 runs two scheduler
    processes, one per core (SGLANG_CPU_OMP_THREADS_BIND)."""
    tp, arch = request.param
    root = Path(os.environ.get("TPUSYNC_REPO_ROOT", Path(__file__).resolve().parents[3]))
    model = tiny_model.ensure(root)
    work = tmp_path_factory.mktemp(f"sglang-weights-tp{tp}-{arch}")
    env = {"TPUSYNC_AUTH_SECRET": SECRET}
    family = arch.removesuffix("-split")
    if family != "llama":
        model = _other(family, model, work / family)
        keep = ("llama", "qwen2", family) if family != "phi3" else ("llama", "qwen2")
        env["SGLANG_DISABLED_MODEL_ARCHS"] = model_modules_except(*keep)
    new_dir = work / "trained"
    new = _perturbed(model, new_dir)
    args = ["--custom-weight-loader", weight_sync.LOADER, weight_faults.BREAK_NEXT_LOAD]
    # KEYS RULE: the TP=1 server guards its weight-update endpoints with an admin key.
    keys = {"admin_api_key": ADMIN_KEY} if tp == 1 else {}
    args += ["--admin-api-key", ADMIN_KEY] if keys else []
    if tp > 1:
        args += ["--tp-size", str(tp)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"
    a = launch(model, work / "a.log", args, env=env)
    try:
        a.wait_ready()
        yield a, model, new_dir, new, tp, keys, arch
    finally:
        a.stop()


def _outputs(server) -> list[list[int]]:
    return [server.generate(p, max_new_tokens=12)["output_ids"] for p in PROMPTS]


LONG_TOKENS = 32  # 3-5 s of decoding on the CPU servers (7-10 tokens/s): the update lands inside


def _long(server, started: threading.Event | None = None) -> list[int]:
    """A long greedy generation that runs to LONG_TOKENS (the end-of-sequence token ignored),
    streamed: ``started`` is set once its first tokens arrived, so it is in flight then."""
    req = urllib.request.Request(
        f"{server.base}/generate",
        data=json.dumps(
            {
                "input_ids": PROMPTS[1],
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": LONG_TOKENS,
                    "ignore_eos": True,
                },
                "stream": True,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    chunks = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunks.append(json.loads(line[5:])["output_ids"])
            if started is not None:
                started.set()
    # SGLang streams either every token so far or only the new ones in each chunk.
    out = chunks[-1] if len(chunks[-1]) == LONG_TOKENS else [t for c in chunks for t in c]
    assert len(out) == LONG_TOKENS, [len(c) for c in chunks]
    return out


def _weight_version(server) -> str:
    _status, body = http(f"{server.base}/model_info")
    return json.loads(body)["weight_version"]


def _auth(keys: dict) -> dict[str, str]:
    """The header SGLang's admin endpoints want from the test's keys (none at TP=2)."""
    return {"Authorization": f"Bearer {keys['admin_api_key']}"} if keys else {}


def _outputs_of(server, model_dir: Path, keys: dict) -> list[list[int]]:
    """The server's outputs on the weights of ``model_dir``, loaded by SGLang's own
    ``/update_weights_from_disk`` (no tpusync on that path): the reference for a version."""
    payload = {"model_path": str(model_dir)}
    _status, body = http(f"{server.base}/update_weights_from_disk", payload, headers=_auth(keys))
    assert json.loads(body)["success"], server.tail()
    return _outputs(server)


def _publish_and_update(trainer, version, tensors, url, tp, keys, timeout=120.0, fails=None):
    """The server's update (its samplers join the trainer with their first poll), then the
    trainer's publish of ``version``: (the version the server serves, the trainer's report);
    with ``fails`` = (error class, pattern) the update must raise that: (it, the report)."""
    with ThreadPoolExecutor(1) as pool:
        update = pool.submit(weight_sync.update_server, url, timeout=timeout, **keys)
        trainer.wait_for_samplers(tp, timeout=60)
        report = trainer.publish(version, tensors)
        if fails is None:
            return update.result(timeout=timeout + 180), report
        with pytest.raises(fails[0], match=fails[1]) as raised:
            update.result(timeout=timeout + 180)
        return raised.value, report


def _load_fails(trainer, version, tensors, a, tp, keys, served):
    """LOAD FAILURE RULE: rank 0's load of ``version`` raises half way (fault injected); every
    rank loads ``served`` again ("its checkpoint" or "version N"), the server says so, and the
    trainer counts no rank committed."""
    weight_faults.arm(a.base, tp, _auth(keys))
    loaded = f"version {version} verified but load_weights failed \\(rank 0: RuntimeError: injected"
    error, report = _publish_and_update(
        trainer, version, tensors, a.base, tp, keys, fails=(UpdateRejectedError, loaded)
    )
    assert f"every rank loaded {served} again and serves it; still serving {served}" in str(error)
    assert report.committed == [] and sorted(report.failed) == [f"0:{r}" for r in range(tp)]
    assert all("load_weights failed" in why for why in report.failed.values()), report


def test_a_running_server_takes_each_version_and_keeps_serving_through_faults(server, monkeypatch):
    a, model_dir, new_dir, new, tp, keys, arch = server
    full = arch == "llama"  # the whole scenario; the other families, what depends on the model
    # FUSED SPLIT RULE: a Phi-3 or GLM-4 trainer may publish its fused tensors split.
    publishable = (lambda t: split_fused(t, model_dir)) if arch.endswith("-split") else dict
    fused = [n for n in new if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]
    assert bool(fused) == arch.startswith(("phi3", "glm4"))
    new = publishable(new)
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    before = _outputs(a)
    reference = _outputs_of(a, new_dir, keys)
    assert _outputs_of(a, model_dir, keys) == before
    assert before != reference  # the perturbed weights change greedy outputs: the check can fail
    # Small blocks: bytes_sent counts whole blocks.
    small = {"block_bytes": 1 << 13, "pool_bytes": 16 << 20}
    trainer = DamagingTrainer(
        0, 1, None, secret=SECRET.encode(), control="tcp://127.0.0.1:0", deadline=60.0, **small
    )
    trainer.last_rank = tp - 1
    first_weight_version = _weight_version(a)
    init = dict(
        control=trainer.control_address,
        replica=0,
        params=publishable(checkpoint_params(model_dir)),
        **small,
    )
    with _session(a.base, trainer, keys):
        _refuses_other_models(a.base, init, keys)
        if keys:  # without the key SGLang refuses the session, and says which key it wants
            with pytest.raises(RuntimeError, match=r"HTTP 401.*pass api_key= or admin_api_key="):
                weight_sync.init_server(a.base, **init)
        setup = weight_sync.init_server(a.base, **init, **keys)
        # SLICE CONTRACT: the dry run of SGLang's own load_weights tells every tensor's part.
        assert setup.sharded == (tp > 1), setup
        # Published as they are, Phi-3's fused tensors go whole to every rank: a rank's rows of
        # q, k and v (of gate and up) are not one box of the fused tensor, and the smallest box
        # around them overlaps the other ranks' (the setup says so). Split, they are cut.
        whole = sorted(fused) if arch == "phi3" and setup.sharded else []
        assert sorted(setup.whole) == whole, setup
        assert all("the ranks' parts do not tile it" in why for why in setup.whole.values())
        assert setup.unwritten == {}, setup  # COVERAGE RULE: SGLang's loaders write every part

        if full:  # LOAD FAILURE RULE before any tpusync version: the checkpoint is read again
            _load_fails(trainer, 1, new, a, tp, keys, "its checkpoint")
            assert _outputs(a) == before and _weight_version(a) == first_weight_version

        version, report = _publish_and_update(trainer, 2, new, a.base, tp, keys)
        assert version == 2 and report.ok, report
        # One sampler rank per scheduler process.
        assert sorted(report.committed) == [f"0:{r}" for r in range(tp)], report
        _assert_copies(report, new, tp, setup.sharded, whole, arch)
        assert _outputs(a) == reference
        assert _weight_version(a) == "2"

        original = publishable(_weights(model_dir))
        if not full:
            version, report = _publish_and_update(trainer, 4, original, a.base, tp, keys)
            assert version == 4 and report.ok, report
            assert _outputs(a) == before and _weight_version(a) == "4"
            return

        with pytest.raises(TimeoutError, match="no new version"):
            weight_sync.update_server(a.base, timeout=2, **keys)
        with pytest.raises(UpdateRejectedError, match="already took 2"):
            weight_sync.update_server(a.base, timeout=2, version=2, **keys)
        assert _outputs(a) == reference

        with pytest.raises(UpdateRejectedError, match="checksum") as rejected:
            _publish_and_update(trainer, 3, original, a.base, tp, keys)
        assert "still serving version 2" in str(rejected.value)
        # ENGINE OUTCOME CONTRACT: at TP=2 only rank 1 got the damaged block; rank 0 verified
        # the version and still did not load it (the outputs below are version 2's).
        assert f"rank {tp - 1}: version 3 rejected" in str(rejected.value)
        assert _outputs(a) == reference and _weight_version(a) == "2"

        # SERVER UPDATE CONTRACT: a request in flight when the update arrives ends on the
        # version it started on (SGLang holds the update until it ended), all of its tokens.
        long_v1 = _long(a)
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(_long, a, started)
            assert started.wait(60), "the long request sent no tokens"
            version, report = _publish_and_update(trainer, 4, original, a.base, tp, keys)
            assert in_flight.result(timeout=120) == long_v1
        assert version == 4 and report.ok, report
        assert _outputs(a) == before and _weight_version(a) == "4"
        assert _long(a) != long_v1  # version 4 writes other tokens: the check above can fail

        # LOAD FAILURE RULE after a version: every rank loads version 4 again, then takes 6.
        _load_fails(trainer, 5, new, a, tp, keys, "version 4")
        assert _outputs(a) == before and _weight_version(a) == "4"
        version, report = _publish_and_update(trainer, 6, new, a.base, tp, keys)
        assert version == 6 and report.ok, report
        assert _outputs(a) == reference and _weight_version(a) == "6"
    if tp > 1:  # a new session whose ranks each take every tensor whole (sharded=False)
        trainer = TrainerSync(
            0, 1, None, secret=SECRET.encode(), control="tcp://127.0.0.1:0", deadline=60.0, **small
        )
        with _session(a.base, trainer, keys):
            init["control"] = trainer.control_address
            setup = weight_sync.init_server(a.base, **init, sharded=False, **keys)
            assert not setup.sharded, setup
            version, report = _publish_and_update(trainer, 7, original, a.base, tp, keys)
            assert version == 7 and report.ok, report
            _assert_copies(report, original, tp, False, [], arch)
            assert _outputs(a) == before and _weight_version(a) == "7"


@contextmanager
def _session(url: str, trainer: TrainerSync, keys: dict) -> Iterator[None]:
    """Closes the server's samplers, then the trainer, whatever failed inside."""
    try:
        yield
    finally:
        try:
            weight_sync.close_server(url, **keys)
        finally:
            trainer.close()


def _refuses_other_models(url: str, init: dict, keys: dict) -> None:
    """SHAPE CHECK RULE: another model's tensors are refused before a byte moves. COVERAGE RULE:
    a trainer that leaves the final norm out would leave it at the old version: refused, unless
    it says it publishes only part of the model. So is one that leaves out the k projection,
    which is only some rows of a stacked parameter."""
    params = init["params"]
    # (The fused Phi-3 checkpoint has no q / k projection of its own.)
    q = next((n for n in params if n.endswith("layers.0.self_attn.q_proj.weight")), "")
    norm = next(n for n in params if n.endswith("model.norm.weight"))
    if q:
        for factor, why in ((2, "reads only"), (0.5, "cannot take these tensors")):
            (rows, cols), dtype = params[q]
            other = {**params, q: [[int(rows * factor), cols], dtype]}
            with pytest.raises(RuntimeError, match=why):
                weight_sync.init_server(url, **{**init, "params": other}, **keys)
        no_k = {n: v for n, v in params.items() if n != q.replace("q_proj", "k_proj")}
        qkv = r"layers\.0\.self_attn\.qkv_proj\.weight: \d+ of its \d+ elements"
        with pytest.raises(RuntimeError, match=rf"leave 1 of the server's parameters .*{qkv}"):
            weight_sync.init_server(url, **{**init, "params": no_k}, **keys)
    left_out = {n: v for n, v in params.items() if n != norm}
    unwritten = rf"leave 1 of the server's parameters .*{re.escape(norm)}: all of \("
    with pytest.raises(RuntimeError, match=unwritten):
        weight_sync.init_server(url, **{**init, "params": left_out}, **keys)
    part = weight_sync.init_server(url, **{**init, "params": left_out}, partial=True, **keys)
    assert part.unwritten == {norm: f"rank 0: all of ({params[norm][0][0]},)"}, part
    weight_sync.close_server(url, **keys)


def _assert_copies(report, tensors: dict, tp: int, sliced: bool, whole: list, arch: str) -> None:
    """SLICE CONTRACT: sliced, a TP=2 server pulls about one copy of the model (the small
    replicated tensors, and the tensors in ``whole``, once more per rank), not two; whole, every
    rank pulls a copy."""
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    copies = report.bytes_sent / model_bytes
    print(f"tp={tp} {arch} sliced={sliced}: {report.bytes_sent} bytes sent, {copies:.2f} copies")
    if sliced:
        least = 1.0 + (tp - 1) * sum(tensors[n].numel() * 4 for n in whole) / model_bytes
        assert least <= copies < least + 0.3, (report.bytes_sent, model_bytes)
    else:
        assert tp <= copies < tp + 0.3, (report.bytes_sent, model_bytes)
