"""tpusync.jax: tpusync for JAX.

Available now: zero-copy JAX arrays over host pool blocks (:func:`block_array`). The paged KV cache
manager, sharded transfers, P/D and weight-sync device side are tracked in the project's issues and
are not part of this release yet.
"""

from tpusync.core import require_api

MIN_CORE_API = 1
require_api(MIN_CORE_API, "tpusync-jax")

from tpusync.jax._views import block_array  # noqa: E402 - after the API gate on purpose

__all__ = ["MIN_CORE_API", "block_array"]
