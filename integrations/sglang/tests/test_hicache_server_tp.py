"""A LIVE SGLang server of two tensor-parallel ranks with HiCache on tpusync.

``--tp-size 2`` on CPU runs two scheduler processes (one per rank, each bound to one core with
``SGLANG_CPU_OMP_THREADS_BIND``), each with its own backend built from the one extra config, as
on a GPU server. The RANK RESOURCES CONTRACT of ``tpusync.sglang.hicache`` gives each rank its
own disk directory (``disk_dir/tp0``, ``disk_dir/tp1``) and ``/dev/shm`` namespace
(``<namespace>-tp0``, ``-tp1``): before it, the second rank stopped at start-up on the first
rank's locks. A request is served, ``/flush_cache`` drops the device and host caches, and the
same request comes back with every whole page from storage and identical greedy output. SGLang
counts a storage hit only where every rank found the page (it takes the minimum over the TP
group), so both ranks served their shard of each page; the host tier holds fewer pages than the
prompt has, so part of each rank's shard came back from its disk tier.

CPU only through the TEST-ONLY shim (see test_hicache_server.py); started by
``support/live_server.py`` (LIVE SERVER CONTRACT).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import tiny_model
from live_server import PAGE, assert_from_storage, hicache_args, launch

HOST_PAGES = 6  # per rank: fewer than the prompt's pages, so some come back from disk
PROMPT = list(range(40, 77))  # 37 tokens: 9 whole pages and one partial


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = Path(os.environ.get("TPUSYNC_REPO_ROOT", Path(__file__).resolve().parents[3]))
    model = tiny_model.ensure(root)
    work = tmp_path_factory.mktemp("sglang-server-tp2")
    namespace = f"sglang-tp2-{os.getpid()}"
    args = [
        "--tp-size", "2",
        *hicache_args({"capacity_pages": HOST_PAGES, "namespace": namespace,
                       "disk_dir": str(work / "disk"), "disk_gb": 0.05}),
    ]  # fmt: skip
    srv = launch(model, work / "server.log", args, {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    srv.work = work
    srv.namespace = namespace
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        from tpusync.core import KVStore

        for rank in (0, 1):
            KVStore.unlink_namespace(f"{namespace}-tp{rank}")


def test_each_rank_serves_its_shard_back_from_its_own_tiers(server):
    first = server.generate(PROMPT)
    assert first["meta_info"]["cached_tokens"] == 0
    expected = (len(PROMPT) - 1) // PAGE * PAGE
    assert expected // PAGE > HOST_PAGES
    deadline = time.monotonic() + 60
    while server.metric("sglang:backup_pgs_sum") < expected // PAGE:
        assert time.monotonic() < deadline, f"no backup to tpusync:\n{server.tail()}"
        time.sleep(1)
    server.flush_cache()

    second = server.generate(PROMPT)
    assert_from_storage(second, expected, server)
    assert second["output_ids"] == first["output_ids"]

    # One store per rank, each with its own disk directory and /dev/shm host tier.
    disk = server.work / "disk"
    assert sorted(p.name for p in disk.iterdir()) == ["tp0", "tp1"]
    for rank in ("tp0", "tp1"):
        assert (disk / rank / "tier.meta").is_file()
        assert list((disk / rank).glob("*.tps")), f"rank {rank} wrote no disk segment"
        assert Path(f"/dev/shm/tpusync-{server.namespace}-{rank}-host").exists()
    assert server.log.read_text(errors="replace").count("tpusync HiCache storage: pages of") == 2
