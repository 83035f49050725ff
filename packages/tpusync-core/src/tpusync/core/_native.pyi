"""
tpusync native core (C++20): host block pools, block index, copy engine.
"""

from collections.abc import Sequence
import enum
from typing import Annotated, Any

from numpy.typing import NDArray


API_VERSION: int = 1

def checksum64(data: bytes, seed: int = 0) -> int:
    """XXH3-64 checksum of bytes (the checksum every stored block carries)."""

class BlockPool:
    """Fixed-size host blocks in one prefaulted pool (anonymous or /dev/shm)."""

    @staticmethod
    def create(block_bytes: int, num_blocks: int, shm_name: str = '', persist: bool = False, prefault: bool = True, huge_pages: bool = False, mlock: bool = False) -> BlockPool: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def block_stride(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def pool_bytes(self) -> int: ...

    @property
    def shm_name(self) -> str: ...

    @property
    def attached(self) -> bool: ...

    @property
    def huge_pages(self) -> bool: ...

    @property
    def locked(self) -> bool: ...

    @property
    def base_address(self) -> int: ...

    def stats(self) -> dict: ...

    def alloc(self, n: int) -> list[int]: ...

    def free(self, ids: Sequence[int]) -> None: ...

    def retain(self, ids: Sequence[int]) -> None: ...

    def claim(self, slot: int) -> int: ...

    def refcount(self, id: int) -> int: ...

    def address(self, id: int) -> int: ...

    @staticmethod
    def slot_of(id: int) -> int: ...

    def view(self, id: int, dtype: str = 'uint8', shape: Sequence[int] | None = None) -> NDArray:
        """
        A writable numpy array over the block's memory (no copy). The block's memory stays valid while the array lives, even if the block is freed.
        """

    def dlpack(self, id: int, dtype: str = 'uint8', shape: Sequence[int] | None = None) -> Any:
        """
        A DLPack-exporting array over the block (torch.from_dlpack, jax.dlpack.from_dlpack, np.from_dlpack take it without a copy).
        """

    def unlink(self) -> None:
        """
        Remove the /dev/shm name now; the mapping stays valid until the pool is closed.
        """

class Tier(enum.Enum):
    DEVICE = 0

    HOST = 1

    DISK = 2

    REMOTE = 3

class Placement:
    """Where one key lives: tiers, their locations, pin count."""

    @property
    def pins(self) -> int: ...

    @property
    def tier_mask(self) -> int: ...

    def has(self, tier: Tier) -> bool: ...

    @property
    def best(self) -> Tier | None:
        """The fastest tier holding the key."""

    def location(self, tier: Tier) -> int | None: ...

class BlockIndex:
    """Content-addressed index: engine block hash -> placement per tier."""

    def __init__(self) -> None: ...

    def insert(self, key: bytes, tier: Tier, location: int) -> None: ...

    def lookup(self, key: bytes, touch: bool = True) -> Placement | None: ...

    def lookup_prefix(self, keys: Sequence[bytes]) -> tuple[int, list[Placement]]:
        """Length of the leading run of indexed keys, and their placements."""

    def remove(self, key: bytes, tier: Tier) -> int: ...

    def erase(self, key: bytes) -> Placement: ...

    def pin(self, key: bytes) -> None: ...

    def unpin(self, key: bytes) -> None: ...

    def eviction_candidates(self, tier: Tier, n: int) -> list[tuple[bytes, int]]:
        """Up to n least-recently-used unpinned (key, location) pairs of a tier."""

    def count(self, tier: Tier) -> int: ...

    def __len__(self) -> int: ...

    def clear(self) -> None: ...

class Engine:
    """Worker threads that run copies while Python keeps computing."""

    def __init__(self, threads: int = 0) -> None: ...

    @property
    def num_threads(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

class Future:
    """Completion of an asynchronous tpusync operation."""

    def done(self) -> bool: ...

    def cancel(self) -> bool:
        """
        Cancel: a pending operation never starts; a running one stops between chunks.
        """

    def wait(self, timeout: float) -> bool:
        """
        Wait up to `timeout` seconds; True when complete (successfully or not).
        """

    def result(self, timeout: float | None = None) -> None:
        """
        Wait (default TPUSYNC_DEFAULT_TIMEOUT_S or 120 s), then raise the operation's error if it failed; TimeoutError if it is still running.
        """

    @property
    def state(self) -> str:
        """'pending', 'running', 'done', 'failed' or 'cancelled'."""

    def add_done_callback(self, fn: object) -> None:
        """Call fn(future) once complete, on an engine thread holding the GIL."""

def put_blocks(engine: Engine, pool: BlockPool, ids: Sequence[int], src: Annotated[NDArray, dict(device='cpu', writable=False)], rows: Sequence[int] | None = None) -> Future:
    """
    Copy block i of `src` (row rows[i] when given) into pool block ids[i] on the engine's threads.
    """

def get_blocks(engine: Engine, pool: BlockPool, ids: Sequence[int], dst: Annotated[NDArray, dict(device='cpu')], rows: Sequence[int] | None = None) -> Future:
    """
    Copy pool block ids[i] into block i of `dst` (row rows[i] when given) on the engine's threads.
    """

def copy(engine: Engine, dst: Annotated[NDArray, dict(device='cpu')], src: Annotated[NDArray, dict(device='cpu', writable=False)]) -> Future:
    """Copy all bytes of src into dst, split across the engine's threads."""

def memcpy_seconds(dst: Annotated[NDArray, dict(device='cpu')], src: Annotated[NDArray, dict(device='cpu', writable=False)]) -> float:
    """
    Seconds for one plain memcpy on the calling thread (benchmark reference).
    """
