"""Two LIVE SGLang servers share a prefix cache through one tpusync store node.

A real ``tpusync store-node`` process and two SGLang servers on CPU whose HiCache backends name it
in ``store_nodes`` (nothing else shared: no filesystem, no /dev/shm namespace, separate
processes). Server A serves a prompt; its backend writes the pages through to the node. Server B
has never seen the prompt, yet serves it with every whole page from storage - the node - and the
same greedy output as A: the cross-instance prefix reuse a router such as llm-d counts on.

CPU only through the TEST-ONLY shim (see test_hicache_server.py); started by
``support/live_server.py`` (LIVE SERVER CONTRACT).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny_model
from live_server import PAGE, assert_from_storage, free_port, hicache_args, http, launch

PROMPT = (
    "two servers one store node: the second server finds every page of this prompt on the node "
    "although only the first server computed it"
)


def _segment_bytes(model: Path) -> int:
    """One page of one layer's K (or V) in SGLang's layer_first host pool: the store block."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg["dtype"] == "bfloat16"
    return PAGE * cfg["num_key_value_heads"] * head_dim * 2


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = Path(os.environ.get("TPUSYNC_REPO_ROOT", Path(__file__).resolve().parents[3]))
    model = tiny_model.ensure(root)
    work = tmp_path_factory.mktemp("sglang-shared")
    secret = work / "secret"
    secret.write_bytes(os.urandom(32).hex().encode() + b"\n")
    secret.chmod(0o600)
    metrics = free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "tpusync.core.cli", "store-node", "--listen", "127.0.0.1:0",
         "--capacity", "4MiB", "--block-bytes", str(_segment_bytes(model)),
         "--auth-secret-file", str(secret), "--metrics-port", str(metrics)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    started = []
    try:
        line = node.stdout.readline()
        assert line, "the store node did not start"
        address = json.loads(line)["address"]
        args = hicache_args(
            {"capacity_pages": 64, "store_nodes": [address], "auth_secret_file": str(secret)}
        )
        for name in ("a", "b"):
            started.append(launch(model, work / f"server-{name}.log", args))
        for srv in started:
            srv.wait_ready()
        yield model, started, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        for srv in started:
            srv.stop()
        node.terminate()
        node.communicate(timeout=30)


def _node_blocks(url: str) -> float:
    _, body = http(url)
    for line in body.splitlines():
        if line.startswith("tpusync_store_blocks_used "):
            return float(line.split()[1])
    raise AssertionError(f"no tpusync_store_blocks_used on {url}")


def test_a_second_server_serves_the_first_servers_prefix_from_the_store_node(servers):
    from transformers import AutoTokenizer

    model, (a, b), node_metrics = servers
    ids = AutoTokenizer.from_pretrained(model)(PROMPT).input_ids
    expected = (len(ids) - 1) // PAGE * PAGE
    assert expected >= 4 * PAGE

    first = a.generate(ids)
    assert first["meta_info"]["cached_tokens"] == 0
    # A's backup reaches its store, whose write-through copies each page's 4 segments (2 layers,
    # K and V) to the node in the background: wait until the node holds them.
    deadline = time.monotonic() + 60
    while _node_blocks(node_metrics) < expected // PAGE * 4:
        assert time.monotonic() < deadline, f"the node never got A's pages:\n{a.tail()}"
        time.sleep(1)

    second = b.generate(ids)
    assert_from_storage(second, expected, b)
    assert second["output_ids"] == first["output_ids"]
