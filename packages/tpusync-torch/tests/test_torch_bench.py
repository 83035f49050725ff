from tpusync.core.bench.common import run_suite


def test_bench_device_is_a_plugin_suite_with_same_run_reference():
    data = run_suite("device", "--total-mib", "8", "--repeats", "1")
    assert data["suite"] == "device" and isinstance(data["goal_met"], bool)
    layouts = {(r["device"], r["layout"]) for r in data["results"]}
    assert {("cpu", "vllm_cpu"), ("cpu", "jax_pages")} <= layouts
    for r in data["results"]:
        for path in ("d2h", "h2d"):
            e = r[path]
            assert e["gbps"] > 0 and e["limit_gbps"] > 0 and e["better"] == "higher"
            assert abs(e["ratio"] - e["gbps"] / e["limit_gbps"]) < 0.01
