"""The SGLang P/D backend's settings from the environment (read once per manager, pd.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "0", "abc", "1e999"])
def test_a_timeout_from_the_environment_must_be_positive_and_finite(monkeypatch, raw):
    """TIMEOUT CONTRACT: NaN made every ``now > end`` test false (an unbounded wait for pool
    room on the send worker) and inf is no bound either; both were accepted."""
    from tpusync.sglang.pd import _env_float

    monkeypatch.setenv("TPUSYNC_SGLANG_COPY_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match=r"\$TPUSYNC_SGLANG_COPY_TIMEOUT_S must be a positive"):
        _env_float("TPUSYNC_SGLANG_COPY_TIMEOUT_S", 60.0)
    monkeypatch.setenv("TPUSYNC_SGLANG_COPY_TIMEOUT_S", "2.5")
    assert _env_float("TPUSYNC_SGLANG_COPY_TIMEOUT_S", 60.0) == 2.5


@pytest.mark.parametrize("raw", ["0", "-1", "2.5", "abc", "65"])
def test_a_stream_count_from_the_environment_is_named_when_wrong(monkeypatch, raw):
    from tpusync.sglang.pd import _env_streams

    monkeypatch.setenv("TPUSYNC_SGLANG_STREAMS", raw)
    with pytest.raises(ValueError, match=r"\$TPUSYNC_SGLANG_STREAMS must be .* 1 to 64"):
        _env_streams("TPUSYNC_SGLANG_STREAMS", 2)
    monkeypatch.delenv("TPUSYNC_SGLANG_STREAMS")
    assert _env_streams("TPUSYNC_SGLANG_STREAMS", 2) == 2
