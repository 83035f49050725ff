"""The ``tpusync`` command line."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable

from tpusync.core import _native


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a bad count got a traceback, or 0 silently meant the
    default)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not >= 1")
    return v


def _port(text: str) -> int:
    """argparse type: a TCP port, 1..65535."""
    v = _positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a TCP port (1..65535)")
    return v


def _link_gbit(text: str) -> float:
    """argparse type: a finite rate >= 0 in Gbit/s (0 skips the emulated-host rows)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite rate >= 0 (0: skip)")
    return v


def _int_list(text: str) -> list[int]:
    """argparse type: comma-separated ints >= 1, e.g. 1000,100000."""
    return [_positive_int(x) for x in text.split(",")]


def _one_line(command: str, run: Callable[[], int]) -> int:
    """Runs a command; an error it can name (bad input, no memory, a failed system call) is one
    line on stderr and exit status 2, not a traceback."""
    from tpusync.core.errors import TpusyncError

    try:
        return run()
    # RuntimeError: the benches' own named failures (e.g. "fio failed", a reference that could
    # not be measured); ImportError: an optional dependency a suite needs is not installed.
    except (TpusyncError, OSError, ValueError, MemoryError, RuntimeError, ImportError) as e:
        print(f"tpusync {command}: {e}", file=sys.stderr)
        return 2


def _cmd_version(args: argparse.Namespace) -> int:
    info = {"tpusync_core": _native.__version__, "api_version": _native.API_VERSION}
    if args.json:
        print(json.dumps(info))
    else:
        print(f"tpusync-core {info['tpusync_core']} (API version {info['api_version']})")
    return 0


BENCH_GROUP = "tpusync.bench"


def _plugin_suites() -> dict:
    """Bench suites declared by other packages under the ``tpusync.bench`` entry-point group.

    PLUGIN CONTRACT: an entry point ``name = "pkg.module:run"`` names a callable
    ``run(total_bytes: int, repeats: int, show_progress: bool) -> dict`` returning the JSON
    convention of tpusync.core.bench. Loading happens only when that suite is asked for, so the
    core CLI never imports torch or jax by itself.
    """
    from importlib.metadata import entry_points

    builtin = ("memory", "tiers", "transport")
    return {ep.name: ep for ep in entry_points(group=BENCH_GROUP) if ep.name not in builtin}


def _cmd_bench(args: argparse.Namespace) -> int:
    return _one_line(f"bench {args.suite}", lambda: _bench(args))


# SUITE OPTIONS: each option below applies to the suites named; given to another suite it is
# refused, not silently ignored.
_SUITE_OPTIONS = {
    "dir": ("--dir", ("tiers",)),
    "lookup_keys": ("--lookup-keys", ("tiers",)),
    "session_tokens": ("--session-tokens", ("tiers",)),
    "streams": ("--streams", ("transport",)),
    "link_gbit": ("--link-gbit", ("weights",)),
}


def _bench(args: argparse.Namespace) -> int:
    for attr, (flag, suites) in _SUITE_OPTIONS.items():
        if getattr(args, attr) is not None and args.suite not in suites:
            raise ValueError(f"{flag} applies to the {' / '.join(suites)} suite only")
    defaults = {
        "memory": (256, 5),
        "tiers": (256, 5),
        "transport": (1024, 3),
        "weights": (1024, 3),  # tpusync-rl: a 1 GiB state dict to two samplers
    }.get(args.suite, (256, 5))
    args.total_mib = args.total_mib or defaults[0]
    args.repeats = args.repeats or defaults[1]
    if args.suite == "memory":
        from tpusync.core.bench import memory

        result = memory.run(
            total_bytes=args.total_mib << 20, repeats=args.repeats, show_progress=not args.quiet
        )
    elif args.suite == "tiers":
        from tpusync.core.bench import tiers

        result = tiers.run(
            total_bytes=args.total_mib << 20,
            repeats=args.repeats,
            directory=args.dir,
            lookup_sizes=args.lookup_keys,
            session_tokens=args.session_tokens or 1 << 20,
            show_progress=not args.quiet,
        )
    elif args.suite == "transport":
        from tpusync.core.bench import transport

        result = transport.run(
            total_bytes=args.total_mib << 20,
            repeats=args.repeats,
            streams=args.streams,
            show_progress=not args.quiet,
        )
        if not args.json:
            _print_transport_table(result)
            return 0
    else:
        plugins = _plugin_suites()
        if args.suite not in plugins:
            raise SystemExit(f"unknown bench suite {args.suite}")
        # Suite options other than the plugin contract's three go only to the suite they name.
        extra = {} if args.link_gbit is None else {"link_gbit": args.link_gbit}
        result = plugins[args.suite].load()(
            total_bytes=args.total_mib << 20,
            repeats=args.repeats,
            show_progress=not args.quiet,
            **extra,
        )
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.suite == "memory":
        _print_table(result)
    else:
        print(json.dumps(result, indent=2))
    return 0


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tpusync bench {result['suite']}")
    for col in ("block", "put GB/s", "get GB/s", "memcpy GB/s", "put ratio", "get ratio"):
        table.add_column(col, justify="right")
    for r in result["results"]:
        table.add_row(
            f"{r['block_bytes'] >> 10} KiB",
            f"{r['put']['gbps']:.2f}",
            f"{r['get']['gbps']:.2f}",
            f"{r['put']['limit_gbps']:.2f}",
            f"{r['put']['ratio']:.2f}",
            f"{r['get']['ratio']:.2f}",
        )
    Console().print(table)


def _print_transport_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tpusync bench transport ({result['bytes'] >> 20} MiB)")
    for col in ("path", "GB/s", "reference GB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in result["tcp"]:
        ref = r.get("limit_gbps")
        table.add_row(
            f"TCP x{r['streams']} vs iperf3",
            f"{r['gbps']:.2f}",
            "-" if ref is None else f"{ref:.2f}",
            "-" if ref is None else f"{r['ratio']:.2f}",
        )
    s = result["shm"]
    table.add_row(
        "same-host shm vs memcpy", f"{s['gbps']:.2f}", f"{s['limit_gbps']:.2f}", f"{s['ratio']:.2f}"
    )
    Console().print(table)
    m = result["small"]
    print(f"16 KiB pull: {m['latency_us']:.0f} us (TCP round trip {m['limit_us']:.0f} us)")


def _cmd_demo(args: argparse.Namespace) -> int:
    return _one_line("demo", lambda: _demo(args))


def _demo(args: argparse.Namespace) -> int:
    from tpusync.core import demo

    result = demo.run(layers=args.layers, num_blocks=args.blocks)
    if args.json:
        print(json.dumps(result))
    else:
        mib = result["bytes"] / (1 << 20)
        print(
            f"offloaded {result['layers']} layers x {result['blocks_per_layer']} blocks "
            f"({mib:.0f} MiB) of a synthetic paged KV cache to the host pool and back\n"
            f"  save (device -> host): {result['save_gbps']:.2f} GB/s\n"
            f"  load (host -> device): {result['load_gbps']:.2f} GB/s\n"
            f"  verified: {result['verified']}"
        )
    return 0 if result["verified"] else 1


def _cmd_store_node(args: argparse.Namespace) -> int:
    """A node that cannot start (bad size, address or port in use, namespace or disk directory
    held by another node, no secret) says why in one line on stderr and exits 2."""
    from tpusync.core.store_node import parse_size, run_store_node

    return _one_line(
        "store-node",
        lambda: run_store_node(
            listen=args.listen,
            capacity=parse_size(args.capacity),
            block_bytes=parse_size(args.block_bytes),
            secret_file=args.auth_secret_file,
            metrics_port=args.metrics_port,
            disk_dir=args.disk_dir,
            disk_capacity=parse_size(args.disk_capacity) if args.disk_dir else 0,
            name_space=args.namespace or "",
            fingerprint=args.fingerprint or "",
        ),
    )


def _cmd_shm(args: argparse.Namespace) -> int:
    """``tpusync shm list`` / ``reclaim``: tpusync's /dev/shm segments (OWNER LOCK CONTRACT)."""
    from tpusync.core.errors import TpusyncError
    from tpusync.core.pool import reclaim_stale_segments

    try:
        if args.action == "list":
            rows = [
                {"name": n, "bytes": b, "owner": "live" if owned else "none"}
                for n, b, owned in _native.shm_segments(args.prefix)
            ]
        else:
            rows = [{"name": n, "bytes": b} for n, b in reclaim_stale_segments(args.prefix)]
    except TpusyncError as e:
        print(f"tpusync shm {args.action}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        owner = f"  owner: {r['owner']}" if "owner" in r else "  removed"
        print(f"/dev/shm/{r['name']}  {r['bytes'] / 2**20:.1f} MiB{owner}")
    total = sum(r["bytes"] for r in rows) / 2**20
    print(f"{len(rows)} segment(s), {total:.1f} MiB", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpusync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("version", help="print versions")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_version)

    p = sub.add_parser("bench", help="run a benchmark suite")
    p.add_argument("suite", choices=["memory", "tiers", "transport", *sorted(_plugin_suites())])
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.add_argument(
        "--total-mib",
        type=_positive_int,
        default=None,
        help="MiB per measurement (memory 256, transport 1024)",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="runs per figure (memory 5, transport 3)",
    )
    p.add_argument(
        "--streams",
        type=_positive_int,
        nargs="+",
        default=None,
        help="transport: TCP stream counts",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dir", default=None, help="tiers: directory for the disk tier and fio")
    p.add_argument(
        "--lookup-keys",
        type=_int_list,
        default=None,
        help="tiers: index sizes for lookups (default 1000,100000,10000000)",
    )
    p.add_argument(
        "--session-tokens",
        type=_positive_int,
        default=None,
        help="tiers: long-session stream length in tokens (default 1048576, at least 1024)",
    )
    p.add_argument(
        "--link-gbit",
        type=_link_gbit,
        default=None,
        help="weights: link rate of the emulated hosts (default 2; 0 skips those rows)",
    )
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "store-node",
        help="run a distributed prefix cache node until SIGTERM",
        description="The shared secret comes from --auth-secret-file or $TPUSYNC_AUTH_SECRET "
        "(never from the command line).",
    )
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: pick one)")
    p.add_argument("--capacity", default="1GiB", help="host DRAM tier size, e.g. 8GiB")
    p.add_argument("--disk-dir", default=None, help="directory of a disk tier below DRAM")
    p.add_argument("--disk-capacity", default="16GiB", help="disk tier size (with --disk-dir)")
    p.add_argument("--block-bytes", default="256KiB", help="block size, e.g. 256KiB")
    p.add_argument("--auth-secret-file", default=None, help="file holding the shared secret")
    p.add_argument("--metrics-port", type=_port, default=None, help="Prometheus metrics port")
    p.add_argument(
        "--namespace",
        default=None,
        help="keep the DRAM tier in /dev/shm/tpusync-NAMESPACE-host so a restarted node "
        "(even after kill -9) serves its blocks again (letters, digits, - _ .)",
    )
    p.add_argument(
        "--fingerprint",
        default=None,
        help="model fingerprint; a restart with another one discards the cached blocks",
    )
    p.set_defaults(func=_cmd_store_node)

    p = sub.add_parser(
        "shm",
        help="list tpusync's /dev/shm segments, or remove those of dead processes",
        description="list: every /dev/shm/PREFIX* segment, its size and whether a live process "
        "owns it (removes nothing). reclaim: remove those no live process owns. A P/D or RL "
        "pool of a killed process has no owner and is reclaimed by the next one started on the "
        "host anyway; a warm-restart namespace (tpusync-NAMESPACE-host) of a dead server has no "
        "owner either, and reclaiming it throws that cache away.",
    )
    p.add_argument("action", choices=["list", "reclaim"])
    p.add_argument(
        "--prefix",
        default="tpusync-",
        help="segment name prefix, at least 8 characters (default: tpusync-)",
    )
    p.add_argument("--json", action="store_true", help="JSON on stdout")
    p.set_defaults(func=_cmd_shm)

    p = sub.add_parser("demo", help="offload a synthetic paged KV cache and back")
    p.add_argument("--layers", type=_positive_int, default=16)
    p.add_argument("--blocks", type=_positive_int, default=256, help="at least 2")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
