"""Framework-neutral parts of the KV cache managers (tpusync.torch / tpusync.jax).

Layouts and host block formats (:mod:`.layout`), segment plans for the native gather/scatter
(:mod:`.plan`), futures (:mod:`.futures`), the injected store / transport protocols
(:mod:`.protocols`), the P/D transport (:mod:`.pd_transport`), the shared manager
logic (:mod:`.manager`) and weight bucket plans (:mod:`.weights`). Imports numpy only.
"""

from tpusync.core.kvcache.futures import LayeredTransfer, TransferFuture
from tpusync.core.kvcache.layout import BlockFormat, KVLayout, check_format
from tpusync.core.kvcache.manager import KVCacheManagerBase
from tpusync.core.kvcache.pd_transport import PdBlockTransport
from tpusync.core.kvcache.protocols import BlockTransport, KVStore
from tpusync.core.kvcache.weights import WeightManifest, plan_weights

__all__ = [
    "BlockFormat",
    "BlockTransport",
    "KVCacheManagerBase",
    "KVLayout",
    "KVStore",
    "LayeredTransfer",
    "PdBlockTransport",
    "TransferFuture",
    "WeightManifest",
    "check_format",
    "plan_weights",
]
