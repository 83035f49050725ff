"""copy_checksum64 and Checksum64Stream: the fused copy + XXH3 pass of the core, from Python.

DIGEST CONTRACT: whatever the split into pieces and whichever pieces are copied while hashed,
the digest equals checksum64 of all the bytes joined (the BLOCK CHECKSUM CONTRACT of tpusync-rl
relies on it).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tpusync.core as tc

# Sizes around XXH3's short-input paths, the 1 KiB dispatch, the 16 KiB fused chunk and the
# 64 KiB non-temporal threshold.
SIZES = [0, 1, 17, 240, 241, 1023, 1024, (16 << 10) + 3, (64 << 10) - 1, (64 << 10) + 65, 1 << 20]


@pytest.mark.parametrize("n", SIZES)
def test_copy_checksum64_copies_and_returns_the_one_shot_digest(n):
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, n + 8, dtype=np.uint8)
    dst = np.full(n + 16, 0xEE, dtype=np.uint8)
    for seed in (0, 9):
        # Odd offsets on both sides: no alignment is assumed.
        got = tc.copy_checksum64(dst[3 : 3 + n], src[5 : 5 + n], seed=seed)
        assert got == tc.checksum64(src[5 : 5 + n], seed=seed)
        assert np.array_equal(dst[3 : 3 + n], src[5 : 5 + n])
        assert (dst[:3] == 0xEE).all() and (dst[3 + n :] == 0xEE).all()


def test_copy_checksum64_takes_any_dtypes_of_equal_byte_size():
    src = np.arange(64, dtype=np.float32).reshape(8, 8)
    dst = np.zeros(256, dtype=np.uint8)
    assert tc.copy_checksum64(dst, src) == tc.checksum64(src)
    assert np.array_equal(dst.view(np.float32).reshape(8, 8), src)
    torch = pytest.importorskip("torch")
    t = torch.randn(5, 7).to(torch.bfloat16)  # through DLPack, bf16 included
    out = torch.zeros(5, 7, dtype=torch.bfloat16)
    want = tc.checksum64(t.view(torch.int16).numpy())
    assert tc.copy_checksum64(out, t) == want and torch.equal(out, t)
    scalar, one = torch.tensor(2.5), torch.zeros(())
    assert tc.copy_checksum64(one, scalar) == tc.checksum64(scalar.numpy()) and one.item() == 2.5


def test_copy_checksum64_refuses_bad_arrays_and_writes_nothing():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(tc.InvalidArgumentError, match="copy from 64 source bytes into a 32"):
        tc.copy_checksum64(dst[:32], src)
    wide = np.zeros((8, 16), dtype=np.uint8)
    # A strided destination is refused, never silently copied into a temporary.
    with pytest.raises(tc.InvalidArgumentError, match="dst must be a C-contiguous"):
        tc.copy_checksum64(wide[:, :8], src)
    assert not wide.any()
    with pytest.raises(tc.InvalidArgumentError, match="src must be a C-contiguous"):
        tc.copy_checksum64(dst, wide[:, ::2])
    ro = np.zeros(64, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(TypeError):
        tc.copy_checksum64(ro, src)
    assert not dst.any()
    assert tc.copy_checksum64(dst, ro) == tc.checksum64(ro)  # a read-only source is fine


def test_stream_copy_update_and_update_over_a_block_of_pieces_and_gaps():
    rng = np.random.default_rng(1)
    block = rng.integers(0, 256, (1 << 20) + 77, dtype=np.uint8)
    cuts = [0, 64, 5000, (64 << 10) + 1, (300 << 10) + 7, block.size - 16, block.size]
    out = np.full(block.size, 0xEE, dtype=np.uint8)
    h = tc.Checksum64Stream(seed=4)
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
        if i % 2:
            h.update(block[lo:hi])  # a gap: hashed, not copied
        else:
            h.copy_update(out[lo:hi], block[lo:hi])
    assert h.digest() == tc.checksum64(block, seed=4)
    assert h.digest() == tc.checksum64(block, seed=4)  # digest() leaves the state usable
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
        assert (out[lo:hi] == 0xEE).all() if i % 2 else np.array_equal(out[lo:hi], block[lo:hi])
    h.reset()
    assert h.digest() == tc.checksum64(b"")
    with pytest.raises(tc.InvalidArgumentError, match="data must be a C-contiguous"):
        h.update(block[::2])


@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(max_size=200_000),
    splits=st.lists(st.integers(0, 200_000), max_size=6),
    copy=st.lists(st.booleans(), min_size=7, max_size=7),
    seed=st.integers(0, 2**64 - 1),
)
def test_stream_any_split_equals_the_one_shot_digest(data, splits, copy, seed):
    src = np.frombuffer(data, dtype=np.uint8)
    out = np.zeros_like(src)
    h = tc.Checksum64Stream(seed)
    cuts = [0, *sorted(min(s, src.size) for s in splits), src.size]
    for k, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
        if copy[k]:
            h.copy_update(out[lo:hi], src[lo:hi])
            assert np.array_equal(out[lo:hi], src[lo:hi])
        else:
            h.update(src[lo:hi])
    assert h.digest() == tc.checksum64(data, seed)


def test_stream_copy_update_gathers_and_scatters_rows_at_a_stride():
    """One side may be a strided box with contiguous rows (a resharded tensor piece): the copy is
    a gather into / scatter out of the packed side, the hash covers the packed bytes in C order."""
    rng = np.random.default_rng(2)
    full = rng.standard_normal((64, 100)).astype(np.float32)
    box = full[10:40, 20:70]  # rows of 200 bytes, 400 apart
    packed = np.ascontiguousarray(box)
    out = np.zeros(packed.nbytes, dtype=np.uint8)
    h = tc.Checksum64Stream()
    h.copy_update(out, box)
    assert h.digest() == tc.checksum64(packed)
    assert np.array_equal(out.view(np.float32).reshape(box.shape), packed)
    target = np.zeros_like(full)
    h = tc.Checksum64Stream(seed=1)
    h.copy_update(target[10:40, 20:70], packed.view(np.uint8).reshape(-1), keep_in_cache=True)
    assert h.digest() == tc.checksum64(packed, seed=1)
    assert np.array_equal(target[10:40, 20:70], packed)
    target[10:40, 20:70] = 0
    assert not target.any()  # nothing written outside the box
    cube = rng.standard_normal((4, 6, 8, 10)).astype(np.float32)[1:3, :, 2:5]  # 30-float runs
    out = np.zeros(cube.nbytes, dtype=np.uint8)
    h = tc.Checksum64Stream()
    h.copy_update(out, cube)
    assert h.digest() == tc.checksum64(np.ascontiguousarray(cube))
    with pytest.raises(tc.InvalidArgumentError, match="innermost dimension is strided"):
        tc.Checksum64Stream().copy_update(np.zeros(30 * 50 * 4, np.uint8), full.T[:30, :50])
    with pytest.raises(tc.InvalidArgumentError, match="both are strided"):
        tc.Checksum64Stream().copy_update(target[:30, :50], full[10:40, 20:70])
    with pytest.raises(tc.InvalidArgumentError, match="into a 100-byte destination"):
        tc.Checksum64Stream().copy_update(np.zeros(100, np.uint8), box)


def _bf16_by_value(x: np.ndarray) -> np.ndarray:
    """Round to nearest even by VALUE (float64 arithmetic, not the bit trick under test): the two
    bf16 neighbours of each float, the nearer, the even one on a tie; NaN -> 0x7FC0."""
    u = x.view(np.uint32).astype(np.uint64)
    lo = u & 0xFFFF0000
    hi = lo + 0x10000
    with np.errstate(invalid="ignore", over="ignore"):  # NaN lanes: replaced at the end
        f = np.abs(x.astype(np.float64))
        flo = np.abs(lo.astype(np.uint32).view(np.float32).astype(np.float64))
        fhi = np.abs(hi.astype(np.uint32).view(np.float32).astype(np.float64))
        fhi[np.isinf(fhi)] = 2.0**128  # past the largest bf16: overflow to infinity
        dlo, dhi = f - flo, fhi - f
    up = (dhi < dlo) | ((dhi == dlo) & ((lo >> 16) & 1 == 1))
    out = np.where(up, hi, lo) >> 16
    out = np.where(u == lo, u >> 16, out)  # exact (infinities and zeros included)
    out = np.where(np.isnan(x), 0x7FC0, out)
    return out.astype(np.uint16)


def test_stream_cast_update_hashes_fp32_and_writes_bf16_rounded_to_nearest_even():
    rng = np.random.default_rng(4)
    tops = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    bits = (tops[:, None] | lows[None, :]).ravel()
    bits = np.concatenate([bits, rng.integers(0, 2**32, 5000, dtype=np.uint32)])
    x = bits.view(np.float32)
    dst = np.full(len(x) + 2, 0xABCD, np.uint16)
    h = tc.Checksum64Stream(seed=3)
    h.cast_update(dst[1:-1], x)
    assert h.digest() == tc.checksum64(x.view(np.uint8), seed=3)
    assert np.array_equal(dst[1:-1], _bf16_by_value(x))
    assert dst[0] == 0xABCD and dst[-1] == 0xABCD


def test_stream_cast_update_scatters_and_gathers_rows_at_a_stride():
    rng = np.random.default_rng(5)
    src = rng.standard_normal((40, 64)).astype(np.float32)
    big = np.zeros((64, 128), np.uint16)
    h = tc.Checksum64Stream()
    h.cast_update(big[8:48, 16:80], src)  # scatter: packed fp32 rows into a strided bf16 box
    assert h.digest() == tc.checksum64(src)
    assert np.array_equal(big[8:48, 16:80], _bf16_by_value(src))
    assert not big[:8].any() and not big[:, :16].any() and not big[:, 80:].any()
    packed = np.zeros((20, 32), np.uint16)
    h = tc.Checksum64Stream()
    h.cast_update(packed, src[::2, 16:48])  # gather: strided fp32 rows into packed bf16
    assert h.digest() == tc.checksum64(np.ascontiguousarray(src[::2, 16:48]))
    assert np.array_equal(packed, _bf16_by_value(np.ascontiguousarray(src[::2, 16:48])))


def test_stream_cast_update_writes_float16_rounded_like_numpy_with_nan_made_quiet():
    """A float16 destination: every sign / exponent / top-10-mantissa pattern with the low bits
    that decide rounding (exact, just above, around the tie, the largest) and random bits give
    numpy's IEEE round-to-nearest-even (subnormals, overflow to inf); NaN -> sign | 0x7E00."""
    rng = np.random.default_rng(6)
    tops = np.arange(1 << 19, dtype=np.uint32) << 13
    lows = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x0ABC], np.uint32)
    bits = (tops[:, None] | lows[None, :]).ravel()
    bits = np.concatenate([bits, rng.integers(0, 2**32, 5000, dtype=np.uint32)])
    x = bits.view(np.float32)
    dst = np.full(len(x) + 2, 0xABCD, np.uint16)
    h = tc.Checksum64Stream(seed=5)
    h.cast_update(dst[1:-1].view(np.float16), x)
    assert h.digest() == tc.checksum64(x.view(np.uint8), seed=5)
    got = dst[1:-1]
    nan = np.isnan(x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.array_equal(got[nan], ((bits[nan] >> 16) & 0x8000 | 0x7E00).astype(np.uint16))
    assert dst[0] == 0xABCD and dst[-1] == 0xABCD
    big = np.zeros((64, 128), np.float16)  # scatter into a strided float16 box
    src = rng.standard_normal((40, 64)).astype(np.float32)
    h = tc.Checksum64Stream()
    h.cast_update(big[8:48, 16:80], src)
    assert h.digest() == tc.checksum64(src)
    assert np.array_equal(big[8:48, 16:80], src.astype(np.float16))
    assert not big[:8].any() and not big[:, :16].any() and not big[:, 80:].any()


def test_stream_cast_update_refuses_wrong_dtypes_and_sizes_and_writes_nothing():
    src = np.ones(8, np.float32)
    h = tc.Checksum64Stream()
    cases = [
        (np.zeros(8, np.uint16), np.ones(8, np.float64), "src must be float32"),
        (np.zeros(8, np.float32), src, "dst must be bfloat16, float16"),
        (np.zeros(8, np.int16), src, "dst must be bfloat16, float16"),
        (np.zeros(7, np.uint16), src, "8 source values into 7"),
        (np.zeros((8, 2), np.uint16)[:, 0], src, "innermost dimension is strided"),
        (
            np.zeros((4, 4), np.uint16)[:, :2],
            np.ones((4, 4), np.float32)[:, :2],
            "both are strided",
        ),
    ]
    for dst, s, why in cases:
        before = dst.copy()
        with pytest.raises(tc.errors.InvalidArgumentError, match=why):
            h.cast_update(dst, s)
        assert np.array_equal(dst, before)
    assert h.digest() == tc.Checksum64Stream().digest()  # nothing was hashed
