"""vLLM sampler integration: tpusync as a backend of vLLM's weight-transfer API.

vLLM (0.32) updates a running engine's weights through a pluggable weight-transfer engine
(``WeightTransferConfig(backend=...)``) driven by four calls on the engine:
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
``finish_weight_update``. tpusync-rl registers the backend ``"tpusync"`` (a ``vllm.general_plugins``
entry point calls :func:`register` in every vLLM process); its worker-side engine
(:class:`tpusync.rl.vllm.engine.TpusyncWeightTransferEngine`) is one
:class:`~tpusync.rl.sampler.SamplerSync` per vLLM worker that pulls a version from the trainers,
verifies every digest, stages it in shadow buffers (checkpoint names and shapes) and only then
loads it into the model through vLLM's layerwise reload (``model.load_weights`` plus the
post-load processing a fresh load runs, e.g. CPU weight repacking).

ATOMICITY CONTRACT: the model is not touched until a whole version has landed and verified on
every worker of the engine (ENGINE OUTCOME CONTRACT in engine.py); a rejected or timed-out update
raises out of ``update_weights`` and the engine keeps serving the old weights, as it does when
vLLM's reload of a verified version fails half way (LOAD FAILURE RULE). The load itself
runs inside vLLM's ``update_weights`` RPC, between engine steps: with the offline ``LLM`` call
:func:`update` between ``generate`` calls; with a server, pause generation first (vLLM's
``pause_generation``) so no request sees two versions.

This module imports vLLM only inside functions: tpusync-rl does not depend on vLLM.

    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from tpusync.rl import vllm as rlvllm

    llm = LLM(model_dir, weight_transfer_config=WeightTransferConfig(backend="tpusync"))
    rlvllm.init(llm, control=trainer_control_address, replica=0,
                params=rlvllm.checkpoint_params(model_dir))
    # the trainer: TrainerSync(0, 1, None, ...): the workers report the slices they load
    while training:
        rlvllm.update(llm, timeout=60)      # raises if no new version / the update was rejected
        outputs = llm.generate(prompts, sampling_params)

A vLLM server (OpenAI API) is driven the same way over HTTP by :func:`init_server` and
:func:`update_server`. A tensor-parallel engine's workers report the slices they load to a
trainer built with ``dst_layouts=None`` (SAMPLER LAYOUTS CONTRACT); :func:`tp_layouts` plans the
same slices on the trainer, ahead of the engine, for Llama-family models.
"""

from __future__ import annotations

import json
import logging
import struct
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("tpusync.rl")

BACKEND = "tpusync"

__all__ = [
    "BACKEND",
    "checkpoint_params",
    "init",
    "init_info",
    "init_server",
    "register",
    "tp_layouts",
    "update",
    "update_server",
]


def tp_layouts(model_dir: str | Path, tp: int, params: Mapping[str, Any] | None = None) -> dict:
    """The trainer's ``dst_layouts`` for a TP=``tp`` engine (:func:`tpusync.rl.vllm.tp.tp_layouts`)."""
    from tpusync.rl.vllm.tp import tp_layouts as plan

    return plan(model_dir, tp, params)


def register() -> None:
    """Register the ``tpusync`` weight-transfer backend with vLLM (idempotent; the plugin hook)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "tpusync.rl.vllm.engine", "TpusyncWeightTransferEngine"
        )


_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def checkpoint_params(model_dir: str | Path) -> dict[str, list]:
    """``{name: [shape, dtype]}`` of every tensor in a model directory's safetensors files.

    Reads only the files' JSON headers (no tensor data): the names and shapes a trainer of this
    model publishes under (Hugging Face checkpoint names, which ``model.load_weights`` takes).
    """
    out: dict[str, list] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_dir}: not a safetensors model directory")
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{path.name}: {name} has unsupported dtype {meta['dtype']}")
            out[name] = [list(meta["shape"]), _ST_DTYPES[meta["dtype"]]]
    return out


def init_info(
    *,
    control: str,
    replica: int,
    params: Mapping[str, Any],
    dtype: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The ``init_info`` dict of ``LLM.init_weight_transfer_engine`` for the tpusync backend.

    ``control``: trainer rank 0's control address; ``replica``: this engine's sampler replica
    number (unique per engine); ``params``: ``{trainer name: [shape, dtype]}`` of what the trainer
    publishes (:func:`checkpoint_params`); ``dtype``: the staging dtype (default: the engine's).
    ``sharded`` (default True): each tensor-parallel worker receives only its slices; False:
    every worker receives whole tensors. ``partial`` (default False): the trainer publishes only
    some of the model's parameters (those it trains); without it ``init`` is refused when the
    trainer's tensors would leave any parameter unwritten (COVERAGE RULE in
    :mod:`tpusync.rl.vllm.coverage`). Sharded or not, the workers report their layouts to a
    trainer built with ``dst_layouts=None``; a trainer given ``dst_layouts`` must name the same ones
    (:func:`tp_layouts`, or ``ShardLayout.replicated(shape, range(tp))`` with ``sharded=False``). Other options go to
    :class:`~tpusync.rl.sampler.SamplerSync` (``block_bytes``, ``pool_bytes``, ``streams``,
    ``window``, ``listen``, ``same_host``). The transport secret is read from
    ``$TPUSYNC_AUTH_SECRET`` in the worker processes (inherited from the ``LLM`` process).
    """
    params = {str(k): [list(v[0]), str(v[1])] for k, v in params.items()}
    return {
        "control": control,
        "replica": int(replica),
        "params": params,
        "dtype": dtype,
        **options,
    }


def init(llm: Any, **kwargs: Any) -> None:
    """``llm.init_weight_transfer_engine`` with :func:`init_info` (``kwargs``)."""
    llm.init_weight_transfer_engine({"init_info": init_info(**kwargs)})


def update(llm: Any, timeout: float, version: int | None = None) -> None:
    """Pull the next version (or at least ``version``) into a running ``LLM`` and load it.

    Runs vLLM's start / update / finish sequence, then drops the prefix cache (its KV blocks were
    computed with the old weights), a KV connector's included (``reset_connector``: e.g.
    tpusync-vllm's offloaded blocks). Raises when no newer version was announced within
    ``timeout`` s or the update was rejected (digest mismatch, version skew, a trainer died): the
    engine then keeps serving the weights it had. Raises RuntimeError as well when the new
    weights are loaded but the caches could not be dropped (requests still running).
    """
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"timeout": float(timeout), "version": version}})
    except Exception:
        _end_session(llm.finish_weight_update)
        raise
    llm.finish_weight_update(weight_version=None if version is None else str(version))
    if not llm.reset_prefix_cache(reset_connector=True):
        raise RuntimeError(
            "new weights loaded, but vLLM could not reset its prefix cache or its KV connector's: "
            "requests may reuse KV computed with the old weights; call "
            "LLM.reset_prefix_cache(reset_connector=True) with no request running before serving"
        )


def _end_session(finish: Any) -> None:
    """After a failed ``update_weights``: end vLLM's update session on the workers that returned
    normally (ENGINE OUTCOME CONTRACT in engine.py: only the engine's last worker raised, and
    vLLM closed the session on that one only). The last worker's refusal to finish a session
    vLLM already closed is expected and dropped; the update's error is what the caller sees."""
    try:
        finish()
    except Exception:  # noqa: BLE001 - the last worker's "without a matching start_weight_update"
        pass


# A vLLM OpenAI server (``vllm.entrypoints.openai.api_server``) exposes the same weight-transfer
# calls over HTTP when started with ``VLLM_SERVER_DEV_MODE=1`` and
# ``--weight-transfer-config '{"backend": "tpusync"}'``; the two functions below drive them.
_PAUSE_MODES = ("wait", "abort", "keep")


def _post(base: str, path: str, body: Any = None, timeout: float = 60.0) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"vLLM server {base}{path}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ConnectionError(f"vLLM server {base}{path}: {getattr(e, 'reason', e)}") from None
    try:
        return json.loads(raw) if raw else None
    except ValueError:  # a route that answers in plain text (vLLM's LoRA routes)
        return raw.decode(errors="replace")


def init_server(url: str, *, timeout: float = 120.0, **kwargs: Any) -> None:
    """:func:`init` for a vLLM server at ``url`` (``http://host:port``): ``kwargs`` as
    :func:`init_info`. Raises ConnectionError / RuntimeError (with the server's reply)."""
    _post(
        url.rstrip("/"), "/init_weight_transfer_engine", {"init_info": init_info(**kwargs)}, timeout
    )


def update_server(
    url: str, timeout: float, version: int | None = None, pause: str = "wait"
) -> None:
    """:func:`update` for a vLLM server at ``url``, with generation paused around it.

    SERVER UPDATE CONTRACT: ``/pause?mode=<pause>`` first (``"wait"``, the default, lets
    in-flight requests finish on the old weights, so no request sees two versions; ``"abort"``
    aborts them; ``"keep"`` freezes them, and they resume on the new weights), then the
    start / update / finish sequence and a prefix-cache reset (the KV connector's included; a
    reset the server reports as failed raises RuntimeError, except under ``"keep"``, whose frozen
    requests hold their blocks), then ``/resume`` - always, also when the update failed, in
    which case the server serves the weights it had and this raises RuntimeError with the
    server's reply. Every request has a timeout (``timeout`` for the pull, plus a minute for the
    HTTP round trip and the load).
    """
    if pause not in _PAUSE_MODES:
        raise ValueError(f"pause must be one of {_PAUSE_MODES}, not {pause!r}")
    base, slack = url.rstrip("/"), float(timeout) + 60.0
    _post(base, f"/pause?mode={pause}", timeout=slack)
    try:
        _post(base, "/start_weight_update")
        info = {"timeout": float(timeout), "version": version}
        try:
            _post(base, "/update_weights", {"update_info": info}, timeout=slack)
        except RuntimeError:
            _end_session(lambda: _post(base, "/finish_weight_update", {"weight_version": None}))
            raise
        weight_version = None if version is None else str(version)
        _post(base, "/finish_weight_update", {"weight_version": weight_version})
        reply = _post(base, "/reset_prefix_cache?reset_external=true")
        if not (isinstance(reply, dict) and reply.get("success")):
            if pause != "keep":
                raise RuntimeError(
                    f"new weights loaded on {base}, but its prefix cache was not reset ({reply!r}): "
                    "requests may reuse KV computed with the old weights; POST "
                    "/reset_prefix_cache?reset_external=true with no request running"
                )
            # Frozen requests hold their blocks: vLLM cannot drop those (they resume on the new
            # weights with KV computed on the old ones - "keep" mode's own documented mix).
            log.warning("vLLM server %s: prefix cache kept by frozen requests (%r)", base, reply)
    finally:
        _post(base, "/resume")
