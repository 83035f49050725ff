// Moved to tpusync/concurrency/thread_pool.h (generic concurrency sits below the tiers and the
// store); this header keeps the engine:: spellings working.
#pragma once

#include "tpusync/concurrency/thread_pool.h"

namespace tpusync::engine {
using concurrency::ThreadPool;
}  // namespace tpusync::engine
