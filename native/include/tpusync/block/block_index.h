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
// FLAT LOOKUP CONTRACT (what a lookup touches, and why): a CLOCK-mode hit of a key of at most
// kHotKey (40) bytes held in at most two tiers touches TWO cache lines: one 8-byte bucket of an
// open-addressing table (linear probing, load <= 0.7, a 32-bit hash tag next to a 32-bit entry
// id; the probe ends in the home line except when it crosses a line boundary) and the key's HOT
// line, a 64-byte record with everything a CLOCK lookup reads and writes: key length, tier mask,
// reference bits, pins, the locations of the two fastest tiers holding the key, and the first 40
// key bytes. A miss touches the bucket line only (a 32-bit tag matches a foreign key with
// probability 2^-32 per probed bucket). Everything else lives in a separate COLD array that a
// CLOCK lookup never reads: the LRU links, locations of a third and fourth tier, key bytes 40..56
// (and a side array for 56..64). Hot and cold records are separate arrays (not two halves of one
// 128-byte entry) so the adjacent-line prefetcher does not drag the cold half in on every hit.
// Exact LRU (kExactLru) reads the key's cold line and writes two neighbours' cold lines per tier
// on a touch: five lines per hit, the price of exact order. Lines counted per lookup:
//   CLOCK hit 2 (bucket, hot), CLOCK miss 1 (bucket), exact-LRU hit 3 + 2 per tier, miss 1;
//   + 1 cold line for keys > 40 bytes, for a key in three or four tiers (the third and fourth
//   location), and + 1 side-array line for keys > 56 bytes.
// LookupPrefix runs a software pipeline over the batch (bucket prefetch 20 keys ahead, hot line
// 10 ahead, cold line 10 and LRU neighbours 4 ahead with exact LRU), so the DRAM misses of a batch
// overlap continuously instead of adding up. All arrays are 2 MiB aligned and populated with
// transparent huge pages (MADV_HUGEPAGE, then MADV_COLLAPSE of what the fault path did not give),
// so a random lookup does not also pay a page walk: 10^7 keys span ~1.4 GB.
// Rejected: one 128-byte entry per key holding links and key together (the layout before: a
// CLOCK hit read three lines, bucket + both halves, 82 ns/key batched at 10^7 vs 16 at 10^3);
// the table itself as the array of hot records (built, tested and measured in branch tiers5,
// docs/tiers.md "One-line table": one line per CLOCK hit unless displaced, LRU links on stable
// cold-record ids patched on every move; cachegrind 1.20 lines per hit against 1.86, single-key
// latency 0.23 us against 0.40 at 10^7, but the batched lookup, what the store uses, was
// 1.13-1.34x SLOWER at 10^5 and 10^7: 30% of hits at load 0.6 are displaced into a second
// line, which costs almost a random line's time on the development VM, and the 1 GiB table of
// 2^24 64-byte slots spreads the DRAM lines over more memory than the 128 MiB bucket array,
// which its 480 MiB L3 holds; 1.72 GB at 10^7 keys against 1.42); std::unordered_map (a heap
// node per key plus an out-of-line key: three or four dependent
// misses per lookup; a 32-key lookup was 10x slower at 10^7 keys than at 10^3).
//
// The index only records locations; moving bytes and enforcing capacity is the tiers' job (issue:
// tiered store). Thread-safe: one mutex; callers batch to amortise it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
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
  // only the 8-byte buckets, never entries, but is O(keys) under the lock).
  Status Reserve(size_t keys);
  // Every key and its placement (O(size); for clearing or checkpointing a store, not hot paths).
  std::vector<std::pair<BlockKey, Placement>> Snapshot() const;
  // Calls fn(key, location) for every key held in `tier`, under the index lock and without a
  // per-key allocation (a store checkpointing a tier at close: tier.h CLEAN-CLOSE HOOK; O(size)
  // time, O(1) memory where Snapshot() is O(size) memory). fn must not call into the index.
  void ForEachIn(Tier tier,
                 const std::function<void(std::string_view key, uint64_t location)>& fn) const;
  // CURSOR CONTRACT (a chunked walk: the disk tier's checkpoint, tier.h CHUNKED WALK): visits the
  // keys held in `tier` whose entry id is >= *cursor, in id order, under the index lock held for
  // THIS CALL ONLY: it stops after max_keys (at least 1) visits or 8 * max_keys ids looked at,
  // stores the next id to look at in *cursor and returns true while ids remain (false: the walk is
  // complete). What a cursor may rely on between calls: an entry id never changes while its key is
  // indexed in any tier - Grow (rehash / resize) and backward-shift deletion move only the 8-byte
  // buckets, never entries, and entry chunks are never reallocated - so no rehash, insert or
  // removal between chunks makes the walk skip or repeat a key that stays in `tier` throughout: it
  // is visited exactly once. A key that enters `tier` during the walk may or may not be visited (a
  // freed id below the cursor is reused first); one that leaves it may or may not be; one that
  // leaves and re-enters (a new id) may be visited twice, with two locations. Clear() restarts
  // ids at 0: a cursor at or past the highest id ends the walk. The walk ends: a new id past the
  // cursor appears only when the index holds more keys than ever before (freed ids are reused
  // first). fn must not call into the index.
  bool ForEachInChunk(Tier tier, uint64_t* cursor, size_t max_keys,
                      const std::function<void(std::string_view key, uint64_t location)>& fn) const;
  void Clear();

 private:
  static constexpr uint32_t kNil = 0xffffffffu;
  static constexpr size_t kHotKey = 40;   // key bytes in the hot line
  static constexpr size_t kColdKey = 16;  // key bytes kHotKey.. in the cold line
  static constexpr size_t kHotLocations = 2;
  // HOT CONTRACT: everything a CLOCK lookup of a short key in <= 2 tiers reads or writes.
  // Locations are stored by RANK: the i-th set bit of tier_mask has its location in slot i
  // (slots 0, 1 here, 2, 3 in the cold line), so the two fastest tiers are always hot.
  struct alignas(64) Hot {
    uint8_t key_len;
    uint8_t tier_mask;   // 0: the entry is free
    uint8_t referenced;  // kClock: bit t set = used since last linked in tier t
    uint8_t unused;
    uint32_t pins;
    std::array<uint64_t, kHotLocations> location;
    char key[kHotKey];
  };
  static_assert(sizeof(Hot) == 64, "a hot record is exactly one cache line");
  struct alignas(64) Cold {
    std::array<uint64_t, kNumTiers - kHotLocations> location;  // rank 2 and 3
    std::array<uint32_t, kNumTiers> prev;
    std::array<uint32_t, kNumTiers> next;
    char key[kColdKey];
  };
  static_assert(sizeof(Cold) == 64, "a cold record is exactly one cache line");
  static_assert(kHotKey + kColdKey + 8 == kMaxKeyBytes, "the side array holds the last 8 bytes");
  struct List {
    uint32_t head = kNil;  // least recent
    uint32_t tail = kNil;  // most recent
    size_t count = 0;
  };
  class Array;  // anonymous memory (huge pages where the kernel allows), block_index.cc

  Hot& HotAt(uint32_t id) const;
  Cold& ColdAt(uint32_t id) const;
  char* Tail(uint32_t id) const;  // key bytes past kHotKey + kColdKey (8 per entry)
  uint64_t& LocationSlot(uint32_t id, size_t rank) const;
  void StoreLocations(uint32_t id, const Placement& p);  // writes every location by rank
  bool KeyIs(uint32_t id, std::string_view key) const;
  BlockKey KeyOf(uint32_t id) const;
  // Copies entry id's key into out (kMaxKeyBytes), without allocating; returns its length.
  size_t CopyKey(uint32_t id, char* out) const;
  Placement PlacementOf(uint32_t id) const;
  uint64_t Hash(std::string_view key) const;
  // Bucket position of key (with hash h), or npos.
  size_t Find(std::string_view key, uint64_t h) const;
  Status Grow(size_t min_buckets);
  Result<uint32_t> NewEntry();
  void FreeEntry(size_t pos);  // removes bucket `pos` (backward shift) and frees its entry
  void Link(uint32_t id, size_t tier);
  void Unlink(uint32_t id, size_t tier);
  void Touch(uint32_t id);

  const Recency recency_;
  const HashFn hash_;
  mutable std::mutex mu_;
  std::unique_ptr<Array> buckets_;  // uint64_t: (hash >> 32) << 32 | (id + 1); 0 = empty
  size_t mask_ = 0;                 // bucket count - 1
  size_t size_ = 0;
  std::vector<std::unique_ptr<Array>> hot_;    // kChunkEntries hot records each
  std::vector<std::unique_ptr<Array>> cold_;   // kChunkEntries cold records each
  std::vector<std::unique_ptr<Array>> tails_;  // kChunkEntries x 8 key bytes each
  std::vector<uint32_t> free_ids_;
  uint32_t next_id_ = 0;
  std::array<List, kNumTiers> lists_{};
};

}  // namespace tpusync::block
