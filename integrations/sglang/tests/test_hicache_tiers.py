"""The HiCache backend's remote and event options with real SGLang host pools (no server).

- store nodes: two backend instances with their own host pools and host tiers (nothing shared in
  process or in /dev/shm) share pages through one real ``tpusync store-node`` process;
- KV events: the backend publishes its store's placement changes through
  ``tpusync.core.events`` (the publisher the vLLM connector uses); a SUB socket decodes them with
  tpusync's decoder (vLLM's event classes are not installed in the SGLang venv) and sees the
  pages stored in CPU, demoted to DISK and dropped from CPU when the host tier overflows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from hicache_backend import create
from sglang.srt.mem_cache.utils import get_hash_str

from tpusync.core import events as tev

SECRET = b"sglang-hicache-test-secret-0123456789"
EXTRA = {"prefault": False}


def _create(host, extra, tp_rank=0, tp_size=1, dp_rank=0):
    return create(
        host, {**EXTRA, **extra}, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank,
        page_first=False,
    )  # fmt: skip


def _hashes(n_pages: int, page_size: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return get_hash_str(
        torch.randint(0, 50_000, (n_pages * page_size,), generator=g).tolist(),
        None,
        page_size=page_size,
    )


def _fill(host, indices, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(0, indices.numel(), host.page_size):
        page = host.get_data_page(int(indices[s]), flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
        out.append(host.get_data_page(int(indices[s]), flat=True).clone())
    return out


@pytest.fixture
def secret_file(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    f.chmod(0o600)
    return f


@pytest.fixture
def store_node(secret_file, sglang_pools):
    """One real store-node process sized for this host pool's segments."""
    _, host = sglang_pools("layer_first")
    from tpusync.sglang.hicache import HostPoolRows

    block = HostPoolRows(host).segment_bytes
    cmd = [sys.executable, "-m", "tpusync.core.cli", "store-node", "--listen", "127.0.0.1:0",
           "--capacity", "4MiB", "--block-bytes", str(block),
           "--auth-secret-file", str(secret_file)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "store node did not start"
        yield json.loads(line)["address"]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.parametrize(
    ("capacity_a", "write_through"),
    [(4, False), (16, True)],
    ids=["demoted-when-host-tier-overflows", "written-through-without-overflow"],
)
def test_two_backends_share_pages_through_a_store_node(
    sglang_pools, store_node, secret_file, capacity_a, write_through, monkeypatch
):
    remote = {
        "store_nodes": [store_node],
        "auth_secret_file": str(secret_file),
        "replicas": 1,
        "write_through": write_through,
    }
    _, host_a = sglang_pools("layer_first")
    _, host_b = sglang_pools("layer_first")
    a = _create(host_a, {"capacity_pages": capacity_a, **remote})
    # B takes the secret from $TPUSYNC_AUTH_SECRET, as every other tpusync component can.
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET.decode())
    b = _create(host_b, {"capacity_pages": 16, "store_nodes": store_node})  # comma-string form
    try:
        n = 10
        keys = _hashes(n, host_a.page_size, seed=31 + capacity_a)
        src = host_a.alloc(n * host_a.page_size)
        expected = _fill(host_a, src, seed=32)
        for lo in range(0, n, 2):  # two pages per backup, like SGLang's write-through batches
            sl = slice(lo * host_a.page_size, (lo + 2) * host_a.page_size)
            assert a.batch_set_v1(keys[lo : lo + 2], src[sl]) == [True, True]
        a.store.flush(30)
        spp = a.store.segments_per_page
        if write_through:  # every page copied to the node although A's host tier holds all
            assert a.store.stats()["write_through"] >= n * spp
            assert a.store.stats()["tiers"]["remote"]["demotions_in"] == 0
        else:
            assert a.store.stats()["tiers"]["remote"]["demotions_in"] >= (n - 4) * spp

        assert b.batch_exists(keys) == n  # B never saw these pages: they come from the node
        dst = host_b.alloc(n * host_b.page_size)
        assert b.batch_get_v1(keys, dst) == [True] * n
        got = [host_b.get_data_page(int(dst[i * host_b.page_size]), flat=True) for i in range(n)]
        assert all(torch.equal(x, y) for x, y in zip(expected, got, strict=True))
        stats = b.store.stats()
        assert stats["tiers"]["remote"]["hits"] >= n * spp
        # promoted into B's own host tier on read
        segments = b.store._segment_keys(b._keys(keys))
        assert set(b.store.store.lookup(segments)[1]) == {"host"}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"store_nodes": ["127.0.0.1:1"]}, "needs auth_secret_file"),
        ({"store_nodes": [""], "auth_secret_file": "/x"}, "store_nodes"),
        ({"store_nodes": 7, "auth_secret_file": "/x"}, "store_nodes"),
        ({"auth_secret_file": "/x"}, "only apply with store_nodes"),
        ({"replicas": 2}, "only apply with store_nodes"),
        ({"write_through": True}, "only apply with store_nodes"),
        (
            {"store_nodes": ["h:1"], "auth_secret_file": "/x", "write_through": "yes"},
            "true or false",
        ),
        ({"store": "interim", "store_nodes": ["h:1"], "auth_secret_file": "/x"}, "kvstore"),
        ({"store": "interim", "kv_events_endpoint": "tcp://127.0.0.1:*"}, "kvstore"),
        ({"kv_events_interval_s": 0}, "positive"),
        ({"namespace": "../etc"}, "namespace"),
        ({"kv_events_endpoint": "tcp://127.0.0.1:*", "kv_events_bind": "no"}, "kv_events_bind"),
    ],
)
def test_bad_remote_or_event_options_fail_at_startup(sglang_pools, extra, match, monkeypatch):
    monkeypatch.delenv("TPUSYNC_AUTH_SECRET", raising=False)
    _, host = sglang_pools("layer_first")
    with pytest.raises(ValueError, match=match):
        _create(host, {"capacity_pages": 4, **extra})


@pytest.mark.parametrize(
    ("ranks", "tags"),
    [
        ([{"tp_rank": 0, "tp_size": 2}, {"tp_rank": 1, "tp_size": 2}], ["tp0", "tp1"]),
        # attention DP: both replicas are attention-TP rank 0 of 1; SGLang gives no dp size
        ([{"dp_rank": 0}, {"dp_rank": 1}], ["", "dp1"]),
    ],
    ids=["tp2", "attention-dp2"],
)
def test_ranks_of_one_server_get_their_own_disk_directory_and_shm_namespace(
    sglang_pools, tmp_path, ranks, tags
):
    """RANK RESOURCES CONTRACT: the ranks of one server, configured with one extra config, each
    lock their own disk directory and /dev/shm namespace (a shared one would stop the second rank
    at start-up), keep their own copy of a page, and only the first rank publishes events."""
    from tpusync.core import KVStore

    namespace = f"sglang-ranks-{os.getpid()}"
    names = [f"{namespace}-{t}" if t else namespace for t in tags]
    extra = {
        "capacity_pages": 2,
        "disk_dir": str(tmp_path / "disk"),
        "disk_gb": 0.01,
        "namespace": namespace,
        "kv_events_endpoint": "tcp://127.0.0.1:*",
    }
    backends, hosts = [], []
    try:
        for rank in ranks:
            _, host = sglang_pools("layer_first")
            hosts.append(host)
            backends.append(_create(host, extra, **rank))
        for tag in tags:
            assert (tmp_path / "disk" / tag / "tier.meta").exists(), tag
        for name in names:
            assert Path(f"/dev/shm/tpusync-{name}-host").exists(), name
        assert backends[0].events is not None and backends[1].events is None
        n = 4  # twice the host tier: pages go down to each rank's own disk tier
        keys = _hashes(n, hosts[0].page_size, seed=61)
        shards = []
        for rank, (b, host) in enumerate(zip(backends, hosts, strict=True)):
            src = host.alloc(n * host.page_size)
            shards.append(_fill(host, src, seed=62 + rank))  # a different shard per rank
            assert b.batch_set_v1(keys, src) == [True] * n
            b.store.flush(30)
            assert b.store.stats()["tiers"]["disk"]["demotions_in"] > 0
        for rank, (b, host) in enumerate(zip(backends, hosts, strict=True)):
            dst = host.alloc(n * host.page_size)
            assert b.batch_get_v1(keys, dst) == [True] * n
            got = [host.get_data_page(int(dst[i * host.page_size]), flat=True) for i in range(n)]
            assert all(torch.equal(x, y) for x, y in zip(shards[rank], got, strict=True))
    finally:
        for b in backends:
            b.close()
        for name in names:
            KVStore.unlink_namespace(name)


def _drain(sub: zmq.Socket, until, timeout_s: float = 20.0):
    """Receive batches until ``until(events)`` holds; returns (events, sequence numbers, topics)."""
    events, seqs, topics = [], [], set()
    deadline = time.monotonic() + timeout_s
    while not until(events):
        left = deadline - time.monotonic()
        if left <= 0 or not sub.poll(int(left * 1000)):
            break
        topic, seq, payload = sub.recv_multipart()
        topics.add(topic.decode())
        seqs.append(int.from_bytes(seq, "big"))
        events.extend(tev.decode_batch(payload)[1])
    return events, seqs, topics


def _join(backend, host, sub: zmq.Socket) -> None:
    """Wait until the PUB/SUB pair is joined (ZMQ drops messages sent before that): store probe
    pages until one is announced, then clear and consume everything up to AllBlocksCleared."""
    for attempt in range(40):
        keys = _hashes(1, host.page_size, seed=1000 + attempt)
        src = host.alloc(host.page_size)
        _fill(host, src, seed=1000 + attempt)
        assert backend.batch_set_v1(keys, src) == [True]
        host.free(src)
        if sub.poll(500):
            break
    else:
        pytest.fail("the KV event subscriber never received anything")
    backend.store.flush(30)
    backend.clear()
    events, _, _ = _drain(sub, lambda evs: any(isinstance(e, tev.AllBlocksCleared) for e in evs))
    assert any(isinstance(e, tev.AllBlocksCleared) for e in events)


def _pages_in(events, kind, medium) -> list[bytes]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
def test_events_show_cpu_then_disk_when_the_host_tier_overflows(sglang_pools, tmp_path, encoding):
    _, host = sglang_pools("layer_first")
    backend = _create(
        host,
        {
            "capacity_pages": 3,
            "disk_dir": str(tmp_path),
            "disk_gb": 0.01,
            "kv_events_endpoint": "tcp://127.0.0.1:*",
            "kv_events_pod_id": "pod-a",
            "kv_events_encoding": encoding,
            "kv_events_interval_s": 0.02,
        },
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@pod-a@")
    try:
        assert backend.events is not None and backend.events.topic == "kv@pod-a@tiny-test"
        sub.connect(backend.events.endpoint)
        _join(backend, host, sub)
        n = 8
        keys = _hashes(n, host.page_size, seed=41)
        pages = [bytes.fromhex(k) for k in keys]
        src = host.alloc(n * host.page_size)
        _fill(host, src, seed=42)
        for i in range(n):
            sl = slice(i * host.page_size, (i + 1) * host.page_size)
            assert backend.batch_set_v1([keys[i]], src[sl]) == [True]
        backend.store.flush(30)

        def done(evs):
            return (
                set(_pages_in(evs, tev.BlockStored, "DISK")) >= set(pages)
                and len(set(_pages_in(evs, tev.BlockRemoved, "CPU"))) >= n - 3
            )

        events, seqs, topics = _drain(sub, done)
        assert topics == {"kv@pod-a@tiny-test"}
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence has gaps"
        stored_cpu = _pages_in(events, tev.BlockStored, "CPU")
        assert stored_cpu[:n] == pages, "every page announced once, in put order, as SGLang hashes"
        assert set(_pages_in(events, tev.BlockStored, "DISK")) == set(pages)
        removed_cpu = set(_pages_in(events, tev.BlockRemoved, "CPU"))
        assert len(removed_cpu) >= n - 3 and removed_cpu <= set(pages)
        for e in events:
            if isinstance(e, tev.BlockStored):
                assert e.block_size == host.page_size and e.token_ids == []
                assert len(e.block_hashes) == len(set(e.block_hashes)), "a page listed twice"
        # every page is still served (from DISK for those the host tier dropped)
        assert backend.batch_exists(keys) == n

        backend.clear()
        events, _, _ = _drain(
            sub, lambda evs: any(isinstance(e, tev.AllBlocksCleared) for e in evs)
        )
        assert any(isinstance(e, tev.AllBlocksCleared) for e in events)
    finally:
        sub.close(0)
        backend.close()


def test_events_connect_to_a_bound_router_like_llm_d_epp(sglang_pools):
    """kv_events_bind=false: the router (llm-d's EPP) binds, every pod's backend connects."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    _, host = sglang_pools("layer_first")
    backend = _create(
        host,
        {
            "capacity_pages": 8,
            "kv_events_endpoint": f"tcp://127.0.0.1:{port}",
            "kv_events_bind": False,
            "kv_events_pod_id": "pod-b",
        },
    )
    try:
        _join(backend, host, sub)
        keys = _hashes(2, host.page_size, seed=51)
        src = host.alloc(2 * host.page_size)
        _fill(host, src, seed=52)
        assert backend.batch_set_v1(keys, src) == [True, True]
        want = {bytes.fromhex(k) for k in keys}
        events, _, topics = _drain(
            sub, lambda evs: set(_pages_in(evs, tev.BlockStored, "CPU")) >= want
        )
        assert topics == {"kv@pod-b@tiny-test"}
        assert set(_pages_in(events, tev.BlockStored, "CPU")) == want
    finally:
        backend.close()
        sub.close(0)
