"""SGLang P/D (prefill/decode disaggregation) transfer backend on tpusync's P/D primitive.

The classes subclass SGLang's ``Common*`` disaggregation classes (0.5.23), so SGLang's own
bootstrap server, HTTP rank registry, ZMQ control messages, room bookkeeping, heartbeats and
timeouts are reused unchanged; tpusync supplies only the data movement:

- prefill (``send`` -> ``add_transfer_request``, one call per chunk): a worker thread gathers the
  chunk's KV pages (every layer buffer of ``KVArgs.kv_data_ptrs``; the decode rank's kv heads
  only, TP CONTRACT) and, on the last chunk, the request's aux rows into blocks of a tpusync
  ``HostBlockPool`` (segment gathers on tpusync's engine threads, GIL released), offers them
  with :class:`tpusync.core.pd.PdProducer` under a 63-bit request id, and tells the decode rank
  over SGLang's ZMQ control socket (``TPUSYNC_CHUNK``);
- decode: a listener pulls each announced chunk with :class:`tpusync.core.pd.PdConsumer` into its
  own pool blocks (every block XXH3-verified), scatters them into its KV buffers at the page
  indices it sent in ``send_metadata`` and, for the last chunk, into its aux rows.

STATE CONTRACT (per room, SGLang's KVPoll): prefill Bootstrapping -> WaitingForInput (every decode
rank's metadata arrived) -> Transferring (first chunk offered) -> Success (the decode acknowledged
a verified receipt of every chunk) or Failed. Decode Bootstrapping -> WaitingForInput -> Success
only when (a) every chunk up to the last landed and was scattered locally AND (b) the prefill
reported Success; Failed on the first failed chunk, a prefill Failed, a dead prefill (SGLang's
heartbeat) or a timeout. ``poll()`` never blocks: it reads the room table that the worker
threads update. ``failure_exception()`` raises SGLang's ``KVTransferError`` with the stored reason.

TIMEOUT CONTRACT: every wait is bounded: gathers and scatters by ``TPUSYNC_SGLANG_COPY_TIMEOUT_S``
(default 60), an offered chunk by ``TPUSYNC_SGLANG_SEND_DEADLINE_S`` (default 120; then the
prefill marks the room Failed), a fetch by ``TPUSYNC_SGLANG_RECV_DEADLINE_S`` (default 60),
plus SGLang's own bootstrap / waiting timeouts.

ABORT CONTRACT: an aborted or failed room is never written after the abort was observed: the
decode scatter checks the room state under the room lock that ``abort`` also takes, and a chunk
that lands afterwards is dropped (its blocks go back to the pool). Nothing of an aborted room is
held until a deadline: the decode abandons the room's fetches in flight
(:meth:`PdConsumer.abandon`, on a background thread, so ``abort`` never waits on the network),
which tells the prefill's producer to drop those chunks' staging blocks; the prefill, told by
SGLang's ``ABORT`` message (or failing the room itself), drops its queued chunks and cancels the
room's offered ones (:meth:`PdProducer.cancel`), also one offered while the abort arrived (it
re-checks the room after offering). A room the prefill scheduler aborts itself is reported
Failed to its decode ranks at once, with the reason (PREFILL ABORT CONTRACT), and its offers are
cancelled; the decode's own room stays WaitingForInput until Success or Failed, so SGLang's
waiting timeout bounds it whatever message is lost. The deadlines stay the backstop for a peer
that cannot be reached. The first failure of a room stays its reason (a fetch cut short by the
abort does not overwrite SGLang's "Aborted" cause).

TP CONTRACT: prefill and decode may run different attention TP sizes (one a multiple of the
other). SGLang's own rank mapping decides which ranks pair (a decode rank of a larger TP pulls
from one prefill rank, of a smaller TP from several, and counts their Success reports); each
pair moves only the kv heads both hold (pd_layout.py, HEAD SLICE CONTRACT): the decode's layout
travels in its registration, the prefill's with every chunk, and layouts that cannot pair fail
the room with the reason. The prefill stages in blocks of its page size; a decode staging pages
of another size gets a second pool and consumer for them (``_Way``, one per size, on first use).
Head slicing takes pages to be NHD (``[page_size, heads, head_dim]``, SGLang's MHA token pool):
the size checks cannot tell another element order of the same sizes apart, so a pair of
different TP sizes is only right for NHD pools (equal TP sizes move whole pages, any order).

PP CONTRACT: a prefill of several pipeline stages sends each stage's layers from that stage's
ranks; SGLang's rank mapping makes a decode of one stage pull from every prefill stage (and count
their Success reports), a decode split alike pull from its own stage. Each stage's buffers go
into the decode buffers of the same model layers (pd_layout.py, LAYER PAIRING CONTRACT, by
``KVArgs.kv_layer_ids``), and every stage sends the aux rows with its last chunk (SGLang's
stages all hold the request's outputs by then, as its own backends assume). The prefill's room
states then live in SGLang's consensus store over its pipeline group, which SGLang builds.

Scope (checked at start-up with a clear error): KV in host memory (SGLang's ``--device cpu``; a
GPU KV cache needs a device <-> staging copy that is not implemented), every KV buffer with the
same bytes per page, no hybrid state buffers (Mamba / SWA / DSA), device
destinations only (``supports_host_destination = False``), no ``prefill_complete`` allocation.
Rejected alternative: writing into the decode's KV memory from the prefill (RDMA-style push).
tpusync's P/D primitive is pull-based with verified receipt, which also gives the prefill its
completion signal without an extra message.

Configuration (environment, read once per manager): ``TPUSYNC_AUTH_SECRET`` (or
``TPUSYNC_SGLANG_SECRET_FILE``) - the shared transport secret, required on both sides;
``TPUSYNC_SGLANG_POOL_MB`` - staging pool per rank and page size (default 256);
``TPUSYNC_SGLANG_LISTEN_HOST`` - address the prefill's producer binds (default SGLang's rank IP);
``TPUSYNC_SGLANG_STREAMS`` (default 2); ``TPUSYNC_SGLANG_SAME_HOST`` - ``0`` turns the same-host
path off (SAME-HOST CONTRACT: default on, a decode rank on the prefill's host pulls out of its
/dev/shm pool).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import math
import os
import queue
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from tpusync.core import (
    HostBlockPool,
    PoolExhaustedError,
    TpusyncError,
    _native,
    reclaim_stale_segments,
)
from tpusync.core.pd import PdConsumer, PdProducer, host_id, load_secret
from tpusync.sglang.pd_layout import HeadSlice, RankLayout, head_slice, stream_segments

__all__ = [
    "TpusyncKVBootstrapServer",
    "TpusyncKVManager",
    "TpusyncKVReceiver",
    "TpusyncKVSender",
]

logger = logging.getLogger(__name__)

CHUNK_TAG = b"TPUSYNC_CHUNK"
REGISTER_ROOM = b"None"  # SGLang's convention: a registration message carries room "None"
_RECV_POLL_MS = 200
_FETCH_POLL_S = 0.002
_POOLS = itertools.count()  # names this process's same-host pools apart


def _env_float(name: str, default: float) -> float:
    """A positive, finite number from the environment (NaN would disable a timeout: every
    ``now > end`` test is false; inf is no bound either)."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"${name} must be a positive finite number, got {raw!r}")
    return value


def _env_streams(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 64:
        raise ValueError(f"${name} must be a whole number of streams from 1 to 64, got {raw!r}")
    return int(raw)


def _region(ptr: int, nbytes: int, item_len: int) -> np.ndarray:
    """A writable ``[nbytes // item_len, item_len]`` uint8 view of SGLang-owned memory (no copy).

    The memory belongs to SGLang's KV / aux pools, which outlive the manager.
    """
    if ptr == 0 or nbytes <= 0 or item_len <= 0 or nbytes % item_len:
        raise ValueError(f"bad KV region: ptr={ptr:#x} bytes={nbytes} item={item_len}")
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return np.ctypeslib.as_array(buf).reshape(-1, item_len)


def _request_id(room: int, chunk: int, decode: str, prefill: str) -> int:
    """One chunk of one room between one prefill rank and one decode rank (a decode rank of a
    smaller TP pulls the same chunk from several prefill ranks)."""
    key = f"{room}/{chunk}/{decode}/{prefill}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


@dataclass
class _PeerInfo:
    """One decode rank's per-room metadata (from ``send_metadata``)."""

    session: str
    endpoint: str
    dst_port: int
    dst_kv_indices: np.ndarray
    dst_aux_index: int | None
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: int = 0


@dataclass
class _Chunk:
    room: int
    kv_indices: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None


@dataclass
class _PrefillAbort:
    """A room the prefill scheduler aborted (``TpusyncKVSender.abort``), for the send worker."""

    room: int
    targets: list[tuple[str, int]]  # the room's decode endpoints, taken before clear() drops them
    reason: str


@dataclass
class _FromRank:
    """Decode-side progress of one room from one prefill rank."""

    in_flight: int = 0
    last_landed: bool = False
    ok: bool = False  # the rank reported Success
    reported: bool = False  # handed to SGLang's per-rank Success count


@dataclass
class _RecvRoom:
    """Decode-side progress of one room (from every prefill rank it pulls from)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    dst_kv_indices: np.ndarray | None = None
    dst_aux_index: int | None = None
    ranks: dict[int, _FromRank] = field(default_factory=dict)
    done: bool = False


@dataclass
class _Way:
    """A staging pool and the consumer pulling into it: one per prefill block size (a prefill of
    another TP size stages pages of another size)."""

    pool: HostBlockPool
    consumer: PdConsumer


@dataclass
class _Fetch:
    """One chunk being pulled from one prefill rank."""

    room: int
    rank: int  # the prefill's unique rank
    way: _Way
    ids: list[int]
    start: int
    n: int
    is_last: bool
    slice: HeadSlice
    kv_blocks: int


class TpusyncKVManager(CommonKVManager):
    """One per scheduler rank; owns the staging pool and the tpusync producer / consumer."""

    supports_host_destination = False
    kv_status_msg_tag = b"TPUSYNC_STATUS"
    kv_status_msg_carries_reason = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        _check_supported(args)
        from sglang.srt.runtime_context import get_device

        device = str(get_device().device)
        if device != "cpu":
            # DEVICE CONTRACT: the KV regions are read and written by host threads, so they must
            # be host memory. Rejected alternative: guessing from the pointer (a device pointer
            # dereferenced on the host crashes the process instead of failing with a reason).
            raise ValueError(
                f"tpusync P/D backend: KV on device {device!r} is not supported yet (host KV "
                "only: --device cpu); the device <-> staging copy path is not implemented"
            )
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self.copy_timeout = _env_float("TPUSYNC_SGLANG_COPY_TIMEOUT_S", 60.0)
        self.send_deadline = _env_float("TPUSYNC_SGLANG_SEND_DEADLINE_S", 120.0)
        self.recv_deadline = _env_float("TPUSYNC_SGLANG_RECV_DEADLINE_S", 60.0)
        self._streams = _env_streams("TPUSYNC_SGLANG_STREAMS", 2)
        secret_file = os.environ.get("TPUSYNC_SGLANG_SECRET_FILE") or None
        secret = load_secret(secret_file)
        item = int(args.kv_item_lens[0])
        self.page_bytes = item
        self.kv_tables = [
            _region(p, n, i)
            for p, n, i in zip(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, strict=True)
        ]
        self.aux_tables = [
            _region(p, n, i)
            for p, n, i in zip(
                args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, strict=True
            )
        ]
        self._flat = [t.reshape(-1) for t in self.kv_tables]  # segment regions (no copy)
        self.aux_bytes = sum(int(x) for x in args.aux_item_lens)
        self.aux_blocks = self._aux_blocks(item)
        self._pool_bytes = int(_env_float("TPUSYNC_SGLANG_POOL_MB", 256.0) * 2**20)
        same_host = os.environ.get("TPUSYNC_SGLANG_SAME_HOST", "1") != "0"
        self.host = host_id() if same_host else ""
        self.received = self.received_shm = 0  # blocks pulled, of them through /dev/shm
        shm_name = unix_path = None
        if disaggregation_mode == DisaggregationMode.PREFILL and self.host:
            # SAME-HOST CONTRACT: the staging pool lives in /dev/shm and the producer also
            # listens on a Unix socket; a decode rank on this host (same boot id) pulls through
            # it and copies straight out of the pool (no TCP). Leftovers of killed processes are
            # removed first (OWNER LOCK CONTRACT, tpusync.core.reclaim_stale_segments).
            tag = f"sglang-{os.getpid()}-{next(_POOLS)}"
            shm_name = f"tpusync-pd-{tag}"
            reclaim_stale_segments("tpusync-pd-")
            unix_path = os.path.join(tempfile.gettempdir(), f"tpusync-pd-{tag}.sock")
        self.pool = self._new_pool(item, shm_name)
        # The Common* constructor registers this rank with the bootstrap server (prefill), so the
        # tpusync endpoint must exist first; the rank IP comes from SGLang's helper.
        from sglang.srt.utils.network import get_local_ip_auto

        self.producer: PdProducer | None = None
        self.consumer: PdConsumer | None = None
        if disaggregation_mode == DisaggregationMode.PREFILL:
            host = os.environ.get("TPUSYNC_SGLANG_LISTEN_HOST") or get_local_ip_auto()
            self.producer = PdProducer(
                self.pool, listen=f"{host}:0", secret=secret, unix_path=unix_path
            )
        else:
            self._secret = secret
            self.consumer = self._new_consumer(self.pool)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.layout = self._rank_layout()
        if self.defer_decode_allocation:
            raise ValueError(
                "tpusync P/D backend: --disaggregation-decode-allocation-policy "
                "prefill_complete is not supported"
            )
        self._lock = threading.Lock()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.transfer_infos: dict[int, dict[str, _PeerInfo]] = {}
            self.decode_kv_args_table: dict[str, dict[str, Any]] = {}
            self._queue: queue.Queue[_Chunk | _PrefillAbort | None] = queue.Queue()
            # request id -> (room, is_last); rooms with their outstanding request ids.
            self._offered: dict[int, tuple[int, bool]] = {}
            self._room_offers: dict[int, set[int]] = {}
            self._room_last_offered: set[int] = set()
            self._start(self._prefill_control_loop, "tpusync-pd-control")
            self._start(self._prefill_worker_loop, "tpusync-pd-send")
            self._start(self._prefill_ack_loop, "tpusync-pd-ack")
            assert self.producer is not None
            logger.info(
                "tpusync P/D prefill rank %d: offering %d-byte pages at %s%s",
                args.engine_rank,
                item,
                self.producer.address,
                f" and {self.producer.unix_address}" if self.producer.unix_address else "",
            )
        else:
            self._recv_rooms: dict[int, _RecvRoom] = {}
            self._fetching: dict[int, _Fetch] = {}
            self._abandon: queue.Queue[tuple[int, _Way, str] | None] = queue.Queue()
            # prefill block size -> its way; prefill layout (as sent) -> the head slice
            self._ways: dict[int, _Way] = {item: _Way(self.pool, self.consumer)}
            self._slices: dict[bytes, HeadSlice] = {}
            self._start(self._decode_control_loop, "tpusync-pd-control")
            self._start(self._decode_fetch_loop, "tpusync-pd-fetch")
            self._start(self._decode_abandon_loop, "tpusync-pd-abandon")
            self._threads.append(self._start_heartbeat_checker_thread())
            logger.info(
                "tpusync P/D decode rank %d: pulling %d-byte pages (same-host path %s)",
                args.engine_rank,
                item,
                "on" if self.host else "off",
            )

    # -- helpers -----------------------------------------------------------------------------

    def _aux_blocks(self, block_bytes: int) -> int:
        """Blocks of ``block_bytes`` that the aux rows of one request fill."""
        return -(-self.aux_bytes // block_bytes) if self.aux_bytes else 0

    def _new_pool(self, block_bytes: int, shm_name: str | None = None) -> HostBlockPool:
        need = len(self.kv_tables) + self._aux_blocks(block_bytes) + 1
        blocks = max(self._pool_bytes // block_bytes, need)
        return HostBlockPool(block_bytes, blocks, shm_name=shm_name, prefault=shm_name is None)

    def _new_consumer(self, pool: HostBlockPool) -> PdConsumer:
        return PdConsumer(pool, streams=self._streams, secret=self._secret)

    def _rank_layout(self) -> RankLayout:
        """This rank's KV layout (pd_layout.py), sent to the peers it pairs with."""
        args = self.kv_args
        per_rank = int(getattr(args, "kv_head_num", 0) or 0)
        total = int(getattr(args, "total_kv_head_num", 0) or 0) or per_rank * self.attn_tp_size
        # LAYER PAIRING CONTRACT (pd_layout.py): the model layer of each KV buffer, as SGLang's
        # scheduler sets it; without them (or a list of another length) buffers pair by position.
        layer_ids = [int(x) for x in (getattr(args, "kv_layer_ids", None) or [])]
        if len(layer_ids) != len(args.kv_item_lens):
            layer_ids = []
        return RankLayout(
            tp=int(self.attn_tp_size),
            rank=int(self.attn_tp_rank),
            total_heads=total,
            page_size=int(args.page_size),
            item_lens=tuple(int(x) for x in args.kv_item_lens),
            mla=bool(self.is_mla_backend or self.is_hybrid_mla_backend),
            layer_ids=tuple(layer_ids),
        )

    def _way(self, block_bytes: int) -> _Way:
        """The staging pool + consumer for a prefill's block size (created on first use)."""
        with self._lock:
            way = self._ways.get(block_bytes)
        if way is None:
            pool = self._new_pool(block_bytes)
            way = _Way(pool, self._new_consumer(pool))
            with self._lock:
                way = self._ways.setdefault(block_bytes, way)
        return way

    def _copy(self, call: Any, pool: HostBlockPool, ids: list[int], segs: np.ndarray) -> None:
        """Run one segment gather / scatter between ``pool`` blocks and the KV buffers."""
        if len(segs):
            call(pool.engine, pool.native, ids, self._flat, segs).result(self.copy_timeout)

    def _start(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _recv_loop(self) -> Any:
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stopped:
            if poller.poll(_RECV_POLL_MS):
                yield self.server_socket.recv_multipart()

    def session_id(self) -> str:
        return f"{self.local_ip}:{self.rank_port}"

    def teardown(self) -> None:
        """Stop the worker threads and the producer (pending offers end as failed)."""
        self._stopped = True
        if getattr(self, "_heartbeat_shutdown", None) is not None:
            self._heartbeat_shutdown.set()
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self._queue.put(None)
        else:
            self._abandon.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
        if self.producer is not None:
            self.producer.close()

    close = teardown

    # -- decode -> prefill messages (built by the decode, parsed by the prefill) ---------------

    def build_receiver_registration_message(self) -> list[bytes]:
        return [
            REGISTER_ROOM,
            self.local_ip.encode("ascii"),
            str(self.rank_port).encode("ascii"),
            self.session_id().encode("ascii"),
            struct.pack(f"{len(self.kv_args.kv_item_lens)}Q", *self.kv_args.kv_item_lens),
            struct.pack(f"{len(self.kv_args.aux_item_lens)}Q", *self.kv_args.aux_item_lens),
            self.layout.to_json(),
        ]

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: np.ndarray,
        aux_index: int | None,
        state_indices: list | None,
        decode_prefix_len: int | None,
        is_dummy: bool,
        device_kv_indices: np.ndarray | None = None,
    ) -> list[bytes]:
        if state_indices:
            raise NotImplementedError("tpusync P/D backend: hybrid state buffers")
        room = self._recv_rooms.setdefault(bootstrap_room, _RecvRoom())
        with room.lock:
            if not is_dummy:
                room.dst_kv_indices = np.asarray(kv_indices, dtype=np.int64).copy()
                room.dst_aux_index = aux_index
        return [
            str(bootstrap_room).encode("ascii"),
            self.local_ip.encode("ascii"),
            str(self.rank_port).encode("ascii"),
            self.session_id().encode("ascii"),
            b"" if is_dummy else np.asarray(kv_indices, dtype=np.int32).tobytes(),
            b"" if is_dummy or aux_index is None else str(aux_index).encode("ascii"),
            str(required_dst_info_num).encode("ascii"),
            str(decode_prefix_len or 0).encode("ascii"),
        ]

    # -- prefill -------------------------------------------------------------------------------

    def _prefill_control_loop(self) -> None:
        for msg in self._recv_loop():
            try:
                self._handle_prefill_message(msg)
            except Exception:  # noqa: BLE001 - a bad message must not stop the control thread
                logger.exception("tpusync P/D: dropping malformed control message")

    def _handle_prefill_message(self, msg: list[bytes]) -> None:
        if msg and msg[0] == ABORT_TAG:
            note = AbortNotification.from_zmq(msg)
            if note is not None and note.room in self.request_status:
                self.record_failure(note.room, "Aborted by the decode side")
                self.update_status(note.room, KVPoll.Failed)
                self._cancel_offers(note.room, "aborted by the decode side")
            return
        if msg and msg[0] == b"BOOTSTRAP":
            return  # deferred-allocation readiness; that policy is refused at start-up
        session = msg[3].decode("ascii")
        if msg[0] == REGISTER_ROOM:
            aux_lens = list(struct.unpack(f"{len(msg[5]) // 8}Q", msg[5]))
            problem, sl = None, None
            if aux_lens != list(self.kv_args.aux_item_lens):
                problem = (
                    f"aux row sizes differ: decode {aux_lens}, prefill {self.kv_args.aux_item_lens}"
                )
            elif len(msg) < 7:
                problem = "the decode sent no KV layout (a tpusync older than this prefill's)"
            else:
                try:  # HEAD SLICE CONTRACT: what this rank sends that decode rank
                    sl = head_slice(self.layout, RankLayout.from_json(msg[6]))
                except ValueError as e:
                    problem = f"KV layouts cannot pair: {e}"
            with self._lock:
                self.decode_kv_args_table[session] = {"problem": problem, "slice": sl}
            if problem:
                logger.error("tpusync P/D: decode %s is incompatible: %s", session, problem)
            return
        room = int(msg[0].decode("ascii"))
        is_dummy = msg[4] == b"" and msg[5] == b""
        info = _PeerInfo(
            session=session,
            endpoint=msg[1].decode("ascii"),
            dst_port=int(msg[2].decode("ascii")),
            dst_kv_indices=np.frombuffer(msg[4], dtype=np.int32).astype(np.int64),
            dst_aux_index=None if msg[5] == b"" else int(msg[5].decode("ascii")),
            required_dst_info_num=int(msg[6].decode("ascii")),
            is_dummy=is_dummy,
            decode_prefix_len=int(msg[7].decode("ascii")) if len(msg) > 7 else 0,
        )
        with self._lock:
            peers = self.transfer_infos.setdefault(room, {})
            peers[session] = info
            complete = len(peers) == info.required_dst_info_num
            problem = self.decode_kv_args_table.get(session, {}).get("problem")
        if problem:
            reason = f"tpusync P/D: {problem}"
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
            if not is_dummy:  # tell that decode rank now, not at SGLang's waiting timeout
                self.send_kv_status_message(
                    targets=[(info.endpoint, info.dst_port)],
                    bootstrap_room=room,
                    status=KVPoll.Failed,
                    failure_reason=reason,
                )
            return
        if complete:
            self.req_to_decode_prefix_len[room] = info.decode_prefix_len
            self.update_status(room, KVPoll.WaitingForInput)

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: np.ndarray,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: list | None = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        """Queue one chunk for the send worker (called from the scheduler thread; never blocks)."""
        if state_indices:
            self.record_failure(bootstrap_room, "tpusync P/D backend: hybrid state buffers")
            self.update_status(bootstrap_room, KVPoll.Failed)
            return
        if self.request_status.get(bootstrap_room) in (None, KVPoll.Failed):
            return
        self._queue.put(
            _Chunk(
                bootstrap_room,
                np.asarray(kv_indices, dtype=np.int64).copy(),
                index_slice,
                is_last_chunk,
                aux_index,
            )
        )

    def prefill_aborted(self, room: int, targets: list[tuple[str, int]], reason: str) -> None:
        """PREFILL ABORT CONTRACT: the prefill scheduler aborted ``room`` (SGLang's
        ``sender.abort()``, then ``clear()``). The send worker, in queue order (never the
        scheduler thread, which must not wait on the network), cancels the room's offered chunks
        and tells every decode endpoint the room Failed with the reason. Without the message a
        decode that had pulled some chunks waited for the rest until SGLang's waiting timeout
        (SGLang's own ``abort`` only marks the room Failed locally)."""
        self._queue.put(_PrefillAbort(room, targets, reason))

    def _prefill_worker_loop(self) -> None:
        while True:
            chunk = self._queue.get()
            if chunk is None or self._stopped:
                return
            if isinstance(chunk, _PrefillAbort):
                try:
                    self._cancel_offers(chunk.room, "aborted by the prefill")
                    self.send_kv_status_message(
                        targets=chunk.targets,
                        bootstrap_room=chunk.room,
                        status=KVPoll.Failed,
                        failure_reason=chunk.reason,
                    )
                except Exception:  # noqa: BLE001 - the worker must live; SGLang's timeout backs it
                    logger.exception(
                        "tpusync P/D: telling room %s's decode of the abort failed", chunk.room
                    )
                continue
            try:
                self._send_chunk(chunk)
            except Exception as e:  # noqa: BLE001 - reported through the room's state
                logger.exception("tpusync P/D: sending room %s failed", chunk.room)
                self.conclude_failure(
                    bootstrap_room=chunk.room, failure_reason=f"tpusync P/D send failed: {e}"
                )

    def _send_chunk(self, chunk: _Chunk) -> None:
        room = chunk.room
        if self.request_status.get(room) in (None, KVPoll.Failed):
            return
        with self._lock:
            peers = [p for p in self.transfer_infos.get(room, {}).values() if not p.is_dummy]
        if not peers:  # a dummy rank for this room: nothing to move
            if chunk.is_last:
                self.update_status(room, KVPoll.Success)
            return
        assert self.producer is not None
        n = len(chunk.kv_indices)
        chunk_no = chunk.index_slice.start
        for peer in peers:
            dst = peer.dst_kv_indices[chunk.index_slice]
            if len(dst) != n:
                raise ValueError(
                    f"room {room}: decode {peer.session} has {len(dst)} pages for a chunk of {n}"
                )
            with self._lock:
                sl = self.decode_kv_args_table.get(peer.session, {}).get("slice")
            if sl is None:
                raise ValueError(f"room {room}: decode {peer.session} never registered")
            segs, kv_blocks = stream_segments(sl, chunk.kv_indices, self.page_bytes, "src")
            blocks = kv_blocks + (self.aux_blocks if chunk.is_last else 0)
            ids = self._alloc_waiting(blocks)
            try:
                self._copy(_native.put_segments, self.pool, ids, segs)
                if chunk.is_last and self.aux_blocks:
                    if chunk.aux_index is None:
                        raise ValueError(f"room {room}: last chunk without an aux index")
                    head = np.concatenate(
                        [t[chunk.aux_index] for t in self.aux_tables]
                    )  # one aux row per buffer, a few hundred bytes
                    staging = np.zeros(self.aux_blocks * self.page_bytes, dtype=np.uint8)
                    staging[: head.size] = head
                    for k, bid in enumerate(ids[kv_blocks:]):
                        self.pool.view(bid)[:] = staging[
                            k * self.page_bytes : (k + 1) * self.page_bytes
                        ]
                rid = _request_id(room, chunk_no, peer.session, self.session_id())
                with self._lock:
                    self._offered[rid] = (room, chunk.is_last)
                    self._room_offers.setdefault(room, set()).add(rid)
                if ids:
                    self.producer.register_send(rid, ids, self.send_deadline, 0)
                else:  # an empty last chunk and no aux buffers: nothing to move
                    self._ack(rid, done=True)
            finally:
                self.pool.free(ids)  # the producer holds its own references
            if self.request_status.get(room) in (None, KVPoll.Failed):
                # ABORT CONTRACT: the room failed (an abort arrived) while this chunk was being
                # offered; the abort handler may have looked before the offer existed.
                self._cancel_offers(room, "failed while a chunk was being offered")
                return
            self.update_status(room, KVPoll.Transferring)
            self._send_multipart_locked(
                f"tcp://{peer.endpoint}:{peer.dst_port}",
                [
                    CHUNK_TAG,
                    str(room).encode("ascii"),
                    str(rid).encode("ascii"),
                    self.producer.address.encode("ascii"),
                    str(chunk.index_slice.start).encode("ascii"),
                    str(n).encode("ascii"),
                    str(blocks).encode("ascii"),
                    b"1" if chunk.is_last else b"0",
                    str(self._prefill_unique_rank()).encode("ascii"),
                    self.layout.to_json(),
                    (self.producer.unix_address or "").encode("ascii"),
                    self.host.encode("ascii"),
                ],
            )
        if chunk.is_last:
            # Only now is every decode peer's last chunk offered: from here an acknowledgement may
            # conclude the room (_ack). Marked earlier, the first peer's ack concluded it while
            # the next peer's copy was still staging, and SGLang could reuse those pages.
            with self._lock:
                offers = self._room_offers.get(room)
                if offers is None:  # a chunk failed: _ack concluded the room already
                    return
                if offers:
                    self._room_last_offered.add(room)
                    return
                self._room_offers.pop(room, None)  # every offer was acknowledged meanwhile
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)

    def _cancel_offers(self, room: int, why: str) -> None:
        """ABORT CONTRACT: end every offered chunk of ``room`` now, so the producer drops their
        staging blocks instead of holding them to the send deadline. The ack loop then sees
        them failed and concludes the room (already Failed) as before."""
        assert self.producer is not None
        with self._lock:
            rids = list(self._room_offers.get(room, ()))
        for rid in rids:
            try:
                self.producer.cancel(rid, f"room {room} {why}")
            except TpusyncError:
                pass  # not live any more: acknowledged, expired, or released by the decode

    def _alloc_waiting(self, blocks: int) -> list[int]:
        """Staging blocks for one chunk; while the pool is full (earlier offers not yet fetched)
        wait for acknowledgements to free blocks, at most ``copy_timeout`` seconds."""
        if blocks > self.pool.num_blocks:
            raise ValueError(
                f"a chunk of {blocks} blocks exceeds the staging pool ({self.pool.num_blocks}); "
                "raise TPUSYNC_SGLANG_POOL_MB"
            )
        end = time.monotonic() + self.copy_timeout
        while True:
            try:
                return self.pool.alloc(blocks)
            except PoolExhaustedError:
                if time.monotonic() > end or self._stopped:
                    raise
            time.sleep(_FETCH_POLL_S)

    def _prefill_ack_loop(self) -> None:
        assert self.producer is not None
        while not self._stopped:
            for r in self.producer.poll():
                if r.done or r.failed:
                    self._ack(r.request_id, r.done, f"({r.code}): {r.reason}")
            time.sleep(_FETCH_POLL_S)

    def _ack(self, rid: int, done: bool, why: str = "") -> None:
        """One offered chunk ended: the room succeeds when its last chunk and every earlier one
        were acknowledged, and fails on the first chunk that was not."""
        with self._lock:
            entry = self._offered.pop(rid, None)
            if entry is None:
                return
            room, _ = entry
            outstanding = self._room_offers.get(room, set())
            outstanding.discard(rid)
            finished = done and not outstanding and room in self._room_last_offered
            if not done or finished:
                self._room_offers.pop(room, None)
                self._room_last_offered.discard(room)
        if not done:
            self.conclude_failure(
                bootstrap_room=room, failure_reason=f"tpusync P/D: chunk not fetched {why}"
            )
        elif finished:
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)

    # -- decode --------------------------------------------------------------------------------

    def _decode_control_loop(self) -> None:
        for msg in self._recv_loop():
            try:
                if msg and msg[0] == CHUNK_TAG:
                    self._start_fetch(msg)
                    continue
                if self.handle_abort_ack_message(msg):
                    continue
                parsed = self.parse_kv_status_message(msg)
                if parsed is not None:
                    self._on_prefill_status(*parsed)
            except Exception:  # noqa: BLE001 - a bad message must not stop the control thread
                logger.exception("tpusync P/D: dropping malformed control message")

    def _start_fetch(self, msg: list[bytes]) -> None:
        room = int(msg[1])
        rid = int(msg[2])
        peer = msg[3].decode("ascii")
        start, n, blocks = int(msg[4]), int(msg[5]), int(msg[6])
        is_last = msg[7] == b"1"
        rank = int(msg[8])
        unix, host = (
            (msg[10].decode("ascii"), msg[11].decode("ascii")) if len(msg) > 11 else ("", "")
        )
        if unix and self.host and host == self.host:
            peer = unix  # SAME-HOST CONTRACT: out of the prefill's /dev/shm pool, no TCP
        state = self._recv_rooms.get(room)
        if state is None or self.request_status.get(room) in (None, KVPoll.Failed):
            # Aborted or cleared: not pulled. The prefill cancels the room's offers on SGLang's
            # ABORT message (ABORT CONTRACT); its deadline is the backstop.
            return
        try:
            sl, block = self._slice_from(msg[9] if len(msg) > 9 else b"")
            kv_blocks = -(-n * sl.bytes_per_page // block)
            want = kv_blocks + (self._aux_blocks(block) if is_last else 0)
            if blocks != want:
                raise ValueError(f"{blocks} blocks announced for {n} pages, {want} expected")
            way = self._way(block)
        except Exception as e:  # noqa: BLE001 - a bad layout, or no memory for a staging pool
            self._fail_room(room, f"tpusync P/D: chunk from prefill rank {rank} refused: {e}")
            return
        # DECODE WAIT CONTRACT: the room stays WaitingForInput while its chunks land (as with
        # SGLang's own backends), so SGLang's waiting timeout still bounds it if the prefill's
        # final status never comes; SGLang times out WaitingForInput rooms only, and a decode
        # room marked Transferring here once waited forever for a prefill that aborted.
        with state.lock:
            state.ranks.setdefault(rank, _FromRank()).in_flight += 1
        fetch = _Fetch(room, rank, way, [], start, n, is_last, sl, kv_blocks)
        if blocks == 0:  # an empty last chunk: nothing on the wire
            self._land(fetch)
            return
        try:
            fetch.ids = way.pool.alloc(blocks)
        except Exception as e:  # noqa: BLE001
            self._landed(fetch)
            self._fail_room(room, f"tpusync P/D: no staging blocks for {blocks} blocks: {e}")
            return
        with self._lock:
            self._fetching[rid] = fetch
        try:
            way.consumer.start_recv(rid, peer, fetch.ids, deadline=self.recv_deadline)
        except Exception as e:  # noqa: BLE001
            with self._lock:
                self._fetching.pop(rid, None)
            way.pool.free(fetch.ids)
            self._landed(fetch)
            self._fail_room(room, f"tpusync P/D: fetch from {peer} not started: {e}")

    def _slice_from(self, raw: bytes) -> tuple[HeadSlice, int]:
        """The head slice from the prefill rank whose layout is ``raw`` to this rank, and the
        prefill's block size (its page item); ValueError when they cannot pair."""
        sl = self._slices.get(raw)
        if sl is None:
            src = RankLayout.from_json(raw)
            if len(set(src.item_lens)) != 1:
                raise ValueError(f"prefill KV buffers of several page sizes {src.item_lens}")
            sl = head_slice(src, self.layout)
            self._slices[raw] = sl
        return sl, sl.src_item[0]

    def _decode_fetch_loop(self) -> None:
        while not self._stopped:
            with self._lock:
                ways = list(self._ways.values())
            for way in ways:
                for r in way.consumer.poll():
                    if r.done or r.failed:
                        self._fetched(r)
            time.sleep(_FETCH_POLL_S)

    def _fetched(self, r: Any) -> None:
        with self._lock:
            fetch = self._fetching.pop(r.request_id, None)
        if fetch is None:
            return
        try:
            if r.failed:
                self._landed(fetch)
                self._fail_room(
                    fetch.room, f"tpusync P/D: fetching KV failed ({r.code}): {r.reason}"
                )
            else:
                self.received += len(fetch.ids)
                self.received_shm += len(fetch.ids) if r.shm else 0
                self._land(fetch)
        except Exception as e:  # noqa: BLE001
            logger.exception("tpusync P/D: landing room %s failed", fetch.room)
            self._fail_room(fetch.room, f"tpusync P/D: scatter failed: {e}")
        finally:
            fetch.way.pool.free(fetch.ids)

    def _landed(self, fetch: _Fetch) -> None:
        """A fetch that will not land (failed or never started) is no longer in flight."""
        state = self._recv_rooms.get(fetch.room)
        if state is not None:
            with state.lock:
                state.ranks[fetch.rank].in_flight -= 1

    def _land(self, fetch: _Fetch) -> None:
        """Scatter one pulled chunk into this rank's pages (HEAD SLICE CONTRACT) and, with its
        prefill rank's last chunk, the aux rows."""
        room = fetch.room
        state = self._recv_rooms.get(room)
        if state is None:
            return
        with state.lock:
            src = state.ranks[fetch.rank]
            src.in_flight -= 1
            if self.request_status.get(room) in (None, KVPoll.Failed):
                return  # ABORT CONTRACT: never write into an aborted room's pages
            assert state.dst_kv_indices is not None
            dst = state.dst_kv_indices[fetch.start : fetch.start + fetch.n]
            if len(dst) != fetch.n:
                raise ValueError(f"room {room}: {fetch.n} pages arrived for {len(dst)} slots")
            pool = fetch.way.pool
            segs, _ = stream_segments(fetch.slice, dst, pool.block_bytes, "dst")
            self._copy(_native.get_segments, pool, fetch.ids, segs)
            if fetch.is_last:
                if self.aux_bytes:
                    raw = np.concatenate([pool.view(b) for b in fetch.ids[fetch.kv_blocks :]])
                    off = 0
                    for t in self.aux_tables:
                        t[state.dst_aux_index][:] = raw[off : off + t.shape[1]]
                        off += t.shape[1]
                src.last_landed = True
        self._report_if_complete(room, fetch.rank)

    def _on_prefill_status(self, room: int, status: int, rank: int, reason: str | None) -> None:
        if status != KVPoll.Success:
            super().apply_prefill_status(
                bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason
            )
            return
        state = self._recv_rooms.get(room)
        if state is None:
            return
        with state.lock:
            state.ranks.setdefault(rank, _FromRank()).ok = True
        self._report_if_complete(room, rank)

    def _report_if_complete(self, room: int, rank: int) -> None:
        """Hand SGLang one prefill rank's Success once that rank reported Success AND its last
        chunk and every earlier one landed here; SGLang counts the ranks the room needs."""
        state = self._recv_rooms.get(room)
        if state is None:
            return
        with state.lock:
            src = state.ranks.get(rank)
            ready = (
                src is not None
                and src.ok
                and src.last_landed
                and src.in_flight == 0
                and not src.reported
                and not state.done
            )
            if ready:
                src.reported = True
        if ready:
            super().apply_prefill_status(
                bootstrap_room=room, status=KVPoll.Success, prefill_rank=rank
            )

    def abandon_room(self, room: int, why: str) -> None:
        """ABORT CONTRACT: abandon the room's fetches in flight (never blocks: a background
        thread calls :meth:`PdConsumer.abandon`, whose waits are bounded, so each prefill
        producer drops those chunks' blocks at once). Their staging blocks come back through the
        fetch loop, which sees them failed."""
        with self._lock:
            rids = [(rid, f.way) for rid, f in self._fetching.items() if f.room == room]
        for rid, way in rids:
            self._abandon.put((rid, way, f"room {room} {why}"))

    def _decode_abandon_loop(self) -> None:
        while True:
            item = self._abandon.get()
            if item is None or self._stopped:
                return
            rid, way, why = item
            try:
                for rel in way.consumer.abandon(rid, why):
                    if not rel.released and rel.code != "NotFound":
                        logger.info(
                            "tpusync P/D: prefill %s not told of abandoned chunk %s (%s): "
                            "its deadline frees it",
                            rel.peer,
                            rid,
                            rel.reason,
                        )
            except TpusyncError as e:  # already ended (landed, failed and polled): nothing held
                logger.debug("tpusync P/D: abandon of chunk %s: %s", rid, e)

    def _fail_room(self, room: int, reason: str) -> None:
        if self.request_status.get(room) == KVPoll.Failed:
            return  # the first failure stays the room's reason (e.g. SGLang's abort)
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    def forget_room(self, room: int) -> None:
        state = self._recv_rooms.pop(room, None)
        if state is not None:
            with state.lock:
                state.done = True


def _check_supported(args: KVArgs) -> None:
    lens = set(int(x) for x in args.kv_item_lens)
    if len(lens) != 1:
        raise ValueError(
            f"tpusync P/D backend: KV buffers must have one page size, got {sorted(lens)}"
        )
    if any(getattr(args, "state_data_ptrs", None) or []):
        raise ValueError("tpusync P/D backend: hybrid state buffers are not supported yet")


class TpusyncKVSender(CommonKVSender):
    """Prefill side of one request: SGLang's sender; chunks go to :class:`TpusyncKVManager`."""

    def abort(self) -> None:
        mgr, room = self.kv_mgr, self.bootstrap_room
        targets = mgr._room_notify_targets(room)  # before clear() forgets the room's peers
        super().abort()
        if mgr.request_status.get(room) == KVPoll.Failed:  # SGLang did abort it (owned room)
            with mgr.failure_lock:
                reason = mgr.failure_records.get(room) or "aborted by the prefill"
            mgr.prefill_aborted(room, targets, f"prefill: {reason}")


class TpusyncKVReceiver(CommonKVReceiver):
    """Decode side of one request: SGLang's receiver plus a guarded abort / clear."""

    def send_metadata(
        self,
        kv_indices: np.ndarray,
        aux_index: int | None = None,
        state_indices: list | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices: np.ndarray | None = None,
    ) -> None:
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("tpusync P/D backend: host KV destinations")
        super().send_metadata(
            kv_indices, aux_index, state_indices, decode_prefix_len, destination, device_kv_indices
        )

    def abort(self) -> None:
        state = self.kv_mgr._recv_rooms.get(self.bootstrap_room)
        if state is None:
            super().abort()
            return
        with state.lock:  # ABORT CONTRACT: no scatter runs past this point for this room
            super().abort()
        self.kv_mgr.abandon_room(self.bootstrap_room, "aborted by the decode")

    def _clear(self) -> None:
        super()._clear()
        self.kv_mgr.forget_room(self.bootstrap_room)


class TpusyncKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server, unchanged (rank registry over HTTP)."""
