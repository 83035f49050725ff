"""Mooncake Transfer Engine as an optional same-run reference of ``tpusync bench transport``.

CONTRACT: :func:`run_reference` never raises and never waits past its timeout. It moves the same
number of blocks of the same size as the tpusync TCP rows (the initiator pulls them with one
``batch_transfer_sync_read`` per repeat: TCP protocol, ``P2PHANDSHAKE`` metadata, both engines on
loopback, default Mooncake settings), verifies every block's bytes, and returns either the median
seconds or the reason it could not run (not installed, import error, engine error, timeout).

It runs in a child process (``python -m tpusync.core.bench.mooncake_ref``): the Mooncake engine
loads its own native libraries and logging, a hang cannot stall the bench, and a crash cannot take
the bench down. Both engines live in that one child, as tpusync's producer and consumer share the
bench process. Rejected alternative: importing ``mooncake.engine`` into the bench process - a wait
inside the engine has no timeout we could impose there.

Which wheel: ``mooncake-transfer-engine`` (the CUDA build) needs ``libcudart.so.12`` and
``libcuda.so.1`` at import; on a machine without an NVIDIA driver the bench session installs
``mooncake-transfer-engine-non-cuda`` (same engine, same version line, no CUDA dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROTOCOL = "tcp"
METADATA = "P2PHANDSHAKE"


def run_reference(blocks: int, block_bytes: int, repeats: int, timeout: float = 300.0) -> dict:
    """``{"seconds": median, "repeats": [...]}`` or ``{"skipped": reason}``; never raises."""
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "2")  # the engine logs every connection at INFO
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    cmd = [
        sys.executable,
        "-m",
        "tpusync.core.bench.mooncake_ref",
        "--blocks",
        str(blocks),
        "--block-bytes",
        str(block_bytes),
        "--repeats",
        str(repeats),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"Mooncake reference did not finish within {timeout:.0f} s"}
    except OSError as e:
        return {"skipped": f"cannot start the Mooncake reference: {e}"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"skipped": f"Mooncake reference exited {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def _child(blocks: int, block_bytes: int, repeats: int) -> dict:
    try:
        import numpy as np
        from mooncake.engine import TransferEngine
    except ImportError as e:  # not installed, or its native libraries are missing
        return {"skipped": f"mooncake.engine is not importable here: {e}"}
    nbytes = blocks * block_bytes
    src = np.empty(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)  # zeros + first write below prefault both
    for i in range(blocks):
        src[i * block_bytes : (i + 1) * block_bytes] = i % 251
    dst[:] = 1
    target, initiator = TransferEngine(), TransferEngine()
    for name, eng, buf in (("target", target, src), ("initiator", initiator, dst)):
        rc = eng.initialize("127.0.0.1", METADATA, PROTOCOL, "")
        if rc != 0:
            return {"skipped": f"Mooncake {name} initialize(tcp, P2PHANDSHAKE) returned {rc}"}
        rc = eng.register_memory(buf.ctypes.data, nbytes)
        if rc != 0:
            return {"skipped": f"Mooncake {name} register_memory returned {rc}"}
    session = f"127.0.0.1:{target.get_rpc_port()}"
    local = [dst.ctypes.data + i * block_bytes for i in range(blocks)]
    remote = [src.ctypes.data + i * block_bytes for i in range(blocks)]
    lengths = [block_bytes] * blocks

    def pull() -> float:
        t0 = time.perf_counter()
        rc = initiator.batch_transfer_sync_read(session, local, remote, lengths)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_read returned {rc}")
        return dt

    try:
        pull()  # warm: handshake + connections
        if not np.array_equal(src, dst):
            return {"skipped": "Mooncake moved wrong bytes"}
        times = []
        for _ in range(repeats):
            dst[:] = 0
            times.append(pull())
            if not np.array_equal(src, dst):
                return {"skipped": "Mooncake moved wrong bytes"}
    except RuntimeError as e:
        return {"skipped": f"Mooncake transfer failed: {e}"}
    import importlib.metadata as md

    version = "unknown"
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            version = f"{dist} {md.version(dist)}"
            break
        except md.PackageNotFoundError:
            continue
    return {
        "seconds": statistics.median(times),
        "repeats": [round(t, 4) for t in times],
        "version": version,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--block-bytes", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    print(json.dumps(_child(a.blocks, a.block_bytes, a.repeats)), flush=True)
    # The engine's threads may outlive main; do not wait for their teardown.
    os._exit(0)


if __name__ == "__main__":
    main()
