"""The vLLM live tests' child processes: scenario scripts and OpenAI servers.

Each child runs in a session of its own, so that killing its process group also ends vLLM's
engine-core and worker children, and writes its output to a log file the failure message quotes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import rl_netutil as U


def start(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    """``cmd`` in its own session, offline, with the tests' tpusync secret and ``env`` added."""
    full = {
        **os.environ,
        "TPUSYNC_AUTH_SECRET": U.SECRET.decode(),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **env,
    }
    return subprocess.Popen(
        cmd,
        env=full,
        stdout=open(log, "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill(*procs: subprocess.Popen, grace: float = 0.0) -> None:
    """SIGKILL each process's group (vLLM's engine-core and worker children die with it), after
    up to ``grace`` s for the group to end on its own: once the scenario exited, its children
    take ~2 s to shut down and unlink their /dev/shm segments, which a SIGKILL would leak."""
    end = time.monotonic() + grace
    for proc in procs:
        try:
            while time.monotonic() < end:
                os.killpg(proc.pid, 0)
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(proc: subprocess.Popen, out: Path, log: Path, timeout: float = 600) -> dict:
    """The JSON result ``out`` of a scenario process, once it exited 0 (else the test fails
    with the end of its log)."""
    rc = None
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill(proc, grace=15.0 if rc == 0 else 0.0)
        proc.wait(timeout=30)
    if rc != 0 or not out.exists():
        pytest.fail(f"{proc.args} failed (rc {rc}):\n{log.read_text(errors='replace')[-6000:]}")
    return json.loads(out.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server: subprocess.Popen, base: str, log: Path, timeout: float = 300) -> None:
    """Until the server at ``base`` answers ``/health`` (the test fails if it exits first or
    does not answer within ``timeout`` s)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}):\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"the server did not answer /health in {timeout} s:\n{log.read_text()[-6000:]}")
