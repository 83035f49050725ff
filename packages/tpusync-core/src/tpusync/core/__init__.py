"""tpusync.core: the native core of tpusync.

Host block pools (prefaulted, optionally in /dev/shm), a content-addressed block index with pins
and LRU, and a copy engine whose futures let Python keep computing while bytes move.
"""

import atexit

from tpusync.core import _native
from tpusync.core._compat import require_api
from tpusync.core._native import (
    API_VERSION,
    BlockIndex,
    Checksum64Stream,
    Engine,
    Future,
    Placement,
    Tier,
    checksum64,
    copy_checksum64,
)
from tpusync.core.errors import (
    AlreadyExistsError,
    AuthError,
    CancelledError,
    CorruptionError,
    InternalError,
    InvalidArgumentError,
    NoSpaceError,
    NotFoundError,
    PoolExhaustedError,
    StateError,
    StorageIOError,
    TimeoutError,
    TpusyncError,
    UnavailableError,
    VersionMismatchError,
)
from tpusync.core.pool import HostBlockPool, default_engine, dtype_name, reclaim_stale_segments
from tpusync.core.store import KVStore, StoreFuture

__version__: str = _native.__version__

# EXIT GATE (engine_bindings.cc): at interpreter exit, engine workers stop entering Python and
# those inside (a done-callback that released the GIL) are waited for, at most 10 s, before
# the interpreter finalizes; a callback resuming during finalization aborted the process.
atexit.register(_native.close_exit_gate, 10.0)

__all__ = [
    "API_VERSION",
    "AlreadyExistsError",
    "AuthError",
    "BlockIndex",
    "CancelledError",
    "Checksum64Stream",
    "CorruptionError",
    "Engine",
    "Future",
    "HostBlockPool",
    "InternalError",
    "InvalidArgumentError",
    "KVStore",
    "NoSpaceError",
    "NotFoundError",
    "Placement",
    "PoolExhaustedError",
    "StateError",
    "StorageIOError",
    "StoreFuture",
    "Tier",
    "TimeoutError",
    "TpusyncError",
    "UnavailableError",
    "VersionMismatchError",
    "__version__",
    "checksum64",
    "copy_checksum64",
    "default_engine",
    "dtype_name",
    "reclaim_stale_segments",
    "require_api",
]
