"""tpusync.torch: tpusync for PyTorch.

- :class:`KVCacheManager`: device <-> host block transfers over a paged KV cache (any layout
  described by a :class:`KVLayout`), per layer or all layers, asynchronous; KVStore-backed
  save / load / lookup and the P/D primitive (register_send / start_recv / poll) over the tiered
  :class:`KVStore` and a :class:`PdBlockTransport` (or any object with their protocols).
- :func:`flatten_weights` / :func:`restore_weights`: weight-sync device side.
- :func:`block_tensor`: zero-copy torch views of host pool blocks.
"""

from tpusync.core import require_api

MIN_CORE_API = 7  # kvcache.weights.HostWeights
require_api(MIN_CORE_API, "tpusync-torch")

from tpusync.core.kvcache import (  # noqa: E402 - after the API gate on purpose
    BlockFormat,
    KVLayout,
    PdBlockTransport,
)
from tpusync.core.store import KVStore  # noqa: E402
from tpusync.torch._views import block_tensor  # noqa: E402
from tpusync.torch.kv_cache import KVCacheManager  # noqa: E402
from tpusync.torch.weights import HostWeights, flatten_weights, restore_weights  # noqa: E402

__all__ = [
    "MIN_CORE_API",
    "BlockFormat",
    "HostWeights",
    "KVCacheManager",
    "KVLayout",
    "KVStore",
    "PdBlockTransport",
    "block_tensor",
    "flatten_weights",
    "restore_weights",
]
