"""tpusync.rl: versioned, resharding trainer -> sampler weight sync.

Available now (transport-agnostic cores, tested in-process):

- :mod:`tpusync.rl.layout`: :class:`ShardLayout` - which global box of a tensor each rank holds
  (from JAX shardings, tensor-parallel splits, explicit slices; replicas allowed).
- :mod:`tpusync.rl.plan`: :class:`ReshardPlan` - which source rank sends which box to which
  destination rank, never gathering a full tensor.
- :mod:`tpusync.rl.chunks`: :class:`WeightPublisher` / :class:`WeightSubscriber` - versioned
  manifests, per-chunk XXH3 digests, dtype casting, name mapping, delta updates, shadow (atomic)
  or in-place (paused) commit.

- :mod:`tpusync.rl.trainer` / :mod:`tpusync.rl.sampler`: :class:`TrainerSync` /
  :class:`SamplerSync` - the network path: bucketed, pipelined, multi-stream transfers over
  tpusync's P/D transport, chain / tree fan-out, resharding, commit reports
  (:mod:`tpusync.rl.reports`) and fault handling (:mod:`tpusync.rl.pack` lays pieces into blocks,
  :mod:`tpusync.rl.control` is the signed control channel, :mod:`tpusync.rl.endpoint` the wire
  end of a process, :mod:`tpusync.rl.topology` the fan-out tree and request ids,
  :mod:`tpusync.rl.membership` rank 0's record of the samplers, :mod:`tpusync.rl.sharing` the
  same-host shared segment, :mod:`tpusync.rl.agreement` the multi-process delta agreement).

- :mod:`tpusync.rl.jaxsync`: :class:`~tpusync.rl.jaxsync.JaxTrainerSync` - multi-controller JAX
  (``jax.distributed``) trainers publishing pytrees of sharded arrays, each process its own shards.
- Delta updates (``publish(..., delta=True)``) from single- and multi-rank trainers (torch TP /
  FSDP processes, multi-controller JAX): only the changed row chunks of changed tensors move
  (CHUNK DELTA CONTRACT in :mod:`tpusync.rl.chunks`); the ranks agree on the union of their
  changed rows through rank 0's control channel; full updates after a failed version or
  differing bases.
- :mod:`tpusync.rl.vllm`: the ``tpusync`` backend of vLLM's weight-transfer API (a running vLLM
  engine as the sampler, or a vLLM OpenAI server over HTTP); each worker pulls only its
  tensor-parallel slices (TP SLICE CONTRACT in :mod:`tpusync.rl.vllm.tp`) of its own pipeline
  stage's layers (PP STAGE RULE there), which the workers report to a trainer built without
  ``dst_layouts`` (SAMPLER LAYOUTS CONTRACT in :mod:`tpusync.rl.trainer`); imports vLLM only
  when vLLM calls it. :mod:`tpusync.rl.fused` splits fused checkpoint tensors (Phi-3's
  ``qkv_proj`` / ``gate_up_proj``) into the parts an engine's tensor-parallel ranks cut;
  :mod:`tpusync.rl.lora` syncs LoRA adapter versions into a running engine, each version its
  own adapter (ADAPTER VERSION CONTRACT), with vLLM's loaders in :mod:`tpusync.rl.vllm.lora`
  (SGLang's: ``tpusync.sglang.lora``).

NOT IMPLEMENTED YET: the trainer-side slice plan computed ahead of the engine (``tp_layouts``,
tensor parallelism only) knows the Llama-family checkpoint names only (Llama, Mistral, Qwen2,
Qwen3, the Qwen3 MoE, Qwen2 MoE and Mixtral experts, DeepSeek's latent attention, Phi-3 once
split; for other architectures, pipeline or expert parallelism let the workers report their
slices: ``TrainerSync(dst_layouts=None)``). Tracked in the project's issues.
"""

from tpusync.core import require_api

MIN_CORE_API = 12  # reclaim_stale_segments (OWNER LOCK CONTRACT)
require_api(MIN_CORE_API, "tpusync-rl")

from tpusync.rl.chunks import (  # noqa: E402 - after the API gate on purpose
    Chunk,
    UpdateRejectedError,
    VersionSkewError,
    WeightPublisher,
    WeightSubscriber,
)
from tpusync.rl.layout import Box, ShardLayout  # noqa: E402
from tpusync.rl.manifest import Manifest, TensorMeta  # noqa: E402
from tpusync.rl.plan import ReshardPlan, Transfer  # noqa: E402
from tpusync.rl.reports import PublishReport, UpdateResult  # noqa: E402
from tpusync.rl.sampler import SamplerSync  # noqa: E402
from tpusync.rl.trainer import TrainerSync  # noqa: E402

__all__ = [
    "MIN_CORE_API",
    "Box",
    "Chunk",
    "Manifest",
    "PublishReport",
    "ReshardPlan",
    "SamplerSync",
    "ShardLayout",
    "TensorMeta",
    "Transfer",
    "TrainerSync",
    "UpdateResult",
    "UpdateRejectedError",
    "VersionSkewError",
    "WeightPublisher",
    "WeightSubscriber",
]
