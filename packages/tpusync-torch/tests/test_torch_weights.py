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
