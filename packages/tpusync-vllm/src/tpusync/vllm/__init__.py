"""tpusync.vllm: a vLLM KV connector on tpusync.

``TpusyncConnector`` (host-tier offload and prefix reuse, KV events with the tier as medium) is
imported lazily, so ``import tpusync.vllm`` works without vLLM installed. Load it in vLLM with
``{"kv_connector": "TpusyncConnector", "kv_role": "kv_both"}`` (registered by the
``vllm.general_plugins`` entry point) or with ``"kv_connector_module_path": "tpusync.vllm"``.
Reference: docs/vllm.md.
"""

from typing import Any

from tpusync.core import require_api

MIN_CORE_API = 15  # pd.pair_layers; 14: pd.host_id; 13: shared P/D sends (SHARED-SEND CONTRACT)
require_api(MIN_CORE_API, "tpusync-vllm")

__all__ = ["MIN_CORE_API", "TpusyncConnector"]


def __getattr__(name: str) -> Any:
    if name == "TpusyncConnector":
        from tpusync.vllm.connector import TpusyncConnector

        return TpusyncConnector
    raise AttributeError(f"module 'tpusync.vllm' has no attribute {name!r}")
