"""The connector's P/D worker half (PdWorker) without vLLM: the ABANDON CONTRACT glue that
get_finished relies on for requests finished (aborted) while their KV is still loading."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tpusync.vllm.pd import HeadPart, PdWorker, head_plan, rank_heads, spare_replica

SECRET = "pd-worker-test-secret-0123456789"


def layers(blocks: int = 8, row_bytes: int = 256, n: int = 2, fill: int | None = None):
    g = torch.Generator().manual_seed(3)
    if fill is not None:
        return [torch.full((blocks, row_bytes), fill, dtype=torch.uint8) for _ in range(n)]
    return [
        torch.randint(0, 255, (blocks, row_bytes), generator=g, dtype=torch.uint8) for _ in range(n)
    ]


def until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def all_landed(consumers: list[PdWorker]) -> bool:
    """Poll every consumer until each reported its own request done (none may fail)."""
    finished: set[str] = set()

    def landed() -> bool:
        for w in consumers:
            done, failed = w.poll()
            assert not failed, failed
            finished.update(done)
        return len(finished) == len(consumers)

    return until(landed)


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    prod = PdWorker(layers(), producer=True, pool_blocks=8, same_host=False, timeout_s=120.0)
    cons = PdWorker(layers(fill=0), producer=False, pool_blocks=8, timeout_s=120.0)
    yield prod, cons
    cons.close()
    prod.close()


def test_abandon_drops_loading_receives_and_frees_both_pools(pair):
    """A request finished while loading: its receive is dropped at once (never scattered into
    vLLM's blocks, never reported by poll), the producer is told to drop its copy of the prefill
    (its pool is whole again long before its 120 s deadline) and the staging blocks come back."""
    prod, cons = pair
    prod.publish(11, [1, 2, 3])  # held by the producer until acknowledged or released
    assert prod.pool.num_free == 5
    # A receipt that fails (one block short): the producer keeps its blocks for a retry.
    cons.start("req-a", 11, prod.address, [4, 5])
    # A receive whose prefill was never published: still waiting at the producer.
    cons.start("req-b", 12, prod.address, [6])
    assert cons.pool.num_free == 5 and cons.pending == 2
    time.sleep(0.2)  # req-a's refusal arrived; nothing polled it yet
    gone = cons.abandon({"req-a", "req-b", "req-unknown"}, "aborted by the client")
    assert gone == {"req-a", "req-b"}
    assert cons.pending == 0
    # The staging blocks come back once the background abandons returned; poll reports nothing
    # for the abandoned requests, and vLLM's blocks were never written.
    seen: list[tuple[set[str], dict[str, list[int]]]] = []

    def drained() -> bool:
        seen.append(cons.poll())
        return cons.abandoning == 0

    assert until(drained)
    assert cons.pool.num_free == 8
    assert all(not done and not failed for done, failed in seen)
    assert all(int(t.sum()) == 0 for t in cons.layers)
    # The producer dropped its reference at once (its deadline is 120 s away).
    assert until(lambda: (prod.poll(), prod.pool.num_free)[1] == 8)
    assert prod.producer.pending == 0
    # Abandoning again (or a request that never loaded) is a no-op.
    assert cons.abandon({"req-a"}) == set()


def test_a_receive_that_completed_is_not_abandoned_twice(pair):
    prod, cons = pair
    prod.publish(21, [0, 7])
    cons.start("req-c", 21, prod.address, [2, 3])
    assert until(lambda: "req-c" in cons.poll()[0])
    for j, t in enumerate(cons.layers):  # scattered into vLLM's blocks
        assert torch.equal(t[[2, 3]], prod.layers[j][[0, 7]])
    assert cons.abandon({"req-c"}) == set()
    assert until(lambda: (prod.poll(), prod.pool.num_free)[1] == 8)


def test_a_killed_producers_segment_is_reclaimed_by_the_next_producer(monkeypatch):
    """A vLLM worker killed by SIGKILL (OOM kill, crash) leaves its P/D pool in /dev/shm; the next
    producer on the host removes it (OWNER LOCK CONTRACT) and keeps live producers' pools."""
    import os
    import signal
    import subprocess
    import sys

    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    live = PdWorker(layers(), producer=True, pool_blocks=8, name="live", timeout_s=120.0)
    script = (
        "import os, signal, sys, torch\n"
        "from tpusync.vllm.pd import PdWorker\n"
        "w = PdWorker([torch.zeros(8, 256, dtype=torch.uint8)] * 2, producer=True, pool_blocks=8,\n"
        "             name='killed')\n"
        "print(w.pool.native.shm_name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    killed = proc.stdout.strip()
    assert killed.startswith("tpusync-pd-killed-") and os.path.exists(f"/dev/shm/{killed}")
    try:
        assert live.pool.native.shm_name and os.path.exists(f"/dev/shm/{live.pool.native.shm_name}")
        new = PdWorker(layers(), producer=True, pool_blocks=8, name="next", timeout_s=120.0)
        try:
            assert not os.path.exists(f"/dev/shm/{killed}")
            assert os.path.exists(f"/dev/shm/{live.pool.native.shm_name}")
            assert os.path.exists(f"/dev/shm/{new.pool.native.shm_name}")
        finally:
            new.close()
    finally:
        live.close()
        if os.path.exists(f"/dev/shm/{killed}"):
            os.unlink(f"/dev/shm/{killed}")


# ------------------------------------------------------------------ HEAD RESHARD CONTRACT (pd.py)


def test_head_plan_names_every_producer_rank_holding_a_consumer_ranks_heads():
    # 4 kv heads; producer TP=1 -> consumer TP=2: both consumer ranks read rank 0's blocks.
    assert head_plan(4, [1, 1], [2, 1], 0) == [HeadPart(0, 2, 4, (0, 2), (0, 2))]
    assert head_plan(4, [1, 1], [2, 1], 1) == [HeadPart(0, 2, 4, (2, 4), (0, 2))]
    # TP=2 -> TP=1: one consumer rank gathers both producer ranks, each read once.
    assert head_plan(4, [2, 1], [1, 1], 0) == [
        HeadPart(0, 1, 2, (0, 2), (0, 2)),
        HeadPart(1, 1, 2, (0, 2), (2, 4)),
    ]
    # TP=2 -> TP=4 with two pipeline stages: stage 1's ranks read stage 1's producer ranks.
    assert head_plan(8, [2, 2], [4, 2], 6) == [HeadPart(3, 2, 4, (0, 2), (0, 2))]
    assert head_plan(8, [4, 2], [2, 2], 3) == [
        HeadPart(6, 1, 2, (0, 2), (0, 2)),
        HeadPart(7, 1, 2, (0, 2), (2, 4)),
    ]
    # More consumer ranks than kv heads: vLLM gives tp/H ranks each head; each pulls its holder.
    assert head_plan(2, [1, 1], [4, 1], 0) == [HeadPart(0, 4, 2, (0, 1), (0, 1))]
    assert head_plan(2, [1, 1], [4, 1], 3) == [HeadPart(0, 4, 2, (1, 2), (0, 1))]
    assert head_plan(2, [2, 1], [4, 1], 1) == [HeadPart(0, 2, 1, (0, 1), (0, 1))]
    assert rank_heads(2, 4, 2) == (1, 2) and rank_heads(4, 2, 1) == (2, 4)
    assert rank_heads(4, 3, 0) is None and rank_heads(6, 4, 0) is None
    # REPLICA RULE: more producer ranks than kv heads: each head is pulled from the first rank
    # holding it (ranks 0 and 2 of TP=4 for 2 heads), whatever the consumer's layout, its own
    # included (consumer rank 3 holds head 1, as producer ranks 2 and 3 do: it reads rank 2,
    # as does consumer rank 2).
    assert head_plan(2, [4, 1], [1, 1], 0) == [
        HeadPart(0, 1, 1, (0, 1), (0, 1)),
        HeadPart(2, 1, 1, (0, 1), (1, 2)),
    ]
    assert head_plan(2, [4, 1], [4, 1], 3) == [HeadPart(2, 2, 1, (0, 1), (0, 1))]
    assert head_plan(2, [4, 1], [2, 1], 1) == [HeadPart(2, 1, 1, (0, 1), (0, 1))]
    assert [spare_replica(2, 4, t) for t in range(4)] == [False, True, False, True]
    assert not any(spare_replica(4, tp, t) for tp in (1, 2, 4) for t in range(tp))
    assert not spare_replica(0, 4, 1)  # unknown heads: every rank offers (no head plan either)
    # Every producer rank that offers (no spare replica) is read by exactly the consumer ranks
    # that name it as its readers, and nobody reads a spare replica.
    for tp_p, tp_c in [
        (1, 4), (2, 4), (4, 1), (4, 2), (2, 2), (1, 8), (2, 8), (4, 8),
        (8, 1), (8, 2), (8, 4), (8, 8), (16, 2),
    ]:  # fmt: skip
        reads: dict[int, list[int]] = {}
        for r in range(tp_c):
            for part in head_plan(4, [tp_p, 1], [tp_c, 1], r):
                reads.setdefault(part.producer_rank, []).append(part.readers)
        assert sorted(reads) == [q for q in range(tp_p) if not spare_replica(4, tp_p, q)]
        assert all(len(v) == v[0] and len(set(v)) == 1 for v in reads.values())
    # Not reshardable: another pipeline size, a split vLLM does not make, an unknown head count,
    # a bad rank.
    assert head_plan(4, [2, 2], [2, 1], 0) is None
    assert head_plan(4, [3, 1], [1, 1], 0) is None
    assert head_plan(4, [1, 1], [3, 1], 0) is None
    assert head_plan(0, [1, 1], [2, 1], 0) is None
    assert head_plan(4, [1, 1], [2, 1], 2) is None


HEADS, BLOCK_TOKENS, CHANNELS, NBLOCKS = 4, 32, 16, 8
# Where a block's heads sit: vLLM's CPU layout [blocks, heads, tokens, 2*hd] (axis 1: outer 1) or
# a flash-style K or V part [blocks, tokens, heads, hd] (axis 2: outer = tokens).
AXES = {1: "cpu-layout", 2: "tokens-outer"}


def model_cache(seed: int, axis: int = 1) -> list[torch.Tensor]:
    """Two layers of a whole model's KV cache, every head, float32."""
    g = torch.Generator().manual_seed(seed)
    shape = [NBLOCKS, BLOCK_TOKENS, CHANNELS]
    shape.insert(axis, HEADS)
    return [torch.randn(*shape, generator=g) for _ in range(2)]


def rank_rows(cache: list[torch.Tensor], tp: int, t: int, axis: int = 1) -> list[torch.Tensor]:
    """Tensor rank t of tp's KV cache (its heads) as the connector registers it: byte rows."""
    lo, hi = rank_heads(HEADS, tp, t)
    return [
        c.narrow(axis, lo, hi - lo).contiguous().clone().flatten(1).view(torch.uint8) for c in cache
    ]


def producers_let_go(producers: list[PdWorker]) -> bool:
    """Every producer's pool is whole again: each of its readers acknowledged."""
    return all(
        until(lambda p=p: (p.poll(), p.pool.num_free)[1] == p.pool.num_blocks) for p in producers
    )


def close_all(workers: list[PdWorker]) -> None:
    for w in workers:
        w.close()


def assert_rows_hold(rows, want, src_blocks, dst_blocks) -> None:
    """A consumer's rows hold the model's bytes of src_blocks at dst_blocks, and nothing else."""
    others = [b for b in range(NBLOCKS) if b not in dst_blocks]
    assert len(rows) == len(want)
    for j, (got, full) in enumerate(zip(rows, want, strict=True)):
        assert torch.equal(got[dst_blocks], full[src_blocks]), j
        assert int(got[others].sum()) == 0  # no other block written


def rank_worker(cache, tp, t, *, producer, axis: int = 1):
    lo, hi = rank_heads(HEADS, tp, t)
    rows = rank_rows(cache, tp, t, axis)
    if not producer:
        for r in rows:
            r.zero_()
    outer = 1 if axis == 1 else BLOCK_TOKENS
    inner = (BLOCK_TOKENS * CHANNELS if axis == 1 else CHANNELS) * 4
    return PdWorker(
        rows,
        producer=producer,
        pool_blocks=8,
        same_host=producer,  # producers offer their /dev/shm pool; consumers take either path
        timeout_s=120.0,
        name=f"reshard-{t}",
        heads=(hi - lo, outer, inner),
    ), rows


@pytest.mark.parametrize("axis", list(AXES), ids=list(AXES.values()))
@pytest.mark.parametrize("tp_p,tp_c", [(1, 2), (2, 1), (2, 4), (2, 8), (8, 2), (8, 8)])
def test_a_consumer_of_another_tensor_size_gets_exactly_its_heads(monkeypatch, tp_p, tp_c, axis):
    """Producer ranks of TP=tp_p publish their heads' rows once; each consumer rank of TP=tp_c
    pulls the producer ranks holding its heads (shared sends named with their readers) and ends
    with the bytes vLLM would hold for its heads; every producer pool is whole again only after
    its last reader acknowledged. With more producer ranks than heads only the first holder of
    each head offers it (REPLICA RULE, the connector skips the others' offers)."""
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    cache = model_cache(5, axis)
    prods = [rank_worker(cache, tp_p, q, producer=True, axis=axis)[0] for q in range(tp_p)]
    conss = [rank_worker(cache, tp_c, c, producer=False, axis=axis) for c in range(tp_c)]
    try:
        src_blocks, dst_blocks = [1, 4, 6], [0, 2, 7]
        for q, p in enumerate(prods):
            if not spare_replica(HEADS, tp_p, q):
                p.publish(77, src_blocks)
        for c, (w, _) in enumerate(conss):
            plan = head_plan(HEADS, [tp_p, 1], [tp_c, 1], c)
            peers = [
                prods[part.producer_rank].unix_address or prods[part.producer_rank].address
                for part in plan
            ]
            w.start_parts(f"req-{c}", 77, list(zip(peers, plan, strict=True)), dst_blocks)
        assert all_landed([w for w, _ in conss])
        for c, (_, rows) in enumerate(conss):
            assert_rows_hold(rows, rank_rows(cache, tp_c, c, axis), src_blocks, dst_blocks)
            assert conss[c][0].received == len(dst_blocks)
        assert producers_let_go(prods)  # every reader acknowledged
    finally:
        close_all([w for w, _ in conss] + prods)


def test_a_shared_send_waits_for_its_last_reader(monkeypatch):
    """SHARED-SEND CONTRACT through the worker: with TP=1 -> TP=2, the producer keeps its copy
    after the first consumer rank's receipt and frees it after the second's."""
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    cache = model_cache(9)
    prod, _ = rank_worker(cache, 1, 0, producer=True)
    (c0, rows0), (c1, _) = (rank_worker(cache, 2, c, producer=False) for c in range(2))
    try:
        prod.publish(5, [3, 4])
        plan0, plan1 = (head_plan(HEADS, [1, 1], [2, 1], c) for c in range(2))
        c0.start_parts("r", 5, [(prod.address, plan0[0])], [1, 2])
        assert until(lambda: "r" in c0.poll()[0])
        time.sleep(0.2)
        prod.poll()
        assert prod.pool.num_free == 6 and prod.producer.pending == 1  # one reader to go
        c1.start_parts("r", 5, [(prod.address, plan1[0])], [1, 2])
        assert until(lambda: "r" in c1.poll()[0])
        assert until(lambda: (prod.poll(), prod.pool.num_free)[1] == 8)
        assert torch.equal(rows0[0][[1, 2]], rank_rows(cache, 2, 0)[0][[3, 4]])
    finally:
        c0.close()
        c1.close()
        prod.close()


def test_a_worker_without_a_known_head_axis_refuses_to_reshard(monkeypatch):
    """Heads that do not describe the rows (here 3 x 1 x 100 bytes for 256-byte rows): the worker
    keeps serving same-layout pulls and refuses resharded ones with a clear error (the connector
    reports them as load errors and vLLM recomputes)."""
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    w = PdWorker(layers(fill=0), producer=False, pool_blocks=8, heads=(3, 1, 100))
    try:
        assert w.heads is None
        with pytest.raises(ValueError, match="cannot reshard"):
            w.start_parts("r", 1, [("127.0.0.1:1", HeadPart(0, 2, 4, (0, 2), (0, 2)))], [0])
        assert w.pending == 0 and w.pool.num_free == 8
    finally:
        w.close()


def test_layer_plan_takes_each_stages_rows_from_that_stage():
    """LAYER PLAN CONTRACT: a consumer of one pipeline stage pulls each producer stage's rows
    from that stage's ranks and maps them to its rows of the same layers (K before V)."""
    stage_rows = [[0, 0, 1, 1], [2, 2, 3, 3]]  # K and V apart: two rows per layer
    mine = [0, 0, 1, 1, 2, 2, 3, 3]
    assert head_plan(4, [1, 2], [1, 1], 0, stage_rows, [mine]) == [
        HeadPart(0, 1, 4, (0, 4), (0, 4), (0, 1, 2, 3)),
        HeadPart(1, 1, 4, (0, 4), (0, 4), (4, 5, 6, 7)),
    ]
    # With tensor resharding on top: producer TP=2 x PP=2 (world ranks 0, 1 | 2, 3) -> TP=1.
    per_rank = [stage_rows[0]] * 2 + [stage_rows[1]] * 2
    assert head_plan(4, [2, 2], [1, 1], 0, per_rank, [mine]) == [
        HeadPart(0, 1, 2, (0, 2), (0, 2), (0, 1, 2, 3)),
        HeadPart(1, 1, 2, (0, 2), (2, 4), (0, 1, 2, 3)),
        HeadPart(2, 1, 2, (0, 2), (0, 2), (4, 5, 6, 7)),
        HeadPart(3, 1, 2, (0, 2), (2, 4), (4, 5, 6, 7)),
    ]
    # Layers by name, not position: an uneven split, rows listed in another order here.
    assert head_plan(2, [1, 2], [1, 1], 0, [[5, 3], [9]], [[3, 5, 9]]) == [
        HeadPart(0, 1, 2, (0, 2), (0, 2), (1, 0)),
        HeadPart(1, 1, 2, (0, 2), (0, 2), (2,)),
    ]
    # No plan: layers unknown, a layer no consumer stage holds, a row no producer stage sends,
    # ranks of one producer stage that disagree, a list per rank missing, a layer the producer
    # holds twice and the consumer once.
    assert head_plan(4, [1, 2], [1, 1], 0) is None
    assert head_plan(4, [1, 2], [1, 1], 0, [[0, 0], [7, 7]], [[0, 0, 1, 1]]) is None
    assert head_plan(4, [1, 3], [1, 2], 0, [[0], [1], [2]], [[0], [1]]) is None
    assert head_plan(4, [1, 2], [1, 1], 0, [[0, 0], [1]], [[0, 0, 1, 1]]) is None
    assert head_plan(4, [1, 3], [1, 2], 1, [[0], [1], [2]], [[0], [1, 2, 3]]) is None
    assert head_plan(4, [2, 2], [1, 1], 0, [[0], [1], [2], [2]], [[0, 1, 2]]) is None
    assert head_plan(4, [1, 2], [1, 1], 0, [[0, 0]], [[0, 0, 1, 1]]) is None
    assert head_plan(4, [1, 2], [1, 1], 0, [[0, 1], [1]], [[0, 1]]) is None


def test_layer_plan_for_a_consumer_of_several_stages():
    """LAYER PLAN CONTRACT, any pipeline sizes: a consumer stage pulls only the producer stages
    holding some of its layers and copies only those layers' rows (-1: another stage's row); a
    producer stage split across consumer stages is pulled by both, and every consumer rank names
    the same number of readers for it (SHARED-SEND CONTRACT)."""
    one = [[0, 0, 1, 1, 2, 2]]  # PP=1 producer: every layer, K and V rows
    cons = [[0, 0, 1, 1], [2, 2]]  # PP=2 consumer of an uneven split
    assert head_plan(4, [1, 1], [1, 2], 0, one, cons) == [
        HeadPart(0, 2, 4, (0, 4), (0, 4), (0, 1, 2, 3, -1, -1))
    ]
    assert head_plan(4, [1, 1], [1, 2], 1, one, cons) == [
        HeadPart(0, 2, 4, (0, 4), (0, 4), (-1, -1, -1, -1, 0, 1))
    ]
    # PP=3 -> PP=2 with stage boundaries that do not line up: producer stage 1 (layer 1) feeds
    # consumer stage 0, producer stage 2 (layers 2, 3) feeds both consumer stages.
    prod = [[0], [1], [2, 3]]
    cons = [[0, 1, 2], [3]]
    assert head_plan(2, [1, 3], [1, 2], 0, prod, cons) == [
        HeadPart(0, 1, 2, (0, 2), (0, 2), (0,)),
        HeadPart(1, 1, 2, (0, 2), (0, 2), (1,)),
        HeadPart(2, 2, 2, (0, 2), (0, 2), (2, -1)),
    ]
    assert head_plan(2, [1, 3], [1, 2], 1, prod, cons) == [
        HeadPart(2, 2, 2, (0, 2), (0, 2), (-1, 0)),
    ]
    # With heads resharded too: producer TP=1 x PP=1 -> consumer TP=2 x PP=2: producer rank 0's
    # send has four readers, two tensor ranks in each of the two stages.
    plans = [head_plan(4, [1, 1], [2, 2], r, one, [[0, 0, 1, 1], [2, 2]]) for r in range(4)]
    assert [[(p.producer_rank, p.readers, p.put, p.rows) for p in plan] for plan in plans] == [
        [(0, 4, (0, 2), (0, 1, 2, 3, -1, -1))],
        [(0, 4, (0, 2), (0, 1, 2, 3, -1, -1))],
        [(0, 4, (0, 2), (-1, -1, -1, -1, 0, 1))],
        [(0, 4, (0, 2), (-1, -1, -1, -1, 0, 1))],
    ]
    assert [[p.take for p in plan] for plan in plans] == [[(0, 2)], [(2, 4)], [(0, 2)], [(2, 4)]]


@given(
    layers=st.integers(1, 12),
    pp_p=st.integers(1, 4),
    pp_c=st.integers(1, 4),
    rows_per_layer=st.integers(1, 2),
    data=st.data(),
)
def test_layer_plan_fills_every_row_once_for_any_contiguous_splits(
    layers, pp_p, pp_c, rows_per_layer, data
):
    """Property: for contiguous splits of the same layers (vLLM's pipeline split, uneven
    allowed), every consumer row gets exactly one producer row of its layer, every producer row
    goes to exactly one consumer stage, and a producer stage's readers are the number of consumer
    stages taking rows from it."""

    def split(n_stages: int) -> list[list[int]]:
        cuts = sorted(
            data.draw(
                st.lists(st.integers(0, layers), min_size=n_stages - 1, max_size=n_stages - 1)
            )
        )
        bounds = [0, *cuts, layers]
        return [
            [x for x in range(a, b) for _ in range(rows_per_layer)]
            for a, b in itertools.pairwise(bounds)
        ]

    prod, cons = split(pp_p), split(pp_c)
    if pp_p == pp_c:
        return  # the equal-pipeline path does not use the layer plan
    filled = {(s, j): 0 for s, rows in enumerate(cons) for j in range(len(rows))}
    taken = {(s, j): 0 for s, rows in enumerate(prod) for j in range(len(rows))}
    readers = {}
    for c in range(pp_c):
        plan = head_plan(2, [1, pp_p], [1, pp_c], c, prod, cons)
        assert plan is not None
        for part in plan:
            readers.setdefault(part.producer_rank, set()).add(part.readers)
            for j, row in enumerate(part.rows):
                if row >= 0:
                    assert cons[c][row] == prod[part.producer_rank][j]
                    filled[(c, row)] += 1
                    taken[(part.producer_rank, j)] += 1
    assert all(v == 1 for v in filled.values()) and all(v == 1 for v in taken.values())
    for s, seen in readers.items():
        pulling = sum(bool(set(prod[s]) & set(rows)) for rows in cons)
        assert seen == {pulling}


def stage_worker(cache, tp, t, layers, *, producer, timeout_s=120.0):
    """Tensor rank t of tp of the pipeline stage holding ``layers`` (indices into cache)."""
    lo, hi = rank_heads(HEADS, tp, t)
    rows = [rank_rows(cache, tp, t)[i] for i in layers]
    if not producer:
        for r in rows:
            r.zero_()
    w = PdWorker(
        rows,
        producer=producer,
        pool_blocks=8,
        same_host=producer,
        timeout_s=timeout_s,
        name=f"stage-{layers[0]}-{t}",
        heads=(hi - lo, 1, BLOCK_TOKENS * CHANNELS * 4),
    )
    return w, rows


def model_layers(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NBLOCKS, HEADS, BLOCK_TOKENS, CHANNELS, generator=g) for _ in range(n)]


@pytest.mark.parametrize("tp_p,tp_c", [(1, 1), (2, 1), (1, 2)])
def test_a_consumer_of_one_stage_gets_every_stages_layers(monkeypatch, tp_p, tp_c):
    """Producer of two pipeline stages of unequal size (layers 0-1 and 2: blocks of two sizes,
    pulled into two pools) -> consumer of one stage: every consumer row holds the model's bytes
    of its layer and heads, and every producer pool is whole again."""
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    cache = model_layers(11, 3)
    stages = [[0, 1], [2]]
    prods = [
        stage_worker(cache, tp_p, t, ls, producer=True)[0] for ls in stages for t in range(tp_p)
    ]
    conss = [stage_worker(cache, tp_c, c, [0, 1, 2], producer=False) for c in range(tp_c)]
    per_rank = [ls for ls in stages for _ in range(tp_p)]
    try:
        src_blocks, dst_blocks = [2, 5], [6, 1]
        for p in prods:
            p.publish(91, src_blocks)
        for c, (w, _) in enumerate(conss):
            plan = head_plan(HEADS, [tp_p, 2], [tp_c, 1], c, per_rank, [[0, 1, 2]])
            assert plan is not None and {p.rows for p in plan} == {(0, 1), (2,)}
            peers = [prods[part.producer_rank].unix_address for part in plan]
            w.start_parts(f"req-{c}", 91, list(zip(peers, plan, strict=True)), dst_blocks)
            assert w.pending == 1
        assert all_landed([w for w, _ in conss])
        for c, (w, rows) in enumerate(conss):
            assert_rows_hold(rows, rank_rows(cache, tp_c, c), src_blocks, dst_blocks)
            assert w.received == 2 and w.received_shm == 2 and w.pending == 0
        assert producers_let_go(prods)  # every reader acknowledged
    finally:
        close_all([w for w, _ in conss] + prods)


@pytest.mark.parametrize(
    "prod_stages,cons_stages,tp_p,tp_c",
    [
        ([[0, 1, 2]], [[0, 1], [2]], 1, 1),
        ([[0, 1, 2]], [[0], [1, 2]], 1, 2),
        ([[0], [1, 2]], [[0], [1], [2]], 2, 1),
    ],
    ids=["pp1-to-pp2", "pp1-to-pp2xtp2", "pp2xtp2-to-pp3"],
)
def test_consumer_stages_take_their_layers_from_any_producer_split(
    monkeypatch, prod_stages, cons_stages, tp_p, tp_c
):
    """LAYER PLAN CONTRACT with a consumer of several stages: each consumer rank pulls the
    producer stages holding some of its layers and copies only those rows; a producer send that
    several consumer stages read is freed after the last of them (every producer pool whole)."""
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    cache = model_layers(13, 3)
    prods = [
        stage_worker(cache, tp_p, t, ls, producer=True)[0]
        for ls in prod_stages
        for t in range(tp_p)
    ]
    conss = [
        (stage_worker(cache, tp_c, t, ls, producer=False), ls)
        for ls in cons_stages
        for t in range(tp_c)
    ]
    per_rank = [ls for ls in prod_stages for _ in range(tp_p)]
    layout_p, layout_c = [tp_p, len(prod_stages)], [tp_c, len(cons_stages)]
    try:
        src_blocks, dst_blocks = [3, 0], [4, 7]
        for p in prods:
            p.publish(92, src_blocks)
        for r, ((w, _), _) in enumerate(conss):
            plan = head_plan(HEADS, layout_p, layout_c, r, per_rank, cons_stages)
            assert plan is not None
            peers = [prods[part.producer_rank].unix_address for part in plan]
            w.start_parts(f"req-{r}", 92, list(zip(peers, plan, strict=True)), dst_blocks)
        assert all_landed([w for (w, _), _ in conss])
        for r, ((w, rows), ls) in enumerate(conss):
            want = rank_rows(cache, tp_c, r % tp_c)
            assert_rows_hold(rows, [want[i] for i in ls], src_blocks, dst_blocks)
            assert w.received == 2 and w.pending == 0
        assert producers_let_go(prods)  # every reader of every send acknowledged
    finally:
        close_all([w for (w, _), _ in conss] + prods)


def test_a_stage_that_never_offers_fails_the_request_once(monkeypatch):
    """One stage publishes, the other never does: the request is reported failed once, with its
    blocks, when the missing stage answers that it holds no such request (at the latest at the
    deadline); the landed stage's part is not reported as a success, and every staging pool is
    whole again."""
    monkeypatch.setenv("TPUSYNC_AUTH_SECRET", SECRET)
    cache = model_layers(12, 3)
    p0, _ = stage_worker(cache, 1, 0, [0, 1], producer=True)
    p1, _ = stage_worker(cache, 1, 0, [2], producer=True)
    cons, _ = stage_worker(cache, 1, 0, [0, 1, 2], producer=False, timeout_s=2.0)
    try:
        p0.publish(93, [1, 2])  # stage 1 never offers request 93
        plan = head_plan(HEADS, [1, 2], [1, 1], 0, [[0, 1], [2]], [[0, 1, 2]])
        cons.start_parts("req", 93, [(p0.address, plan[0]), (p1.address, plan[1])], [3, 4])
        reports: list[tuple[set[str], dict[str, list[int]]]] = []

        def ended() -> bool:
            reports.append(cons.poll())
            return cons.pending == 0

        assert until(ended, timeout=30.0)
        assert [f for _, f in reports if f] == [{"req": [3, 4]}]
        assert all(not d for d, _ in reports)
        assert all(ways.pool.num_free == 8 for ways in cons._ways.values())
        assert sorted(cons._ways) == [8192, 16384, 24576]  # its own size, one per stage's
    finally:
        cons.close()
        p0.close()
        p1.close()
