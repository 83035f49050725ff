import json
import subprocess
import sys

import pytest

from tpusync.core import cli


def run_cli(*args):
    out = subprocess.run(
        [sys.executable, "-m", "tpusync.core.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout


def test_version_json():
    import tpusync.core as tc

    info = json.loads(run_cli("version", "--json"))
    assert info == {"tpusync_core": tc.__version__, "api_version": tc.API_VERSION}


def test_bench_memory_json_schema():
    data = json.loads(run_cli("bench", "memory", "--json", "--total-mib", "8", "--repeats", "1"))
    assert data["suite"] == "memory"
    sizes = [r["block_bytes"] for r in data["results"]]
    assert sizes == [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]
    for r in data["results"]:
        for path in ("put", "get"):
            e = r[path]
            assert e["gbps"] > 0 and e["limit_gbps"] > 0 and e["better"] == "higher"
            assert abs(e["ratio"] - e["gbps"] / e["limit_gbps"]) < 0.01
    assert isinstance(data["goal_met"], bool)


def test_demo_verifies():
    out = json.loads(run_cli("demo", "--layers", "2", "--blocks", "16", "--json"))
    assert out["verified"] is True
    assert out["bytes"] == 2 * 8 * out["block_bytes"]


def test_parser_rejects_unknown_suite():
    import pytest

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "nonsense"])


def test_bench_tiers_json_schema(tmp_path):
    data = json.loads(
        run_cli(
            "bench",
            "tiers",
            "--json",
            "--total-mib",
            "4",
            "--repeats",
            "1",
            "--quiet",
            "--dir",
            str(tmp_path),
            "--lookup-keys",
            "1000,10000",
            "--session-tokens",
            "16384",
        )
    )
    assert data["suite"] == "tiers"
    for r in data["host"]:
        for path in ("put", "get", "put_shm_checksummed"):
            assert r[path]["gbps"] > 0 and r[path]["limit"].startswith("one memcpy")
    for r in data["disk"]:
        assert r["io_backend"] in ("io_uring", "pread")
        for path in ("write", "read"):
            assert r[path]["gbps"] > 0
            # fio is the same-run reference when installed (nox's bench session installs it).
            assert r[path]["ratio"] is None or r[path]["limit"].startswith("fio ")
    assert [r["keys"] for r in data["lookup"]] == [1000, 10000]
    for r in data["lookup"]:
        assert r["batch"] == 1024 and r["ns_per_key"] > 0 and r["us_single_key"] > 0
    restart = data["restart"]
    assert restart["slots"] == 1024 and restart["manifest_bytes"] > 1024 * 80
    assert restart["manifest_open_s"] > 0 and restart["scan_open_s"] > 0
    assert [c["journaled_slots"] for c in restart["crash_checkpoint"]] == [128]
    assert restart["crash_checkpoint"][0]["open_s"] > 0
    ck = data["checkpoint"]
    assert ck["slots"] == 4096 and ck["block_bytes"] == 4096 and ck["get_misses"] == 0
    # One checkpoint per variant and round, each variant against its own reference; the row's
    # own figures are the default mode's. (A 4096-slot checkpoint takes ~ms: a call may or may
    # not fall inside it, so only the references are sure to have calls.)
    assert sorted(ck["variants"]) == ["at_fsync", "progressive"]
    for name, v in ck["variants"].items():
        assert v["checkpoints"] == ck["rounds"] == 8 and v["checkpoint_s"] > 0, name
        assert v["put_without"]["n"] > 0 and v["get_without"]["n"] > 0, name
        assert v["put"]["better"] == v["get"]["better"] == "lower"
        assert v["get"]["limit"].startswith("get p99 of the same caller")
        assert len(v["slowest_during"]) <= 5
    assert ck["variants"]["at_fsync"]["options"] == {"checkpoint_write_back": "at_fsync"}
    assert ck["variants"]["progressive"]["options"] == {"checkpoint_write_back": "progressive"}
    assert ck["put"] == ck["variants"]["progressive"]["put"]
    assert ck["get"] == ck["variants"]["progressive"]["get"]
    assert ck["better"] == "lower" and ck["p99_us"] == ck["put"]["p99_us"]
    session = data["long_session"]
    assert session["device_footprint_bounded"] is True
    assert session["verified_blocks"] == session["offloaded_blocks"] > 0
    assert session["device_max_blocks_used"] <= session["device_budget_blocks"]
    assert list(tmp_path.iterdir()) == []  # the bench cleans up after itself


def test_cli_never_imports_frameworks_and_finds_plugin_suites(monkeypatch):
    code = (
        "import sys; from tpusync.core import cli; cli.build_parser(); "
        "bad = sorted(m for m in ('torch', 'jax') if m in sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    class FakeEntryPoint:
        name = "fake"

        def load(self):
            return lambda total_bytes, repeats, show_progress: {
                "suite": "fake",
                "bytes": total_bytes,
                "repeats": repeats,
            }

    import importlib.metadata

    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda group: [FakeEntryPoint()] if group == cli.BENCH_GROUP else [],
    )
    args = cli.build_parser().parse_args(["bench", "fake", "--json", "--total-mib", "1"])
    assert args.func(args) == 0


def test_shm_list_shows_owners_and_reclaim_removes_only_dead_ones():
    """``tpusync shm list`` tells a live pool's segment from a killed process's (removing
    nothing); ``tpusync shm reclaim`` removes the latter only (OWNER LOCK CONTRACT)."""
    import os
    import signal

    import tpusync.core as tc

    prefix = f"tpusync-pytest-cli-{os.getpid()}-"
    live = tc.HostBlockPool(4096, 4, shm_name=prefix + "live")
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, tpusync.core as tc\n"
            f"p = tc.HostBlockPool(4096, 4, shm_name='{prefix}killed')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n",
        ],
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL
    try:
        listed = json.loads(run_cli("shm", "list", "--prefix", prefix, "--json"))
        assert listed == [
            {"name": prefix + "killed", "bytes": live.native.pool_bytes, "owner": "none"},
            {"name": prefix + "live", "bytes": live.native.pool_bytes, "owner": "live"},
        ]
        assert os.path.exists(f"/dev/shm/{prefix}killed")  # looking removes nothing
        gone = json.loads(run_cli("shm", "reclaim", "--prefix", prefix, "--json"))
        assert gone == [{"name": prefix + "killed", "bytes": live.native.pool_bytes}]
        assert not os.path.exists(f"/dev/shm/{prefix}killed")
        assert os.path.exists(f"/dev/shm/{prefix}live")
        bad = subprocess.run(
            [sys.executable, "-m", "tpusync.core.cli", "shm", "reclaim", "--prefix", "tpu"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert bad.returncode == 2 and bad.stdout == ""
        assert "tpusync shm reclaim: shm segment prefix 'tpu' must be 8-200" in bad.stderr
    finally:
        live.native.unlink()
        if os.path.exists(f"/dev/shm/{prefix}killed"):
            os.unlink(f"/dev/shm/{prefix}killed")


@pytest.mark.parametrize(
    "args, message",
    [
        (["store-node", "--capacity", "99999999999999999999TiB"], "is too large a size"),
        (["store-node", "--metrics-port", "99999"], "is not a TCP port (1..65535)"),
        (["bench", "memory", "--total-mib", "-1"], "--total-mib: -1 is not >= 1"),
        (["bench", "memory", "--repeats", "0"], "--repeats: 0 is not >= 1"),
        (["bench", "tiers", "--lookup-keys", "abc"], "--lookup-keys: 'abc' is not an integer"),
        (["bench", "transport", "--streams", "0"], "--streams: 0 is not >= 1"),
        (["demo", "--layers", "0"], "--layers: 0 is not >= 1"),
        (["bench", "memory", "--total-mib", "1", "--quiet"], "give at least 2 MiB"),
        (["demo", "--blocks", "1"], "blocks 1: at least 2"),
        (["bench", "tiers", "--session-tokens", "16", "--quiet"], "session_tokens 16 is below"),
        (["bench", "memory", "--link-gbit", "inf"], "--link-gbit: inf is not a finite rate"),
        (["bench", "memory", "--link-gbit", "-1"], "--link-gbit: -1 is not a finite rate"),
        (["bench", "memory", "--dir", "/tmp"], "--dir applies to the tiers suite only"),
        (["bench", "memory", "--streams", "2"], "--streams applies to the transport suite only"),
        (["bench", "transport", "--session-tokens", "2048"], "--session-tokens applies to"),
    ],
    ids=[
        "capacity",
        "port",
        "total-mib",
        "repeats",
        "lookup-keys",
        "streams",
        "layers",
        "tiny",
        "demo-blocks",
        "session-tokens",
        "link-inf",
        "link-negative",
        "dir-elsewhere",
        "streams-elsewhere",
        "tokens-elsewhere",
    ],  # fmt: skip
)
def test_bad_numbers_get_one_line_and_exit_2(args, message):
    """Each printed a traceback (exit 1), a cryptic error, or silently ran the defaults."""
    bad = subprocess.run(
        [sys.executable, "-m", "tpusync.core.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2, bad.stderr
    assert message in bad.stderr
    assert "Traceback" not in bad.stderr
