"""Prefill -> decode across two "hosts": two network namespaces joined by a veth pair, each with
its own address, so the KV blocks cross a real (virtual) network link over authenticated TCP.

Needs root and iproute2 (like the `multihost` nox session). Creates only the namespaces
tpsx<pid>a / tpsx<pid>b and the 10.233.<n>.0/30 link between them, and deletes them on exit.
Exit status 0 only when the decode side found every byte equal.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "single_host_disagg" / "disagg.py"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=12)
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("multihost_disagg needs root and iproute2 (network namespaces); not run")
        return 2
    tag = f"{os.getpid() % 100000}"
    a, b = f"tpsx{tag}a", f"tpsx{tag}b"
    subnet = f"10.233.{os.getpid() % 200 + 1}"
    addr_a, addr_b = f"{subnet}.1", f"{subnet}.2"
    env = dict(os.environ)
    env.setdefault("TPUSYNC_AUTH_SECRET", secrets.token_hex(16))
    prefill = None
    try:
        ip("netns", "add", a)
        ip("netns", "add", b)
        ip("link", "add", f"tx{tag}a", "netns", a, "type", "veth", "peer", "name", f"tx{tag}b",
           "netns", b)  # fmt: skip
        for ns, dev, addr in ((a, f"tx{tag}a", addr_a), (b, f"tx{tag}b", addr_b)):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
        prefill = subprocess.Popen(
            ["ip", "netns", "exec", a, sys.executable, str(SCRIPT), "prefill",
             "--blocks", str(args.blocks), "--listen", f"{addr_a}:0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        line = prefill.stdout.readline()
        if not line:
            print("prefill exited before publishing (see its stderr above)")
            return 1
        p = json.loads(line)
        out = subprocess.run(
            ["ip", "netns", "exec", b, sys.executable, str(SCRIPT), "decode",
             "--blocks", str(args.blocks), "--peer", p["tcp"]],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        if not out.stdout.strip():
            print(f"decode failed:\n{out.stderr}")
            return 1
        d = json.loads(out.stdout.strip().splitlines()[-1])
        prefill.stdin.write("done\n")
        prefill.stdin.flush()
        prefill.wait(timeout=30)
        same = p["sha256"] == d["sha256"] and d["bytes_equal"] and d["other_blocks_untouched"]
        mib_s = d["bytes"] / max(d["recv_s"], 1e-9) / 2**20
        print(f"prefill in netns {a} ({addr_a}) published {p['blocks']} blocks "
              f"({p['bytes']} bytes) sha256={p['sha256']} on {p['tcp']}")  # fmt: skip
        print(f"decode in netns {b} ({addr_b}) received them in {d['recv_s']:.3f} s "
              f"({mib_s:.0f} MiB/s) sha256={d['sha256']} | bytes equal: {same}")  # fmt: skip
        print("OK: decode holds exactly the prefill's KV" if same else "FAILED: bytes differ")
        return 0 if same else 1
    finally:
        if prefill is not None and prefill.poll() is None:
            prefill.kill()
            prefill.wait(timeout=10)
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())
