"""Run tpusync's benchmark suites at a small size and plot them (one PNG per suite).

Each suite is ``tpusync bench <suite> --json`` (the convention in tpusync.core.bench: every
measured path has ``gbps``, the same-run reference ``limit_gbps`` and their ``ratio``). This
script walks the JSON generically, prints one line per measured path and draws, per suite, the
figure next to its reference. Small sizes keep it CI-fast; the figures are then noisy and say
little about a real machine - run with ``--total-mib 256 --repeats 5`` for meaningful ones.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def run_suite(suite: str, total_mib: int, repeats: int, workdir: str) -> dict:
    cmd = [sys.executable, "-m", "tpusync.core.cli", "bench", suite, "--json", "--quiet",
           "--total-mib", str(total_mib), "--repeats", str(repeats)]  # fmt: skip
    if suite == "tiers":
        cmd += ["--dir", workdir, "--lookup-keys", "1000,10000", "--session-tokens", "8192"]
    if suite == "transport":
        cmd += ["--streams", "1", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def paths(node: Any, label: str = "") -> list[tuple[str, dict]]:
    """Every measured throughput entry (a dict with 'gbps') with a readable label."""
    found: list[tuple[str, dict]] = []
    if isinstance(node, dict):
        if "gbps" in node or "latency_us" in node:
            extra = f" streams={node['streams']}" if "streams" in node else ""
            return [(label.strip(" /") + extra, node)]
        tag = ""
        for key in ("block_bytes", "streams", "keys", "name", "path"):
            if key in node and not isinstance(node[key], dict | list):
                v = node[key]
                tag = f"{v >> 10} KiB" if key == "block_bytes" and v >= 1024 else f"{key}={v}"
                break
        for k, v in node.items():
            if isinstance(v, dict | list):
                found += paths(v, f"{label} {tag} {k}" if k != "results" else f"{label} {tag}")
    elif isinstance(node, list):
        for v in node:
            found += paths(v, label)
    return found


def plot(suite: str, entries: list[tuple[str, dict]], out: Path) -> None:
    entries = [(lbl, e) for lbl, e in entries if "gbps" in e]
    labels = [" ".join(lbl.split()) for lbl, _ in entries]
    gbps = [e["gbps"] for _, e in entries]
    limits = [e.get("limit_gbps") or 0.0 for _, e in entries]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(entries) + 1.5))
    y = range(len(entries))
    ax.barh([i + 0.2 for i in y], gbps, height=0.4, label="tpusync")
    ax.barh([i - 0.2 for i in y], limits, height=0.4, label="same-run reference", alpha=0.6)
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s")
    ax.set_title(f"tpusync bench {suite} (small size: indicative only)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--suites", nargs="+", default=["memory", "tiers", "transport"])
    ap.add_argument("--total-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="build/examples/microbenchmarks")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tpusync-bench-") as tmp:
        for suite in args.suites:
            result = run_suite(suite, args.total_mib, args.repeats, tmp)
            (out / f"{suite}.json").write_text(json.dumps(result, indent=2))
            entries = paths(result)
            if not entries:
                print(f"{suite}: no throughput entries in the JSON")
                continue
            for label, e in entries:
                name = " ".join(label.split())
                ratio = f"{e['ratio']:.2f}" if e.get("ratio") is not None else "-"
                if "gbps" in e:
                    ref = f"{e['limit_gbps']:.2f}" if e.get("limit_gbps") else "-"
                    fig, unit = f"{e['gbps']:8.2f}", "GB/s"
                else:
                    ref, fig, unit = f"{e['limit_us']:.1f}", f"{e['latency_us']:8.1f}", "us  "
                print(f"{suite:9} {name:32} {fig} {unit}  reference {ref:>6} {unit}  "
                      f"ratio {ratio:>5}  ({e.get('limit', '')[:70]})")  # fmt: skip
            png = out / f"{suite}.png"
            plot(suite, entries, png)
            print(f"wrote {png} and {out / (suite + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
