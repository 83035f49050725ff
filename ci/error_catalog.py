"""Generate docs/errors.md: every error message tpusync raises, with its class, where, cause, fix.

Sources, read systematically (no hand-kept list to forget):

- Python: every ``raise X(...)`` in packages/*/src and integrations/*/src (ast; f-string holes
  and computed parts shown as ``…``).
- C++: every ``Status::<Code>(...)`` in native/src (not tests), literals joined, computed parts as
  ``…``; the code maps to the Python class raised by the bindings (tpusync.core.errors).

Cause and fix come from, in order: a hand-written note whose pattern matches the message
(NOTES below), else the note of the area (source directory) combined with what the class means.

    python ci/error_catalog.py           # rewrite docs/errors.md
    python ci/error_catalog.py --check   # fail when docs/errors.md is stale (the docs session)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs/errors.md"
HOLE = "…"

CODE_CLASS = {
    "InvalidArgument": "InvalidArgumentError",
    "PoolExhausted": "PoolExhaustedError",
    "NotFound": "NotFoundError",
    "AlreadyExists": "AlreadyExistsError",
    "FailedPrecondition": "StateError",
    "Timeout": "TimeoutError",
    "Cancelled": "CancelledError",
    "IOError": "StorageIOError",
    "NoSpace": "NoSpaceError",
    "Corrupted": "CorruptionError",
    "Unavailable": "UnavailableError",
    "PermissionDenied": "AuthError",
    "VersionMismatch": "VersionMismatchError",
    "Internal": "InternalError",
}

# What each class means, and the generic fix (the message names the argument or object).
CLASS_NOTE = {
    "InvalidArgumentError": (
        "an argument is outside the documented contract",
        "correct the named argument; nothing was changed",
    ),
    "ValueError": ("an argument is outside the documented contract", "correct the named argument"),
    "TypeError": ("an argument has the wrong type", "pass the type the message names"),
    "PoolExhaustedError": (
        "a pool or tier has no free block for the request",
        "free blocks, enlarge the pool / tier, or retry after write-back caught up",
    ),
    "NotFoundError": (
        "the named object (key, request, block, file) does not exist",
        "check the id; it may have expired, been evicted or already been reported",
    ),
    "AlreadyExistsError": (
        "the id or name is already in use",
        "choose another id, or finish / retract the previous one first",
    ),
    "StateError": (
        "the object is in the wrong state for this call (closed, not started, still in use)",
        "follow the call order in the object's contract",
    ),
    "TimeoutError": (
        "a bounded wait ran out",
        "wait again, raise the timeout, or check that the peer / worker is alive",
    ),
    "CancelledError": (
        "the operation was cancelled or its engine shut down",
        "expected after cancel() or close(); otherwise keep the engine alive until futures complete",
    ),
    "StorageIOError": (
        "an operating-system I/O call failed (the message carries errno text)",
        "check the path, permissions and the device",
    ),
    "NoSpaceError": (
        "a filesystem or /dev/shm is full",
        "free space, enlarge /dev/shm, or shrink the tier / pool",
    ),
    "CorruptionError": (
        "bytes failed a checksum, magic or length check",
        "the block is served as a miss and removed; check the disk or the peer; report it if it repeats",
    ),
    "UnavailableError": (
        "a peer could not be reached, or the connection broke",
        "check the address, that the peer runs, firewalls / namespaces, and the shared secret",
    ),
    "AuthError": (
        "the peer failed the HMAC handshake",
        "use the same TPUSYNC_AUTH_SECRET (or secret file) on both ends",
    ),
    "VersionMismatchError": (
        "peer, file or wheel written by an incompatible tpusync version",
        "upgrade both sides to the same release; stale disk tiers are cold-started",
    ),
    "InternalError": (
        "a broken invariant inside tpusync",
        "report it with the message and the stats() of the object",
    ),
    "ConfigError": (
        "a connector configuration key or value is wrong",
        "fix kv_connector_extra_config / the backend's extra config as the message says",
    ),
    "ImportError": ("a package is missing or too old", "install / upgrade the named package"),
    "RuntimeError": (
        "the object is in the wrong state for this call",
        "follow the call order in the object's contract",
    ),
    "SystemExit": ("a command-line argument is wrong", "see `tpusync <command> --help`"),
    "NotImplementedError": (
        "the feature is not available in this build",
        "see the page of the integration; it names what is pending",
    ),
    "TpusyncTimeoutError": (
        "a bounded wait ran out (tpusync.core.errors.TimeoutError)",
        "wait again, raise the timeout, or check that the peer / worker is alive",
    ),
    "AttributeError": (
        "a name that the module does not export (lazy attribute lookup)",
        "check the spelling against the module's __all__",
    ),
    "KeyError": ("a lookup by a key the mapping does not hold", "use a key the message lists"),
    "IndexError": ("an index past the end of a sequence", "use an index inside the sequence"),
    "VersionSkewError": (
        "a weight update arrived for another version than the subscriber expects",
        "resynchronise the subscriber to the publisher's current version",
    ),
    "UpdateRejectedError": (
        "a weight update failed validation and was not applied",
        "the message says which check failed; the previous weights stay in place",
    ),
}

# Area notes by source path prefix (first match wins): the context a message comes from.
AREAS = [
    ("native/src/memory", "Host pools (HostBlockPool, /dev/shm segments)"),
    ("native/src/block", "Block keys and the block index"),
    ("native/src/engine", "Copy engine, futures and block transfers"),
    ("native/src/tier", "Tiers (host tier, disk tier, io_uring)"),
    ("native/src/store", "KVStore (tier cascade, write-back)"),
    ("native/src/transport", "Transport (frames, auth, links, P/D streams)"),
    ("native/src/node", "Store nodes and StoreClient"),
    ("native/src/base", "Base (status, checksums)"),
    ("packages/tpusync-core/bindings", "Bindings (argument conversion)"),
    (
        "packages/tpusync-core/src/tpusync/core/kvcache",
        "KV-cache managers (layouts, plans, P/D transport)",
    ),
    ("packages/tpusync-core/src/tpusync/core/events.py", "KV events (llm-d wire format)"),
    ("packages/tpusync-core/src/tpusync/core/routing.py", "Prefix-aware routing"),
    ("packages/tpusync-core", "tpusync.core (Python)"),
    ("packages/tpusync-torch", "tpusync.torch"),
    ("packages/tpusync-jax", "tpusync.jax"),
    ("packages/tpusync-vllm", "tpusync.vllm (vLLM connector)"),
    ("packages/tpusync-rl", "tpusync.rl (weight sync for RL)"),
    ("integrations/sglang", "SGLang integration"),
    ("integrations", "Integrations"),
]

# Hand-written cause / fix for messages that need more than the class says (regex on message).
NOTES: list[tuple[str, str, str]] = [
    (
        r"pool exhausted|PoolExhausted|no free block",
        "more blocks requested than the pool has free",
        "free blocks (finish_send, free_host, drop views) or create the pool with more blocks",
    ),
    (
        r"stale block id|already freed|double free",
        "a block id used after it was freed",
        "keep ownership balanced; retain() for a second owner",
    ),
    (
        r"/dev/shm",
        "a /dev/shm segment of another size or name, or /dev/shm is full",
        "use the same size and name when re-attaching, remove the stale segment, or enlarge /dev/shm",
    ),
    (
        r"secret",
        "no or too short shared secret",
        "set TPUSYNC_AUTH_SECRET (16+ bytes) or pass a secret file, the same on every peer",
    ),
    (
        r"pinned",
        "the key is pinned (a load in flight holds it)",
        "unpin it first, or wait for the load",
    ),
    (
        r"fingerprint|format|field '",
        "the two sides use different block formats (dtype, block size, heads, layers, layout)",
        "give both engines the same model and cache configuration; the message names the field",
    ),
    (
        r"endpoint",
        "a ZMQ endpoint that cannot be bound or connected",
        "use tcp://HOST:PORT (PORT free when binding) or ipc://PATH",
    ),
    (
        r"undecodable KV event|not msgpack|KV event batch must",
        "bytes on a KV-event topic that are not an llm-d / vLLM event batch",
        "check what else publishes on that endpoint and topic; subscribers count and skip such messages",
    ),
    (
        r"topic|medium|KV event|kv@",
        "a KV-event topic, medium or batch outside the llm-d wire format",
        "topic kv@<pod>@<model> without '@' in the parts; medium one of GPU, CPU, DISK, REMOTE",
    ),
    (
        r"tier weight|tier_weights",
        "the router was given no weight, or a bad one, for a medium",
        "give every medium (None, GPU, CPU, DISK, REMOTE) a weight >= 0",
    ),
    (r"closed", "the object was closed", "create a new one; close() is final"),
    (
        r"deadline|timed out|not complete after",
        "the peer or worker did not finish in time",
        "check the peer is alive and reachable; raise the deadline for large transfers",
    ),
]


def area_of(rel: str) -> str:
    for prefix, name in AREAS:
        if rel.startswith(prefix):
            return name
    return "Other"


def _render(node: ast.AST) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_render(v) if isinstance(v, ast.Constant) else HOLE for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _render(node.left) + _render(node.right)
    return HOLE


def python_errors() -> list[tuple[str, str, str, int]]:
    out = []
    roots = [*ROOT.glob("packages/*/src"), *ROOT.glob("integrations/*/src")]
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
                    continue
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "?")
                if not (name.endswith(("Error", "Exception", "Exit")) or name == "ConfigError"):
                    continue
                args = node.exc.args
                msg = _render(args[0]) if args else ""
                out.append((msg, name, rel, node.lineno))
    return out


_LIT = re.compile(r'"((?:[^"\\]|\\.)*)"')
_CALL = re.compile(r"Status::(\w+)\(")


def _balanced(text: str, start: int) -> str:
    depth, i = 1, start
    in_str = False
    while i < len(text) and depth:
        c = text[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        i += 1
    return text[start : i - 1]


def _cpp_message(args: str) -> str:
    parts, pos = [], 0
    for m in _LIT.finditer(args):
        gap = re.sub(r"StrCat\(|[,()\s]", "", args[pos : m.start()])
        if gap:
            parts.append(HOLE)
        parts.append(bytes(m.group(1), "utf-8").decode("unicode_escape"))
        pos = m.end()
    if re.sub(r"[,()\s]", "", args[pos:]):
        parts.append(HOLE)
    return "".join(parts) if parts else HOLE


def cpp_errors() -> list[tuple[str, str, str, int]]:
    out = []
    for path in sorted(ROOT.glob("native/src/**/*.cc")):
        if path.name.endswith("_test.cc"):
            continue
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for m in _CALL.finditer(text):
            code = m.group(1)
            if code not in CODE_CLASS:
                continue
            msg = _cpp_message(_balanced(text, m.end()))
            out.append((msg, CODE_CLASS[code], rel, text.count("\n", 0, m.start()) + 1))
    return out


def cause_fix(msg: str, cls: str) -> tuple[str, str]:
    for pattern, cause, fix in NOTES:
        if re.search(pattern, msg, re.IGNORECASE):
            return cause, fix
    return CLASS_NOTE.get(cls, ("see the message", "see the message"))


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return f"`{text}`" if text and text != HOLE else "(computed message)"


def render() -> str:
    rows = python_errors() + cpp_errors()
    by_area: dict[str, list] = {}
    for msg, cls, rel, line in rows:
        by_area.setdefault(area_of(rel), []).append((msg, cls, rel, line))
    lines = [
        "# Error reference",
        "",
        "<!-- GENERATED by ci/error_catalog.py from the sources; do not edit by hand. -->",
        "",
        f"Every error message tpusync raises ({len(rows)} sites), read from the sources: Python",
        "`raise` statements and native `Status` constructors (a native code reaches Python as the",
        "class shown; see `tpusync.core.errors`). `…` marks a value filled in at run time. The",
        "cause and fix come from a note on the message's pattern or, failing that, from what the",
        "class means. [Troubleshooting](troubleshooting.md) covers symptoms that raise nothing.",
        "",
        "## What each class means",
        "",
        "| class | cause | fix |",
        "| --- | --- | --- |",
    ]
    used = sorted({cls for _, cls, _, _ in rows})
    for cls in used:
        cause, fix = CLASS_NOTE.get(cls, ("see the message", "see the message"))
        lines.append(f"| `{cls}` | {cause} | {fix} |")
    for area in [a for _, a in AREAS] + ["Other"]:
        if area not in by_area:
            continue
        lines += ["", f"## {area}", "", "| message | class | where | cause | fix |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
        seen = set()
        # Source order, without line numbers (they would make the page stale on every edit).
        for msg, cls, rel, _line in sorted(by_area[area], key=lambda r: (r[2], r[3])):
            key = (msg, cls, rel)
            if key in seen:
                continue
            seen.add(key)
            cause, fix = cause_fix(msg, cls)
            lines.append(f"| {_cell(msg)} | `{cls}` | `{rel}` | {cause} | {fix} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run `python ci/error_catalog.py`")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
