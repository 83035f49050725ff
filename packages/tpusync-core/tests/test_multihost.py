"""Three "hosts" with their own addresses: network namespaces joined by veth pairs to a bridge in a
fourth namespace (nothing touches the host's own network). Store nodes run on two hosts, a client
with replication 2 on the third; a P/D pull crosses hosts too.

Runs only as root with iproute2 and TPUSYNC_NETNS=1 (the `multihost` nox session sets it; CI runs
as root). The hosts are tpusync.core.bench.hosts.emulated_hosts (HOSTS CONTRACT) with unshaped
links: traffic goes only to their 10.232.<k>.0/24 addresses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tpusync.core.bench.hosts import emulated_hosts

pytestmark = pytest.mark.skipif(
    os.environ.get("TPUSYNC_NETNS") != "1" or os.geteuid() != 0 or not shutil.which("ip"),
    reason="multi-host tests need root, iproute2 and TPUSYNC_NETNS=1 (nox -s multihost)",
)

SECRET = "multihost-test-secret-0123456789"


@pytest.fixture(scope="module")
def hosts():
    with emulated_hosts(3, None) as on:  # unshaped links: these tests need addresses, not rates
        yield [(h.ns, h.addr) for h in on]


def in_ns(ns: str, code: str, **popen) -> subprocess.Popen:
    env = dict(os.environ, TPUSYNC_AUTH_SECRET=SECRET)
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE, text=True, env=env, **popen,
    )  # fmt: skip


def test_store_nodes_and_pd_across_hosts(hosts, tmp_path):
    (h1, a1), (h2, a2), (h3, a3) = hosts
    nodes = []
    for ns, addr in ((h1, a1), (h2, a2)):
        env = dict(os.environ, TPUSYNC_AUTH_SECRET=SECRET)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "tpusync.core.cli", "store-node",
             "--listen", f"{addr}:7600", "--capacity", "8MiB", "--block-bytes", "65536"],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        nodes.append((proc, json.loads(proc.stdout.readline())))
    producer = in_ns(
        h1,
        f"""
        import sys, time
        import tpusync.core as tc
        from tpusync.core.pd import PdProducer
        pool = tc.HostBlockPool(65536, 8)
        ids = pool.alloc(8)
        for i, b in enumerate(ids):
            pool.view(b)[:] = 100 + i
        prod = PdProducer(pool, listen="{a1}:7700")
        prod.register_send(9, ids, deadline=60.0, blocks_per_group=2)
        print(prod.address, flush=True)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if any(r.request_id == 9 and r.state != "pending" for r in prod.poll()):
                print("acked", flush=True)
                sys.exit(0)
            time.sleep(0.01)
        sys.exit(3)
        """,
    )
    assert producer.stdout.readline().strip() == f"{a1}:7700"
    client = in_ns(
        h3,
        f"""
        import json
        import tpusync.core as tc
        from tpusync.core.pd import PdConsumer
        from tpusync.core.store_node import StoreClient
        pool = tc.HostBlockPool(65536, 32)
        out = {{}}
        c = StoreClient(pool, ["{a1}:7600", "{a2}:7600"], replication=2, timeout=5.0)
        src = pool.alloc(10)
        for i, b in enumerate(src):
            pool.view(b)[:] = i
        keys = [f"mh{{i}}" for i in range(10)]
        out["put"] = c.put(keys, src)
        dst = pool.alloc(10)
        out["get"] = c.get(keys, dst)
        out["data"] = all(int(pool.view(b)[0]) == i for i, b in enumerate(dst))
        out["prefix"] = c.lookup_prefix(keys + ["none"])
        pd = PdConsumer(pool, streams=2)
        d = pool.alloc(8)
        pd.start_recv(9, "{a1}:7700", d, deadline=30.0)
        r = pd.wait(9, timeout=30.0)
        out["pd"] = r.state
        out["pd_data"] = all(int(pool.view(b)[5]) == 100 + i for i, b in enumerate(d))
        print(json.dumps(out), flush=True)
        """,
    )
    try:
        out, _ = client.communicate(timeout=120)
        res = json.loads(out)
        assert res["put"] == [2] * 10
        assert res["get"] == [True] * 10 and res["data"]
        assert res["prefix"] == 10
        assert res["pd"] == "done" and res["pd_data"]
        assert producer.stdout.readline().strip() == "acked"
    finally:
        for proc in [producer, client] + [p for p, _ in nodes]:
            if proc.poll() is None:
                proc.terminate()
            proc.communicate(timeout=30)
    for proc, _ in nodes:
        assert proc.returncode == 0  # clean SIGTERM shutdown


def _node(ns: str, addr: str, port: int) -> tuple[subprocess.Popen, dict]:
    env = dict(os.environ, TPUSYNC_AUTH_SECRET=SECRET)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "tpusync.core.cli", "store-node",
         "--listen", f"{addr}:{port}", "--capacity", "64MiB", "--block-bytes", "65536"],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    return proc, json.loads(proc.stdout.readline())


def test_kvstore_remote_tier_across_hosts_survives_kill9_and_rejoin(hosts):
    """Three hosts each run a store node; a KVStore on host 3 demotes to them (replicas 2); the
    node on host 1 is SIGKILLed; a KVStore on host 2 still finds and reads every block byte-exact
    within its deadline; the node restarted on host 1 re-joins and takes new blocks again."""
    (h1, a1), (h2, a2), (h3, a3) = hosts
    port = 7610
    nodes = [_node(ns, addr, port) for ns, addr in hosts]
    remote = [f"{a}:{port}" for _, a in hosts]
    writer = f"""
        import json
        import numpy as np
        import tpusync.core as tc
        keys = [f"mhkv{{i}}".encode() for i in range(64)]
        rows = np.stack([np.full(65536, i % 251, dtype=np.uint8) for i in range(64)])
        s = tc.KVStore(65536, 8, remote={remote!r}, replicas=2, remote_timeout=3.0)
        ok = all(all(s.put(keys[i:i + 8], rows[i:i + 8]).result(timeout=60))
                 for i in range(0, 64, 8))
        s.flush(timeout=60)
        print(json.dumps({{"ok": ok, "demoted": s.stats()["tiers"]["remote"]["demotions_in"]}}),
              flush=True)
        """
    reader = f"""
        import json, time
        import numpy as np
        import tpusync.core as tc
        from tpusync.core.pool import HostBlockPool
        from tpusync.core.store_node import StoreClient
        keys = [f"mhkv{{i}}".encode() for i in range(64)]
        s = tc.KVStore(65536, 128, remote={remote!r}, replicas=2, remote_timeout=3.0)
        t0 = time.monotonic()
        n, _ = s.lookup(keys)
        out = np.zeros((64, 65536), dtype=np.uint8)
        found = s.get(keys, out).result(timeout=60)
        dt = time.monotonic() - t0
        exact = all((out[i] == i % 251).all() for i in range(64))
        print(json.dumps({{"prefix": n, "found": sum(found), "exact": exact, "seconds": dt}}),
              flush=True)
        input()  # wait for the restart of the killed node
        pool = HostBlockPool(65536, 16)
        c = StoreClient(pool, {remote!r}, replication=2, timeout=3.0)
        fresh = [f"fresh{{i}}" for i in range(16)]
        print(json.dumps({{"put": c.put(fresh, pool.alloc(16))}}), flush=True)
        """
    procs = []
    try:
        w = in_ns(h3, writer)
        procs.append(w)
        res = json.loads(w.communicate(timeout=120)[0])
        assert res["ok"] and res["demoted"] >= 56
        nodes[0][0].kill()  # SIGKILL: no goodbye
        nodes[0][0].communicate(timeout=30)
        r = in_ns(h2, reader, stdin=subprocess.PIPE)
        procs.append(r)
        first = json.loads(r.stdout.readline())
        assert first["prefix"] == 64 and first["found"] == 64 and first["exact"]
        assert first["seconds"] < 2 * 3.0 + 5.0  # within the failover deadline
        nodes[0] = _node(h1, a1, port)
        r.stdin.write("\n")
        r.stdin.flush()
        second = json.loads(r.stdout.readline())
        assert second["put"] == [2] * 16  # the restarted node took its share again
    finally:
        for proc in procs + [p for p, _ in nodes]:
            if proc.poll() is None:
                proc.terminate()
            proc.communicate(timeout=30)
