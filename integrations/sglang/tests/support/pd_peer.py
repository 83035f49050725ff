"""One side (prefill or decode) of an SGLang P/D transfer on the tpusync backend, in its own process.

Run by tests/test_pd_backend.py: ``python pd_peer.py ROLE PORT SCENARIO [TP RANK [PP PP_RANK]]``. It builds
SGLang's real objects the way a scheduler does on CPU: a published (test) ServerArgs, SGLang's
``KVArgs`` over CPU torch KV buffers, the manager / sender / receiver / bootstrap server classes
resolved through SGLang's own ``get_kv_class`` after the tpusync plugin hooked in, and drives one
or more rooms through ``KVPoll`` exactly as the prefill / decode schedulers poll them. The last
stdout line is a JSON report (states seen per room, failure reasons, SHA-256 digests of the pages
involved).

Scenarios: ``ok`` (room 11: two chunks, then room 12 which the decode aborts once the prefill
offered its first chunk, without pulling it; the prefill must then free its staging blocks at
once, not at the send deadline), ``prefill_dies`` (the prefill offers the first chunk and exits),
``decode_dies`` (the decode sends its metadata, sees the first chunk offered without pulling it,
and exits; the prefill's offer must expire into Failed), ``tp`` (room 11 between servers of
different attention TP sizes: this process is attention TP rank RANK of TP; every rank holds its
kv heads of one seeded model cache, and a decode rank reports its pages next to the model's own
bytes for its heads; the decode leaves the model's kv heads unset in its ``KVArgs``, as SGLang's
decode does without staging), ``tp_bad`` (room 11 with a decode that declares twice the model's
kv heads in pages of the same size: the layouts cannot pair, and both sides must fail the room
with the reason), ``pp`` (room 11 from a prefill of PP pipeline stages, this process being stage
PP_RANK, which holds its layers of the seeded model cache, to a decode of one stage or of as
many: every stage fills the decode's buffers of its layers; the prefill stages share a real gloo
group, which SGLang's consensus store of room states needs), ``prefill_aborts`` (the prefill
scheduler aborts room 31 after the decode pulled its first chunk and room 32 before any chunk,
each followed by ``clear()`` as SGLang's scheduler does; the prefill stays up, heartbeats
answered, until the decode touches ``$TPUSYNC_TEST_DONE_FILE``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import cpu_shim  # noqa: E402 - before anything imports sglang

cpu_shim.install()

import torch  # noqa: E402

LAYERS, PAGE, HEADS, DIM, PAGES = 3, 4, 2, 16, 16
AUX_ROWS, AUX_WIDTH = 8, 16
SRC_PAGES = [7, 3, 9, 1, 12]  # prefill page indices of the request (two chunks: 2 + 3 pages)
DST_PAGES = [2, 14, 5, 11, 0]  # decode page indices it asks for
DST_PAGES_ABORTED = [4, 6, 8, 10, 13]  # room 12 (aborted): must stay zero
SRC_AUX, DST_AUX = 3, 5
TIMEOUT_S = 300.0  # generous: SGLang imports take minutes on a loaded 2-core machine


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def rank_heads(tp: int, rank: int) -> tuple[int, int]:
    """The model kv heads attention TP rank ``rank`` of ``tp`` holds (SGLang's split)."""
    if HEADS % tp == 0:
        return rank * (HEADS // tp), (rank + 1) * (HEADS // tp)
    return rank // (tp // HEADS), rank // (tp // HEADS) + 1


def model_cache() -> list:
    """Every kv head of every KV buffer, the same in every process (seeded)."""
    g = torch.Generator().manual_seed(7)
    shape = (PAGES * PAGE, HEADS, DIM)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2 * LAYERS)]


def stage_layers(pp: int, pp_rank: int) -> list[int]:
    """The model layers pipeline stage ``pp_rank`` of ``pp`` holds (earlier stages get the
    remainder, as SGLang splits them)."""
    per, extra = divmod(LAYERS, pp)
    start = pp_rank * per + min(pp_rank, extra)
    return list(range(start, start + per + (pp_rank < extra)))


class PipelineGroup:
    """The part of SGLang's pipeline GroupCoordinator that its P/D consensus store uses, over a
    real torch.distributed gloo group of the prefill's stages (TPUSYNC_TEST_PP_PORT)."""

    def __init__(self, pp: int, pp_rank: int) -> None:
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{os.environ['TPUSYNC_TEST_PP_PORT']}",
            rank=pp_rank,
            world_size=pp,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        self.world_size, self.rank_in_group = pp, pp_rank
        self.is_first_rank, self.is_last_rank = pp_rank == 0, pp_rank == pp - 1

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        import torch.distributed as dist

        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def setup(role: str, port: int, scenario: str, tp: int, rank: int, pp: int = 1, pp_rank: int = 0):
    from sglang.srt.runtime_context import get_context, get_parallel

    from tpusync.sglang import pd_plugin

    pd_plugin.install_now()  # what SGLang's load_plugins() does with our entry point
    get_context().override_server_args(
        disaggregation_mode=role,
        disaggregation_bootstrap_port=port,
        disaggregation_transfer_backend="tpusync",
        host="127.0.0.1",
        device="cpu",
        tp_size=tp,
        pp_size=pp,
    ).install()
    group = PipelineGroup(pp, pp_rank) if role == "prefill" and pp > 1 else None
    get_parallel().override_permanently(
        attn_tp_rank=rank, attn_cp_rank=0, attn_dcp_rank=0, attn_dp_rank=0, tp_rank=rank,
        pp_rank=pp_rank, pp_group=group,
    )  # fmt: skip
    assert get_parallel().pp_size == pp
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend("tpusync")  # raises ValueError unless the plugin hooked in
    classes = {t: get_kv_class(backend, t) for t in KVClassType}
    torch.manual_seed(1 if role == "prefill" else 2)
    lo, hi = rank_heads(tp, rank)
    shape = (PAGES * PAGE, hi - lo, DIM)
    layers = stage_layers(pp, pp_rank)
    if scenario == "pp":  # K of every layer of this stage, then V (SGLang's buffer order)
        model = model_cache()
        bufs = [model[kv * LAYERS + i][:, lo:hi].clone() for kv in (0, 1) for i in layers]
        if role == "decode":
            bufs = [torch.zeros_like(b) for b in bufs]
    elif role == "prefill" and tp == 1 and scenario != "tp":
        k = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
        v = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
        bufs = k + v
    elif role == "prefill":  # every prefill rank: its heads of the one model cache
        bufs = [b[:, lo:hi].clone() for b in model_cache()]
    else:
        bufs = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    if role == "prefill":
        aux = torch.randint(0, 2**20, (AUX_ROWS, AUX_WIDTH), dtype=torch.int32)
    else:
        aux = torch.zeros((AUX_ROWS, AUX_WIDTH), dtype=torch.int32)
    args = classes[KVClassType.KVARGS]()
    args.engine_rank = rank
    args.kv_data_ptrs = [b.data_ptr() for b in bufs]
    args.kv_data_lens = [b.nbytes for b in bufs]
    args.kv_item_lens = [b[0].nbytes * PAGE for b in bufs]
    args.kv_layer_ids = layers * 2
    args.kv_cache_dtype_str = "bfloat16"
    args.aux_data_ptrs = [aux.data_ptr()]
    args.aux_data_lens = [aux.nbytes]
    args.aux_item_lens = [aux[0].nbytes]
    args.state_types = []
    args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], []
    args.state_layer_ids = []
    args.page_size = PAGE
    args.pp_rank = pp_rank
    args.system_dp_rank = 0
    args.prefill_start_layer, args.prefill_end_layer = layers[0], layers[-1] + 1
    if role == "prefill" or scenario not in ("tp", "tp_bad"):
        args.kv_head_num, args.total_kv_head_num = hi - lo, HEADS
    elif scenario == "tp_bad":  # a decode of another model: 4 kv heads, the same page bytes
        args.kv_head_num, args.total_kv_head_num = 2 * (hi - lo), 2 * HEADS
    args.rust_http_port = None
    args.is_hybrid_mla_backend = False
    return classes, args, bufs, aux


def digests(bufs, aux, pages, aux_row) -> dict:
    per_page = []
    for p in pages:
        h = hashlib.sha256()
        for b in bufs:
            h.update(b[p * PAGE : (p + 1) * PAGE].contiguous().view(torch.uint8).numpy().tobytes())
        per_page.append(h.hexdigest())
    return {"pages": per_page, "aux": hashlib.sha256(aux[aux_row].numpy().tobytes()).hexdigest()}


def wait_for(obj, targets, states: list, timeout: float = TIMEOUT_S) -> int:
    from sglang.srt.disaggregation.base.conn import KVPoll

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = int(obj.poll())
        if not states or states[-1] != s:
            states.append(s)
        if s in targets or s == KVPoll.Failed:
            return s
        time.sleep(0.005)
    raise TimeoutError(f"no state in {targets} after {timeout}s; seen {states}")


def reason(obj) -> str | None:
    try:
        obj.failure_exception()
    except Exception as e:  # noqa: BLE001 - SGLang's KVTransferError
        return f"{type(e).__name__}: {e}"
    return None


def prefill(port: int, scenario: str, tp: int, rank: int, pp: int, pp_rank: int) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType
    from sglang.srt.runtime_context import get_server_args

    classes, args, bufs, aux = setup("prefill", port, scenario, tp, rank, pp, pp_rank)
    first = rank == 0 and pp_rank == 0
    server = classes[KVClassType.BOOTSTRAP_SERVER]("127.0.0.1", port) if first else None
    mgr = classes[KVClassType.MANAGER](args, DisaggregationMode.PREFILL, get_server_args(), False)
    report = {"role": "prefill", "manager": type(mgr).__name__, "rooms": {}}
    slow = float(os.environ.get("TPUSYNC_TEST_SLOW_COPY_S", "0"))
    if slow:
        # Every second staging copy (the second decode peer's copy of each chunk) waits ``slow``
        # seconds; the report says how many copies were done when the room was concluded.
        real_copy, real_conclude = mgr._copy, mgr.conclude_transfer
        copies: list[int] = [0]
        report["copies_at_success"] = []

        def slow_copy(*a: object) -> None:
            if copies[0] % 2 == 1:
                time.sleep(slow)
            real_copy(*a)
            copies[0] += 1

        def conclude(*a: object, **kw: object) -> None:
            if kw.get("status") == KVPoll.Success:
                report["copies_at_success"].append(copies[0])
            real_conclude(*a, **kw)

        mgr._copy, mgr.conclude_transfer = slow_copy, conclude
    say(event="ready")
    if scenario == "prefill_aborts":
        _prefill_aborts(classes, mgr, port, report)
        rooms = []
    else:
        rooms = {"ok": [11, 12], "tp": [11], "tp_bad": [11], "pp": [11]}.get(scenario, [21])
    for room in rooms:
        states: list[int] = []
        sender = classes[KVClassType.SENDER](mgr, f"127.0.0.1:{port}", room)
        sender.init(len(SRC_PAGES), aux_index=SRC_AUX)
        s = wait_for(sender, {KVPoll.WaitingForInput}, states)
        if s == KVPoll.WaitingForInput:
            sender.send(torch.tensor(SRC_PAGES[:2], dtype=torch.int32).numpy())
            if scenario == "prefill_dies":
                time.sleep(0.05)
                say(event="exiting")
                os._exit(3)
            sender.send(torch.tensor(SRC_PAGES[2:], dtype=torch.int32).numpy())
            s = wait_for(sender, {KVPoll.Success}, states)
        entry = {
            "states": states,
            "final": s,
            "reason": reason(sender) if s == KVPoll.Failed else None,
            **digests(bufs, aux, SRC_PAGES, SRC_AUX),
        }
        if room == 12:
            # ABORT CONTRACT: the aborted room's offers are cancelled, so the staging pool is
            # whole again long before TPUSYNC_SGLANG_SEND_DEADLINE_S (6 s in the test); wait at
            # most half of it (bounded), then report what is still held.
            end = time.monotonic() + 3.0
            while time.monotonic() < end and (
                mgr.producer.pending or mgr.pool.num_free != mgr.pool.num_blocks
            ):
                time.sleep(0.01)
            entry["pool_free"] = mgr.pool.num_free
            entry["pool_blocks"] = mgr.pool.num_blocks
            entry["offers_left"] = mgr.producer.pending
        report["rooms"][room] = entry
    mgr.teardown()
    if server is not None:
        server.close()
    say(**report)


def _prefill_aborts(classes, mgr, port: int, report: dict) -> None:
    """The prefill scheduler aborts room 31 after its first chunk was pulled, room 32 before any
    chunk (``sender.abort()`` then ``clear()``), then stays up until the decode is done."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType

    for room in (31, 32):
        states: list[int] = []
        sender = classes[KVClassType.SENDER](mgr, f"127.0.0.1:{port}", room)
        sender.init(len(SRC_PAGES), aux_index=SRC_AUX)
        wait_for(sender, {KVPoll.WaitingForInput}, states)
        if room == 31:
            sender.send(torch.tensor(SRC_PAGES[:2], dtype=torch.int32).numpy())
            end = time.monotonic() + 60.0  # until the decode acknowledged the chunk
            while time.monotonic() < end and (
                room not in mgr._room_offers or mgr._room_offers[room]
            ):
                time.sleep(0.01)
            states.append(int(sender.poll()))
        sender.abort()
        states.append(int(sender.poll()))
        sender.clear()
        report["rooms"][room] = {"states": states}
    done = Path(os.environ["TPUSYNC_TEST_DONE_FILE"])
    end = time.monotonic() + TIMEOUT_S
    while time.monotonic() < end and not done.exists():
        time.sleep(0.05)


def decode(port: int, scenario: str, tp: int, rank: int, pp: int, pp_rank: int) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType
    from sglang.srt.runtime_context import get_server_args

    classes, args, bufs, aux = setup("decode", port, scenario, tp, rank, pp, pp_rank)
    mgr = classes[KVClassType.MANAGER](args, DisaggregationMode.DECODE, get_server_args(), False)
    addr = f"127.0.0.1:{port}"
    end = time.monotonic() + TIMEOUT_S
    while not mgr.try_ensure_parallel_info(addr):  # the decode scheduler's retry loop
        if time.monotonic() > end:
            raise TimeoutError("no prefill parallel info from the bootstrap server")
        time.sleep(0.2)
    report = {"role": "decode", "rooms": {}}
    rooms = {"ok": [11, 12], "tp": [11], "tp_bad": [11], "pp": [11]}.get(scenario, [21])
    if scenario == "prefill_aborts":
        rooms = []
        for room in (31, 32):
            states: list[int] = []
            receiver = classes[KVClassType.RECEIVER](mgr, addr, room)
            receiver.init(0)
            wait_for(receiver, {KVPoll.WaitingForInput}, states)
            receiver.send_metadata(
                torch.tensor(DST_PAGES, dtype=torch.int32).numpy(), aux_index=DST_AUX
            )
            t0 = time.monotonic()
            s = wait_for(receiver, {KVPoll.Success}, states, timeout=60.0)
            report["rooms"][room] = {
                "states": states,
                "final": s,
                "after_s": round(time.monotonic() - t0, 2),
                "reason": reason(receiver) if s == KVPoll.Failed else None,
            }
            receiver.clear()
        Path(os.environ["TPUSYNC_TEST_DONE_FILE"]).touch()
    for room in rooms:
        states: list[int] = []
        receiver = classes[KVClassType.RECEIVER](mgr, addr, room)
        states.append(int(receiver.poll()))
        receiver.init(0)
        s = wait_for(receiver, {KVPoll.WaitingForInput}, states)
        dst = DST_PAGES_ABORTED if room == 12 else DST_PAGES
        if scenario == "decode_dies":
            offered = threading.Event()
            mgr._start_fetch = lambda msg, seen=offered: seen.set()  # no pull: about to die
        if room == 12:
            # Abort once the prefill offered a chunk of this room, which is not pulled (so the
            # prefill holds it; a pull would also race the abort for the room's pages).
            offered = threading.Event()
            real_fetch = mgr._start_fetch

            def fetch_unless_room_12(msg, seen=offered, real=real_fetch):
                if int(msg[1]) == 12:
                    seen.set()
                else:
                    real(msg)

            mgr._start_fetch = fetch_unless_room_12
        receiver.send_metadata(
            torch.tensor(dst, dtype=torch.int32).numpy(), aux_index=DST_AUX + (room == 12)
        )
        if scenario == "decode_dies":
            # Die only once the metadata reached the prefill, and before any byte is pulled: ZMQ
            # sends from a background thread, so os._exit right after send_metadata can drop the
            # message (the prefill would then sit in Bootstrapping until SGLang's bootstrap
            # timeout). The prefill's first chunk offer shows it has the metadata; this decode
            # never pulls it (its fetch is replaced above), then dies.
            if not offered.wait(timeout=60.0):
                say(event="no chunk offered")
            say(event="exiting")
            os._exit(3)
        if room == 12:
            if not offered.wait(timeout=60.0):
                say(event="no chunk offered for room 12")
            receiver.abort()
        s = wait_for(receiver, {KVPoll.Success}, states)
        why = reason(receiver) if s == KVPoll.Failed else None
        if room == 12:
            # Keep the room's pages unreachable for a while: a late scatter would show here.
            time.sleep(1.0)
        report["rooms"][room] = {
            "states": states,
            "final": s,
            "reason": why,
            **digests(bufs, aux, dst, DST_AUX + (room == 12)),
        }
        if scenario in ("tp", "pp"):  # the model's own bytes of this rank's heads and layers
            lo, hi = rank_heads(tp, rank)
            model, layers = model_cache(), stage_layers(pp, pp_rank)
            mine = [model[kv * LAYERS + i][:, lo:hi].contiguous() for kv in (0, 1) for i in layers]
            report["rooms"][room]["model_pages"] = digests(mine, aux, SRC_PAGES, DST_AUX)["pages"]
            report["rooms"][room]["heads"] = [lo, hi]
            report["rooms"][room]["layers"] = layers
        receiver.clear()
    report["received"], report["received_shm"] = mgr.received, mgr.received_shm
    mgr.teardown()
    say(**report)


if __name__ == "__main__":
    role, port, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tp, rank = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (1, 0)
    pp, pp_rank = (int(sys.argv[6]), int(sys.argv[7])) if len(sys.argv) > 7 else (1, 0)
    (prefill if role == "prefill" else decode)(port, scenario, tp, rank, pp, pp_rank)
