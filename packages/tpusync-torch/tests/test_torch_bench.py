import json
import subprocess
import sys


def test_bench_device_is_a_plugin_suite_with_same_run_reference():
    # -X faulthandler: a crash of the child prints its Python stacks into the failure message.
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "tpusync.core.cli", "bench", "device"]
        + ["--json", "--quiet", "--total-mib", "8", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}, stderr:\n{proc.stderr[-6000:]}"
    data = json.loads(proc.stdout)
    assert data["suite"] == "device" and isinstance(data["goal_met"], bool)
    layouts = {(r["device"], r["layout"]) for r in data["results"]}
    assert {("cpu", "vllm_cpu"), ("cpu", "jax_pages")} <= layouts
    for r in data["results"]:
        for path in ("d2h", "h2d"):
            e = r[path]
            assert e["gbps"] > 0 and e["limit_gbps"] > 0 and e["better"] == "higher"
            assert abs(e["ratio"] - e["gbps"] / e["limit_gbps"]) < 0.01
