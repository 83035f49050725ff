import warnings

import numpy as np
import pytest
import torch

import tpusync.core as tc
from tpusync.torch import flatten_weights, restore_weights


def test_state_dict_round_trip_in_place_across_buckets():
    g = torch.Generator().manual_seed(0)
    sd = {
        "embed": torch.randn(300, 64, generator=g),
        "w1": torch.randn(64, 128, generator=g).to(torch.bfloat16),
        "b1": torch.randn(128, generator=g),
        "t": torch.randn(64, 32, generator=g).t(),  # non-contiguous source
        "step": torch.tensor(7, dtype=torch.int64),
    }
    pool = tc.HostBlockPool(4096, 128)
    host, futures = flatten_weights(sd, pool, bucket_bytes=12 << 10)
    assert len(futures) == len(host.manifest.buckets) > 2
    for f in futures:
        f.result(timeout=10)
    targets = {k: torch.zeros_like(v).contiguous() for k, v in sd.items()}
    ptrs = {k: v.data_ptr() for k, v in targets.items()}
    restore_weights(host, targets).result(timeout=10)
    for k in sd:
        assert torch.equal(targets[k], sd[k]) and targets[k].data_ptr() == ptrs[k]
    host.free()
    assert pool.num_free == pool.num_blocks


def test_restore_refuses_mismatch_naming_tensor_and_field():
    pool = tc.HostBlockPool(4096, 16)
    host, futures = flatten_weights({"a": torch.ones(10), "b": torch.ones(3, 3)}, pool)
    [f.result(timeout=10) for f in futures]
    b = torch.zeros(3, 3)
    with pytest.raises(tc.InvalidArgumentError, match="'b': field 'shape'"):
        restore_weights(host, {"a": torch.zeros(10), "b": torch.zeros(9)})
    with pytest.raises(tc.InvalidArgumentError, match="'a': field 'dtype'"):
        restore_weights(host, {"a": torch.zeros(10, dtype=torch.float64), "b": b})
    with pytest.raises(tc.InvalidArgumentError, match="field 'name'"):
        restore_weights(host, {"a": torch.zeros(10)})
    assert not b.any()


def test_freed_weights_and_missing_buckets_are_refused():
    """A freed HostWeights raised a bare IndexError (the JAX face restored uninitialised memory);
    bucket -1 silently restored the last bucket."""
    sd = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    pool = tc.HostBlockPool(4096, 32)
    host, futures = flatten_weights(sd, pool, bucket_bytes=16 << 10)
    [f.result(timeout=10) for f in futures]
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    for bad in ([99], [-1]):
        with pytest.raises(tc.InvalidArgumentError, match="does not exist"):
            restore_weights(host, targets, buckets=bad)
    host.free()
    with pytest.raises(tc.StateError, match="freed"):
        restore_weights(host, targets)


def test_a_flatten_that_fails_gives_back_what_it_took():
    """A bucket that did not fit, or a tensor on an unsupported device, left the blocks already
    taken allocated for good."""
    pool = tc.HostBlockPool(4096, 3)
    big = {"a": torch.randn(2048), "b": torch.randn(2048)}  # 8 KiB each: two buckets of 2 blocks
    with pytest.raises(tc.PoolExhaustedError):
        flatten_weights(big, pool, bucket_bytes=8 << 10)
    assert pool.num_free == pool.num_blocks
    mixed = {"a": torch.randn(16), "m": torch.empty(16, device="meta")}
    with pytest.raises(tc.InvalidArgumentError, match="several devices"):
        flatten_weights(mixed, pool)
    with pytest.raises(tc.InvalidArgumentError, match="'meta' device"):
        flatten_weights({"m": torch.empty(16, device="meta")}, pool)
    with pytest.raises(tc.InvalidArgumentError, match="not a torch.Tensor"):
        flatten_weights({"x": [1.0, 2.0]}, pool)
    assert pool.num_free == pool.num_blocks


def test_restore_into_read_only_memory_is_refused_not_a_segfault(tmp_path):
    """WRITABLE MEMORY CHECK: restore_weights into a tensor over a read-only mapping killed the
    process with SIGSEGV."""
    np.save(tmp_path / "b.npy", np.zeros(9, np.float32))
    with warnings.catch_warnings():  # torch warns once per process
        warnings.simplefilter("ignore")
        ro = torch.from_numpy(np.load(tmp_path / "b.npy", mmap_mode="r"))
    pool = tc.HostBlockPool(4096, 8)
    sd = {"a": torch.arange(10.0), "b": torch.arange(9.0)}
    host, futures = flatten_weights(sd, pool)
    for f in futures:
        f.result(timeout=10)
    a = torch.zeros(10)
    with pytest.raises(tc.InvalidArgumentError, match="weight 'b': .* is read-only"):
        restore_weights(host, {"a": a, "b": ro})
    assert not a.any()  # refused before any byte moved
    host.free()
