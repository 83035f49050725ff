"""Publisher and subscriber cores: chunking, digests, staging and atomic commit.

These classes are transport-agnostic: a publisher yields :class:`Chunk` objects for each
destination rank, a subscriber accepts them in any order. The network path that carries chunks
between processes (bucketed, pipelined, fanned out) sits on top.

COMMIT CONTRACT: a subscriber serves exactly one committed version at a time. In ``shadow`` mode
chunks land in shadow copies and :meth:`WeightSubscriber.commit` swaps them in at once, so a
reader of :attr:`WeightSubscriber.weights` sees either the whole old version or the whole new one.
In ``inplace`` mode (memory is short) chunks are written into the live tensors, which is only
allowed while the caller has declared the engine paused (:meth:`WeightSubscriber.paused`); an
update that fails half-way then leaves the subscriber marked ``dirty`` until a full update lands.

DIGEST CONTRACT: every chunk carries the XXH3-64 of its bytes in the trainer's dtype, computed by
the sender and re-computed by the subscriber before anything is written; one mismatch rejects the
whole update (nothing is committed) and is logged. A chunk whose ``digest`` is None was already
verified end to end: the network path checks each block against the checksum the trainer took
when it filled the block (:mod:`tpusync.rl.pack`, BLOCK CHECKSUM CONTRACT).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tpusync.core import Checksum64Stream, checksum64
from tpusync.rl.layout import Box, ShardLayout
from tpusync.rl.manifest import Manifest, TensorMeta
from tpusync.rl.plan import ReshardPlan, Transfer
from tpusync.rl.reports import listed

log = logging.getLogger("tpusync.rl")

# Staging casts the core does in the hash pass (Checksum64Stream.cast_update): float32 -> these.
_FUSED_CASTS = (torch.bfloat16, torch.float16)


class VersionSkewError(RuntimeError):
    """An update's version does not follow the subscriber's version (or delta base)."""


class UpdateRejectedError(RuntimeError):
    """The update cannot be committed (digest mismatch, missing chunks, bad chunk)."""


@dataclass(frozen=True)
class Chunk:
    version: int
    name: str  # trainer name
    src_rank: int
    dst_rank: int
    box: Box
    dtype: str  # trainer dtype of `data`
    data: np.ndarray  # uint8, box.size * itemsize bytes, C-contiguous
    digest: int | None  # None: verified upstream (the network path's block checksum)


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _dtype_name(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name


def _as_torch(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.from_dlpack(x) if hasattr(x, "__dlpack__") else torch.as_tensor(np.asarray(x))


def _one(local: Any) -> Any:
    """One shard of ``local`` (a shard, or ``{rank: shard}``: the smallest rank's)."""
    return local[min(local)] if isinstance(local, Mapping) else local


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor (any dtype, bf16 included) as a contiguous uint8 array."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8).numpy()


# CHUNK DELTA CONTRACT: a delta chunk of a tensor is a run of ``chunk_rows`` consecutive rows
# (dim-0 indices) of the GLOBAL tensor, ``chunk_rows = max(1, chunk_bytes // bytes per row)``
# (``WeightPublisher.chunk_bytes``; :class:`tpusync.rl.trainer.TrainerSync` uses its block size, so
# a changed chunk is about one host block on the wire). Chunk ``c`` covers rows
# ``[c * chunk_rows, (c + 1) * chunk_rows)``; each local shard is digested per chunk on the rows
# it holds (a contiguous row slice of the shard: hashed in place, no copy). A delta names the
# changed rows as sorted, disjoint runs of global rows (``Manifest.rows``), so the changed sets of
# several trainer ranks unite by plain row union whatever their shardings or chunk sizes, and a
# run maps to sampler boxes through the ordinary reshard plan (each transfer cut to the runs).
# 0-d tensors are one chunk. Rejected: chunks as packed host blocks (a block's content depends on
# the packing of one stream, i.e. on both layouts and on what else changed, so neither the ranks
# nor two versions would agree on what a block holds), and chunks in flat element order (a
# column-sharded shard's flat span is strided in the global tensor).
DELTA_CHUNK_BYTES = 4 << 20


def chunk_rows(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> int:
    """Rows per delta chunk of a tensor of global ``shape`` (0 for a 0-d tensor: one chunk)."""
    if not shape:
        return 0
    row = itemsize
    for n in shape[1:]:
        row *= n
    return max(1, chunk_bytes // max(row, 1))


def merge_runs(runs: Collection[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint row runs covering the union of ``runs`` (touching runs are joined)."""
    out: list[list[int]] = []
    for r0, r1 in sorted((int(a), int(b)) for a, b in runs if b > a):
        if out and r0 <= out[-1][1]:
            out[-1][1] = max(out[-1][1], r1)
        else:
            out.append([r0, r1])
    return tuple((a, b) for a, b in out)


def _shard_boxes(local: Any, layout: ShardLayout, rank: int) -> list[tuple[Box, torch.Tensor]]:
    """``(global box, shard)`` of each local shard (``{rank: shard}`` in rank order, or one)."""
    items = sorted(local.items()) if isinstance(local, Mapping) else [(rank, local)]
    out = []
    for r, x in items:
        t = _as_torch(x)
        try:
            box = layout.box_of(r)
        except KeyError:  # not a layout rank: only a whole-tensor copy can be told apart
            box = Box((0,) * t.dim(), tuple(t.shape))
        out.append((box, t))
    return out


def _digest(local: Any, layout: ShardLayout, rank: int, chunk_bytes: int) -> tuple:
    """Per-chunk XXH3-64 digests of every local shard (CHUNK DELTA CONTRACT):
    ``(dtype, global shape, ((box, chunk_rows, first chunk, (digest, ...)), ...))``."""
    shards = _shard_boxes(local, layout, rank)
    dtype = _dtype_name(shards[0][1]) if shards else ""
    rows = chunk_rows(
        tuple(layout.shape), _torch_dtype(dtype).itemsize if dtype else 1, chunk_bytes
    )
    out = []
    for box, t in shards:
        if rows == 0 or t.dim() == 0 or tuple(t.shape) != box.shape:
            out.append((box, 0, 0, (checksum64(_bytes_of(t)),)))
            continue
        b0, b1 = box.lo[0], box.hi[0]
        first = b0 // rows
        digs = []
        c = first
        while c * rows < b1:
            lo, hi = max(c * rows, b0), min((c + 1) * rows, b1)
            digs.append(checksum64(_bytes_of(t[lo - b0 : hi - b0])))
            c += 1
        out.append((box, rows, first, tuple(digs)))
    return (dtype, tuple(layout.shape), tuple(out))


def _changed_runs(old: tuple | None, new: tuple) -> tuple[tuple[int, int], ...] | None:
    """The global row runs whose chunks differ between two :func:`_digest` results; None when
    the whole tensor counts as changed (no base, another dtype, shape or sharding, or 0-d)."""
    if old is None or old[:2] != new[:2] or len(old[2]) != len(new[2]):
        return None
    runs = []
    for (obox, orows, ofirst, od), (nbox, nrows, nfirst, nd) in zip(old[2], new[2], strict=True):
        if (obox, orows, ofirst, len(od)) != (nbox, nrows, nfirst, len(nd)):
            return None
        if od == nd:
            continue
        if nrows == 0:
            return None
        for k, (a, b) in enumerate(zip(od, nd, strict=True)):
            if a != b:
                c = nfirst + k
                runs.append((max(c * nrows, nbox.lo[0]), min((c + 1) * nrows, nbox.hi[0])))
    return merge_runs(runs)


@dataclass
class WeightPublisher:
    """Trainer side of one rank: builds manifests and the chunks this rank must send.

    DELTA CONTRACT: a delta manifest lists the tensors whose local shard changed since the last
    *published* version (its ``base_version``), judged by the digests :meth:`published` took.
    A multi-rank trainer must send one set on every rank, the UNION of the ranks' changed sets,
    against one base that every rank published (the AGREEMENT CONTRACT of
    :class:`tpusync.rl.trainer.TrainerSync`): pass it as ``changed`` to :meth:`prepare`, and the
    union of the ranks' changed row runs (:meth:`changed_rows`) as ``rows`` to send only the
    changed chunks of those tensors (CHUNK DELTA CONTRACT); without ``rows`` they go whole.

    SNAPSHOT RULE: the base digests describe the tensors as they were BEFORE their bytes were
    read for the send: take them with :meth:`digests` first and hand the same dict to
    :meth:`changed_rows` and :meth:`published` (``taken=``). A tensor changed while the send
    read it (an optimizer step that did not wait for ``publish``) may reach the samplers torn,
    and then differs from the base, so the next delta sends its changed chunks again. Digests
    taken after the send (the rule before 2026-12-07) described bytes the samplers never got:
    such a tensor stayed torn on the samplers through every later delta.
    """

    rank: int
    chunk_bytes: int = DELTA_CHUNK_BYTES  # the delta chunk (CHUNK DELTA CONTRACT)
    _last_digests: dict[str, tuple] = field(default_factory=dict)  # last published, per chunk
    _last_version: int | None = None  # last published (the base of a delta)
    _last_prepared: int | None = None  # versions only grow, published or not

    @property
    def base_version(self) -> int | None:
        """The last published version (the base of the next delta); None before the first."""
        return self._last_version

    def check_next(self, version: int) -> None:
        """Raise VersionSkewError unless ``version`` follows the last prepared version."""
        if self._last_prepared is not None and version <= self._last_prepared:
            raise VersionSkewError(
                f"version {version} does not follow the last prepared version {self._last_prepared}"
            )

    def prepare(
        self,
        version: int,
        tensors: Mapping[str, tuple[Any, ShardLayout]],
        delta: bool = False,
        changed: Collection[str] | None = None,
        rows: Mapping[str, Collection[tuple[int, int]]] | None = None,
    ) -> Manifest:
        """Manifest of ``version``; with ``delta``, only tensors whose local shard changed.

        In a multi-rank trainer every rank must agree on the delta set: pass ``delta=False`` unless
        the caller combines the ranks' changed sets (see :meth:`changed`) and passes the
        combined set as ``changed`` (names outside ``tensors`` are refused). Without a published
        base a delta is a full update. ``rows`` (with ``delta``; the ranks' unions of
        :meth:`changed_rows`) sends only those row runs of the tensors it names (a per-chunk
        delta, CHUNK DELTA CONTRACT); without it every tensor in the delta is sent whole.
        """
        self.check_next(version)
        if changed is not None:
            unknown = sorted(set(changed) - set(tensors))
            if unknown:
                raise ValueError(f"delta set names tensors this rank does not publish: {unknown}")
        self._last_prepared = version
        part: dict[str, tuple[tuple[int, int], ...]] = {}
        if delta and self._last_version is not None:
            names = set(changed) if changed is not None else self.changed(tensors)
            for name, runs in (rows or {}).items():
                if name not in names:
                    raise ValueError(f"delta rows name {name!r}, which the delta does not send")
                shape = tuple(tensors[name][1].shape)
                merged = merge_runs(runs)
                if shape and merged != ((0, shape[0]),):
                    part[name] = merged  # an empty run list: nothing of it is sent
        else:
            names = set(tensors)
        metas = tuple(
            TensorMeta(n, _dtype_name(_one(tensors[n][0])), tensors[n][1])
            for n in tensors
            if n in names
        )
        base = self._last_version if delta and self._last_version is not None else None
        return Manifest(version, metas, base_version=base, rows=part)

    def changed(self, tensors: Mapping[str, tuple[Any, ShardLayout]]) -> set[str]:
        """Names whose local shard (or any of this process's shards) differs from the last
        published digests; every name when none were taken."""
        return set(self.changed_rows(tensors))

    def digests(self, tensors: Mapping[str, tuple[Any, ShardLayout]]) -> dict[str, tuple]:
        """The per-chunk digests of every local tensor, one read of each (SNAPSHOT RULE)."""
        return {
            name: _digest(local, layout, self.rank, self.chunk_bytes)
            for name, (local, layout) in tensors.items()
        }

    def changed_rows(
        self,
        tensors: Mapping[str, tuple[Any, ShardLayout]],
        taken: Mapping[str, tuple] | None = None,
    ) -> dict[str, tuple[tuple[int, int], ...] | None]:
        """Changed tensors -> the global row runs of this process's changed chunks, or None when
        the whole tensor counts as changed (CHUNK DELTA CONTRACT; no digests taken, another
        dtype, shape or sharding, a 0-d tensor). Unchanged tensors are absent. ``taken``: the
        tensors' digests from :meth:`digests` (else they are taken here)."""
        taken = self.digests(tensors) if taken is None else taken
        out = {}
        for name, (_local, layout) in tensors.items():
            new = taken[name]
            old = self._last_digests.get(name)
            if old == new:
                continue
            runs = _changed_runs(old, new)
            out[name] = None if runs is not None and runs == ((0, layout.shape[0]),) else runs
        return out

    def chunks(
        self,
        manifest: Manifest,
        tensors: Mapping[str, tuple[Any, ShardLayout]],
        dst_layouts: Mapping[str, ShardLayout],
    ) -> Iterator[Chunk]:
        """Every chunk this rank sends for ``manifest``, given the samplers' layouts by trainer name."""
        for meta in manifest.tensors:
            local = _as_torch(tensors[meta.name][0])
            plan = ReshardPlan.build(
                meta.layout, dst_layouts[meta.name], manifest.rows_of(meta.name)
            )
            for t in plan.sent_by(self.rank):
                data = _bytes_of(local[t.src_index])
                yield Chunk(
                    manifest.version,
                    meta.name,
                    self.rank,
                    t.dst_rank,
                    t.box,
                    meta.dtype,
                    data,
                    checksum64(data),
                )

    def published(
        self,
        manifest: Manifest,
        tensors: Mapping[str, tuple[Any, ShardLayout]],
        digests: bool = True,
        taken: Mapping[str, tuple] | None = None,
    ) -> None:
        """Record that ``manifest`` went out (the base of the next delta).

        ``tensors`` holds every tensor of this rank (a shard or ``{rank: shard}`` each), not only
        the manifest's: the digests describe the whole model at this version. ``taken``: their
        digests from :meth:`digests`, taken before the send (SNAPSHOT RULE); without it they
        are taken here. ``digests=False`` keeps none (no full read of the model) when no delta
        will follow; the next delta then sends every tensor, which is always correct.
        """
        self._last_digests.clear()
        if digests:
            if taken is None:
                taken = self.digests(tensors)
            missing = sorted(set(tensors) - set(taken))
            if missing:
                raise ValueError(f"published: no digests taken for {missing}")
            self._last_digests.update({name: taken[name] for name in tensors})
        self._last_version = manifest.version


@dataclass
class _Pending:
    manifest: Manifest
    expected: dict[tuple[str, Box], Transfer]
    staging: dict[str, torch.Tensor]
    by_name: dict[str, list[Transfer]] = field(default_factory=dict)
    # Elements landed per expected transfer, and the pieces (sub-boxes) that landed.
    covered: dict[tuple[str, Box], int] = field(default_factory=dict)
    pieces: dict[tuple[str, Box], list[Box]] = field(default_factory=dict)
    error: str | None = None
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)


def same_name(name: str) -> str:
    """The default name map: the engine's names are the trainer's."""
    return name


class WeightSubscriber:
    """Sampler side of one rank: stages, verifies and commits versions of its weight shards.

    ``layouts`` are the sampler group's, over all its ranks; ``weights`` holds this rank's shard
    of each tensor whose layout names this rank. A layout without this rank (another rank of
    the group holds all of that tensor, e.g. a layer on another pipeline stage) needs no entry
    in ``weights``: nothing of that tensor is planned for or staged on this rank.

    ``whole``: every full (not delta) version must write every tensor of ``layouts`` (WHOLE
    VERSION RULE; a LoRA adapter's directory is rewritten whole each version, so a tensor a
    version leaves out would be served as zeros or as its previous value). Off by default: an
    engine's sampler may take only the tensors its trainer trains.
    """

    def __init__(
        self,
        rank: int,
        weights: Mapping[str, torch.Tensor],
        layouts: Mapping[str, ShardLayout],
        name_map: Callable[[str], str | None] = same_name,
        mode: str = "shadow",
        version: int = 0,
        recycle: bool = False,
        whole: bool = False,
    ) -> None:
        if mode not in ("shadow", "inplace"):
            raise ValueError(f"mode must be 'shadow' or 'inplace', not {mode!r}")
        for name, layout in layouts.items():
            if rank not in layout.ranks:
                continue
            box = layout.box_of(rank)
            if name not in weights:
                raise ValueError(f"{name}: no local tensor for rank {rank}'s shard {box}")
            if tuple(weights[name].shape) != box.shape:
                raise ValueError(
                    f"{name}: local tensor shape {tuple(weights[name].shape)} != shard {box.shape}"
                )
        self.rank = rank
        self.mode = mode
        self._weights = dict(weights)
        self._layouts = dict(layouts)
        self._name_map = name_map
        self._version = version
        self._lock = threading.Lock()
        self._paused = False
        self._pending: _Pending | None = None
        # RECYCLE CONTRACT (shadow mode, opt-in): the tensors a commit replaced become the next
        # update's shadow buffers, so a steady stream of updates allocates (and page-faults)
        # nothing; the caller promises to drop references to an old version's tensors before
        # the next update begins. Without it every update stages into fresh tensors.
        self._recycle = recycle
        self._whole = whole
        self._spare: dict[str, torch.Tensor] = {}
        self.dirty = False
        self.metrics = {
            "updates_committed": 0,
            "updates_rejected": 0,
            "bytes_received": 0,
            "last_update_s": 0.0,
            # Bytes staged by a fused copy + verify pass (FUSED STAGING CONTRACT in receive).
            "bytes_fused": 0,
        }

    @property
    def version(self) -> int:
        return self._version

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The committed weights (a new dict object after each shadow-mode commit)."""
        return self._weights

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Declare the engine paused (required for in-place updates)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def trainer_layouts(self) -> dict[str, ShardLayout] | None:
        """This group's layouts keyed by trainer name before any manifest, when the names are
        the trainer's (the default name map); None with another name map."""
        return dict(self._layouts) if self._name_map is same_name else None

    def layouts_by_trainer_name(self, manifest: Manifest) -> dict[str, ShardLayout]:
        """This sampler group's layout of each manifest tensor, keyed by the trainer's name."""
        out = {}
        for meta in manifest.tensors:
            engine = self._name_map(meta.name)
            if engine is not None:
                out[meta.name] = self._layouts[engine]
        return out

    def begin(self, manifest: Manifest) -> None:
        """Start staging ``manifest``; version skew and shape mismatches are refused here."""
        with self._lock:
            if manifest.version <= self._version:
                raise VersionSkewError(
                    f"update to version {manifest.version} refused: rank {self.rank} already has "
                    f"version {self._version}"
                )
            if manifest.base_version is not None and manifest.base_version != self._version:
                raise VersionSkewError(
                    f"delta update {manifest.base_version}->{manifest.version} refused: rank "
                    f"{self.rank} has version {self._version}"
                )
            if manifest.base_version is not None and self.dirty:
                # DIRTY RULE: a failed in-place update left some live tensors at a version that
                # is neither the base nor this one; a delta would commit that mix.
                raise VersionSkewError(
                    f"delta update {manifest.base_version}->{manifest.version} refused: rank "
                    f"{self.rank}'s in-place weights are dirty since a failed update; a full "
                    "update must land first"
                )
            if self.mode == "inplace" and not self._paused:
                raise RuntimeError(
                    "in-place updates need the engine paused: use `with sub.paused():`"
                )
            expected, staging = {}, {}
            mapped: dict[str, str] = {}  # engine name -> the trainer name mapped to it
            for meta in manifest.tensors:
                engine = self._name_map(meta.name)
                if engine is None:
                    continue
                if engine not in self._layouts:
                    raise ValueError(f"trainer tensor {meta.name} maps to unknown tensor {engine}")
                if engine in mapped:
                    raise ValueError(
                        f"trainer tensors {mapped[engine]} and {meta.name} both map to {engine}: "
                        "the name map must give every trainer tensor its own target"
                    )
                mapped[engine] = meta.name
                if tuple(meta.layout.shape) != tuple(self._layouts[engine].shape):
                    raise ValueError(
                        f"{meta.name} -> {engine}: trainer shape {meta.layout.shape} != "
                        f"sampler shape {self._layouts[engine].shape}"
                    )
                if self.rank not in self._layouts[engine].ranks:
                    continue  # another rank of this group holds all of it
                rows = manifest.rows_of(meta.name)
                plan = ReshardPlan.build(meta.layout, self._layouts[engine], rows)
                mine = plan.to(self.rank)
                for t in mine:
                    expected[(meta.name, t.box)] = t
                live = self._weights[engine]
                if rows is not None and not mine:
                    continue  # a per-chunk delta that changed none of this rank's rows
                if self.mode == "inplace":
                    # A per-chunk delta writes only the changed rows. Detached: the live tensors
                    # may be nn.Parameters, which refuse in-place writes that autograd records.
                    staging[engine] = live.detach()
                else:
                    spare = self._spare.pop(engine, None)
                    ok = (
                        spare is not None
                        and spare.shape == live.shape
                        and spare.dtype == live.dtype
                    )
                    staging[engine] = spare if ok else torch.empty_like(live)
                    if rows is not None:
                        # CHUNK DELTA CONTRACT, shadow mode: the shadow starts as a copy of the
                        # committed tensor and takes the changed rows, so the commit still swaps
                        # in a whole new version. Rejected: writing the rows into the live tensor
                        # (a reader would see a mix of versions).
                        staging[engine].copy_(live)
            if self._whole and manifest.base_version is None:
                left = sorted(set(self._layouts) - set(mapped))
                if left:
                    raise ValueError(
                        f"update {manifest.version} is a full version without "
                        f"{listed(left)}: this sampler takes every tensor of each full version"
                    )
            if manifest.base_version is None and manifest.tensors and not mapped:
                raise ValueError(
                    f"update {manifest.version}: the name map maps none of the trainer's "
                    f"{len(manifest.tensors)} tensors (e.g. {manifest.tensors[0].name}) to a "
                    "tensor of this sampler"
                )
            if self.mode == "inplace":
                self.dirty = True
            by_name: dict[str, list[Transfer]] = {}
            for (name, _box), t in expected.items():
                by_name.setdefault(name, []).append(t)
            self._pending = _Pending(manifest, expected, staging, by_name)

    def receive(self, chunk: Chunk, hasher: Checksum64Stream | None = None) -> None:
        """Verify and stage one chunk; a bad chunk rejects the whole update.

        PIECE CONTRACT: a chunk carries either a whole planned transfer box or a piece of one (a
        sub-box, as the network path cuts transfers to fit host blocks); pieces of one transfer
        must not overlap and must cover it exactly once before :meth:`commit` accepts the update.

        FUSED STAGING CONTRACT (``hasher``, shadow mode only): the chunk's bytes are part of a
        block not verified yet. They are fed to ``hasher`` exactly once, whatever happens here
        (staged, refused, or the update already failed), so the caller's block digest stays
        whole; where the target has contiguous rows (a whole shard, or a resharded box of it: a
        scatter) and the staging copy needs no cast (``copy_update``) or casts float32 to
        bfloat16 or float16 (``cast_update``, torch's rounding), it is the same pass as the hash;
        otherwise
        (other casts, a strided innermost dimension) the bytes are hashed, then cast and copied. The caller
        compares the digest at the block's end and aborts the update on a mismatch: the bytes
        only ever reached shadow buffers that are never committed. In-place mode refuses a
        ``hasher`` (live weights take verified bytes only).
        """
        if hasher is not None and self.mode != "shadow":
            raise UpdateRejectedError(
                f"rank {self.rank}: in-place updates stage verified blocks only (fused staging "
                "writes bytes before their block is verified)"
            )
        fed = False
        try:
            fed = self._receive(chunk, hasher)
        finally:
            if hasher is not None and not fed:
                hasher.update(chunk.data)

    def _receive(self, chunk: Chunk, hasher: Checksum64Stream | None) -> bool:
        """:meth:`receive`; True when the copy already fed ``hasher``."""
        with self._lock:
            p = self._pending
            if p is None or chunk.version != p.manifest.version:
                raise VersionSkewError(
                    f"chunk of version {chunk.version} arrived but rank {self.rank} is staging "
                    f"{None if p is None else p.manifest.version}"
                )
            if p.error:
                return False
            transfer = self._transfer_of(p, chunk)
            key = None if transfer is None else (chunk.name, transfer.box)
            if (
                transfer is None
                or chunk.dst_rank != self.rank
                or any(b.intersect(chunk.box) is not None for b in p.pieces.get(key, ()))
            ):
                p.error = (
                    f"unexpected or duplicate chunk {chunk.name} {chunk.box} from {chunk.src_rank}"
                )
                log.error("rank %d rejects update %d: %s", self.rank, chunk.version, p.error)
                return False
            itemsize = _torch_dtype(chunk.dtype).itemsize
            if chunk.data.nbytes != chunk.box.size * itemsize:
                p.error = f"chunk {chunk.name} {chunk.box} carries {chunk.data.nbytes} bytes"
                log.error("rank %d rejects update %d: %s", self.rank, chunk.version, p.error)
                return False
            if chunk.digest is not None and checksum64(chunk.data) != chunk.digest:
                p.error = f"digest mismatch in {chunk.name} {chunk.box} from rank {chunk.src_rank}"
                log.error("rank %d rejects update %d: %s", self.rank, chunk.version, p.error)
                return False
            engine = self._name_map(chunk.name)
            dtype = _torch_dtype(chunk.dtype)
            target = p.staging[engine]
            if chunk.box == transfer.box:
                index = transfer.dst_index
            else:
                index = self._layouts[engine].box_of(self.rank).local_slices(chunk.box)
            dst = target[index]
            fusable = (
                hasher is not None
                and dst.device.type == "cpu"
                and (dst.dim() == 0 or dst.stride(-1) == 1 or dst.shape[-1] == 1)
            )
            if fusable and dst.dtype == dtype:
                hasher.copy_update(dst, chunk.data)  # one pass: staging copy + block hash
                self.metrics["bytes_fused"] += chunk.data.nbytes
            elif fusable and dtype == torch.float32 and dst.dtype in _FUSED_CASTS:
                # one pass: block hash of the fp32 bytes + cast into the bf16 / fp16 staging buffer
                hasher.cast_update(dst, chunk.data.view(np.float32))
                self.metrics["bytes_fused"] += chunk.data.nbytes
            else:
                if hasher is not None:
                    hasher.update(chunk.data)
                src = torch.from_numpy(chunk.data).view(dtype).reshape(chunk.box.shape)
                dst.copy_(src)  # dtype cast happens here
            p.pieces.setdefault(key, []).append(chunk.box)
            p.covered[key] = p.covered.get(key, 0) + chunk.box.size
            p.bytes += chunk.data.nbytes
            return hasher is not None

    @staticmethod
    def _transfer_of(p: _Pending, chunk: Chunk) -> Transfer | None:
        exact = p.expected.get((chunk.name, chunk.box))
        if exact is not None:
            return exact
        for t in p.by_name.get(chunk.name, ()):
            if t.box.contains(chunk.box):
                return t
        return None

    def expects(self, name: str) -> bool:
        """Whether the update being staged wants pieces of trainer tensor ``name``."""
        with self._lock:
            return self._pending is not None and name in self._pending.by_name

    def missing(self) -> list[tuple[str, Box]]:
        with self._lock:
            p = self._pending
            return [] if p is None else self._missing(p)

    @staticmethod
    def _missing(p: _Pending) -> list[tuple[str, Box]]:
        return [k for k, t in p.expected.items() if p.covered.get(k, 0) != t.box.size]

    def verify(self) -> int:
        """The staged version's number once all of it arrived and verified; otherwise raises
        UpdateRejectedError exactly as :meth:`commit` would (the staged version is dropped, the
        old one kept). A :meth:`commit` right after a ``verify`` that returned, with no other
        call on this subscriber in between, cannot fail (GROUP COMMIT CONTRACT in
        :mod:`tpusync.rl.sampler`)."""
        with self._lock:
            return self._verified().manifest.version

    def staged(self) -> dict[str, torch.Tensor]:
        """The weights a :meth:`commit` would make current, without committing: the committed
        tensors with the staged version's in their place (shadow mode, after a :meth:`verify`
        that returned; a ``staged`` between the two does not change what ``commit`` does). For a
        caller that must use a version before it commits it - a vLLM engine loads a version into
        its model and commits it only if that load worked (LOAD FAILURE RULE,
        :mod:`tpusync.rl.vllm.engine`). The staged tensors stay the subscriber's: they become
        the committed ones, or spares again when the version is aborted."""
        if self.mode != "shadow":
            raise RuntimeError(
                "staged() needs shadow mode: in-place updates write the live weights"
            )
        with self._lock:
            merged = dict(self._weights)
            merged.update(self._verified().staging)
            return merged

    def _verified(self) -> _Pending:
        """The staged update, complete and verified (lock held); else drop it and raise."""
        p = self._pending
        if p is None:
            raise UpdateRejectedError("nothing staged")
        missing = self._missing(p)
        if p.error or missing:
            reason = p.error or f"{len(missing)} chunks missing, e.g. {missing[0][0]}"
            self._drop(p)
            self.metrics["updates_rejected"] += 1
            log.error("rank %d: update %d rejected: %s", self.rank, p.manifest.version, reason)
            raise UpdateRejectedError(
                f"update {p.manifest.version} rejected on rank {self.rank}: {reason}; "
                f"still serving version {self._version}"
                + (" (in-place: weights are dirty until a full update)" if self.dirty else "")
            )
        return p

    def commit(self) -> int:
        """Make the staged version current; raises UpdateRejectedError (old version kept)."""
        with self._lock:
            p = self._verified()
            if self.mode == "shadow":
                merged = dict(self._weights)
                merged.update(p.staging)
                if self._recycle:
                    self._spare = {n: self._weights[n] for n in p.staging}
                self._weights = merged  # one reference swap: readers see old or new, never a mix
            self.dirty = False
            self._version = p.manifest.version
            self._pending = None
            self.metrics["updates_committed"] += 1
            self.metrics["bytes_received"] += p.bytes
            self.metrics["last_update_s"] = time.monotonic() - p.started
            return self._version

    def _drop(self, p: _Pending) -> None:
        """Forget a staged update (lock held); its shadow buffers stay spares when recycling."""
        if self._recycle and self.mode == "shadow":
            self._spare.update(p.staging)
        self._pending = None

    def abort(self, reason: str) -> None:
        with self._lock:
            if self._pending is not None:
                log.warning(
                    "rank %d: update %d aborted: %s",
                    self.rank,
                    self._pending.manifest.version,
                    reason,
                )
                self._drop(self._pending)
                self.metrics["updates_rejected"] += 1
