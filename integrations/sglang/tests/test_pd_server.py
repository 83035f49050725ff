"""SGLang P/D through tpusync with two LIVE SGLang servers (real processes, real HTTP, real sockets).

A prefill server (``--disaggregation-mode prefill``) and a decode server (``decode``), both with
``--disaggregation-transfer-backend tpusync`` (the name the plugin entry point adds), serve the tiny
model on CPU; a third, ordinary server computes the same prompts alone for reference. The test
does what SGLang's router does: it sends each request to both P/D servers at once with the
prefill's bootstrap address and one random ``bootstrap_room``. The decode server receives the
prompt's KV pages and first token from the prefill server through tpusync and decodes; its
greedy tokens must equal the reference server's. Three pairings of two prefill servers (TP=1
and TP=2) and two decode servers (TP=1 through the same-host path, the default on one host; TP=2
with it turned off, ``TPUSYNC_SGLANG_SAME_HOST=0``, over TCP as from another host) take turns:
equal TP sizes, a larger prefill TP and a larger decode TP (each side's ranks move only the kv
heads both hold). (Measured once by hand, 2026-12-02: a decode
server whose received pages were dropped before the scatter decoded [210, 167, 381, ...] where
the reference decodes [210, 441, 122, ...], so equal tokens do show that the KV landed.)

Then the prefill server is stopped: a request to the decode server fails with SGLang's transfer
error naming the lost prefill's bootstrap address, in bounded time, and the decode server stays
healthy.

Servers are started by ``support/live_server.py`` (LIVE SERVER CONTRACT), all five at once (a
TP=2 server on CPU is two scheduler processes, one core each). (Until 2026-12-07 a third decode
server, TP=1 over TCP, made a fourth pairing; it was dropped for CI's 90 minutes: TCP is still
crossed, by the TP=2 decode.)
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


TP2 = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # a CPU server of two ranks: one core each


@dataclass
class PdServers:
    prefill: Server  # TP=1
    prefill_tp2: Server
    decode: Server  # TP=1, pulls through the same-host path
    decode_tp2: Server  # pulls over TCP (same-host path off)
    reference: Server  # an ordinary TP=1 server
    bootstrap: dict[str, int]  # the prefills' bootstrap ports, by name

    def disaggregated(self, ids: list[int], prefill: str, decode: Server) -> tuple[dict, dict]:
        """One request through ``prefill`` and ``decode`` at once, as SGLang's router sends it."""
        route = {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap[prefill],
            "bootstrap_room": random.getrandbits(62),
        }
        with ThreadPoolExecutor(2) as pool:
            pre = pool.submit(getattr(self, prefill).generate, ids, **route)
            dec = pool.submit(decode.generate, ids, **route)
            return pre.result(timeout=300), dec.result(timeout=300)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = Path(os.environ.get("TPUSYNC_REPO_ROOT", Path(__file__).resolve().parents[3]))
    model = tiny_model.ensure(root)
    logs = tmp_path_factory.mktemp("sglang-pd-servers")
    bootstrap = {"prefill": free_port(), "prefill_tp2": free_port()}
    pd = ["--disaggregation-transfer-backend", "tpusync"]
    # --disable-overlap-schedule: SGLang's overlapped prefill makes a torch.cuda.Event when it
    # sends a cached prefix early, which fails on CPU.
    prefill = [*pd, "--disaggregation-mode", "prefill", "--disable-overlap-schedule",
               "--enable-metrics", "--disaggregation-bootstrap-port"]  # fmt: skip
    decode = [*pd, "--disaggregation-mode", "decode"]
    tp2 = ["--tp-size", "2"]
    env = {"TPUSYNC_AUTH_SECRET": SECRET}
    started: list[Server] = []
    try:
        for name, args, extra_env in (
            ("prefill", [*prefill, str(bootstrap["prefill"])], {}),
            ("prefill-tp2", [*prefill, str(bootstrap["prefill_tp2"]), *tp2], TP2),
            ("decode", decode, {}),
            ("decode-tp2", [*decode, *tp2], {**TP2, "TPUSYNC_SGLANG_SAME_HOST": "0"}),
            ("reference", [], {}),
        ):
            started.append(launch(model, logs / f"{name}.log", args, {**env, **extra_env}))
        for srv in started:  # all start at once; then each is waited for
            srv.wait_ready()
        yield PdServers(*started, bootstrap=bootstrap)
    finally:
        for srv in started:
            srv.stop()


def test_decode_servers_continue_from_the_prefill_servers_kv(servers: PdServers):
    """Three pairings, in this order:
    - TP=1 to TP=1 through the same-host path, the prefill's radix cache empty;
    - TP=1 to TP=2 over TCP, the same prompts: each decode rank pulls its half of the heads from
      the one prefill rank; the prefill's cache now holds the prompts, so SGLang sends their
      cached pages early, in a chunk of their own, before the chunk that ends the request;
    - a prefill of TP=2 to a decode of TP=1: the decode rank pulls half the kv heads from each
      prefill rank (pd_layout.py, HEAD SLICE CONTRACT) and counts both ranks' reports."""
    cases = [
        ("same-host", "prefill", servers.decode, False),
        ("tp1-to-tp2-tcp", "prefill", servers.decode_tp2, True),
        ("tp2-to-tp1", "prefill_tp2", servers.decode, False),
    ]
    want = [servers.reference.generate(ids)["output_ids"] for ids in PROMPTS]
    for case, prefill, decode, cached in cases:
        source = getattr(servers, prefill)
        transfers_before = source.metric("sglang:kv_transfer_total_mb_count")
        for ids, tokens in zip(PROMPTS, want, strict=True):
            pre, dec = servers.disaggregated(ids, prefill, decode)
            assert len(tokens) == 8
            assert dec["output_ids"] == tokens, (case, ids[:4], dec, decode.tail())
            # The prefill server computed the first token only; the decode did not prefill.
            assert pre["output_ids"] == tokens[:1], case
            assert dec["meta_info"]["prompt_tokens"] == len(ids) > 8 * PAGE
            assert (pre["meta_info"]["cached_tokens"] > 0) == cached, (case, pre)
        # SGLang's prefill observed each request's transfer through the backend's sender.
        transfers = source.metric("sglang:kv_transfer_total_mb_count") - transfers_before
        assert transfers >= len(PROMPTS), case
    # The backend's start-up lines: every rank of every server, and each decode's path.
    for srv, ranks in ((servers.prefill, 1), (servers.prefill_tp2, 2)):
        log = srv.log.read_text()
        assert [f"tpusync P/D prefill rank {r}: offering" in log for r in range(2)] == [
            r < ranks for r in range(2)
        ]
    for srv, ranks, on_off in (
        (servers.decode, 1, "on"),
        (servers.decode_tp2, 2, "off"),
    ):
        log = srv.log.read_text()
        for r in range(ranks):
            assert f"tpusync P/D decode rank {r}: pulling" in log
        assert f"(same-host path {on_off})" in log


def test_a_lost_prefill_fails_the_decode_request_clearly(servers: PdServers):
    """Runs last in this module: it stops the prefill server."""
    servers.prefill.stop()
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as err:
        servers.decode.generate(
            PROMPTS[0],
            bootstrap_host="127.0.0.1",
            bootstrap_port=servers.bootstrap["prefill"],
            bootstrap_room=random.getrandbits(62),
        )
    body = json.loads(err.value.read().decode())
    assert err.value.code == 500
    # SGLang's words depend on whether its heartbeat saw the loss first ("Lost connection with
    # prefill instance (bootstrap_addr: ...)") or the request did ("Prefill server with
    # bootstrap_addr: ... is ... down"); both name the lost prefill's bootstrap address.
    assert f"bootstrap_addr: 127.0.0.1:{servers.bootstrap['prefill']}" in body["message"], body
    assert time.monotonic() - t0 < 120
    assert servers.decode.healthy()
