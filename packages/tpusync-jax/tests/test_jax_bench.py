import json
import subprocess
import sys


def test_bench_device_jax_is_a_plugin_suite_with_same_run_reference():
    # -X faulthandler: a crash of the child prints its Python stacks into the failure message.
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "tpusync.core.cli", "bench", "device-jax"]
        + ["--json", "--quiet", "--total-mib", "8", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}, stderr:\n{proc.stderr[-6000:]}"
    data = json.loads(proc.stdout)
    assert data["suite"] == "device-jax" and isinstance(data["goal_met"], bool)
    for r in data["results"]:
        for path in ("d2h", "h2d"):
            e = r[path]
            assert e["gbps"] > 0 and e["limit_gbps"] > 0 and e["better"] == "higher"
            assert abs(e["ratio"] - e["gbps"] / e["limit_gbps"]) < 0.01
    # CPU devices: the goal row is the default (native) path; the staged rows, unpinned and
    # through the pinned_host memory kind, are reported beside it and are not part of the goal.
    rows = [(r["path"], r["host_memory"], r["goal"]) for r in data["results"]]
    assert rows == [
        ("native", "-", True),
        ("staged", "unpinned", False),
        ("staged", "pinned_host", False),
    ]
    goal = all(r[p]["ratio"] >= 0.9 for r in data["results"] if r["goal"] for p in ("d2h", "h2d"))
    assert data["goal_met"] == goal
