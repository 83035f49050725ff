"""tpusync.jax: tpusync for JAX.

- :class:`KVCacheManager`: device <-> host block transfers over a paged KV cache held as JAX
  arrays (sharded or not), per layer or all layers, asynchronous; KVStore-backed save / load /
  lookup and the P/D primitive over the tiered :class:`KVStore` and a
  :class:`PdBlockTransport` (or any object with their protocols).
- :func:`flatten_weights` / :func:`restore_weights`: weight-sync device side for pytrees.
- :func:`block_array`: zero-copy JAX arrays over host pool blocks.
"""

from tpusync.core import require_api

MIN_CORE_API = 7  # kvcache.weights.HostWeights
require_api(MIN_CORE_API, "tpusync-jax")

from tpusync.core.kvcache import (  # noqa: E402 - after the API gate on purpose
    BlockFormat,
    KVLayout,
    PdBlockTransport,
)
from tpusync.core.store import KVStore  # noqa: E402
from tpusync.jax._views import block_array  # noqa: E402
from tpusync.jax.kv_cache import KVCacheManager  # noqa: E402
from tpusync.jax.weights import HostWeights, flatten_weights, restore_weights  # noqa: E402

__all__ = [
    "MIN_CORE_API",
    "BlockFormat",
    "HostWeights",
    "KVCacheManager",
    "KVLayout",
    "KVStore",
    "PdBlockTransport",
    "block_array",
    "flatten_weights",
    "restore_weights",
]
