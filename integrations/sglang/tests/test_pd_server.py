"""SGLang P/D through tpusync with two LIVE SGLang servers (real processes, real HTTP, real sockets).

A prefill server (``--disaggregation-mode prefill``) and a decode server (``decode``), both with
``--disaggregation-transfer-backend tpusync`` (the name the plugin entry point adds), serve the tiny
model on CPU; a third, ordinary server computes the same prompts alone for reference. The test
does what SGLang's router does: it sends each request to both P/D servers at once with the
prefill's bootstrap address and one random ``bootstrap_room``. The decode server receives the
prompt's KV pages and first token from the prefill server through tpusync and decodes; its
greedy tokens must equal the reference server's. Two decode servers take turns with the one
prefill server: one pulls through the same-host path (the prefill's /dev/shm pool, the default
on one host), the other with it turned off (``TPUSYNC_SGLANG_SAME_HOST=0``), over TCP as it
would from another host. (Measured once by hand, 2026-12-02: a decode
server whose received pages were dropped before the scatter decoded [210, 167, 381, ...] where
the reference decodes [210, 441, 122, ...], so equal tokens do show that the KV landed.)

Then the prefill server is stopped: a request to the decode server fails with SGLang's transfer
error naming the lost prefill's bootstrap address, in bounded time, and the decode server stays
healthy.

Servers are started by ``support/live_server.py`` (LIVE SERVER CONTRACT), all four at once.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiny_model
from live_server import PAGE, Server, free_port, launch

SECRET = "tpusync-sglang-live-pd-secret"
PROMPTS = [
    list(range(40, 77)),  # 37 tokens: 9 full pages and one partial
    [(7 * i) % 250 + 3 for i in range(150)],  # 150 tokens: 37 full pages and one partial
]


@dataclass
class PdServers:
    prefill: Server
    decode: Server  # pulls through the same-host path
    decode_tcp: Server  # pulls over TCP (same-host path off)
    reference: Server
    bootstrap: int  # the prefill's bootstrap port

    def disaggregated(self, ids: list[int], decode: Server) -> tuple[dict, dict]:
        """One request through the prefill and ``decode`` at once, as SGLang's router sends it."""
        route = {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap,
            "bootstrap_room": random.getrandbits(62),
        }
        with ThreadPoolExecutor(2) as pool:
            pre = pool.submit(self.prefill.generate, ids, **route)
            dec = pool.submit(decode.generate, ids, **route)
            return pre.result(timeout=300), dec.result(timeout=300)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = Path(os.environ.get("TPUSYNC_REPO_ROOT", Path(__file__).resolve().parents[3]))
    model = tiny_model.ensure(root)
    logs = tmp_path_factory.mktemp("sglang-pd-servers")
    bootstrap = free_port()
    pd = ["--disaggregation-transfer-backend", "tpusync"]
    env = {"TPUSYNC_AUTH_SECRET": SECRET}
    started: list[Server] = []
    try:
        for name, args, extra_env in (
            # --disable-overlap-schedule: SGLang's overlapped prefill makes a torch.cuda.Event
            # when it sends a cached prefix early, which fails on CPU.
            ("prefill", [*pd, "--disaggregation-mode", "prefill", "--disable-overlap-schedule",
                         "--disaggregation-bootstrap-port", str(bootstrap), "--enable-metrics"], {}),
            ("decode", [*pd, "--disaggregation-mode", "decode"], {}),
            ("decode-tcp", [*pd, "--disaggregation-mode", "decode"],
             {"TPUSYNC_SGLANG_SAME_HOST": "0"}),
            ("reference", [], {}),
        ):  # fmt: skip
            started.append(launch(model, logs / f"{name}.log", args, {**env, **extra_env}))
        for srv in started:  # all four start at once; then each is waited for
            srv.wait_ready()
        yield PdServers(*started, bootstrap=bootstrap)
    finally:
        for srv in started:
            srv.stop()


def test_decode_servers_continue_from_the_prefill_servers_kv(servers: PdServers):
    """First the same-host decode, with the prefill's radix cache empty; then the TCP decode with
    the same prompts: the prefill's cache now holds them, so SGLang sends their cached pages early,
    in a chunk of their own, before the chunk that ends the request."""
    for path, decode in (("same-host", servers.decode), ("tcp", servers.decode_tcp)):
        transfers_before = servers.prefill.metric("sglang:kv_transfer_total_mb_count")
        for ids in PROMPTS:
            want = servers.reference.generate(ids)["output_ids"]
            pre, dec = servers.disaggregated(ids, decode)
            assert len(want) == 8
            assert dec["output_ids"] == want, (path, ids[:4], dec, decode.tail())
            # The prefill server computed the first token only; the decode did not prefill.
            assert pre["output_ids"] == want[:1]
            assert dec["meta_info"]["prompt_tokens"] == len(ids) > 8 * PAGE
            assert (pre["meta_info"]["cached_tokens"] > 0) == (path == "tcp"), (path, pre)
        # SGLang's prefill observed each request's transfer through the backend's sender, and
        # the decode's start-up line names its path.
        transfers = servers.prefill.metric("sglang:kv_transfer_total_mb_count") - transfers_before
        assert transfers >= len(PROMPTS), path
        on_off = "on" if path == "same-host" else "off"
        log = decode.log.read_text()
        assert "tpusync P/D decode rank 0: pulling" in log and f"(same-host path {on_off})" in log
    assert "tpusync P/D prefill rank 0: offering" in servers.prefill.log.read_text()


def test_a_lost_prefill_fails_the_decode_request_clearly(servers: PdServers):
    """Runs last in this module: it stops the prefill server."""
    servers.prefill.stop()
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as err:
        servers.decode.generate(
            PROMPTS[0],
            bootstrap_host="127.0.0.1",
            bootstrap_port=servers.bootstrap,
            bootstrap_room=random.getrandbits(62),
        )
    body = json.loads(err.value.read().decode())
    assert err.value.code == 500
    # SGLang's words depend on whether its heartbeat saw the loss first ("Lost connection with
    # prefill instance (bootstrap_addr: ...)") or the request did ("Prefill server with
    # bootstrap_addr: ... is ... down"); both name the lost prefill's bootstrap address.
    assert f"bootstrap_addr: 127.0.0.1:{servers.bootstrap}" in body["message"], body
    assert time.monotonic() - t0 < 120
    assert servers.decode.healthy()
