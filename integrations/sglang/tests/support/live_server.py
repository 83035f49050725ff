"""TEST-ONLY: a live SGLang server process (``python -m sglang.launch_server``) on CPU.

LIVE SERVER CONTRACT: :func:`launch` starts the tiny test model on CPU with the flags every live
scenario shares plus the caller's, in its own session (its process group is killed on stop),
output to a log file, the CPU server shim installed in every server process
(``server_site/sitecustomize.py``), and SGLang told to import only the Llama model module (start-up
on a loaded 2-core machine is dominated by imports). :meth:`Server.wait_ready` waits, bounded,
for ``/health`` and SGLang's "fired up and ready" line (after its own warm-up request); a server
that exits or is not ready in time fails the test with its log tail; one whose HTTP port was
taken before it bound it is restarted on another port. Ports are drawn outside the kernel's
ephemeral range (:func:`free_port`). Several servers can be launched first and waited for
afterwards, so their start-ups overlap.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import random
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

SUPPORT = Path(__file__).parent
STARTUP_TIMEOUT_S = 600  # a loaded 2-core machine: imports dominate (seen: 95-380 s)
REQUEST_TIMEOUT_S = 120
PAGE = 4


def free_port() -> int:
    """A port free now, for a server process to bind later: drawn between SGLang's own picks
    (22000-29999, its NCCL / TCPStore ports) and the kernel's ephemeral range (bind(0) and
    connect() hand those out, so one taken from there can be gone by the time the server binds
    it: seen with three servers starting at once)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = range(30000, ephemeral_low)
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(
    url: str,
    payload: dict | None = None,
    timeout: float = REQUEST_TIMEOUT_S,
    method=None,
    headers: dict[str, str] | None = None,
):
    """(status, body) of one HTTP request; an HTTP error status raises urllib's HTTPError."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        method=method,
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


def model_modules_except(*keep: str) -> str:
    """``SGLANG_DISABLED_MODEL_ARCHS`` for a server that imports only the model modules ``keep``
    (default: llama)."""
    keep = keep or ("llama",)
    spec = importlib.util.find_spec("sglang.srt.models")
    assert spec is not None and spec.submodule_search_locations
    names = [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
    assert set(keep) <= set(names), (keep, names)
    return ",".join(n for n in names if n not in keep)


class Server:
    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.cmd, self.env, self.log = cmd, env, log
        self.proc: subprocess.Popen
        self.base = ""
        self._start()

    def _start(self) -> None:
        port = free_port()
        cmd = [*self.cmd, "--port", str(port)]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self.base = f"http://127.0.0.1:{port}"

    def generate(self, input_ids: list[int], max_new_tokens: int = 8, **extra) -> dict:
        payload = {
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            **extra,
        }
        status, body = http(f"{self.base}/generate", payload)
        assert status == 200, body
        return json.loads(body)

    def flush_cache(self) -> None:
        """SGLang's /flush_cache; ``timeout`` lets the server wait for in-flight work to end
        (it refuses to flush a busy scheduler with 400). Bounded retry on top."""
        deadline = time.monotonic() + 90
        while True:
            try:
                status, body = http(f"{self.base}/flush_cache?timeout=30", method="POST")
                if status == 200:
                    return
            except urllib.error.HTTPError as e:
                body = e.read().decode(errors="replace")
            assert time.monotonic() < deadline, f"flush_cache kept failing: {body}"
            time.sleep(1)

    def metric(self, name: str) -> float:
        """The sum of every sample of ``name`` (all label sets) on /metrics."""
        _, body = http(f"{self.base}/metrics")
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", body, re.M):
            total += float(m.group(1))
        return total

    def healthy(self) -> bool:
        try:
            return http(f"{self.base}/health", timeout=5)[0] == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S, restarts: int = 2) -> None:
        """Bounded wait for readiness. A server whose HTTP port was taken between the pick and
        its bind (uvicorn logs the error and then hangs in shutdown) is restarted on another
        port, at most ``restarts`` times."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.log.read_text(errors="replace")
            if "error while attempting to bind" in text and restarts > 0:
                self.stop()
                restarts -= 1
                self._start()
                continue
            if self.proc.poll() is not None or "error while attempting to bind" in text:
                pytest.fail(f"SGLang server failed (rc {self.proc.poll()}):\n{self.tail()}")
            if self.healthy() and "fired up and ready" in text:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"SGLang server not ready in {timeout_s} s:\n{self.tail()}")
            time.sleep(2)

    def kill(self) -> None:
        """SIGKILL the server's whole process group (a crash: no shutdown code runs)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server's own process group
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def hicache_args(extra: dict) -> list[str]:
    """Server flags for HiCache with tpusync as its storage backend (layer_first host pool, the
    ``direct`` io backend, prefetch waited for), ``extra`` over the backend config every live
    scenario shares: SGLang's dynamic-loader keys, no prefault, and SGLang's own prefetch knobs
    (popped by SGLang before the backend sees the config): prefetch from one page on, and give a
    slow CPU machine time to finish it."""
    config = {
        "backend_name": "tpusync",
        "module_path": "tpusync.sglang",
        "class_name": "TpusyncHiCacheStorage",
        "interface_v1": 1,
        "prefault": False,
        "prefetch_threshold": PAGE,
        "prefetch_timeout_base": 60,
        **extra,
    }
    return [
        "--enable-hierarchical-cache", "--hicache-ratio", "2",
        "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", json.dumps(config),
        "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip


def assert_from_storage(response: dict, tokens: int, server: Server) -> None:
    """``response`` (from ``server``) had its first ``tokens`` prompt tokens from tpusync storage
    (HiCache L3), none from the device or host cache."""
    meta = response["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    assert details.get("storage_backend") == "TpusyncHiCacheStorage", meta
    assert details.get("storage", 0) == tokens, (meta, server.tail())
    assert details.get("device", 0) == 0 and details.get("host", 0) == 0, meta


def launch(model: Path, log: Path, args: list[str], env: dict[str, str] | None = None) -> Server:
    """Start (not wait for) a server of ``model`` with the shared flags plus ``args``."""
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model), "--device", "cpu", "--host", "127.0.0.1",
        "--attention-backend", "torch_native", "--grammar-backend", "none",
        "--disable-cuda-graph", "--page-size", str(PAGE), "--max-total-tokens", "2048",
        "--random-seed", "1",
        *args,
    ]  # fmt: skip
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(SUPPORT / "server_site"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "TPUSYNC_SGLANG_CPU_SHIM": "1",
        "SGLANG_DISABLED_MODEL_ARCHS": model_modules_except(),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(env or {}),
    }
    return Server(cmd, full_env, log)
