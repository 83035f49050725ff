"""TransferFuture: one future type for every framework path (native engine, CUDA events, threads).

WAIT CONTRACT (as for native futures): ``result`` always waits with a timeout (default
``TPUSYNC_DEFAULT_TIMEOUT_S`` or 120 s) and raises :class:`tpusync.core.TimeoutError` when it
passes; the operation keeps running. A failed step (a dead peer, a refused id) fails the future
with the step's exception: no path hangs on a peer that went away.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tpusync.core.errors import TimeoutError as TpusyncTimeoutError

__all__ = [
    "LayeredTransfer",
    "TransferFuture",
    "after",
    "completed",
    "failed",
    "from_native",
    "gather",
    "watch",
]


def default_timeout() -> float:
    try:
        v = float(os.environ.get("TPUSYNC_DEFAULT_TIMEOUT_S", "120"))
    except ValueError:
        v = 120.0
    return v if v > 0 else 120.0


class TransferFuture(cf.Future):
    """A ``concurrent.futures.Future`` with tpusync's timeout rules and a ``keepalive`` slot.

    ``keepalive`` holds whatever must outlive the operation (native futures, staging tensors,
    CUDA events); it is dropped once the future completes.
    """

    def __init__(self, name: str = "transfer") -> None:
        super().__init__()
        self.name = name
        self.keepalive: list[Any] = []
        self.add_done_callback(lambda f: f.keepalive.clear())

    def result(self, timeout: float | None = None) -> Any:
        t = default_timeout() if timeout is None else timeout
        try:
            return super().result(timeout=t)
        except cf.TimeoutError:
            if self.done():
                return super().result(timeout=0)
            raise TpusyncTimeoutError(f"{self.name} not complete after {t} s") from None

    def wait(self, timeout: float) -> bool:
        """True once complete (successfully or not) within ``timeout`` seconds."""
        done, _ = cf.wait([self], timeout=timeout)
        return bool(done)

    @property
    def state(self) -> str:
        if not self.done():
            return "running" if self.running() else "pending"
        if self.cancelled():
            return "cancelled"
        return "failed" if self.exception(timeout=0) is not None else "done"

    def settle(self, fn: Callable[[], Any]) -> None:
        """Complete with fn()'s value, or with the exception it raised (once; later calls no-op)."""
        if cf.Future.done(self):
            return
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            with contextlib.suppress(cf.InvalidStateError):
                self.set_exception(e)
            return
        with contextlib.suppress(cf.InvalidStateError):
            self.set_result(value)


def completed(value: Any = None, name: str = "transfer") -> TransferFuture:
    f = TransferFuture(name)
    f.set_result(value)
    return f


def failed(error: BaseException, name: str = "transfer") -> TransferFuture:
    f = TransferFuture(name)
    f.set_exception(error)
    return f


class _NativeBacked(TransferFuture):
    """A TransferFuture over a ``tpusync.core.Future``.

    GIL CONTRACT: engine workers never run Python for it. Waiters wait on the native future
    (GIL released); callbacks (gather / after chains) are driven by the watcher thread, which
    polls the native future's ``done()``. Rejected alternative: the native ``add_done_callback``,
    which makes an engine worker take the GIL and stalls every copy behind a busy Python thread
    for up to the interpreter's switch interval.
    """

    def __init__(self, native: Any, name: str, value: Any) -> None:
        super().__init__(name)
        self._native = native
        self._value = value
        self.keepalive.append(native)
        watch(native.done, self._settle_native)

    def _settle_native(self) -> None:
        native, value = self._native, self._value
        self.settle(lambda: (native.result(timeout=0), value)[1])

    def _wait_native(self, timeout: float | None) -> None:
        if super().done():
            return
        t = default_timeout() if timeout is None else timeout
        if self._native.wait(t):
            self._settle_native()

    def done(self) -> bool:
        if not super().done() and self._native.done():
            self._settle_native()
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        self._wait_native(timeout)
        return super().result(timeout=0 if super().done() else timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait_native(timeout)
        return super().exception(timeout=0 if super().done() else timeout)

    def wait(self, timeout: float) -> bool:
        self._wait_native(timeout)
        return super().done()


def from_native(native: Any, name: str, value: Any = None) -> TransferFuture:
    """Wrap a ``tpusync.core.Future`` (see :class:`_NativeBacked`)."""
    return _NativeBacked(native, name, value)


def after(
    first: cf.Future,
    step: Callable[[Any], Any],
    name: str,
    cleanup: Callable[[], None] | None = None,
) -> TransferFuture:
    """A future for ``step(first.result())``; if ``step`` returns a future, its completion.

    ``cleanup`` runs once whatever happens (success, failure of either step), after both.
    """
    out = TransferFuture(name)
    if cleanup is not None:
        out.add_done_callback(lambda _f: cleanup())

    def on_first(f: cf.Future) -> None:
        if f.cancelled():
            out.set_exception(cf.CancelledError(f"{name}: previous step cancelled"))
            return
        err = f.exception()
        if err is not None:
            out.set_exception(err)
            return
        try:
            nxt = step(f.result())
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            out.set_exception(e)
            return
        if isinstance(nxt, cf.Future):
            out.keepalive.append(nxt)
            nxt.add_done_callback(lambda g: out.settle(lambda: g.result(timeout=0)))
        else:
            out.set_result(nxt)

    first.add_done_callback(on_first)
    return out


def gather(parts: Sequence[cf.Future], name: str, value: Any = None) -> TransferFuture:
    """Completes when every part has: with the first failure, else with ``value``."""
    out = TransferFuture(name)
    out.keepalive.extend(parts)
    if not parts:
        out.set_result(value)
        return out
    lock = threading.Lock()
    left = [len(parts)]

    def one(f: cf.Future) -> None:
        err = f.exception() if not f.cancelled() else cf.CancelledError(name)
        if err is not None:
            out.settle(lambda: _raise(err))
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out.settle(lambda: value)

    for p in parts:
        p.add_done_callback(one)
    return out


def _raise(err: BaseException) -> Any:
    raise err


class _Watcher:
    """One daemon thread that polls completion checks that have no callback (CUDA events) and
    deadlines. Polls back off from 20 us to 1 ms while anything is pending; idle it sleeps."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: list[tuple[Callable[[], bool], Callable[[], None], float | None]] = []
        self._thread: threading.Thread | None = None

    def add(
        self, check: Callable[[], bool], fire: Callable[[], None], deadline: float | None
    ) -> None:
        with self._cv:
            self._items.append((check, fire, deadline))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tpusync-watch", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        delay = 20e-6
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
            # Polling happens in a helper so that no reference to a finished item (and through
            # it to native futures and pools) survives in this frame while the thread idles.
            fired = self._poll_once()
            delay = 20e-6 if fired else min(delay * 2, 1e-3)
            time.sleep(delay)

    def _poll_once(self) -> bool:
        with self._cv:
            items = list(self._items)
        fired = []
        now = time.monotonic()
        for item in items:
            check, fire, deadline = item
            try:
                hit = check() or (deadline is not None and now >= deadline)
            except BaseException:  # noqa: BLE001 - the fire step reports it
                hit = True
            if hit:
                fired.append(item)
                with contextlib.suppress(Exception):  # fire() settles futures; never kill us
                    fire()
        with self._cv:
            for item in fired:
                self._items.remove(item)
        return bool(fired)


_WATCHER = _Watcher()


def watch(
    check: Callable[[], bool], fire: Callable[[], None], deadline: float | None = None
) -> None:
    """Call ``fire()`` once (on the watcher thread) when ``check()`` is true or at ``deadline``
    (a ``time.monotonic()`` value)."""
    _WATCHER.add(check, fire, deadline)


class LayeredTransfer:
    """Per-layer futures of one multi-layer transfer plus one future for all of it.

    A caller overlaps copy and compute by waiting for ``layer(i)`` right before layer i runs
    (or, on CUDA, by :meth:`tpusync.torch.KVCacheManager.wait_layer`, a stream wait).
    """

    def __init__(self, layers: dict[int, TransferFuture], overall: TransferFuture) -> None:
        self.layers = layers
        self.overall = overall

    def layer(self, i: int) -> TransferFuture:
        return self.layers[i]

    def done(self) -> bool:
        return self.overall.done()

    def wait(self, timeout: float) -> bool:
        return self.overall.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for every layer (each waited on directly), then for the whole transfer."""
        t = default_timeout() if timeout is None else timeout
        deadline = time.monotonic() + t
        for f in self.layers.values():
            f.wait(max(0.0, deadline - time.monotonic()))
        return self.overall.result(max(0.0, deadline - time.monotonic()))

    @property
    def state(self) -> str:
        return self.overall.state
