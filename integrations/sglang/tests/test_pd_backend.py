"""Issue 8 scenario 3: SGLang's P/D classes on the tpusync backend, prefill and decode in real
processes (tests/support/pd_peer.py), real bytes between CPU KV tensors.

Every test starts prefill processes (rank 0 also runs SGLang's bootstrap server; each a
TpusyncKVManager + senders) and decode processes (manager + receivers), one per attention TP
rank, all resolved through SGLang's own ``get_kv_class`` after the tpusync plugin hooked in, and
checks the KVPoll states each side saw, the failure reasons and the page bytes. Every wait is
bounded (the peers time out on their own; the test kills them).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import free_port

pytest.importorskip("sglang")

PEER = Path(__file__).parent / "support" / "pd_peer.py"
PROC_TIMEOUT_S = 420
FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = 0, 1, 2, 3, 4


def _report(out: str, what: str, err: str, more: str = "") -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"{what} printed no report:\n{err[-4000:]}{more}"
    return json.loads(lines[-1])


def _run(scenario: str, p_tp: int = 1, d_tp: int = 1, p_pp: int = 1, d_pp: int = 1, **extra_env):
    """Prefill ranks 0..p_tp-1 of each of p_pp pipeline stages and decode ranks 0..d_tp-1 of
    each of d_pp stages, each its own process (one rank per process, as SGLang's schedulers);
    their last reports (stage-major), the decode processes, and the prefill stderrs. Every
    process is bounded by PROC_TIMEOUT_S and killed after it."""
    port = free_port()
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
        "TPUSYNC_TEST_PP_PORT": str(free_port()),  # the prefill stages' gloo group
        **extra_env,
    }

    def start(role: str, tp: int, rank: int, pp: int, stage: int) -> subprocess.Popen:
        tail = [str(tp), str(rank)] if p_tp * d_tp * p_pp * d_pp > 1 else []
        tail += [str(pp), str(stage)] if p_pp * d_pp > 1 else []
        return subprocess.Popen(
            [sys.executable, str(PEER), role, str(port), scenario, *tail],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    n_p, n_d = p_tp * p_pp, d_tp * d_pp
    procs = [start("prefill", p_tp, r, p_pp, s) for s in range(p_pp) for r in range(p_tp)]
    procs += [start("decode", d_tp, r, d_pp, s) for s in range(d_pp) for r in range(d_tp)]
    outs = []
    try:
        for proc in procs[n_p:] + procs[:n_p]:  # the decodes end first (or die on purpose)
            out, err = proc.communicate(timeout=PROC_TIMEOUT_S)
            outs.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    decs, pres = outs[:n_d], outs[n_d:]
    # A decode without a report most often waited for a prefill that never came up: show both.
    prefill_tails = "".join(
        f"\n--- prefill {i} stderr:\n{c.stderr[-2000:]}" for i, c in enumerate(pres)
    )
    d = [_report(c.stdout, "decode", c.stderr, prefill_tails) for c in decs]
    p = [_report(c.stdout, "prefill", c.stderr) for c in pres]
    return p, d, decs, [c.stderr for c in pres]


def _decodes_hold_the_model(run: tuple, same_host: str) -> list[dict]:
    """Room 11 of a ``tp`` / ``pp`` run: every process succeeded, every decode rank's pages hold
    the model's bytes of its heads and layers and its aux row every prefill rank's, pulled
    through the same-host path exactly when ``same_host`` is "1". The decode rooms, in order."""
    p, d, decs, p_errs = run
    for c in decs:
        assert c.returncode == 0, c.stderr[-4000:]
    aux = p[0]["rooms"]["11"]["aux"]
    for rank, rep in enumerate(p):
        room = rep["rooms"]["11"]
        assert room["final"] == SUCCESS, (rank, room, p_errs[rank][-3000:])
        assert room["aux"] == aux
    rooms = []
    for rank, rep in enumerate(d):
        room = rep["rooms"]["11"]
        assert room["final"] == SUCCESS, (rank, room)
        assert room["pages"] == room["model_pages"], f"decode {rank}: wrong page bytes"
        assert room["aux"] == aux
        assert rep["received"] > 0, rep
        assert rep["received_shm"] == (rep["received"] if same_host == "1" else 0), rep
        rooms.append(room)
    return rooms


def _run_pair(scenario: str) -> tuple[dict, dict, subprocess.CompletedProcess, str]:
    p, d, decs, p_errs = _run(scenario)
    return p[0], d[0], decs[0], p_errs[0]


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
    # SAME-HOST CONTRACT: both processes run on this host, so every block came out of the
    # prefill's /dev/shm pool (no TCP); test_pd_between_attention_tp_sizes covers TCP.
    assert d["received"] > 0 and d["received_shm"] == d["received"], d
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


def test_a_room_the_prefill_aborts_fails_on_the_decode_at_once_with_the_reason(tmp_path):
    """PREFILL ABORT CONTRACT: room 31 aborted by the prefill scheduler after the decode pulled
    its first chunk, room 32 before any chunk. SGLang's waiting timeout is 300 s here and the
    prefill stays up (heartbeats answered), so only the prefill's message can end the rooms;
    before it, room 31 sat in Transferring for good (SGLang times out WaitingForInput only)."""
    done = tmp_path / "decode-done"
    p, d, decs, p_errs = _run("prefill_aborts", TPUSYNC_TEST_DONE_FILE=str(done))
    assert decs[0].returncode == 0, decs[0].stderr[-4000:]
    for room in ("31", "32"):
        dec, pre = d[0]["rooms"][room], p[0]["rooms"][room]
        assert pre["states"][-1] == FAILED, (room, pre)
        assert dec["final"] == FAILED, (room, dec)
        assert "Aborted" in (dec["reason"] or ""), (room, dec)
        assert dec["after_s"] < 30.0, (room, dec)
        # DECODE WAIT CONTRACT: never Transferring on the decode (SGLang's timeout still runs)
        assert dec["states"] == [WAITING, FAILED], (room, dec)
    assert p[0]["rooms"]["31"]["states"][-2] == TRANSFERRING  # the chunk was offered first


def test_decode_dies_after_metadata_prefill_fails_with_reason():
    p, d, dec, p_err = _run_pair("decode_dies")
    assert d == {"event": "exiting"}
    assert "rooms" in p, f"prefill gave no report: {p}\n{p_err[-4000:]}"
    room = p["rooms"]["21"]
    assert room["final"] == FAILED, room
    assert "tpusync" in room["reason"] or "Abort" in room["reason"], room


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "same_host"),
    [(1, 2, "1"), (2, 1, "0")],
    ids=["tp1-to-tp2-shm", "tp2-to-tp1-tcp"],
)
def test_pd_between_attention_tp_sizes_moves_each_rank_its_heads(p_tp, d_tp, same_host):
    """HEAD SLICE CONTRACT end to end: prefill and decode servers of different attention TP
    sizes (one process per rank, SGLang's own rank mapping and per-rank Success count). Each
    decode rank's pages hold exactly the model's bytes of its kv heads, its aux row the
    prefill's; before, these layouts failed the room ("KV page sizes differ"). One case pulls
    through the same-host path, the other over TCP (TPUSYNC_SGLANG_SAME_HOST=0)."""
    rooms = _decodes_hold_the_model(
        _run("tp", p_tp, d_tp, TPUSYNC_SGLANG_SAME_HOST=same_host), same_host
    )
    assert [r["heads"] for r in rooms] == [
        [r * 2 // d_tp, (r + 1) * 2 // d_tp] for r in range(d_tp)
    ]


def test_a_room_with_two_decode_peers_succeeds_only_after_both_have_every_chunk():
    """TP=1 prefill to TP=2 decode: each chunk is staged and offered once per decode rank, one
    after the other. The second rank's copy of each chunk is slowed (0.5 s), so the first rank's
    last chunk is acknowledged while the second's is still being staged. The prefill must not
    conclude the room then: it did, and SGLang could reuse the pages the second copy was still
    reading or clear the room before that offer (a decode rank waiting for a chunk that never came,
    seen once in a live TP=1 -> TP=2 run). Now the room concludes after all four copies."""
    run = _run("tp", 1, 2, TPUSYNC_SGLANG_SAME_HOST="0", TPUSYNC_TEST_SLOW_COPY_S="0.5")
    p = run[0]
    assert p[0]["copies_at_success"] == [4], p[0]
    _decodes_hold_the_model(run, "0")


def test_pd_layouts_that_cannot_pair_fail_both_sides_at_once_with_the_reason():
    """A decode whose KV layout cannot pair with the prefill's (here: another model's kv head
    count in pages of the same size, which the old page-size check let through) fails the room on
    both sides with the reason, the decode as soon as the prefill saw its metadata (not at
    SGLang's 300 s waiting timeout of this test)."""
    p, d, decs, p_errs = _run("tp_bad")
    assert decs[0].returncode == 0, decs[0].stderr[-4000:]
    pre, dec = p[0]["rooms"]["11"], d[0]["rooms"]["11"]
    assert pre["final"] == FAILED and "kv heads differ" in (pre["reason"] or ""), pre
    assert dec["final"] == FAILED and "kv heads differ" in (dec["reason"] or ""), dec


@pytest.mark.parametrize("d_pp", [1, 2], ids=["pp2-to-pp1-shm", "pp2-to-pp2-tcp"])
def test_pd_from_pipeline_stages_fills_each_layer_from_its_stage(d_pp):
    """PP CONTRACT end to end: a prefill of two pipeline stages (one process each, a real gloo
    group between them for SGLang's consensus store of room states). A decode of one stage pulls
    from both and counts both Success reports; its buffers of every layer hold the model's bytes
    (LAYER PAIRING CONTRACT: stage 1's K and V of layer 2 land in the decode's buffers 2 and 5,
    not 0 and 1). A decode of two stages pulls each stage's layers from that stage alone. Before,
    a stage's buffers went by position: a one-stage decode refused them ("KV buffer counts
    differ")."""
    same_host = "1" if d_pp == 1 else "0"
    rooms = _decodes_hold_the_model(
        _run("pp", p_pp=2, d_pp=d_pp, TPUSYNC_SGLANG_SAME_HOST=same_host), same_host
    )
    assert [r["layers"] for r in rooms] == ([[0, 1, 2]] if d_pp == 1 else [[0, 1], [2]])
