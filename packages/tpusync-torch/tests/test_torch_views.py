import numpy as np
import pytest
import torch

import tpusync.core as tc
from tpusync.torch import block_tensor


def test_dlpack_view_is_zero_copy():
    pool = tc.HostBlockPool(8192, 4)
    (b,) = pool.alloc(1)
    t = block_tensor(pool, b, torch.bfloat16, (16, 256))
    assert t.data_ptr() == pool.address(b)
    assert t.shape == (16, 256) and t.dtype == torch.bfloat16
    t.fill_(1.5)
    out = np.zeros(8192, np.uint8)
    pool.get([b], out).result(timeout=10)
    assert torch.frombuffer(bytearray(out.tobytes()), dtype=torch.bfloat16).eq(1.5).all()


def test_torch_tensors_as_put_get_buffers():
    pool = tc.HostBlockPool(4096, 4)
    ids = pool.alloc(2)
    src = torch.randn(2, 1024)
    pool.put(ids, src).result(timeout=10)
    dst = torch.empty_like(src)
    pool.get(ids, dst).result(timeout=10)
    assert torch.equal(src, dst)


def test_wrong_shape_for_torch_view():
    pool = tc.HostBlockPool(4096, 1)
    (b,) = pool.alloc(1)
    with pytest.raises(tc.InvalidArgumentError, match="covers 8192 bytes"):
        block_tensor(pool, b, torch.float32, (2048,))


def test_api_gate_names_the_package(monkeypatch):
    from tpusync.core import _compat

    monkeypatch.setattr(_compat, "API_VERSION", 0)
    with pytest.raises(ImportError, match="tpusync-torch needs tpusync-core with API version >= 1"):
        _compat.require_api(1, "tpusync-torch")
