"""tpusync.torch: tpusync for PyTorch.

Available now: zero-copy torch views of host pool blocks (:func:`block_tensor`). The paged KV cache
manager, P/D transfer and weight-sync device side are tracked in the project's issues and are not
part of this release yet.
"""

from tpusync.core import require_api

MIN_CORE_API = 1
require_api(MIN_CORE_API, "tpusync-torch")

from tpusync.torch._views import block_tensor  # noqa: E402 - after the API gate on purpose

__all__ = ["MIN_CORE_API", "block_tensor"]
