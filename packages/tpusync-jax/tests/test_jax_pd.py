"""P/D between two real processes: a JAX producer process and a torch consumer (this process),
over authenticated TCP on 127.0.0.1 (ephemeral port) through PdBlockTransport."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tpusync.core as tc
from tpusync.core.pd import SECRET_ENV

torch = pytest.importorskip("torch")
from tpusync.torch import KVCacheManager as TorchManager  # noqa: E402
from tpusync.torch import PdBlockTransport  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from pd_peer_jax import host_caches  # noqa: E402

PEER = Path(__file__).with_name("pd_peer_jax.py")
SECRET = "jax-to-torch-test-secret-0123"


def test_jax_producer_process_to_torch_consumer_then_producer_dies():
    """The torch consumer's own layout (same format) receives the JAX producer's blocks; a
    fetch whose producer process was killed fails instead of hanging."""
    proc = subprocess.Popen(
        [sys.executable, str(PEER), "req=4,9", "late=1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, SECRET_ENV: SECRET},
    )
    try:
        line = proc.stdout.readline()
        assert line, f"producer exited ({proc.wait(timeout=10)}) before publishing"
        address = json.loads(line)["address"]
        host, lay = host_caches()
        dst = [tuple(torch.zeros(lay.shape) for _ in range(2)) for _ in host]
        probe = TorchManager(dst, lay, host_blocks=1)
        pool = tc.HostBlockPool(probe.host_block_bytes, 32)
        cons = TorchManager(
            dst, lay, pool=pool, transport=PdBlockTransport(pool, secret=SECRET.encode())
        )
        cons.start_recv(address, "req", [0, 1], timeout=30).result(timeout=40)
        for parts, hparts in zip(dst, host, strict=True):
            for t, h in zip(parts, hparts, strict=True):
                np.testing.assert_array_equal(t[:, 0].numpy(), h[:, 4])
                np.testing.assert_array_equal(t[:, 1].numpy(), h[:, 9])
                assert not t[:, 2:].any()
        proc.kill()
        proc.wait(timeout=10)
        with pytest.raises(tc.UnavailableError, match="late"):
            cons.start_recv(address, "late", [5], timeout=30).result(timeout=40)
        polled = cons.poll()
        assert polled["done"] == ["req"] and list(polled["failed"]) == ["late"]
        assert pool.num_free == pool.num_blocks
    finally:
        proc.kill()
        proc.wait(timeout=10)
