"""Hooks the tpusync P/D backend into SGLang 0.5.23 through its general plugin mechanism.

SGLang's transfer backend is a closed Enum (``sglang.srt.disaggregation.utils.TransferBackend``)
mapped to classes by an if/elif chain in ``get_kv_class``, so an out-of-tree backend cannot be
named on the command line without help. tpusync-sglang declares an entry point in SGLang's
``sglang.srt.plugins`` group; SGLang's ``load_plugins()`` runs :func:`register` early in every
SGLang process (engine, scheduler, detokenizer, DP controller), which:

1. adds ``"tpusync"`` to ``DISAGG_TRANSFER_BACKEND_CHOICES`` (the argument parser's choices);
2. replaces ``TransferBackend`` with an Enum holding every existing member (same values) plus
   ``TPUSYNC = "tpusync"``, through ``HookRegistry`` class REPLACE (which also re-binds the name
   in modules that imported it). FRAGILE: a module that captured an old *member* before plugins
   loaded compares unequal to the new one; SGLang's own comparisons go through the class;
3. wraps ``get_kv_class`` (AROUND): for ``tpusync`` it returns the classes of
   :mod:`tpusync.sglang.pd`; anything else goes to SGLang's original.

``register`` is idempotent; ``install_now()`` applies the hooks at once (for processes that do not
call ``load_plugins``, e.g. tests). See docs/sglang.md for the upstream proposal that would make
all of this a two-line config.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

logger = logging.getLogger(__name__)

BACKEND = "tpusync"
_registered = False


def _extended_enum(original: type[enum.Enum]) -> type[enum.Enum]:
    if any(m.value == BACKEND for m in original):
        return original
    members = {m.name: m.value for m in original}
    members["TPUSYNC"] = BACKEND
    extended = enum.Enum(original.__name__, members, module=original.__module__)
    extended.__qualname__ = original.__qualname__
    return extended


def _get_kv_class_around(original_fn: Any, transfer_backend: Any, class_type: Any) -> Any:
    value = getattr(transfer_backend, "value", transfer_backend)
    if value != BACKEND:
        return original_fn(transfer_backend, class_type)
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType
    from tpusync.sglang import pd

    mapping = {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: pd.TpusyncKVManager,
        KVClassType.SENDER: pd.TpusyncKVSender,
        KVClassType.RECEIVER: pd.TpusyncKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: pd.TpusyncKVBootstrapServer,
    }
    return mapping.get(class_type)


def register() -> None:
    """Entry point of group ``sglang.srt.plugins``: register the hooks (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.DISAGG_TRANSFER_BACKEND_CHOICES.append(BACKEND)
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.TransferBackend",
        _extended_enum(utils.TransferBackend),
        HookType.REPLACE,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class_around, HookType.AROUND
    )
    _registered = True
    logger.info("tpusync P/D transfer backend registered as %r", BACKEND)


def install_now() -> None:
    """Register and apply the hooks in this process (what ``load_plugins()`` does)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()
