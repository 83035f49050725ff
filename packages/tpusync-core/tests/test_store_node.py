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


def test_a_node_that_cannot_start_says_why_in_one_line(secret_file, tmp_path):
    """Start-up failures exit 2 with one ``tpusync store-node: <why>`` line, no traceback: the
    address in use, the metrics port in use, a size it cannot read. A put with the wrong secret
    raises like a get (it returned 0 replicas before)."""
    proc, info = start_node(secret_file, metrics_port=free_port())
    try:
        metrics_port = int(info["metrics"].rsplit(":", 1)[1].split("/")[0])
        base = [sys.executable, "-m", "tpusync.core.cli", "store-node", "--capacity", "4MiB",
                "--block-bytes", str(BLOCK), "--auth-secret-file", str(secret_file)]  # fmt: skip
        cases = {
            "address in use": (["--listen", info["address"]], "Address already in use"),
            "metrics port in use": (
                ["--listen", "127.0.0.1:0", "--metrics-port", str(metrics_port)],
                f"metrics port {metrics_port} on 127.0.0.1: Address already in use",
            ),
            "bad size": (["--listen", "127.0.0.1:0", "--capacity", "lots"], "cannot read 'lots'"),
        }
        for case, (args, why) in cases.items():
            run = subprocess.run(
                [*base, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
            )
            lines = run.stderr.strip().splitlines()
            assert run.returncode == 2, (case, run.stderr)
            assert len(lines) == 1 and lines[0].startswith("tpusync store-node: "), (case, lines)
            assert why in lines[0], (case, lines)
        pool = tc.HostBlockPool(BLOCK, 2)
        stranger = StoreClient(pool, [info["address"]], secret=b"wrong-secret-0123456789abc")
        with pytest.raises(tc.AuthError):
            stranger.put(["k"], pool.alloc(1))
    finally:
        stop(proc)


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


def start_node_at(secret_file, listen, capacity="16MiB"):
    cmd = [sys.executable, "-m", "tpusync.core.cli", "store-node", "--listen", listen,
           "--capacity", capacity, "--block-bytes", str(BLOCK),
           "--auth-secret-file", str(secret_file)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, "store node did not start"
    return proc, json.loads(line)


def _pattern(key: str) -> np.uint8:
    return np.uint8(sum(key.encode()) % 251)


def test_kill9_mid_transfer_fails_over_within_deadline_and_restart_rejoins(secret_file):
    """SIGKILL one of three nodes while a client streams 2 MiB puts / gets at them (replication 2):
    every call returns within its deadline, reads fall back to the surviving replica and never
    return wrong bytes; the node restarted on the same address takes its share again."""
    import threading
    import time

    ports = [free_port() for _ in range(3)]
    # Sized so nothing is evicted during the test (DRAM is touched only as blocks arrive).
    procs = [start_node_at(secret_file, f"127.0.0.1:{p}", capacity="256MiB") for p in ports]
    addrs = [info["address"] for _, info in procs]
    timeout = 2.0
    pool = tc.HostBlockPool(BLOCK, 256)
    client = StoreClient(pool, addrs, replication=2, secret=SECRET, timeout=timeout)
    batch = 64  # 2 MiB per request per node
    stored: list[str] = []
    problems: list[str] = []
    slowest = [0.0]
    stop_flag = threading.Event()
    round_no = [0]

    def worker() -> None:
        src, dst = pool.alloc(batch), pool.alloc(batch)
        while not stop_flag.is_set():
            r = round_no[0]
            round_no[0] += 1
            keys = [f"kill-{r}-{i}" for i in range(batch)]
            for k, b in zip(keys, src, strict=True):
                pool.view(b)[:] = _pattern(k)
            t0 = time.monotonic()
            try:
                put = client.put(keys, src)
            except tc.TpusyncError as e:  # a clean error is allowed; a hang or wrong bytes is not
                problems.append(f"put raised {e!r}")
                continue
            finally:
                slowest[0] = max(slowest[0], time.monotonic() - t0)
            if min(put) < 1:
                problems.append(f"round {r}: a key reached no replica: {put}")
                continue
            stored.extend(keys)
            probe = stored[-batch:]
            t0 = time.monotonic()
            found = client.get(probe, dst)
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            for k, b, f in zip(probe, dst, found, strict=True):
                if not f:
                    problems.append(f"lost {k}")
                elif not (pool.view(b) == _pattern(k)).all():
                    problems.append(f"wrong bytes for {k}")
            time.sleep(0.02)

    t = threading.Thread(target=worker)
    try:
        t.start()
        while round_no[0] < 3:
            time.sleep(0.01)
        stop(procs[0][0], signal.SIGKILL)  # mid-transfer: the worker is streaming right now
        killed_at = round_no[0]
        while round_no[0] < killed_at + 5:
            time.sleep(0.01)
        # Restart on the same address: it re-joins (empty) and takes its share of new puts.
        procs[0] = start_node_at(secret_file, f"127.0.0.1:{ports[0]}", capacity="256MiB")
        restarted_at = round_no[0]
        while round_no[0] < restarted_at + 3:
            time.sleep(0.01)
        stop_flag.set()
        t.join(timeout=60)
        assert not t.is_alive()
        assert problems == []
        # Every call ended within one request deadline per replica tried (plus scheduling slack).
        assert slowest[0] < 2 * timeout + 3.0
        # Every block stored before, during and after the kill still reads back correctly.
        dst = pool.alloc(batch)
        for lo in range(0, len(stored), batch):
            keys = stored[lo : lo + batch]
            found = client.get(keys, dst[: len(keys)])
            assert all(found), keys
            for k, b in zip(keys, dst, strict=False):
                assert (pool.view(b) == _pattern(k)).all(), k
        fresh = [f"after-{i}" for i in range(32)]
        src = pool.alloc(32)
        assert client.put(fresh, src) == [2] * 32  # both replicas again: the node re-joined
        assert procs[0][1]["address"] == addrs[0]
    finally:
        stop_flag.set()
        t.join(timeout=60)
        for proc, _ in procs:
            stop(proc)


def test_kvstore_with_remote_nodes_demotes_and_shares(secret_file):
    """KVStore(remote=...): the host tier demotes to the nodes when full; a second store finds
    the first one's blocks by prefix lookup and reads them back byte-exact."""
    procs = [start_node(secret_file, capacity="16MiB") for _ in range(2)]
    try:
        addrs = [info["address"] for _, info in procs]
        keys = [f"shared-{i}".encode() for i in range(48)]
        rows = np.stack([np.full(BLOCK, sum(k) % 251, dtype=np.uint8) for k in keys])
        a = tc.KVStore(BLOCK, 8, remote=addrs, auth_secret_file=secret_file, replicas=2)
        for lo in range(0, len(keys), 8):
            assert all(a.put(keys[lo : lo + 8], rows[lo : lo + 8]).result(timeout=30))
        a.flush(timeout=30)
        assert a.stats()["tiers"]["remote"]["demotions_in"] >= 40
        b = tc.KVStore(BLOCK, 64, remote=addrs, auth_secret=SECRET, replicas=2)
        n, where = b.lookup(keys + [b"missing"])
        assert n == 48 and set(where) == {"remote"}
        out = np.zeros_like(rows)
        assert all(b.get(keys, out).result(timeout=30))
        assert (out == rows).all()
        assert b.lookup(keys)[1] == ["host"] * 48  # promoted into B's DRAM on read
        a.close()
        b.close()
    finally:
        for proc, _ in procs:
            stop(proc)


def test_kvstore_write_through_shares_before_any_overflow(secret_file):
    """write_through=True: every put is copied to the nodes at once (DRAM far from full), so a
    second store finds it; events announce the REMOTE copy; a dead node only counts errors."""
    proc, info = start_node(secret_file, capacity="16MiB")
    try:
        keys = [f"wt-{i}".encode() for i in range(6)]
        rows = np.stack([np.full(BLOCK, 7 * i + 1, dtype=np.uint8) for i in range(6)])
        a = tc.KVStore(
            BLOCK, 64, remote=[info["address"]], auth_secret_file=secret_file, write_through=True
        )
        a.enable_events()
        assert all(a.put(keys, rows).result(timeout=30))
        a.flush(timeout=30)  # waits for the write-through copies
        st = a.stats()
        assert st["write_through"] == 6 and st["write_through_errors"] == 0
        assert st["tiers"]["host"]["indexed"] == 6  # the DRAM copies stay
        assert st["tiers"]["remote"]["demotions_in"] == 0  # not write-back
        events, _ = a.take_events()
        assert [(k, t) for k, t, _ in events].count(("stored", "remote")) == 6
        b = tc.KVStore(BLOCK, 64, remote=[info["address"]], auth_secret=SECRET)
        assert b.lookup(keys) == (6, ["remote"] * 6)
        out = np.zeros_like(rows)
        assert all(b.get(keys, out).result(timeout=30))
        assert (out == rows).all()
        a.close()
        b.close()
    finally:
        stop(proc)
    # The node is gone: puts still succeed locally, copies fail and back off, flush returns.
    c = tc.KVStore(
        BLOCK, 64, remote=[info["address"]], auth_secret=SECRET, write_through=True,
        remote_timeout=1.0,
    )  # fmt: skip
    assert all(c.put(keys, rows).result(timeout=30))
    c.flush(timeout=30)
    st = c.stats()
    assert st["write_through"] == 0
    assert st["write_through_errors"] + st["write_through_dropped"] == 6
    assert c.lookup(keys) == (6, ["host"] * 6)
    c.close()


def test_store_node_cli_disk_tier_holds_what_dram_cannot(secret_file, tmp_path):
    cmd = [sys.executable, "-m", "tpusync.core.cli", "store-node", "--listen", "127.0.0.1:0",
           "--capacity", str(4 * BLOCK), "--block-bytes", str(BLOCK),
           "--disk-dir", str(tmp_path / "disk"), "--disk-capacity", str(64 * BLOCK),
           "--auth-secret-file", str(secret_file)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        pool = tc.HostBlockPool(BLOCK, 64)
        client = StoreClient(pool, [info["address"]], secret=SECRET, timeout=10.0)
        keys = [f"disk-{i}" for i in range(24)]
        src = pool.alloc(24)
        for i, b in enumerate(src):
            pool.view(b)[:] = np.uint8(i + 1)
        for i in range(0, 24, 2):  # small puts: DRAM write-back to disk keeps up
            assert client.put(keys[i : i + 2], src[i : i + 2]) == [1, 1]
        dst = pool.alloc(24)
        assert client.get(keys, dst) == [True] * 24
        for i, b in enumerate(dst):
            assert (pool.view(b) == np.uint8(i + 1)).all()
    finally:
        out = stop(proc)
    stats = json.loads(out.strip().splitlines()[-1])["stats"]
    assert stats["blocks_total"] == 4 and stats["disk_blocks_total"] == 64
    assert stats["disk_blocks_used"] >= 20


def _start_ns_node(secret_file, ns: str, fingerprint: str):
    cmd = [sys.executable, "-m", "tpusync.core.cli", "store-node", "--listen", "127.0.0.1:0",
           "--capacity", "2MiB", "--block-bytes", str(BLOCK),
           "--auth-secret-file", str(secret_file), "--namespace", ns,
           "--fingerprint", fingerprint]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"store node did not start: {err}")
    return proc, json.loads(line)


def test_namespaced_node_killed_with_sigkill_restarts_warm_and_verified(secret_file):
    """WARM RESTART CONTRACT with real processes: put, kill -9, restart -> the same bytes; another
    fingerprint -> a cold start with its reason on stdout and stderr."""
    import os
    import uuid

    ns = f"pytest-node-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    shm = f"/dev/shm/tpusync-{ns}-host"
    pool = tc.HostBlockPool(BLOCK, 16)
    keys = [f"warm-{i}" for i in range(8)]
    try:
        proc, info = _start_ns_node(secret_file, ns, "model-a")
        assert info["namespace"] == ns and info["recovered_blocks"] == 0
        assert info["cold_start_reason"] is None
        src = pool.alloc(8)
        for i, b in enumerate(src):
            pool.view(b)[:] = np.arange(BLOCK, dtype=np.uint64).astype(np.uint8) * (i + 3)
        client = StoreClient(pool, [info["address"]], secret=SECRET, timeout=5.0)
        assert client.put(keys, src) == [1] * 8
        proc.kill()  # SIGKILL: no shutdown code runs
        proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL

        proc, info = _start_ns_node(secret_file, ns, "model-a")
        try:
            assert info["recovered_blocks"] == 8 and info["cold_start_reason"] is None
            client = StoreClient(pool, [info["address"]], secret=SECRET, timeout=5.0)
            assert client.lookup_prefix(keys) == 8
            dst = pool.alloc(8)
            assert client.get(keys, dst) == [True] * 8
            for s, d in zip(src, dst, strict=True):
                assert np.array_equal(pool.view(s), pool.view(d))
            pool.free(dst)
        finally:
            proc.kill()
            _, err = proc.communicate(timeout=30)
        assert "warm restart, 8 blocks re-attached and verified" in err

        proc, info = _start_ns_node(secret_file, ns, "model-b")
        try:
            assert info["recovered_blocks"] == 0
            assert "fingerprint" in info["cold_start_reason"], info
            client = StoreClient(pool, [info["address"]], secret=SECRET, timeout=5.0)
            assert client.lookup_prefix(keys) == 0
        finally:
            out = stop(proc)
        assert json.loads(out.splitlines()[-1])["stopped"] is True
    finally:
        for path in (shm, shm + ".lock"):
            if os.path.exists(path):
                os.unlink(path)


def test_client_and_node_input_is_checked_by_name():
    """Bad counts, secrets, keys and leases get named errors (nanobind printed its signatures, a
    str node list was split into one-character addresses, a negative lease was ignored); bytes
    keys (block hashes) work like str keys; a lookup leaves no lease past its prefix; a node
    listed twice and a node of another block size are refused when the store opens."""
    from tpusync.core.store_node import StoreNode

    with pytest.raises(ValueError, match="StoreNode: capacity must be >= 0, got -1"):
        StoreNode(capacity=-1, secret=SECRET)
    with pytest.raises(TypeError, match="secret must be bytes or str, got int"):
        StoreNode(secret=123)
    node = StoreNode(capacity=8 * BLOCK, block_bytes=BLOCK, secret=SECRET.decode())
    try:
        pool = tc.HostBlockPool(BLOCK, 8)
        with pytest.raises(ValueError, match="StoreClient: replication must be >= 0"):
            StoreClient(pool, node.address, replication=-1, secret=SECRET)
        client = StoreClient(pool, node.address, secret=SECRET)  # one str: one node
        client.check_nodes()
        src = pool.alloc(2)
        pool.view(src[0])[:] = 7
        pool.view(src[1])[:] = 9
        with pytest.raises(ValueError, match="block ids must be >= 0, got -1"):
            client.put(["k"], [-1])
        with pytest.raises(TypeError, match="key 1 must be str or bytes, got int"):
            client.put([b"a", 5], src)
        with pytest.raises(ValueError, match="key 0 is not valid UTF-8"):
            client.lookup_prefix(["\udcff"])
        assert client.put([b"\xff\x00hash", "text"], src) == [1, 1]
        dst = pool.alloc(2)
        assert client.get([b"\xff\x00hash", b"text"], dst) == [True, True]  # "text" == b"text"
        assert (pool.view(dst[0]) == 7).all() and (pool.view(dst[1]) == 9).all()
        for bad in (-1.0, float("nan")):
            with pytest.raises(tc.InvalidArgumentError, match="lease must be >= 0"):
                client.lookup_prefix(["text"], lease=bad)
        assert client.lookup_prefix([b"absent", b"\xff\x00hash", "text"], lease=60) == 0
        assert node.stats()["leases_active"] == 0  # found past the prefix: released
        with pytest.raises(tc.InvalidArgumentError, match="listed twice"):
            tc.KVStore(BLOCK, 4, remote=[node.address, node.address], auth_secret=SECRET)
        with pytest.raises(tc.InvalidArgumentError, match=f"serves {BLOCK}-byte blocks"):
            tc.KVStore(2 * BLOCK, 4, remote=node.address, auth_secret=SECRET)
        with pytest.raises(tc.AuthError):
            tc.KVStore(BLOCK, 4, remote=node.address, auth_secret=b"wrong-secret-0123456789abc")
    finally:
        node.stop()
