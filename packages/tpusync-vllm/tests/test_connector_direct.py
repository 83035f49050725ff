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


def vllm_config(extra: dict, role: str = "kv_both"):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    model = str(tiny_model_dir())
    return VllmConfig(
        model_config=ModelConfig(
            model=model, tokenizer=model, dtype="float32", max_model_len=1024, seed=0
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TpusyncConnector",
            kv_role=role,
            kv_connector_extra_config=extra,
            engine_id=str(uuid.uuid4()),
        ),
    )


def worker(extra: dict):
    """A worker-role connector over zeroed CPU KV caches: (connector, caches, layer names)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    register()
    vc = vllm_config(extra)
    mc = vc.model_config
    heads, head = mc.get_num_kv_heads(vc.parallel_config), mc.get_head_size()
    names = [
        f"model.layers.{i}.self_attn.attn" for i in range(mc.get_num_layers(vc.parallel_config))
    ]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype=mc.dtype)
    kc = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
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
