"""Zero-copy JAX arrays over host pool blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from tpusync.core import HostBlockPool


def block_array(
    pool: HostBlockPool, block_id: int, dtype: Any = "uint8", shape: Sequence[int] | None = None
) -> jax.Array:
    """A CPU jax.Array sharing one pool block's memory (DLPack, no copy).

    JAX arrays are immutable: treat the block as read-only while the array is in use. The block's
    memory stays valid while the array lives.
    """
    return jax.dlpack.from_dlpack(pool.dlpack(block_id, dtype, shape))
