"""Paged KV cache layouts and the content format of the host blocks they are saved into.

A :class:`KVLayout` names the axes of ONE layer's KV tensor (or each of its two tensors when K and
V are separate) and their logical sizes; the physical order comes from the tensor's strides, so
vLLM's stride-permuted HND view, a plain NHD tensor, a K/V-split ``[2, num_blocks, ...]`` tensor
and JAX's ``[kv_heads, num_pages, page_size, head_dim]`` page arrays are all described the same way.

HOST CONTENT CONTRACT: one host block holds ``layers_per_host_block`` consecutive layers of one
device block. Inside it, layer ``l % layers_per_host_block`` starts at ``(l % L) * layer_bytes``;
inside a layer, the pieces (the K tensor then the V tensor when separate; shards in ascending
shard-index order for a sharded JAX array) follow each other; inside a piece, the bytes of the
block's sub-array are stored in the tensor's MEMORY order (axes by decreasing stride). No bytes are
reordered element-wise, so producer and consumer must share the physical layout: the
:class:`BlockFormat` of both ends is compared field by field and a mismatch is refused with an
error naming the field (``block_size``, ``dtype``, ``memory_order``, ...).

Rejected alternative: a canonical element order (e.g. always [head, token, dim]) in host blocks.
It lets unlike layouts interoperate but costs an element-wise transpose on every copy; a format
check keeps every copy a plain run of memcpys (or DMA descriptors on an accelerator).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tpusync.core.errors import InvalidArgumentError
from tpusync.core.pool import dtype_name

__all__ = [
    "AXIS_NAMES",
    "KV_MODES",
    "BlockFormat",
    "KVLayout",
    "PieceGeometry",
    "check_format",
    "check_unshared",
]

AXIS_NAMES = ("kv", "block", "head", "token", "dim")
KV_MODES = ("axis", "fused", "separate", "single")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class KVLayout:
    """Logical layout of one layer of a paged KV cache.

    ``axes`` names each axis of a layer tensor in its shape order, from ``AXIS_NAMES``:
    ``block`` (size ``num_blocks``), ``token`` (``block_size`` tokens per block), ``head``
    (``num_kv_heads``; may be omitted when 1), ``dim`` (``head_dim``, or ``2 * head_dim`` when
    ``kv == "fused"``) and ``kv`` (size 2, only when ``kv == "axis"``).

    ``kv``: ``"axis"`` - K and V on a ``kv`` axis of one tensor (vLLM GPU ``[2, N, B, H, D]``);
    ``"fused"`` - K then V on the ``dim`` axis (vLLM CPU ``[N, H, B, 2 * D]``); ``"separate"`` -
    two tensors per layer, K then V (JAX page arrays); ``"single"`` - one tensor with no V (MLA).
    """

    axes: tuple[str, ...]
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv: str = "axis"

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.kv not in KV_MODES:
            raise InvalidArgumentError(f"KVLayout field 'kv': {self.kv!r} is not one of {KV_MODES}")
        bad = [a for a in self.axes if a not in AXIS_NAMES]
        if bad or len(set(self.axes)) != len(self.axes):
            raise InvalidArgumentError(
                f"KVLayout field 'axes': {self.axes} must be distinct names from {AXIS_NAMES}"
            )
        need = {"block", "token", "dim"} | ({"kv"} if self.kv == "axis" else set())
        if self.num_kv_heads != 1:
            need.add("head")
        missing = need - set(self.axes)
        if missing:
            raise InvalidArgumentError(
                f"KVLayout field 'axes': {self.axes} lacks {sorted(missing)}"
            )
        if "kv" in self.axes and self.kv != "axis":
            raise InvalidArgumentError(
                f"KVLayout field 'axes': a 'kv' axis needs kv='axis', not kv={self.kv!r}"
            )
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise InvalidArgumentError(f"KVLayout field {name!r} must be > 0")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def vllm_cpu(cls, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype):
        """vLLM's CPU layout: ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, K/V fused."""
        return cls(
            ("block", "head", "token", "dim"),
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            "fused",
        )

    @classmethod
    def nhd(cls, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype):
        """K/V split on the outer axis, NHD: ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
        return cls(
            ("kv", "block", "token", "head", "dim"),
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            "axis",
        )

    @classmethod
    def hnd(cls, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype):
        """K/V split on the outer axis, HND: ``[2, num_blocks, kv_heads, block_size, head_dim]``."""
        return cls(
            ("kv", "block", "head", "token", "dim"),
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            "axis",
        )

    @classmethod
    def jax_pages(cls, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype):
        """JAX paged attention: separate K and V arrays ``[kv_heads, num_pages, page_size, dim]``
        (the block axis inside the heads axis)."""
        return cls(
            ("head", "block", "token", "dim"),
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            "separate",
        )

    # -- derived -------------------------------------------------------------------------------
    @property
    def parts_per_layer(self) -> int:
        return 2 if self.kv == "separate" else 1

    @property
    def block_axis(self) -> int:
        return self.axes.index("block")

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    def axis_size(self, axis: str) -> int:
        return {
            "kv": 2,
            "block": self.num_blocks,
            "head": self.num_kv_heads,
            "token": self.block_size,
            "dim": self.head_dim * (2 if self.kv == "fused" else 1),
        }[axis]

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape of each layer tensor."""
        return tuple(self.axis_size(a) for a in self.axes)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (all parts)."""
        per_part = self.itemsize * int(np.prod(self.shape)) // self.num_blocks
        return per_part * self.parts_per_layer

    def check_tensor(self, shape: Sequence[int], dtype: Any, what: str) -> None:
        """Refuse a tensor whose shape or dtype disagrees with the layout (naming the field)."""
        if dtype_name(dtype) != self.dtype:
            raise InvalidArgumentError(
                f"{what}: dtype {dtype_name(dtype)} does not match the layout's field 'dtype' "
                f"({self.dtype})"
            )
        shape = tuple(int(s) for s in shape)
        if len(shape) != len(self.axes):
            raise InvalidArgumentError(
                f"{what}: shape {shape} has {len(shape)} axes but the layout's field 'axes' names "
                f"{len(self.axes)}: {self.axes}"
            )
        for axis, got in zip(self.axes, shape, strict=True):
            want = self.axis_size(axis)
            if got != want:
                field = {
                    "block": "num_blocks",
                    "token": "block_size",
                    "head": "num_kv_heads",
                    "dim": "head_dim",
                    "kv": "kv",
                }[axis]
                raise InvalidArgumentError(
                    f"{what}: axis {axis!r} has size {got} but the layout's field {field!r} "
                    f"implies {want}"
                )


@dataclass(frozen=True)
class PieceGeometry:
    """Where one device block of one tensor (piece) lives in that tensor's memory.

    ``run_offsets[j]`` (bytes, relative to the block's start in the tensor's region) and
    ``run_bytes`` describe the contiguous runs of the block's sub-array in memory order;
    block ``b`` starts at ``b * block_stride`` in the region.
    """

    run_offsets: np.ndarray
    run_bytes: int
    block_stride: int
    region_bytes: int
    memory_order: tuple[str, ...]

    @property
    def block_bytes(self) -> int:
        return int(self.run_offsets.size) * self.run_bytes

    @classmethod
    def of(
        cls,
        shape: Sequence[int],
        byte_strides: Sequence[int],
        itemsize: int,
        block_axis: int,
        axes: Sequence[str],
    ) -> PieceGeometry:
        """Runs of a block's sub-array, computed vectorised from the tensor's shape and strides."""
        shape = [int(s) for s in shape]
        strides = [int(s) for s in byte_strides]
        if any(s < 0 for s in strides):
            raise InvalidArgumentError(f"negative strides {tuple(strides)} are not supported")
        if any(n == 0 for n in shape):
            raise InvalidArgumentError(f"empty tensor of shape {tuple(shape)}")
        region = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + itemsize
        inner = [d for d in range(len(shape)) if d != block_axis and shape[d] > 1]
        inner.sort(key=lambda d: -strides[d])
        if any(strides[d] == 0 for d in inner) or (
            shape[block_axis] > 1 and not strides[block_axis]
        ):
            raise InvalidArgumentError(f"broadcast (zero) strides {tuple(strides)} in a KV tensor")
        # SIZE-1 AXES: their stride is arbitrary (torch and numpy / JAX pick different ones for
        # the same bytes), so they are left out of the memory order; two caches that differed
        # only there had unequal formats (a P/D refusal, a store miss). The block axis stays.
        kept = [d for d in range(len(shape)) if shape[d] > 1 or d == block_axis]
        order = tuple(axes[d] for d in sorted(kept, key=lambda d: -strides[d]))
        # Merge the innermost axes while they are contiguous.
        run = itemsize
        k = len(inner)
        while k > 0 and strides[inner[k - 1]] == run:
            run *= shape[inner[k - 1]]
            k -= 1
        offsets = np.zeros(1, dtype=np.uint64)
        for d in reversed(inner[:k]):
            step = np.arange(shape[d], dtype=np.uint64) * np.uint64(strides[d])
            offsets = (step[:, None] + offsets[None, :]).reshape(-1)
        # Overlapping runs would mean the tensor aliases itself (e.g. as_strided tricks).
        if offsets.size > 1:
            srt = np.sort(offsets)
            if np.any(np.diff(srt) < run):
                raise InvalidArgumentError(f"tensor strides {tuple(strides)} make a block overlap")
        _check_blocks_apart(shape, strides, itemsize, block_axis, offsets, run)
        return cls(offsets, run, strides[block_axis], region, order)


_MAX_CHECKED_RUNS = 1 << 24


def _check_blocks_apart(shape, strides, itemsize, block_axis, offsets, run) -> None:
    """BLOCKS APART RULE: no two blocks of a tensor share a byte, or a load into one block would
    change another (a cache made with as_strided, whose block stride is shorter than a block).
    Every layout a framework makes passes the quick test: sorted by stride, each axis steps past
    everything the smaller-stride axes reach (dense, padded and permuted tensors alike). Other
    strides get the exact test, every run of every block sorted (bounded by _MAX_CHECKED_RUNS)."""
    axes = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: strides[d])
    reach = itemsize
    for d in axes:
        if strides[d] < reach:
            break
        reach += (shape[d] - 1) * strides[d]
    else:
        return
    n = shape[block_axis]
    if n * offsets.size > _MAX_CHECKED_RUNS:
        raise InvalidArgumentError(
            f"tensor strides {tuple(strides)} interleave blocks in a way too large to check "
            f"for overlap ({n} blocks x {offsets.size} runs); use a dense or permuted tensor"
        )
    starts = np.sort(
        (np.arange(n, dtype=np.uint64)[:, None] * np.uint64(strides[block_axis]) + offsets).reshape(
            -1
        )
    )
    if np.any(np.diff(starts) < run):
        raise InvalidArgumentError(
            f"tensor strides {tuple(strides)} make blocks overlap: a load into one block would "
            "change another"
        )


def check_unshared(starts: Sequence[tuple[int, str]]) -> None:
    """ALIAS RULE: cache parts written in place must not share memory. ``starts`` holds each
    part's (or shard's) first-element address and its name; two that start at the same byte are
    refused (e.g. one zeros array passed as K and V of every layer: a load into one layer would
    change them all). Parts that merely interleave (K and V as strided views of one tensor) start
    at different bytes and pass."""
    seen: dict[int, str] = {}
    for addr, what in starts:
        if addr in seen:
            raise InvalidArgumentError(
                f"{what} is the same memory as {seen[addr]}: every layer's K and V need their own "
                "tensors or arrays, or a load into one would change the other"
            )
        seen[addr] = what


def split_layers(
    kv_caches: Sequence[Any] | Mapping[str, Any], layout: KVLayout, is_part: Any, noun: str
) -> tuple[list[str], list[list[Any]]]:
    """Layer names and per-layer parts of an engine's caches, checked against ``layout``.

    ``kv_caches`` is a sequence or a name -> entry mapping; an entry is one tensor / array
    (``is_part(entry)``) or a sequence of them (K and V). The count of parts and every part's
    shape and dtype are checked here, once for both frameworks.
    """
    if isinstance(kv_caches, Mapping):
        names = [str(n) for n in kv_caches]
        entries = list(kv_caches.values())
    else:
        entries = list(kv_caches)
        names = [str(i) for i in range(len(entries))]
    if not entries:
        raise InvalidArgumentError("kv_caches is empty")
    layers = []
    for name, e in zip(names, entries, strict=True):
        parts = [e] if is_part(e) else list(e)
        if len(parts) != layout.parts_per_layer:
            raise InvalidArgumentError(
                f"layer {name}: {len(parts)} {noun}(s) but layout field 'kv' = "
                f"{layout.kv!r} needs {layout.parts_per_layer}"
            )
        for p in parts:
            layout.check_tensor(p.shape, p.dtype, f"layer {name}")
        layers.append(parts)
    return names, layers


def _itemsize(dtype: str) -> int:
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "bool": 1}
    if dtype in sizes:
        return sizes[dtype]
    if dtype.startswith("float8"):
        return 1
    try:
        return np.dtype(dtype).itemsize
    except TypeError as e:
        raise InvalidArgumentError(f"unsupported KV dtype {dtype!r}") from e


@dataclass(frozen=True)
class BlockFormat:
    """Everything both ends of a transfer must agree on about a host block's bytes."""

    dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv: str
    memory_order: tuple[tuple[str, ...], ...]
    num_layers: int
    layers_per_host_block: int
    layer_block_bytes: int
    host_block_bytes: int
    shards: tuple[str, ...] = ()
    version: int = FORMAT_VERSION

    @classmethod
    def of_layout(
        cls,
        layout: KVLayout,
        memory_order: tuple[tuple[str, ...], ...],
        num_layers: int,
        layers_per_host_block: int,
        shards: tuple[str, ...] = (),
    ) -> BlockFormat:
        """The format of host blocks that pack ``layers_per_host_block`` layers of ``layout`` (of
        ``num_layers``, each part in ``memory_order``); refuses a group size outside
        [1, num_layers]."""
        if not 1 <= layers_per_host_block <= num_layers:
            raise InvalidArgumentError(
                f"layers_per_host_block must be in [1, {num_layers}], got {layers_per_host_block}"
            )
        return cls(
            dtype=layout.dtype,
            block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            kv=layout.kv,
            memory_order=memory_order,
            num_layers=num_layers,
            layers_per_host_block=layers_per_host_block,
            layer_block_bytes=layout.layer_block_bytes,
            host_block_bytes=layout.layer_block_bytes * layers_per_host_block,
            shards=shards,
        )

    @property
    def num_groups(self) -> int:
        """Host blocks per device block (one per group of ``layers_per_host_block`` layers)."""
        return -(-self.num_layers // self.layers_per_host_block)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory_order"] = [list(o) for o in self.memory_order]
        d["shards"] = list(self.shards)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockFormat:
        d = dict(d)
        d["memory_order"] = tuple(tuple(o) for o in d["memory_order"])
        d["shards"] = tuple(d.get("shards", ()))
        return cls(**d)

    @property
    def fingerprint(self) -> str:
        """16 hex digits over the canonical JSON of every field."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def check_format(mine: BlockFormat, theirs: BlockFormat | Mapping[str, Any], peer: str) -> None:
    """Raise InvalidArgumentError naming every field on which ``theirs`` differs from ``mine``."""
    if not isinstance(theirs, BlockFormat):
        try:
            theirs = BlockFormat.from_dict(theirs)
        except (KeyError, TypeError) as e:
            raise InvalidArgumentError(f"{peer} sent an unreadable KV block format: {e}") from e
    a, b = mine.to_dict(), theirs.to_dict()
    diffs = [k for k in a if a[k] != b.get(k)]
    if diffs:
        detail = "; ".join(f"field {k!r}: here {a[k]!r}, {peer} {b.get(k)!r}" for k in diffs)
        raise InvalidArgumentError(f"KV block format mismatch with {peer}: {detail}")
