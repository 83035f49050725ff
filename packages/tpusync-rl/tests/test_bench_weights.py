"""``tpusync bench weights`` end to end at a small size: every path runs in real processes and the
JSON carries each row against its same-run reference (the figures themselves mean nothing at
32 MiB; the goal figures come from the 1 GiB default, docs/rl.md)."""

from __future__ import annotations

import os
import statistics

import pytest

from tpusync.core.bench import hosts
from tpusync.core.bench.common import run_suite


def test_bench_weights_json_has_every_path_against_its_same_run_reference():
    data = run_suite("weights", "--total-mib", "32", "--repeats", "2", timeout=900)
    assert data["suite"] == "weights" and data["bytes"] == 32 << 20
    paths = data["paths"]
    reported = {
        "chain_tcp_vs_gloo": "tcp",
        "chain_same_host_vs_gloo": "unix",
        "shared_same_host_vs_gloo": "shared-segment",
        "shared_same_host_vs_cpu_floor": "shared-segment",
    }
    rounds = data["rounds"]
    refs = {"chain_tcp_vs_gloo": "gloo", "shared_same_host_vs_cpu_floor": "cpu_floor"}
    for name, path in reported.items():
        row = paths[name]
        assert row["gbps"] > 0 and row["limit_gbps"] > 0 and row["better"] == "higher", name
        # PAIRED ROUNDS: the ratio is the median of the per-round ratios (two rounds here).
        assert len(row["ratio_rounds"]) == 2, row
        assert row["ratio"] == pytest.approx(statistics.median(row["ratio_rounds"]), abs=0.002)
        assert f"(samplers reported: {path})" in row["path"], row["path"]
    for name, ref in refs.items():
        mine = name.split("_vs_")[0]
        want = [r / s for s, r in zip(rounds[mine], rounds[ref], strict=True)]
        assert paths[name]["ratio_rounds"] == pytest.approx(want, rel=0.01, abs=0.002), name
    floor = paths["cpu_floor_vs_gloo"]
    assert floor["limit"].startswith("torch.distributed gloo")
    secs = data["seconds"]
    assert {len(v) for v in rounds.values()} == {2} and set(rounds) == set(secs), rounds
    # "rounds" holds figures rounded to 0.1 ms, "seconds" the median of the raw ones.
    assert secs["gloo"] == pytest.approx(statistics.median(rounds["gloo"]), rel=1e-3, abs=1e-4)
    # The floor is the shared path's work without its waits: the path cannot beat it by much.
    assert secs["shared_same_host"] > 0.5 * secs["cpu_floor"]
    assert paths["resharded_vs_plain"]["ratio"] > 0
    # 2 MiB tensors are one 4 MiB chunk each: here a per-chunk delta is a per-tensor one.
    assert paths["delta_contiguous_chunk_vs_tensor"]["ratio"] == 1.0
    if data["iperf3"]:
        assert paths["chain_tcp_vs_iperf3"]["limit"].startswith("iperf3")
    links = data["links"]
    # integration-rl sets TPUSYNC_NETNS=1 where it can make emulated hosts (CI: root): the rows
    # must then be there, never skipped in silence.
    if os.environ.get("TPUSYNC_NETNS") == "1":
        assert hosts.unavailable() is None and data["iperf3"], (hosts.unavailable(), data["iperf3"])
    if links["skipped"] is None:
        assert links["gbit"] == 2.0
        assert links["queue"] in ("sparse-first", "fifo"), links
        for name in ("chain_links_vs_gloo", "chain_links_vs_iperf3"):
            row = paths[name]
            assert abs(row["ratio"] - row["gbps"] / row["limit_gbps"]) < 0.01, name
            assert "(samplers reported: tcp)" in row["path"] and "emulated host" in row["path"]
        secs = links["seconds"]
        # Shaped links: nothing crosses one faster than its rate (2 Gbit/s = 0.25 GB/s), and
        # gloo's root sends every byte twice through its link.
        for name, copies in (("chain", 1), ("iperf3", 1), ("gloo", 2)):
            assert copies * (32 << 20) / secs[name] < 0.3e9, (name, secs[name])
    else:
        assert links["skipped"], links
