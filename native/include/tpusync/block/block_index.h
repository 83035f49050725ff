// BlockIndex: key -> where the block lives in each tier, with pin counts and per-tier LRU order.
//
// PIN CONTRACT: a key with pins > 0 is NEVER returned by EvictionCandidates, in any tier; pins are
// counted (pin twice, unpin twice). Unpinning an unpinned key is an error, not a no-op, because it
// means two owners disagree about the block.
//
// LRU CONTRACT: each tier keeps its own recency list. Insert and a touching Lookup move the key to
// the most-recent end of every tier it is in; EvictionCandidates walks one tier from the least
// recent end. All operations are O(1) per key (EvictionCandidates is O(returned + skipped pins)).
//
// The index only records locations; moving bytes and enforcing capacity is the tiers' job (issue:
// tiered store). Thread-safe: one mutex; callers batch to amortise it.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/block/block_key.h"

namespace tpusync::block {

enum class Tier : uint8_t { kDevice = 0, kHost = 1, kDisk = 2, kRemote = 3 };
inline constexpr size_t kNumTiers = 4;
std::string_view TierName(Tier tier);

// Where one key lives: a tier-specific 64-bit location (pool block id, disk slot, node id...).
struct Placement {
  uint8_t tier_mask = 0;  // bit i set: present in Tier(i)
  std::array<uint64_t, kNumTiers> location{};
  uint32_t pins = 0;

  bool in(Tier t) const { return tier_mask & (1u << static_cast<unsigned>(t)); }
  // The fastest tier holding the key (lowest enum value).
  std::optional<Tier> best() const;
};

struct Victim {
  BlockKey key;
  uint64_t location;
};

class BlockIndex {
 public:
  BlockIndex() = default;
  BlockIndex(const BlockIndex&) = delete;
  BlockIndex& operator=(const BlockIndex&) = delete;

  // Records that `key` is in `tier` at `location`. kAlreadyExists if it already is (the caller
  // decides whether to overwrite via Remove first).
  Status Insert(std::string_view key, Tier tier, uint64_t location);
  // Placement of a key; with `touch` the key becomes most recent in every tier it is in.
  std::optional<Placement> Lookup(std::string_view key, bool touch = true);
  // Length of the leading run of keys present in any tier (touching them), and their placements.
  size_t LookupPrefix(std::span<const std::string_view> keys, std::vector<Placement>* out);
  // Forgets key in `tier`; the key disappears when no tier holds it. Returns the old location.
  Result<uint64_t> Remove(std::string_view key, Tier tier);
  // Forgets key in every tier (pins included); NotFound if absent.
  Result<Placement> Erase(std::string_view key);
  Status Pin(std::string_view key);
  Status Unpin(std::string_view key);
  // Up to n least-recent unpinned keys of `tier` (not removed; the caller moves, then Removes).
  std::vector<Victim> EvictionCandidates(Tier tier, size_t n) const;
  size_t Count(Tier tier) const;
  size_t size() const;
  // Every key and its placement (O(size); for clearing or checkpointing a store, not hot paths).
  std::vector<std::pair<BlockKey, Placement>> Snapshot() const;
  void Clear();

 private:
  struct Entry;
  struct Hook {
    Entry* prev = nullptr;
    Entry* next = nullptr;
  };
  struct Entry {
    BlockKey key;
    Placement placement;
    std::array<Hook, kNumTiers> lru;
  };
  struct List {
    Entry* head = nullptr;  // least recent
    Entry* tail = nullptr;  // most recent
    size_t count = 0;
  };
  void Link(Entry* e, size_t tier);
  void Unlink(Entry* e, size_t tier);
  void Touch(Entry* e);

  mutable std::mutex mu_;
  // Node-based map: Entry addresses stay stable across rehash, so intrusive LRU links are safe.
  std::unordered_map<BlockKey, Entry, BlockKeyHash, std::equal_to<>> map_;
  std::array<List, kNumTiers> lists_{};
};

}  // namespace tpusync::block
