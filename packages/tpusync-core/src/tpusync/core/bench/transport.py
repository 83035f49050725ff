"""``tpusync bench transport``: the network transport against same-run references.

1. TCP over loopback: ``total`` bytes in ``block`` blocks pulled with the P/D primitive (auth,
   striping, per-block XXH3 checksums, writev/readv from and into pool memory) with 1, 2, 4, 8
   streams, against ``iperf3`` with the same number of parallel streams and bytes, same run.
2. Same host: the same pull through the producer's Unix socket, which passes the producer's
   /dev/shm pool and lets the consumer memcpy out of it, against one numpy copy out of a mapped
   /dev/shm file into a prefaulted buffer (the memcpy limit of that path). The reference is kept
   as one bulk copy on purpose: it is the honest cost of a plain copy of the same bytes (glibc
   streams a copy that large with non-temporal stores); the pull copies block by block and must
   stream its stores too (``StreamCopy``) to come near it, not get a per-block reference.
3. Small transfers: one 16 KiB block pulled end to end (pull, data, ack) over a warm link with
   ``PdConsumer.recv`` (the pull runs on the calling thread), and one 16 KiB block read from a
   store node with ``StoreClient.get``, each against a plain 16 KiB TCP round trip between two
   Python sockets (median latency). ``async_latency_us`` keeps the start_recv + wait figure (a
   worker thread does the pull).
4. A large store get: 64 MiB of blocks read from an in-process store node with one
   ``StoreClient.get`` (striped over up to 4 links, STRIPE CONTRACT in store_client.h), against
   iperf3 with 4 streams and the same bytes. ``links`` counts the connections the node accepted.
5. Mooncake Transfer Engine (optional, when ``mooncake.engine`` imports here): the same number of
   blocks of the same size pulled over its TCP protocol with P2PHANDSHAKE metadata, same run
   (bench/mooncake_ref.py), while the pools are still alive; tpusync's default stream count is
   measured again right after it for the row's ratio. The row says why it was skipped otherwise.

Producer and consumer run in this one process on separate native threads; every byte crosses a
real socket (or the shared segment). Figures are medians of ``repeats`` runs.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time

import numpy as np

from tpusync.core.bench.common import measure, progress, result_entry
from tpusync.core.bench.mooncake_ref import run_reference as _mooncake_reference
from tpusync.core.pd import PdConsumer, PdProducer
from tpusync.core.pool import HostBlockPool

STREAMS = [1, 2, 4, 8]
SMALL = 16 << 10
STORE_BYTES = 64 << 20  # one store get: the largest single request (kMaxRequestBytes)
STORE_LIMIT = "iperf3 over loopback TCP, 4 parallel streams, same bytes, same run"
IPERF_LIMIT = "iperf3 over loopback TCP, same parallel streams and bytes, same run"
SHM_LIMIT = "one numpy copy out of a mapped /dev/shm file into a prefaulted buffer, same run"
RTT_LIMIT = "plain 16 KiB TCP round trip between two Python sockets on loopback, same run"
MOONCAKE_LIMIT = (
    "Mooncake Transfer Engine, TCP protocol, P2PHANDSHAKE metadata, loopback, default settings, "
    "same blocks pulled with batch_transfer_sync_read, same run"
)
DEFAULT_STREAMS = 4  # PdConsumer's default


def run(
    total_bytes: int = 1 << 30,
    block_bytes: int = 2 << 20,
    repeats: int = 3,
    streams: list[int] | None = None,
    show_progress: bool = True,
) -> dict:
    streams = streams or STREAMS
    n = max(1, total_bytes // block_bytes)
    nbytes = n * block_bytes
    secret = os.urandom(32)
    tag = f"tpusync-bench-{os.getpid()}"
    iperf = shutil.which("iperf3")
    tcp, shm, small = [], {}, {}
    with progress(show_progress) as bar, tempfile.TemporaryDirectory() as tmp:
        task = bar.add_task("bench transport", total=len(streams) + 3)
        src_pool = HostBlockPool(block_bytes, n, shm_name=tag)
        dst_pool = HostBlockPool(block_bytes, n)
        src, dst = src_pool.alloc(n), dst_pool.alloc(n)
        for i, b in enumerate(src):
            src_pool.view(b)[:] = i % 251
        sock = os.path.join(tmp, "p.sock")
        rid = iter(range(1, 1 << 30))
        with PdProducer(src_pool, secret=secret, unix_path=sock) as prod:

            def pull(consumer: PdConsumer, peer: str, blocks: list[int], ids: list[int]) -> dict:
                r = next(rid)
                prod.register_send(r, blocks, deadline=120.0, blocks_per_group=16)
                t0 = time.perf_counter()
                consumer.start_recv(r, peer, ids, deadline=120.0)
                res = consumer.wait(r, timeout=120.0)
                dt = time.perf_counter() - t0
                if not res.done:
                    raise RuntimeError(f"bench transport: pull failed: {res.reason}")
                return {"seconds": dt, "shm": res.shm}

            for k in streams:
                consumer = PdConsumer(dst_pool, streams=k, secret=secret)
                pull(consumer, prod.address, src, dst)  # warm: connect + authenticate
                ours = measure(
                    lambda c=consumer: pull(c, prod.address, src, dst)["seconds"], repeats
                )
                entry = {"streams": k}
                if iperf:
                    ref = statistics.median(_iperf3(iperf, k, nbytes) for _ in range(repeats))
                    entry.update(result_entry(nbytes, ours, ref, IPERF_LIMIT))
                else:
                    entry.update({"gbps": round(nbytes / ours / 1e9, 3), "limit": None})
                tcp.append(entry)
                bar.advance(task)
            _check(src_pool, src, dst_pool, dst)

            # Mooncake, then tpusync's default stream count again right after it: the two figures
            # of the ratio are minutes apart at most (other load on the machine drifts).
            ref = _mooncake_reference(
                n, block_bytes, repeats, timeout=_mooncake_timeout(nbytes, repeats)
            )
            if "seconds" in ref:
                consumer = PdConsumer(dst_pool, streams=DEFAULT_STREAMS, secret=secret)
                pull(consumer, prod.address, src, dst)  # warm
                ours = measure(
                    lambda c=consumer: pull(c, prod.address, src, dst)["seconds"], repeats
                )
                mooncake = {
                    "streams": DEFAULT_STREAMS,
                    **result_entry(nbytes, ours, ref["seconds"], MOONCAKE_LIMIT),
                    "version": ref.get("version"),
                }
                _check(src_pool, src, dst_pool, dst)
            else:
                mooncake = {
                    "skipped": ref.get("skipped", "unknown reason"),
                    "limit": MOONCAKE_LIMIT,
                }
            bar.advance(task)

            consumer = PdConsumer(dst_pool, streams=1, secret=secret)
            unix = prod.unix_address
            assert pull(consumer, unix, src, dst)["shm"], "same-host pull did not use /dev/shm"
            ours = measure(lambda: pull(consumer, unix, src, dst)["seconds"], repeats)
            ref = measure(lambda: _shm_copy_seconds(tag, nbytes), repeats)
            shm = {"streams": 1, **result_entry(nbytes, ours, ref, SHM_LIMIT)}
            _check(src_pool, src, dst_pool, dst)
            bar.advance(task)

            # The block size is a property of the pool: a dedicated 16 KiB pair.
            small = _small_latency(secret, repeats=max(20, repeats * 10))
            store = _store_bulk_get(secret, block_bytes, repeats, iperf)
            bar.advance(task)
        src_pool.free(src)
        dst_pool.free(dst)
    return {
        "suite": "transport",
        "bytes": nbytes,
        "block_bytes": block_bytes,
        "repeats": repeats,
        "cpus": os.cpu_count(),
        "tcp": tcp,
        "shm": shm,
        "small": small,
        "store_get": store,
        "iperf3": iperf is not None,
        "mooncake": mooncake,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _mooncake_timeout(nbytes: int, repeats: int) -> float:
    """Generous: Mooncake TCP measured ~0.15-0.4 GB/s here; 20 MB/s is the floor we wait for."""
    return 60.0 + (repeats + 1) * nbytes / 20e6


def _check(src_pool, src, dst_pool, dst) -> None:
    for i in (0, len(src) // 2, len(src) - 1):
        if not np.array_equal(src_pool.view(src[i]), dst_pool.view(dst[i])):
            raise RuntimeError("bench transport: data check failed")


def _iperf3(iperf: str, streams: int, nbytes: int, server=None, client=None) -> float:
    """Seconds iperf3 needs to move nbytes with `streams` parallel streams: over loopback, or
    from emulated host ``client`` to emulated host ``server`` (:mod:`tpusync.core.bench.hosts`).

    IPERF3 READING: the receiver's own byte count and time. iperf3 (3.12) often sends its
    receiver summary before it counted every byte of a short run (2-64 MiB here: 4 of 8 runs at
    8 MiB, some with 0 bytes, which divided by zero before), so a run is taken only when the
    receiver counted at least 90% of the bytes, up to ``_IPERF3_TRIES`` runs; after that the
    rate of the most complete run stands, and none with bytes is a clear error."""
    best = (0.0, 0.0)
    for _ in range(_IPERF3_TRIES):
        received, seconds = _iperf3_run(iperf, streams, nbytes, server, client)
        if received >= 0.9 * nbytes and seconds > 0:
            return nbytes * seconds / received
        if seconds > 0 and received > best[0]:
            best = (received, seconds)
    if best[0] <= 0:
        raise RuntimeError(
            f"bench transport: iperf3 reported no bytes received in {_IPERF3_TRIES} runs of "
            f"{nbytes} bytes: no usable reference"
        )
    return nbytes * best[1] / best[0]


_IPERF3_TRIES = 3


def _iperf3_run(iperf: str, streams: int, nbytes: int, server, client) -> tuple[float, float]:
    """One iperf3 run: (bytes, seconds) of the receiver's summary."""
    if server is not None:
        addr, port = server.addr, 5201  # the server host's own network stack: the port is free
    else:
        addr = "127.0.0.1"
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
    on_server = server.prefix if server is not None else []
    on_client = client.prefix if client is not None else []
    server_proc = subprocess.Popen(
        [*on_server, iperf, "-s", "-1", "-B", addr, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        out = None
        for _ in range(50):  # the server needs a moment to listen
            time.sleep(0.05)
            proc = subprocess.run(
                [
                    *on_client,
                    iperf,
                    "-c",
                    addr,
                    "-p",
                    str(port),
                    "-n",
                    str(nbytes),
                    "-P",
                    str(streams),
                    "-J",
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if proc.returncode == 0:
                out = json.loads(proc.stdout)
                break
        if out is None:
            raise RuntimeError("bench transport: iperf3 client never connected")
        got = out["end"].get("sum_received") or {}
        return float(got.get("bytes") or 0), float(got.get("seconds") or 0)
    finally:
        server_proc.kill()
        server_proc.wait(timeout=10)


def _shm_copy_seconds(name: str, nbytes: int) -> float:
    dst = np.empty(nbytes, dtype=np.uint8)
    dst[:] = 1  # prefault
    with open(f"/dev/shm/{name}", "rb") as f:
        m = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
        try:
            src = np.frombuffer(m, dtype=np.uint8, count=nbytes)
            src[::4096].sum()  # map every page before timing
            t0 = time.perf_counter()
            np.copyto(dst, src)
            dt = time.perf_counter() - t0
            del src
        finally:
            m.close()
    return dt


def _small_latency(secret: bytes, repeats: int) -> dict:
    src_pool, dst_pool = HostBlockPool(SMALL, 2), HostBlockPool(SMALL, 2)
    src, dst = src_pool.alloc(1), dst_pool.alloc(1)
    src_pool.view(src[0])[:] = 3
    with PdProducer(src_pool, secret=secret) as prod:
        # The default consumer (4 streams): a 16 KiB pull takes its 1-stream small-pull link.
        consumer = PdConsumer(dst_pool, secret=secret)
        rid = iter(range(1, 1 << 30))

        def once(inline: bool) -> float:
            r = next(rid)
            prod.register_send(r, src, deadline=30.0)
            t0 = time.perf_counter()
            if inline:
                res = consumer.recv(r, prod.address, dst, deadline=30.0)
            else:
                consumer.start_recv(r, prod.address, dst, deadline=30.0)
                res = consumer.wait(r, timeout=30.0)
            dt = time.perf_counter() - t0
            if not res.done:
                raise RuntimeError(f"bench transport: small pull failed: {res.reason}")
            return dt

        once(True)
        once(False)
        ours = measure(lambda: once(True), repeats)
        ours_async = measure(lambda: once(False), repeats)
    if not np.array_equal(src_pool.view(src[0]), dst_pool.view(dst[0])):
        raise RuntimeError("bench transport: small pull data check failed")
    store = _store_get_latency(secret, repeats)
    ref = _tcp_round_trip(repeats)
    return {
        "block_bytes": SMALL,
        "latency_us": round(ours * 1e6, 1),
        "limit_us": round(ref * 1e6, 1),
        "limit": RTT_LIMIT,
        "ratio": round(ours / ref, 3),
        "better": "lower",
        "async_latency_us": round(ours_async * 1e6, 1),
        "store_get_us": round(store * 1e6, 1),
        "store_get_ratio": round(store / ref, 3),
    }


def _store_get_latency(secret: bytes, repeats: int) -> float:
    """Median seconds of one 16 KiB StoreClient.get from an in-process store node."""
    from tpusync.core.store_node import StoreClient, StoreNode

    node = StoreNode(capacity=64 * SMALL, block_bytes=SMALL, secret=secret)
    try:
        pool = HostBlockPool(SMALL, 2)
        src, dst = pool.alloc(1), pool.alloc(1)
        pool.view(src[0])[:] = 5
        client = StoreClient(pool, [node.address], secret=secret)
        if client.put(["bench-small"], src) != [1]:
            raise RuntimeError("bench transport: store put failed")

        def once() -> float:
            t0 = time.perf_counter()
            found = client.get(["bench-small"], dst)
            dt = time.perf_counter() - t0
            if found != [True]:
                raise RuntimeError("bench transport: store get missed")
            return dt

        once()
        dt = measure(once, repeats)
        if not np.array_equal(pool.view(src[0]), pool.view(dst[0])):
            raise RuntimeError("bench transport: store get data check failed")
        return dt
    finally:
        node.stop()


def _store_bulk_get(secret: bytes, block_bytes: int, repeats: int, iperf: str | None) -> dict:
    """One StoreClient.get of STORE_BYTES from an in-process store node (striped over up to 4
    links, STRIPE CONTRACT in store_client.h) against iperf3 with 4 streams, same bytes."""
    from tpusync.core.store_node import StoreClient, StoreNode

    n = max(1, STORE_BYTES // block_bytes)
    nbytes = n * block_bytes
    node = StoreNode(capacity=2 * nbytes, block_bytes=block_bytes, secret=secret)
    try:
        pool = HostBlockPool(block_bytes, 2 * n)
        src, dst = pool.alloc(n), pool.alloc(n)
        for i, b in enumerate(src):
            pool.view(b)[:] = (i * 7) % 251
        keys = [f"bench-bulk-{i}" for i in range(n)]
        client = StoreClient(pool, [node.address], secret=secret)
        if client.put(keys, src) != [1] * n:
            raise RuntimeError("bench transport: store put failed")

        def once() -> float:
            t0 = time.perf_counter()
            found = client.get(keys, dst)
            dt = time.perf_counter() - t0
            if found != [True] * n:
                raise RuntimeError("bench transport: store get missed")
            return dt

        once()  # warm: links connected and authenticated
        ours = measure(once, repeats)
        _check(pool, src, pool, dst)
        links = node.stats()["links"]
    finally:
        node.stop()
    entry = {"blocks": n, "links": links}
    if iperf:
        ref = statistics.median(_iperf3(iperf, 4, nbytes) for _ in range(repeats))
        entry.update(result_entry(nbytes, ours, ref, STORE_LIMIT))
    else:
        entry.update({"gbps": round(nbytes / ours / 1e9, 3), "limit": None})
    return entry


def _tcp_round_trip(repeats: int) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    payload = b"x" * SMALL

    def echo() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(repeats + 1):
                got = 0
                while got < SMALL:
                    chunk = conn.recv(SMALL - got)
                    if not chunk:
                        return
                    got += len(chunk)
                conn.sendall(payload)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    cli = socket.create_connection(srv.getsockname(), timeout=30)
    cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def once() -> float:
        t0 = time.perf_counter()
        cli.sendall(payload)
        got = 0
        while got < SMALL:
            got += len(cli.recv(SMALL - got))
        return time.perf_counter() - t0

    try:
        once()
        return measure(once, repeats)
    finally:
        cli.close()
        t.join(timeout=10)
        srv.close()
