import jax
import jax.numpy as jnp
import numpy as np

import tpusync.core as tc
from tpusync.jax import block_array


def test_dlpack_view_is_zero_copy():
    pool = tc.HostBlockPool(8192, 2)
    (b,) = pool.alloc(1)
    v = pool.view(b, np.float32)
    v[:] = np.arange(2048, dtype=np.float32)
    a = block_array(pool, b, jnp.float32, (32, 64))
    assert a.unsafe_buffer_pointer() == pool.address(b)
    assert a.devices() == {jax.devices("cpu")[0]}
    np.testing.assert_array_equal(np.asarray(a).ravel(), np.arange(2048, dtype=np.float32))


def test_bfloat16_view():
    pool = tc.HostBlockPool(4096, 1)
    (b,) = pool.alloc(1)
    a = block_array(pool, b, jnp.bfloat16)
    assert a.dtype == jnp.bfloat16 and a.shape == (2048,)
