"""LoRA adapter versions from a trainer into a running vLLM engine or server.

vLLM serves adapters it loads from a PEFT directory (``LoRARequest(name, int_id, path)``), each
under its own integer id. :class:`LoraSync` is :class:`tpusync.rl.lora.AdapterSync` (ADAPTER
VERSION CONTRACT: one adapter per version, written after every digest verified, loaded before
the version is committed, the newest ``keep`` kept) with vLLM as the loader:

- ``engine=``: an offline ``vllm.LLM`` started with ``enable_lora=True``; ``add_lora`` loads each
  version on every worker; requests pass :meth:`AdapterVersion.request` as ``lora_request=``.
- ``server=``: a vLLM OpenAI server's URL, started with ``--enable-lora`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; ``POST /v1/load_lora_adapter`` loads each version
  and ``/v1/unload_lora_adapter`` drops the old ones (the server's list of adapters would
  otherwise grow by one per step); requests name the version by ``model=<its name>``. The
  server must see ``root`` (same host or a shared filesystem).

This module imports vLLM only in :meth:`AdapterVersion.request` and for ``engine=``: a client of
a vLLM server needs only torch and safetensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tpusync.rl import lora
from tpusync.rl.lora import AdapterSync, check_adapter, lora_layouts
from tpusync.rl.vllm import _post

__all__ = ["AdapterVersion", "LoraSync", "check_adapter", "lora_layouts"]


class AdapterVersion(lora.AdapterVersion):
    """One adapter version served by vLLM (ADAPTER VERSION CONTRACT)."""

    __slots__ = ()

    def request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` to pass to ``generate(..., lora_request=)``."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_int_id, self.path)


class _EngineLoader:
    """An offline ``vllm.LLM``: ``add_lora`` on every worker."""

    engine = "vLLM"

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def check(self, rank: int) -> None:
        config = self._llm.llm_engine.vllm_config.lora_config
        if config is None:
            raise ValueError(
                "the vLLM engine was started without enable_lora=True: it serves no adapter"
            )
        if rank > config.max_lora_rank:
            raise ValueError(
                f"the adapter's rank {rank} is above the engine's max_lora_rank "
                f"{config.max_lora_rank}: start the engine with a larger max_lora_rank"
            )

    def load(self, adapter: lora.AdapterVersion) -> None:
        engine = self._llm.llm_engine
        if adapter.lora_int_id in engine.list_loras():
            # ID RULE: vLLM's add_lora keeps an adapter whose id it already holds and returns
            # True, so the version would be served with the other adapter's tensors.
            raise RuntimeError(
                f"the engine already holds an adapter with id {adapter.lora_int_id} (another "
                "LoraSync on this engine with the same id_offset, or one not closed): give each "
                "its own id_offset"
            )
        if not engine.add_lora(adapter.request()):  # type: ignore[attr-defined]
            raise RuntimeError("add_lora returned False")

    def unload(self, adapter: lora.AdapterVersion) -> None:
        self._llm.llm_engine.remove_lora(adapter.lora_int_id)


class _ServerLoader:
    """A vLLM OpenAI server: its runtime LoRA routes, each call bounded by ``timeout`` s."""

    engine = "vLLM"

    def __init__(self, url: str, timeout: float) -> None:
        self._url, self._timeout = url.rstrip("/"), timeout

    def check(self, rank: int) -> None:
        """Nothing here: the server's LoRA settings are not on its HTTP API; a refusal rejects
        the version instead."""

    def load(self, adapter: lora.AdapterVersion) -> None:
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        _post(self._url, "/v1/load_lora_adapter", body, self._timeout)

    def unload(self, adapter: lora.AdapterVersion) -> None:
        _post(self._url, "/v1/unload_lora_adapter", {"lora_name": adapter.name}, self._timeout)


class LoraSync(AdapterSync):
    """A vLLM engine's sampler of LoRA adapter versions (ADAPTER VERSION CONTRACT).

    ``config`` / ``params`` / ``root`` / ``name`` / ``id_offset`` / ``keep`` and the
    :class:`~tpusync.rl.sampler.SamplerSync` keyword arguments (``control`` and ``replica`` are
    required): as :class:`~tpusync.rl.lora.AdapterSync`. ``engine``: a ``vllm.LLM`` started with
    ``enable_lora=True`` (its ``max_lora_rank`` at least the adapter's). ``server``: instead, the
    URL of a vLLM OpenAI server started with ``--enable-lora`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; each HTTP call times out after ``http_timeout``
    s. Neither: the directories are only written.
    """

    version_type = AdapterVersion

    def __init__(
        self,
        config: Mapping[str, Any],
        params: Mapping[str, Any],
        *,
        engine: Any = None,
        server: str | None = None,
        root: str | Path | None = None,
        http_timeout: float = 60.0,
        **kwargs: Any,
    ) -> None:
        if engine is not None and server is not None:
            raise ValueError("pass engine= (an offline vllm.LLM) or server= (a URL), not both")
        loader: lora.AdapterLoader | None = None
        if engine is not None:
            loader = _EngineLoader(engine)
        elif server is not None:
            loader = _ServerLoader(server, http_timeout)
        super().__init__(config, params, loader=loader, root=root, **kwargs)
