// BlockIndex: key -> where the block lives in each tier, with pin counts and per-tier LRU order.
//
// PIN CONTRACT: a key with pins > 0 is NEVER returned by EvictionCandidates, in any tier; pins are
// counted (pin twice, unpin twice). Unpinning an unpinned key is an error, not a no-op, because it
// means two owners disagree about the block.
//
// RECENCY CONTRACT: each tier keeps its own recency list, in one of two modes (Recency):
// - kExactLru: Insert and a touching Lookup move the key to the most-recent end of every tier it
//   is in; EvictionCandidates walks one tier from the least recent end. All operations are O(1)
//   per key (EvictionCandidates is O(returned + skipped pins)). A touch relinks the key, which
//   writes its two list neighbours: two more random cache lines per looked-up key.
// - kClock (second chance): Insert links the key at the most-recent end of its new tier; a
//   touching Lookup only sets the key's reference bit for every tier it is in (a write to the
//   key's own entry, which the lookup has already read: no neighbour lines). EvictionCandidates
//   walks from the least recent end; a key whose reference bit is set has the bit cleared and is
//   relinked at the most-recent end instead of being returned (it was used since it was linked).
//   So a victim is always a key not used since its last pass, oldest pass first; the relinks are
//   paid by the eviction path (amortised O(1): one relink per earlier touch) instead of by
//   every lookup. A walk visits each key at most twice, so it always terminates.
// Both modes: pinned keys are never returned; the order within one tier never depends on
// another tier. The default (kDefaultRecency) is chosen by measurement (docs/design-decisions.md).
//
// FLAT LOOKUP CONTRACT (what a lookup touches, and why): the open-addressing table IS the array
// of HOT records (linear probing over 64-byte slots, load <= 0.7, backward-shift deletion). A
// hot record holds everything a CLOCK lookup reads and writes: key length, tier mask, reference
// bits, pins, a 32-bit hash tag, the locations of the two fastest tiers holding the key, and the
// first 32 key bytes. So a CLOCK-mode hit of a key of at most kHotKey (32) bytes held in at most
// two tiers touches ONE line, the record at its home slot, plus the next slot's line when the
// key was displaced (mean displacement ~0.75 slots at load 0.6: the following line, which the
// adjacent-line prefetcher usually brings with it). Probes past foreign records compare the tag
// first (a foreign key matches with probability 2^-32). A miss probes to the first empty slot:
// 2-6 adjacent lines at load 0.5-0.7, one DRAM round trip. Everything else lives in a COLD
// record per entry that a CLOCK lookup never reads: the LRU links, locations of a third and
// fourth tier, key bytes 32..44 and the slot the entry's hot record is in now (a side array holds
// key bytes 44..64). The cold record's index is the entry's STABLE id: hot records move (MOVE
// CONTRACT, below), cold ones never do, so LRU links and the free list hold ids and survive
// growth and deletion. Lines counted per lookup:
//   CLOCK hit 1 (+ the next slot's line when displaced), CLOCK miss 1-2 (adjacent), exact-LRU hit
//   2 + 2 per tier (hot, cold, two neighbours' cold); + 1 cold line for keys > 32 bytes or a key in
//   three or four tiers, + 1 side-array line for keys > 44 bytes.
// LookupPrefix runs a software pipeline over the batch (home slot prefetched 20 keys ahead; with
// exact LRU or a long key the cold record 10 ahead, the LRU neighbours 4 ahead), so the DRAM
// misses of a batch overlap continuously instead of adding up. All arrays are 2 MiB aligned and
// populated with transparent huge pages (MADV_HUGEPAGE, then MADV_COLLAPSE of what the fault path
// did not give), so a random lookup does not also pay a page walk. Memory: 64 bytes per slot
// (a power of two >= keys / 0.7) + 64 cold + 20 side bytes per entry: 1.93 GB at 10^7 keys
// (2^24 slots), against 1.46 GB with the separate 8-byte bucket array this replaced.
// Rejected: a bucket array of 8-byte (tag, entry id) pairs over hot records that never move (the
// layout before: a CLOCK hit read two random lines, bucket and hot record); tombstones instead of
// backward-shift deletion (no moves on deletion, but misses and inserts probe past tombstones
// until a rehash, and the store deletes as often as it inserts); one 128-byte entry per key
// (three lines per hit); std::unordered_map (a heap node per key plus an out-of-line key: three
// or four dependent misses per lookup).
//
// The index only records locations; moving bytes and enforcing capacity is the tiers' job (issue:
// tiered store). Thread-safe: one mutex; callers batch to amortise it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
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

enum class Recency : uint8_t { kExactLru = 0, kClock = 1 };
std::string_view RecencyName(Recency r);

struct Victim {
  BlockKey key;
  uint64_t location;
};

class BlockIndex {
 public:
  static constexpr Recency kDefaultRecency = Recency::kClock;
  // The hash of a key; tests pass a degenerate one to force tag collisions and long probes.
  using HashFn = uint64_t (*)(std::string_view key);
  explicit BlockIndex(Recency recency = kDefaultRecency, HashFn hash = nullptr);
  ~BlockIndex();
  Recency recency() const { return recency_; }
  BlockIndex(const BlockIndex&) = delete;
  BlockIndex& operator=(const BlockIndex&) = delete;

  // Records that `key` is in `tier` at `location`. kAlreadyExists if it already is (the caller
  // decides whether to overwrite via Remove first). kPoolExhausted if memory for the index runs
  // out.
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
  // Not const: in kClock mode the walk relinks referenced keys (see RECENCY CONTRACT).
  std::vector<Victim> EvictionCandidates(Tier tier, size_t n);
  size_t Count(Tier tier) const;
  size_t size() const;
  // Sizes the hash table for `keys` keys so inserts up to that many never rehash (a rehash moves
  // every 64-byte hot record and patches its cold record: O(keys) under the lock).
  Status Reserve(size_t keys);
  // Every key and its placement (O(size); for clearing or checkpointing a store, not hot paths).
  std::vector<std::pair<BlockKey, Placement>> Snapshot() const;
  void Clear();

 private:
  static constexpr uint32_t kNil = 0xffffffffu;
  static constexpr size_t kHotKey = 32;   // key bytes in the hot record (the table slot)
  static constexpr size_t kColdKey = 12;  // key bytes kHotKey.. in the cold record
  static constexpr size_t kTailKey = kMaxKeyBytes - kHotKey - kColdKey;  // side array, 20
  static constexpr size_t kHotLocations = 2;
  // HOT CONTRACT: a slot of the open-addressing table, and everything a CLOCK lookup of a short
  // key in <= 2 tiers reads or writes. Locations are stored by RANK: the i-th set bit of
  // tier_mask has its location in slot i (0, 1 here, 2, 3 in the cold record), so the two
  // fastest tiers are always hot. tier_mask == 0 marks an empty slot.
  // MOVE CONTRACT: hot records move (growth, backward-shift deletion); `tag` gives a record's home
  // position, so a move never reads or rehashes its key, and every move rewrites the cold
  // record's `slot`. Everything that outlives one call (LRU links, the free list, Snapshot's
  // order) uses the STABLE entry id, the index of the cold record, which never moves.
  struct alignas(64) Hot {
    uint8_t key_len;
    uint8_t tier_mask;   // 0: the slot is empty
    uint8_t referenced;  // kClock: bit t set = used since last linked in tier t
    uint8_t unused;
    uint32_t tag;   // hash >> 32: pre-compare (a foreign key matches with p = 2^-32) and home
    uint32_t pins;
    uint32_t id;    // the stable entry id: index of the cold record
    std::array<uint64_t, kHotLocations> location;
    char key[kHotKey];
  };
  static_assert(sizeof(Hot) == 64, "a hot record is exactly one cache line");
  struct alignas(64) Cold {
    std::array<uint64_t, kNumTiers - kHotLocations> location;  // rank 2 and 3
    std::array<uint32_t, kNumTiers> prev;                      // LRU links: entry ids
    std::array<uint32_t, kNumTiers> next;
    uint32_t slot;  // current table position of the entry's hot record; kNil: id is free
    char key[kColdKey];
  };
  static_assert(sizeof(Cold) == 64, "a cold record is exactly one cache line");
  static_assert(kHotKey + kColdKey + kTailKey == kMaxKeyBytes, "the side array holds the rest");
  struct List {
    uint32_t head = kNil;  // least recent
    uint32_t tail = kNil;  // most recent
    size_t count = 0;
  };
  class Array;  // anonymous memory (huge pages where the kernel allows), block_index.cc

  // `pos` is a table position (valid until the next move); `id` a stable entry id.
  Hot& HotAt(size_t pos) const;
  Hot& HotOf(uint32_t id) const;  // the hot record of entry `id`, wherever it is now
  Cold& ColdAt(uint32_t id) const;
  char* Tail(uint32_t id) const;  // key bytes past kHotKey + kColdKey (kTailKey per entry)
  uint64_t& LocationSlot(size_t pos, size_t rank) const;
  void StoreLocations(size_t pos, const Placement& p);  // writes every location by rank
  bool KeyIs(size_t pos, std::string_view key) const;
  BlockKey KeyOf(size_t pos) const;
  Placement PlacementOf(size_t pos) const;
  uint64_t Hash(std::string_view key) const;
  // Table position of key (with hash h), or npos.
  size_t Find(std::string_view key, uint64_t h) const;
  Status Grow(size_t min_slots);
  Result<uint32_t> NewEntry();
  void FreeEntry(size_t pos);  // empties slot `pos` (backward shift) and frees its entry id
  void Link(uint32_t id, size_t tier);
  void Unlink(uint32_t id, size_t tier);
  void Touch(size_t pos);

  const Recency recency_;
  const HashFn hash_;
  mutable std::mutex mu_;
  std::unique_ptr<Array> table_;  // Hot records, (mask_ + 1) slots
  size_t mask_ = 0;               // slot count - 1
  size_t size_ = 0;
  std::vector<std::unique_ptr<Array>> cold_;   // kChunkEntries cold records each
  std::vector<std::unique_ptr<Array>> tails_;  // kChunkEntries x kTailKey key bytes each
  std::vector<uint32_t> free_ids_;
  uint32_t next_id_ = 0;
  std::array<List, kNumTiers> lists_{};
};

}  // namespace tpusync::block
