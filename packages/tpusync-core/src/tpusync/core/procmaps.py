"""Which address ranges of this process may be written (Linux ``/proc/self/maps``).

WRITABLE MEMORY CHECK: a native copy into read-only memory does not fail, it kills the process
with SIGSEGV. numpy marks such arrays (``flags.writeable``) and is refused by that flag, but torch
keeps no read-only flag: ``torch.from_numpy(np.load(path, mmap_mode="r"))`` only warns, and its
memory is a read-only file mapping. ``check_writable`` reads the process's mappings and refuses a
range that any read-only or unmapped byte touches, naming what it is and the mapping. It reads
the whole map on every call (about a millisecond per thousand mappings), so callers check once
per target (a KV cache at its first load, the targets of one weights restore), never per block.
Where ``/proc/self/maps`` cannot be read (not Linux), nothing is checked.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from tpusync.core.errors import InvalidArgumentError

__all__ = ["check_writable"]


def _mappings() -> list[tuple[int, int, str, str]] | None:
    """(start, end, perms, path) of every mapping, in address order; None without /proc."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        parts = line.split(None, 5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append((start, end, parts[1], parts[5].strip() if len(parts) > 5 else ""))
    return out


def check_writable(ranges: Iterable[tuple[int, int, str]], action: str) -> None:
    """Raise InvalidArgumentError unless every byte of every ``(address, nbytes, what)`` range
    lies in a writable mapping of this process. ``action`` says what would write there (for the
    message: "a load", "restore_weights")."""
    maps = _mappings()
    if maps is None:
        return
    starts = [m[0] for m in maps]
    for addr, nbytes, what in ranges:
        pos, end = addr, addr + nbytes
        i = bisect.bisect_right(starts, pos) - 1
        while pos < end:
            if i < 0 or i >= len(maps) or not maps[i][0] <= pos < maps[i][1]:
                raise InvalidArgumentError(
                    f"{what}: its memory at {pos:#x} is not mapped in this process; "
                    f"{action} would write there"
                )
            _, stop, perms, path = maps[i]
            if "w" not in perms:
                raise InvalidArgumentError(
                    f"{what}: its memory at {pos:#x} is read-only (a {perms} mapping of "
                    f"{path or 'anonymous memory'}); {action} would write there and crash the "
                    "process: build it over writable memory (np.load without mmap_mode='r', "
                    "or .clone() it)"
                )
            pos, i = stop, i + 1
