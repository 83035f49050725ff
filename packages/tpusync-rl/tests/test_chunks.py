import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from tpusync.rl.chunks import (
    UpdateRejectedError,
    VersionSkewError,
    WeightPublisher,
    WeightSubscriber,
)
from tpusync.rl.layout import ShardLayout

SHAPES = {"layers.0.w": (8, 6), "layers.0.b": (8,), "embed": (12, 4)}


def full_weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def trainer_shards(full, world=2, dims=None):
    """TP=world trainer: every tensor split on dim 0 (or ``dims[name]``); returns per-rank
    {name: (local, layout)}."""
    out = {r: {} for r in range(world)}
    for name, t in full.items():
        layout = ShardLayout.split(t.shape, (dims or {}).get(name, 0), world)
        for r in range(world):
            box = layout.box_of(r)
            index = tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=True))
            out[r][name] = (t[index].clone(), layout)
    return out


def engine_name(trainer_name):
    return "model." + trainer_name


def make_samplers(world=4, dtype=torch.bfloat16, mode="shadow", column_major=()):
    """TP=world sampler group with engine names; the bias is replicated on every rank. Tensors
    named in ``column_major`` (2-D) are stored transposed in memory (innermost dim strided)."""
    layouts = {}
    for name, shape in SHAPES.items():
        layouts[engine_name(name)] = (
            ShardLayout.replicated(shape, range(world))
            if name.endswith(".b")
            else ShardLayout.split(shape, 0 if name != "embed" else 1, world)
        )
    subs = []
    for r in range(world):
        weights = {n: torch.zeros(lay.box_of(r).shape, dtype=dtype) for n, lay in layouts.items()}
        for n in column_major:
            weights[n] = torch.zeros(weights[n].shape[::-1], dtype=dtype).t()
        subs.append(WeightSubscriber(r, weights, layouts, name_map=engine_name, mode=mode))
    return subs


def push(version, full, subs, delta=False, publishers=None, tamper=None, drop=None):
    shards = trainer_shards(full)
    publishers = publishers or [WeightPublisher(r) for r in shards]
    manifests = [p.prepare(version, shards[p.rank], delta=delta) for p in publishers]
    assert len({m.to_bytes() for m in manifests}) == 1, "all trainer ranks agree on the manifest"
    manifest = manifests[0]
    for s in subs:
        s.begin(manifest)
    dst = subs[0].layouts_by_trainer_name(manifest)
    for p in publishers:
        for chunk in p.chunks(manifest, shards[p.rank], dst):
            if tamper:
                chunk = tamper(chunk)
            if drop and drop(chunk):
                continue
            subs[chunk.dst_rank].receive(chunk)
    return manifest, publishers, shards


def expect_equal(subs, full, dtype=torch.bfloat16):
    for s in subs:
        for name, t in full.items():
            box = s._layouts[engine_name(name)].box_of(s.rank)
            want = t[tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=False))].to(dtype)
            assert torch.equal(s.weights[engine_name(name)], want), (s.rank, name)


def test_tp2_fp32_to_tp4_bf16_with_name_mapping():
    subs = make_samplers()
    full = full_weights(1)
    push(1, full, subs)
    for s in subs:
        assert s.commit() == 1
    expect_equal(subs, full)


def test_group_whose_ranks_each_hold_only_some_tensors_stages_only_its_own():
    """A pipeline-parallel-like group: ranks 0-1 hold layer 0 (the weight split, the bias on
    both), ranks 2-3 hold the embedding (split); a rank keeps no tensor of the other stage, is
    planned nothing of it and commits with its own tensors only."""
    stage0, stage1 = (0, 1), (2, 3)
    layouts = {
        engine_name("layers.0.w"): ShardLayout.split(SHAPES["layers.0.w"], 0, 2, stage0),
        engine_name("layers.0.b"): ShardLayout.replicated(SHAPES["layers.0.b"], stage0),
        engine_name("embed"): ShardLayout.split(SHAPES["embed"], 1, 2, stage1),
    }
    subs = []
    for r in range(4):
        mine = {n: lay for n, lay in layouts.items() if r in lay.ranks}
        weights = {n: torch.zeros(lay.box_of(r).shape) for n, lay in mine.items()}
        subs.append(WeightSubscriber(r, weights, layouts, name_map=engine_name))
    full = full_weights(5)
    push(1, full, subs)
    for s in subs:
        assert s.commit() == 1
        held = {engine_name(n) for n in SHAPES if s.rank in layouts[engine_name(n)].ranks}
        assert set(s.weights) == held, s.rank
        for name in held:
            box = layouts[name].box_of(s.rank)
            index = tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=True))
            assert torch.equal(s.weights[name], full[name[len("model.") :]][index]), (s.rank, name)
    with pytest.raises(ValueError, match="no local tensor for rank 2"):
        WeightSubscriber(2, {}, layouts, name_map=engine_name)


def test_digest_mismatch_rejects_and_keeps_old_version():
    subs = make_samplers()
    push(1, full_weights(1), subs)
    for s in subs:
        s.commit()
    before = {n: t.clone() for n, t in subs[2].weights.items()}

    def corrupt(chunk):
        if chunk.dst_rank == 2 and chunk.name == "embed":
            data = chunk.data.copy()
            data[0] ^= 1
            return dataclasses.replace(chunk, data=data)
        return chunk

    push(2, full_weights(2), subs, tamper=corrupt)
    with pytest.raises(UpdateRejectedError, match="digest mismatch in embed"):
        subs[2].commit()
    assert subs[2].version == 1
    for n, t in before.items():
        assert torch.equal(subs[2].weights[n], t)
    assert subs[0].commit() == 2  # the others commit


def test_missing_chunk_rejects():
    subs = make_samplers()

    def drop(chunk):
        return chunk if not (chunk.dst_rank == 1 and chunk.name == "layers.0.w") else None

    manifest, _, _ = push(1, full_weights(1), subs, tamper=lambda c: c)
    subs2 = make_samplers()
    for s in subs2:
        s.begin(manifest)
    shards = trainer_shards(full_weights(1))
    dst = subs2[0].layouts_by_trainer_name(manifest)
    for r in shards:
        for chunk in WeightPublisher(r).chunks(manifest, shards[r], dst):
            if drop(chunk) is not None:
                subs2[chunk.dst_rank].receive(chunk)
    assert subs2[1].missing()
    with pytest.raises(UpdateRejectedError, match="chunks missing"):
        subs2[1].commit()
    assert subs2[1].version == 0


def test_version_skew_refused():
    subs = make_samplers()
    m, pubs, shards = push(3, full_weights(1), subs)
    for s in subs:
        s.commit()
    with pytest.raises(VersionSkewError, match="already has version 3"):
        subs[0].begin(m)
    with pytest.raises(VersionSkewError, match="does not follow"):
        pubs[0].prepare(3, shards[0])


def push_committed(version, full, subs):
    """A full update pushed, recorded as published by every trainer rank (the base of the next
    delta) and committed by every sampler; returns the publishers and the trainer shards."""
    m, pubs, shards = push(version, full, subs)
    for p in pubs:
        p.published(m, shards[p.rank])
    for s in subs:
        s.commit()
    return pubs, shards


def test_delta_update_sends_only_changed_tensors():
    subs = make_samplers(dtype=torch.float32)
    full = full_weights(1)
    pubs, _ = push_committed(1, full, subs)
    full2 = dict(full)
    full2["embed"] = full["embed"] + 1
    m2, _, _ = push(2, full2, subs, delta=True, publishers=pubs)
    assert [t.name for t in m2.tensors] == ["embed"] and m2.base_version == 1
    for s in subs:
        s.commit()
    expect_equal(subs, full2, torch.float32)
    # A delta against a base the subscriber does not have is refused.
    lagging = make_samplers(dtype=torch.float32)
    with pytest.raises(VersionSkewError, match="delta update 1->2 refused"):
        lagging[0].begin(m2)


def test_multi_rank_delta_sends_the_union_of_the_changed_sets():
    """DELTA CONTRACT with two trainer ranks: only rank 1's shard of embed changed. Rank 0's own
    set is empty, the union is {embed}; with it both ranks build the same manifest and the
    samplers end bit-equal. A process holding several ranks digests every one of its shards."""
    subs = make_samplers(dtype=torch.float32)
    full = full_weights(1)
    pubs, shards = push_committed(1, full, subs)
    full2 = dict(full)
    full2["embed"] = full["embed"].clone()
    full2["embed"][10, 2] += 1  # rows 6..11: rank 1's shard
    shards2 = trainer_shards(full2)
    own = [p.changed(shards2[p.rank]) for p in pubs]
    assert own == [set(), {"embed"}]
    union = set().union(*own)
    manifests = [p.prepare(2, shards2[p.rank], delta=True, changed=union) for p in pubs]
    assert manifests[0].to_bytes() == manifests[1].to_bytes()
    assert [t.name for t in manifests[0].tensors] == ["embed"] and manifests[0].base_version == 1
    for s in subs:
        s.begin(manifests[0])
    dst = subs[0].layouts_by_trainer_name(manifests[0])
    for p in pubs:
        for chunk in p.chunks(manifests[0], shards2[p.rank], dst):
            subs[chunk.dst_rank].receive(chunk)
    for s in subs:
        assert s.commit() == 2
    expect_equal(subs, full2, torch.float32)
    with pytest.raises(ValueError, match=r"does not publish: \['nope'\]"):
        pubs[0].prepare(3, shards2[0], delta=True, changed={"nope"})
    # One process, both ranks: {rank: shard} per tensor; a change in the second shard counts.
    both = WeightPublisher(0)
    held = {n: ({r: shards[r][n][0] for r in (0, 1)}, shards[0][n][1]) for n in SHAPES}
    both.published(both.prepare(1, held), held)
    assert both.changed(held) == set()
    moved = {n: ({r: shards2[r][n][0] for r in (0, 1)}, shards2[0][n][1]) for n in SHAPES}
    assert both.changed(moved) == {"embed"}


def test_inplace_requires_pause_and_writes_live_tensors():
    subs = make_samplers(mode="inplace")
    live = subs[0].weights["model.embed"]
    with pytest.raises(RuntimeError, match="paused"):
        push(1, full_weights(1), subs)
    subs = make_samplers(mode="inplace")
    live = subs[0].weights["model.embed"]
    with subs[0].paused(), subs[1].paused(), subs[2].paused(), subs[3].paused():
        push(1, full_weights(1), subs)
        for s in subs:
            s.commit()
    assert subs[0].weights["model.embed"] is live  # same storage, updated in place
    expect_equal(subs, full_weights(1))


def test_shape_mismatch_is_refused_naming_tensors():
    subs = make_samplers()
    bad = {n: (torch.zeros(9, 6), ShardLayout.split((9, 6), 0, 2)) for n in ["layers.0.w"]}
    manifest = WeightPublisher(0).prepare(1, bad)
    with pytest.raises(ValueError, match=r"layers.0.w -> model.layers.0.w: trainer shape \(9, 6\)"):
        subs[0].begin(manifest)


def test_manifest_round_trip_and_malformed():
    from tpusync.rl.manifest import Manifest

    shards = trainer_shards(full_weights(0))
    m = WeightPublisher(0).prepare(5, shards[0])
    assert Manifest.from_bytes(m.to_bytes()) == m
    with pytest.raises(ValueError, match="malformed"):
        Manifest.from_bytes(b"\xc1\xc1")
    assert np.dtype("float32")  # keep numpy import meaningful for type checkers


def test_recycle_reuses_the_replaced_tensors_as_shadow_buffers():
    layouts = {"w": ShardLayout.replicated((4, 3), [0])}
    sub = WeightSubscriber(0, {"w": torch.zeros(4, 3)}, layouts, recycle=True)
    pub = WeightPublisher(0)
    served = [sub.weights["w"]]
    for v in (1, 2, 3):
        t = {"w": (torch.full((4, 3), float(v)), layouts["w"])}
        m = pub.prepare(v, t)
        sub.begin(m)
        for c in pub.chunks(m, t, layouts):
            sub.receive(c)
        sub.commit()
        assert torch.equal(sub.weights["w"], torch.full((4, 3), float(v)))
        served.append(sub.weights["w"])
    # Version 2 staged into the tensor version 0 served; version 3 into version 1's.
    assert served[2] is served[0] and served[3] is served[1] and served[1] is not served[0]
    m = pub.prepare(4, {"w": (torch.ones(4, 3), layouts["w"])})
    sub.begin(m)
    sub.abort("test")
    assert sub.version == 3 and torch.equal(sub.weights["w"], torch.full((4, 3), 3.0))


def test_staged_shows_the_verified_version_before_commit_and_abort_keeps_the_committed():
    """A vLLM engine loads a version before committing it (LOAD FAILURE RULE): staged() is what
    commit would make current, the committed weights stay untouched until then, and a version
    aborted after staged() leaves the committed one served."""
    subs = make_samplers(dtype=torch.float32)
    full1, full2 = full_weights(1), full_weights(2)
    full2["layers.0.b"] = full1["layers.0.b"]
    pubs, _ = push_committed(1, full1, subs)
    m2, _, _ = push(2, full2, subs, delta=True, publishers=pubs)
    assert {t.name for t in m2.tensors} == {"layers.0.w", "embed"}
    served = [s.weights for s in subs]
    for s, old in zip(subs, served, strict=True):
        assert s.verify() == 2
        staged = s.staged()
        assert staged.keys() == old.keys() and s.weights is old and s.version == 1
        # The unchanged bias is the committed tensor itself; the rest are staged copies.
        assert staged["model.layers.0.b"] is old["model.layers.0.b"]
        assert staged["model.embed"] is not old["model.embed"]
    expect_equal(subs, full1, torch.float32)  # nothing committed yet
    subs[0].abort("its engine failed to load it")
    assert subs[0].version == 1 and subs[0].weights is served[0]
    expect_equal(subs[:1], full1, torch.float32)
    for s in subs[1:]:
        assert s.commit() == 2
    expect_equal(subs[1:], full2, torch.float32)
    with pytest.raises(UpdateRejectedError, match="nothing staged"):
        subs[1].staged()
    inplace = make_samplers(dtype=torch.float32, mode="inplace")[0]
    with pytest.raises(RuntimeError, match="staged\\(\\) needs shadow mode"):
        inplace.staged()


def _fused_push(version, full, subs):
    """Push like the shared-segment reader does: digest-free chunks, each fed through a fresh
    Checksum64Stream that must end up equal to the chunk's own XXH3 (FUSED STAGING CONTRACT)."""
    from tpusync.core import Checksum64Stream, checksum64

    # layers.0.w split on dim 1 by the trainer, dim 0 by the samplers: strided targets.
    shards = trainer_shards(full, dims={"layers.0.w": 1})
    pubs = [WeightPublisher(r) for r in shards]
    manifest = [p.prepare(version, shards[p.rank]) for p in pubs][0]
    for s in subs:
        s.begin(manifest)
    dst = subs[0].layouts_by_trainer_name(manifest)
    for p in pubs:
        for chunk in p.chunks(manifest, shards[p.rank], dst):
            h = Checksum64Stream()
            subs[chunk.dst_rank].receive(dataclasses.replace(chunk, digest=None), hasher=h)
            assert h.digest() == checksum64(chunk.data), (chunk.name, chunk.box)
    return manifest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_receive_stages_and_hashes_every_byte_once(dtype):
    """fp32 -> fp32 pieces go through the fused copy + hash and fp32 -> bf16 pieces through the
    fused hash + cast, also into the column blocks of layers.0.w (a scatter into rows at a
    stride); a target whose innermost dim is strided (embed stored column-major) takes the
    fallback (hash, then copy): the same weights either way (torch's own cast for bf16), and the
    hash covers each chunk exactly once."""
    subs = make_samplers(world=2, dtype=dtype, column_major=("model.embed",))
    full = full_weights(5)
    _fused_push(1, full, subs)
    for s in subs:
        assert s.commit() == 1
    expect_equal(subs, full, dtype)
    fused = sum(s.metrics["bytes_fused"] for s in subs)
    received = sum(s.metrics["bytes_received"] for s in subs)
    assert fused == received - 12 * 4 * 4  # all but embed's 192 bytes (fp32 on the wire)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_fused_cast_rounds_like_torch_at_ties_overflow_and_subnormals(low):
    """The fused fp32 -> bf16 / fp16 staging cast gives torch's bits for the values where
    rounding is decided: exact ties (both ways), just past a tie, the largest floats (overflow to
    inf), subnormals, signed zeros and infinities; a NaN stays a NaN."""
    from tpusync.core import Checksum64Stream, checksum64

    bits = [
        0x3F808000,
        0x3F818000,
        0x3F808001,
        0x3F807FFF,
        0x7F7FFFFF,
        0x7F7F7FFF,
        0xFF7FFFFF,
        0x00000001,
        0x00008000,
        0x00018000,
        0x807FFFFF,
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFA00001,
        # float16's deciding points: ties at 1 + 2^-11 (both ways), 65504 / 65520 (overflow),
        # the smallest subnormal's half (2^-25, a tie to zero), just above it, the largest
        # subnormal and its tie into the smallest normal
        0x3F801000,
        0x3F803000,
        0x477FE000,
        0x477FEFFF,
        0x477FF000,
        0x33000000,
        0x33000001,
        0x387FC000,
        0x387FE000,
    ]
    rng = np.random.default_rng(3)
    raw = np.concatenate([np.array(bits, np.uint32), rng.integers(0, 2**32, 4096, np.uint32)])
    values = raw.view(np.float32).reshape(-1, 1)
    layouts = {"w": ShardLayout.replicated((len(raw), 1), [0])}
    sub = WeightSubscriber(0, {"w": torch.zeros(len(raw), 1, dtype=low)}, layouts)
    pub = WeightPublisher(0)
    t = {"w": (torch.from_numpy(values.copy()), layouts["w"])}
    m = pub.prepare(1, t)
    sub.begin(m)
    for c in pub.chunks(m, t, layouts):
        h = Checksum64Stream()
        sub.receive(dataclasses.replace(c, digest=None), hasher=h)
        assert h.digest() == checksum64(c.data)
    sub.commit()
    assert sub.metrics["bytes_fused"] == raw.nbytes
    got = sub.weights["w"].view(torch.int16).numpy().ravel()
    want_t = torch.from_numpy(values.copy()).to(low)
    want = want_t.view(torch.int16).numpy().ravel()
    nan = np.isnan(values.ravel())
    assert (got[~nan] == want[~nan]).all()
    assert torch.isnan(sub.weights["w"].ravel()[torch.from_numpy(nan)]).all()


def test_fused_receive_feeds_a_refused_chunk_to_the_hasher_too():
    """A duplicate chunk is refused (the update fails) but its bytes still reach the block hash,
    so the caller's digest names the real bytes of the block rather than a partial one."""
    from tpusync.core import Checksum64Stream, checksum64

    subs = make_samplers(dtype=torch.float32)
    full = full_weights(6)
    shards = trainer_shards(full)
    pub = WeightPublisher(0)
    manifest = pub.prepare(1, shards[0])
    subs[0].begin(manifest)
    dst = subs[0].layouts_by_trainer_name(manifest)
    chunk = next(c for c in pub.chunks(manifest, shards[0], dst) if c.dst_rank == 0)
    chunk = dataclasses.replace(chunk, digest=None)
    subs[0].receive(chunk, hasher=Checksum64Stream())
    h = Checksum64Stream()
    subs[0].receive(chunk, hasher=h)  # duplicate
    assert h.digest() == checksum64(chunk.data)
    with pytest.raises(UpdateRejectedError, match="duplicate"):
        subs[0].commit()


def test_inplace_refuses_unverified_chunks():
    """In-place mode writes live weights: a chunk whose block is not verified yet (a hasher) is
    refused before a byte is written."""
    from tpusync.core import Checksum64Stream

    subs = make_samplers(dtype=torch.float32, mode="inplace")
    full = full_weights(7)
    shards = trainer_shards(full)
    pub = WeightPublisher(0)
    manifest = pub.prepare(1, shards[0])
    before = {n: t.clone() for n, t in subs[0].weights.items()}
    with subs[0].paused():
        subs[0].begin(manifest)
        dst = subs[0].layouts_by_trainer_name(manifest)
        chunk = next(c for c in pub.chunks(manifest, shards[0], dst) if c.dst_rank == 0)
        with pytest.raises(UpdateRejectedError, match="verified blocks only"):
            subs[0].receive(dataclasses.replace(chunk, digest=None), hasher=Checksum64Stream())
    for n, t in before.items():
        assert torch.equal(subs[0].weights[n], t)


@pytest.mark.parametrize("mode", ["shadow", "inplace"])
def test_chunk_delta_sends_only_the_changed_rows_resharded_and_commits_bit_equal(mode):
    """CHUNK DELTA CONTRACT: TP=2 trainer (embed split by columns, layers.0.w by rows) -> TP=4
    samplers (embed by columns, layers.0.w by rows), chunks of 32 bytes (embed: 2 rows, layers.0.w:
    1 row, the 8-element bias: one chunk). Rank 0 changes one element of embed row 9, rank 1 one
    row of layers.0.w: the union is embed rows 8..9 (sent by BOTH ranks, each its columns) and
    layers.0.w row 5; only those bytes move, and every sampler ends bit-equal to the new model
    (shadow: built from its committed version, which readers keep seeing until the commit;
    in place: only the changed rows written). A changed one-chunk tensor is sent whole."""
    subs = make_samplers(dtype=torch.float32, mode=mode)
    full = full_weights(1)
    dims = {"embed": 1}
    shards = trainer_shards(full, dims=dims)
    pubs = [WeightPublisher(r, chunk_bytes=32) for r in shards]
    m1 = [p.prepare(1, shards[p.rank]) for p in pubs][0]

    def deliver(manifest, shards):
        ctx = [s.paused() for s in subs] if mode == "inplace" else []
        for c in ctx:
            c.__enter__()
        try:
            for s in subs:
                s.begin(manifest)
            dst = subs[0].layouts_by_trainer_name(manifest)
            for p in pubs:
                for chunk in p.chunks(manifest, shards[p.rank], dst):
                    subs[chunk.dst_rank].receive(chunk)
            return [s.commit() for s in subs]
        finally:
            for c in ctx:
                c.__exit__(None, None, None)

    deliver(m1, shards)
    for p in pubs:
        p.published(m1, shards[p.rank])
    full2 = {n: t.clone() for n, t in full.items()}
    full2["embed"][9, 0] += 1.0  # trainer rank 0's columns
    full2["layers.0.w"][5, 2] -= 3.0  # trainer rank 1's rows
    shards2 = trainer_shards(full2, dims=dims)
    own = [p.changed_rows(shards2[p.rank]) for p in pubs]
    assert own == [{"embed": ((8, 10),)}, {"layers.0.w": ((5, 6),)}]
    union = {"embed": ((8, 10),), "layers.0.w": ((5, 6),)}
    manifests = [
        p.prepare(2, shards2[p.rank], delta=True, changed=set(union), rows=union) for p in pubs
    ]
    assert manifests[0].to_bytes() == manifests[1].to_bytes()
    m2 = manifests[0]
    assert m2.rows == union and m2.base_version == 1
    assert type(m2).from_bytes(m2.to_bytes()) == m2
    before = [dict(s.weights) for s in subs]
    old = [{n: t.clone() for n, t in b.items()} for b in before]
    bytes_before = [s.metrics["bytes_received"] for s in subs]
    senders = {}
    dst = subs[0].layouts_by_trainer_name(m2)
    for p in pubs:
        for chunk in p.chunks(m2, shards2[p.rank], dst):
            senders.setdefault(chunk.name, set()).add(p.rank)
    assert senders == {"embed": {0, 1}, "layers.0.w": {1}}  # rank 1 sends embed: the union
    assert deliver(m2, shards2) == [2] * 4
    expect_equal(subs, full2, torch.float32)
    got = sum(s.metrics["bytes_received"] - b for s, b in zip(subs, bytes_before, strict=True))
    assert got == (2 * 4 + 1 * 6) * 4  # embed rows 8..9 (4 columns) + one row of layers.0.w
    if mode == "shadow":  # the committed dicts readers held were never written
        for b, o in zip(before, old, strict=True):
            assert all(torch.equal(b[n], o[n]) for n in o)
    # Changed rows whose union covers the whole tensor (the bias: one 8-row chunk, each trainer
    # rank holds half of it) send it whole, without rows.
    for p in pubs:
        p.published(m2, shards2[p.rank])
    full3 = {n: t.clone() for n, t in full2.items()}
    full3["layers.0.b"] += 1.0
    shards3 = trainer_shards(full3, dims=dims)
    own = [p.changed_rows(shards3[p.rank]) for p in pubs]
    assert own == [{"layers.0.b": ((0, 4),)}, {"layers.0.b": ((4, 8),)}]
    union = {"layers.0.b": ((0, 4), (4, 8))}
    m3 = pubs[0].prepare(3, shards3[0], delta=True, changed=set(union), rows=union)
    pubs[1].prepare(3, shards3[1], delta=True, changed=set(union), rows=union)
    assert [t.name for t in m3.tensors] == ["layers.0.b"] and not m3.rows
    deliver(m3, shards3)
    expect_equal(subs, full3, torch.float32)


def test_chunk_delta_manifest_refuses_bad_rows():
    lay = ShardLayout.replicated((6, 2), [0])
    pub = WeightPublisher(0, chunk_bytes=8)
    t = {"w": (torch.zeros(6, 2), lay)}
    pub.published(pub.prepare(1, t), t)
    with pytest.raises(ValueError, match="does not send"):
        pub.prepare(2, t, delta=True, changed=set(), rows={"w": ((0, 1),)})
    m = pub.prepare(3, t, delta=True, changed={"w"}, rows={"w": ((4, 6), (0, 2), (1, 3))})
    assert m.rows == {"w": ((0, 3), (4, 6))}  # merged, sorted
    with pytest.raises(ValueError, match="sorted, disjoint runs"):
        dataclasses.replace(m, rows={"w": ((0, 7),)})
    with pytest.raises(ValueError, match="only a delta manifest"):
        dataclasses.replace(m, base_version=None)


def test_a_tensor_changed_during_the_send_goes_out_again_in_the_next_delta():
    """SNAPSHOT RULE: version 1's bytes were read as A, then an optimizer step changed row 4 to B
    before ``published``. The base is A's digests (taken before the send), so a delta against B
    resends row 4's chunk; digests taken after the send (B's) called B unchanged, and a sampler
    that got A (or a torn A/B) kept it through every later delta."""
    lay = ShardLayout.replicated((6, 2), [0])
    pub = WeightPublisher(0, chunk_bytes=8)  # one row per chunk
    w = torch.zeros(6, 2)
    t = {"w": (w, lay)}
    taken = pub.digests(t)
    m1 = pub.prepare(1, t)
    sent = b"".join(bytes(c.data) for c in pub.chunks(m1, t, {"w": lay}))  # the send reads A
    w[4, 1] = 3.0  # the step lands before publish returned
    pub.published(m1, t, taken=taken)
    assert pub.changed_rows(t) == {"w": ((4, 5),)}
    assert sent == bytes(48)
    with pytest.raises(ValueError, match=r"no digests taken for \['w'\]"):
        pub.published(m1, t, taken={})


def test_a_dirty_inplace_subscriber_refuses_a_delta_until_a_full_update_lands():
    """DIRTY RULE: a version that failed half way left some live tensors at it; a delta on the old
    base then committed a mix of two versions, reported ok."""
    subs = make_samplers(dtype=torch.float32, mode="inplace")
    full = full_weights(1)
    with contextlib.ExitStack() as paused:
        for s in subs:
            paused.enter_context(s.paused())
        pubs, _ = push_committed(1, full, subs)
        full2 = {n: t + 1 for n, t in full.items()}
        push(2, full2, subs, publishers=pubs, drop=lambda c: c.name == "embed")  # v2 fails
        for s in subs:
            with pytest.raises(UpdateRejectedError, match="dirty until a full update"):
                s.commit()
            assert s.dirty and s.version == 1
        full3 = dict(full)
        full3["embed"] = full["embed"] + 3
        shards3 = trainer_shards(full3)
        m3 = pubs[0].prepare(3, shards3[0], delta=True)
        assert m3.base_version == 1 and [t.name for t in m3.tensors] == ["embed"]
        with pytest.raises(VersionSkewError, match="dirty since a failed update"):
            subs[0].begin(m3)
        push(4, full3, subs, publishers=[WeightPublisher(r) for r in range(2)])
        for s in subs:
            assert s.commit() == 4 and not s.dirty
    expect_equal(subs, full3, torch.float32)


def test_a_name_map_must_give_each_trainer_tensor_its_own_target_and_map_something():
    """Two trainer tensors mapped to one engine tensor: the last write won and the other engine
    tensor kept its old version, reported ok. A name map that maps nothing "committed" every
    version while nothing changed."""
    layouts = {"w": ShardLayout.replicated((8, 6), [0])}
    full = full_weights(1)
    shards = trainer_shards(full, world=1)
    manifest = WeightPublisher(0).prepare(1, shards[0])
    both = WeightSubscriber(0, {"w": torch.zeros(8, 6)}, layouts, name_map=lambda n: "w")
    with pytest.raises(ValueError, match="both map to w"):
        both.begin(manifest)
    nothing = WeightSubscriber(0, {"w": torch.zeros(8, 6)}, layouts, name_map=lambda n: None)
    with pytest.raises(ValueError, match="maps none of the trainer's 3 tensors"):
        nothing.begin(manifest)


def test_inplace_updates_write_into_parameters_that_require_grad():
    """Live nn.Parameters refused every in-place update ("a view of a leaf Variable that requires
    grad is being used in an in-place operation")."""
    subs = make_samplers(dtype=torch.float32, mode="inplace")
    for s in subs:
        s._weights = {n: torch.nn.Parameter(t) for n, t in s.weights.items()}
    live = subs[1].weights["model.embed"]
    with contextlib.ExitStack() as paused:
        for s in subs:
            paused.enter_context(s.paused())
        push(1, full_weights(1), subs)
        for s in subs:
            assert s.commit() == 1
    assert subs[1].weights["model.embed"] is live and live.requires_grad
    expect_equal(subs, full_weights(1), torch.float32)
