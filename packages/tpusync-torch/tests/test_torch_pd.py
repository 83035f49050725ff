"""P/D between two real processes: a torch producer process, a torch consumer (this process),
over authenticated TCP on 127.0.0.1 (ephemeral port) through PdBlockTransport."""

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


def start_producer(sends: dict[str, list[int]]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, SECRET_ENV: SECRET}  # the secret never goes on a command line
    proc = subprocess.Popen(
        [sys.executable, str(PEER), *(f"{t}={','.join(map(str, b))}" for t, b in sends.items())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()  # the producer prints its address once published
    if not line:
        proc.kill()
        pytest.fail(f"producer exited ({proc.wait(timeout=10)}) before publishing")
    return proc, json.loads(line)["address"]


def consumer() -> tuple[KVCacheManager, list[torch.Tensor], list[torch.Tensor]]:
    src, lay = make_caches()
    dst = [torch.zeros_like(c) for c in src]
    probe = KVCacheManager(dst, lay, host_blocks=1)
    pool = tc.HostBlockPool(probe.host_block_bytes, 64)
    transport = PdBlockTransport(pool, secret=SECRET.encode())
    return KVCacheManager(dst, lay, pool=pool, transport=transport), src, dst


def test_torch_producer_process_to_torch_consumer_then_producer_dies():
    """One producer process (process start-up dominates on a loaded CI box): a verified
    transfer with the producer's acknowledged release, then SIGKILL and a fetch that fails."""
    proc, address = start_producer({"req-7": [3, 8, 11], "req-late": [1, 2]})
    try:
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        mgr, src, dst = consumer()
        mgr.start_recv(address, "req-7", [0, 1, 2], timeout=30).result(timeout=40)
        assert mgr.poll() == {"done": ["req-7"], "failed": {}}
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
