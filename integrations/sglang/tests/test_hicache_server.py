"""Scenario 1 of issue 8: a LIVE SGLang server (real processes, real HTTP) with HiCache on tpusync.

``python -m sglang.launch_server`` runs the tiny test model on CPU with
``--enable-hierarchical-cache --hicache-storage-backend dynamic`` and the extra config naming
``tpusync.sglang.TpusyncHiCacheStorage``. A request is served, ``/flush_cache`` drops the device
and host caches, and the same request again is served with its prefix pages loaded from tpusync
storage: ``meta_info.cached_tokens_details.storage`` counts them, the backend's own prefetch
counters (SGLang's ``sglang:prefetch_pgs`` histogram, fed by the backend's ``get_stats``) count
the pages it served, and greedy output is identical. The backend also publishes its store's
placement changes as KV events (``kv_events_endpoint``): the subscriber sees every page of the
prompt announced in medium CPU under SGLang's own page hashes. Last, the server is killed with
SIGKILL and a replacement with the same extra config (``namespace``: host tier in /dev/shm;
``disk_dir``) serves a prompt the killed server had stored from storage, with identical output.
The store's host tier holds fewer pages than either prompt, so both prompts come back partly from
the disk tier (written back as the host tier overflowed), in the running server and after the
SIGKILL.

CPU only through the TEST-ONLY shim ``support/cpu_server_shim.py`` (installed in every server
process by ``support/server_site/sitecustomize.py``): CPU stand-ins for SGLang's host-pool copy
kernel and host-memory registration, nothing of tpusync. The server is started by
``support/live_server.py`` (LIVE SERVER CONTRACT).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import tiny_model
from live_server import PAGE, assert_from_storage, free_port, hicache_args, launch

# The store's host tier, in pages: fewer than either prompt has, so their pages overflow into the
# disk tier and are read back from it.
HOST_PAGES = 6

PROMPT = (
    "the cache page block host disk token model prefix hit miss store load copy layer head key "
    "value tpusync sglang the cache page block host disk token model prefix"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = Path(os.environ.get("TPUSYNC_REPO_ROOT", Path(__file__).resolve().parents[3]))
    model = tiny_model.ensure(root)
    events_endpoint = f"tcp://127.0.0.1:{free_port()}"
    work = tmp_path_factory.mktemp("sglang-server")
    log = work / "server.log"
    namespace = f"sglang-live-{os.getpid()}"
    args = hicache_args(
        {
            "capacity_pages": HOST_PAGES,
            # Host tier in /dev/shm and a disk tier: a replacement server re-attaches both.
            "namespace": namespace,
            "disk_dir": str(work / "disk"),
            "disk_gb": 0.05,
            "kv_events_endpoint": events_endpoint,
            "kv_events_pod_id": "pod-live",
            "kv_events_model": "tiny",
        }
    )
    srv = launch(model, log, args)
    srv.model_dir = model
    srv.events_endpoint = events_endpoint
    srv.args = args
    srv.work = work
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        from tpusync.core import KVStore

        KVStore.unlink_namespace(namespace)


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
        # every whole page of the prompt but the last token's, from tpusync storage, none from
        # device or host
        expected = (len(ids) - 1) // PAGE * PAGE
        assert expected // PAGE > HOST_PAGES  # so some of them are read from the disk tier
        assert_from_storage(second, expected, server)
        assert second["meta_info"]["cached_tokens"] == expected, second["meta_info"]
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


RESTART_PROMPT = (
    "a server killed without warning comes back warm: its host tier in shared memory and its "
    "disk tier are found again by the next server with the same namespace and directory"
)


def test_a_server_killed_with_sigkill_is_replaced_warm(server):
    """Runs last in this module: it kills the module's server. The replacement, started with the
    same extra config, has empty device and host caches, so every prefix page it reports from
    storage was found in the tiers the killed server left behind: at most HOST_PAGES of them in
    the /dev/shm host tier, the rest in the disk tier (whose lock died with the killed server, or
    the replacement would not start)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(server.model_dir)(RESTART_PROMPT).input_ids
    expected = (len(ids) - 1) // PAGE * PAGE
    assert expected // PAGE > 2 * HOST_PAGES  # most of them come back from the disk tier
    backed_before = server.metric("sglang:backup_pgs_sum")
    first = server.generate(ids)
    assert first["meta_info"]["cached_tokens"] == 0
    deadline = time.monotonic() + 60
    while server.metric("sglang:backup_pgs_sum") - backed_before < expected // PAGE:
        assert time.monotonic() < deadline, f"prompt pages not all backed up:\n{server.tail()}"
        time.sleep(1)
    server.kill()

    replacement = launch(server.model_dir, server.work / "replacement.log", server.args)
    try:
        replacement.wait_ready()
        second = replacement.generate(ids)
        assert_from_storage(second, expected, replacement)
        assert second["output_ids"] == first["output_ids"]
        assert "cold start" not in replacement.log.read_text(errors="replace")
    finally:
        replacement.stop()
