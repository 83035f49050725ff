"""The server side of RL weight sync into a running SGLang server: a custom weight loader.

SGLang (0.5.23) runs a function named in the server's ``--custom-weight-loader`` when a client
posts ``/update_weights_from_tensor`` with ``load_format`` set to that function's import path:
every tensor-parallel scheduler process calls ``fn(model, named_tensors)`` between batches, after
in-flight requests ended (the HTTP server holds new ones back meanwhile). :func:`load` (start the
server with ``--custom-weight-loader tpusync.sglang.weight_loader.load``) is that function. Its
``named_tensors`` carry one request (REQUEST CONTRACT, :mod:`tpusync.sglang.weight_request`):

- ``init``: open one :class:`~tpusync.rl.sampler.SamplerSync` per scheduler process, sampler rank
  = the process's tensor-parallel rank, all of one ``replica``, staging into shadow buffers
  under the checkpoint names (``dtype``, by default the model's). What each rank receives: SLICE
  CONTRACT below;
- ``update``: pull one version (``timeout``, optionally at least ``version``) and, once every
  rank verified it, load it with ``model.load_weights`` - SGLang's own path for tensors it is
  handed;
- ``close``: close the sampler.

NEVER-RAISE CONTRACT: SGLang calls a custom loader with nothing around it that catches: an
exception would end the scheduler process and with it the server. So :func:`load` never raises.
Every outcome - done, or why not - goes to the client as one signed message on the request's
``reply`` address (a :class:`~tpusync.rl.control.ControlServer`, HMAC with the shared secret from
``$TPUSYNC_AUTH_SECRET``), sent by tensor-parallel rank 0 for the whole server, and SGLang's own
HTTP answer (always "Success" for a loader that returned) is not the outcome:
:mod:`tpusync.sglang.weight_sync` waits for the message.

ENGINE OUTCOME CONTRACT: the ranks of the server agree before any of them changes state: an
``init`` opens on every rank or on none (ranks that opened close again), and an ``update`` is
committed and loaded on every rank or on none (the GROUP COMMIT callback of
:meth:`SamplerSync.update` gathers every rank's verdict over SGLang's tensor-parallel CPU group),
so the server never serves two versions at once and keeps the old weights on any failure. The
version is loaded before it is committed, and committed only once every rank loaded it: when
``load_weights`` itself raises half way on any rank, every rank loads again what it served
before and the version is rejected (LOAD FAILURE RULE, :func:`_load_or_undo`), so the
trainer's report never counts a version the server does not serve.

SLICE CONTRACT: with ``sharded`` (the default) each rank receives only the part of each
checkpoint tensor that the model's ``load_weights`` keeps on it, as a dry run of that same
``load_weights`` on shapes alone finds it (DRY-RUN CONTRACT, :mod:`tpusync.sglang.weight_slices`:
exact, whatever the model class, or the whole tensor where the dry run cannot tell), and places it
in a zero tensor of the checkpoint's shape before ``load_weights``, which reads only that part.
The ranks exchange their parts at ``init``, so all report the same layouts to a trainer built
without ``dst_layouts``; a tensor whole on any rank is whole on all of them. With
``sharded=False`` every rank receives whole tensors (a TP=N server then pulls N copies). The
outcome of ``init`` says whether any tensor was split (``sharded``) and which tensors were left
whole, with the reason (``whole``).

SHAPE CHECK RULE (with ``sharded``, at any TP size, TP=1 included): ``init`` is refused on every
rank, before a byte moves, when the dry run's ``load_weights`` raised on the trainer's names and
shapes (:class:`~tpusync.sglang.weight_slices.DryRunError`) or when no rank reads some rows or
columns of a tensor (the trainer's tensor is larger than the server's: the real load would take
part of it silently). Either way the trainer publishes another model, and a real load would
fail half way or load the wrong weights. It is refused as well when the trainer's tensors would
leave some of the model's parameters partly or wholly unwritten (COVERAGE RULE in
:mod:`~tpusync.sglang.weight_slices`: a name the loader skips, a missing tensor), since the
server would then serve those at the old version beside the new ones, unless the request says
``partial`` (a trainer that publishes only the parameters it trains): the outcome then lists
them (``unwritten``). ``sharded=False`` skips the dry run and these checks, for a model whose
loader needs the values themselves.

Not supported (refused at ``init`` with the reason): pipeline parallelism.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tpusync.sglang.weight_request import decode

log = logging.getLogger("tpusync.sglang")

REPLY_TIMEOUT_S = 30.0


class _Worker:
    """The sampler of this scheduler process (one per process: SGLang runs one model runner per
    tensor-parallel rank and process)."""

    def __init__(self) -> None:
        self.sampler: Any = None
        self.last_version = 0
        # name -> (checkpoint shape, this rank's part of it): SLICE CONTRACT
        self.slices: dict[str, tuple[tuple[int, ...], Any]] = {}


_W = _Worker()


def _group() -> tuple[int, int, Any]:
    """(tensor-parallel rank, size, CPU process group or None) of this scheduler process."""
    from sglang.srt.runtime_context import get_parallel

    tp = get_parallel().tp_group
    return tp.rank_in_group, tp.world_size, (tp.cpu_group if tp.world_size > 1 else None)


def _gather(mine: Any) -> list[Any]:
    """Every tensor-parallel rank's ``mine``, in rank order (all ranks take part)."""
    import torch.distributed as dist

    _rank, world, group = _group()
    if group is None:
        return [mine]
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    return parts


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _layouts(
    parts: list[dict], shapes: dict[str, tuple[int, ...]], whole: dict[str, str]
) -> dict[str, Any]:
    """Every checkpoint tensor's layout over the server's ranks from each rank's kept parts
    (``parts[r]``: rank r's ``{name: (lo, hi) or None}``; SLICE CONTRACT). A tensor whole on any
    rank, or whose parts do not tile it, is whole on every rank; ``whole`` gets the reason.
    Raises ValueError when no rank reads some rows or columns of a tensor (SHAPE CHECK RULE:
    the real load would take only part of it, silently)."""
    from tpusync.rl.layout import Box, ShardLayout
    from tpusync.sglang.weight_slices import bounding_box

    world = len(parts)
    out = {}
    for n, shape in shapes.items():
        parts_of_n = [p.get(n) for p in parts]
        if all(b is not None for b in parts_of_n):
            boxes = [Box(tuple(lo), tuple(hi)) for lo, hi in parts_of_n]
            read = bounding_box(boxes)
            if read != Box((0,) * len(shape), tuple(shape)):
                raise ValueError(
                    f"the server's model reads only [{read.lo}, {read.hi}) of {n} "
                    f"{tuple(shape)}: the trainer's tensor is larger than the server's; does "
                    "the trainer publish this server's model?"
                )
            try:
                out[n] = ShardLayout(shape, tuple(enumerate(boxes)))
                continue
            except ValueError as e:
                whole.setdefault(n, f"the ranks' parts do not tile it ({e})")
        out[n] = ShardLayout.replicated(shape, range(world))
    return out


def _init(model: Any, req: dict) -> tuple[str | None, bool, dict[str, str], dict[str, str]]:
    """Open this rank's sampler: (the failure of any rank, every rank's reason, or None;
    whether any tensor is split over the ranks; the tensors left whole, and why; the model
    parameters the trainer's tensors leave unwritten, with ``partial``)."""
    import torch

    from tpusync.rl.chunks import WeightSubscriber, _torch_dtype
    from tpusync.rl.sampler import SamplerSync
    from tpusync.sglang.weight_slices import kept_boxes

    rank, world, _ = _group()
    error, mine, whole, unwritten, dtype = None, {}, {}, {}, None
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        from sglang.srt.runtime_context import get_parallel

        if _W.sampler is not None:
            raise RuntimeError("tpusync weight sync is already initialized on this server")
        if get_parallel().pp_group.world_size > 1:
            raise ValueError("pipeline-parallel SGLang servers are not supported")
        params = req.get("params") or {}
        if not params:
            raise ValueError("params is empty: pass checkpoint_params(model_dir)")
        shapes = {str(n): tuple(int(x) for x in shape) for n, (shape, _dt) in params.items()}
        if req.get("dtype"):
            dtype = _torch_dtype(req["dtype"])
        else:
            dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        if bool(req.get("sharded", True)):  # at TP=1 too: the SHAPE CHECK RULE
            t0 = time.monotonic()
            boxes, whole, unwritten = kept_boxes(model, shapes, dtype)
            log.info(
                "tpusync weight sync: rank %d's parts of %d tensors in %.3f s (%d whole, "
                "%d parameters left unwritten)",
                rank, len(boxes), time.monotonic() - t0, len(whole), len(unwritten),
            )  # fmt: skip
            mine = {n: None if b is None else (b.lo, b.hi) for n, b in boxes.items()}
            if unwritten and not req.get("partial"):  # COVERAGE RULE
                named = "; ".join(f"{n}: {what}" for n, what in list(unwritten.items())[:4])
                more = f" and {len(unwritten) - 4} more" if len(unwritten) > 4 else ""
                raise ValueError(
                    f"the trainer's tensors leave {len(unwritten)} of the server's parameters "
                    f"partly or wholly unwritten ({named}{more}): a load would serve them at the "
                    "old version beside the new one; publish every tensor of the model, or pass "
                    "partial=True if the trainer publishes only the parameters it trains"
                )
    except Exception as e:  # noqa: BLE001 - NEVER-RAISE CONTRACT: reported to the client
        error = _why(e)
    # Every rank takes part in both gathers, whatever failed where.
    first = _gather((rank, error, mine, whole, unwritten))
    failed = [(r, f) for r, f, _m, _w, _u in first if f is not None]
    whole = {n: why for _r, _f, _m, w, _u in first for n, why in w.items()}
    unwritten = {}
    for r, _f, _m, _w, u in first:
        for n, what in u.items():
            unwritten.setdefault(n, f"rank {r}: {what}")
    sharded = False
    if not failed:
        try:
            # Not sharded: no parts, so whole tensors everywhere. At TP=1 the dry run only
            # checked the shapes: the one rank takes everything, nothing to report as whole.
            layouts = _layouts([m for _r, _f, m, _w, _u in first], shapes, whole)
            whole = whole if world > 1 else {}
            sharded = any(len({b for _r, b in lay.shards}) > 1 for lay in layouts.values())
            _W.slices = {n: (lay.shape, lay.box_of(rank)) for n, lay in layouts.items()}
            weights = {n: torch.zeros(b.shape, dtype=dtype) for n, (_s, b) in _W.slices.items()}
            sub = WeightSubscriber(rank, weights, layouts, mode="shadow", recycle=True)
            _W.sampler = SamplerSync(
                sub, replica=int(req["replica"]), control=str(req["control"]),
                **req.get("options", {}),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - NEVER-RAISE CONTRACT
            error = _why(e)
        failed = [(r, f) for r, f in _gather((rank, error)) if f is not None]
    if not failed:
        return None, sharded, whole, unwritten
    if error is None and _W.sampler is not None:  # another rank failed: undo this one
        _W.sampler.close()
        _W.sampler = None
    return "; ".join(f"rank {r}: {f}" for r, f in failed), sharded, whole, unwritten


def _full(name: str, part: Any) -> Any:
    """``part`` in a zero tensor of the checkpoint's shape (SLICE CONTRACT: only it is read)."""
    import torch

    from tpusync.rl.layout import Box

    shape, box = _W.slices[name]
    if tuple(box.shape) == tuple(shape):
        return part
    out = torch.zeros(shape, dtype=part.dtype)
    out[Box((0,) * len(shape), shape).local_slices(box)] = part
    return out


def _update(model: Any, req: dict) -> dict[str, Any]:
    """Pull, agree, load, commit: the outcome (``ok``, ``version``, ``failure``, ``timed_out``)."""
    rank, _world, _ = _group()
    t0 = time.monotonic()
    if _W.sampler is None:
        why = ("rejected", "call init_server before update_server: no tpusync sampler here")
        return _outcome(_gather((rank, None, why)), None, t0)
    want = req.get("version")
    timeout = float(req.get("timeout", 60.0))
    gathered: list[list] = []
    load_failed: list[str] = []  # why the verified version was not loaded (LOAD FAILURE RULE)

    def confirm(version: int) -> str | None:
        gathered.append(_gather((rank, version, None)))
        failed = _failed(gathered[0])
        if failed:
            return "verified here, not loaded: " + _say(failed)
        why = _load_or_undo(model, version)
        if why is not None:
            load_failed.append(why)
        return why

    result, failure = None, None
    try:
        if want is not None and _W.sampler.version >= int(want):
            failure = (
                "rejected",
                f"version {want} requested but this rank already took {_W.sampler.version}",
            )
        else:
            result = _W.sampler.update(timeout=timeout, confirm=confirm)
            if result is None:
                failure = ("timeout", f"no version newer than {_W.sampler.version} in {timeout} s")
            elif not result.ok:
                failure = ("rejected", f"version {result.version} rejected: {result.reason}")
    except Exception as e:  # noqa: BLE001 - NEVER-RAISE CONTRACT
        failure = ("rejected", _why(e))
    if not gathered:  # this rank failed before its version verified
        gathered.append(_gather((rank, None, failure)))
    if load_failed:
        return _outcome(gathered[0], None, t0, failure=load_failed[0])
    if _failed(gathered[0]):
        return _outcome(gathered[0], None, t0)
    assert result is not None and result.ok
    _W.last_version = result.version
    log.info("SGLang rank %d now serves version %d (%.3f s)", rank, result.version, result.seconds)
    return _outcome(gathered[0], result.version, t0)


def _load_or_undo(model: Any, version: int) -> str | None:
    """Load the staged ``version`` (verified on every rank, not committed yet); None when every
    rank loaded it, else why not, the same on every rank (the version is then rejected).

    LOAD FAILURE RULE: ``load_weights`` that raises half way (something the SHAPE CHECK RULE's
    dry run could not see, or a fault) leaves the model part new, part old. So the ranks
    exchange their load outcomes, and if any failed, every rank loads again what it served
    before: the committed version's tensors (staging never touches them), or, before this
    sampler's first version, the server's checkpoint, read again from the safetensors files of
    its model path (:func:`_checkpoint`). The server then serves the old weights whole and the
    version is not committed anywhere: the trainer's report counts every rank failed."""
    rank = _group()[0]
    sub = _W.sampler.sub
    try:
        # One checkpoint-shaped tensor at a time (a generator): a list would hold the whole
        # model at checkpoint size on every rank while load_weights runs.
        model.load_weights((n, _full(n, t)) for n, t in sub.staged().items())
        why = None
    except Exception as e:  # noqa: BLE001 - NEVER-RAISE CONTRACT
        log.error("SGLang rank %d: loading version %d failed: %s", rank, version, _why(e))
        why = _why(e)
    failed = [(r, w) for r, w in _gather((rank, why)) if w is not None]
    if not failed:
        return None
    reasons = "; ".join(f"rank {r}: {w}" for r, w in failed)
    try:
        if _W.sampler.version > 0:
            model.load_weights((n, _full(n, t)) for n, t in sub.weights.items())
        else:
            model.load_weights(_checkpoint())
        back = None
    except Exception as e:  # noqa: BLE001 - NEVER-RAISE CONTRACT
        back = _why(e)
    stuck = [(r, b) for r, b in _gather((rank, back)) if b is not None]
    was = f"version {_W.last_version}" if _W.last_version > 0 else "its checkpoint"
    if not stuck:
        return (
            f"version {version} verified but load_weights failed ({reasons}): every rank "
            f"loaded {was} again and serves it"
        )
    return (
        f"version {version} verified but load_weights failed ({reasons}), and {was} could not "
        f"be loaded again ({'; '.join(f'rank {r}: {b}' for r, b in stuck)}): the model is "
        "partly updated; replace this server"
    )


def _checkpoint() -> Any:
    """The server's checkpoint tensors, ``(name, tensor)`` one at a time from the safetensors
    files of its model path (what it served before this sampler's first version)."""
    from pathlib import Path

    from safetensors import safe_open

    from sglang.srt.runtime_context import get_server_args

    if _W.last_version > 0:
        raise RuntimeError(
            f"this server serves version {_W.last_version}, which its sampler (set up again "
            "since) does not hold"
        )
    path = Path(get_server_args().model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise RuntimeError(
            f"the server's model path {str(path)!r} is no directory of safetensors files: its "
            "checkpoint cannot be read again"
        )
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def _failed(outcomes: list[tuple]) -> list[tuple[int, tuple[str, str]]]:
    """The ranks that did not verify, as ``(rank, (kind, reason))``; when every rank verified
    but not the same version (they polled across an announcement), all of them."""
    failed = [(r, f) for r, _v, f in outcomes if f is not None]
    versions = {v for _r, v, f in outcomes if f is None}
    if not failed and len(versions) > 1:
        failed = [(r, ("rejected", f"verified version {v}")) for r, v, _f in outcomes]
    return failed


def _say(failed: list[tuple[int, tuple[str, str]]]) -> str:
    return "; ".join(f"rank {r}: {msg}" for r, (_kind, msg) in failed)


def _outcome(
    outcomes: list[tuple], version: int | None, t0: float, failure: str | None = None
) -> dict[str, Any]:
    """The outcome of ``outcomes`` (every rank's), or of the server's ``failure`` (one reason
    for every rank, naming the ranks it concerns: LOAD FAILURE RULE)."""
    failed = _failed(outcomes)
    timed_out = bool(failed) and all(kind == "timeout" for _r, (kind, _m) in failed)
    failure = failure or _say(failed) or None
    return {
        "ok": failure is None,
        "version": version if failure is None else None,
        "failure": failure,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - t0, 4),
    }


def _reply(req: dict, outcome: dict) -> None:
    from tpusync.core.pd import load_secret
    from tpusync.rl.control import ControlClient

    client = ControlClient(load_secret(), req["reply"])
    try:
        client.request({"op": "outcome", "token": req["token"], **outcome}, REPLY_TIMEOUT_S)
    finally:
        client.close()


def load(model: Any, named_tensors: list) -> None:
    """SGLang's custom weight loader entry point (NEVER-RAISE CONTRACT: never raises)."""
    try:
        req = decode(named_tensors)
    except Exception as e:  # noqa: BLE001 - not ours: nothing to reply to, so only logged
        log.error("tpusync weight loader: %s; the model was not touched", e)
        return
    outcome: dict[str, Any]
    try:
        if req["kind"] == "init":
            failure, sharded, whole, unwritten = _init(model, req)
            outcome = {"ok": failure is None, "failure": failure, "sharded": sharded}
            outcome.update(whole=whole, unwritten=unwritten)
        elif req["kind"] == "update":
            outcome = _update(model, req)
        else:
            if _W.sampler is not None:
                _W.sampler.close()
                _W.sampler = None
            outcome = {"ok": True, "failure": None}
        outcome["serving"] = _W.last_version
    except Exception as e:  # noqa: BLE001 - NEVER-RAISE CONTRACT
        outcome = {"ok": False, "failure": _why(e), "serving": _W.last_version}
    if outcome.get("failure"):
        log.error("tpusync weight %s: %s", req["kind"], outcome["failure"])
    try:
        if _group()[0] != 0:
            return  # rank 0 speaks for the server (the ranks agreed on the outcome)
    except Exception:  # noqa: BLE001 - no tensor-parallel group: this process is the server
        pass
    try:
        _reply(req, outcome)
    except Exception as e:  # noqa: BLE001 - NEVER-RAISE CONTRACT: the client times out instead
        log.error("tpusync weight loader: could not report to %s: %s", req["reply"], _why(e))
