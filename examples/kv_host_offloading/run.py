"""A long multi-turn chat whose KV blocks live in tpusync's tiered store (host DRAM -> disk).

There is no model here (a real engine is too heavy for CI): a synthetic session stands in for it.
Each turn appends a user message and a reply to the conversation; the "engine" owns a small paged
torch KV cache (CPU tensors, vLLM's CPU layout) that it wipes between turns, as a busy server
would. Every turn it:

1. hashes the conversation's full blocks (chained SHA-256, like vLLM's prefix caching),
2. asks the store for the leading run it already holds (``lookup``) and loads that run into
   the cache (``load``: disk hits are promoted to DRAM),
3. "computes" only the remaining blocks (deterministic values from each block's hash),
4. checks every loaded byte against what was computed when that block was first seen,
5. saves the conversation's blocks (``save`` skips the ones already stored).

The host tier is deliberately too small for the conversation, so older blocks are demoted to the
disk tier and come back from it. Exit status 0 only when every reused block was byte-exact.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile

import torch

from tpusync.torch import KVCacheManager, KVLayout, KVStore

LAYERS, HEADS, BLOCK_TOKENS, HEAD_DIM = 4, 2, 16, 64


def block_hashes(tokens: list[int]) -> list[bytes]:
    out, parent = [], b"\0" * 32
    for i in range(len(tokens) // BLOCK_TOKENS):
        chunk = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in chunk)).digest()
        out.append(parent)
    return out


def computed_kv(h: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """What the model would have produced for one block, per layer: a function of its hash."""
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little"))
    return torch.randn((LAYERS, *shape), generator=g).to(torch.float16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--tokens-per-turn", type=int, default=80, help="user + assistant tokens")
    ap.add_argument("--host-blocks", type=int, default=64, help="host tier capacity (blocks)")
    ap.add_argument("--disk-blocks", type=int, default=4096)
    ap.add_argument("--disk-dir", default=None, help="default: a temporary directory")
    args = ap.parse_args()
    for name in ("turns", "tokens_per_turn", "host_blocks", "disk_blocks"):
        low = 0 if name == "host_blocks" else 1  # 0 host blocks: a disk-only store
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least {low}")

    max_blocks = args.turns * args.tokens_per_turn // BLOCK_TOKENS + 1
    layout = KVLayout.vllm_cpu(max_blocks, HEADS, BLOCK_TOKENS, HEAD_DIM, torch.float16)
    caches = [torch.zeros(layout.shape, dtype=torch.float16) for _ in range(LAYERS)]
    host_block_bytes = KVCacheManager(caches, layout, host_blocks=1).host_block_bytes
    block_shape = tuple(layout.shape[1:])

    with tempfile.TemporaryDirectory(prefix="tpusync-chat-") as tmp:
        store = KVStore(
            host_block_bytes,
            args.host_blocks,
            disk_dir=args.disk_dir or tmp,
            disk_blocks=args.disk_blocks,
            writeback_batch=8,
        )
        try:
            exact = chat(args, store, caches, layout, block_shape, max_blocks)
        finally:
            store.close()  # before the temporary directory goes (it may hold the disk tier)
    print("OK: every reused block was byte-exact" if exact else "FAILED: a reused block differed")
    return 0 if exact else 1


def chat(args, store: KVStore, caches, layout, block_shape, max_blocks: int) -> bool:
    """The turns of the conversation; True when every reused block was byte-exact."""
    mgr = KVCacheManager(caches, layout, host_blocks=4 * LAYERS * max_blocks, store=store)
    conversation: list[int] = []
    exact = True
    reused_total = computed_total = 0
    print(f"{'turn':>4} {'blocks':>6} {'reused':>6} {'computed':>8} {'host':>5} {'disk':>5}")
    for turn in range(args.turns):
        conversation += [(turn * 7919 + i * 31) % 32000 for i in range(args.tokens_per_turn)]
        hashes = block_hashes(conversation)
        for c in caches:
            c.zero_()  # the engine reused its device blocks for other requests
        # mgr.lookup(hashes) gives the same leading run; the store's own lookup also says
        # which tier serves each key (one key per block and layer, hash-major).
        n_keys, tiers = store.lookup(mgr.store_keys(hashes))
        n = n_keys // LAYERS
        per_block = [tiers[b * LAYERS : (b + 1) * LAYERS] for b in range(n)]
        on_disk = sum("disk" in t for t in per_block)
        on_host = n - on_disk
        device = list(range(len(hashes)))
        if n:
            mgr.load(hashes[:n], device[:n]).result(timeout=60)
            for b in range(n):
                want = computed_kv(hashes[b], block_shape)
                exact &= all(torch.equal(caches[i][b], want[i]) for i in range(LAYERS))
        for b in range(n, len(hashes)):  # prefill only what the store did not have
            want = computed_kv(hashes[b], block_shape)
            for i in range(LAYERS):
                caches[i][b] = want[i]
        mgr.save(hashes, device).result(timeout=60)
        reused_total += n
        computed_total += len(hashes) - n
        print(f"{turn:>4} {len(hashes):>6} {n:>6} {len(hashes) - n:>8} {on_host:>5} {on_disk:>5}")
    store.flush(60)
    s = store.stats()
    host, disk = s["tiers"].get("host", {}), s["tiers"]["disk"]  # no host tier at 0 blocks
    print(
        f"reused {reused_total} blocks, computed {computed_total}; store: promotions to host "
        f"{host.get('promotions_in', 0)}, demotions to disk {disk['demotions_in']}, disk hits "
        f"{disk['hits']}, evicted {s['evicted']}, corrupted {s['corrupted']}"
    )
    return exact


if __name__ == "__main__":
    raise SystemExit(main())
