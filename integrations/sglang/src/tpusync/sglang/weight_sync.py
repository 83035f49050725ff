"""RL weight sync into a running SGLang server: the client side (an RL driver's calls).

A rollout SGLang server started with ``--custom-weight-loader tpusync.sglang.weight_loader.load``
(:data:`LOADER`) and ``$TPUSYNC_AUTH_SECRET`` in its environment becomes a tpusync-rl sampler:

    from tpusync.rl.vllm import checkpoint_params
    from tpusync.sglang import weight_sync

    weight_sync.init_server(url, control=trainer_control_address, replica=0,
                            params=checkpoint_params(model_dir))
    # trainer: TrainerSync(0, 1, None, ...).publish(version, state_dict) in its own process
    weight_sync.update_server(url, timeout=60)   # raises if the version was not loaded
    # ... rollouts on the new weights ...

Each call is SGLang's weight-update session (``/begin_weight_update``,
``/update_weights_from_tensor`` with ``load_format=LOADER`` and one tpusync request, REQUEST
CONTRACT in :mod:`tpusync.sglang.weight_request`, ``/end_weight_update``) plus the loader's
outcome, which comes back as a signed message to a :class:`~tpusync.rl.control.ControlServer`
this call opens for the length of the request (NEVER-RAISE CONTRACT in
:mod:`tpusync.sglang.weight_loader`: SGLang's own answer says "Success" whatever the loader
found). ``reply_host`` is the address the server's processes reach this process at (default
127.0.0.1: a server on this host).

SERVER UPDATE CONTRACT: SGLang applies the update once in-flight requests ended and holds new
ones back meanwhile, so no request sees two versions; after a loaded version it drops its radix
cache (KV computed with the old weights; SGLang's ``flush_cache``) and this call records the
version as the server's weight version (``/update_weight_version``: ``weight_version`` in
``/model_info``). A version that did not load raises (:class:`UpdateRejectedError` or
TimeoutError) and the server serves the weights it had. Every wait is bounded: ``timeout`` for
the pull, plus ``slack_s`` for the HTTP round trips and the load.
"""

from __future__ import annotations

import json
import os
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from tpusync.sglang.weight_request import encode

LOADER = "tpusync.sglang.weight_loader.load"
SLACK_S = 120.0
# TARGET RULE: every call names SGLang's target model runner only. SGLang's default ("all") also
# runs the loader for each speculative-decoding draft runner of the server, and a second run of
# one request waited for the version after the one the target took, then loaded that into the
# draft model (committed, so the target never got it). The trainer's weights are the target
# model's; draft weights are not synced.
_SELECTOR = {"selector": "target"}
# How long a refused update call waits for the loader's outcome that SGLang's refusal came
# after (SGLang sends its answer once the loader returned, so the outcome is normally there).
_OUTCOME_AFTER_ERROR_S = 10.0

__all__ = [
    "LOADER",
    "ServerSetup",
    "UpdateRejectedError",
    "close_server",
    "init_server",
    "update_server",
]


@dataclass(frozen=True)
class ServerSetup:
    """What :func:`init_server` set up (SLICE CONTRACT in :mod:`tpusync.sglang.weight_loader`).

    ``sharded``: some checkpoint tensors are split over the tensor-parallel ranks (each pulls
    only its part). ``whole``: ``{checkpoint name: why}`` for each tensor every rank pulls whole
    because the dry run of the model's ``load_weights`` could not tell its part (empty for
    SGLang's dense Llama / Qwen models; tensors every rank keeps whole, such as norms, are not
    listed). ``unwritten``: ``{model parameter: what of it}`` that the trainer's tensors leave
    unwritten, so that it keeps the values it had before every update; only with
    ``partial=True`` (COVERAGE RULE in :mod:`tpusync.sglang.weight_slices`), empty otherwise."""

    sharded: bool
    whole: dict[str, str] = field(default_factory=dict)
    unwritten: dict[str, str] = field(default_factory=dict)


class UpdateRejectedError(RuntimeError):
    """The server did not load the version (digest mismatch, version skew, a trainer died, ...);
    it serves the weights it had."""


@dataclass(frozen=True)
class _Keys:
    """SGLang's keys (KEYS RULE): ``--admin-api-key`` guards the weight-update endpoints when the
    server has one, else ``--api-key``; ``--api-key`` guards the others (``/server_info``)."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def header(self, admin: bool) -> dict[str, str]:
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def _http(
    base: str, path: str, body: Any = None, timeout: float = 60.0, keys: _Keys = _Keys()
) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        base + path,
        data=data,
        headers={"Content-Type": "application/json", **keys.header(path != "/server_info")},
        method="POST" if body is not None else "GET",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        if e.code in (401, 403):
            detail += " (a server started with --api-key or --admin-api-key wants that key: "
            detail += "pass api_key= or admin_api_key=)"
        raise RuntimeError(f"SGLang server {base}{path}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ConnectionError(f"SGLang server {base}{path}: {getattr(e, 'reason', e)}") from None
    return json.loads(raw) if raw else None


def _tp_size(base: str, keys: _Keys) -> int:
    info = _http(base, "/server_info", keys=keys)
    args = info.get("server_args") if isinstance(info.get("server_args"), dict) else {}
    return int(info.get("tp_size") or args.get("tp_size") or 1)


def _call(url: str, body: dict, wait_s: float, flush: bool, reply_host: str, keys: _Keys) -> dict:
    """One request through SGLang's weight-update session; the loader's outcome."""
    from tpusync.core.pd import load_secret
    from tpusync.rl.control import ControlServer

    base = url.rstrip("/")
    outcomes: queue.Queue = queue.Queue()
    token = os.urandom(16).hex()

    def handler(msg: dict, _answer) -> dict:
        if msg.get("op") == "outcome" and msg.get("token") == token:
            outcomes.put(msg)
        return {"op": "ok"}

    server = ControlServer(load_secret(), handler, listen=f"tcp://{reply_host}:0")
    try:
        request = {**body, "reply": server.address, "token": token}
        payload = encode(request, _tp_size(base, keys))
        _http(base, "/begin_weight_update", dict(_SELECTOR), keys=keys)
        try:
            reply = _http(
                base,
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": payload,
                    "load_format": LOADER,
                    "flush_cache": flush,
                    **_SELECTOR,
                },
                timeout=wait_s,
                keys=keys,
            )
        except Exception as e:
            try:  # close SGLang's session; the update's own error is what the caller sees
                _http(base, "/end_weight_update", {}, keys=keys)
            except (RuntimeError, ConnectionError):
                pass
            if not isinstance(e, RuntimeError):
                raise
            # REFUSED AFTER LOAD RULE: SGLang answers an error status also when the loader ran
            # and something after it failed (its cache flush refused while requests run); the
            # loader's outcome then says what the server holds now, and the caller must know.
            try:
                outcome = outcomes.get(timeout=_OUTCOME_AFTER_ERROR_S)
            except queue.Empty:
                raise e from None
            outcome["sglang_error"] = str(e)
            return outcome
        _http(base, "/end_weight_update", {}, keys=keys)
        try:
            outcome = outcomes.get(timeout=SLACK_S)
        except queue.Empty:
            raise TimeoutError(
                f"SGLang server {base} answered {reply!r} but its tpusync loader sent no outcome "
                f"within {SLACK_S:.0f} s (started with --custom-weight-loader {LOADER} and "
                "$TPUSYNC_AUTH_SECRET? can it reach this process at "
                f"{server.address}?)"
            ) from None
        outcome["sglang"] = reply
        return outcome
    finally:
        server.close()


def init_server(
    url: str,
    *,
    control: str,
    replica: int,
    params: dict[str, Any],
    dtype: str | None = None,
    sharded: bool = True,
    partial: bool = False,
    reply_host: str = "127.0.0.1",
    timeout: float = SLACK_S,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    **options: Any,
) -> ServerSetup:
    """Make the SGLang server at ``url`` sampler replica ``replica`` of the trainers whose rank 0
    listens on ``control``. ``params``: ``{checkpoint name: [shape, dtype]}`` the trainer
    publishes (:func:`tpusync.rl.vllm.checkpoint_params` of the model directory); ``dtype``:
    the staging dtype (default: the model's); ``options``: :class:`~tpusync.rl.sampler.SamplerSync`
    options (``block_bytes``, ``pool_bytes``, ``streams``, ``window``, ``listen``,
    ``same_host``). ``sharded``: each tensor-parallel rank receives only the part of each tensor
    its ``load_weights`` keeps (SLICE CONTRACT in :mod:`tpusync.sglang.weight_loader`); the
    :class:`ServerSetup` says what was split. ``partial``: the trainer publishes only some of
    the model's parameters (those it trains); without it, ``init`` is refused when the trainer's
    tensors would leave any parameter of the server's model partly or wholly unwritten (COVERAGE
    RULE in :mod:`tpusync.sglang.weight_slices`; checked with ``sharded`` only). ``api_key`` /
    ``admin_api_key``: the server's ``--api-key`` / ``--admin-api-key``, where it has them (KEYS
    RULE). Raises RuntimeError with
    every rank's reason when a rank could not open (none stays open then), which with ``sharded``
    includes a trainer whose names or shapes do not fit the server's model (SHAPE CHECK RULE in
    :mod:`tpusync.sglang.weight_loader`)."""
    body = {
        "kind": "init",
        "control": control,
        "replica": int(replica),
        "params": {str(k): [list(v[0]), str(v[1])] for k, v in params.items()},
        "dtype": dtype,
        "sharded": bool(sharded),
        "partial": bool(partial),
        "options": options,
    }
    keys = _Keys(api_key, admin_api_key)
    outcome = _call(url, body, timeout, flush=False, reply_host=reply_host, keys=keys)
    if not outcome.get("ok"):
        raise RuntimeError(f"tpusync weight sync not set up on {url}: {outcome.get('failure')}")
    if outcome.get("sglang_error"):  # REFUSED AFTER LOAD RULE: the samplers are open
        raise RuntimeError(
            f"tpusync weight sync set up on {url} (close_server ends it), but: "
            f"{outcome['sglang_error']}"
        )
    return ServerSetup(
        bool(outcome.get("sharded")),
        dict(outcome.get("whole") or {}),
        dict(outcome.get("unwritten") or {}),
    )


def update_server(
    url: str,
    timeout: float,
    version: int | None = None,
    *,
    reply_host: str = "127.0.0.1",
    slack_s: float = SLACK_S,
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> int:
    """Pull the next version (at least ``version``) into the server and load it; returns the
    version it now serves (SERVER UPDATE CONTRACT). TimeoutError when no newer version was
    announced within ``timeout`` s, :class:`UpdateRejectedError` when it was not loaded. Keys:
    as for :func:`init_server`."""
    body = {"kind": "update", "timeout": float(timeout), "version": version}
    keys = _Keys(api_key, admin_api_key)
    outcome = _call(url, body, float(timeout) + slack_s, True, reply_host, keys)
    if not outcome.get("ok"):
        why = outcome.get("failure")
        # The version the server loaded last; 0: none yet, it serves its checkpoint.
        serving = f"version {outcome['serving']}" if outcome.get("serving") else "its checkpoint"
        if outcome.get("timed_out"):
            raise TimeoutError(f"no new version reached {url}: {why}; still serving {serving}")
        raise UpdateRejectedError(f"update not loaded on {url}: {why}; still serving {serving}")
    # The version is loaded and committed: record it as the server's weight version even when
    # SGLang reported a failure after the load (REFUSED AFTER LOAD RULE), then raise that.
    new = {"new_version": str(outcome["version"])}
    _http(url.rstrip("/"), "/update_weight_version", new, keys=keys)
    sglang = outcome.get("sglang") or {}
    after = outcome.get("sglang_error")
    if after is None and isinstance(sglang, dict) and sglang.get("success") is False:
        after = str(sglang)
    if after is not None:
        raise RuntimeError(
            f"version {outcome['version']} loaded on {url} and recorded as its weight_version, "
            f"but: {after}"
        )
    return int(outcome["version"])


def close_server(
    url: str,
    *,
    reply_host: str = "127.0.0.1",
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> None:
    """Close the server's samplers (it keeps serving the weights it has). Keys: as for
    :func:`init_server`."""
    keys = _Keys(api_key, admin_api_key)
    _call(url, {"kind": "close"}, SLACK_S, flush=False, reply_host=reply_host, keys=keys)
