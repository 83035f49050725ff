"""The request a client sends through SGLang's ``/update_weights_from_tensor`` to tpusync's loader.

REQUEST CONTRACT: SGLang hands a custom weight loader only ``(model, named_tensors)``, decoded
from ``serialized_named_tensors`` (one payload per tensor-parallel rank). A tpusync request is
exactly one named tensor: its name is :data:`PREFIX` followed by a JSON object (the request), its
value an empty CPU tensor (SGLang moves every value to the device before it calls the loader, so
the value must be a tensor; an empty one pickles to no data and passes SGLang's restricted
unpickler). The body always has ``kind`` (``"init"``, ``"update"`` or ``"close"``), ``reply`` (the
address of the client's :class:`~tpusync.rl.control.ControlServer` that receives the outcome) and
``token`` (echoed in the outcome, so a late outcome of an earlier request is never taken for this
one's). Importing this module needs torch, not SGLang.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

PREFIX = "tpusync.sglang.weights:"
KINDS = ("init", "update", "close")


def encode(body: dict[str, Any], ranks: int) -> list[str]:
    """``serialized_named_tensors`` for ``ranks`` tensor-parallel ranks (the same request each)."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

    if body.get("kind") not in KINDS:
        raise ValueError(f"request kind must be one of {KINDS}, not {body.get('kind')!r}")
    buf = io.BytesIO()
    ForkingPickler(buf).dump([(PREFIX + json.dumps(body), torch.empty(0))])
    payload = base64.b64encode(buf.getvalue()).decode()
    return [payload] * ranks


def decode(named_tensors: list) -> dict[str, Any]:
    """The request in ``named_tensors`` (what SGLang passed the loader); ValueError if it is not
    exactly one well-formed tpusync request."""
    if len(named_tensors) != 1:
        raise ValueError(
            f"a tpusync weight request is one named tensor, not {len(named_tensors)}: "
            "send it with tpusync.sglang.weight_sync, not real tensors"
        )
    name = named_tensors[0][0]
    if not isinstance(name, str) or not name.startswith(PREFIX):
        raise ValueError(f"not a tpusync weight request: {str(name)[:80]!r}")
    try:
        body = json.loads(name[len(PREFIX) :])
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed tpusync weight request: {e}") from None
    if not isinstance(body, dict) or body.get("kind") not in KINDS:
        raise ValueError(f"tpusync weight request without a known kind: {str(body)[:200]}")
    if not isinstance(body.get("reply"), str) or not isinstance(body.get("token"), str):
        raise ValueError("tpusync weight request without its reply address and token")
    return body
