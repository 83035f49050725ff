"""Generate docs/errors.md: every error message tpusync raises, with its class, where, cause, fix.

Sources, read systematically (no hand-kept list to forget):

- Python: every ``raise X(...)`` in packages/*/src and integrations/*/src (ast; f-string holes
  and computed parts shown as ``…``).
- C++: every ``Status::<Code>(...)`` and ``Status::FromErrno(errno, what)`` in native/src,
  native/include and the bindings (not tests), literals joined, computed parts as ``…``; the code
  maps to the Python class raised by the bindings (tpusync.core.errors).

Cause and fix of each message come from ci/error_notes.toml: one table per source file or folder
(``["native/src/tier/disk_tier.cc"]``, ``["native/src/transport/"]``), each key a regular
expression searched in the message (rendered as on the page, ``…`` for computed parts), each value
``["cause", "fix"]``. A message must match EXACTLY ONE note among the tables whose name is a
prefix of its file: no match means it has no documented cause and fix, two or more mean a pattern
is too loose. Notes that match no message are reported too (stale after a message changed).

    python ci/error_catalog.py           # rewrite docs/errors.md (prints what lacks a note)
    python ci/error_catalog.py --check   # fail when docs/errors.md is stale, a message has no
                                         # note or two, or a note matches nothing (docs session)
    python ci/error_catalog.py --missing # list messages without a note, with file:line
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs/errors.md"
NOTES_FILE = ROOT / "ci/error_notes.toml"
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
    ("native/src/concurrency", "Copy engine, futures and block transfers"),
    ("native/src/tier", "Tiers (host tier, disk tier, io_uring)"),
    ("native/src/store", "KVStore (tier cascade, write-back)"),
    ("native/src/transport", "Transport (frames, auth, links, P/D streams)"),
    ("native/src/node", "Store nodes and StoreClient"),
    ("native/src/base", "Base (status, checksums)"),
    ("native/include/tpusync/base", "Base (status, checksums)"),
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
                if not isinstance(node, ast.Raise):
                    continue
                if isinstance(node.exc, ast.Name) and node.exc.id.endswith("Error"):
                    out.append(("", node.exc.id, rel, node.lineno))  # bare `raise XError`
                    continue
                if not isinstance(node.exc, ast.Call):
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


def _split_args(args: str) -> list[str]:
    """Split a C++ argument list at its top-level commas (strings and brackets respected)."""
    out, depth, cur, in_str, i = [], 0, [], False, 0
    while i < len(args):
        c = args[i]
        cur.append(c)
        if in_str:
            if c == "\\":
                i += 1
                cur.append(args[i])
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            cur.pop()
            out.append("".join(cur))
            cur = []
        i += 1
    out.append("".join(cur))
    return out


# A Status::FromErrno's class follows errno (native/src/base/status.cc).
ERRNO_CLASS = "StorageIOError (by errno)"

CPP_SOURCES = ("native/src/**/*.cc", "native/src/**/*.h", "native/include/**/*.h",
               "packages/tpusync-core/bindings/*.cc", "packages/tpusync-core/bindings/*.h")  # fmt: skip
# Test helpers that live beside the sources but are compiled into tests only.
CPP_TEST_ONLY = {"native/src/tier/mock_tier.h"}


def cpp_errors() -> list[tuple[str, str, str, int]]:
    out = []
    paths = sorted({p for g in CPP_SOURCES for p in ROOT.glob(g)})
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        if path.name.endswith("_test.cc") or rel in CPP_TEST_ONLY:
            continue
        text = path.read_text()
        for m in _CALL.finditer(text):
            code = m.group(1)
            line = text.count("\n", 0, m.start()) + 1
            if text[text.rfind("\n", 0, m.start()) + 1 : m.start()].strip() == "Status":
                continue  # the definition of Status::FromErrno, not a use
            if code == "FromErrno":
                what = _split_args(_balanced(text, m.end()))[-1]
                out.append((_cpp_message(what) + ": … (errno …)", ERRNO_CLASS, rel, line))
                continue
            if code not in CODE_CLASS:
                continue
            msg = _cpp_message(_balanced(text, m.end()))
            out.append((msg, CODE_CLASS[code], rel, line))
    return out


Row = tuple[str, str, str, int]


def load_notes() -> list[tuple[str, str, str, str]]:
    """(scope, pattern, cause, fix) from ci/error_notes.toml, in file order."""
    data = tomllib.loads(NOTES_FILE.read_text())
    notes = []
    for scope, table in data.items():
        for pattern, value in table.items():
            if not (isinstance(value, list) and len(value) == 2):
                raise SystemExit(f"{NOTES_FILE.name}: [{scope}] {pattern!r}: want [cause, fix]")
            re.compile(pattern)
            notes.append((scope, pattern, value[0], value[1]))
    return notes


def matches(notes: list, msg: str, rel: str) -> list[int]:
    """Indexes of the notes in scope for ``rel`` whose pattern is found in ``msg``."""
    return [
        i
        for i, (scope, pattern, _, _) in enumerate(notes)
        if rel.startswith(scope) and re.search(pattern, msg)
    ]


def audit(rows: list[Row], notes: list) -> list[str]:
    """Problems with the notes: messages with none or several, notes matching nothing."""
    problems, used = [], set()
    for msg, _cls, rel, line in rows:
        hit = matches(notes, msg, rel)
        used.update(hit)
        if not hit:
            problems.append(f"{rel}:{line}: no note for {msg!r}")
        elif len(hit) > 1:
            pats = ", ".join(f"[{notes[i][0]}] {notes[i][1]!r}" for i in hit)
            problems.append(f"{rel}:{line}: {msg!r} matches several notes: {pats}")
    for i, (scope, pattern, _, _) in enumerate(notes):
        if i not in used:
            problems.append(f"{NOTES_FILE.name}: [{scope}] {pattern!r} matches no message")
    return problems


def cause_fix(notes: list, msg: str, rel: str, cls: str) -> tuple[str, str]:
    hit = matches(notes, msg, rel)
    if hit:
        return notes[hit[0]][2], notes[hit[0]][3]
    # No note yet: the class meaning, marked so that the page shows the gap (--check fails).
    cause, fix = CLASS_NOTE.get(cls.split()[0], ("see the message", "see the message"))
    return f"(no note yet) {cause}", fix


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    if not text:
        return "(no message)"
    return f"`{text}`" if text != HOLE else "(computed message)"


def render(rows: list[Row], notes: list) -> str:
    by_area: dict[str, list] = {}
    for msg, cls, rel, line in rows:
        by_area.setdefault(area_of(rel), []).append((msg, cls, rel, line))
    lines = [
        "# Error reference",
        "",
        "<!-- GENERATED by ci/error_catalog.py from the sources and ci/error_notes.toml; do not",
        "     edit by hand. -->",
        "",
        f"Every error message tpusync raises ({len(rows)} sites), read from the sources: Python",
        "`raise` statements and native `Status` constructors (a native code reaches Python as the",
        "class shown; see `tpusync.core.errors`). `…` marks a value filled in at run time. Each",
        "message has its own cause and fix (ci/error_notes.toml).",
        "[Troubleshooting](troubleshooting.md) covers symptoms that raise nothing.",
        "",
        "## What each class means",
        "",
        "| class | meaning | what to do in general |",
        "| --- | --- | --- |",
    ]
    used = sorted({cls for _, cls, _, _ in rows})
    for cls in used:
        cause, fix = CLASS_NOTE.get(cls, ("see the message", "see the message"))
        lines.append(f"| `{cls}` | {cause} | {fix} |")
    for area in dict.fromkeys([a for _, a in AREAS] + ["Other"]):  # each section once
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
            cause, fix = (t.replace("|", "\\|") for t in cause_fix(notes, msg, rel, cls))
            lines.append(f"| {_cell(msg)} | `{cls}` | `{rel}` | {cause} | {fix} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    args = sys.argv[1:]
    rows = python_errors() + cpp_errors()
    notes = load_notes()
    problems = audit(rows, notes)
    if "--missing" in args:
        print("\n".join(problems) or "every message has exactly one note")
        return 1 if problems else 0
    text = render(rows, notes)
    noted = sum(1 for msg, _, rel, _ in rows if len(matches(notes, msg, rel)) == 1)
    summary = f"{len(rows)} messages, {noted} with exactly one note, {len(problems)} problem(s)"
    if "--check" in args:
        rc = 0
        if problems:
            print("\n".join(problems))
            print(f"{summary}: every message needs one specific note in {NOTES_FILE.name}")
            rc = 1
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run `python ci/error_catalog.py`")
            rc = 1
        return rc
    OUT.write_text(text)
    print("\n".join(problems))
    print(f"wrote {OUT.relative_to(ROOT)}: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
