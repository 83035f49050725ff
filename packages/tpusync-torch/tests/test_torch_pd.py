"""P/D between two real processes: a torch producer process, a torch consumer (this process),
through PdBlockTransport - over authenticated TCP on 127.0.0.1 (ephemeral port), and over the
same-host path (producer pool in /dev/shm, Unix socket, shm copies)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpusync.core as tc
from tpusync.core.pd import SECRET_ENV
from tpusync.torch import KVCacheManager, PdBlockTransport

sys.path.insert(0, str(Path(__file__).parent))
from pd_peer_torch import make_caches  # noqa: E402

PEER = Path(__file__).with_name("pd_peer_torch.py")
SECRET = "two-process-test-secret-0123"


def start_producer(
    sends: dict[str, list[int]], same_host: list[str] | None = None
) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, SECRET_ENV: SECRET}  # the secret never goes on a command line
    proc = subprocess.Popen(
        [
            sys.executable,
            str(PEER),
            *(same_host or []),
            *(f"{t}={','.join(map(str, b))}" for t, b in sends.items()),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()  # the producer prints its address once published
    if not line:
        proc.kill()
        pytest.fail(f"producer exited ({proc.wait(timeout=10)}) before publishing")
    return proc, json.loads(line)


def consumer() -> tuple[KVCacheManager, list[torch.Tensor], list[torch.Tensor]]:
    src, lay = make_caches()
    dst = [torch.zeros_like(c) for c in src]
    probe = KVCacheManager(dst, lay, host_blocks=1)
    pool = tc.HostBlockPool(probe.host_block_bytes, 64)
    transport = PdBlockTransport(pool, secret=SECRET.encode())
    return KVCacheManager(dst, lay, pool=pool, transport=transport), src, dst


@pytest.mark.parametrize("path", ["tcp", "same_host_shm"])
def test_torch_producer_process_to_torch_consumer_then_producer_dies(path, tmp_path):
    """One producer process (process start-up dominates on a loaded CI box): a verified
    transfer with the producer's acknowledged release, then SIGKILL and a fetch that fails."""
    same_host = None
    if path == "same_host_shm":
        shm = f"tpusync-test-pd-{os.getpid()}"
        same_host = ["--shm", shm, "--unix", str(tmp_path / "pd.sock")]
    proc, addrs = start_producer({"req-7": [3, 8, 11], "req-late": [1, 2]}, same_host)
    try:
        tcp = addrs["address"]
        assert tcp.startswith("127.0.0.1:") and not tcp.endswith(":0")
        address = tcp if same_host is None else addrs["unix_address"]
        assert address.startswith("unix:" if same_host else "127.0.0.1:"), addrs
        mgr, src, dst = consumer()
        mgr.start_recv(address, "req-7", [0, 1, 2], timeout=30).result(timeout=40)
        assert mgr.poll() == {"done": ["req-7"], "failed": {}}
        st = mgr.transport.stats()
        assert st["fetched"] == 1 and st["fetched_shm"] == (1 if same_host else 0), st
        for s, d in zip(src, dst, strict=True):
            for a, b in ((3, 0), (8, 1), (11, 2)):
                assert torch.equal(d[:, b], s[:, a])  # K and V of block a landed in b
            assert not d[:, 3:].any()  # nothing else written
        assert mgr.pool.num_free == mgr.pool.num_blocks
        proc.stdin.write("req-7\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"released": True}

        proc.kill()  # dies with "req-late" still published
        proc.wait(timeout=10)
        f = mgr.start_recv(address, "req-late", [4, 5], timeout=30)
        with pytest.raises(tc.UnavailableError, match="req-late"):
            f.result(timeout=40)
        assert "req-late" in mgr.poll()["failed"]
        assert not any(d[:, 4:].any() for d in dst)
        assert mgr.pool.num_free == mgr.pool.num_blocks
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if same_host is not None:  # a killed producer leaves its named segment (warm re-attach)
            Path("/dev/shm", shm).unlink(missing_ok=True)
