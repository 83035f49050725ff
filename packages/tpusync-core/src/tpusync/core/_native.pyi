"""
tpusync native core (C++20): host block pools, block index, copy engine.
"""

from collections.abc import Sequence
import enum
from typing import Annotated, Any, overload

import numpy
from numpy.typing import NDArray


API_VERSION: int = 15

@overload
def checksum64(data: bytes, seed: int = 0) -> int:
    """XXH3-64 checksum of bytes (the checksum every stored block carries)."""

@overload
def checksum64(data: Annotated[NDArray, dict(order='C', device='cpu', writable=False)], seed: int = 0) -> int:
    """XXH3-64 checksum of a C-contiguous host array's bytes, without a copy."""

def copy_checksum64(dst: Annotated[NDArray, dict(device='cpu')], src: Annotated[NDArray, dict(device='cpu', writable=False)], seed: int = 0) -> int:
    """
    Copy src's bytes into dst and return their XXH3-64 (== checksum64(src, seed)) in one pass over memory. Both C-contiguous host arrays of the same byte size, any dtypes; InvalidArgumentError otherwise.
    """

class Checksum64Stream:
    """
    XXH3-64 of bytes that come in pieces: update / copy_update with consecutive pieces, then digest() == checksum64(all pieces joined, seed). Not thread-safe: one per thread.
    """

    def __init__(self, seed: int = 0) -> None: ...

    def reset(self, seed: int = 0) -> None:
        """Start a new digest with this seed."""

    def update(self, data: Annotated[NDArray, dict(device='cpu', writable=False)]) -> None:
        """Hash the next piece (a C-contiguous host array's bytes)."""

    def copy_update(self, dst: Annotated[NDArray, dict(device='cpu')], src: Annotated[NDArray, dict(device='cpu', writable=False)], *, keep_in_cache: bool = False) -> None:
        """
        Copy the next piece from src into dst and hash its bytes (in C order) in the same pass. Host arrays of the same byte size, any dtypes; both C-contiguous, or one of them strided with a contiguous innermost dimension (a gather into / scatter out of the other); InvalidArgumentError otherwise. Large copies bypass the cache (non-temporal stores) unless keep_in_cache: then dst stays cached for a reader that comes right after.
        """

    def cast_update(self, dst: Annotated[NDArray, dict(device='cpu')], src: Annotated[NDArray, dict(device='cpu', writable=False)]) -> None:
        """
        Hash the next piece (src: float32 host values, its bytes in C order) and write it into dst as bfloat16 or float16 (dst's dtype; uint16 means bfloat16 bits) in the same pass: round to nearest even like torch's tensor.to(dst dtype) for every non-NaN value; NaN becomes 0x7FC0 (bfloat16) or sign | 0x7E00 (float16). dst is a host array with as many values; both C-contiguous, or one of them strided with a contiguous innermost dimension; InvalidArgumentError otherwise.
        """

    def digest(self) -> int:
        """The digest of every piece so far (the state stays usable)."""

class BlockBorrow:
    """Borrows of a batch of blocks (memory kept valid until release())."""

    @property
    def active(self) -> bool: ...

    @property
    def slots(self) -> list[int]:
        """Pool slot of each id, in the given order."""

    def __len__(self) -> int: ...

    def release(self) -> None:
        """End the borrows now (idempotent)."""

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

    def wait_huge_pages(self, timeout: float = 60.0) -> bool:
        """
        Waits up to `timeout` s for a /dev/shm pool's background huge-page collapse; True when none is running.
        """

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

    def borrow(self, ids: Sequence[int]) -> BlockBorrow:
        """
        Borrow every block of ``ids`` at once (unknown, stale or freed ids raise, none borrowed); the memory stays valid until the returned BlockBorrow is released.
        """

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

def reclaim_stale_segments(prefix: str) -> list[tuple[str, int]]:
    """
    Unlink every /dev/shm/<prefix>* segment that no live pool owns (its owner was destroyed or its process died, e.g. by SIGKILL) and return [(name, bytes)] of what was removed. Only for prefixes of non-persistent pools: a persistent warm-restart segment has no live owner either. InvalidArgumentError for a prefix under 8 characters or with characters outside letters, digits, '-', '_' and '.'.
    """

def shm_segments(prefix: str) -> list[tuple[str, int, bool]]:
    """
    [(name, bytes, owned)] of every /dev/shm/<prefix>* segment, in name order; owned: a live pool holds it. Removes nothing. Same prefix rules as reclaim_stale_segments.
    """

class Tier(enum.Enum):
    DEVICE = 0

    HOST = 1

    DISK = 2

    REMOTE = 3

class Recency(enum.Enum):
    """
    Recency mode of a BlockIndex: EXACT_LRU relinks on every touch; CLOCK sets a reference bit and relinks at eviction (second chance).
    """

    EXACT_LRU = 0

    CLOCK = 1

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

    def __init__(self, recency: Recency = Recency.CLOCK) -> None: ...

    @property
    def recency(self) -> Recency: ...

    def insert(self, key: bytes, tier: Tier, location: int) -> None: ...

    def insert_many(self, keys: Annotated[NDArray[numpy.uint8], dict(shape=(None, None), order='C', device='cpu', writable=False)], tier: Tier, first_location: int) -> None:
        """
        Insert row i of a [n, key_bytes] C-contiguous uint8 array at location first_location + i (bulk registration; stops at the first error).
        """

    def lookup(self, key: bytes, touch: bool = True) -> Placement | None: ...

    def lookup_prefix(self, keys: Sequence[bytes]) -> tuple[int, list[Placement]]:
        """Length of the leading run of indexed keys, and their placements."""

    def lookup_prefix_array(self, keys: Annotated[NDArray[numpy.uint8], dict(shape=(None, None), order='C', device='cpu', writable=False)]) -> int:
        """
        Length of the leading run of indexed keys among the rows of a [n, key_bytes] C-contiguous uint8 array (touching them); no per-key Python objects, placements not returned.
        """

    def reserve(self, keys: int) -> None:
        """Size the hash table for this many keys (no rehash up to it)."""

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

def put_segments(engine: Engine, pool: BlockPool, ids: Sequence[int], regions: Sequence[Annotated[NDArray, dict(device='cpu', writable=False)]], segments: Annotated[NDArray[numpy.uint64], dict(shape=(None, None), order='C', device='cpu', writable=False)]) -> Future:
    """
    Gather: for each row (block, block_offset, region, region_offset, bytes) of the uint64 [n, 5] `segments`, copy bytes of regions[region] into pool block ids[block]. Every bound is checked before any byte moves.
    """

def get_segments(engine: Engine, pool: BlockPool, ids: Sequence[int], regions: Sequence[Annotated[NDArray, dict(device='cpu')]], segments: Annotated[NDArray[numpy.uint64], dict(shape=(None, None), order='C', device='cpu', writable=False)]) -> Future:
    """
    Scatter: the inverse of put_segments (pool block bytes into the regions).
    """

def copy(engine: Engine, dst: Annotated[NDArray, dict(device='cpu')], src: Annotated[NDArray, dict(device='cpu', writable=False)]) -> Future:
    """Copy all bytes of src into dst, split across the engine's threads."""

def memcpy_seconds(dst: Annotated[NDArray, dict(device='cpu')], src: Annotated[NDArray, dict(device='cpu', writable=False)]) -> float:
    """
    Seconds for one plain memcpy on the calling thread (benchmark reference).
    """

def close_exit_gate(timeout: float) -> bool:
    """
    EXIT GATE (interpreter exit; tpusync.core's atexit hook): from now on engine workers run no Python (done-callbacks are dropped); waits up to `timeout` s for those inside Python to leave. True when none is left.
    """

class KVStoreNative:
    """Tiered KV block store (use tpusync.core.KVStore, the Python face)."""

    @staticmethod
    def open(engine: Engine, block_bytes: int, host_blocks: int, name_space: str = '', fingerprint: str = '', disk_dir: str = '', disk_blocks: int = 0, disk_segment_blocks: int = 0, disk_direct_io: bool = True, io_backend: str = 'auto', io_threads: int = 4, policy: str = 'lru', writeback_batch: int = 32, writeback_headroom: int = 0, put_wait_s: float = 5.0, prefault: bool = True, huge_pages: bool = False, write_through: bool = False, index_recency: Recency = Recency.CLOCK, disk_checkpoint_s: float = 60.0, disk_checkpoint_writes: int = 65536, disk_manifest_progressive_write_back: bool = True) -> KVStoreNative: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def index_recency(self) -> Recency:
        """Recency mode of the store's index (CLOCK or EXACT_LRU)."""

    def put(self, keys: Sequence[bytes], src: Annotated[NDArray, dict(device='cpu', writable=False)], rows: Sequence[int] | None = None) -> tuple[object, object]:
        """
        (future, stored mask): mask[i] is 1 once keys[i] is stored (read it after the future).
        """

    def get(self, keys: Sequence[bytes], dst: Annotated[NDArray, dict(device='cpu')], rows: Sequence[int] | None = None) -> tuple[object, object]:
        """(future, found mask): mask[i] is 1 when keys[i] was read and verified."""

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[Tier]]:
        """(length of the leading run of stored keys, fastest tier of each)"""

    def pin(self, keys: Sequence[bytes]) -> None: ...

    def unpin(self, keys: Sequence[bytes]) -> None: ...

    def remove(self, keys: Sequence[bytes]) -> int: ...

    def clear(self) -> None: ...

    def flush(self, timeout: float) -> None: ...

    def checkpoint(self) -> None:
        """
        Write a checkpoint of every tier now (disk: manifest + new journal generation).
        """

    def stats(self) -> dict: ...

    def enable_events(self, capacity: int) -> None:
        """Record placement changes (capacity > 0: queue bound; 0: off)."""

    def take_events(self, max: int = 65536) -> tuple:
        """
        ([(kind, tier, key)], events dropped since the last call); kind is 'stored', 'removed' or 'cleared'.
        """

class PdProducer:
    """
    P/D producer: serves registered pool blocks to authenticated consumers.
    """

    @staticmethod
    def start(pool: BlockPool, secret: bytes, listen: str = '127.0.0.1:0', unix_path: str = '', handshake_timeout: float = 5.0, socket_buffer_bytes: int = 0) -> PdProducer: ...

    @property
    def address(self) -> str: ...

    @property
    def unix_address(self) -> str: ...

    @property
    def pending(self) -> int: ...

    def register_send(self, request_id: int, blocks: Sequence[int], deadline: float, blocks_per_group: int = 0, checksums: Sequence[int] = []) -> None: ...

    def register_relay(self, request_id: int, num_blocks: int, deadline: float, blocks_per_group: int = 0) -> None: ...

    def open(self, request_id: int, first: int, blocks: Sequence[int], checksums: Sequence[int]) -> None: ...

    def cancel(self, request_id: int, reason: str) -> None: ...

    def poll(self) -> list: ...

    def stop(self) -> None: ...

class PdConsumer:
    """P/D consumer: pulls registered blocks into its own pool blocks."""

    @staticmethod
    def create(pool: BlockPool, secret: bytes, streams: int = 4, connect_timeout: float = 5.0, socket_buffer_bytes: int = 0, small_pull_bytes: int = 262144, abandon_timeout: float = 2.0) -> PdConsumer: ...

    def recv(self, request_id: int, sources: Sequence[tuple[str, Sequence[int]]], deadline: float, readers: Sequence[int] = []) -> dict: ...

    def start_recv(self, request_id: int, sources: Sequence[tuple[str, Sequence[int]]], deadline: float, readers: Sequence[int] = [], relay: PdProducer | None = None, relay_ids: Sequence[int] = []) -> None: ...

    def abandon(self, request_id: int, reason: str) -> list: ...

    def poll(self) -> list: ...

    def wait(self, request_id: int, groups: int, timeout: float) -> dict: ...

    @property
    def idle_links(self) -> int: ...

class StoreNode:
    """A distributed prefix cache node (put/get/lookup)."""

    @staticmethod
    def start(secret: bytes, listen: str = '127.0.0.1:0', capacity_bytes: int = 1073741824, block_bytes: int = 262144, disk_dir: str = '', disk_capacity_bytes: int = 0, name_space: str = '', fingerprint: str = '') -> StoreNode: ...

    @property
    def address(self) -> str: ...

    @property
    def cold_start_reason(self) -> str: ...

    @property
    def block_bytes(self) -> int: ...

    def stats(self) -> dict: ...

    def stop(self) -> None: ...

class StoreClient:
    """Client of several store nodes: rendezvous hashing, replicas."""

    @staticmethod
    def create(pool: BlockPool, secret: bytes, nodes: Sequence[str], replication: int = 1, timeout: float = 10.0) -> StoreClient: ...

    def rank(self, key: bytes) -> list[int]: ...

    def put(self, keys: Sequence[bytes], blocks: Sequence[int]) -> list[int]: ...

    def get(self, keys: Sequence[bytes], dst: Sequence[int]) -> list[bool]: ...

    def lookup_prefix(self, keys: Sequence[bytes], lease: float = 0.0) -> int: ...

    def remove(self, keys: Sequence[bytes]) -> list[bool]: ...

    def check_nodes(self) -> None: ...

def open_remote_kv_store(engine: Engine, block_bytes: int, host_blocks: int, nodes: Sequence[str], secret: bytes, disk_dir: str = '', disk_blocks: int = 0, disk_segment_blocks: int = 0, disk_direct_io: bool = True, io_backend: str = 'auto', io_threads: int = 4, policy: str = 'lru', writeback_batch: int = 32, writeback_headroom: int = 0, put_wait_s: float = 5.0, prefault: bool = True, huge_pages: bool = False, name_space: str = '', fingerprint: str = '', replicas: int = 1, remote_blocks: int = 65536, lease: float = 10.0, timeout: float = 10.0, write_through: bool = False, index_recency: Recency = Recency.CLOCK, disk_checkpoint_s: float = 60.0, disk_checkpoint_writes: int = 65536, disk_manifest_progressive_write_back: bool = True) -> KVStoreNative:
    """
    A KVStore over host [-> disk] -> store nodes (host demotes to disk first, then remote).
    """
