// StoreEvent stream: replaying the events must reproduce exactly where the index places each key
// (puts, write-back demotions, LRU drops from both tiers, promotions, Remove, Clear).
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../tier/mock_tier.h"
#include "tpusync/store/kv_store.h"

namespace tpusync::store {
namespace {

using block::Tier;
using tier::MockTier;
constexpr size_t kBytes = 4096;
constexpr auto kWait = std::chrono::seconds(10);

std::string Key(int i) { return "ev-" + std::to_string(i); }

std::unique_ptr<KVStore> Open(size_t host_blocks, size_t disk_blocks,
                              std::shared_ptr<concurrency::ThreadPool> engine) {
  std::vector<std::unique_ptr<tier::BlockTier>> tiers;
  tiers.push_back(std::make_unique<MockTier>(Tier::kHost, kBytes, host_blocks));
  tiers.push_back(std::make_unique<MockTier>(Tier::kDisk, kBytes, disk_blocks));
  StoreConfig cfg;
  cfg.writeback_batch = 1;
  cfg.put_wait_s = 2.0;
  return std::move(KVStore::Open(std::move(tiers), cfg, std::move(engine)).value());
}

void Put(KVStore& s, int id) {
  std::vector<uint8_t> buf(kBytes, static_cast<uint8_t>(id));
  auto stored = std::make_shared<std::vector<uint8_t>>();
  ASSERT_TRUE(s.Put({Key(id)}, {buf.data(), kBytes, 1, {}}, stored)->Wait(kWait).ok());
}

void Get(KVStore& s, int id) {
  std::vector<uint8_t> buf(kBytes);
  auto found = std::make_shared<std::vector<uint8_t>>();
  ASSERT_TRUE(s.Get({Key(id)}, {buf.data(), kBytes, 1, {}}, found)->Wait(kWait).ok());
}

// key -> set of tiers, rebuilt from events only.
using Replay = std::map<std::string, std::set<Tier>>;

void Apply(Replay& r, const std::vector<StoreEvent>& evs) {
  for (const StoreEvent& e : evs) {
    switch (e.kind) {
      case StoreEvent::Kind::kStored:
        EXPECT_TRUE(r[e.key].insert(e.tier).second) << "stored twice: " << e.key;
        break;
      case StoreEvent::Kind::kRemoved:
        EXPECT_EQ(r[e.key].erase(e.tier), 1u) << "removed but never stored: " << e.key;
        if (r[e.key].empty()) r.erase(e.key);
        break;
      case StoreEvent::Kind::kCleared: r.clear(); break;
    }
  }
}

void ExpectMatchesIndex(KVStore& s, const Replay& r, int max_id) {
  for (int i = 0; i < max_id; ++i) {
    const std::string k = Key(i);
    std::string_view kv = k;
    std::vector<block::Placement> p;
    const size_t n = s.Lookup({&kv, 1}, &p);
    std::set<Tier> want;
    if (n == 1) {
      for (Tier t : {Tier::kHost, Tier::kDisk}) {
        if (p[0].in(t)) want.insert(t);
      }
    }
    auto it = r.find(k);
    EXPECT_EQ(it == r.end() ? std::set<Tier>{} : it->second, want) << k;
  }
}

TEST(KVStoreEvents, OffByDefault) {
  auto s = Open(4, 8, std::make_shared<concurrency::ThreadPool>(2));
  Put(*s, 1);
  EXPECT_TRUE(s->TakeEvents(100).empty());
}

TEST(KVStoreEvents, ReplayReproducesPlacementThroughDemotionEvictionPromotionRemoveClear) {
  auto s = Open(3, 5, std::make_shared<concurrency::ThreadPool>(2));
  s->EnableEvents(10000);
  Replay r;
  for (int i = 0; i < 12; ++i) Put(*s, i);  // host full -> demote to disk; disk full -> LRU drop
  ASSERT_TRUE(s->Flush(kWait).ok());
  std::vector<StoreEvent> evs = s->TakeEvents(100000);
  size_t disk_stored = 0, removed = 0;
  for (const auto& e : evs) {
    disk_stored += e.kind == StoreEvent::Kind::kStored && e.tier == Tier::kDisk;
    removed += e.kind == StoreEvent::Kind::kRemoved;
  }
  EXPECT_GT(disk_stored, 0u);  // demotions are announced
  EXPECT_GT(removed, 0u);      // evictions are announced
  Apply(r, evs);
  ExpectMatchesIndex(*s, r, 12);

  for (int i = 0; i < 12; ++i) Get(*s, i);  // disk hits are promoted to host
  ASSERT_TRUE(s->Flush(kWait).ok());
  Apply(r, s->TakeEvents(100000));
  ExpectMatchesIndex(*s, r, 12);

  const std::string k = Key(11);
  std::string_view kv = k;
  ASSERT_TRUE(s->Remove({&kv, 1}).ok());
  Apply(r, s->TakeEvents(100000));
  ExpectMatchesIndex(*s, r, 12);

  s->Clear();
  evs = s->TakeEvents(100000);
  ASSERT_EQ(evs.size(), 1u);
  EXPECT_EQ(evs[0].kind, StoreEvent::Kind::kCleared);
  Apply(r, evs);
  EXPECT_TRUE(r.empty());
}

TEST(KVStoreEvents, BoundedQueueDropsOldestAndCounts) {
  auto s = Open(8, 8, std::make_shared<concurrency::ThreadPool>(2));
  s->EnableEvents(3);
  for (int i = 0; i < 5; ++i) Put(*s, i);
  uint64_t dropped = 0;
  auto evs = s->TakeEvents(100, &dropped);
  ASSERT_EQ(evs.size(), 3u);
  EXPECT_EQ(dropped, 2u);
  EXPECT_EQ(evs.back().key, Key(4));
  s->TakeEvents(100, &dropped);
  EXPECT_EQ(dropped, 0u);  // reset by the previous call
  s->EnableEvents(0);
  Put(*s, 6);
  EXPECT_TRUE(s->TakeEvents(100).empty());
}

}  // namespace
}  // namespace tpusync::store
