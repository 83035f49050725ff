"""tpusync.rl: versioned trainer -> sampler weight sync.

NOT IMPLEMENTED YET: this release ships only the package and its API gate; the publisher /
subscriber (versions, resharding, fan-out, digests) are tracked in the project's issues.
"""

from tpusync.core import require_api

MIN_CORE_API = 1
require_api(MIN_CORE_API, "tpusync-rl")

__all__ = ["MIN_CORE_API"]
