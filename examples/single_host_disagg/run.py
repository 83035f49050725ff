"""Prefill process -> decode process on one host, through the same-host path (Unix socket + the
prefill's /dev/shm host pool), then once more over loopback TCP. Exit status 0 only when the
decode side found every byte equal. Small by default; ``--blocks`` makes it bigger."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "disagg.py"


def handoff(blocks: int, via: str, env: dict[str, str], tmp: str) -> dict:
    shm = f"tpusync-example-{os.getpid()}-{via}"
    unix = os.path.join(tmp, f"{via}.sock")
    prefill = subprocess.Popen(
        [sys.executable, str(SCRIPT), "prefill", "--blocks", str(blocks),
         "--unix", unix, "--shm", shm],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = prefill.stdout.readline()
        if not line:
            raise SystemExit("prefill exited before publishing (see its stderr above)")
        p = json.loads(line)
        peer = p["unix"] if via == "unix" else p["tcp"]  # unix_address reads "unix:PATH"
        out = subprocess.run(
            [sys.executable, str(SCRIPT), "decode", "--blocks", str(blocks), "--peer", peer],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        if out.returncode != 0 and not out.stdout:
            raise SystemExit(f"decode failed:\n{out.stderr}")
        d = json.loads(out.stdout.strip().splitlines()[-1])
        prefill.stdin.write("done\n")
        prefill.stdin.flush()
        prefill.wait(timeout=30)
        return {"prefill": p, "decode": d}
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait(timeout=10)
        Path(f"/dev/shm/{shm}").unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=12)
    args = ap.parse_args()
    if args.blocks < 1:
        ap.error(f"--blocks {args.blocks}: at least 1")
    env = dict(os.environ)
    env.setdefault("TPUSYNC_AUTH_SECRET", secrets.token_hex(16))
    ok = True
    with tempfile.TemporaryDirectory(prefix="tpusync-disagg-") as tmp:
        for via in ("unix", "tcp"):
            r = handoff(args.blocks, via, env, tmp)
            p, d = r["prefill"], r["decode"]
            same = p["sha256"] == d["sha256"] and d["bytes_equal"] and d["other_blocks_untouched"]
            ok &= same
            mib_s = d["bytes"] / max(d["recv_s"], 1e-9) / 2**20
            print(
                f"[{via:4}] prefill published {p['blocks']} blocks ({p['bytes']} bytes) "
                f"sha256={p['sha256']} | decode received from {d['peer']} in {d['recv_s']:.3f} s "
                f"({mib_s:.0f} MiB/s) sha256={d['sha256']} | bytes equal: {same}"
            )
    print("OK: decode holds exactly the prefill's KV" if ok else "FAILED: bytes differ")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
