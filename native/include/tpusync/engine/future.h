// Moved to tpusync/concurrency/future.h (generic concurrency sits below the tiers and the store);
// this header keeps the engine:: spellings working.
#pragma once

#include "tpusync/concurrency/future.h"

namespace tpusync::engine {
using concurrency::CompletionCounter;
using concurrency::Future;
using concurrency::FutureCore;
using concurrency::FutureState;
}  // namespace tpusync::engine
