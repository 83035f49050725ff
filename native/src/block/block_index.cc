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
constexpr size_t kMinBuckets = 64;
// LookupPrefix's software pipeline (see there): how many keys ahead of the one being touched each
// stage runs: far enough that a stage's line has usually arrived when the next stage reads it,
// close enough that the lines in flight (2 per key with CLOCK: bucket, hot line; 5 with exact
// LRU) stay within the core's outstanding-miss slots. Measured on the development VM at 10^7
// keys (C++, CLOCK, hot / cold records, alternating runs at load ~12): 12/8 64.9 and 61.1,
// 20/10 61.9 and 54.5, 28/14 59.1 and 75.9 ns per key; with the two-line entries before, 4/8/12
// to 12/24/36 were all within noise. The shortest is best for one-key calls (no pipeline there).
constexpr size_t kNeighbourAhead = 4;
constexpr size_t kEntryAhead = 10;
constexpr size_t kBucketAhead = 20;
constexpr size_t kRing = 32;  // > kBucketAhead, a power of two
static_assert(kRing > kBucketAhead && (kRing & (kRing - 1)) == 0);

uint64_t HashKey(std::string_view key) { return BlockKeyHash()(key); }
void PrefetchRead(const void* p) { __builtin_prefetch(p); }
uint32_t Tag(uint64_t h) { return static_cast<uint32_t>(h >> 32); }
uint64_t MakeBucket(uint64_t h, uint32_t id) {
  return (static_cast<uint64_t>(Tag(h)) << 32) | (static_cast<uint64_t>(id) + 1);
}
uint32_t BucketId(uint64_t b) { return static_cast<uint32_t>(b) - 1; }
// The home position depends on the tag only, so rehash and deletion never read an entry.
size_t Home(uint64_t bucket_or_hash_tag, size_t mask) {
  return static_cast<size_t>((static_cast<uint32_t>(bucket_or_hash_tag >> 32) * 0x9E3779B1u)) &
         mask;
}

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

BlockIndex::Hot& BlockIndex::HotAt(uint32_t id) const {
  return hot_[id >> kChunkShift]->as<Hot>()[id & (kChunkEntries - 1)];
}

BlockIndex::Cold& BlockIndex::ColdAt(uint32_t id) const {
  return cold_[id >> kChunkShift]->as<Cold>()[id & (kChunkEntries - 1)];
}

char* BlockIndex::Tail(uint32_t id) const {
  return tails_[id >> kChunkShift]->as<char>() + (id & (kChunkEntries - 1)) * 8;
}

uint64_t& BlockIndex::LocationSlot(uint32_t id, size_t rank) const {
  return rank < kHotLocations ? HotAt(id).location[rank]
                              : ColdAt(id).location[rank - kHotLocations];
}

void BlockIndex::StoreLocations(uint32_t id, const Placement& p) {
  size_t rank = 0;
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (p.tier_mask & (1u << t)) LocationSlot(id, rank++) = p.location[t];
  }
}

bool BlockIndex::KeyIs(uint32_t id, std::string_view key) const {
  const Hot& h = HotAt(id);
  if (h.key_len != key.size()) return false;
  if (std::memcmp(h.key, key.data(), std::min(key.size(), kHotKey)) != 0) return false;
  if (key.size() <= kHotKey) return true;  // the common case: the hot line only
  const size_t cold_len = std::min(key.size(), kHotKey + kColdKey) - kHotKey;
  if (std::memcmp(ColdAt(id).key, key.data() + kHotKey, cold_len) != 0) return false;
  return key.size() <= kHotKey + kColdKey || std::memcmp(Tail(id), key.data() + kHotKey + kColdKey,
                                                         key.size() - kHotKey - kColdKey) == 0;
}

size_t BlockIndex::CopyKey(uint32_t id, char* out) const {
  const Hot& h = HotAt(id);
  const size_t len = h.key_len;
  std::memcpy(out, h.key, std::min(len, kHotKey));
  if (len > kHotKey) {
    std::memcpy(out + kHotKey, ColdAt(id).key, std::min(len, kHotKey + kColdKey) - kHotKey);
  }
  if (len > kHotKey + kColdKey) {
    std::memcpy(out + kHotKey + kColdKey, Tail(id), len - kHotKey - kColdKey);
  }
  return len;
}

BlockKey BlockIndex::KeyOf(uint32_t id) const {
  const Hot& h = HotAt(id);
  BlockKey k(h.key, std::min<size_t>(h.key_len, kHotKey));
  if (h.key_len > kHotKey) {
    k.append(ColdAt(id).key, std::min<size_t>(h.key_len, kHotKey + kColdKey) - kHotKey);
  }
  if (h.key_len > kHotKey + kColdKey) k.append(Tail(id), h.key_len - kHotKey - kColdKey);
  return k;
}

Placement BlockIndex::PlacementOf(uint32_t id) const {
  const Hot& h = HotAt(id);
  Placement p;
  p.tier_mask = h.tier_mask;
  p.pins = h.pins;
  size_t rank = 0;
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (!(h.tier_mask & (1u << t))) continue;
    // Ranks 0 and 1 are in the hot line; the cold line is read only for a third tier.
    p.location[t] =
        rank < kHotLocations ? h.location[rank] : ColdAt(id).location[rank - kHotLocations];
    ++rank;
  }
  return p;
}

size_t BlockIndex::Find(std::string_view key, uint64_t h) const {
  if (!buckets_) return static_cast<size_t>(-1);
  const uint64_t* b = buckets_->as<uint64_t>();
  const uint32_t tag = Tag(h);
  for (size_t pos = Home(h, mask_);; pos = (pos + 1) & mask_) {
    const uint64_t v = b[pos];
    if (v == 0) return static_cast<size_t>(-1);
    if (static_cast<uint32_t>(v >> 32) == tag && KeyIs(BucketId(v), key)) return pos;
  }
}

Status BlockIndex::Grow(size_t min_buckets) {
  size_t n = kMinBuckets;
  while (n < min_buckets) n <<= 1;
  if (buckets_ && n <= mask_ + 1) return Status::OK();
  auto fresh = Array::Make(n * sizeof(uint64_t));
  if (!fresh) {
    return Status::PoolExhausted(StrCat("block index: no memory for ", n, " hash buckets"));
  }
  uint64_t* nb = fresh->as<uint64_t>();
  const size_t nmask = n - 1;
  if (buckets_) {
    const uint64_t* ob = buckets_->as<uint64_t>();
    for (size_t i = 0; i <= mask_; ++i) {
      if (ob[i] == 0) continue;
      size_t pos = Home(ob[i], nmask);
      while (nb[pos] != 0) pos = (pos + 1) & nmask;
      nb[pos] = ob[i];
    }
  }
  buckets_ = std::move(fresh);
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
  if ((next_id_ >> kChunkShift) >= hot_.size()) {
    auto hot = Array::Make(kChunkEntries * sizeof(Hot));
    auto cold = Array::Make(kChunkEntries * sizeof(Cold));
    auto tail = Array::Make(kChunkEntries * (kMaxKeyBytes - kHotKey - kColdKey));
    if (!hot || !cold || !tail) {
      return Status::PoolExhausted("block index: no memory for more entries");
    }
    hot_.push_back(std::move(hot));
    cold_.push_back(std::move(cold));
    tails_.push_back(std::move(tail));
  }
  return next_id_++;
}

void BlockIndex::FreeEntry(size_t pos) {
  uint64_t* b = buckets_->as<uint64_t>();
  const uint32_t id = BucketId(b[pos]);
  // Backward-shift deletion: no tombstones, so probe lengths never degrade with churn.
  size_t hole = pos;
  for (size_t j = (pos + 1) & mask_; b[j] != 0; j = (j + 1) & mask_) {
    const size_t home = Home(b[j], mask_);
    if (((j - home) & mask_) >= ((j - hole) & mask_)) {
      b[hole] = b[j];
      hole = j;
    }
  }
  b[hole] = 0;
  HotAt(id).tier_mask = 0;
  free_ids_.push_back(id);
  --size_;
}

void BlockIndex::Link(uint32_t id, size_t tier) {
  List& l = lists_[tier];
  Cold& e = ColdAt(id);
  e.prev[tier] = l.tail;
  e.next[tier] = kNil;
  HotAt(id).referenced &= static_cast<uint8_t>(~(1u << tier));
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

void BlockIndex::Touch(uint32_t id) {
  Hot& e = HotAt(id);
  const uint8_t mask = e.tier_mask;
  if (recency_ == Recency::kClock) {
    if (e.referenced != mask)
      e.referenced = mask;  // no store when already set: the line stays clean
    return;
  }
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
  uint32_t id;
  if (pos == static_cast<size_t>(-1)) {
    if (!buckets_ || (size_ + 1) * 10 > (mask_ + 1) * 7) {
      TPUSYNC_RETURN_IF_ERROR(Grow(buckets_ ? (mask_ + 1) * 2 : kMinBuckets));
    }
    TPUSYNC_ASSIGN_OR_RETURN(id, NewEntry());
    Hot& hot = HotAt(id);
    Cold& cold = ColdAt(id);
    hot.tier_mask = 0;
    hot.referenced = 0;
    hot.pins = 0;
    hot.location.fill(0);
    cold.location.fill(0);
    cold.prev.fill(kNil);
    cold.next.fill(kNil);
    hot.key_len = static_cast<uint8_t>(key.size());
    std::memcpy(hot.key, key.data(), std::min(key.size(), kHotKey));
    if (key.size() > kHotKey) {
      std::memcpy(cold.key, key.data() + kHotKey,
                  std::min(key.size(), kHotKey + kColdKey) - kHotKey);
    }
    if (key.size() > kHotKey + kColdKey) {
      std::memcpy(Tail(id), key.data() + kHotKey + kColdKey, key.size() - kHotKey - kColdKey);
    }
    uint64_t* b = buckets_->as<uint64_t>();
    for (pos = Home(h, mask_); b[pos] != 0; pos = (pos + 1) & mask_) {
    }
    b[pos] = MakeBucket(h, id);
    ++size_;
  } else {
    id = BucketId(buckets_->as<uint64_t>()[pos]);
  }
  Hot& e = HotAt(id);
  if (e.tier_mask & (1u << t)) {
    return Status::AlreadyExists(StrCat("block already indexed in the ", TierName(tier), " tier"));
  }
  Placement p = PlacementOf(id);  // re-stored by rank: the new tier may shift the others
  p.tier_mask |= static_cast<uint8_t>(1u << t);
  p.location[t] = location;
  e.tier_mask = p.tier_mask;
  StoreLocations(id, p);
  Link(id, t);  // most recent in the new tier (both modes)
  Touch(id);
  if (recency_ == Recency::kClock) e.referenced &= static_cast<uint8_t>(~(1u << t));
  return Status::OK();
}

std::optional<Placement> BlockIndex::Lookup(std::string_view key, bool touch) {
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  if (pos == static_cast<size_t>(-1)) return std::nullopt;
  const uint32_t id = BucketId(buckets_->as<uint64_t>()[pos]);
  if (touch) Touch(id);
  return PlacementOf(id);
}

size_t BlockIndex::LookupPrefix(std::span<const std::string_view> keys,
                                std::vector<Placement>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!buckets_) return 0;
  const uint64_t* b = buckets_->as<uint64_t>();
  const size_t count = keys.size();
  // PIPELINE: one pass over the batch in which iteration i hashes key i + kBucketAhead and
  // prefetches its bucket, reads the (by now cached) bucket of key i + kEntryAhead and prefetches
  // the entry it names, reads the (by now cached) entry of key i + kNeighbourAhead and prefetches
  // its LRU neighbours for writing, and only then compares, touches and reports key i. So every
  // iteration has about three keys' worth of misses in flight and none of them is waited for:
  // the misses of a batch overlap continuously instead of in bursts with a stall per stage.
  // Prefetches are hints only; the touch itself relinks with the exact LRU order of the moment
  // (a neighbour read early may have changed by then; that costs a miss, never correctness).
  uint64_t hashes[kRing];
  uint32_t ids[kRing];
  const auto stage_bucket = [&](size_t j) {
    hashes[j & (kRing - 1)] = Hash(keys[j]);
    __builtin_prefetch(&b[Home(hashes[j & (kRing - 1)], mask_)]);
  };
  const auto stage_entry = [&](size_t j) {
    const uint64_t h = hashes[j & (kRing - 1)];
    const uint32_t tag = Tag(h);
    uint32_t id = kNil;
    for (size_t pos = Home(h, mask_); b[pos] != 0; pos = (pos + 1) & mask_) {
      if (static_cast<uint32_t>(b[pos] >> 32) == tag) {
        id = BucketId(b[pos]);
        PrefetchRead(&HotAt(id));
        // Exact LRU reads the links too; so does a long key (cold key bytes).
        if (recency_ == Recency::kExactLru || keys[j].size() > kHotKey) PrefetchRead(&ColdAt(id));
        break;
      }
    }
    ids[j & (kRing - 1)] = id;
  };
  const auto stage_neighbours = [&](size_t j) {
    const uint32_t id = ids[j & (kRing - 1)];
    if (id == kNil || recency_ == Recency::kClock) return;  // kClock touches no neighbour
    const uint8_t mask = HotAt(id).tier_mask;
    const Cold& e = ColdAt(id);
    for (size_t t = 0; t < kNumTiers; ++t) {
      if (!(mask & (1u << t))) continue;
      if (e.prev[t] != kNil) __builtin_prefetch(&ColdAt(e.prev[t]), 1);
      if (e.next[t] != kNil) __builtin_prefetch(&ColdAt(e.next[t]), 1);
    }
  };
  // Warm-up: fill the three stages for the first keys.
  for (size_t j = 0; j < std::min(count, kBucketAhead); ++j) stage_bucket(j);
  for (size_t j = 0; j < std::min(count, kEntryAhead); ++j) stage_entry(j);
  for (size_t j = 0; j < std::min(count, kNeighbourAhead); ++j) stage_neighbours(j);
  for (size_t i = 0; i < count; ++i) {
    if (i + kBucketAhead < count) stage_bucket(i + kBucketAhead);
    if (i + kEntryAhead < count) stage_entry(i + kEntryAhead);
    if (i + kNeighbourAhead < count) stage_neighbours(i + kNeighbourAhead);
    // The first tag match is usually the key; Find confirms it (and handles a tag collision).
    const uint64_t h = hashes[i & (kRing - 1)];
    const uint32_t guess = ids[i & (kRing - 1)];
    uint32_t id;
    if (guess != kNil && KeyIs(guess, keys[i])) {
      id = guess;
    } else {
      const size_t pos = Find(keys[i], h);
      if (pos == static_cast<size_t>(-1)) return i;
      id = BucketId(b[pos]);
    }
    Touch(id);
    if (out) out->push_back(PlacementOf(id));
  }
  return count;
}

Result<uint64_t> BlockIndex::Remove(std::string_view key, Tier tier) {
  const size_t t = static_cast<size_t>(tier);
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  const uint32_t id =
      pos == static_cast<size_t>(-1) ? kNil : BucketId(buckets_->as<uint64_t>()[pos]);
  if (id == kNil || !(HotAt(id).tier_mask & (1u << t))) {
    return Status::NotFound(StrCat("block not indexed in the ", TierName(tier), " tier"));
  }
  Placement p = PlacementOf(id);
  const uint64_t loc = p.location[t];
  Unlink(id, t);
  p.tier_mask &= static_cast<uint8_t>(~(1u << t));
  HotAt(id).tier_mask = p.tier_mask;
  if (p.tier_mask == 0) {
    FreeEntry(pos);
  } else {
    StoreLocations(id, p);  // the tiers after t move down one rank
  }
  return loc;
}

Result<Placement> BlockIndex::Erase(std::string_view key) {
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  if (pos == static_cast<size_t>(-1)) return Status::NotFound("block not indexed");
  const uint32_t id = BucketId(buckets_->as<uint64_t>()[pos]);
  const Placement p = PlacementOf(id);
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (p.tier_mask & (1u << t)) Unlink(id, t);
  }
  FreeEntry(pos);
  return p;
}

Status BlockIndex::Pin(std::string_view key) {
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  if (pos == static_cast<size_t>(-1))
    return Status::NotFound("cannot pin a block that is not indexed");
  Hot& e = HotAt(BucketId(buckets_->as<uint64_t>()[pos]));
  if (e.pins == UINT32_MAX) return Status::FailedPrecondition("pin count overflow");
  ++e.pins;
  return Status::OK();
}

Status BlockIndex::Unpin(std::string_view key) {
  const uint64_t h = Hash(key);
  std::lock_guard<std::mutex> lock(mu_);
  const size_t pos = Find(key, h);
  if (pos == static_cast<size_t>(-1)) {
    return Status::NotFound("cannot unpin a block that is not indexed");
  }
  Hot& e = HotAt(BucketId(buckets_->as<uint64_t>()[pos]));
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
      if (HotAt(id).pins == 0) out.push_back({KeyOf(id), PlacementOf(id).location[t]});
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
    const Hot& e = HotAt(id);
    uint32_t next = ColdAt(id).next[t];
    if (e.referenced & bit) {
      Unlink(id, t);
      Link(id, t);                  // clears the bit
      if (next == kNil) next = id;  // it was the tail: it is still next, now unreferenced
    } else {
      if (id == first_kept) break;
      if (first_kept == kNil) first_kept = id;
      if (e.pins == 0) out.push_back({KeyOf(id), PlacementOf(id).location[t]});
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
  for (uint32_t id = 0; id < next_id_; ++id) {
    if (HotAt(id).tier_mask != 0) out.emplace_back(KeyOf(id), PlacementOf(id));
  }
  return out;
}

void BlockIndex::ForEachIn(
    Tier tier, const std::function<void(std::string_view key, uint64_t location)>& fn) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint8_t bit = static_cast<uint8_t>(1u << static_cast<unsigned>(tier));
  char key[kMaxKeyBytes];
  for (uint32_t id = 0; id < next_id_; ++id) {
    if (!(HotAt(id).tier_mask & bit)) continue;
    fn(std::string_view(key, CopyKey(id, key)),
       PlacementOf(id).location[static_cast<size_t>(tier)]);
  }
}

bool BlockIndex::ForEachInChunk(
    Tier tier, uint64_t* cursor, size_t max_keys,
    const std::function<void(std::string_view key, uint64_t location)>& fn) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint8_t bit = static_cast<uint8_t>(1u << static_cast<unsigned>(tier));
  const size_t t = static_cast<size_t>(tier);
  max_keys = std::max<size_t>(1, max_keys);  // 0 would never advance the cursor
  const size_t max_looked = max_keys * 8;
  char key[kMaxKeyBytes];
  uint64_t id = *cursor;
  size_t visited = 0, looked = 0;
  for (; id < next_id_ && visited < max_keys && looked < max_looked; ++id, ++looked) {
    const uint32_t i = static_cast<uint32_t>(id);
    if (!(HotAt(i).tier_mask & bit)) continue;
    fn(std::string_view(key, CopyKey(i, key)), PlacementOf(i).location[t]);
    ++visited;
  }
  *cursor = id;
  return id < next_id_;
}

void BlockIndex::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  // Capacity is kept (a cleared store refills to the same size); entries are reused from id 0.
  if (buckets_) std::memset(buckets_->as<uint64_t>(), 0, (mask_ + 1) * sizeof(uint64_t));
  for (uint32_t id = 0; id < next_id_; ++id) HotAt(id).tier_mask = 0;
  free_ids_.clear();
  next_id_ = 0;
  size_ = 0;
  lists_ = {};
}

}  // namespace tpusync::block
