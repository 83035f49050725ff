"""TEST-ONLY fault injection in a live SGLang server (importable there through
``server_site/sitecustomize.py``, which puts this folder on the server processes' path).

A server started with ``--custom-weight-loader tpusync.sglang.weight_loader.load
weight_faults.break_next_load`` runs :func:`break_next_load` when a client posts
``/update_weights_from_tensor`` with ``load_format`` = :data:`BREAK_NEXT_LOAD` (:func:`arm`).
"""

from __future__ import annotations

from typing import Any

BREAK_NEXT_LOAD = "weight_faults.break_next_load"


def break_next_load(model: Any, _named_tensors: list) -> None:
    """Rank 0's next ``model.load_weights`` raises after its first 3 tensors, half way through
    a load; the loads after it are untouched (LOAD FAILURE RULE of tpusync's loader)."""
    from tpusync.sglang.weight_loader import _group

    if _group()[0] != 0:
        return
    real = model.load_weights

    def broken(weights: Any) -> Any:
        def first_three() -> Any:
            for i, item in enumerate(weights):
                if i == 3:
                    raise RuntimeError("injected fault: load_weights failed after 3 tensors")
                yield item

        del model.load_weights  # this load only
        return real(first_three())

    model.load_weights = broken


def arm(base: str, tp: int, headers: dict[str, str]) -> None:
    """Have the server at ``base`` (``tp`` ranks) run :func:`break_next_load` on every rank."""
    import json
    import urllib.request

    from tpusync.sglang.weight_request import encode

    def post(path: str, body: dict) -> bytes:
        req = urllib.request.Request(
            base + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **headers},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.read()

    # Any well-formed payload: the function ignores the tensors.
    payload = encode({"kind": "close", "reply": "", "token": ""}, tp)
    post("/begin_weight_update", {})
    try:
        post(
            "/update_weights_from_tensor",
            {"serialized_named_tensors": payload, "load_format": BREAK_NEXT_LOAD},
        )
    finally:
        post("/end_weight_update", {})
