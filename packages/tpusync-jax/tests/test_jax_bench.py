from tpusync.core.bench.common import run_suite


def test_bench_device_jax_is_a_plugin_suite_with_same_run_reference():
    data = run_suite("device-jax", "--total-mib", "8", "--repeats", "1")
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
