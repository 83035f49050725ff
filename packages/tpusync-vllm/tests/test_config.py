"""kv_connector_extra_config parsing: every key checked, bad values refused clearly."""

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


def test_no_key_is_pending_any_more():
    assert PENDING_KEYS == {}


def test_store_node_and_metrics_keys():
    cfg = TpusyncVllmConfig.from_extra(
        {
            "store_nodes": ["10.0.0.5:7600", "node-b:7600"],
            "replicas": 2,
            "auth_secret_file": "/etc/tpusync/secret",
            "store_timeout_s": 1,
            "metrics_port": 9400,
        }
    )
    assert cfg.store_nodes == ("10.0.0.5:7600", "node-b:7600")
    assert (cfg.replicas, cfg.store_timeout_s, cfg.metrics_port) == (2, 1, 9400)
    assert cfg.write_through  # shared prefix cache: saves are published at once by default
    # A comma-separated string (command lines) is the same list.
    assert TpusyncVllmConfig.from_extra({"store_nodes": "a:1, b:2"}).store_nodes == ("a:1", "b:2")


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
        {"store_nodes": ["no-port"]},
        {"store_nodes": [7600]},
        {"store_nodes": ["a:1"], "replicas": 2},
        {"store_nodes": ["a:1"], "replicas": 0},
        {"store_timeout_s": 0},
        {"metrics_port": 70000},
        {"metrics_port": "9400"},
        # NaN and infinity passed every "> 0" check and failed later, or waited forever.
        {"load_timeout_s": float("nan")},
        {"lease_s": float("inf")},
        {"store_nodes": ["a:99999"]},
        {"store_nodes": ["a:0"]},
        {"replicas": -3},
        {"store_nodes": ["a:1"], "store_timeout_s": 5.0, "lookup_timeout_s": 5.0},
    ],
)
def test_bad_values_are_clear_errors(extra):
    with pytest.raises(ConfigError):
        TpusyncVllmConfig.from_extra(extra)
