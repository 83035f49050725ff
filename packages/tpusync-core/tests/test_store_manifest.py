"""Clean-shutdown manifest of the disk tier (docs/tiers.md "Crash semantics").

A KVStore that closes cleanly leaves ``<disk_dir>/manifest``; the next store on that directory
takes its blocks from it instead of reading every slot header and keeps it, journaling every slot
it changes after it, so a store killed with SIGKILL after that is restarted from the manifest plus
the headers of only the journaled slots (test_store_checkpoint.py has the periodic checkpoints).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from store_blocks import BLOCK, blocks, keys, served

import tpusync.core as tc


def open_store(disk: Path) -> tc.KVStore:
    return tc.KVStore(BLOCK, 4, disk_dir=disk, disk_blocks=64, writeback_batch=2)


KILLED = textwrap.dedent(
    """
    import sys, time, numpy as np, tpusync.core as tc
    disk = sys.argv[1]
    s = tc.KVStore({block}, 4, disk_dir=disk, disk_blocks=64, writeback_batch=2,
                   checkpoint_s=0, checkpoint_writes=0)
    print(s.stats()["tiers"]["disk"]["recovery"], flush=True)
    base = np.arange({block}, dtype=np.uint32)
    for i in range(24, 32):
        s.put([b"blk-%d" % i], ((base * 7 + i * 131) % 251).astype(np.uint8)[None]).result(10)
    s.flush(30)
    print("READY", flush=True)
    time.sleep(120)
    """
)


def test_clean_close_reopens_from_the_manifest_and_a_later_sigkill_reads_the_journal(
    tmp_path, capfd
):
    disk = tmp_path / "disk"
    manifest = disk / "manifest"
    ids = list(range(24))
    s = open_store(disk)
    assert s.stats()["tiers"]["disk"]["recovery"] == "cold"
    for i in ids:
        assert s.put(keys([i]), blocks([i])).result(10) == [True]
    s.flush(30)
    on_disk = s.stats()["tiers"]["disk"]["indexed"]
    assert on_disk >= 20
    # The cold open wrote an empty checkpoint at once (the first checkpoint); every put since is
    # journaled after it.
    assert s.stats()["tiers"]["disk"]["checkpoints"] == 1
    s.close()
    assert manifest.is_file()  # written again at the clean close

    s = open_store(disk)
    st = s.stats()["tiers"]["disk"]
    assert st["recovery"] == "manifest"
    assert st["recovered"] == on_disk and st["indexed"] == on_disk
    assert manifest.is_file()  # kept: a new journal generation continues it
    assert len(served(s, ids)) == on_disk
    assert s.stats()["corrupted"] == 0
    s.close()
    assert manifest.is_file()

    # A process that opened from the manifest, wrote more (no checkpoint of its own), and was
    # killed: the next open takes the manifest and reads the headers of the journaled slots only.
    script = tmp_path / "killed.py"
    script.write_text(KILLED.format(block=BLOCK))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(disk)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "manifest"
        assert proc.stdout.readline().strip() == "READY"
    finally:
        proc.kill()  # SIGKILL: no destructor, no new manifest
        assert proc.wait(30) == -9
    assert manifest.is_file()
    capfd.readouterr()
    s = open_store(disk)
    st = s.stats()["tiers"]["disk"]
    assert st["recovery"] == "checkpoint"
    assert 0 < st["recovery_slots_read"] < 64
    assert "scanning" not in capfd.readouterr().err
    assert st["recovered"] >= on_disk
    assert len(served(s, list(range(32)))) == st["indexed"]
    assert s.stats()["corrupted"] == 0
    s.close()
