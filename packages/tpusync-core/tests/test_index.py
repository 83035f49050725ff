import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tpusync.core as tc
from tpusync.core import Tier, _native


def test_lookup_prefix_and_placement():
    idx = tc.BlockIndex()
    keys = [bytes([i]) * 32 for i in range(5)]
    for i, k in enumerate(keys[:3]):
        idx.insert(k, Tier.HOST, i)
    idx.insert(keys[1], Tier.DISK, 77)
    n, placements = idx.lookup_prefix(keys)
    assert n == 3
    assert placements[1].has(Tier.DISK) and placements[1].location(Tier.DISK) == 77
    assert placements[1].best == Tier.HOST
    assert placements[0].location(Tier.DISK) is None


def test_errors_map_to_python_exceptions():
    idx = tc.BlockIndex()
    with pytest.raises(tc.NotFoundError):
        idx.pin(b"missing")
    idx.insert(b"k", Tier.HOST, 1)
    with pytest.raises(tc.AlreadyExistsError):
        idx.insert(b"k", Tier.HOST, 2)
    with pytest.raises(tc.StateError, match="unbalanced"):
        idx.unpin(b"k")
    with pytest.raises(tc.InvalidArgumentError):
        idx.insert(b"", Tier.HOST, 1)


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "pin", "unpin", "evict", "touch"]), st.integers(0, 15)),
    max_size=200,
)


@pytest.mark.parametrize("recency", [_native.Recency.EXACT_LRU, _native.Recency.CLOCK])
@settings(max_examples=200, deadline=None)
@given(script=ops)
def test_pinned_keys_are_never_evicted(recency, script):
    """Model-based, in both recency modes: the index agrees with a dict model; evictions never
    pick a pinned key and a full candidate walk returns every unpinned key exactly once."""
    idx = tc.BlockIndex(recency)
    assert idx.recency == recency
    pins: dict[bytes, int] = {}
    for op, i in script:
        k = b"key%02d" % i
        if op == "insert" and k not in pins:
            idx.insert(k, Tier.HOST, i)
            pins[k] = 0
        elif op == "pin" and k in pins:
            idx.pin(k)
            pins[k] += 1
        elif op == "unpin" and k in pins and pins[k] > 0:
            idx.unpin(k)
            pins[k] -= 1
        elif op == "touch":
            assert (idx.lookup(k) is not None) == (k in pins)
        elif op == "evict":
            for key, loc in idx.eviction_candidates(Tier.HOST, 3):
                assert pins[key] == 0
                assert idx.remove(key, Tier.HOST) == loc
                del pins[key]
    assert len(idx) == len(pins) == idx.count(Tier.HOST)
    for k, p in pins.items():
        assert idx.lookup(k, touch=False).pins == p
    walk = [k for k, _ in idx.eviction_candidates(Tier.HOST, 1000)]
    assert sorted(walk) == sorted(k for k, p in pins.items() if p == 0)


def test_default_recency_is_clock_and_lru_order_is_kept_in_exact_mode():
    """The default mode (chosen by measurement, docs/design-decisions.md) and the exact order."""
    assert tc.BlockIndex().recency == _native.Recency.CLOCK
    for recency in (_native.Recency.EXACT_LRU, _native.Recency.CLOCK):
        idx = tc.BlockIndex(recency)
        for i in range(4):
            idx.insert(b"k%d" % i, Tier.HOST, i)
        idx.lookup(b"k0")
        assert [k for k, _ in idx.eviction_candidates(Tier.HOST, 2)] == [b"k1", b"k2"]
