"""The client side of RL weight sync into SGLang (``tpusync.sglang.weight_sync``) against a
stand-in SGLang HTTP server, used only to inject answers a live server gives rarely (a refused
cache flush after a load). The stand-in decodes each request the way SGLang's scheduler does
and answers as the tpusync loader would (the loader's outcome over the signed control channel).
Live-server behaviour is in test_weight_sync_server.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tpusync.core.pd import load_secret
from tpusync.rl.control import ControlClient
from tpusync.sglang import weight_sync
from tpusync.sglang.weight_request import decode

FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)


class _StandIn:
    """A stand-in SGLang: records every call; ``/update_weights_from_tensor`` runs 'the loader'
    (sends ``outcome`` for the request's token when it is not None) and answers ``status``."""

    def __init__(self, outcome: dict | None, status: int, message: str = "Success") -> None:
        self.calls: list[tuple[str, dict]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a: object) -> None:
                pass

            def _answer(self, code: int, obj: dict) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:  # /server_info
                self._answer(200, {"tp_size": 1})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                stand_in.calls.append((self.path, body))
                if self.path != "/update_weights_from_tensor":
                    return self._answer(200, {"success": True, "message": "Success"})
                from sglang.srt.utils.common import MultiprocessingSerializer

                request = decode(
                    MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
                )
                if outcome is not None:
                    client = ControlClient(load_secret(), request["reply"])
                    try:
                        client.request({"op": "outcome", "token": request["token"], **outcome}, 10)
                    finally:
                        client.close()
                self._answer(status, {"success": status == 200, "message": message})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]

    def body(self, path: str) -> dict:
        return next(b for p, b in self.calls if p == path)


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", "weight-sync-client-test-secret-0123")


@pytest.fixture
def stand_in():
    made: list[_StandIn] = []

    def make(*a, **kw) -> _StandIn:
        made.append(_StandIn(*a, **kw))
        return made[-1]

    yield make
    for s in made:
        s.server.shutdown()
        s.server.server_close()


LOADED_5 = {"ok": True, "version": 5, "failure": None, "timed_out": False, "serving": 5}


def test_every_call_names_the_target_runner_only(stand_in):
    """TARGET RULE: with SGLang's default selector ("all") a speculative-decoding server ran the
    loader once more per draft runner, and the draft took the next version."""
    s = stand_in(LOADED_5, 200)
    assert weight_sync.update_server(s.url, timeout=5) == 5
    assert s.body("/begin_weight_update")["selector"] == "target"
    assert s.body("/update_weights_from_tensor")["selector"] == "target"
    assert s.body("/update_weight_version") == {"new_version": "5"}


def test_a_version_loaded_before_sglang_refused_its_cache_flush_is_recorded_then_raised(stand_in):
    """REFUSED AFTER LOAD RULE: SGLang answers HTTP 400 when its cache flush is refused, after
    the loader loaded and committed the version. The caller used to get a bare HTTP error and
    the server kept reporting the old weight_version while serving the new weights."""
    s = stand_in(LOADED_5, 400, FLUSH_REFUSED)
    with pytest.raises(RuntimeError, match="version 5 loaded .* recorded .* cache was not flushed"):
        weight_sync.update_server(s.url, timeout=5)
    assert s.body("/update_weight_version") == {"new_version": "5"}
    assert "/end_weight_update" in s.paths()  # SGLang's session closed


def test_a_refused_call_without_a_loader_outcome_raises_the_http_error(stand_in, monkeypatch):
    monkeypatch.setattr(weight_sync, "_OUTCOME_AFTER_ERROR_S", 0.5)
    s = stand_in(None, 400, "no such load format")
    with pytest.raises(RuntimeError, match="HTTP 400.*no such load format"):
        weight_sync.update_server(s.url, timeout=5)
    assert "/update_weight_version" not in s.paths()
    assert "/end_weight_update" in s.paths()
