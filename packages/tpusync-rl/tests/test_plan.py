import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync.rl.layout import Box, ShardLayout
from tpusync.rl.plan import ReshardPlan


def apply(plan: ReshardPlan, full: np.ndarray) -> dict[int, np.ndarray]:
    """Run a plan on host arrays: sources hold their shards, destinations start empty."""
    src_local = {
        r: full[tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=False))].copy()
        for r, box in plan.src.shards
    }
    dst_local = {r: np.full(box.shape, np.nan) for r, box in plan.dst.shards}
    written = {r: np.zeros(box.shape, int) for r, box in plan.dst.shards}
    for t in plan.transfers:
        dst_local[t.dst_rank][t.dst_index] = src_local[t.src_rank][t.src_index]
        written[t.dst_rank][t.dst_index] += 1
    for w in written.values():
        assert (w == 1).all(), "every destination element is written exactly once"
    return dst_local


def expected(layout: ShardLayout, full: np.ndarray) -> dict[int, np.ndarray]:
    return {
        r: full[tuple(slice(a, b) for a, b in zip(box.lo, box.hi, strict=False))]
        for r, box in layout.shards
    }


def test_tp2_to_tp4_moves_only_intersections():
    full = np.arange(8 * 6, dtype=float).reshape(8, 6)
    src = ShardLayout.split(full.shape, dim=0, world=2)
    dst = ShardLayout.split(full.shape, dim=0, world=4, ranks=[10, 11, 12, 13])
    plan = ReshardPlan.build(src, dst)
    got = apply(plan, full)
    for r, want in expected(dst, full).items():
        np.testing.assert_array_equal(got[r], want)
    assert sum(t.elements for t in plan.transfers) == full.size  # nothing moved twice
    assert plan.elements_sent() == {0: 24, 1: 24}


def test_column_to_row_split_crosses_every_pair():
    full = np.arange(4 * 4, dtype=float).reshape(4, 4)
    plan = ReshardPlan.build(
        ShardLayout.split(full.shape, 1, 2), ShardLayout.split(full.shape, 0, 2)
    )
    assert len(plan.transfers) == 4
    got = apply(plan, full)
    for r, want in expected(plan.dst, full).items():
        np.testing.assert_array_equal(got[r], want)


def test_replicated_source_spreads_load():
    full = np.arange(16, dtype=float).reshape(4, 4)
    src = ShardLayout.replicated(full.shape, [0, 1])
    dst = ShardLayout.split(full.shape, 0, 4, ranks=[2, 3, 4, 5])
    plan = ReshardPlan.build(src, dst)
    assert plan.elements_sent() == {0: 8, 1: 8}
    apply(plan, full)


def test_rank_on_both_sides_copies_locally():
    full = np.zeros((4, 2))
    plan = ReshardPlan.build(
        ShardLayout.replicated(full.shape, [0, 1]), ShardLayout.replicated(full.shape, [1])
    )
    assert [(t.src_rank, t.dst_rank) for t in plan.transfers] == [(1, 1)]


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="cover 8 of 16"):
        ShardLayout((4, 4), ((0, Box((0, 0), (2, 4))),))
    with pytest.raises(ValueError, match="outside shape"):
        ShardLayout((4, 4), ((0, Box((0, 0), (5, 4))),))
    with pytest.raises(ValueError, match="different shapes"):
        ReshardPlan.build(ShardLayout.replicated((4,), [0]), ShardLayout.replicated((5,), [0]))
    with pytest.raises(ValueError, match="strided"):
        ShardLayout.from_slices((4,), {0: (slice(0, 4, 2),)})


@st.composite
def layouts(draw, shape):
    """A mesh-style layout: some dims split evenly-ish across mesh axes, possibly replicated."""
    split_dims = draw(st.lists(st.sampled_from(range(len(shape))), unique=True, max_size=2))
    parts = [draw(st.integers(1, 4)) if d in split_dims else 1 for d in range(len(shape))]
    replicas = draw(st.integers(1, 2))
    shards, rank = [], draw(st.integers(0, 50))
    grid = np.indices(parts).reshape(len(shape), -1).T
    for cell in grid:
        lo, hi = [], []
        for d, (i, n) in enumerate(zip(cell, parts, strict=False)):
            step = -(-shape[d] // n)
            lo.append(min(i * step, shape[d]))
            hi.append(min((i + 1) * step, shape[d]))
        if any(a >= b for a, b in zip(lo, hi, strict=False)):
            continue  # uneven split left an empty shard: nobody holds it
        for _ in range(replicas):
            shards.append((rank, Box(tuple(lo), tuple(hi))))
            rank += 1
    return ShardLayout(tuple(shape), tuple(shards))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_reshard_reproduces_the_destination_shards(data):
    shape = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    src, dst = data.draw(layouts(shape)), data.draw(layouts(shape))
    full = np.random.default_rng(0).standard_normal(shape)
    plan = ReshardPlan.build(src, dst)
    got = apply(plan, full)
    for r, want in expected(dst, full).items():
        np.testing.assert_array_equal(got[r], want)
    # Each transfer is exactly an intersection: total moved == total destination elements.
    assert sum(t.elements for t in plan.transfers) == sum(b.size for _, b in dst.shards)


def test_from_jax_sharding_matches_device_map():
    jax = pytest.importorskip("jax")  # jax is installed in the tests session; 1 CPU device here
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    layout = ShardLayout.from_jax(NamedSharding(mesh, PartitionSpec("x", "y")), (4, 6))
    assert layout.shards == ((jax.devices()[0].id, Box((0, 0), (4, 6))),)


def test_pytree_leaves_whose_dotted_names_collide_are_refused():
    """NAME RULE (jaxsync.py): ``{"layers.0": {"w"}}`` and ``{"layers": [{"w"}]}`` both name a
    leaf ``layers.0.w``; the second silently replaced the first, which was never published."""
    jax = pytest.importorskip("jax")
    from tpusync.rl.jaxsync import pytree_shards

    tree = {"layers.0": {"w": jax.numpy.zeros(2)}, "layers": [{"w": jax.numpy.ones(2)}]}
    with pytest.raises(ValueError, match="both named 'layers.0.w'"):
        pytree_shards(tree)
    assert sorted(pytree_shards({"a": {"w": jax.numpy.zeros(2)}})) == ["a.w"]
