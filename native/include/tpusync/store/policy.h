// TierPolicy: which blocks leaving a tier are worth writing to the next one down.
//
// POLICY CONTRACT: victims are always chosen least-recently-used by the BlockIndex (pins honoured);
// a policy only decides admission below. A block refused admission is dropped when its tier needs
// the room (counted as an eviction), so "second use" spares SSD writes for blocks read only once.
// Called with the store lock held: O(1), no I/O.
//
// Rejected alternative: a policy that also picks victims (ARC, LFU). The index's per-tier LRU lists
// are O(1) and the pin contract lives there; a second recency structure would have to mirror every
// pin, touch and removal. Admission is where workloads differ (one-shot prompts vs shared
// prefixes), so that is what is pluggable.
#pragma once

#include <memory>
#include <string_view>

#include "tpusync/base/status.h"
#include "tpusync/block/block_index.h"

namespace tpusync::store {

class TierPolicy {
 public:
  virtual ~TierPolicy() = default;
  virtual std::string_view name() const = 0;
  // A key was put (new or again) or read.
  virtual void OnAccess(std::string_view key) = 0;
  // Whether a block of `key` leaving tier `from` should be written to the next tier down.
  virtual bool AdmitBelow(std::string_view key, block::Tier from) = 0;
};

// "lru": every block cascades down (plain LRU at every tier).
std::unique_ptr<TierPolicy> MakeLruPolicy();
// "second_use": a block goes below DRAM only once it was used at least twice (put + a read, or two
// puts). Use counts are remembered for the last `history` keys, evicted ones included.
std::unique_ptr<TierPolicy> MakeSecondUsePolicy(size_t history);
Result<std::unique_ptr<TierPolicy>> MakePolicy(std::string_view name, size_t history);

}  // namespace tpusync::store
