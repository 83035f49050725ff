"""Emulated hosts (tpusync.core.bench.hosts, HOSTS CONTRACT): namespaces with shaped links that
reach each other and nothing else, joined with ``enter``, removed even when the body raises.

The namespace tests run only as root with iproute2 and TPUSYNC_NETNS=1 (the `multihost` nox
session sets it; CI runs as root)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from tpusync.core.bench import hosts

netns = pytest.mark.skipif(
    os.environ.get("TPUSYNC_NETNS") != "1" or hosts.unavailable() is not None,
    reason="emulated hosts need root, iproute2 and TPUSYNC_NETNS=1 (nox -s multihost)",
)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _tc(ns: str, *what: str) -> str:
    """What ``tc *what`` prints in namespace ``ns``."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *what], capture_output=True, text=True, timeout=30
    )
    return out.stdout


def _qdisc(ns: str, dev: str) -> str:
    return _tc(ns, "qdisc", "show", "dev", dev)


def _classes(ns: str, dev: str) -> str:
    return _tc(ns, "-s", "class", "show", "dev", dev)


def _sent(ns: str, dev: str, classid: str) -> tuple[int, int]:
    """Bytes and packets the htb class ``classid`` of ``dev`` has sent."""
    shown = _classes(ns, dev)
    m = re.search(rf"class htb {classid} .*?\n Sent (\d+) bytes (\d+) pkt", shown)
    assert m, shown
    return int(m.group(1)), int(m.group(2))


def test_bad_arguments_are_refused_before_anything_is_made():
    with pytest.raises(ValueError, match="n must be 1..250"):
        with hosts.emulated_hosts(0, 1.0):
            pass
    with pytest.raises(ValueError, match="link rate must be > 0"):
        with hosts.emulated_hosts(2, 0.0):
            pass


@netns
def test_hosts_talk_over_shaped_links_and_enter_moves_a_process():
    with hosts.emulated_hosts(2, 0.5) as on:
        assert {h.ns for h in on} <= _namespaces()
        assert len({h.addr for h in on}) == 2
        hub = on[0].ns[: -len("h0")] + "hub"
        # Both directions of each link are shaped: the host's egress and the bridge port's,
        # small packets first where the kernel has htb and u32 (this machine's has).
        for i, h in enumerate(on):
            assert h.queue == "sparse-first"
            for ns, dev in ((h.ns, hosts.IFNAME), (hub, f"p{i}")):
                shown = _classes(ns, dev)
                assert "class htb 1:1 " in shown and "rate 500Mbit" in shown, (ns, dev, shown)
        # The hosts' addresses are not this namespace's.
        with socket.socket() as s, pytest.raises(OSError):
            s.bind((on[0].addr, 0))
        server = subprocess.Popen(
            [*on[1].prefix, sys.executable, "-c", textwrap.dedent(f"""
                import socket
                s = socket.create_server(("{on[1].addr}", 7611))
                print("listening", flush=True)
                c, _ = s.accept()
                data = b""
                while len(data) < 1 << 20:
                    data += c.recv(1 << 16)
                c.sendall(len(data).to_bytes(8, "little"))
            """)],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            assert server.stdout.readline().strip() == "listening"
            client = subprocess.run(
                [sys.executable, "-c", textwrap.dedent(f"""
                    import socket
                    from tpusync.core.bench import hosts
                    hosts.enter("{on[0].ns}")
                    c = socket.create_connection(("{on[1].addr}", 7611), timeout=30)
                    print(c.getsockname()[0])
                    c.sendall(bytes(1 << 20))
                    print(int.from_bytes(c.recv(8), "little"))
                """)],
                capture_output=True,
                text=True,
                timeout=60,
            )  # fmt: skip
            assert client.returncode == 0, client.stderr
            assert client.stdout.split() == [on[0].addr, str(1 << 20)]
            # The receiver's ACKs took the sparse class, the sender's data the bulk one.
            acks, ack_packets = _sent(on[1].ns, hosts.IFNAME, "1:10")
            assert ack_packets > 0 and acks < 128 * ack_packets
            assert _sent(on[0].ns, hosts.IFNAME, "1:20")[0] >= 1 << 20
        finally:
            server.kill()
            server.wait(timeout=10)


@netns
def test_hosts_are_removed_even_when_the_body_raises():
    made: list[str] = []
    with pytest.raises(RuntimeError, match="body failed"):
        with hosts.emulated_hosts(2, 1.0) as on:
            made = [h.ns for h in on]
            assert set(made) <= _namespaces()
            raise RuntimeError("body failed")
    assert made and not set(made) & _namespaces()
    assert made[0][: -len("h0")] + "hub" not in _namespaces()


@netns
def test_unshaped_hosts_have_no_token_bucket():
    with hosts.emulated_hosts(1, None) as on:
        assert on[0].ns in _namespaces()
        assert on[0].queue is None
        shown = _qdisc(on[0].ns, hosts.IFNAME)
        assert "tbf" not in shown and "htb" not in shown


@netns
def test_a_kernel_without_htb_gets_one_fifo_token_bucket(monkeypatch):
    real = hosts._run

    def no_htb(*cmd: str) -> None:
        if "htb" in cmd:
            raise RuntimeError(f"emulated hosts: {' '.join(cmd)} failed: unknown qdisc kind")
        real(*cmd)

    monkeypatch.setattr(hosts, "_run", no_htb)
    with hosts.emulated_hosts(1, 0.5) as on:
        assert on[0].queue == "fifo"
        shown = _qdisc(on[0].ns, hosts.IFNAME)
        assert "tbf" in shown and "500Mbit" in shown, shown


@netns
def test_enter_a_missing_host_is_a_clear_error():
    with pytest.raises(FileNotFoundError):
        hosts.enter("tpe-no-such-host")
