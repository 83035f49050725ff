"""API-version gate used by every framework package at import time."""

from __future__ import annotations

from tpusync.core._native import API_VERSION, __version__


def require_api(minimum: int, package: str) -> None:
    """Raise ImportError unless the installed core offers API version ``minimum`` or later.

    Framework wheels call this first thing, so a mismatched install fails at import with the fix
    spelled out, not later with an AttributeError deep inside a serving engine.
    """
    if API_VERSION < minimum:
        raise ImportError(
            f"{package} needs tpusync-core with API version >= {minimum}, but the installed "
            f"tpusync-core {__version__} has API version {API_VERSION}; upgrade it with "
            f"`pip install -U tpusync-core` (or install matching versions of both)."
        )
