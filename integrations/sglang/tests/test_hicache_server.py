"""Scenario 1 of issue 8: a LIVE SGLang server (real processes, real HTTP) with HiCache on tpusync.

``python -m sglang.launch_server`` runs the tiny test model on CPU with
``--enable-hierarchical-cache --hicache-storage-backend dynamic`` and the extra config naming
``tpusync.sglang.TpusyncHiCacheStorage``. A request is served, ``/flush_cache`` drops the device
and host caches, and the same request again is served with its prefix pages loaded from tpusync
storage: ``meta_info.cached_tokens_details.storage`` counts them, the backend's own prefetch
counters (SGLang's ``sglang:prefetch_pgs`` histogram, fed by the backend's ``get_stats``) count
the pages it served, and greedy output is identical. The backend also publishes its store's
placement changes as KV events (``kv_events_endpoint``): the subscriber sees every page of the
prompt announced in medium CPU under SGLang's own page hashes.

CPU only through the TEST-ONLY shim ``support/cpu_server_shim.py`` (installed in every server
process by ``support/server_site/sitecustomize.py``): CPU stand-ins for SGLang's host-pool copy
kernel and host-memory registration, nothing of tpusync. To keep start-up short the server is told
(``SGLANG_DISABLED_MODEL_ARCHS``) to skip importing the ~200 model modules other than Llama.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tiny_model

SUPPORT = Path(__file__).parent / "support"
STARTUP_TIMEOUT_S = 600  # a loaded 2-core machine: imports dominate (seen: 95-380 s)
REQUEST_TIMEOUT_S = 120
PAGE = 4
PROMPT = (
    "the cache page block host disk token model prefix hit miss store load copy layer head key "
    "value tpusync sglang the cache page block host disk token model prefix"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _other_model_modules() -> str:
    spec = importlib.util.find_spec("sglang.srt.models")
    assert spec is not None and spec.submodule_search_locations
    names = [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
    assert "llama" in names
    return ",".join(n for n in names if n != "llama")


def _http(
    url: str,
    payload: dict | None = None,
    timeout: float = REQUEST_TIMEOUT_S,
    method: str | None = None,
):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method=method
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read().decode()
        return resp.status, body


class Server:
    def __init__(self, proc: subprocess.Popen, base: str, log: Path) -> None:
        self.proc, self.base, self.log = proc, base, log

    def generate(self, input_ids: list[int]) -> dict:
        status, body = _http(
            f"{self.base}/generate",
            {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
        )
        assert status == 200, body
        return json.loads(body)

    def flush_cache(self) -> None:
        """SGLang's /flush_cache; ``timeout`` lets the server wait for in-flight work to end
        (it refuses to flush a busy scheduler with 400). Bounded retry on top."""
        deadline = time.monotonic() + 90
        while True:
            try:
                status, body = _http(f"{self.base}/flush_cache?timeout=30", method="POST")
                if status == 200:
                    return
            except urllib.error.HTTPError as e:
                body = e.read().decode(errors="replace")
            assert time.monotonic() < deadline, f"flush_cache kept failing: {body}"
            time.sleep(1)

    def metric(self, name: str) -> float:
        _, body = _http(f"{self.base}/metrics")
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", body, re.M):
            total += float(m.group(1))
        return total

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = Path(os.environ.get("TPUSYNC_REPO_ROOT", Path(__file__).resolve().parents[3]))
    model = tiny_model.ensure(root)
    port = _free_port()
    events_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    log = tmp_path_factory.mktemp("sglang-server") / "server.log"
    extra = {
        "backend_name": "tpusync",
        "module_path": "tpusync.sglang",
        "class_name": "TpusyncHiCacheStorage",
        "interface_v1": 1,
        "capacity_pages": 512,
        "prefault": False,
        "kv_events_endpoint": events_endpoint,
        "kv_events_pod_id": "pod-live",
        "kv_events_model": "tiny",
        # SGLang's own prefetch knobs (popped by SGLang before the backend sees the config):
        # prefetch from one page on, and give a slow CPU machine time to finish it.
        "prefetch_threshold": PAGE,
        "prefetch_timeout_base": 60,
    }
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model), "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port),
        "--attention-backend", "torch_native", "--grammar-backend", "none",
        "--disable-cuda-graph", "--page-size", str(PAGE), "--max-total-tokens", "2048",
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(extra),
        "--enable-metrics", "--enable-cache-report",
        "--random-seed", "1",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(SUPPORT / "server_site"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "TPUSYNC_SGLANG_CPU_SHIM": "1",
        "SGLANG_DISABLED_MODEL_ARCHS": _other_model_modules(),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    srv = Server(proc, f"http://127.0.0.1:{port}", log)
    srv.model_dir = model
    srv.events_endpoint = events_endpoint
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"SGLang server exited with {proc.returncode}:\n{srv.tail()}")
            try:
                if _http(f"{srv.base}/health", timeout=5)[0] == 200 and (
                    "fired up and ready" in log.read_text(errors="replace")
                ):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"SGLang server not ready in {STARTUP_TIMEOUT_S} s:\n{srv.tail()}")
            time.sleep(2)
        yield srv
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (new session)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def test_flushed_prefix_is_loaded_from_tpusync_with_identical_output(server):
    import zmq
    from sglang.srt.mem_cache.utils import get_hash_str
    from transformers import AutoTokenizer

    from tpusync.core import events as tev

    ids = AutoTokenizer.from_pretrained(server.model_dir)(PROMPT).input_ids
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@pod-live@tiny")
    sub.connect(server.events_endpoint)
    try:
        time.sleep(0.5)  # PUB/SUB join
        first = server.generate(ids)
        assert first["meta_info"]["prompt_tokens"] == len(ids) >= 4 * PAGE
        assert first["meta_info"]["cached_tokens"] == 0

        # The first request's pages went device -> host (write-through) -> tpusync (backup).
        # Wait until the backend reports them stored, then drop device and host caches.
        deadline = time.monotonic() + 60
        while server.metric("sglang:backup_pgs_sum") < 1:
            assert time.monotonic() < deadline, f"no backup to tpusync:\n{server.tail()}"
            time.sleep(1)
        prefetched_before = server.metric("sglang:prefetch_pgs_sum")
        server.flush_cache()

        second = server.generate(ids)
        meta = second["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        assert details.get("storage_backend") == "TpusyncHiCacheStorage", meta
        # every whole page of the prompt but the last token's, from tpusync storage, none from
        # device or host
        expected = (len(ids) - 1) // PAGE * PAGE
        assert details.get("storage", 0) == expected, meta
        assert details.get("device", 0) == 0 and details.get("host", 0) == 0, meta
        assert meta["cached_tokens"] == expected, meta
        assert second["output_ids"] == first["output_ids"]
        assert second["text"] == first["text"]

        # The backend's own counters (its get_stats(), exported by SGLang) saw the pages.
        deadline = time.monotonic() + 60
        while server.metric("sglang:prefetch_pgs_sum") - prefetched_before < expected // PAGE:
            assert time.monotonic() < deadline, f"prefetch counters did not move:\n{server.tail()}"
            time.sleep(1)

        # KV events: the prompt's pages, under SGLang's own page hashes, stored in CPU.
        pages = {bytes.fromhex(h) for h in get_hash_str(ids[:expected], None, page_size=PAGE)}
        stored: set[bytes] = set()
        deadline = time.monotonic() + 30
        while not pages <= stored and sub.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
            topic, _, payload = sub.recv_multipart()
            assert topic == b"kv@pod-live@tiny"
            for e in tev.decode_batch(payload)[1]:
                if isinstance(e, tev.BlockStored) and e.medium == "CPU":
                    assert e.block_size == PAGE
                    stored.update(e.block_hashes)
        assert pages <= stored, f"{len(pages - stored)} prompt page(s) never announced"
    finally:
        sub.close(0)
