#include "tpusync/block/block_index.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1 (uapi asm-generic/mman-common.h); older glibc headers lack it
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace tpusync::block {
namespace {

constexpr size_t kChunkShift = 16;  // 65536 records of 64 bytes: 4 MiB, two 2 MiB huge pages
constexpr size_t kChunkEntries = size_t{1} << kChunkShift;
constexpr size_t kMinSlots = 64;
// Positions are stored in 32 bits (Cold::slot, with kNil = 2^32 - 1 reserved): 2^31 slots of
// 64 bytes (128 GiB of table) is the ceiling.
constexpr size_t kMaxSlots = size_t{1} << 31;
// LookupPrefix's software pipeline (see there): how many keys ahead of the one being touched each
// stage runs: far enough that a stage's line has usually arrived when the next stage reads it,
// close enough that the lines in flight (1 per key with CLOCK: the hot record at the home slot;
// 4 with exact LRU: hot, cold, two neighbours) stay within the core's outstanding-miss slots.
constexpr size_t kNeighbourAhead = 4;
constexpr size_t kEntryAhead = 10;
constexpr size_t kSlotAhead = 20;
constexpr size_t kRing = 32;  // > kSlotAhead, a power of two
static_assert(kRing > kSlotAhead && (kRing & (kRing - 1)) == 0);
constexpr size_t kNpos = static_cast<size_t>(-1);

uint64_t HashKey(std::string_view key) { return BlockKeyHash()(key); }
void PrefetchRead(const void* p) { __builtin_prefetch(p); }
uint32_t Tag(uint64_t h) { return static_cast<uint32_t>(h >> 32); }
// The home position depends on the tag only, so growth and deletion never read a key.
size_t Home(uint32_t tag, size_t mask) { return static_cast<size_t>(tag * 0x9E3779B1u) & mask; }

}  // namespace

// Zeroed anonymous memory, asked for transparent huge pages: an index of 10^7 keys spans 1.4 GB,
// and 4 KiB pages would add a TLB miss (a page walk) to every random lookup.
// HUGE PAGE CONTRACT: an array of 2 MiB or more is 2 MiB aligned, madvised MADV_HUGEPAGE and
// populated at once (MADV_POPULATE_WRITE: the fault path allocates huge pages where the kernel
// can); whatever the fault path left in 4 KiB pages (fragmented memory, "defer" defrag) is
// collapsed synchronously with MADV_COLLAPSE (Linux 6.1+). Both are best effort: an older kernel
// or THP "never" leaves 4 KiB pages, slower but correct. Populating commits the memory when the
// array is mapped, not as keys arrive: a store reserving 10^8 keys commits its 2 GiB of buckets
// at open (random hashing would touch every page of it after a fraction of the keys anyway).
// Rejected: populating lazily by first touch (what this did before): with THP "madvise" and
// defrag "madvise" that works when memory is unfragmented, but on a long-running host the faults
// fall back to 4 KiB pages silently and nothing collapses them before khugepaged gets round to
// it (minutes to hours).
class BlockIndex::Array {
 public:
  // ALIGNMENT: arrays of 2 MiB and more start on a 2 MiB boundary (mapped 2 MiB larger, the
  // unaligned head and tail unmapped again), so every 2 MiB of them can be one huge page; an
  // unaligned 8 MiB chunk would get at most three.
  static std::unique_ptr<Array> Make(size_t bytes) {
    constexpr size_t kHuge = size_t{2} << 20;
    const bool huge = bytes >= kHuge;
    const size_t span = huge ? bytes + kHuge : bytes;
    void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    if (huge) {
      const auto at = reinterpret_cast<uintptr_t>(p);
      const uintptr_t aligned = (at + kHuge - 1) & ~(kHuge - 1);
      if (aligned > at) munmap(p, aligned - at);
      const size_t tail = at + span - (aligned + bytes);
      if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
      p = reinterpret_cast<void*>(aligned);
#ifdef MADV_HUGEPAGE
      (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
      (void)madvise(p, bytes, MADV_POPULATE_WRITE);
      (void)madvise(p, bytes & ~(kHuge - 1), MADV_COLLAPSE);
    }
    return std::unique_ptr<Array>(new Array(p, bytes));
  }
  ~Array() { munmap(data_, bytes_); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  Array(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  void* data_;
  size_t bytes_;
};

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kDisk: return "disk";
    case Tier::kRemote: return "remote";
  }
  return "unknown";
}

std::optional<Tier> Placement::best() const {
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (tier_mask & (1u << t)) return static_cast<Tier>(t);
  }
  return std::nullopt;
}

std::string_view RecencyName(Recency r) { return r == Recency::kClock ? "clock" : "exact_lru"; }

BlockIndex::BlockIndex(Recency recency, HashFn hash) : recency_(recency), hash_(hash) {}
BlockIndex::~BlockIndex() = default;

uint64_t BlockIndex::Hash(std::string_view key) const { return hash_ ? hash_(key) : HashKey(key); }

BlockIndex::Hot& BlockIndex::HotAt(size_t pos) const { return table_->as<Hot>()[pos]; }

BlockIndex::Hot& BlockIndex::HotOf(uint32_t id) const { return HotAt(ColdAt(id).slot); }

BlockIndex::Cold& BlockIndex::ColdAt(uint32_t id) const {
  return cold_[id >> kChunkShift]->as<Cold>()[id & (kChunkEntries - 1)];
}

char* BlockIndex::Tail(uint32_t id) const {
  return tails_[id >> kChunkShift]->as<char>() + (id & (kChunkEntries - 1)) * kTailKey;
}

uint64_t& BlockIndex::LocationSlot(size_t pos, size_t rank) const {
  Hot& h = HotAt(pos);
  return rank < kHotLocations ? h.location[rank] : ColdAt(h.id).location[rank - kHotLocations];
}

void BlockIndex::StoreLocations(size_t pos, const Placement& p) {
  size_t rank = 0;
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (p.tier_mask & (1u << t)) LocationSlot(pos, rank++) = p.location[t];
  }
}

bool BlockIndex::KeyIs(size_t pos, std::string_view key) const {
  const Hot& h = HotAt(pos);
  if (h.key_len != key.size()) return false;
  if (std::memcmp(h.key, key.data(), std::min(key.size(), kHotKey)) != 0) return false;
  if (key.size() <= kHotKey) return true;  // the common case: the hot record only
  const size_t cold_len = std::min(key.size(), kHotKey + kColdKey) - kHotKey;
  if (std::memcmp(ColdAt(h.id).key, key.data() + kHotKey, cold_len) != 0) return false;
  return key.size() <= kHotKey + kColdKey ||
         std::memcmp(Tail(h.id), key.data() + kHotKey + kColdKey,
                     key.size() - kHotKey - kColdKey) == 0;
}

BlockKey BlockIndex::KeyOf(size_t pos) const {
  const Hot& h = HotAt(pos);
  BlockKey k(h.key, std::min<size_t>(h.key_len, kHotKey));
  if (h.key_len > kHotKey) {
    k.append(ColdAt(h.id).key, std::min<size_t>(h.key_len, kHotKey + kColdKey) - kHotKey);
  }
  if (h.key_len > kHotKey + kColdKey) k.append(Tail(h.id), h.key_len - kHotKey - kColdKey);
  return k;
}

Placement BlockIndex::PlacementOf(size_t pos) const {
  const Hot& h = HotAt(pos);
  Placement p;
  p.tier_mask = h.tier_mask;
  p.pins = h.pins;
  size_t rank = 0;
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (!(h.tier_mask & (1u << t))) continue;
    // Ranks 0 and 1 are in the hot record; the cold one is read only for a third tier.
    p.location[t] =
        rank < kHotLocations ? h.location[rank] : ColdAt(h.id).location[rank - kHotLocations];
    ++rank;
  }
  return p;
}

size_t BlockIndex::Find(std::string_view key, uint64_t h) const {
  if (!table_) return kNpos;
  const Hot* tab = table_->as<Hot>();
  const uint32_t tag = Tag(h);
  for (size_t pos = Home(tag, mask_);; pos = (pos + 1) & mask_) {
    if (tab[pos].tier_mask == 0) return kNpos;
    if (tab[pos].tag == tag && KeyIs(pos, key)) return pos;
  }
}

Status BlockIndex::Grow(size_t min_slots) {
  size_t n = kMinSlots;
  while (n < min_slots) n <<= 1;
  if (table_ && n <= mask_ + 1) return Status::OK();
  if (n > kMaxSlots) {
    return Status::PoolExhausted(StrCat("block index: ", n, " slots is past the 2^31 limit"));
  }
  auto fresh = Array::Make(n * sizeof(Hot));
  if (!fresh) {
    return Status::PoolExhausted(StrCat("block index: no memory for ", n, " hash slots"));
  }
  Hot* nt = fresh->as<Hot>();
  const size_t nmask = n - 1;
  if (table_) {
    const Hot* ot = table_->as<Hot>();
    for (size_t i = 0; i <= mask_; ++i) {
      if (ot[i].tier_mask == 0) continue;
      size_t pos = Home(ot[i].tag, nmask);
      while (nt[pos].tier_mask != 0) pos = (pos + 1) & nmask;
      nt[pos] = ot[i];
      ColdAt(ot[i].id).slot = static_cast<uint32_t>(pos);  // MOVE CONTRACT
    }
  }
  table_ = std::move(fresh);
  mask_ = nmask;
  return Status::OK();
}

Status BlockIndex::Reserve(size_t keys) {
  std::lock_guard<std::mutex> lock(mu_);
  return Grow(keys + keys * 3 / 7 + 1);  // load <= 0.7
}

Result<uint32_t> BlockIndex::NewEntry() {
  if (!free_ids_.empty()) {
    const uint32_t id = free_ids_.back();
    free_ids_.pop_back();
    return id;
  }
  if (next_id_ == kNil) return Status::PoolExhausted("block index holds 2^32 - 1 keys");
  if ((next_id_ >> kChunkShift) >= cold_.size()) {
    auto cold = Array::Make(kChunkEntries * sizeof(Cold));
    auto tail = Array::Make(kChunkEntries * kTailKey);
    if (!cold || !tail) return Status::PoolExhausted("block index: no memory for more entries");
    cold_.push_back(std::move(cold));
    tails_.push_back(std::move(tail));
  }
  return next_id_++;
}

void BlockIndex::FreeEntry(size_t pos) {
  Hot* tab = table_->as<Hot>();
  const uint32_t id = tab[pos].id;
  // Backward-shift deletion: no tombstones, so probe lengths (and misses, which probe to an empty
  // slot) never degrade with churn. Each record shifted back patches its cold record's `slot`.
  size_t hole = pos;
  for (size_t j = (pos + 1) & mask_; tab[j].tier_mask != 0; j = (j + 1) & mask_) {
    const size_t home = Home(tab[j].tag, mask_);
    if (((j - home) & mask_) >= ((j - hole) & mask_)) {
      tab[hole] = tab[j];
      ColdAt(tab[hole].id).slot = static_cast<uint32_t>(hole);  // MOVE CONTRACT
      hole = j;
    }
  }
  tab[hole].tier_mask = 0;
  ColdAt(id).slot = kNil;
  free_ids_.push_back(id);
  --size_;
}

void BlockIndex::Link(uint32_t id, size_t tier) {
  List& l = lists_[tier];
  Cold& e = ColdAt(id);
  e.prev[tier] = l.tail;
  e.next[tier] = kNil;
  HotAt(e.slot).referenced &= static_cast<uint8_t>(~(1u << tier));
  if (l.tail != kNil) ColdAt(l.tail).next[tier] = id;
  l.tail = id;
  if (l.head == kNil) l.head = id;
  ++l.count;
}

void BlockIndex::Unlink(uint32_t id, size_t tier) {
  List& l = lists_[tier];
  Cold& e = ColdAt(id);
  const uint32_t prev = e.prev[tier], next = e.next[tier];
  if (prev != kNil) {
    ColdAt(prev).next[tier] = next;
  } else {
    l.head = next;
  }
  if (next != kNil) {
    ColdAt(next).prev[tier] = prev;
  } else {
    l.tail = prev;
  }
  e.prev[tier] = e.next[tier] = kNil;
  --l.count;
}

void BlockIndex::Touch(size_t pos) {
  Hot& e = HotAt(pos);
  const uint8_t mask = e.tier_mask;
  if (recency_ == Recency::kClock) {
    if (e.referenced != mask)
      e.referenced = mask;  // no store when already set: the line stays clean
    return;
  }
  const uint32_t id = e.id;
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (mask & (1u << t) && lists_[t].tail != id) {
      Unlink(id, t);
      Link(id, t);
    }
  }
}

Status BlockIndex::Insert(std::string_view key, Tier tier, uint64_t location) {
  TPUSYNC_RETURN_IF_ERROR(ValidateKey(key));
  const size_t t = static_cast<size_t>(tier);
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  size_t pos = Find(key, h);
  if (pos == kNpos) {
    if (!table_ || (size_ + 1) * 10 > (mask_ + 1) * 7) {
      TPUSYNC_RETURN_IF_ERROR(Grow(table_ ? (mask_ + 1) * 2 : kMinSlots));
    }
    uint32_t id;
    TPUSYNC_ASSIGN_OR_RETURN(id, NewEntry());
    Hot* tab = table_->as<Hot>();
    for (pos = Home(Tag(h), mask_); tab[pos].tier_mask != 0; pos = (pos + 1) & mask_) {
    }
    Hot& hot = tab[pos];
    Cold& cold = ColdAt(id);
    hot.key_len = static_cast<uint8_t>(key.size());
    hot.tier_mask = 0;  // set below, before anything probes the table again
    hot.referenced = 0;
    hot.unused = 0;
    hot.tag = Tag(h);
    hot.pins = 0;
    hot.id = id;
    hot.location.fill(0);
    cold.location.fill(0);
    cold.prev.fill(kNil);
    cold.next.fill(kNil);
    cold.slot = static_cast<uint32_t>(pos);
    std::memcpy(hot.key, key.data(), std::min(key.size(), kHotKey));
    if (key.size() > kHotKey) {
      std::memcpy(cold.key, key.data() + kHotKey,
                  std::min(key.size(), kHotKey + kColdKey) - kHotKey);
    }
    if (key.size() > kHotKey + kColdKey) {
      std::memcpy(Tail(id), key.data() + kHotKey + kColdKey, key.size() - kHotKey - kColdKey);
    }
    ++size_;
  }
  Hot& e = HotAt(pos);
  if (e.tier_mask & (1u << t)) {
    return Status::AlreadyExists(StrCat("block already indexed in the ", TierName(tier), " tier"));
  }
  Placement p = PlacementOf(pos);  // re-stored by rank: the new tier may shift the others
  p.tier_mask |= static_cast<uint8_t>(1u << t);
  p.location[t] = location;
  e.tier_mask = p.tier_mask;
  StoreLocations(pos, p);
  Link(e.id, t);  // most recent in the new tier (both modes)
  Touch(pos);
  if (recency_ == Recency::kClock) e.referenced &= static_cast<uint8_t>(~(1u << t));
  return Status::OK();
}

std::optional<Placement> BlockIndex::Lookup(std::string_view key, bool touch) {
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  if (pos == kNpos) return std::nullopt;
  if (touch) Touch(pos);
  return PlacementOf(pos);
}

size_t BlockIndex::LookupPrefix(std::span<const std::string_view> keys,
                                std::vector<Placement>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!table_) return 0;
  const Hot* tab = table_->as<Hot>();
  const size_t count = keys.size();
  // PIPELINE: one pass over the batch in which iteration i hashes key i + kSlotAhead and
  // prefetches its home slot (the hot record: with CLOCK the only line a short-key hit needs),
  // probes the (by now cached) slots of key i + kEntryAhead for the first tag match and, with
  // exact LRU or a long key, prefetches that entry's cold record, prefetches the LRU neighbours of
  // key i + kNeighbourAhead for writing (exact LRU), and only then compares, touches and reports
  // key i. So the misses of a batch overlap continuously instead of in bursts with a stall per
  // stage. Nothing moves during the call (a touch never moves a record), so a position found
  // ahead is still valid at key i. Prefetches are hints only; the touch itself relinks with the
  // exact LRU order of the moment (a neighbour read early may have changed by then; that costs a
  // miss, never correctness).
  uint64_t hashes[kRing];
  size_t guesses[kRing];
  const bool want_cold = recency_ == Recency::kExactLru;
  const auto stage_slot = [&](size_t j) {
    hashes[j & (kRing - 1)] = Hash(keys[j]);
    const size_t home = Home(Tag(hashes[j & (kRing - 1)]), mask_);
    PrefetchRead(&tab[home]);
    // A hit is displaced by ~0.75 slots on average at load 0.6: the next slot's line too (without
    // it the probe at kEntryAhead stalled on it: 76.7 against 59.9-64.3 ns per key at 10^7).
    PrefetchRead(&tab[(home + 1) & mask_]);
  };
  const auto stage_entry = [&](size_t j) {
    const uint32_t tag = Tag(hashes[j & (kRing - 1)]);
    size_t guess = kNpos;
    for (size_t pos = Home(tag, mask_); tab[pos].tier_mask != 0; pos = (pos + 1) & mask_) {
      if (tab[pos].tag == tag) {
        guess = pos;
        // Exact LRU reads the links; a long key its cold key bytes.
        if (want_cold || keys[j].size() > kHotKey) PrefetchRead(&ColdAt(tab[pos].id));
        break;
      }
    }
    guesses[j & (kRing - 1)] = guess;
  };
  const auto stage_neighbours = [&](size_t j) {
    const size_t pos = guesses[j & (kRing - 1)];
    if (pos == kNpos || !want_cold) return;  // kClock touches no neighbour
    const uint8_t mask = tab[pos].tier_mask;
    const Cold& e = ColdAt(tab[pos].id);
    for (size_t t = 0; t < kNumTiers; ++t) {
      if (!(mask & (1u << t))) continue;
      if (e.prev[t] != kNil) __builtin_prefetch(&ColdAt(e.prev[t]), 1);
      if (e.next[t] != kNil) __builtin_prefetch(&ColdAt(e.next[t]), 1);
    }
  };
  // Warm-up: fill the three stages for the first keys.
  for (size_t j = 0; j < std::min(count, kSlotAhead); ++j) stage_slot(j);
  for (size_t j = 0; j < std::min(count, kEntryAhead); ++j) stage_entry(j);
  for (size_t j = 0; j < std::min(count, kNeighbourAhead); ++j) stage_neighbours(j);
  for (size_t i = 0; i < count; ++i) {
    if (i + kSlotAhead < count) stage_slot(i + kSlotAhead);
    if (i + kEntryAhead < count) stage_entry(i + kEntryAhead);
    if (i + kNeighbourAhead < count) stage_neighbours(i + kNeighbourAhead);
    // The first tag match is usually the key; Find confirms it (and handles a tag collision).
    const size_t guess = guesses[i & (kRing - 1)];
    size_t pos;
    if (guess != kNpos && KeyIs(guess, keys[i])) {
      pos = guess;
    } else {
      pos = Find(keys[i], hashes[i & (kRing - 1)]);
      if (pos == kNpos) return i;
    }
    Touch(pos);
    if (out) out->push_back(PlacementOf(pos));
  }
  return count;
}

Result<uint64_t> BlockIndex::Remove(std::string_view key, Tier tier) {
  const size_t t = static_cast<size_t>(tier);
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  if (pos == kNpos || !(HotAt(pos).tier_mask & (1u << t))) {
    return Status::NotFound(StrCat("block not indexed in the ", TierName(tier), " tier"));
  }
  Placement p = PlacementOf(pos);
  const uint64_t loc = p.location[t];
  Unlink(HotAt(pos).id, t);
  p.tier_mask &= static_cast<uint8_t>(~(1u << t));
  if (p.tier_mask == 0) {
    FreeEntry(pos);
  } else {
    HotAt(pos).tier_mask = p.tier_mask;
    StoreLocations(pos, p);  // the tiers after t move down one rank
  }
  return loc;
}

Result<Placement> BlockIndex::Erase(std::string_view key) {
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  if (pos == kNpos) return Status::NotFound("block not indexed");
  const Placement p = PlacementOf(pos);
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (p.tier_mask & (1u << t)) Unlink(HotAt(pos).id, t);
  }
  FreeEntry(pos);
  return p;
}

Status BlockIndex::Pin(std::string_view key) {
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  if (pos == kNpos) return Status::NotFound("cannot pin a block that is not indexed");
  Hot& e = HotAt(pos);
  if (e.pins == UINT32_MAX) return Status::FailedPrecondition("pin count overflow");
  ++e.pins;
  return Status::OK();
}

Status BlockIndex::Unpin(std::string_view key) {
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  if (pos == kNpos) return Status::NotFound("cannot unpin a block that is not indexed");
  Hot& e = HotAt(pos);
  if (e.pins == 0) {
    return Status::FailedPrecondition("unpin of a block that is not pinned (unbalanced pin/unpin)");
  }
  --e.pins;
  return Status::OK();
}

std::vector<Victim> BlockIndex::EvictionCandidates(Tier tier, size_t n) {
  const size_t t = static_cast<size_t>(tier);
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Victim> out;
  if (recency_ == Recency::kExactLru) {
    for (uint32_t id = lists_[t].head; id != kNil && out.size() < n; id = ColdAt(id).next[t]) {
      const size_t pos = ColdAt(id).slot;
      if (HotAt(pos).pins == 0) out.push_back({KeyOf(pos), PlacementOf(pos).location[t]});
    }
    return out;
  }
  // kClock: second chance. A referenced key is relinked at the most-recent end with its bit
  // cleared, so it comes round again only after every key ahead of it; `budget` bounds the walk at
  // two passes (each key is relinked at most once per walk, then seen at most once more).
  const uint8_t bit = static_cast<uint8_t>(1u << t);
  size_t budget = 2 * lists_[t].count;
  uint32_t id = lists_[t].head;
  uint32_t first_kept = kNil;  // the first unreferenced key passed over: the walk has wrapped
  while (id != kNil && out.size() < n && budget-- > 0) {
    const size_t pos = ColdAt(id).slot;
    const Hot& e = HotAt(pos);
    uint32_t next = ColdAt(id).next[t];
    if (e.referenced & bit) {
      Unlink(id, t);
      Link(id, t);                  // clears the bit
      if (next == kNil) next = id;  // it was the tail: it is still next, now unreferenced
    } else {
      if (id == first_kept) break;
      if (first_kept == kNil) first_kept = id;
      if (e.pins == 0) out.push_back({KeyOf(pos), PlacementOf(pos).location[t]});
    }
    id = next != kNil ? next : lists_[t].head;
  }
  return out;
}

size_t BlockIndex::Count(Tier tier) const {
  std::lock_guard<std::mutex> lock(mu_);
  return lists_[static_cast<size_t>(tier)].count;
}

size_t BlockIndex::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return size_;
}

std::vector<std::pair<BlockKey, Placement>> BlockIndex::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<BlockKey, Placement>> out;
  out.reserve(size_);
  // By entry id (stable, roughly insertion order), not by table position (hash order).
  for (uint32_t id = 0; id < next_id_; ++id) {
    const uint32_t pos = ColdAt(id).slot;
    if (pos != kNil) out.emplace_back(KeyOf(pos), PlacementOf(pos));
  }
  return out;
}

void BlockIndex::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  // Capacity is kept (a cleared store refills to the same size); entries are reused from id 0.
  // O(entries ever used), not O(table): each live record's slot is emptied through its cold one.
  for (uint32_t id = 0; id < next_id_; ++id) {
    Cold& c = ColdAt(id);
    if (c.slot != kNil) HotAt(c.slot).tier_mask = 0;
    c.slot = kNil;
  }
  free_ids_.clear();
  next_id_ = 0;
  size_ = 0;
  lists_ = {};
}

}  // namespace tpusync::block
