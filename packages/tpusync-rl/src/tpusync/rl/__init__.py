"""tpusync.rl: versioned, resharding trainer -> sampler weight sync.

Available now (transport-agnostic cores, tested in-process):

- :mod:`tpusync.rl.layout`: :class:`ShardLayout` - which global box of a tensor each rank holds
  (from JAX shardings, tensor-parallel splits, explicit slices; replicas allowed).
- :mod:`tpusync.rl.plan`: :class:`ReshardPlan` - which source rank sends which box to which
  destination rank, never gathering a full tensor.
- :mod:`tpusync.rl.chunks`: :class:`WeightPublisher` / :class:`WeightSubscriber` - versioned
  manifests, per-chunk XXH3 digests, dtype casting, name mapping, delta updates, shadow (atomic)
  or in-place (paused) commit.

NOT IMPLEMENTED YET: the network path (bucketed, pipelined, multi-stream, tree/chain fan-out over
tpusync's transport), JAX pytree publishing across processes, and the vLLM sampler integration.
They are tracked in the project's issues.
"""

from tpusync.core import require_api

MIN_CORE_API = 2
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

__all__ = [
    "MIN_CORE_API",
    "Box",
    "Chunk",
    "Manifest",
    "ReshardPlan",
    "ShardLayout",
    "TensorMeta",
    "Transfer",
    "UpdateRejectedError",
    "VersionSkewError",
    "WeightPublisher",
    "WeightSubscriber",
]
