"""Emulated hosts for benchmarks and tests: network namespaces behind one bridge, each with its
own address and, for benchmarks, a link shaped to a rate.

A benchmark on one machine talks over loopback, where the CPU, not a link, sets every rate. A
cluster's hosts each have a NIC of a fixed rate; what a topology (a chain, a broadcast from one
root) gains there comes from which NIC carries how many copies of each byte. This module gives a
benchmark such hosts on one machine.

HOSTS CONTRACT: ``emulated_hosts(n, gbit)`` creates ``n`` host namespaces and one hub namespace
holding a bridge; host ``i`` has one interface, ``eth0``, with the address ``10.232.<k>.<i+1>``
(``k`` from this process's pid), joined to the bridge by a veth pair. With ``gbit``, each host's
link is a full-duplex NIC of ``gbit`` Gbit/s: both the host's egress (what it sends) and the
bridge port's egress towards it (what it receives) are shaped to that rate; with None the links
are not shaped (the multi-host tests, which need addresses, not rates). Each shaped egress is
``Host.queue``: ``"sparse-first"`` where the kernel has htb and the u32 classifier (packets under
128 bytes, pure ACKs and control messages, leave ahead of bulk data, as the sparse flows of
fq_codel, the default queue of Linux hosts, do; bulk data waits in a FIFO of 10 ms of the rate),
else ``"fifo"`` (one ``tc`` tbf with a 10 ms queue, where a host's ACKs wait behind the data it
sends). The hosts see only
each other; nothing touches the machine's own interfaces or addresses. Every namespace is removed
on exit, also when the body raises. Needs root and iproute2 (``ip``, ``tc``);
:func:`unavailable` says why not where they are missing.

A process joins a host with :func:`enter` before it opens any socket (``setns`` moves the calling
thread; threads it starts afterwards inherit the namespace), or runs a command under
``Host.prefix`` (``ip netns exec``).

Why sparse-first: with one FIFO per egress, a host that sends and receives bulk data at once (the
middle of a chain) queues the ACKs of what it receives behind up to 10 ms of what it sends, and
its sender slows: on 2 Gbit/s links the first sampler of a chain of four that forwards every block
as it lands finished ~5% later than with a sampler that forwards between buckets. Real hosts do
not pay that (fq_codel, or fq, serve a flow of small packets first), so the emulation would blame
the chain for its own queue. A host that only sends or only receives bulk (iperf3, gloo's root
and its ranks) runs the same under both. Rejected: shaping only the bridge ports (a host could
then send at the full rate to each of several hosts at once: gloo's root would get two NICs).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
IFNAME = "eth0"


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace and its address on the shared bridge."""

    ns: str
    addr: str
    queue: str | None = None  # its link's egress queues: "sparse-first", "fifo", None (unshaped)

    @property
    def prefix(self) -> list[str]:
        """Command prefix that runs a program on this host."""
        return ["ip", "netns", "exec", self.ns]


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "they need root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"they need iproute2 ({tool!r} not found)"
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"emulated hosts: {' '.join(cmd)} failed: {proc.stderr.strip()}")


SPARSE_BYTES = 128  # IP packets shorter than this leave first (pure ACKs, control messages)


def _shape(ns: str, dev: str, gbit: float) -> str:
    """Shapes ``dev``'s egress to ``gbit`` and returns its ``Host.queue`` (HOSTS CONTRACT)."""
    # burst: at least one tick of the rate at HZ=100 (else a token bucket cannot reach it) and
    # 64 KiB (a GSO segment); bulk queue: 10 ms of traffic (dropped beyond it; with the FIFO
    # token bucket 2, 5 and 50 ms gave the same chain times).
    burst = max(int(gbit * 1e9 / 8 / 100), 64 << 10)
    queue = max(int(gbit * 1e9 / 8 * 0.010), 64 << 10)
    rate = f"{gbit:g}gbit"
    tc = ["ip", "netns", "exec", ns, "tc"]
    try:
        _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst))  # fmt: skip
        for cls, prio, share in (("10", "0", 0.05), ("20", "1", 0.95)):
            _run(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", f"1:{cls}", "htb",
                 "rate", f"{gbit * share:g}gbit", "ceil", rate, "prio", prio, "quantum", "60000",
                 "burst", str(burst), "cburst", str(burst))  # fmt: skip
        _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "pfifo")
        _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "bfifo",
             "limit", str(queue))  # fmt: skip
        # The IPv4 total length (offset 2) below SPARSE_BYTES: the sparse class.
        _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "u16", "0", f"{0xFFFF & ~(SPARSE_BYTES - 1):#06x}", "at", "2",
             "flowid", "1:10")  # fmt: skip
        return "sparse-first"
    except RuntimeError:  # this kernel lacks htb or u32: one FIFO token bucket
        subprocess.run([*tc, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
        _run(*tc, "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", rate, "burst", str(burst), "latency", "10ms")  # fmt: skip
        return "fifo"


@contextmanager
def emulated_hosts(n: int, gbit: float | None) -> Iterator[list[Host]]:
    """``n`` hosts with ``gbit`` Gbit/s full-duplex links (None: unshaped) to one bridge (HOSTS
    CONTRACT)."""
    if n < 1 or n > 250:
        raise ValueError(f"emulated hosts: n must be 1..250, not {n}")
    if gbit is not None and not gbit > 0:
        raise ValueError(f"emulated hosts: the link rate must be > 0 Gbit/s, not {gbit}")
    why = unavailable()
    if why:
        raise RuntimeError(f"emulated hosts cannot be made here: {why}")
    tag = f"{os.getpid() % 100000:05d}"
    subnet = f"10.232.{os.getpid() % 250 + 1}"
    hub = f"tpe{tag}hub"
    names = [f"tpe{tag}h{i}" for i in range(n)]
    made: list[str] = []
    queues: list[str | None] = []
    try:
        _run("ip", "netns", "add", hub)
        made.append(hub)
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        for i, ns in enumerate(names):
            port = f"p{i}"
            _run("ip", "netns", "add", ns)
            made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", IFNAME, "netns", ns, "type", "veth",
                 "peer", "name", port, "netns", hub)  # fmt: skip
            _run("ip", "-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            _run("ip", "-n", hub, "link", "set", port, "master", "br0")
            _run("ip", "-n", hub, "link", "set", port, "up")
            queue = None
            if gbit is not None:
                sends = _shape(ns, IFNAME, gbit)  # what host i sends
                receives = _shape(hub, port, gbit)  # what host i receives
                queue = sends if sends == receives else "fifo"
            queues.append(queue)
        yield [Host(ns, f"{subnet}.{i + 1}", queues[i]) for i, ns in enumerate(names)]
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def enter(ns: str) -> None:
    """Move the calling thread into host ``ns``'s network namespace (call before any socket or
    thread is made: see the module doc)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise PermissionError(f"emulated hosts: cannot enter {ns} ({os.strerror(err)})")
    finally:
        os.close(fd)
