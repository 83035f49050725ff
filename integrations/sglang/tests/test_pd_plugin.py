"""The plugin hook: SGLang's closed TransferBackend Enum and get_kv_class learn "tpusync"."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("sglang")


def test_entry_point_is_declared_in_sglangs_plugin_group():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("tpusync") == "tpusync.sglang.pd_plugin:register"


def test_install_now_adds_the_backend_and_keeps_the_others():
    from tpusync.sglang import pd, pd_plugin

    pd_plugin.install_now()
    pd_plugin.install_now()  # idempotent
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.fake import FakeKVManager

    assert DISAGG_TRANSFER_BACKEND_CHOICES.count("tpusync") == 1
    backend = utils.TransferBackend("tpusync")
    assert backend.value == "tpusync"
    assert utils.TransferBackend("mooncake").value == "mooncake"  # existing members survive
    get = utils.get_kv_class
    kinds = utils.KVClassType
    assert get(backend, kinds.MANAGER) is pd.TpusyncKVManager
    assert get(backend, kinds.SENDER) is pd.TpusyncKVSender
    assert get(backend, kinds.RECEIVER) is pd.TpusyncKVReceiver
    assert get(backend, kinds.BOOTSTRAP_SERVER) is pd.TpusyncKVBootstrapServer
    assert get(backend, kinds.KVARGS) is KVArgs
    assert get(utils.TransferBackend.FAKE, kinds.MANAGER) is FakeKVManager  # original path
    with pytest.raises(ValueError):
        utils.TransferBackend("no-such-backend")
