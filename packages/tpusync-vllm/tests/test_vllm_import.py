import tpusync.core as tc
import tpusync.vllm


def test_gate_passes_against_installed_core():
    assert tc.API_VERSION >= tpusync.vllm.MIN_CORE_API
