"""P/D disaggregation for the vLLM connector over tpusync's P/D streaming primitive.

PRODUCER (``kv_producer``, prefill instance): in the step that completes a request's prefill, the
worker gathers the prompt's full blocks (all layers) into a host pool and offers them with
:class:`tpusync.core.pd.PdProducer` under a transfer id the scheduler chose. The producer keeps
its own reference on the pool blocks until the consumer acknowledged a verified receipt or the
deadline passed, so vLLM frees its blocks at once (``request_finished`` holds nothing): no later
engine step is needed for the transfer to complete.

CONSUMER (``kv_consumer``, decode instance): a request carrying ``do_remote_prefill`` in its
``kv_transfer_params`` loads asynchronously: the worker pulls the blocks with
:class:`tpusync.core.pd.PdConsumer` into its pool (checksummed per block), and in
``get_finished`` scatters every completed transfer into vLLM's blocks before reporting it done;
a failed or expired transfer is reported as load errors (``kv_load_failure_policy``).

ABANDON CONTRACT (consumer): a request that finishes while its blocks are still on the wire was
aborted (a request waiting for remote KV does not run). vLLM keeps its blocks until the
connector reports it in ``finished_recving``; without an abandon that waited for the whole
transfer (or its 60 s timeout) and scattered bytes nobody would read. ``get_finished`` calls
:meth:`PdWorker.abandon` for every finished request first: its receive is dropped from the
worker's table at once (never scattered into vLLM's blocks, so it is reported finished in the
same step and vLLM frees the blocks), and a background thread calls
:meth:`PdConsumer.abandon`, which stops the receive and tells the producer to drop its copy of
the prefill at once instead of at its deadline (every wait there is bounded; an engine step
never waits on the network). That thread frees the staging blocks once the abandon returned
(the pool is thread-safe). Until then :meth:`PdWorker.poll` reads no receive's end (the consumer
reports an end once; read first, it would leave the abandon nothing to tell the producer).

SAME-HOST PATH (``pd_same_host``, default on): the producer's pool lives in ``/dev/shm`` and it
also listens on a Unix socket; its kv_transfer_params carry that socket (``tpusync_unix``) and
the producer's host id (``tpusync_host``: the kernel's boot id). A consumer with the same host id
pulls through the socket - the native stream then copies straight out of the producer's shared
pool (no TCP); any other consumer pulls over TCP from ``remote_host``/``remote_port`` as before.
Rejected alternative: comparing host names or IP addresses - containers on one host have
different ones, and two hosts may share a name; the boot id names one running kernel.

HEAD RESHARD CONTRACT (prefill and decode of different tensor-parallel sizes, same pipeline
size): vLLM gives tensor rank t of T the kv heads [t * H/T, (t+1) * H/T) of the model's H, and
every block row (one layer's K/V of a block) of every attention backend is [outer, heads, inner]
bytes (the CPU backend: outer 1; flash layouts: outer = block_size). A consumer rank computes
from both layouts (:func:`head_plan`) which producer ranks hold its heads; it pulls each of those
ranks' whole blocks (the producer's own rows, unchanged) into a pool of the producer's block size
and, when they all landed, copies its heads' slices into vLLM's blocks. Several consumer ranks
pulling one producer rank name their number (SHARED-SEND CONTRACT, tpusync.core.pd), so the
producer frees the blocks after the last of them. Supported when each side's size divides H or
is a multiple of it (vLLM then replicates each head on tp/H ranks: :func:`rank_heads`). REPLICA
RULE: on a producer with more tensor ranks than heads only the first rank holding a head offers
it (:func:`spare_replica`: the others would publish copies nobody pulls, held until their
deadline), and every consumer rank pulls its heads from those first holders - a consumer of the
producer's own layout too, through a head plan instead of rank r from rank r. Rejected
alternatives: the producer slicing per consumer rank - it does not know the consumer's layout
when it publishes; a gather of all heads on one rank - the whole prefill through one process.
Each consumer rank of a larger group receives its producer rank's every head (tp_c / tp_p times
the bytes it keeps): the price of a producer that publishes once.

LAYER PLAN CONTRACT (producer and consumer of different pipeline sizes): each rank's blocks hold
the rows of its stage's layers only. Every worker states the model layer of each of its rows
(``pd_layers`` in its lookup-server info, parsed by vLLM's own layer-index rule from the
registered layer names); the producer's scheduler passes every rank's list on
(``tpusync_rank_layers``), the consumer's scheduler hands its workers every consumer stage's list
(``stage_rows`` of the connector's ``PdRecv``). A consumer rank pulls, from each producer stage holding some of
its layers, the head parts above from that stage's ranks, and maps each row of a layer it holds
to its own row of the same layer (occurrences pair in order: K before V where a layer has two
rows, :func:`tpusync.core.pd.pair_layers`); rows of layers another consumer stage holds arrive
with the block and are not copied (blocks are pulled whole: a stage split across two consumer
stages is pulled by both). Each consumer rank knows every consumer stage's layers, so all of
them name the same number of readers of a producer stage's send (SHARED-SEND CONTRACT). Parts
of one request may come in blocks of several sizes (stages of unequal layer counts): each size
is pulled into its own pool, and the request is done when every part landed (failed on the
first that did not; later parts are then not scattered). The plan must give every consumer row
exactly one source and every producer row a consumer stage, else there is none and the
consumer computes the prompt itself (:func:`layer_plan`).

kv_transfer_params the producer returns (and the consumer expects): ``do_remote_prefill``,
``remote_engine_id``, ``remote_host``, ``remote_port``, ``remote_block_ids`` (the producer's vLLM
block ids, informational), ``tpusync_transfer_id``, ``tpusync_num_blocks``,
``tpusync_ranks`` / ``tpusync_layout`` (PER-RANK P/D CONTRACT), ``tpusync_rank_layers`` (LAYER
PLAN CONTRACT) and, for the same-host path, ``tpusync_unix`` and ``tpusync_host``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

import tpusync.core as tc
from tpusync.core.pd import PdConsumer, PdProducer, PdResult, host_id, load_secret, pair_layers

__all__ = [
    "HeadPart",
    "PdWorker",
    "head_plan",
    "layer_plan",
    "host_id",
    "rank_heads",
    "spare_replica",
    "transfer_id_for",
]

log = logging.getLogger("tpusync.vllm")


def transfer_id_for(engine_id: str, req_id: str) -> int:
    """A 63-bit transfer id from the producer's engine id and the request id."""
    d = hashlib.blake2b(f"{engine_id}/{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") >> 1


@dataclass
class _Ways:
    """A host pool of one block size and the consumer that pulls into it."""

    pool: tc.HostBlockPool
    consumer: PdConsumer


@dataclass(frozen=True)
class HeadPart:
    """One producer rank's share of a consumer rank's heads (HEAD RESHARD CONTRACT)."""

    producer_rank: int  # the producer's world rank (pipeline stage * tensor size + tensor rank)
    readers: int  # consumer ranks that pull this producer rank's blocks
    producer_heads: int  # heads per row in the producer's blocks
    take: tuple[int, int]  # [first, end) of the producer rank's heads
    put: tuple[int, int]  # [first, end) of this consumer rank's heads
    # LAYER PLAN CONTRACT: this consumer rank's row for each row of the producer rank's blocks
    # (-1: a layer another stage of the consumer holds, not copied); None: the same rows (equal
    # pipeline sizes).
    rows: tuple[int, ...] | None = None


def rank_heads(total_heads: int, tp: int, t: int) -> tuple[int, int] | None:
    """The kv heads [first, end) of tensor rank ``t`` of ``tp`` in vLLM's split: ``H/tp`` each
    when ``tp`` divides the model's ``H``, one head shared by ``tp/H`` ranks when ``H`` divides
    ``tp`` (grouped-query heads replicated); None for any other pair."""
    if total_heads <= 0 or tp <= 0:
        return None
    if total_heads % tp == 0:
        h = total_heads // tp
        return t * h, (t + 1) * h
    if tp % total_heads == 0:
        g = t * total_heads // tp
        return g, g + 1
    return None


def spare_replica(total_heads: int, tp: int, t: int) -> bool:
    """Whether tensor rank ``t`` of ``tp`` holds a copy of a kv head that a lower rank holds too
    (``tp`` above the model's heads): such a rank publishes nothing for P/D (REPLICA RULE)."""
    return 0 < total_heads < tp and tp % total_heads == 0 and t % (tp // total_heads) != 0


def head_plan(
    total_heads: int,
    producer: Sequence[int],
    consumer: Sequence[int],
    rank: int,
    producer_rows: Sequence[Sequence[int]] | None = None,
    consumer_rows: Sequence[Sequence[int]] | None = None,
) -> list[HeadPart] | None:
    """Where consumer world ``rank`` (layout ``consumer`` = [tensor, pipeline]) finds its kv
    heads among the ranks of a producer of layout ``producer``; None when the P/D stream cannot
    reshard between them (a split :func:`rank_heads` does not know, or layers the LAYER PLAN
    CONTRACT cannot pair).

    ``producer_rows`` (the model layer of each row, per producer world rank) and
    ``consumer_rows`` (the same, per consumer pipeline STAGE) are needed only when the pipeline
    sizes differ: a consumer rank then takes, from each producer stage holding some of its
    layers, the rows of those layers (LAYER PLAN CONTRACT). Equal pipeline sizes are taken to
    split the layers alike (vLLM's rule for one model); were they not, the blocks' sizes differ
    and the transport refuses the pull (InvalidArgument), so the prompt is computed.

    REPLICA RULE: a head the producer replicates (its tensor size above the model's heads) is
    pulled from the first rank holding it, the only one that publishes (:func:`spare_replica`),
    whatever the consumer's layout, the producer's own included."""
    (tp_p, pp_p), (tp_c, pp_c) = producer, consumer
    if not 0 <= rank < tp_c * pp_c or total_heads <= 0:
        return None
    stage, t = divmod(rank, tp_c)
    mine = rank_heads(total_heads, tp_c, t)
    if mine is None or rank_heads(total_heads, tp_p, 0) is None:
        return None
    hp = max(1, total_heads // tp_p)  # heads per producer rank
    copies = max(1, tp_p // total_heads)  # producer ranks holding each of them
    lo, hi = mine  # this rank's heads, in model head numbers
    groups = []  # (producer tensor rank, readers, take, put) within one stage
    for q in range(lo // hp, (hi - 1) // hp + 1):  # producer head groups holding some of them
        a, b = max(lo, q * hp), min(hi, (q + 1) * hp)
        # The consumer tensor ranks whose heads meet group q's, each of which pulls its blocks.
        readers = 0
        for c in range(tp_c):
            c_lo, c_hi = rank_heads(total_heads, tp_c, c)  # type: ignore[misc]
            readers += c_lo < (q + 1) * hp and q * hp < c_hi
        groups.append((q * copies, readers, (a - q * hp, b - q * hp), (a - lo, b - lo)))
    if pp_p == pp_c:
        return [HeadPart(stage * tp_p + q, r, hp, take, put) for q, r, take, put in groups]
    plans = layer_plan(tp_p, pp_p, producer_rows, consumer_rows)
    if plans is None:
        return None
    # SHARED-SEND CONTRACT: a producer stage's send is pulled by every consumer stage that takes
    # rows from it, each through its tensor ranks meeting the head group.
    stages = [sum(any(r >= 0 for r in p[s]) for p in plans) for s in range(pp_p)]
    parts = []
    for s, rows in enumerate(plans[stage]):
        if any(r >= 0 for r in rows):  # a stage holding none of this rank's layers: no pull
            parts += [
                HeadPart(s * tp_p + q, r * stages[s], hp, take, put, rows)
                for q, r, take, put in groups
            ]
    return parts


def layer_plan(
    tp_p: int,
    pp_p: int,
    producer_rows: Sequence[Sequence[int]] | None,
    consumer_rows: Sequence[Sequence[int]] | None,
) -> list[list[tuple[int, ...]]] | None:
    """LAYER PLAN CONTRACT: per consumer stage, per producer stage, the consumer row for each row
    of that producer stage's blocks (-1: a layer the consumer stage does not hold, not copied).
    None when the layers do not pair: a producer layer no consumer stage holds (another model),
    a consumer row no producer stage sends, ranks of one producer stage holding other layers
    (not vLLM's split), or lists missing."""
    if producer_rows is None or consumer_rows is None or len(producer_rows) != tp_p * pp_p:
        return None
    src = []  # the rows of each producer stage
    for s in range(pp_p):
        held = {tuple(int(x) for x in producer_rows[s * tp_p + q]) for q in range(tp_p)}
        if len(held) != 1:
            return None
        src.append(held.pop())
    sent = {layer for rows in src for layer in rows}
    if not consumer_rows or not sent <= {int(x) for rows in consumer_rows for x in rows}:
        return None
    plans = []
    for rows_c in consumer_rows:
        wanted = {int(x) for x in rows_c}
        try:  # pd.pair_layers over the rows of this stage's layers, in producer stage order
            dst = iter(pair_layers([x for rows in src for x in rows if x in wanted], rows_c))
        except ValueError:
            return None  # a layer held more often by the producer than here
        plan = [tuple(next(dst) if x in wanted else -1 for x in rows) for rows in src]
        if sum(r >= 0 for rows in plan for r in rows) != len(rows_c):
            return None  # a row here that no producer stage sends
        plans.append(plan)
    return plans


@dataclass
class _Request:
    """One request's receive, made of one pull per producer block size (LAYER PLAN CONTRACT)."""

    req_id: str
    block_ids: list[int]  # vLLM blocks to fill (-1: locally computed already, skip)
    pending: int  # pulls not ended yet
    failed: bool = False  # a pull failed (reported; later pulls are not scattered)
    shm: bool = True  # every pull came over the same-host path


@dataclass
class _Recv:
    """One pull of a request into one pool."""

    req: _Request
    pool_ids: list[int]
    deadline: float
    ways: _Ways  # the pool / consumer it is pulled with
    # HEAD RESHARD CONTRACT: the parts in pool_ids order (len(block_ids) pool blocks each); None
    # for a same-layout pull (whole rows of this worker's own block size).
    parts: list[HeadPart] | None = None

    @property
    def req_id(self) -> str:
        return self.req.req_id

    @property
    def block_ids(self) -> list[int]:
        return self.req.block_ids


class PdWorker:
    """The worker half of P/D: a host pool of whole vLLM blocks plus a producer or a consumer."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        *,
        producer: bool,
        pool_blocks: int,
        listen: str = "127.0.0.1:0",
        secret_file: str | None = None,
        timeout_s: float = 60.0,
        same_host: bool = True,
        name: str = "",
        heads: tuple[int, int, int] | None = None,
    ) -> None:
        """``heads``: (kv heads, outer, inner bytes) of every row seen as [outer, heads, inner]
        (HEAD RESHARD CONTRACT); None where the rows' head axis is unknown (no resharding)."""
        self.layers = list(layers)
        self._np = [np.asarray(t) for t in self.layers]  # fast row copies (see store.py)
        # HEAD RESHARD CONTRACT: each row as [block, outer, heads, inner], views of the KV cache.
        self.heads = heads
        self._head_views: list[np.ndarray] = []
        if heads is not None:
            own, outer, inner = heads
            if all(a.shape[1] == outer * own * inner for a in self._np):
                views = [a.reshape(a.shape[0], outer, own, inner) for a in self._np]
                if all(np.may_share_memory(v, a) for v, a in zip(views, self._np, strict=True)):
                    self._head_views = views
            if not self._head_views:
                self.heads = None  # not rows of that shape, or not viewable in place
        self.row_bytes = int(self.layers[0].shape[1])
        self.key_bytes = self.row_bytes * len(self.layers)
        secret = load_secret(secret_file)
        self.same_host = same_host
        self.host = host_id() if same_host else ""
        unix_path = None
        shm_name = None
        if producer and same_host and self.host:
            tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:32]
            tag = f"{tag}-{os.getpid()}"
            shm_name = f"tpusync-pd-{tag}"  # not persistent: gone with the process
            # ...unless the process was killed: such leftovers are removed here (OWNER LOCK
            # CONTRACT, tpusync.core.reclaim_stale_segments), so crashes do not pile up in RAM.
            tc.reclaim_stale_segments("tpusync-pd-")
            unix_path = os.path.join(tempfile.gettempdir(), f"tpusync-pd-{tag}.sock")
        self.pool = tc.HostBlockPool(self.key_bytes, pool_blocks, prefault=False, shm_name=shm_name)
        self.timeout_s = timeout_s
        self.producer = (
            PdProducer(self.pool, listen=listen, secret=secret, unix_path=unix_path)
            if producer
            else None
        )
        self.consumer = None if producer else PdConsumer(self.pool, secret=secret, streams=2)
        self._secret = secret
        self._pool_blocks = pool_blocks
        # HEAD RESHARD CONTRACT: one pool + consumer per producer block size, own size first.
        self._ways: dict[int, _Ways] = {}
        if self.consumer is not None:
            self._ways[self.key_bytes] = _Ways(self.pool, self.consumer)
        self._staging = np.empty(0, dtype=np.uint8)  # reused by _stage, grown as needed
        self._recvs: dict[tuple[int, int], _Recv] = {}  # (block bytes, transfer id)
        # ABANDON CONTRACT: abandons run here, off the engine step, and free their staging blocks.
        self._abandoner: ThreadPoolExecutor | None = None
        self._abandon_lock = threading.Lock()
        self._abandoning = 0  # _abandon_lock
        self.sent = 0
        self.received = 0
        self.received_shm = 0  # blocks that came over the same-host shared-memory path

    @property
    def address(self) -> str:
        return self.producer.address if self.producer is not None else ""

    @property
    def unix_address(self) -> str:
        """``unix:PATH`` of a producer serving same-host consumers, else ""."""
        if self.producer is None:
            return ""
        return self.producer.unix_address or ""

    def peer_for(self, tcp_peer: str, unix_peer: str, peer_host: str) -> str:
        """The address a consumer pulls from: the producer's Unix socket when it runs on this
        host (same boot id) and the same-host path is on, else its TCP address."""
        if self.same_host and unix_peer and peer_host and peer_host == self.host:
            return unix_peer
        return tcp_peer

    def _stage(self, n: int, width: int = 0) -> np.ndarray:
        """``n`` staging rows of ``width`` bytes (default: this worker's block), one reused
        buffer (a fresh one per transfer would page-fault its way through every byte)."""
        width = width or self.key_bytes
        if self._staging.size < n * width:
            self._staging = np.empty(n * width, dtype=np.uint8)
        return self._staging[: n * width].reshape(n, width)

    # ---------------------------------------------------------------- producer

    def publish(self, transfer_id: int, block_ids: Sequence[int]) -> None:
        """Copy vLLM blocks into the pool and offer them under ``transfer_id`` (raises on error)."""
        assert self.producer is not None
        n = len(block_ids)
        stage = self._stage(n)
        idx = np.asarray(block_ids, dtype=np.int64)
        rb = self.row_bytes
        for j, arr in enumerate(self._np):
            stage[:, j * rb : (j + 1) * rb] = arr[idx]
        ids = self.pool.alloc(n)
        try:
            self.pool.put(ids, stage).result(self.timeout_s)
            self.producer.register_send(transfer_id, ids, self.timeout_s)
        finally:
            self.pool.free(ids)  # the producer holds its own reference until acknowledged
        self.sent += n

    # ---------------------------------------------------------------- consumer

    def start(self, req_id: str, transfer_id: int, peer: str, block_ids: Sequence[int]) -> None:
        """Start pulling ``len(block_ids)`` blocks of ``transfer_id`` from ``peer``."""
        assert self.consumer is not None
        req = _Request(req_id, list(block_ids), 1)
        self._begin(req, transfer_id, self._ways[self.key_bytes], [(peer, 1)], None)

    def start_parts(
        self,
        req_id: str,
        transfer_id: int,
        parts: Sequence[tuple[str, HeadPart]],
        block_ids: Sequence[int],
    ) -> None:
        """HEAD RESHARD CONTRACT: pull ``len(block_ids)`` blocks of ``transfer_id`` from each
        (peer, part)'s producer rank; :meth:`poll` copies this rank's heads (and, LAYER PLAN
        CONTRACT, rows) out of them."""
        if self.consumer is None or self.heads is None:
            raise ValueError("this worker cannot reshard P/D blocks (no head layout known)")
        own, outer, inner = self.heads
        if not parts or any(p.put[1] > own or p.take[1] > p.producer_heads for _, p in parts):
            raise ValueError(f"head parts {parts!r} do not fit {own} heads per row")
        n_rows = len(self.layers)
        if any(p.rows is not None and not all(-1 <= r < n_rows for r in p.rows) for _, p in parts):
            raise ValueError(f"head parts {parts!r} name rows outside this worker's {n_rows}")
        by_size: dict[int, list[tuple[str, HeadPart]]] = {}
        for peer, part in parts:  # one pull per producer block size
            rows = n_rows if part.rows is None else len(part.rows)
            by_size.setdefault(rows * outer * part.producer_heads * inner, []).append((peer, part))
        req = _Request(req_id, list(block_ids), len(by_size))
        started: list[tuple[int, int]] = []
        try:
            for size, group in by_size.items():
                sources = [(peer, part.readers) for peer, part in group]
                ways = self._ways_for(size)
                self._begin(req, transfer_id, ways, sources, [part for _, part in group])
                started.append((size, transfer_id))
        except tc.TpusyncError:
            for key in started:  # nothing half-started stays behind
                rec = self._recvs.pop(key)
                self._abandon_later(key[1], rec, "a sibling pull did not start")
            raise

    def _begin(
        self,
        req: _Request,
        transfer_id: int,
        ways: _Ways,
        sources: Sequence[tuple[str, int]],
        parts: list[HeadPart] | None,
    ) -> None:
        """Pull ``len(req.block_ids)`` blocks from each (peer, readers) source into pool blocks
        of ``ways`` (source i's in the i-th run of them) and track the pull until it ends."""
        n = len(req.block_ids)
        ids = ways.pool.alloc(n * len(sources))
        try:
            ways.consumer.start_recv_multi(
                transfer_id,
                [(peer, ids[i * n : (i + 1) * n], r) for i, (peer, r) in enumerate(sources)],
                self.timeout_s,
            )
        except tc.TpusyncError:
            ways.pool.free(ids)
            raise
        deadline = time.monotonic() + self.timeout_s
        self._recvs[(ways.pool.block_bytes, transfer_id)] = _Recv(req, ids, deadline, ways, parts)

    def _ways_for(self, block_bytes: int) -> _Ways:
        ways = self._ways.get(block_bytes)
        if ways is None:
            pool = tc.HostBlockPool(block_bytes, self._pool_blocks, prefault=False)
            ways = _Ways(pool, PdConsumer(pool, secret=self._secret, streams=2))
            self._ways[block_bytes] = ways
        return ways

    def abandon(self, req_ids: Iterable[str], reason: str = "request finished") -> set[str]:
        """ABANDON CONTRACT: drop the receives of ``req_ids`` (finished or aborted requests) at
        once - they are never scattered into vLLM's blocks nor reported by :meth:`poll` - and
        tell their producers in the background. Returns the request ids whose receive was
        dropped (the caller reports them finished: their vLLM blocks are no longer written)."""
        if self.consumer is None:
            return set()
        wanted = set(req_ids)
        gone = [(key, rec) for key, rec in self._recvs.items() if rec.req_id in wanted]
        for key, rec in gone:
            del self._recvs[key]
            self._abandon_later(key[1], rec, reason)
        return {rec.req_id for _, rec in gone}

    def _abandon_later(self, transfer_id: int, rec: _Recv, reason: str) -> None:
        """Abandon one pull on the background thread, which frees its staging blocks."""
        if self._abandoner is None:
            self._abandoner = ThreadPoolExecutor(1, thread_name_prefix="tpusync-pd-abandon")
        with self._abandon_lock:
            self._abandoning += 1
        self._abandoner.submit(self._abandon_one, transfer_id, rec, reason)

    def _abandon_one(self, transfer_id: int, rec: _Recv, reason: str) -> None:
        ways = rec.ways
        try:
            for rel in ways.consumer.abandon(transfer_id, f"{rec.req_id}: {reason}"):
                if not rel.released and rel.code != "NotFound":
                    log.info(
                        "tpusync P/D: producer %s not told that %s was abandoned (%s); its "
                        "deadline frees the blocks",
                        rel.peer,
                        rec.req_id,
                        rel.reason,
                    )
        except tc.TpusyncError as exc:  # completed just before, or a source slow to stop:
            # either way freeing is safe (the receive's borrow keeps a slot still being written
            # out of the free list until it stops).
            log.debug("tpusync P/D: abandon of %s: %s", rec.req_id, exc)
        finally:
            ways.pool.free(rec.pool_ids)
            with self._abandon_lock:
                self._abandoning -= 1

    @property
    def abandoning(self) -> int:
        """Abandoned receives whose staging blocks are not back in the pool yet."""
        return self._abandoning

    def poll(self) -> tuple[set[str], dict[str, list[int]]]:
        """(requests whose blocks landed in vLLM's blocks, failed requests -> their block ids)."""
        done: set[str] = set()
        failed: dict[str, list[int]] = {}
        if self.producer is not None:
            for r in self.producer.poll():
                if r.failed:
                    log.warning("tpusync P/D send %d failed: %s", r.request_id, r.reason)
        if self.consumer is None:
            return done, failed
        with self._abandon_lock:
            if self._abandoning:
                # ABANDON CONTRACT: the consumer reports (and forgets) a request's end once; read
                # before an abandon of it ran, that end would leave the abandon nothing to tell
                # its producer. So nothing is read while abandons are outstanding (each is
                # bounded by abandon_timeout); the ends wait for the next step.
                return done, failed
        for size, ways in list(self._ways.items()):
            for r in ways.consumer.poll():
                self._ended(size, r, done, failed)
        return done, failed

    def _ended(self, size: int, r: PdResult, done: set[str], failed: dict[str, list[int]]) -> None:
        """Scatter (done) or report (failed) a pull the consumer of block ``size`` reported
        ended; its request is done when its last pull landed, failed at its first failure."""
        if not (r.done or r.failed):
            return  # still on the wire
        rec = self._recvs.pop((size, r.request_id), None)
        if rec is None:
            return
        req = rec.req
        req.pending -= 1
        was_failed = req.failed
        if req.failed:
            pass  # reported already: vLLM may reuse the blocks, nothing more is written
        elif r.done:
            try:
                self._scatter(rec)
                req.shm = req.shm and bool(r.shm)
            except tc.TpusyncError as exc:
                log.warning("tpusync P/D copy of %s failed: %s", rec.req_id, exc)
                req.failed = True
        else:
            log.warning("tpusync P/D receive of %s failed: %s", rec.req_id, r.reason)
            req.failed = True
        if req.failed and not was_failed:
            failed[rec.req_id] = [b for b in rec.block_ids if b >= 0]
        elif not req.failed and req.pending == 0:
            done.add(rec.req_id)
            self.received += len(rec.block_ids)
            if req.shm:
                self.received_shm += len(rec.block_ids)
        rec.ways.pool.free(rec.pool_ids)

    def _scatter(self, rec: _Recv) -> None:
        keep = [i for i, b in enumerate(rec.block_ids) if b >= 0]
        if not keep:
            return
        dst = np.asarray([rec.block_ids[i] for i in keep], dtype=np.int64)
        if rec.parts is None:
            stage = self._stage(len(rec.pool_ids))
            rec.ways.pool.get(rec.pool_ids, stage).result(self.timeout_s)
            src = stage[np.asarray(keep, dtype=np.int64)]
            rb = self.row_bytes
            for j, arr in enumerate(self._np):
                arr[dst] = src[:, j * rb : (j + 1) * rb]
            return
        # HEAD RESHARD CONTRACT: row j of a producer block is [outer, producer heads, inner];
        # this rank's row j takes heads put[0]:put[1] from heads take[0]:take[1] of each part.
        assert self.heads is not None
        own, outer, inner = self.heads
        n = len(rec.block_ids)
        pool = rec.ways.pool
        got = self._stage(len(rec.pool_ids), pool.block_bytes)
        pool.get(rec.pool_ids, got).result(self.timeout_s)
        for i, part in enumerate(rec.parts):
            hp = part.producer_heads
            prb = outer * hp * inner
            blocks = got[i * n : (i + 1) * n][np.asarray(keep, dtype=np.int64)]
            (a, b), (c, d) = part.take, part.put
            rows = range(len(self._head_views)) if part.rows is None else part.rows
            for j, row in enumerate(rows):  # LAYER PLAN CONTRACT: producer row j -> row `row`
                if row < 0:
                    continue  # a layer another stage of this consumer holds
                src = blocks[:, j * prb : (j + 1) * prb].reshape(len(keep), outer, hp, inner)
                self._head_views[row][dst, :, c:d, :] = src[:, :, a:b, :]

    @property
    def pending(self) -> int:
        """Requests still receiving."""
        return len({id(rec.req) for rec in self._recvs.values()})

    def close(self) -> None:
        if self._abandoner is not None:
            self._abandoner.shutdown(wait=True)  # each abandon's waits are bounded
        if self.producer is not None:
            self.producer.close()
