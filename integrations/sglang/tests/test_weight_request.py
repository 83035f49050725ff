"""The tpusync request inside SGLang's ``/update_weights_from_tensor`` payload (REQUEST CONTRACT)
through SGLang's own decoding (its restricted unpickler), and the loader's NEVER-RAISE CONTRACT
for input that is not a tpusync request."""

from __future__ import annotations

import logging

import pytest
import torch

from tpusync.sglang import weight_loader
from tpusync.sglang.weight_request import PREFIX, decode, encode


def _sglang_decode(payload: str) -> list:
    """What SGLang's scheduler does with one rank's payload (``deserialize_own_rank``)."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    return MultiprocessingSerializer.deserialize(payload)


def test_a_request_passes_sglangs_unpickler_and_decodes_to_itself():
    body = {"kind": "update", "reply": "tcp://127.0.0.1:5555", "token": "ab", "timeout": 3.0}
    payloads = encode(body, 2)
    assert len(payloads) == 2
    named = _sglang_decode(payloads[1])
    assert len(named) == 1 and named[0][1].numel() == 0
    assert named[0][1].to("cpu").numel() == 0  # what SGLang does to every value first
    assert decode(named) == body


@pytest.mark.parametrize(
    "named, why",
    [
        ([], "one named tensor, not 0"),
        ([("model.embed_tokens.weight", torch.zeros(2))], "not a tpusync weight request"),
        ([(PREFIX + "{not json", torch.empty(0))], "malformed"),
        ([(PREFIX + '{"kind": "reboot"}', torch.empty(0))], "without a known kind"),
        ([(PREFIX + '{"kind": "init", "token": "t"}', torch.empty(0))], "reply address"),
    ],
)
def test_anything_else_is_refused_by_name(named, why):
    with pytest.raises(ValueError, match=why):
        decode(named)


def test_encode_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        encode({"kind": "reboot", "reply": "x", "token": "t"}, 1)


def test_the_loader_never_raises_and_leaves_the_model_alone(caplog, monkeypatch):
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", "a-secret-of-at-least-16-bytes")
    monkeypatch.setattr(weight_loader, "REPLY_TIMEOUT_S", 0.5)
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    with caplog.at_level(logging.ERROR, logger="tpusync.sglang"):
        weight_loader.load(model, [("model.embed_tokens.weight", torch.ones(2, 2))])
        # A well-formed request whose reply address nobody listens on (and no distributed
        # state): logged, never raised into SGLang's scheduler.
        weight_loader.load(model, _sglang_decode(encode(
            {"kind": "close", "reply": "tcp://127.0.0.1:9", "token": "t"}, 1
        )[0]))  # fmt: skip
    assert torch.equal(model.weight, before)
    assert "not a tpusync weight request" in caplog.text
    assert "could not report to tcp://127.0.0.1:9: TimeoutError" in caplog.text
