"""tpusync.vllm: a vLLM KV connector on tpusync.

NOT IMPLEMENTED YET: this release ships only the package and its API gate; the TpusyncConnector
(offload, shared prefix cache, P/D, KV events) is tracked in the project's issues.
"""

from tpusync.core import require_api

MIN_CORE_API = 1
require_api(MIN_CORE_API, "tpusync-vllm")

__all__ = ["MIN_CORE_API"]
