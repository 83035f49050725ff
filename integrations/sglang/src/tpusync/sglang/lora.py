"""LoRA adapter versions from a trainer into a running SGLang server.

An SGLang server started with ``--enable-lora`` (and ``--max-lora-rank`` / ``--lora-target-modules``
covering the adapter) loads adapters while it runs, from a PEFT directory, under a name
(``POST /load_lora_adapter``). :class:`LoraSync` is :class:`tpusync.rl.lora.AdapterSync`
(ADAPTER VERSION CONTRACT: one adapter per version, named ``<name>-v<v>``, written after every
digest verified, loaded before the version is committed, the newest ``keep`` kept) with that
server as the loader. It runs in a client process on the server's host (or on a filesystem the
server shares: the server reads ``root``); each tensor-parallel rank of the server reads its own
part of the directory. Requests pick a version by its name: ``"lora_path": adapter.name`` in
``/generate``, or ``model="<served model>:<adapter.name>"`` on the OpenAI routes.

Checked before anything moves (SGLang's ``/server_info``): LoRA on, the adapter's rank within the
server's ``max_lora_rank``, one data-parallel replica (SGLang loads adapters at run time only
then). An adapter SGLang refuses at load (a target module outside ``--lora-target-modules``, a
shape that does not fit the model) rejects the version with SGLang's reason, and the previous
version stays served. Old versions are unloaded (``/unload_lora_adapter``) and their directories
deleted; SGLang remembers where each name was loaded from, so a request that still names one
finds its directory gone and fails rather than being served another version.

Keys: ``api_key`` / ``admin_api_key`` as for :mod:`tpusync.sglang.weight_sync` (KEYS RULE).
Needs tpusync-rl (``pip install tpusync-sglang[rl]``) and safetensors (SGLang's own).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tpusync.rl.lora import AdapterSync, AdapterVersion
from tpusync.sglang.weight_sync import _http, _Keys

__all__ = ["AdapterVersion", "LoraSync"]


def _setting(info: Mapping[str, Any], key: str) -> Any:
    """A server argument from ``/server_info`` (top level in 0.5.23, else under server_args)."""
    if key in info:
        return info[key]
    args = info.get("server_args")
    return args.get(key) if isinstance(args, Mapping) else None


class _ServerLoader:
    """An SGLang server's runtime LoRA routes, each call bounded by ``timeout`` s."""

    engine = "SGLang"

    def __init__(self, url: str, timeout: float, keys: _Keys) -> None:
        self._url, self._timeout, self._keys = url.rstrip("/"), timeout, keys

    def check(self, rank: int) -> None:
        info = _http(self._url, "/server_info", timeout=self._timeout, keys=self._keys)
        # enable_lora unset with --lora-paths given: SGLang turns LoRA on.
        if not (_setting(info, "enable_lora") or _setting(info, "lora_paths")):
            raise ValueError(
                f"the SGLang server {self._url} runs without LoRA: start it with --enable-lora "
                "(and --max-lora-rank, --lora-target-modules covering the adapter)"
            )
        most = _setting(info, "max_lora_rank")
        if isinstance(most, int) and rank > most:
            raise ValueError(
                f"the adapter's rank {rank} is above the SGLang server's max_lora_rank {most}: "
                "start it with a larger --max-lora-rank"
            )
        dp = _setting(info, "dp_size") or 1
        if dp != 1:
            raise ValueError(
                f"the SGLang server {self._url} runs {dp} data-parallel replicas: SGLang loads "
                "adapters at run time with one only (run one server per replica)"
            )

    def load(self, adapter: AdapterVersion) -> None:
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        _http(self._url, "/load_lora_adapter", body, self._timeout, self._keys)

    def unload(self, adapter: AdapterVersion) -> None:
        body = {"lora_name": adapter.name}
        _http(self._url, "/unload_lora_adapter", body, self._timeout, self._keys)


class LoraSync(AdapterSync):
    """An SGLang server's sampler of LoRA adapter versions (ADAPTER VERSION CONTRACT).

    ``server``: the server's URL; ``http_timeout``: the bound of each HTTP call (s);
    ``api_key`` / ``admin_api_key``: the server's keys where it has them. ``config`` /
    ``params`` / ``root`` / ``name`` / ``id_offset`` / ``keep`` and the
    :class:`~tpusync.rl.sampler.SamplerSync` keyword arguments (``control`` and ``replica`` are
    required): as :class:`~tpusync.rl.lora.AdapterSync`. Raises ValueError when the server
    cannot serve the adapter (module docstring), ConnectionError when it does not answer.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        params: Mapping[str, Any],
        *,
        server: str,
        root: str | Path | None = None,
        http_timeout: float = 60.0,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        **kwargs: Any,
    ) -> None:
        loader = _ServerLoader(server, http_timeout, _Keys(api_key, admin_api_key))
        super().__init__(config, params, loader=loader, root=root, **kwargs)
