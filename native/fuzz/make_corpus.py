"""Writes the seed corpus of the frame/handshake fuzzer (native/fuzz/corpus/), byte-exact frames
built from the layout in native/include/tpusync/transport/frame.h. Run once after a wire change:
    python native/fuzz/make_corpus.py   (needs tpusync-core installed, for checksum64)
"""

from __future__ import annotations

import struct
from pathlib import Path

from tpusync.core import checksum64

OUT = Path(__file__).resolve().parent / "corpus"
MAGIC, VERSION = 0x4E595354, 1


def frame(op: int, meta: bytes = b"", blocks: list[bytes] = (), version: int = VERSION) -> bytes:
    block_bytes = len(blocks[0]) if blocks else 0
    head = struct.pack(
        "<IHBBQIIQQ",
        MAGIC,
        version,
        op,
        0,
        7,
        len(meta),
        len(blocks),
        block_bytes,
        checksum64(meta),
    )
    head += struct.pack("<Q", checksum64(head))
    sums = b"".join(struct.pack("<Q", checksum64(b)) for b in blocks)
    return head + meta + sums + b"".join(blocks)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    seeds = {
        "challenge": frame(1, bytes(range(32))),
        "auth_response": frame(2, bytes(64)),
        "auth_proof": frame(3, bytes(32)),
        "bind": frame(4, struct.pack("<QII", 1, 0, 4)),
        "error": frame(6, b"\x03" + struct.pack("<I", 5) + b"nope!"),
        "pd_pull": frame(16, struct.pack("<IQIB", 4, 4096, 1000, 0)),
        "pd_data": frame(17, struct.pack("<IIIII", 0, 1, 2, 0, 2), [b"a" * 64, b"b" * 64]),
        "pd_end": frame(18),
        "pd_release": frame(21, b"\x07" + struct.pack("<I", 7) + b"aborted"),
        "pd_release_ok": frame(21, b"\x00" + struct.pack("<I", 0)),
        "pd_released": frame(22, b"\x03" + struct.pack("<I", 9) + b"not found"),
        "version_2": frame(1, bytes(32), version=2),
        "challenge_then_proof": frame(1, bytes(32)) + frame(3, bytes(32)),
        "truncated": frame(17, b"", [b"x" * 128])[:100],
    }
    for name, data in seeds.items():
        (OUT / name).write_bytes(data)
    print(f"wrote {len(seeds)} seeds to {OUT}")


if __name__ == "__main__":
    main()
