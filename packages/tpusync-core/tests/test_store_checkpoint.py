"""Disk tier checkpoints while the store serves, and the slot journal (docs/tiers.md "Crash
semantics"; native/include/tpusync/tier/disk_tier.h CHECKPOINT CONTRACT).

A store writes a checkpoint manifest in the background (``checkpoint_s`` / ``checkpoint_writes``)
and journals every slot it changes after it. A process killed with SIGKILL is restarted from the
manifest plus the headers of only the journaled slots, and serves exactly what a full header scan
of the same files serves.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from store_blocks import BLOCK, served

import tpusync.core as tc

PRELUDE = textwrap.dedent(
    """
    import json, sys, threading, time, numpy as np, tpusync.core as tc
    disk = sys.argv[1]
    base = np.arange({block}, dtype=np.uint32)
    def put(s, i):
        data = ((base * 7 + i * 131) % 251).astype(np.uint8)[None]
        assert s.put([b"blk-%d" % i], data).result(10) == [True]
    def disk_stats(s):
        return s.stats()["tiers"]["disk"]
    def wait_for(pred, what):
        deadline = time.monotonic() + 20
        while not pred():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)
    """
)

AFTER_A_CHECKPOINT = PRELUDE + textwrap.dedent(
    """
    s = tc.KVStore({block}, 0, disk_dir=disk, disk_blocks=30, checkpoint_s=0,
                   checkpoint_writes=24)
    # The cold open wrote the first (empty) checkpoint: every put is journaled after it.
    assert disk_stats(s)["checkpoints"] == 1
    for i in range(24):
        put(s, i)
    # 24 changed slots: the checkpoint thread writes one within ~100 ms.
    wait_for(lambda: disk_stats(s)["checkpoints"] == 2 and disk_stats(s)["journaled"] == 0,
             "no checkpoint")
    s.remove([b"blk-0", b"blk-1", b"blk-2"])  # forgotten: journaled
    for i in range(24, 34):  # 10 more: the 31st block evicts blk-3, its slot is re-used
        put(s, i)
    time.sleep(0.3)  # 13 changes < 24: no second checkpoint may come
    print(json.dumps(disk_stats(s)), flush=True)
    time.sleep(120)
    """
)

RACING = PRELUDE + textwrap.dedent(
    """
    s = tc.KVStore({block}, 0, disk_dir=disk, disk_blocks=256, checkpoint_s=0,
                   checkpoint_writes=8)
    def writer(w):
        for i in range(w * 50, w * 50 + 50):
            put(s, i)
            time.sleep(0.01)  # ~0.5 s of puts: several checkpoints (polled every 100 ms) run
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(disk_stats(s)), flush=True)
    time.sleep(120)
    """
)

NO_CHECKPOINT = PRELUDE + textwrap.dedent(
    """
    s = tc.KVStore({block}, 0, disk_dir=disk, disk_blocks=16, checkpoint_s=0,
                   checkpoint_writes=0)
    for i in range(5):
        put(s, i)
    print(json.dumps(disk_stats(s)), flush=True)
    time.sleep(120)
    """
)


SCAN_OPEN_THEN_MORE = PRELUDE + textwrap.dedent(
    """
    # Opened by scan (the last run was killed before any checkpoint): the first checkpoint comes
    # at once, in the background, though neither trigger would fire for a long time.
    s = tc.KVStore({block}, 0, disk_dir=disk, disk_blocks=64, checkpoint_s=3600,
                   checkpoint_writes=1000)
    assert disk_stats(s)["recovery"] == "scan"
    wait_for(lambda: disk_stats(s)["checkpoints"] == 1, "no first checkpoint after the scan")
    for i in range(20, 23):
        put(s, i)
    print(json.dumps(disk_stats(s)), flush=True)
    time.sleep(120)
    """
)


def run_and_kill(tmp_path: Path, script: str, disk: Path) -> dict:
    """Runs the child until it prints its disk stats, then SIGKILLs it."""
    path = tmp_path / "child.py"
    path.write_text(script.format(block=BLOCK))
    proc = subprocess.Popen(
        [sys.executable, str(path), str(disk)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line, "the child died before it was ready"
        return json.loads(line)
    finally:
        proc.kill()  # SIGKILL: no destructor, no clean-close manifest
        assert proc.wait(30) == -9


def scan_of_a_copy(disk: Path, tmp_path: Path, disk_blocks: int, ids: list[int]) -> set[int]:
    """What a full header scan of the same files serves (a copy without the manifest)."""
    copy = tmp_path / "scan-copy"
    shutil.copytree(disk, copy)
    (copy / "manifest").unlink()
    s = tc.KVStore(BLOCK, 0, disk_dir=copy, disk_blocks=disk_blocks, checkpoint_s=0)
    assert s.stats()["tiers"]["disk"]["recovery"] == "scan"
    got = served(s, ids)
    s.close()
    return got


def test_sigkill_after_a_checkpoint_reads_only_the_journaled_slots(tmp_path, capfd):
    disk = tmp_path / "disk"
    at_kill = run_and_kill(tmp_path, AFTER_A_CHECKPOINT, disk)
    assert at_kill["checkpoints"] == 2  # the cold open's, then the one after 24 changes
    assert at_kill["journaled"] == 13  # 3 forgotten + 10 written slots
    ids = list(range(34))
    scan = scan_of_a_copy(disk, tmp_path, 30, ids)
    capfd.readouterr()
    s = tc.KVStore(BLOCK, 0, disk_dir=disk, disk_blocks=30, checkpoint_s=0)
    st = s.stats()["tiers"]["disk"]
    assert st["recovery"] == "checkpoint"
    # The freed slots are the ones re-written: 10 distinct slots at most, never all 30.
    assert 0 < st["recovery_slots_read"] <= 13
    assert "scanning" not in capfd.readouterr().err
    got = served(s, ids)
    assert got == scan
    assert got == set(range(4, 34))  # 0-2 removed, 3 evicted
    assert s.stats()["corrupted"] == 0
    s.close()


def test_sigkill_while_checkpoints_race_concurrent_puts_loses_no_block(tmp_path):
    disk = tmp_path / "disk"
    at_kill = run_and_kill(tmp_path, RACING, disk)
    assert at_kill["checkpoints"] >= 2
    ids = list(range(200))
    scan = scan_of_a_copy(disk, tmp_path, 256, ids)
    s = tc.KVStore(BLOCK, 0, disk_dir=disk, disk_blocks=256, checkpoint_s=0)
    assert s.stats()["tiers"]["disk"]["recovery"] == "checkpoint"
    got = served(s, ids)
    assert got == set(ids)  # every put that completed before the kill
    assert got == scan
    s.close()


def test_sigkill_before_any_checkpoint_scans(tmp_path, capfd):
    disk = tmp_path / "disk"
    run_and_kill(tmp_path, NO_CHECKPOINT, disk)
    assert not (disk / "manifest").exists()
    capfd.readouterr()
    s = tc.KVStore(BLOCK, 0, disk_dir=disk, disk_blocks=16, checkpoint_s=0)
    st = s.stats()["tiers"]["disk"]
    assert st["recovery"] == "scan" and st["recovery_slots_read"] == 16
    assert "no clean-shutdown manifest or checkpoint (last close was not clean)" in (
        capfd.readouterr().err
    )
    assert served(s, list(range(5))) == set(range(5))
    s.close()


NO_CHECKPOINT_20 = NO_CHECKPOINT.replace("disk_blocks=16", "disk_blocks=64").replace(
    "range(5)", "range(20)"
)


def test_a_second_sigkill_soon_after_a_scan_open_reads_only_the_journaled_slots(tmp_path, capfd):
    disk = tmp_path / "disk"
    run_and_kill(tmp_path, NO_CHECKPOINT_20, disk)  # killed before any checkpoint: next open scans
    capfd.readouterr()
    at_kill = run_and_kill(tmp_path, SCAN_OPEN_THEN_MORE, disk)
    assert at_kill["recovery"] == "scan" and at_kill["checkpoints"] == 1
    assert at_kill["journaled"] == 3
    capfd.readouterr()
    s = tc.KVStore(BLOCK, 0, disk_dir=disk, disk_blocks=64, checkpoint_s=0)
    st = s.stats()["tiers"]["disk"]
    assert st["recovery"] == "checkpoint"
    assert st["recovery_slots_read"] == 3  # the 3 puts after the first checkpoint, not 64
    assert "scanning" not in capfd.readouterr().err
    assert served(s, list(range(23))) == set(range(23))
    s.close()


WRITE_BACK = PRELUDE + textwrap.dedent(
    """
    s = tc.KVStore({block}, 0, disk_dir=disk, disk_blocks=64, checkpoint_s=0,
                   checkpoint_writes=0, checkpoint_write_back=sys.argv[2])
    for i in range(40):
        put(s, i)
    s.checkpoint()
    for i in range(40, 43):
        put(s, i)
    print(json.dumps(disk_stats(s)), flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("mode", ["at_fsync", "progressive"])
def test_either_manifest_write_back_gives_a_checkpoint_a_crash_restart_reads(tmp_path, mode):
    """tier/disk_manifest.h WRITE-BACK CONTRACT: the option reaches the disk tier (reported in its
    stats) and either mode writes a checkpoint that a restart after SIGKILL reads, with only the
    slots changed after it read."""
    disk = tmp_path / "disk"
    script = tmp_path / "child.py"
    script.write_text(WRITE_BACK.format(block=BLOCK))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(disk), mode], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line, "the child died before it was ready"
        at_kill = json.loads(line)
    finally:
        proc.kill()
        assert proc.wait(30) == -9
    assert at_kill["manifest_write_back"] == mode
    assert at_kill["journaled"] == 3 and at_kill["manifest_errors"] == 0
    s = tc.KVStore(BLOCK, 0, disk_dir=disk, disk_blocks=64, checkpoint_s=0)
    st = s.stats()["tiers"]["disk"]
    assert st["recovery"] == "checkpoint" and st["recovery_slots_read"] == 3
    assert st["manifest_write_back"] == "progressive"  # the default
    assert served(s, list(range(43))) == set(range(43))
    assert not (disk / "manifest.old").exists()  # OLD-MANIFEST CONTRACT: freed after the publish
    s.close()


@pytest.mark.parametrize("bad", ["fsync", "Progressive", True, 1, None])
def test_a_bad_checkpoint_write_back_is_refused_before_anything_opens(tmp_path, bad):
    disk = tmp_path / "disk"
    with pytest.raises(ValueError, match="checkpoint_write_back must be one of"):
        tc.KVStore(BLOCK, 0, disk_dir=disk, disk_blocks=8, checkpoint_write_back=bad)
    assert not disk.exists()
