"""The wire end of one trainer or sampler process: a host block pool, the P/D producer that
serves it (TCP, and a Unix socket for same-host peers), a P/D consumer that pulls into it, and
the address peers reach it at (which also says how a same-host peer can tell that this process
exited: :func:`_process_identity`), and ``FILL_THREADS``, the threads a process fills or hashes
its pool blocks on.

ACK LEDGER CONTRACT: see :class:`_Endpoint`; every poll of the producer goes through it.
"""

from __future__ import annotations

import math
import numbers
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from typing import Any

from tpusync.core import NotFoundError, PoolExhaustedError
from tpusync.core.pd import PdConsumer, PdProducer
from tpusync.core.pool import HostBlockPool, _counts, reclaim_stale_segments
from tpusync.rl.pack import MIN_PIECE

# Threads that pack and hash a trainer's blocks, and that hash an in-place shared-segment
# reader's blocks ahead of its staging copy: two keeps both cores of a 2-vCPU host busy while the
# samplers or the transport wait; more buys nothing once the copies saturate memory bandwidth.
FILL_THREADS = 2


def _process_identity() -> dict[str, Any]:
    """This process as a same-host peer can check it: pid, pid namespace and start time (clock
    ticks since boot, so a reused pid is told apart). Empty where /proc is not readable."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return {}
    return {"pid": os.getpid(), "pidns": ns, "started": started}


def _process_gone(ident: Mapping[str, Any]) -> bool:
    """True when the process ``ident`` (from :func:`_process_identity` in this pid namespace)
    has exited: no such pid, a zombie, or the pid now names a younger process."""
    try:
        with open(f"/proc/{int(ident['pid'])}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    except (OSError, ValueError, KeyError):
        return False  # cannot tell: the deadline decides, as for a remote sampler
    return fields[0] in ("Z", "X") or int(fields[19]) != int(ident.get("started", -1))


MIN_BLOCK_BYTES = 2 * MIN_PIECE  # what pack_streams needs to cut pieces


def check_args(owner: str, seconds: Mapping[str, float], **counts: int) -> None:
    """Counts and durations of TrainerSync / SamplerSync, refused by name before anything starts
    (a zero block size divided by zero; a float bucket count or a negative pool failed only in
    publish, after the version was announced; an infinite silence killed the heartbeat thread)."""
    _counts(owner, **counts)
    if "block_bytes" in counts and counts["block_bytes"] < MIN_BLOCK_BYTES:
        raise ValueError(
            f"{owner}: block_bytes must be at least {MIN_BLOCK_BYTES}, got {counts['block_bytes']}"
        )
    for name, v in seconds.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < math.inf:
            raise ValueError(f"{owner}: {name} must be a finite number of seconds > 0, got {v!r}")


class _Endpoint:
    """A host pool plus a P/D producer serving it (TCP, and a Unix socket for same-host peers)."""

    def __init__(
        self,
        secret: bytes,
        block_bytes: int,
        pool_bytes: int,
        listen: str,
        same_host: bool,
        streams: int,
    ) -> None:
        num = max(pool_bytes // block_bytes, 4)
        self._dir = tempfile.mkdtemp(prefix="tpusync-rl-") if same_host else None
        shm = f"tpusync-rl-{os.getpid()}-{uuid.uuid4().hex[:8]}" if same_host else None
        if shm:  # pools of killed trainers / samplers (OWNER LOCK CONTRACT): removed, not piled up
            reclaim_stale_segments("tpusync-rl-")
        self.pool = HostBlockPool(block_bytes, num, shm_name=shm)
        unix = os.path.join(self._dir, "pd.sock") if self._dir else None
        self.producer = PdProducer(self.pool, listen=listen, unix_path=unix, secret=secret)
        self.consumer = PdConsumer(self.pool, streams=streams, secret=secret)
        self.address = {
            "tcp": self.producer.address,
            "unix": self.producer.unix_address,
            "host": socket.gethostname(),
            # Same-host peers may map this pool (SHARED-SEGMENT CONTRACT, sharing.py).
            "shm": shm,
            # ...and notice at once when this process exits (EXIT WATCH CONTRACT, membership.py).
            "proc": _process_identity(),
        }
        # ACK LEDGER CONTRACT: the producer reports a terminal (done / failed) send once, to
        # whichever caller polls first. Every poll of this endpoint's producer goes through
        # :meth:`poll_sends`, which keeps terminal statuses here until their owner takes them
        # (:meth:`take_send`) or a new version starts (:meth:`forget_sends`). Rejected: polling
        # the producer directly from several places (the pool wait used to drop acknowledgements
        # that the trainer's ack wait then waited for until the version's deadline: the 61 s
        # stall of a 1 GiB publish whose data outgrew the trainer's pool).
        self._sent: dict[int, Any] = {}

    def peer(self, addr: Mapping[str, Any]) -> str:
        if addr.get("unix") and addr.get("host") == self.address["host"] and self._dir:
            return addr["unix"]
        return addr["tcp"]

    def poll_sends(self) -> list[Any]:
        """Poll the producer; terminal statuses go to the ledger. Returns the pending ones."""
        pending = []
        for st in self.producer.poll():
            if st.state == "pending":
                pending.append(st)
            else:
                self._sent[st.request_id] = st
        return pending

    def cancel_send(self, rid: int, why: str) -> None:
        """End send ``rid`` as failed now (CANCEL CONTRACT); one that already ended (acknowledged
        or expired) has nothing left to free."""
        try:
            self.producer.cancel(rid, why)
        except NotFoundError:
            pass

    def take_send(self, rid: int) -> Any | None:
        """The terminal status of send ``rid`` (removed from the ledger), None while pending."""
        return self._sent.pop(rid, None)

    def forget_sends(self) -> None:
        """Drop the ledger (statuses of earlier versions nobody waits for any more)."""
        self.poll_sends()
        self._sent.clear()

    def alloc(self, n: int, deadline: float, on_wait: Any = None) -> list[int]:
        """``n`` blocks, waiting for in-flight ones to be released until ``deadline``
        (``on_wait()`` runs in every round of the wait)."""
        while True:
            try:
                return self.pool.alloc(n)
            except PoolExhaustedError:
                if time.monotonic() >= deadline:
                    raise
                self.poll_sends()  # never drops an acknowledgement (ACK LEDGER CONTRACT)
                if on_wait is not None:
                    on_wait()
                time.sleep(0.002)

    def drain(self, timeout: float) -> int:
        """Serve registered sends until none is pending or ``timeout`` passes; returns how many
        are still pending (their consumers then see the producer go away)."""
        end = time.monotonic() + max(timeout, 0.0)
        while True:
            left = len(self.poll_sends())
            if left == 0 or time.monotonic() >= end:
                return left
            time.sleep(0.005)

    def close(self) -> None:
        """Stop the producer and the consumer and drop the pool: its memory (and /dev/shm
        segment) goes once nothing else holds it, not when the owner object is collected."""
        self.producer.close()
        self.consumer.close()
        # Each of them holds the pool too.
        self.pool = self.producer = self.consumer = None  # type: ignore[assignment]
        if self._dir:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
            self._dir = None
