"""Prefill/decode (P/D) streaming between processes: the Python face of the native primitive.

A producer (prefill) hands pool blocks to :class:`PdProducer` under a request id; a consumer
(decode) pulls them into its own pool blocks with :class:`PdConsumer`, layer by layer (block
groups), and both sides :meth:`poll` per-request results.

Contracts (enforced natively, see native/include/tpusync/transport/pd_stream.h):

- ``register_send`` takes its own reference on every block: the caller may free its blocks at once;
  the producer drops its reference only after the consumer acknowledged a complete, verified
  receipt, or when the deadline passed.
- A consumer request is ``done`` only when every declared source landed every block (each block's
  XXH3 checksum verified); the first failure of any source fails it, with a reason.
- ``groups_ready`` counts the leading groups that fully landed, so the consumer can start using
  layer 0 while later layers are still on the wire (:meth:`PdConsumer.wait` with ``groups``).
- Every connection is authenticated (HMAC-SHA256 challenge-response over a shared secret). The
  secret comes from a file or ``$TPUSYNC_AUTH_SECRET``, never from a command line.
- A consumer that gives up for good calls :meth:`PdConsumer.abandon`: its receive ends at once and
  each producer is told to drop its blocks instead of holding them to the deadline (a failed
  receipt alone keeps them there, for a retry).
- Same-host peers reached through the producer's Unix socket copy straight out of the producer's
  ``/dev/shm`` pool (the pool must have an ``shm_name``): no TCP. Integrations tell a peer on
  their own host by :func:`host_id`.
- A prefill of several pipeline stages pairs its rows with the decode's by model layer
  (:func:`pair_layers`), so both integrations reshard between stage counts the same way.
"""

from __future__ import annotations

import os
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpusync.core import _native
from tpusync.core.errors import StateError
from tpusync.core.pool import HostBlockPool, _counts, _ids

__all__ = [
    "SECRET_ENV",
    "PdConsumer",
    "PdProducer",
    "PdRelease",
    "PdResult",
    "host_id",
    "load_secret",
    "pair_layers",
]

SECRET_ENV = "TPUSYNC_AUTH_SECRET"


def host_id() -> str:
    """This host's identity for the same-host path: the running kernel's boot id (shared by
    every container on the host; "" where the kernel does not publish one, which turns the
    same-host path off)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pair_layers(src_layers: Sequence[int], dst_layers: Sequence[int]) -> list[int]:
    """LAYER PAIRING CONTRACT: for each source row (a buffer, or a row of a block) in order, the
    index of the destination row that holds the same model layer. Occurrences pair in order: the
    k-th source row of a layer goes to the k-th destination row of that layer (K before V where a
    layer has two rows, a draft model's layer after the target's), so a source that holds some
    layers fills exactly those rows of a destination that holds them all. The indices are
    distinct; a destination row no source names is left out (callers that need every row filled
    compare the count). Raises ValueError naming the layer when the destination holds no
    (further) row of a source layer.

    Rejected: deriving the layers from a stage's first layer and a fixed K-then-V order; draft
    models and hybrid pools break any fixed order, and engines know each row's layer."""
    free: dict[int, deque[int]] = defaultdict(deque)
    for j, layer in enumerate(dst_layers):
        free[int(layer)].append(j)
    out = []
    for layer in src_layers:
        if not free[int(layer)]:
            held = sorted(int(x) for x in set(dst_layers))
            span = f"{held[0]}..{held[-1]}, {len(held)} in all" if held else "none"
            raise ValueError(
                f"the destination holds no (further) row for model layer {int(layer)} "
                f"(its layers: {span})"
            )
        out.append(free[int(layer)].popleft())
    return out


def load_secret(secret_file: str | os.PathLike[str] | None = None) -> bytes:
    """The shared transport secret: the file's bytes (every trailing CR and LF dropped) when
    ``secret_file`` is given, else ``$TPUSYNC_AUTH_SECRET``. Raises ValueError when neither is set
    or the secret is shorter than 16 bytes."""
    if secret_file is not None:
        data = Path(secret_file).read_bytes().rstrip(b"\r\n")
    else:
        env = os.environ.get(SECRET_ENV, "")
        if not env:
            raise ValueError(f"no transport secret: pass a secret file or set ${SECRET_ENV}")
        data = env.encode()
    if len(data) < 16:
        raise ValueError(f"the transport secret has {len(data)} bytes; at least 16 are required")
    return data


@dataclass(frozen=True)
class PdResult:
    """One request's state: ``pending``, ``done`` or ``failed`` (``code`` / ``reason`` say why)."""

    request_id: int
    state: str
    code: str | None
    reason: str | None
    groups_total: int
    groups_ready: int
    bytes: int
    shm: bool
    # Consumer, once done: the verified checksum of every destination block (in start_recv
    # order), for forwarding them with register_send; empty unless every block carried one.
    checksums: tuple[int, ...] = ()

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def failed(self) -> bool:
        return self.state == "failed"


@dataclass(frozen=True)
class PdRelease:
    """One producer's answer to :meth:`PdConsumer.abandon`: ``released`` when it dropped its
    blocks; otherwise ``code`` / ``reason`` say why not (``NotFound``: the request was not live
    there - already acknowledged, expired, cancelled or never registered; anything else: it could
    not be told in time, and its deadline frees the blocks)."""

    peer: str
    code: str | None
    reason: str | None

    @property
    def released(self) -> bool:
        return self.code is None


def _result(r: dict) -> PdResult:
    return PdResult(**{**r, "checksums": tuple(r.get("checksums", ()))})


def _results(raw: list[dict]) -> list[PdResult]:
    return [_result(r) for r in raw]


def _sources(
    sources: Sequence[tuple[str, Sequence[int]] | tuple[str, Sequence[int], int]],
) -> tuple[list[tuple[str, list[int]]], list[int]]:
    """(peer, blocks) pairs and one reader count per source (SHARED-SEND CONTRACT). Block ids
    and reader counts are checked as the pool's are (a float id was truncated into another
    block)."""
    pairs = [(str(s[0]), _ids(s[1], "destination block ids")) for s in sources]
    readers = [s[2] if len(s) > 2 else 1 for s in sources]
    _counts("PdConsumer", **{f"readers[{i}]": r for i, r in enumerate(readers)})
    return pairs, [int(r) for r in readers]


def _secret(secret: bytes | str | None, secret_file: str | os.PathLike[str] | None) -> bytes:
    """``secret`` as bytes (a str as UTF-8, like ``$TPUSYNC_AUTH_SECRET``), else
    :func:`load_secret`."""
    if secret is None:
        return load_secret(secret_file)
    if isinstance(secret, str):
        return secret.encode()
    if isinstance(secret, (bytes, bytearray, memoryview)):
        return bytes(secret)
    raise TypeError(f"the transport secret must be bytes or str, got {type(secret).__name__}")


class PdProducer:
    """Serves registered blocks of ``pool`` to authenticated consumers.

    Listens on ``listen`` (``HOST:PORT``; port 0 picks a free one, see :attr:`address`) and, with
    ``unix_path``, also on a Unix socket for same-host consumers.
    """

    def __init__(
        self,
        pool: HostBlockPool,
        *,
        listen: str = "127.0.0.1:0",
        unix_path: str | None = None,
        secret: bytes | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        handshake_timeout: float = 5.0,
    ) -> None:
        self._pool = pool
        self._native = _native.PdProducer.start(
            pool.native,
            _secret(secret, secret_file),
            listen=listen,
            unix_path=unix_path or "",
            handshake_timeout=handshake_timeout,
        )

    @property
    def address(self) -> str:
        return self._native.address

    @property
    def unix_address(self) -> str | None:
        return self._native.unix_address or None

    @property
    def pending(self) -> int:
        return self._native.pending

    def register_send(
        self,
        request_id: int,
        blocks: Sequence[int],
        deadline: float,
        blocks_per_group: int = 0,
        checksums: Sequence[int] = (),
    ) -> None:
        """Offer ``blocks`` under ``request_id`` until acknowledged or ``deadline`` seconds pass.

        ``blocks_per_group`` (0: all in one group) sets the streaming unit, e.g. the blocks of
        one layer. ``checksums``: none, or :func:`tpusync.core.checksum64` of each whole block,
        sent instead of hashing the blocks again and verified by the consumer on every path
        (forward a received request with the consumer's ``PdResult.checksums``).
        AlreadyExistsError for a live request id.
        """
        self._native.register_send(
            request_id, list(blocks), deadline, blocks_per_group, [int(c) for c in checksums]
        )

    def register_relay(
        self, request_id: int, num_blocks: int, deadline: float, blocks_per_group: int = 0
    ) -> None:
        """Offer ``num_blocks`` blocks under ``request_id`` before they exist: a receive started
        with ``relay=self, relay_ids=[request_id, ...]`` (:meth:`PdConsumer.start_recv`) hands
        each block over as it lands and is verified, with the origin's checksum, and a consumer's
        pull of this send gets each block as soon as it is here (RELAY CONTRACT in pd_stream.h:
        cut-through forwarding down a chain). A block handed over twice (a retried or re-sourced
        receive) keeps its first copy. Ends like any send: acknowledged, ``deadline`` seconds,
        or :meth:`cancel`. AlreadyExistsError for a live request id.
        """
        self._native.register_relay(request_id, num_blocks, deadline, blocks_per_group)

    def open(
        self, request_id: int, first: int, blocks: Sequence[int], checksums: Sequence[int]
    ) -> None:
        """Hand blocks ``[first, first + len(blocks))`` of relay ``request_id`` over by hand,
        with the :func:`tpusync.core.checksum64` of each (RELAY CONTRACT); the producer takes its
        own reference on each. NotFoundError when no such relay is live; InvalidArgumentError for
        a send registered with its blocks, a range past the relay's end or a checksum count that
        is not one per block."""
        self._native.open(request_id, first, list(blocks), [int(c) for c in checksums])

    def cancel(self, request_id: int, reason: str) -> None:
        """End registered send ``request_id`` as failed at once (e.g. its consumer is known dead).

        :meth:`poll` reports it once, ``failed`` with code ``Cancelled`` and ``reason``; the
        producer drops its reference on the blocks at once. A pull of it in flight keeps the
        blocks' memory out of the pool until it let go (its TCP link is shut down at once; a
        same-host consumer copying out of the segment keeps them until it acknowledged or its
        socket closed), so a block is never refilled under a reader (CANCEL CONTRACT in
        pd_stream.h). NotFoundError when ``request_id`` is not registered (never was, or it
        already ended: acknowledged, expired or cancelled).
        """
        if not reason:
            raise ValueError("cancel needs a reason (it is reported as the failure's reason)")
        self._native.cancel(request_id, reason)

    def poll(self) -> list[PdResult]:
        """Every request; ``done`` (acknowledged) and ``failed`` (expired or cancelled) ones are
        reported once."""
        return _results(self._native.poll())

    def close(self) -> None:
        """Stop serving; pending requests end as failed (cancelled) and release their blocks."""
        self._native.stop()

    def __enter__(self) -> PdProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ClosedConsumer:
    def __getattr__(self, name: str) -> Any:
        raise StateError("this PdConsumer is closed")


class PdConsumer:
    """Pulls producers' blocks into blocks of ``pool`` over ``streams`` parallel connections."""

    def __init__(
        self,
        pool: HostBlockPool,
        *,
        streams: int = 4,
        secret: bytes | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        connect_timeout: float = 5.0,
        small_pull_bytes: int = 256 << 10,
        abandon_timeout: float = 2.0,
    ) -> None:
        """``small_pull_bytes``: a source of at most this many bytes is pulled over a 1-stream
        link (no striping threads on either side); 0 stripes every pull over ``streams``.
        ``abandon_timeout``: the bound, in seconds, of each wait of :meth:`abandon`."""
        self._pool = pool
        self._native = _native.PdConsumer.create(
            pool.native,
            _secret(secret, secret_file),
            streams=streams,
            connect_timeout=connect_timeout,
            small_pull_bytes=small_pull_bytes,
            abandon_timeout=abandon_timeout,
        )

    def recv(
        self, request_id: int, peer: str, blocks: Sequence[int], deadline: float = 30.0
    ) -> PdResult:
        """Pull request ``request_id`` from ``peer`` into ``blocks`` on the calling thread and
        return its result (``done`` or ``failed`` with a reason) - :meth:`start_recv` plus
        :meth:`wait` without handing the pull to a worker thread and back, the fast path for
        small transfers. Returns within ``deadline`` seconds (plus the moment a socket needs to
        notice it); the result is not reported again by :meth:`poll`."""
        return self.recv_multi(request_id, [(peer, blocks)], deadline)

    def close(self) -> None:
        """Stop receiving: requests in flight end and their sources stop (each bounded by its
        connect timeout or deadline); other Python threads run meanwhile (the GIL is released).
        Later calls raise :class:`~tpusync.core.errors.StateError`."""
        self._native = _ClosedConsumer()

    def __enter__(self) -> PdConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def recv_multi(
        self, request_id: int, sources: Sequence[tuple[str, Sequence[int]]], deadline: float = 30.0
    ) -> PdResult:
        """:meth:`recv` with several senders: the first is pulled on the calling thread, the
        others on worker threads; returns once every sender landed or one failed."""
        pairs, readers = _sources(sources)
        return _result(self._native.recv(request_id, pairs, deadline, readers))

    def start_recv(
        self,
        request_id: int,
        peer: str,
        blocks: Sequence[int],
        deadline: float = 30.0,
        relay: PdProducer | None = None,
        relay_ids: Sequence[int] = (),
    ) -> None:
        """Start pulling request ``request_id`` from ``peer`` (``HOST:PORT`` or ``unix:PATH``)
        into ``blocks`` (as many as the producer registered); fails by ``deadline`` seconds.

        ``relay`` / ``relay_ids``: every block is handed over, as it lands, to each of those
        relay sends of ``relay`` (:meth:`PdProducer.register_relay`; the producer must serve the
        pool this consumer receives into), in the natively running receive (RELAY CONTRACT)."""
        self.start_recv_multi(request_id, [(peer, blocks)], deadline, relay, relay_ids)

    def start_recv_multi(
        self,
        request_id: int,
        sources: Sequence[tuple[str, Sequence[int]]],
        deadline: float = 30.0,
        relay: PdProducer | None = None,
        relay_ids: Sequence[int] = (),
    ) -> None:
        """Like :meth:`start_recv` with several senders, each filling its own destination blocks;
        the request is done only when every sender landed.

        A source may be ``(peer, blocks, readers)``: SHARED-SEND CONTRACT (pd_stream.h) - that
        send is pulled whole by ``readers`` consumers (e.g. the decode ranks that each take their
        heads out of one prefill rank's blocks), every one naming the same count; the producer
        ends it after that many verified receipts."""
        pairs, readers = _sources(sources)
        native_relay = None if relay is None else relay._native
        self._native.start_recv(
            request_id, pairs, deadline, readers, native_relay, [int(i) for i in relay_ids]
        )

    def abandon(self, request_id: int, reason: str) -> list[PdRelease]:
        """Give up receiving ``request_id`` for good (e.g. its decode request was aborted).

        ABANDON CONTRACT (pd_stream.h): the request ends at once as ``failed`` (code
        ``Cancelled``, ``reason``; a failure that came first keeps its own reason), reported once
        by :meth:`poll` / :meth:`wait`. Its links are shut down and, when this returns, no source
        writes its destination blocks any more: they may be freed or reused. Then each source
        producer is told, best-effort and in parallel, to drop its blocks at once (its send ends
        ``failed``, the reason naming this release) instead of holding them until its deadline;
        one :class:`PdRelease` per distinct producer says how that went. Every wait is bounded by
        ``abandon_timeout``: an unreachable producer only costs that long.

        NotFoundError when ``request_id`` is not receiving here (or its end was already
        reported, or it was already abandoned); FailedPreconditionError when it already completed
        (nothing to abandon; it is still reported ``done``); TimeoutError when a source did not
        stop writing within ``abandon_timeout`` (its blocks stay borrowed until the request is
        reported ended; the producers were still told).
        """
        if not reason:
            raise ValueError("abandon needs a reason (it is reported as the failure's reason)")
        return [PdRelease(**r) for r in self._native.abandon(request_id, reason)]

    def poll(self) -> list[PdResult]:
        """Every request; terminal ones (``done`` / ``failed``) are reported once."""
        return _results(self._native.poll())

    def wait(self, request_id: int, groups: int | None = None, timeout: float = 30.0) -> PdResult:
        """Block until ``groups`` groups are ready (all of them when None) or the request ended.

        TimeoutError when neither happened in ``timeout`` seconds; NotFoundError for an unknown
        (or already polled) request.
        """
        return _result(
            self._native.wait(request_id, 2**32 - 1 if groups is None else groups, timeout)
        )

    @property
    def idle_links(self) -> int:
        return self._native.idle_links
