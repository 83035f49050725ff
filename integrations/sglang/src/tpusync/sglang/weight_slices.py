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

What it does not stop: Python attribute writes in ``load_weights`` other than parameters and
buffers (none in SGLang 0.5.23's dense-model loaders), and the loader's other side effects
outside PyTorch (logging).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tpusync.rl.layout import Box

# In-place calls reached through ``__torch_function__`` that do not end in "_".
_INPLACE = frozenset(
    {"__setitem__", "__set__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
)  # fmt: skip
_SOURCE_ARG = {"copy_": 1, "__setitem__": 2}  # where a copy's source is among the arguments


class DryRunError(ValueError):
    """``load_weights`` raised on the checkpoint tensors' shapes (SHAPE CHECK RULE)."""


def view_box(view: Any, shape: tuple[int, ...]) -> Box | None:
    """The elements of a contiguous tensor of ``shape`` that ``view`` (a view of it) covers, as a
    box; None when they are not one (merged or repeated dimensions)."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    off = int(view.storage_offset())
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


def kept_boxes(
    model: Any, shapes: Mapping[str, tuple[int, ...]], dtype: Any
) -> tuple[dict[str, Box | None], dict[str, str]]:
    """(this rank's kept part of each checkpoint tensor, None for the whole of it; why each
    None): DRY-RUN CONTRACT. Raises :class:`DryRunError` when ``load_weights`` raised on the
    shapes (SHAPE CHECK RULE), after putting back anything it rebound."""
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

    owned = [
        (table, k, v)
        for m in model.modules()
        for table in (m._parameters, m._buffers)
        for k, v in table.items()
    ]
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
                table[k] = v
    boxes: dict[str, Box | None] = {}
    for n, shape in shapes.items():
        views = [view_box(x, tuple(shape)) for x in reads[n]]
        if n not in whole and not views:
            whole[n] = "load_weights did not copy it"
        elif n not in whole and any(b is None for b in views):
            whole[n] = "it was copied from a view that is not a box"
        boxes[n] = None if n in whole else bounding_box([b for b in views if b is not None])
    return boxes, {n: whole[n] for n in shapes if boxes[n] is None}
