"""The worker connector built straight from a VllmConfig (no engine), with faults injected.

Runs in the integration-vllm session (skipped without vLLM). The KV caches are plain CPU tensors
in vLLM's layout; the store's ``get`` is wrapped to be late, the one fault these tests inject.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from tinymodel import tiny_model_dir  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from tpusync.vllm.connector import TpusyncConnector, TpusyncMetadata, Transfer  # noqa: E402
from tpusync.vllm.plugin import register  # noqa: E402

BLOCK = 32
BLOCKS = 16


def vllm_config(extra: dict, role: str = "kv_both", dtype: str = "float32", block: int = BLOCK):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    model = str(tiny_model_dir())
    return VllmConfig(
        model_config=ModelConfig(
            model=model, tokenizer=model, dtype=dtype, max_model_len=1024, seed=0
        ),
        cache_config=CacheConfig(block_size=block, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TpusyncConnector",
            kv_role=role,
            kv_connector_extra_config=extra,
            engine_id=str(uuid.uuid4()),
        ),
    )


def kv_config(vc):
    """vLLM's KV cache config for ``vc``'s model: one full-attention group of BLOCKS blocks."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = vc.model_config
    heads, head = mc.get_num_kv_heads(vc.parallel_config), mc.get_head_size()
    layers = mc.get_num_layers(vc.parallel_config)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    block = vc.cache_config.block_size
    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=mc.dtype)
    kc = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
    return kc, names, heads, head


def worker(extra: dict):
    """A worker-role connector over zeroed CPU KV caches: (connector, caches, layer names)."""
    register()
    vc = vllm_config(extra)
    mc = vc.model_config
    kc, names, heads, head = kv_config(vc)
    conn = TpusyncConnector(vc, KVConnectorRole.WORKER, kc)
    caches = {n: torch.zeros(2, BLOCKS, BLOCK, heads, head, dtype=mc.dtype) for n in names}
    conn.register_kv_caches(caches)
    return conn, caches, names


class Late:
    """A get future that answers only after ``delay`` seconds."""

    def __init__(self, fut, delay: float) -> None:
        self.fut, self.delay = fut, delay

    def mask(self, timeout=None):
        time.sleep(self.delay)
        return self.fut.mask(timeout)


def test_a_layer_whose_wait_timed_out_is_a_load_error_not_a_hit():
    """LATE LAYER RULE: layer 0's wait times out (a get slower than load_timeout_s), so the
    forward reads that layer unloaded; the load lands later, "in time" for the step's end. Every
    block of the load must be reported as a load error (vLLM recomputes); it was counted as
    loaded, and the wrong KV was then saved under the prompt's keys."""
    conn, caches, names = worker({"host_bytes": 32 << 20, "load_timeout_s": 1.0})
    try:
        for n in names:
            caches[n][:, 0:4].fill_(7.0)
        keys = [bytes([i]) * 32 for i in range(4)]
        assert conn.store.save(keys, [0, 1, 2, 3], 10) == 4
        real_get = conn.store.store.get
        conn.store.store.get = lambda k, d, rows=None: Late(real_get(k, d, rows), 1.5)
        conn.bind_connector_metadata(
            TpusyncMetadata(loads=[Transfer("req-1", keys, [8, 9, 10, 11])])
        )
        conn.start_load_kv(None)
        conn.wait_for_layer_load(names[0])
        assert not caches[names[0]][:, 8:12].any()  # what the forward read: nothing loaded yet
        for n in names[1:]:
            conn.wait_for_layer_load(n)
        conn.wait_for_save()
        assert conn.get_block_ids_with_load_errors() == {8, 9, 10, 11}
        conn.clear_connector_metadata()
    finally:
        conn.shutdown()


def scheduler(role: str, dtype: str = "float32", block: int = BLOCK) -> TpusyncConnector:
    register()
    vc = vllm_config({"host_bytes": 8 << 20, "pd_same_host": False}, role, dtype, block)
    return TpusyncConnector(vc, KVConnectorRole.SCHEDULER, kv_config(vc)[0])


def test_a_consumer_refuses_kv_of_another_model_config_or_another_prompt(monkeypatch):
    """P/D IDENTITY RULE: the producer's kv_transfer_params name its model identity and its
    prompt; a consumer whose dtype / block size differ (pages of equal size hid it: bf16 x 64
    tokens = fp32 x 32) or whose prompt differs computes locally instead of reading foreign KV
    as its own."""
    from types import SimpleNamespace

    from tpusync.vllm import connector as C

    consumer = scheduler("kv_consumer")
    same = scheduler("kv_producer")
    other = scheduler("kv_producer", dtype="bfloat16", block=2 * BLOCK)
    prompt = list(range(129))

    def params(producer: TpusyncConnector, tokens: list[int]) -> dict:
        return {
            "do_remote_prefill": True,
            "tpusync_ranks": [["127.0.0.1:7000", "", ""]],
            "tpusync_layout": [1, 1],
            "tpusync_transfer_id": 5,
            "tpusync_num_blocks": 4,
            "tpusync_kv_identity": producer._kv_identity(),
            "tpusync_tokens": C._tokens_digest(tokens, 4 * BLOCK),
        }

    def matched(p: dict, tokens: list[int] = prompt) -> int:
        req = SimpleNamespace(
            request_id=f"r{id(p)}", kv_transfer_params=p, num_tokens=len(tokens),
            prompt_token_ids=tokens, block_hashes=[],
        )  # fmt: skip
        return consumer._pd_matched(req, 0)[0]

    try:
        assert matched(params(same, prompt)) == 4 * BLOCK
        assert same._kv_identity() != other._kv_identity()
        assert matched(params(other, prompt)) == 0
        assert matched(params(same, list(range(1000, 1129)))) == 0  # another prompt
        old = params(same, prompt)
        del old["tpusync_kv_identity"], old["tpusync_tokens"]
        assert matched(old) == 0  # a producer that says neither
    finally:
        for c in (consumer, same, other):
            c.shutdown()


def test_data_parallel_engines_publish_kv_events_on_their_own_endpoints():
    """DP RULE: every DP engine's scheduler connector bound the one configured endpoint, so the
    second engine failed to start (Address already in use); its port is now offset by its DP
    rank, as vLLM's own publisher does, and its batches name the rank."""
    from tpusync.vllm.connector import dp_endpoint

    assert dp_endpoint("tcp://127.0.0.1:7000", 0) == "tcp://127.0.0.1:7000"
    assert dp_endpoint("tcp://127.0.0.1:7000", 3) == "tcp://127.0.0.1:7003"
    assert dp_endpoint("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"
    assert dp_endpoint("ipc:///tmp/ev.sock", 2) == "ipc:///tmp/ev.sock_dp2"
    register()
    port = two_free_ports()
    conns = []
    try:
        for dp in (0, 1):
            extra = {"host_bytes": 8 << 20, "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}
            vc = vllm_config(extra)
            vc.parallel_config.data_parallel_rank = dp
            conns.append(TpusyncConnector(vc, KVConnectorRole.SCHEDULER, kv_config(vc)[0]))
        assert [c._publisher.endpoint for c in conns] == [
            f"tcp://127.0.0.1:{port}",
            f"tcp://127.0.0.1:{port + 1}",
        ]
    finally:
        for c in conns:
            c.shutdown()


def two_free_ports() -> int:
    """A port p with p and p + 1 free a moment ago."""
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise AssertionError("no two adjacent free ports")
