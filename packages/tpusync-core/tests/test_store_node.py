"""Store nodes as real subprocesses (`tpusync store-node`) on 127.0.0.1 ephemeral ports."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import tpusync.core as tc
from tpusync.core.store_node import StoreClient, parse_size

SECRET = b"store-node-pytest-secret-0123456789"
BLOCK = 32 << 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def secret_file(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    f.chmod(0o600)
    return f


def start_node(secret_file, metrics_port=None, capacity="4MiB"):
    cmd = [sys.executable, "-m", "tpusync.core.cli", "store-node", "--listen", "127.0.0.1:0",
           "--capacity", capacity, "--block-bytes", str(BLOCK),
           "--auth-secret-file", str(secret_file)]  # fmt: skip
    if metrics_port:
        cmd += ["--metrics-port", str(metrics_port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "store node did not start"
    return proc, json.loads(line)


def stop(proc, sig=signal.SIGTERM):
    if proc.poll() is None:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    return out


def test_parse_size():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("256KiB") == 256 << 10
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("lots")


def test_store_node_serves_and_shuts_down_on_sigterm(secret_file):
    port = free_port()
    proc, info = start_node(secret_file, metrics_port=port)
    try:
        pool = tc.HostBlockPool(BLOCK, 16)
        client = StoreClient(pool, [info["address"]], secret=SECRET)
        src = pool.alloc(6)
        for i, b in enumerate(src):
            pool.view(b)[:] = i + 1
        keys = [f"prefix-{i}" for i in range(6)]
        assert client.put(keys, src) == [1] * 6
        assert client.lookup_prefix([*keys[:3], "absent", keys[4]]) == 3
        dst = pool.alloc(6)
        assert client.get(keys, dst) == [True] * 6
        for i, b in enumerate(dst):
            assert (pool.view(b) == i + 1).all()
        assert client.remove(keys[:2]) == [True, True]
        assert client.lookup_prefix(keys) == 0
        body = urllib.request.urlopen(info["metrics"], timeout=10).read().decode()
        assert "tpusync_store_put_blocks_total 6.0" in body
        assert "tpusync_store_blocks_used 4.0" in body
        # A client with the wrong secret is refused, and the node counts it.
        bad = StoreClient(pool, [info["address"]], secret=b"wrong-secret-0123456789abc")
        with pytest.raises(tc.AuthError):
            bad.lookup_prefix(keys)
    finally:
        out = stop(proc)
    assert proc.returncode == 0
    final = json.loads(out.strip().splitlines()[-1])
    assert final["stopped"] and final["stats"]["rejected_peers"] == 1


def test_replicated_nodes_survive_a_killed_node(secret_file):
    procs = [start_node(secret_file) for _ in range(3)]
    try:
        addrs = [info["address"] for _, info in procs]
        pool = tc.HostBlockPool(BLOCK, 64)
        client = StoreClient(pool, addrs, replication=2, secret=SECRET, timeout=5.0)
        keys = [f"k{i}" for i in range(20)]
        src = pool.alloc(20)
        for i, b in enumerate(src):
            pool.view(b)[:] = np.uint8(i * 3)
        assert client.put(keys, src) == [2] * 20
        stop(procs[0][0], signal.SIGKILL)  # a node dies without warning
        dst = pool.alloc(20)
        assert client.get(keys, dst) == [True] * 20
        for i, b in enumerate(dst):
            assert (pool.view(b) == np.uint8(i * 3)).all()
        assert client.lookup_prefix(keys) == 20
    finally:
        for proc, _ in procs:
            stop(proc)
