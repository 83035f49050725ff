"""Mooncake Transfer Engine over loopback TCP, for comparison with `tpusync bench transport`.

Runs in its own venv (Mooncake is not a tpusync dependency):
    python3 -m venv build/mooncake-venv
    build/mooncake-venv/bin/pip install mooncake-transfer-engine-non-cuda numpy
    build/mooncake-venv/bin/python bench/mooncake_transfer.py --total-mib 1024 --block-mib 2

Moves total bytes in block-sized pieces from an initiator engine's registered buffer into a target
engine's registered buffer (batch_transfer_sync_write, TCP transport, P2P handshake) in one
process, and prints JSON with the median GB/s of several runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mooncake.engine import TransferEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--block-mib", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    total, block = args.total_mib << 20, args.block_mib << 20
    n = total // block

    target, initiator = TransferEngine(), TransferEngine()
    for e in (target, initiator):
        if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("mooncake: initialize failed")
    dst = np.zeros(total, dtype=np.uint8)
    src = np.full(total, 7, dtype=np.uint8)
    dst[:] = 1  # prefault both
    for e, buf in ((target, dst), (initiator, src)):
        if e.register_memory(buf.ctypes.data, buf.nbytes) != 0:
            raise SystemExit("mooncake: register_memory failed")
    session = f"127.0.0.1:{target.get_rpc_port()}"
    srcs = [src.ctypes.data + i * block for i in range(n)]
    dsts = [dst.ctypes.data + i * block for i in range(n)]
    lens = [block] * n

    def once() -> float:
        t0 = time.perf_counter()
        if initiator.batch_transfer_sync_write(session, srcs, dsts, lens) != 0:
            raise SystemExit("mooncake: transfer failed")
        return time.perf_counter() - t0

    once()  # warm: handshake
    secs = statistics.median(once() for _ in range(args.repeats))
    if not (dst[::block] == 7).all():
        raise SystemExit("mooncake: data check failed")
    print(json.dumps({"engine": "mooncake-transfer-engine-non-cuda", "transport": "tcp",
                      "bytes": n * block, "block_bytes": block, "gbps": round(total / secs / 1e9, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
