"""vLLM plugin hook (entry point group ``vllm.general_plugins``): registers TpusyncConnector.

vLLM calls :func:`register` in every process it starts (engine core and workers) before it builds
connectors, so ``"kv_connector": "TpusyncConnector"`` resolves by name everywhere.
"""

from __future__ import annotations

CONNECTOR_NAME = "TpusyncConnector"


def register() -> None:
    """Register the connector with vLLM's KVConnectorFactory (idempotent, lazy import)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "tpusync.vllm.connector", "TpusyncConnector"
    )
