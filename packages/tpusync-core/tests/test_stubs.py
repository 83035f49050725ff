"""The checked-in nanobind stub must match the compiled module (regenerate: nox -s stubs)."""

import subprocess
import sys
from pathlib import Path

STUB = Path(__file__).resolve().parents[1] / "src/tpusync/core/_native.pyi"


def test_checked_in_stub_is_current(tmp_path):
    out = tmp_path / "_native.pyi"
    subprocess.run(
        [sys.executable, "-m", "nanobind.stubgen", "-m", "tpusync.core._native", "-o", str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert STUB.exists(), "no checked-in stub: run `bash ci/nox.sh -s stubs`"
    assert out.read_text() == STUB.read_text(), "stale _native.pyi: run `bash ci/nox.sh -s stubs`"
