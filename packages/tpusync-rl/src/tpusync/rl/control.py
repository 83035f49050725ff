"""The weight-sync control plane: small signed msgpack messages over ZeroMQ.

Bulk bytes never travel here (they go through tpusync's P/D transport); this channel carries who
is in the group, version announcements (manifest, layouts, topology, addresses) and the samplers'
commit reports, to trainer rank 0.

AUTH CONTRACT: every message is ``[HMAC-SHA256(secret, body), body]`` with the same shared secret
as the data plane; a message whose MAC does not verify is dropped and logged, never parsed.
Replays of old announcements are harmless: versions only grow and a subscriber refuses anything
that does not follow its version. Rejected alternative: ZeroMQ CURVE, which would add libsodium
key management next to the transport's existing shared secret.

TIMEOUT CONTRACT: :meth:`ControlClient.request` returns within its timeout, with the reply or by
raising TimeoutError; after a timeout the socket is replaced, so a lost reply never wedges later
requests (a plain REQ socket would stay stuck waiting for it).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

log = logging.getLogger("tpusync.rl")


def _sign(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


def _unpack(secret: bytes, mac: bytes, body: bytes) -> dict | None:
    if not hmac.compare_digest(mac, _sign(secret, body)):
        log.error("control: dropped a message whose HMAC does not verify (wrong secret?)")
        return None
    try:
        msg = msgpack.unpackb(body, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - any malformed body is dropped the same way
        log.error("control: dropped a malformed message: %s", e)
        return None
    return msg if isinstance(msg, dict) else None


# A handler answers a request now (returns the reply) or later (returns None and keeps the
# `answer` callable, which may be called from any thread).
Handler = Callable[[dict, Callable[[dict], None]], "dict | None"]


_WAKE_NAMES = itertools.count()


class ControlServer:
    """A ROUTER socket served by one background thread; replies may be deferred (long polls)."""

    def __init__(self, secret: bytes, handler: Handler, listen: str = "tcp://127.0.0.1:0") -> None:
        self._secret = secret
        self._handler = handler
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(listen)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outbox: list[list[bytes]] = []
        self._out_lock = threading.Lock()
        # Never reused in this process: zmq unbinds a closed socket's inproc endpoint later, in
        # its reaper thread, so a name from id(self) (reused once an object is freed) made a new
        # server's bind fail with "Address already in use" now and then.
        self._wake_addr = f"inproc://tpusync-rl-control-{next(_WAKE_NAMES)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tpusync-rl-control", daemon=True)
        self._thread.start()

    def _send_later(self, ident: bytes, rid: bytes, reply: dict) -> None:
        body = msgpack.packb(reply)
        with self._out_lock:
            self._outbox.append([ident, rid, _sign(self._secret, body), body])
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            with self._out_lock:
                out, self._outbox = self._outbox, []
            for frames in out:
                try:
                    self._sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.ZMQError as e:  # the peer is gone: its reply is moot
                    log.warning("control: reply dropped: %s", e)
            if self._sock not in events:
                continue
            while self._sock.poll(0):
                frames = self._sock.recv_multipart()
                if len(frames) != 4:
                    log.error("control: dropped a request with %d frames", len(frames))
                    continue
                ident, rid, mac, body = frames
                msg = _unpack(self._secret, mac, body)
                if msg is None:
                    continue

                def answer(reply: dict, ident: bytes = ident, rid: bytes = rid) -> None:
                    self._send_later(ident, rid, reply)

                try:
                    reply = self._handler(msg, answer)
                except Exception as e:  # noqa: BLE001 - a bad request must not kill the server
                    log.exception("control: request %r failed", msg.get("op"))
                    reply = {"op": "error", "reason": f"{type(e).__name__}: {e}"}
                if reply is not None:
                    answer(reply)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in (self._sock, self._wake_rx, self._wake_tx):
            s.close(linger=0)


class ControlClient:
    """Request/reply to a :class:`ControlServer` with a timeout on every request."""

    def __init__(self, secret: bytes, address: str) -> None:
        self._secret = secret
        self._address = address
        self._ctx = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self._address)
        return self._sock

    def request(self, msg: dict[str, Any], timeout: float) -> dict:
        """Send ``msg``; the reply, or TimeoutError after ``timeout`` seconds."""
        body = msgpack.packb(msg)
        with self._lock:
            sock = self._socket()
            rid = next(self._ids).to_bytes(8, "little")
            sock.send_multipart([rid, _sign(self._secret, body), body])
            end = time.monotonic() + timeout
            while True:
                left = end - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    if time.monotonic() < end:
                        continue
                    sock.close(linger=0)  # TIMEOUT CONTRACT: a fresh socket for the next call
                    self._sock = None
                    raise TimeoutError(
                        f"control: no reply to {msg.get('op')!r} from {self._address} within "
                        f"{timeout:.1f} s"
                    )
                frames = sock.recv_multipart()
                if len(frames) != 3 or frames[0] != rid:
                    continue  # a late reply to an earlier, timed-out request
                reply = _unpack(self._secret, frames[1], frames[2])
                if reply is None:
                    continue
                if reply.get("op") == "error":
                    raise RuntimeError(f"control: {msg.get('op')!r} failed: {reply.get('reason')}")
                return reply

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
