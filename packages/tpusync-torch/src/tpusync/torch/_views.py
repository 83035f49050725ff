"""Zero-copy torch tensors over host pool blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tpusync.core import HostBlockPool


def block_tensor(
    pool: HostBlockPool,
    block_id: int,
    dtype: torch.dtype = torch.uint8,
    shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """A CPU tensor sharing the memory of one pool block (DLPack, no copy).

    The block's memory stays valid while the tensor lives, even if the block is freed meanwhile.
    """
    return torch.from_dlpack(pool.dlpack(block_id, dtype, shape))
