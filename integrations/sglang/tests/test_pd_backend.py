"""Issue 8 scenario 3: SGLang's P/D classes on the tpusync backend, prefill and decode in two real
processes (tests/support/pd_peer.py), real bytes between CPU KV tensors.

Every test starts a prefill process (SGLang's bootstrap server + TpusyncKVManager + senders) and
a decode process (manager + receivers), both resolved through SGLang's own ``get_kv_class`` after
the tpusync plugin hooked in, and checks the KVPoll states each side saw, the failure reasons and
the page bytes. Every wait is bounded (the peers time out on their own; the test kills them).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

PEER = Path(__file__).parent / "support" / "pd_peer.py"
PROC_TIMEOUT_S = 420
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = 0, 1, 2, 3, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(scenario: str) -> tuple[dict, dict, subprocess.CompletedProcess, str]:
    port = _free_port()
    env = {
        **os.environ,
        "TPUSYNC_AUTH_SECRET": secrets.token_hex(16),
        "SGLANG_HOST_IP": "127.0.0.1",
        "TPUSYNC_SGLANG_POOL_MB": "4",
        "TPUSYNC_SGLANG_SEND_DEADLINE_S": "6",
        "TPUSYNC_SGLANG_RECV_DEADLINE_S": "6",
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "300",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "300",
        "SGLANG_PLUGINS": "tpusync",
    }
    cmd = [sys.executable, str(PEER)]
    pre = subprocess.Popen(
        [*cmd, "prefill", str(port), scenario],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        dec = subprocess.run(
            [*cmd, "decode", str(port), scenario],
            env=env,
            capture_output=True,
            text=True,
            timeout=PROC_TIMEOUT_S,
        )
        pre_out, pre_err = pre.communicate(timeout=PROC_TIMEOUT_S)
    finally:
        if pre.poll() is None:
            pre.kill()
            pre.communicate()
    p_last = [ln for ln in pre_out.splitlines() if ln.startswith("{")]
    d_last = [ln for ln in dec.stdout.splitlines() if ln.startswith("{")]
    assert d_last, f"decode printed no report:\n{dec.stderr[-4000:]}"
    assert p_last, f"prefill printed no report:\n{pre_err[-4000:]}"
    return json.loads(p_last[-1]), json.loads(d_last[-1]), dec, pre_err


def test_pd_transfer_moves_pages_and_aux_and_abort_fails_both_sides():
    p, d, dec, p_err = _run_pair("ok")
    assert dec.returncode == 0, dec.stderr[-4000:]
    assert p["manager"] == "TpusyncKVManager"
    ok_p, ok_d = p["rooms"]["11"], d["rooms"]["11"]
    # KVPoll state machine as the schedulers see it. The prefill's sender may first be polled
    # after the decode's bootstrap info already arrived (the decode registers its room as soon
    # as the bootstrap server answers), so its first state is Bootstrapping or already
    # WaitingForInput; either way the states only move forward.
    assert ok_p["states"][0] in (BOOTSTRAPPING, WAITING) and WAITING in ok_p["states"]
    assert ok_p["states"] == sorted(ok_p["states"]), ok_p["states"]
    assert ok_p["final"] == SUCCESS and ok_p["states"][-1] == SUCCESS
    assert ok_d["states"][0] == BOOTSTRAPPING and WAITING in ok_d["states"]
    assert ok_d["states"] == sorted(ok_d["states"]), ok_d["states"]
    assert ok_d["final"] == SUCCESS, ok_d["reason"]
    # Real bytes: every layer's K and V of each page, in the decode's own page slots, and the
    # aux row, are byte-identical to the prefill's.
    assert ok_d["pages"] == ok_p["pages"]
    assert ok_d["aux"] == ok_p["aux"]
    assert len(set(ok_p["pages"])) == len(ok_p["pages"])  # distinct random pages
    # Abort on the decode side (after the prefill offered a chunk): Failed there with SGLang's
    # reason, and the prefill does not hang but ends Failed too; no page of the aborted room was
    # written on the decode.
    ab_p, ab_d = p["rooms"]["12"], d["rooms"]["12"]
    assert ab_d["final"] == FAILED and "Abort" in (ab_d["reason"] or "")
    assert ab_p["final"] == FAILED and ab_p["reason"], ab_p
    # ABORT CONTRACT: the prefill cancelled the aborted room's offers, so its staging pool is
    # whole again within half the 6 s send deadline (an expiry would hold it the full 6 s).
    assert ab_p["offers_left"] == 0, ab_p
    assert ab_p["pool_free"] == ab_p["pool_blocks"], ab_p
    zero_page = hashlib.sha256(bytes(6 * 4 * 2 * 16 * 2)).hexdigest()  # K+V x 3 layers, bf16
    assert ab_d["pages"] == [zero_page] * 5
    assert ab_d["aux"] == hashlib.sha256(bytes(16 * 4)).hexdigest()


def test_prefill_dies_mid_transfer_decode_fails_with_reason():
    p, d, dec, _ = _run_pair("prefill_dies")
    assert p == {"event": "exiting"}
    room = d["rooms"]["21"]
    assert room["final"] == FAILED
    assert room["reason"], room


def test_decode_dies_after_metadata_prefill_fails_with_reason():
    p, d, dec, p_err = _run_pair("decode_dies")
    assert d == {"event": "exiting"}
    assert "rooms" in p, f"prefill gave no report: {p}\n{p_err[-4000:]}"
    room = p["rooms"]["21"]
    assert room["final"] == FAILED, room
    assert "tpusync" in room["reason"] or "Abort" in room["reason"], room
