"""HostBlockPool: the Python face of the native block pool and copy engine."""

from __future__ import annotations

import logging
import numbers
import operator
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpusync.core import _native

__all__ = ["HostBlockPool", "default_engine", "dtype_name", "reclaim_stale_segments"]

log = logging.getLogger(__name__)

_engine_lock = threading.Lock()
_engine: _native.Engine | None = None


def default_engine() -> _native.Engine:
    """The process-wide copy engine (threads: $TPUSYNC_ENGINE_THREADS, else one per CPU)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = _native.Engine(int(os.environ.get("TPUSYNC_ENGINE_THREADS", "0")))
        return _engine


def dtype_name(dtype: Any) -> str:
    """Normalise a numpy / torch / jax dtype (or its name) to tpusync's dtype name."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype)
    else:
        name = np.dtype(dtype).name
    return name.removeprefix("torch.")


def reclaim_stale_segments(prefix: str) -> list[tuple[str, int]]:
    """Unlink the ``/dev/shm/<prefix>*`` segments no live pool owns; returns ``[(name, bytes)]``.

    OWNER LOCK CONTRACT (``native/include/tpusync/memory/shm_reclaim.h``): a live pool holds a
    shared ``flock`` on its segment, which the kernel drops when its process dies, SIGKILL
    included. Callers that create non-persistent pools under a family of names (a P/D producer's
    ``tpusync-pd-``, an RL endpoint's ``tpusync-rl-``) call this first, so every crash costs RAM
    only until the next start instead of until reboot. Never pass the prefix of persistent
    (warm-restart) segments: their crashed owners hold no lock either. Logged at INFO when
    something was removed.
    """
    gone = _native.reclaim_stale_segments(prefix)
    if gone:
        log.info(
            "reclaimed %d /dev/shm segment(s), %.1f MiB, left by dead processes: %s",
            len(gone),
            sum(b for _n, b in gone) / 2**20,
            ", ".join(n for n, _b in gone),
        )
    return gone


class HostBlockPool:
    """Fixed-size blocks in one prefaulted host memory pool.

    Blocks are addressed by integer ids from :meth:`alloc`. :meth:`put` and :meth:`get` copy
    batches between caller arrays and blocks on the engine's threads (GIL released) and return a
    :class:`tpusync.core.Future`. :meth:`view` and :meth:`dlpack` expose a block without copying.

    With ``shm_name`` the pool lives in ``/dev/shm/<shm_name>`` and, with ``persist=True``,
    survives the process (a restarted process re-attaches it; see the tiered store for the
    verified warm-restart path). A non-persistent segment whose process was killed stays behind
    until :func:`reclaim_stale_segments` removes it.
    """

    def __init__(
        self,
        block_bytes: int,
        num_blocks: int,
        *,
        shm_name: str | None = None,
        persist: bool = False,
        prefault: bool = True,
        huge_pages: bool = False,
        mlock: bool = False,
        engine: _native.Engine | None = None,
    ) -> None:
        _counts("HostBlockPool", block_bytes=block_bytes, num_blocks=num_blocks)
        self._pool = _native.BlockPool.create(
            block_bytes,
            num_blocks,
            shm_name=shm_name or "",
            persist=persist,
            prefault=prefault,
            huge_pages=huge_pages,
            mlock=mlock,
        )
        self._engine = engine or default_engine()

    @property
    def native(self) -> _native.BlockPool:
        return self._pool

    @property
    def engine(self) -> _native.Engine:
        return self._engine

    @property
    def block_bytes(self) -> int:
        return self._pool.block_bytes

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    def stats(self) -> dict[str, int]:
        return self._pool.stats()

    def alloc(self, n: int) -> list[int]:
        """Allocate ``n`` blocks, all or none (PoolExhaustedError names sizes on failure)."""
        _counts("alloc", n=n)
        return self._pool.alloc(n)

    def free(self, ids: Sequence[int]) -> None:
        self._pool.free(_ids(ids))

    def retain(self, ids: Sequence[int]) -> None:
        self._pool.retain(_ids(ids))

    def refcount(self, block_id: int) -> int:
        return self._pool.refcount(block_id)

    def address(self, block_id: int) -> int:
        return self._pool.address(block_id)

    def borrow(self, ids: Sequence[int]) -> _native.BlockBorrow:
        """Borrow many blocks at once (all or none): their memory stays valid, even if freed,
        until the returned object's ``release()`` or collection. ``.slots`` gives each id's
        pool slot. For DMA issued outside the core (CUDA copy streams)."""
        return self._pool.borrow(_ids(ids))

    def view(self, block_id: int, dtype: Any = "uint8", shape: Sequence[int] | None = None):
        """A writable numpy array over one block (no copy)."""
        return self._pool.view(block_id, dtype_name(dtype), None if shape is None else list(shape))

    def dlpack(self, block_id: int, dtype: Any = "uint8", shape: Sequence[int] | None = None):
        """An object exporting ``__dlpack__`` over one block, for torch / jax / numpy (no copy)."""
        return self._pool.dlpack(
            block_id, dtype_name(dtype), None if shape is None else list(shape)
        )

    def put(
        self, ids: Sequence[int], src: Any, rows: Sequence[int] | None = None
    ) -> _native.Future:
        """Copy block ``i`` of ``src`` into pool block ``ids[i]``, asynchronously.

        ``src`` is n * block_bytes contiguous bytes or an array of shape [n, ...] with contiguous
        rows of block_bytes. With ``rows``, ``src`` has shape [num_rows, ...] (e.g. one layer of a
        block-major paged KV cache) and row ``rows[i]`` is saved into ``ids[i]``: a gather with
        no staging copy. Row indices are range-checked before any byte moves.
        """
        return _native.put_blocks(
            self._engine,
            self._pool,
            _ids(ids),
            _array(src, "src", False),
            None if rows is None else _ids(rows, "rows"),
        )

    def get(
        self, ids: Sequence[int], dst: Any, rows: Sequence[int] | None = None
    ) -> _native.Future:
        """Copy pool block ``ids[i]`` into block ``i`` (or row ``rows[i]``) of ``dst``."""
        return _native.get_blocks(
            self._engine,
            self._pool,
            _ids(ids),
            _writable(_array(dst, "dst", True)),
            None if rows is None else _ids(rows, "rows"),
        )

    def __repr__(self) -> str:
        return (
            f"HostBlockPool(block_bytes={self.block_bytes}, num_blocks={self.num_blocks}, "
            f"free={self.num_free}, shm={self._pool.shm_name or None!r})"
        )


def _array(buf: Any, what: str, writes: bool) -> Any:
    """``buf`` itself, unless it is plainly not an array (a list, bytes, a number...): refused
    by name instead of nanobind's list of signatures."""
    if isinstance(buf, list | tuple | dict | str | int | float | bool) or buf is None:
        raise TypeError(
            f"{what} must be an array (numpy, torch or JAX CPU array, or a HostBlockPool view), "
            f"got {type(buf).__name__}"
        )
    if writes and isinstance(buf, bytes):
        raise TypeError(f"{what} is bytes, which is read-only: a get writes into it")
    return buf


def _writable(dst: Any) -> Any:
    """``dst`` itself; a read-only numpy array is refused with the reason (nanobind's own error
    only lists the signatures it expected)."""
    if isinstance(dst, np.ndarray) and not dst.flags.writeable:
        raise TypeError("the destination array is read-only: a get writes into it")
    return dst


def _ids(ids: Sequence[int], what: str = "block ids") -> list[int]:
    """A list of ints from a sequence, or from an integer numpy array with no negative entry (a
    float array used to be truncated and a negative entry wrapped to 2**64 - 1, silently)."""
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{what} must be integers, got an array of {ids.dtype}")
        if ids.dtype.kind == "i" and ids.size and int(ids.min()) < 0:
            raise ValueError(f"{what} must be >= 0, got {int(ids.min())}")
        return ids.astype(np.uint64, copy=False).tolist()
    out = []
    for x in ids:  # ints, numpy / torch integer scalars
        if isinstance(x, bool) or not hasattr(x, "__index__"):
            raise TypeError(f"{what} must be integers, got {type(x).__name__}")
        out.append(operator.index(x))
    if out and min(out) < 0:
        raise ValueError(f"{what} must be >= 0, got {min(out)}")
    if out and max(out) >= 1 << 64:
        raise ValueError(f"{what} must be < 2**64, got {max(out)}")
    return out


def _counts(owner: str, **counts: int) -> None:
    """Refuses a count that is not an int >= 0, by name (nanobind's own error for a negative int
    only listed the signatures it expected)."""
    for name, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{owner}: {name} must be an int, got {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{owner}: {name} must be >= 0, got {v}")
