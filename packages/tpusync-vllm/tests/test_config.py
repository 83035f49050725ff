"""kv_connector_extra_config parsing: every key checked, pending features refused clearly."""

from __future__ import annotations

import pytest

from tpusync.vllm.config import PENDING_KEYS, ConfigError, TpusyncVllmConfig


def test_tier_keys():
    cfg = TpusyncVllmConfig.from_extra(
        {"namespace": "llama-8b.v1", "disk_dir": "/nvme/kv", "disk_bytes": 1 << 30}
    )
    assert (cfg.namespace, cfg.disk_dir, cfg.disk_bytes) == ("llama-8b.v1", "/nvme/kv", 1 << 30)


def test_defaults_and_valid_keys():
    cfg = TpusyncVllmConfig.from_extra(None)
    assert cfg.host_bytes == 1 << 30 and cfg.metrics
    cfg = TpusyncVllmConfig.from_extra(
        {"host_bytes": 1 << 20, "namespace": "ns", "load_timeout_s": 5, "metrics": False}
    )
    assert (cfg.host_bytes, cfg.namespace, cfg.load_timeout_s, cfg.metrics) == (
        1 << 20,
        "ns",
        5,
        False,
    )


@pytest.mark.parametrize("key", sorted(PENDING_KEYS))
def test_pending_keys_raise_not_available(key):
    with pytest.raises(ConfigError, match="not available in this build"):
        TpusyncVllmConfig.from_extra({key: "x"})


@pytest.mark.parametrize(
    "extra",
    [
        {"host_byte": 1},
        {"host_bytes": "1G"},
        {"host_bytes": True},
        {"host_bytes": 0},
        {"metrics": 1},
        {"kv_events_encoding": "json"},
        {"load_timeout_s": -1},
        {"lease_s": 0},
        {"disk_dir": "/tmp/x"},  # without disk_bytes
        {"disk_bytes": 1 << 20},  # without disk_dir
        {"namespace": "has/slash"},
        {"namespace": ""},
    ],
)
def test_bad_values_are_clear_errors(extra):
    with pytest.raises(ConfigError):
        TpusyncVllmConfig.from_extra(extra)
