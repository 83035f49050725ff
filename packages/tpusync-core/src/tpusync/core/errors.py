"""Exceptions raised by tpusync.

Every native error carries a status code; each code maps to exactly one class below, and each class
also derives from the closest Python builtin, so ``except MemoryError`` or ``except TimeoutError``
work as a Python user expects while ``except tpusync.core.TpusyncError`` catches them all.
"""

from __future__ import annotations

import builtins

__all__ = [
    "AlreadyExistsError",
    "AuthError",
    "CancelledError",
    "CorruptionError",
    "InternalError",
    "InvalidArgumentError",
    "NoSpaceError",
    "NotFoundError",
    "PoolExhaustedError",
    "StateError",
    "StorageIOError",
    "TimeoutError",
    "TpusyncError",
    "UnavailableError",
    "VersionMismatchError",
    "error_class",
]


class TpusyncError(Exception):
    """Base class of every tpusync error."""


class InvalidArgumentError(TpusyncError, ValueError):
    """The caller passed something malformed (shape, dtype, id, size, key)."""


class PoolExhaustedError(TpusyncError, MemoryError):
    """A fixed-capacity pool or tier cannot hold the request; nothing was changed."""


class NotFoundError(TpusyncError, LookupError):
    """A key or id is unknown."""


class AlreadyExistsError(TpusyncError):
    """A key, name or slot is already taken."""


class StateError(TpusyncError, RuntimeError):
    """The object is in the wrong state (freed block, stale id, unbalanced unpin, closed store)."""


class TimeoutError(TpusyncError, builtins.TimeoutError):  # noqa: A001 - deliberate shadowing
    """A wait ran past its deadline; the operation may still complete later."""


class CancelledError(TpusyncError):
    """The operation was cancelled."""


class StorageIOError(TpusyncError, OSError):
    """The operating system refused an I/O call (errno in the message)."""


class NoSpaceError(StorageIOError):
    """A storage tier ran out of space (ENOSPC / EDQUOT)."""


class CorruptionError(TpusyncError):
    """A checksum or header did not match; the data was not used."""


class UnavailableError(TpusyncError, ConnectionError):
    """A peer is dead or unreachable."""


class AuthError(TpusyncError, PermissionError):
    """Authentication failed or access was refused."""


class VersionMismatchError(TpusyncError):
    """Incompatible wire, on-disk or API version."""


class InternalError(TpusyncError):
    """A broken invariant inside tpusync: please report it."""


_BY_CODE: dict[str, type[TpusyncError]] = {
    "InvalidArgument": InvalidArgumentError,
    "PoolExhausted": PoolExhaustedError,
    "NotFound": NotFoundError,
    "AlreadyExists": AlreadyExistsError,
    "FailedPrecondition": StateError,
    "Timeout": TimeoutError,
    "Cancelled": CancelledError,
    "IOError": StorageIOError,
    "NoSpace": NoSpaceError,
    "Corrupted": CorruptionError,
    "Unavailable": UnavailableError,
    "PermissionDenied": AuthError,
    "VersionMismatch": VersionMismatchError,
    "Internal": InternalError,
}


def error_class(code_name: str) -> type[TpusyncError]:
    """The exception class for a native status code name (used by the bindings)."""
    return _BY_CODE.get(code_name, InternalError)
