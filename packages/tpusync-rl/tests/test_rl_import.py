import tpusync.core as tc
import tpusync.rl


def test_gate_passes_against_installed_core():
    assert tc.API_VERSION >= tpusync.rl.MIN_CORE_API
