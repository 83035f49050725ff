"""Which part of each checkpoint tensor an SGLang model's ``load_weights`` keeps on this rank.

A tensor-parallel SGLang rank is handed every checkpoint tensor whole and its model's
``load_weights`` keeps one part (rows of a column-parallel weight, columns of a row-parallel one,
a vocabulary range, a stacked q/k/v or gate/up shard, ...): which part depends on the model's own
name mapping and on each layer's weight loader. :func:`kept_boxes` asks the model itself instead
of restating those rules per model class.

DRY-RUN CONTRACT: :func:`kept_boxes` calls ``model.load_weights`` once, with a tensor on PyTorch's
``meta`` device (a shape and dtype, no data) for each checkpoint tensor, under a
``TorchFunctionMode`` that lets nothing write to a real tensor: every in-place call whose target
is not on ``meta`` (``copy_``, ``fill_``, ``x[...] = y``, ``x.data = y``, ``out=``, in-place
operators) is skipped, and a ``copy_`` or ``x[...] = y`` from a view of a checkpoint tensor is
recorded instead. A checkpoint tensor's kept part is the smallest box (one index range per
dimension) holding every view it was copied from; it is None - take the whole tensor - when it
was never copied, when an operation made a new tensor of it (a cast, ``contiguous()`` of a
strided view, ``torch.cat``: what reaches the model is then no longer a plain part of the
checkpoint tensor) or when a view of it is not a box (the reason is returned). Parameters or
buffers the dry run rebound (``module.weight = ...``) are put back. So the model's weights are
the same objects with the same bytes after the dry run, and a box is exactly what the real load
reads, or the whole tensor.

SHAPE CHECK RULE: ``load_weights`` raising on the shapes alone (a name it does not know, a shape
its loader asserts against, a part it narrows past the end) means the real load would fail half
way, with some parameters written: :func:`kept_boxes` raises :class:`DryRunError` instead, so
the caller refuses before a byte moves. (The rule's other half, a tensor of which no rank reads
some rows, is checked where the ranks' parts meet, in :mod:`tpusync.sglang.weight_loader`.) A
loader that needs the values themselves (``.item()``) raises here too; such a model is loaded
without the dry run (``sharded=False`` there).

COVERAGE RULE: the same dry run records which elements of each model parameter ``load_weights``
would write (any in-place write counts, a copy from the checkpoint or a fill such as the zeroed
padding rows of a vocabulary shard; a rebound parameter counts as written whole). A parameter of
which fewer elements would be written than it holds keeps, after a real load, some of the values
it had before: the server would serve a mix of two versions. :func:`kept_boxes` lists such
parameters (``unwritten``); :mod:`tpusync.sglang.weight_loader` refuses ``init`` on them unless
the trainer is declared to publish only part of the model. The count is a lower bound on what
is missing (overlapping writes count twice), and a write it cannot place as a box (advanced
indexing, a strided parameter) counts as covering the whole parameter: so a parameter listed is
left partly unwritten, unless the loader writes it by a path a torch function mode does not see
(through numpy, or a kernel that bypasses ``__torch_function__``; none in SGLang 0.5.23's dense
loaders), and ``partial=True`` is the way past such a loader.

What it does not stop: Python attribute writes in ``load_weights`` other than parameters and
buffers (none in SGLang 0.5.23's dense-model loaders), and the loader's other side effects
outside PyTorch (logging).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from tpusync.rl.layout import Box

# In-place calls reached through ``__torch_function__`` that do not end in "_".
_INPLACE = frozenset(
    {"__setitem__", "__set__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
)  # fmt: skip
_SOURCE_ARG = {"copy_": 1, "__setitem__": 2}  # where a copy's source is among the arguments


class DryRunError(ValueError):
    """``load_weights`` raised on the checkpoint tensors' shapes (SHAPE CHECK RULE)."""


class Kept(NamedTuple):
    """What one dry run of ``load_weights`` found on this rank (DRY-RUN CONTRACT)."""

    boxes: dict[str, Box | None]  # checkpoint name -> the part this rank reads, None: whole
    whole: dict[str, str]  # checkpoint name -> why it is taken whole
    unwritten: dict[str, str]  # model parameter -> what a load leaves unwritten (COVERAGE RULE)


def view_box(view: Any, shape: tuple[int, ...], offset: int = 0) -> Box | None:
    """The elements of a contiguous tensor of ``shape`` starting at storage offset ``offset``
    that ``view`` (a view of it) covers, as a box; None when they are not one (merged or
    repeated dimensions)."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    off = int(view.storage_offset()) - offset
    if off < 0:
        return None
    lo = []
    for s in strides:
        lo.append(off // s if s else 0)
        off = off % s if s else off
    hi = [x + 1 for x in lo]
    if view.numel() == 0:
        return None
    used: set[int] = set()
    for size, stride in zip(view.shape, view.stride(), strict=True):
        if size == 1:
            continue
        dims = [d for d in range(len(shape)) if shape[d] > 1 and strides[d] == stride]
        if len(dims) != 1 or dims[0] in used or lo[dims[0]] + size > shape[dims[0]]:
            return None
        used.add(dims[0])
        hi[dims[0]] = lo[dims[0]] + size
    return Box(tuple(lo), tuple(hi))


def bounding_box(boxes: list[Box]) -> Box:
    """The smallest box holding every one of ``boxes`` (at least one, all of one rank)."""
    lo = tuple(min(b.lo[d] for b in boxes) for d in range(len(boxes[0].lo)))
    hi = tuple(max(b.hi[d] for b in boxes) for d in range(len(boxes[0].hi)))
    return Box(lo, hi)


class _Writes:
    """The parts of the model's parameters that in-place calls would write (COVERAGE RULE)."""

    def __init__(self, model: Any) -> None:
        self.params = dict(model.named_parameters())
        self.by_storage: dict[int, list[str]] = {}
        for n, p in self.params.items():
            if p.numel() and p.device.type != "meta":
                self.by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(n)
        self.boxes: dict[str, set[Box]] = {n: set() for n in self.params}
        self.unknown: set[str] = set()  # written in a way not placed as a box: counted whole

    def owner(self, t: Any) -> str | None:
        """The parameter whose elements ``t`` (a real tensor) views, if any."""
        off = int(t.storage_offset())
        for n in self.by_storage.get(t.untyped_storage().data_ptr(), ()):
            p = self.params[n]
            if p.storage_offset() <= off < p.storage_offset() + p.numel():
                return n
        return None

    def wrote(self, region: Any, base: Any) -> None:
        """An in-place call would write ``region`` (None: somewhere in ``base``)."""
        n = self.owner(base)
        if n is None:
            return
        p = self.params[n]
        if region is None or not p.is_contiguous() or self.owner(region) != n:
            self.unknown.add(n)
            return
        box = view_box(region, tuple(p.shape), int(p.storage_offset()))
        if box is None:
            self.unknown.add(n)
        else:
            self.boxes[n].add(box)

    def missing(self, rebound: set[str]) -> dict[str, str]:
        out = {}
        for n, p in self.params.items():
            if n in self.unknown or n in rebound or not p.numel():
                continue
            got = sum(b.size for b in self.boxes[n])
            if got < p.numel():
                shape = tuple(p.shape)
                out[n] = f"{got} of its {p.numel()} elements {shape}" if got else f"all of {shape}"
        return out


def _indexed(target: Any, index: Any) -> Any:
    """``target[index]`` when that is a view of ``target`` (basic indexing), else None."""
    try:
        region = target[index]
    except Exception:  # noqa: BLE001 - an index the dry run cannot replay: not placed
        return None
    same = region.untyped_storage().data_ptr() == target.untyped_storage().data_ptr()
    return region if same else None


def kept_boxes(model: Any, shapes: Mapping[str, tuple[int, ...]], dtype: Any) -> Kept:
    """This rank's kept part of each checkpoint tensor (None for the whole of it), why each
    None, and the model parameters a load would leave partly unwritten: DRY-RUN CONTRACT,
    COVERAGE RULE. Raises :class:`DryRunError` when ``load_weights`` raised on the shapes (SHAPE
    CHECK RULE), after putting back anything it rebound."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    probes = {n: torch.empty(s, dtype=dtype, device="meta") for n, s in shapes.items()}
    names = {id(t): n for n, t in probes.items()}
    reads: dict[str, list[Any]] = {n: [] for n in probes}
    whole: dict[str, str] = {}

    def real(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.device.type != "meta"

    def probe_of(x: Any) -> str | None:
        if not isinstance(x, torch.Tensor) or x.device.type != "meta":
            return None
        root = x._base if x._base is not None else x
        return names.get(id(root))

    class DryRun(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            fname = getattr(func, "__name__", "")
            seen = [(x, n) for x in tree_leaves((args, kwargs)) if (n := probe_of(x)) is not None]
            target = args[0] if args else None
            inplace = fname in _INPLACE or (fname.endswith("_") and not fname.startswith("_"))
            out_arg = kwargs.get("out")
            if (inplace and real(target)) or real(out_arg):
                if real(out_arg):
                    writes.wrote(out_arg, out_arg)
                elif fname == "__setitem__":
                    region = _indexed(target, args[1]) if len(args) > 1 else None
                    writes.wrote(region, target)
                else:  # x.data = y rebinds all of x; other in-place calls write all of x
                    writes.wrote(target, target)
                at = _SOURCE_ARG.get(fname)
                source = args[at] if at is not None and len(args) > at else None
                for x, n in seen:
                    if x is source:
                        reads[n].append(x)
                    else:
                        whole.setdefault(n, f"{fname} wrote it into a tensor")
                if fname in ("__setitem__", "__set__"):
                    return None
                return out_arg if real(out_arg) else target  # what the call would return
            out = func(*args, **kwargs)
            if seen and any(
                probe_of(o) is None for o in tree_leaves(out) if isinstance(o, torch.Tensor)
            ):
                for _x, n in seen:
                    whole.setdefault(n, f"{fname} made a new tensor of it")
            return out

    writes = _Writes(model)
    owned = [
        (table, k, v)
        for m in model.modules()
        for table in (m._parameters, m._buffers)
        for k, v in table.items()
    ]
    rebound: set[str] = set()
    handed: list[str] = []

    def named():
        for n, t in probes.items():
            handed.append(n)
            yield n, t

    try:
        with torch.no_grad(), DryRun():
            model.load_weights(named())
    except Exception as e:
        at = handed[-1] if handed else "?"
        raise DryRunError(
            f"the server's load_weights cannot take these tensors ({type(e).__name__} after "
            f"{at!r}: {e}); does the trainer publish this server's model?"
        ) from e
    finally:
        for table, k, v in owned:  # DRY-RUN CONTRACT: nothing rebound
            if table.get(k) is not v:
                rebound.update(n for n, p in writes.params.items() if p is v)
                table[k] = v
    boxes: dict[str, Box | None] = {}
    for n, shape in shapes.items():
        views = [view_box(x, tuple(shape)) for x in reads[n]]
        if n not in whole and not views:
            whole[n] = "load_weights did not copy it"
        elif n not in whole and any(b is None for b in views):
            whole[n] = "it was copied from a view that is not a box"
        boxes[n] = None if n in whole else bounding_box([b for b in views if b is not None])
    why = {n: whole[n] for n in shapes if boxes[n] is None}
    return Kept(boxes, why, writes.missing(rebound))
