"""Shared fixtures: real SGLang host KV pools on CPU (with the test-only CPU shim installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

import cpu_shim  # noqa: E402 - must run before anything imports sglang

cpu_shim.install()


@pytest.fixture(scope="session")
def sglang_pools():
    """Factory for (device pool, host pool) pairs built by SGLang's own classes on CPU."""
    torch = pytest.importorskip("torch")
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    def make(layout: str, *, page_size: int = 4, layers: int = 3, heads: int = 2, dim: int = 16):
        device = MHATokenToKVPool(
            64, page_size, torch.bfloat16, heads, dim, layers, "cpu", False,
            start_layer=0, end_layer=layers - 1,
        )  # fmt: skip
        host = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
        )
        return device, host

    return make


@pytest.fixture(scope="session")
def sglang_mla_pools():
    """Factory for MLA (device pool, host pool) pairs built by SGLang's own classes on CPU."""
    torch = pytest.importorskip("torch")
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    def make(layout: str, *, page_size: int = 4, layers: int = 3):
        device = MLATokenToKVPool(
            64, page_size, torch.bfloat16, 32, 16, layers, "cpu", False,
            start_layer=0, end_layer=layers - 1,
        )  # fmt: skip
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=0,
            end_layer=layers - 1,
            target_layer_num=layers,
        )
        return device, host

    return make
