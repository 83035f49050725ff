"""The interim store halves (directory: decisions; slots: bytes) without vLLM."""

from __future__ import annotations

import numpy as np
import pytest

import tpusync.core as tc
from tpusync.vllm.store import HostDirectory, HostSlots


def keys(*names: str) -> list[bytes]:
    return [n.encode().ljust(32, b"\0") for n in names]


def test_directory_lookup_reserve_pin_evict():
    d = HostDirectory(num_slots=3)
    a, b, c, e = keys("a", "b", "c", "e")
    placed = d.reserve([a, b, c])
    assert sorted(s for _, s in placed) == [0, 1, 2]
    assert d.lookup([a, b, c, e]) == 3 and d.lookup([e, a]) == 0
    assert d.reserve([a]) == []  # already stored: no second slot
    d.pin([a, b, c])
    assert d.reserve([e]) == []  # everything pinned: nothing evicted, nothing placed
    d.unpin([a, b])
    d.lookup([b])  # lookup does not touch LRU order; reserve evicts the oldest unpinned (a)
    (got,) = d.reserve([e])
    assert got[0] == e and d.lookup([a]) == 0 and d.evictions == 1
    kinds = [ev.kind for ev in d.take_events()]
    assert kinds == ["stored", "removed", "stored"]
    assert d.num_pins == 1
    d.unpin([c])
    d.unpin([c])  # unbalanced unpin is ignored, never negative
    assert d.num_pins == 0


def test_directory_pin_is_all_or_nothing_and_remove_drops_pins():
    d = HostDirectory(num_slots=4)
    a, b, missing = keys("a", "b", "zz")
    d.reserve([a, b])
    with pytest.raises(tc.NotFoundError):
        d.pin([a, missing])
    assert d.num_pins == 0
    d.pin([a, b])
    assert d.remove([a, missing]) == 1 and d.num_pins == 1
    d.unpin([a, b])
    assert d.num_pins == 0
    d.clear()
    assert len(d) == 0 and d.take_events()[-1].kind == "cleared"
    with pytest.raises(tc.InvalidArgumentError):
        HostDirectory(0)


def test_slots_roundtrip_block_major_rows_and_key_check():
    rows, row_bytes, layers = 8, 256, 3
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 255, (rows, row_bytes), dtype=np.uint8) for _ in range(layers)]
    dst = [np.zeros_like(a) for a in src]
    s = HostSlots(num_slots=4, row_bytes=row_bytes, rows_per_key=layers)
    k1, k2 = keys("k1", "k2")
    s.save([2, 0], [k1, k2], src, [5, 1]).result(10)
    s.load([2, 0], [k1, k2], dst, [6, 3]).result(10)
    for a, b in zip(src, dst, strict=True):
        assert np.array_equal(b[6], a[5]) and np.array_equal(b[3], a[1])
        assert not b[0].any()
    with pytest.raises(tc.NotFoundError):
        s.load([2], [k2], dst, [0]).result(10)  # slot 2 holds k1, not k2
    s.invalidate([0])
    with pytest.raises(tc.NotFoundError):
        s.load([0], [k2], dst, [0]).result(10)
    with pytest.raises(tc.InvalidArgumentError):
        s.save([9], [k1], src, [0])
    with pytest.raises(tc.InvalidArgumentError):
        s.save([0], [k1], src[:1], [0])
