"""The ``tensors`` argument of TrainerSync.publish (tpusync.rl.tensors): SHARD SHAPE RULE."""

import pytest
import torch

from tpusync.rl.layout import ShardLayout
from tpusync.rl.tensors import _normalize


def test_a_shard_whose_shape_is_not_its_layout_box_is_refused_before_anything_moves():
    """The full tensor passed as each rank's shard of a row split was accepted, and every rank's
    box was sent the tensor's first rows (committed, reported ok); a smaller shard failed mid
    version, after the samplers were told."""
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    split = ShardLayout.split((64, 32), 0, 2)
    with pytest.raises(
        ValueError,
        match=r"x: the local shard of rank 0 has shape \(64, 32\), its layout box \(32, 32\)",
    ):
        _normalize({"x": ({0: full, 1: full}, split)}, 2, (0, 1))
    with pytest.raises(ValueError, match=r"rank 1 has shape \(16, 32\)"):
        _normalize({"x": ({0: full[:32], 1: full[32:48]}, split)}, 2, (0, 1))
    with pytest.raises(ValueError, match="rank 0 has shape"):
        _normalize({"x": (torch.cat([full, full]), ShardLayout.replicated((64, 32), [0]))}, 1, (0,))
    with pytest.raises(ValueError, match="is a meta tensor"):
        _normalize({"x": (torch.empty(32, 32, device="meta"), split)}, 2, (0,))
    ok = _normalize({"x": ({0: full[:32], 1: full[32:]}, split), "b": torch.zeros(3)}, 2, (0, 1))
    assert set(ok["x"][0]) == {0, 1} and ok["b"][1].shape == (3,)


def test_a_tensor_whose_shape_is_not_the_samplers_layout_is_refused_before_the_announcement():
    """The error came after the version was announced and named no tensor."""
    import rl_netutil as U

    from tpusync.rl import TrainerSync

    dst = {"c": ShardLayout.replicated((128, 65), [0])}
    t = TrainerSync(0, 1, dst, secret=U.SECRET, block_bytes=64 << 10, pool_bytes=4 << 20)
    try:
        with pytest.raises(ValueError, match=r"c: the trainer publishes shape \(128, 64\)"):
            t.publish(1, {"c": torch.zeros(128, 64)})
        assert t.publish(1, {"c": torch.zeros(128, 65)}).ok  # the version number is still free
    finally:
        t.close()


def test_a_full_update_without_a_tensor_dst_layouts_plans_is_refused_before_the_announcement():
    """FULL UPDATE RULE: the missing tensor was not sent, and every sampler committed the version
    with it at its old value beside the new ones (reported ok). A delta may leave it out."""
    import rl_netutil as U

    from tpusync.rl import TrainerSync

    dst = {n: ShardLayout.replicated((4, 8), [0]) for n in ("a", "b")}
    t = TrainerSync(0, 1, dst, secret=U.SECRET, block_bytes=64 << 10, pool_bytes=4 << 20)
    try:
        with pytest.raises(ValueError, match=r"publish\(1\): dst_layouts plans b, which this full"):
            t.publish(1, {"a": torch.zeros(4, 8)})
        assert t.publish(1, {"a": torch.zeros(4, 8), "b": torch.ones(4, 8)}).ok
        assert t.publish(2, {"a": torch.ones(4, 8)}, delta=True).ok  # b unchanged: not sent
    finally:
        t.close()
