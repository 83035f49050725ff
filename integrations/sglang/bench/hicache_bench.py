"""Benchmark: TpusyncHiCacheStorage zero-copy set/get vs a plain torch page copy, same pages.

Run in the integration-sglang venv (real SGLang host pool on CPU)::

    .nox/integration-sglang/bin/python integrations/sglang/bench/hicache_bench.py --json

Prints one JSON object: GB/s medians for batch_set_v1 (host pool -> tpusync), batch_get_v1
(tpusync -> host pool) and the reference (torch gathers the same pages' K and V runs into a
preallocated buffer, one thread), and their ratios. No assertions: speed targets live here, not
in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import cpu_shim  # noqa: E402

cpu_shim.install()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    tokens = a.pages * a.page_size
    dev = MHATokenToKVPool(
        tokens, a.page_size, torch.bfloat16, a.heads, a.head_dim, a.layers, "cpu", False,
        start_layer=0, end_layer=a.layers - 1,
    )  # fmt: skip
    host = MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, a.page_size, "page_first",
        pin_memory=False, device_capacity_tokens=dev.size, start_layer=0, end_layer=a.layers - 1,
    )  # fmt: skip
    extra = {
        "backend_name": "tpusync",
        "module_path": "tpusync.sglang",
        "class_name": "TpusyncHiCacheStorage",
        "interface_v1": 1,
        "capacity_pages": a.pages,
    }
    cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, True, "bench", extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)

    idx = host.alloc(tokens)
    host.kv_buffer.view(torch.int16).random_()
    page_bytes = host.get_data_page(0, flat=True).numel() * 2
    total = a.pages * page_bytes
    ref_dst = torch.empty(
        2, a.pages, a.page_size * a.layers * a.heads * a.head_dim, dtype=torch.bfloat16
    )
    page_starts = idx[:: a.page_size] // a.page_size

    def ref() -> None:
        kv = host.kv_buffer.view(2, -1, a.page_size * a.layers * a.heads * a.head_dim)
        torch.index_select(kv, 1, page_starts, out=ref_dst)

    sets, gets, refs = [], [], []
    for r in range(a.repeats):
        keys = [f"{r:08x}{i:056x}" for i in range(a.pages)]
        backend.clear()
        t = time.perf_counter()
        assert all(backend.batch_set_v1(keys, idx))
        sets.append(total / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        assert all(backend.batch_get_v1(keys, idx))
        gets.append(total / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        ref()
        refs.append(total / (time.perf_counter() - t) / 1e9)

    out = {
        "suite": "sglang-hicache",
        "pages": a.pages,
        "page_bytes": page_bytes,
        "total_bytes": total,
        "set_gbps": statistics.median(sets),
        "get_gbps": statistics.median(gets),
        "torch_gather_gbps": statistics.median(refs),
    }
    out["set_vs_torch"] = out["set_gbps"] / out["torch_gather_gbps"]
    out["get_vs_torch"] = out["get_gbps"] / out["torch_gather_gbps"]
    print(json.dumps(out, indent=None if a.json else 2))


if __name__ == "__main__":
    main()
