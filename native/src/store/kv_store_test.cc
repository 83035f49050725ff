#include "tpusync/store/kv_store.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "../tier/mock_tier.h"
#include "../tier/test_io.h"
#include "tpusync/tier/disk_tier.h"
#include "tpusync/tier/host_tier.h"

namespace tpusync::store {
namespace {

using block::Tier;
using tier::MockTier;
constexpr size_t kBytes = 4096;
constexpr auto kWait = std::chrono::seconds(10);

std::string Key(int i) { return "blk-" + std::to_string(i); }

struct Fixture {
  std::shared_ptr<concurrency::ThreadPool> engine = std::make_shared<concurrency::ThreadPool>(2);
  MockTier* host = nullptr;
  MockTier* disk = nullptr;
  std::unique_ptr<KVStore> store;

  explicit Fixture(size_t host_blocks, size_t disk_blocks = 0, StoreConfig cfg = {}) {
    std::vector<std::unique_ptr<tier::BlockTier>> tiers;
    auto h = std::make_unique<MockTier>(Tier::kHost, kBytes, host_blocks);
    host = h.get();
    tiers.push_back(std::move(h));
    if (disk_blocks) {
      auto d = std::make_unique<MockTier>(Tier::kDisk, kBytes, disk_blocks);
      disk = d.get();
      tiers.push_back(std::move(d));
    }
    cfg.put_wait_s = 2.0;
    store = std::move(KVStore::Open(std::move(tiers), cfg, engine).value());
  }

  std::vector<uint8_t> Put(const std::vector<int>& ids) {
    std::vector<uint8_t> buf(ids.size() * kBytes);
    std::vector<std::string> keys;
    for (size_t i = 0; i < ids.size(); ++i) {
      std::fill_n(buf.begin() + i * kBytes, kBytes, static_cast<uint8_t>(ids[i]));
      keys.push_back(Key(ids[i]));
    }
    auto stored = std::make_shared<std::vector<uint8_t>>();
    memory::RowBuffer src{buf.data(), kBytes, ids.size(), {}};
    auto f = store->Put(keys, src, stored);
    EXPECT_TRUE(f->Wait(kWait).ok());
    return *stored;
  }
  // Returns the found mask; checks the content of every hit.
  std::vector<uint8_t> Get(const std::vector<int>& ids) {
    std::vector<uint8_t> buf(ids.size() * kBytes, 0xee);
    std::vector<std::string> keys;
    for (int i : ids) keys.push_back(Key(i));
    auto found = std::make_shared<std::vector<uint8_t>>();
    auto f = store->Get(keys, {buf.data(), kBytes, ids.size(), {}}, found);
    EXPECT_TRUE(f->Wait(kWait).ok());
    for (size_t i = 0; i < ids.size(); ++i) {
      if ((*found)[i]) {
        EXPECT_EQ(buf[i * kBytes], static_cast<uint8_t>(ids[i]));
        EXPECT_EQ(buf[i * kBytes + kBytes - 1], static_cast<uint8_t>(ids[i]));
      }
    }
    return *found;
  }
};

TEST(KVStore, PutGetLookupRemove) {
  Fixture f(8);
  EXPECT_EQ(f.Put({1, 2, 3}), (std::vector<uint8_t>{1, 1, 1}));
  EXPECT_EQ(f.Put({2}), (std::vector<uint8_t>{1}));  // already stored: nothing written
  EXPECT_EQ(f.host->stats().blocks_written, 3u);
  EXPECT_EQ(f.Get({3, 9, 1}), (std::vector<uint8_t>{1, 0, 1}));
  std::vector<std::string_view> keys = {"blk-1", "blk-2", "blk-7", "blk-3"};
  std::vector<block::Placement> where;
  EXPECT_EQ(f.store->Lookup(keys, &where), 2u);
  ASSERT_EQ(where.size(), 2u);
  EXPECT_TRUE(where[0].in(Tier::kHost));
  std::vector<std::string_view> rm = {"blk-2", "blk-nope"};
  EXPECT_EQ(*f.store->Remove(rm), 1u);
  EXPECT_EQ(f.Get({2}), (std::vector<uint8_t>{0}));
  const StoreStats s = f.store->stats();
  EXPECT_EQ(s.put_stored, 3u);
  EXPECT_EQ(s.put_present, 1u);
  EXPECT_EQ(s.tiers[0].hits, 2u);
  EXPECT_EQ(s.misses, 2u);
  f.store->Clear();
  EXPECT_EQ(f.store->stats().keys, 0u);
  EXPECT_EQ(f.host->used(), 0u);
}

TEST(KVStore, BadInputIsRefusedBeforeAnythingMoves) {
  Fixture f(4);
  std::vector<uint8_t> buf(kBytes);
  auto stored = std::make_shared<std::vector<uint8_t>>();
  auto fut = f.store->Put({"a", "b"}, {buf.data(), kBytes, 1, {}}, stored);
  EXPECT_EQ(fut->Wait(kWait).code(), StatusCode::kInvalidArgument);
  fut = f.store->Put({std::string(65, 'k')}, {buf.data(), kBytes, 1, {}}, stored);
  EXPECT_EQ(fut->Wait(kWait).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f.host->used(), 0u);
  // A get refuses the keys a put refuses (it reported them as misses): nothing is read or counted.
  EXPECT_EQ(f.Put({1}), (std::vector<uint8_t>{1}));
  auto found = std::make_shared<std::vector<uint8_t>>();
  std::vector<uint8_t> two(2 * kBytes);
  for (const std::string& bad : {std::string(), std::string(65, 'k')}) {
    fut = f.store->Get({Key(1), bad}, {two.data(), kBytes, 2, {}}, found);
    EXPECT_EQ(fut->Wait(kWait).code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(f.store->stats().misses, 0u);
  EXPECT_EQ(f.store->stats().tiers[0].hits, 0u);
  std::vector<std::string_view> missing = {"zzz"};
  EXPECT_EQ(f.store->Pin(missing).code(), StatusCode::kNotFound);
}

TEST(KVStore, ConfigThatWouldHangOrMisreadIsRefusedAtOpen) {
  // writeback_batch 0 looped for ever under the store lock at the first write-back round.
  for (auto bad : {[] {
                     StoreConfig c;
                     c.writeback_batch = 0;
                     return c;
                   }(),
                   [] {
                     StoreConfig c;
                     c.put_wait_s = std::nan("");
                     return c;
                   }()}) {
    std::vector<std::unique_ptr<tier::BlockTier>> tiers;
    tiers.push_back(std::make_unique<MockTier>(Tier::kHost, kBytes, 4));
    tiers.push_back(std::make_unique<MockTier>(Tier::kDisk, kBytes, 8));
    auto s = KVStore::Open(std::move(tiers), bad, std::make_shared<concurrency::ThreadPool>(1));
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(KVStore, InfinitePutWaitWaitsForWriteBackInsteadOfGivingUp) {
  // SECONDS CONTRACT: put_wait_s = inf waits for room (it overflowed to "no wait": 2 of 8 stored).
  StoreConfig cfg;
  cfg.put_wait_s = std::numeric_limits<double>::infinity();
  std::vector<std::unique_ptr<tier::BlockTier>> tiers;
  tiers.push_back(std::make_unique<MockTier>(Tier::kHost, kBytes, 2));
  tiers.push_back(std::make_unique<MockTier>(Tier::kDisk, kBytes, 16));
  auto store = KVStore::Open(std::move(tiers), cfg, std::make_shared<concurrency::ThreadPool>(2));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  constexpr size_t kN = 8;
  std::vector<uint8_t> buf(kN * kBytes, 7);
  std::vector<std::string> keys;
  for (size_t i = 0; i < kN; ++i) keys.push_back(Key(static_cast<int>(i)));
  auto stored = std::make_shared<std::vector<uint8_t>>();
  ASSERT_TRUE((*store)->Put(keys, {buf.data(), kBytes, kN, {}}, stored)->Wait(kWait).ok());
  EXPECT_EQ(*stored, std::vector<uint8_t>(kN, 1));
}

TEST(KVStore, PinnedBlocksAreNeverEvicted) {
  Fixture f(4);
  f.Put({1, 2, 3, 4});
  std::vector<std::string_view> pin = {"blk-1", "blk-2"};
  ASSERT_TRUE(f.store->Pin(pin).ok());
  f.Put({5, 6, 7, 8});  // host only: LRU evicts the unpinned ones
  EXPECT_EQ(f.Get({1, 2}), (std::vector<uint8_t>{1, 1}));
  EXPECT_EQ(f.host->used(), 4u);
  ASSERT_TRUE(f.store->Pin(pin).ok());
  std::vector<std::string_view> rm = {"blk-1"};
  EXPECT_EQ(f.store->Remove(rm).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(f.store->Unpin(pin).ok());
  ASSERT_TRUE(f.store->Unpin(pin).ok());
  EXPECT_EQ(f.store->Unpin(pin).code(), StatusCode::kFailedPrecondition);
}

TEST(KVStore, AllPinnedMeansNotStoredNotOverfilled) {
  Fixture f(2);
  f.Put({1, 2});
  std::vector<std::string_view> pin = {"blk-1", "blk-2"};
  ASSERT_TRUE(f.store->Pin(pin).ok());
  EXPECT_EQ(f.Put({3}), (std::vector<uint8_t>{0}));
  EXPECT_EQ(f.store->stats().put_rejected, 1u);
  EXPECT_EQ(f.host->used(), 2u);
}

// Both recency modes of the index (block_index.h, RECENCY CONTRACT) under random churn of puts,
// gets, pins, unpins and removes over a small host + disk store: a pinned block is always
// readable, no tier ever holds more than its capacity, and every key put is either readable or
// counted (evicted / removed).
class KVStoreRecency : public ::testing::TestWithParam<block::Recency> {};

TEST_P(KVStoreRecency, PinnedStayCapacityHoldsUnderChurn) {
  StoreConfig cfg;
  cfg.writeback_batch = 1;
  cfg.index_recency = GetParam();
  Fixture f(4, 6, cfg);
  std::mt19937_64 rng(5 + static_cast<int>(GetParam()));
  std::map<int, int> pins;
  for (int step = 0; step < 400; ++step) {
    const int id = static_cast<int>(rng() % 16);
    const std::string k = Key(id);
    std::vector<std::string_view> one = {k};
    switch (rng() % 6) {
      case 0:
      case 1: f.Put({id}); break;
      case 2: f.Get({id, static_cast<int>(rng() % 16)}); break;
      case 3: {  // at most two keys pinned: a full host tier of pins makes puts wait put_wait_s
        size_t pinned = 0;
        for (const auto& [p, n] : pins) pinned += n > 0;
        if ((pins[id] > 0 || pinned < 2) && f.store->Pin(one).ok()) ++pins[id];
        break;
      }
      case 4:
        if (pins[id] > 0 && f.store->Unpin(one).ok()) --pins[id];
        break;
      default:
        if (pins[id] == 0) (void)f.store->Remove(one);
    }
    ASSERT_LE(f.host->used(), 4u) << "step " << step;
    ASSERT_LE(f.disk->used(), 6u) << "step " << step;
    for (const auto& [p, n] : pins) {
      if (n > 0) ASSERT_EQ(f.Get({p}), (std::vector<uint8_t>{1})) << "pinned " << p;
    }
  }
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  EXPECT_LE(f.host->used(), 4u);
  EXPECT_LE(f.disk->used(), 6u);
  EXPECT_GT(f.store->stats().evicted, 0u);  // the churn did reach the eviction path
}

INSTANTIATE_TEST_SUITE_P(BothModes, KVStoreRecency,
                         ::testing::Values(block::Recency::kExactLru, block::Recency::kClock));

TEST(KVStore, FullHostDemotesToDiskAndDiskHitsArePromoted) {
  StoreConfig cfg;
  cfg.writeback_batch = 2;
  Fixture f(4, 16, cfg);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(f.Put({i}), (std::vector<uint8_t>{1})) << i;
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  EXPECT_LE(f.host->used(), 4u);
  // Every block is still readable: the cold ones from disk.
  std::vector<int> all;
  for (int i = 0; i < 12; ++i) all.push_back(i);
  EXPECT_EQ(f.Get(all), std::vector<uint8_t>(12, 1));
  const StoreStats s = f.store->stats();
  EXPECT_GT(s.tiers[1].demotions_in, 0u);
  EXPECT_GT(s.tiers[1].hits, 0u);
  EXPECT_GT(s.tiers[0].promotions_in, 0u);
  EXPECT_EQ(s.evicted, 0u);
  EXPECT_LE(f.host->used(), 4u);
  EXPECT_LE(f.disk->used(), 16u);
}

TEST(KVStore, FullDiskEvictsLru) {
  StoreConfig cfg;
  cfg.writeback_batch = 1;
  Fixture f(2, 3, cfg);
  for (int i = 0; i < 10; ++i) f.Put({i});
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  const StoreStats s = f.store->stats();
  EXPECT_GT(s.evicted, 0u);
  EXPECT_LE(f.disk->used(), 3u);
  EXPECT_LE(s.keys, 5u);
  // The newest block survives; every key is either readable or was counted as evicted.
  EXPECT_EQ(f.Get({9}), (std::vector<uint8_t>{1}));
  std::vector<int> all;
  for (int i = 0; i < 10; ++i) all.push_back(i);
  auto found = f.Get(all);
  size_t hits = 0;
  for (auto x : found) hits += x;
  EXPECT_EQ(hits + f.store->stats().evicted, 10u);
}

TEST(KVStore, DiskFullKeepsServingFromDram) {
  StoreConfig cfg;
  cfg.writeback_batch = 1;
  Fixture f(2, 8, cfg);
  f.disk->FailNextWrites(1000);
  for (int i = 0; i < 6; ++i) f.Put({i});
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  const StoreStats s = f.store->stats();
  EXPECT_GT(s.writeback_errors, 0u);
  EXPECT_GT(s.tiers[1].tier.no_space_errors, 0u);
  EXPECT_EQ(f.Get({4, 5}), (std::vector<uint8_t>{1, 1}));  // newest still in DRAM
  f.disk->FailNextWrites(0);
  f.Put({40, 41, 42});
  EXPECT_EQ(f.Get({40, 41, 42}), (std::vector<uint8_t>{1, 1, 1}));
}

TEST(KVStore, WriteThroughCopiesEveryNewBlockToTheLastTierWithoutOverflow) {
  StoreConfig cfg;
  cfg.write_through = true;
  cfg.writeback_batch = 2;
  cfg.writeback_headroom = 2;  // write-back stays idle: only write-through copies blocks down
  Fixture f(16, 16, cfg);
  f.store->EnableEvents(1024);
  EXPECT_EQ(f.Put({1, 2, 3}), (std::vector<uint8_t>{1, 1, 1}));
  ASSERT_TRUE(f.store->Flush(kWait).ok());  // waits for the queued copies
  const StoreStats s = f.store->stats();
  EXPECT_EQ(s.write_through, 3u);
  EXPECT_EQ(s.tiers[0].indexed, 3u);  // DRAM is far from full: the copies stay too
  EXPECT_EQ(s.tiers[1].indexed, 3u);
  EXPECT_EQ(s.tiers[1].demotions_in, 0u);  // not write-back
  EXPECT_EQ(f.disk->stats().blocks_written, 3u);
  size_t disk_stored = 0;
  for (const StoreEvent& e : f.store->TakeEvents(100)) {
    disk_stored += e.kind == StoreEvent::Kind::kStored && e.tier == Tier::kDisk;
  }
  EXPECT_EQ(disk_stored, 3u);
  EXPECT_EQ(f.Put({2}), (std::vector<uint8_t>{1}));  // already stored: no second copy
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  EXPECT_EQ(f.store->stats().write_through, 3u);
}

TEST(KVStore, WriteThroughFailureBacksOffAndPutsStillSucceed) {
  StoreConfig cfg;
  cfg.write_through = true;
  cfg.writeback_batch = 4;
  Fixture f(16, 16, cfg);
  f.disk->FailNextWrites(1000);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(f.Put({i}), (std::vector<uint8_t>{1}));
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  StoreStats s = f.store->stats();
  EXPECT_GT(s.write_through_errors, 0u);
  EXPECT_EQ(s.write_through, 0u);
  // Failed copies are errors; the rest were skipped during the back-off: none is lost silently.
  EXPECT_EQ(s.write_through_errors + s.write_through_dropped, 8u);
  EXPECT_EQ(f.Get({0, 7}), (std::vector<uint8_t>{1, 1}));  // DRAM copies serve
  f.disk->FailNextWrites(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // the first back-off is 1 s
  f.Put({20});
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  EXPECT_EQ(f.store->stats().write_through, 1u);
}

TEST(KVStore, WriteThroughRetriesKeysThatWriteBackIsMovingToAMiddleTier) {
  // host (3 blocks) -> disk -> last tier (where store nodes sit). Write-through meets a key that
  // write-back is moving host -> disk at that moment; the key must still reach the last tier
  // (write-back only brings it to the disk), not be skipped uncounted.
  StoreConfig cfg;
  cfg.write_through = true;
  cfg.writeback_batch = 1;
  cfg.writeback_headroom = 2;  // write-back starts at 2 used blocks and scans the 2 coldest
  cfg.put_wait_s = 10.0;
  std::vector<std::unique_ptr<tier::BlockTier>> tiers;
  tiers.push_back(std::make_unique<MockTier>(Tier::kHost, kBytes, 3));
  auto disk_owned = std::make_unique<MockTier>(Tier::kDisk, kBytes, 16);
  auto last_owned = std::make_unique<MockTier>(Tier::kRemote, kBytes, 16);
  MockTier* disk = disk_owned.get();
  MockTier* last = last_owned.get();
  tiers.push_back(std::move(disk_owned));
  tiers.push_back(std::move(last_owned));
  auto store = std::move(
      KVStore::Open(std::move(tiers), cfg, std::make_shared<concurrency::ThreadPool>(2)).value());
  std::vector<std::vector<uint8_t>> bufs;
  for (int i = 0; i < 3; ++i) bufs.emplace_back(kBytes, static_cast<uint8_t>(i));
  auto put = [&](int i) {
    memory::RowBuffer src{bufs[i].data(), kBytes, 1, {}};
    return store->Put({Key(i)}, src, std::make_shared<std::vector<uint8_t>>());
  };
  auto until = [](auto done) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done() && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return done();
  };
  last->HoldWrites(true);
  disk->HoldWrites(true);
  ASSERT_TRUE(put(0)->Wait(kWait).ok());
  ASSERT_TRUE(until([&] { return last->waiting_writes() == 1; }));  // write-through on key 0
  // Key 1 queues behind key 0 for write-through, and write-back starts moving it to the disk
  // (key 0, being copied, is not eligible).
  ASSERT_TRUE(put(1)->Wait(kWait).ok());
  ASSERT_TRUE(until([&] { return disk->waiting_writes() == 1; }));
  last->HoldWrites(false);  // write-through finishes key 0 and meets key 1 mid-move
  ASSERT_TRUE(until([&] { return last->stats().blocks_written == 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  disk->HoldWrites(false);
  ASSERT_TRUE(put(2)->Wait(kWait).ok());
  ASSERT_TRUE(store->Flush(kWait).ok());
  const StoreStats s = store->stats();
  EXPECT_GT(s.tiers[1].demotions_in, 0u);  // write-back did move a key to the disk
  EXPECT_EQ(s.write_through_dropped + s.write_through_errors, 0u);
  EXPECT_EQ(s.write_through, 3u);
  EXPECT_EQ(s.tiers[2].indexed, 3u);
  EXPECT_EQ(last->stats().blocks_written, 3u);
}

TEST(KVStore, WriteThroughNeedsALowerTier) {
  StoreConfig cfg;
  cfg.write_through = true;
  std::vector<std::unique_ptr<tier::BlockTier>> tiers;
  tiers.push_back(std::make_unique<MockTier>(Tier::kHost, kBytes, 4));
  auto r = KVStore::Open(std::move(tiers), cfg, std::make_shared<concurrency::ThreadPool>(1));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(KVStore, CorruptedLowerTierBlockIsAMissAndItsSlotIsReclaimed) {
  StoreConfig cfg;
  cfg.writeback_batch = 4;
  cfg.writeback_headroom = 2;
  Fixture f(2, 8, cfg);
  for (int i = 0; i < 6; ++i) f.Put({i});
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  std::vector<std::string_view> k0 = {"blk-0"};
  std::vector<block::Placement> where;
  ASSERT_EQ(f.store->Lookup(k0, &where), 1u);
  ASSERT_TRUE(where[0].in(Tier::kDisk));
  ASSERT_FALSE(where[0].in(Tier::kHost));
  const size_t used = f.disk->used();
  f.disk->Damage(where[0].location[static_cast<size_t>(Tier::kDisk)]);
  EXPECT_EQ(f.Get({0}), (std::vector<uint8_t>{0}));
  EXPECT_EQ(f.store->stats().corrupted, 1u);
  EXPECT_EQ(f.disk->used(), used - 1);
  EXPECT_EQ(f.store->Lookup(k0, nullptr), 0u);
}

TEST(KVStore, KeysClearedWhileTheirWriteBackLandsLeaveNoKeyedSlotBelow) {
  // WRITTEN, NOT INDEXED: the slots a write-back batch wrote for keys cleared meanwhile were
  // released with their headers intact, so a restart after a crash brought the keys back.
  StoreConfig cfg;
  cfg.writeback_batch = 4;
  cfg.writeback_headroom = 2;
  Fixture f(4, 16, cfg);
  f.disk->HoldWrites(true);
  f.Put({1, 2, 3, 4});
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  while (f.disk->waiting_writes() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(f.disk->waiting_writes(), 1u);
  f.store->Clear();
  f.disk->HoldWrites(false);
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  EXPECT_EQ(f.store->stats().keys, 0u);
  EXPECT_EQ(f.disk->used(), 0u);
  EXPECT_GT(f.disk->forgets(), 0u);
  EXPECT_EQ(f.disk->keyed(), 0u);
}

TEST(KVStore, AGetRefusesTwoKeysIntoOneRow) {
  // DISTINCT ROWS: both reads raced into the row, and the disk hit was promoted to DRAM from it
  // after the other key's bytes landed there (that key's bytes under this key from then on).
  Fixture f(4, 16);
  f.Put({1, 2});
  std::vector<uint8_t> buf(2 * kBytes);
  auto found = std::make_shared<std::vector<uint8_t>>();
  auto fut = f.store->Get({Key(1), Key(2)}, {buf.data(), kBytes, 2, {1, 1}}, found);
  const Status s = fut->Wait(kWait);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("row index 1 is given for keys #0 and #1"), std::string::npos);
  EXPECT_EQ(f.Get({1, 2}), (std::vector<uint8_t>{1, 1}));
}

TEST(KVStore, OnePutWaitsPutWaitSecondsInAllNotPerKey) {
  // ONE PUT WAIT: with the host tier full of pinned blocks, each key of a put waited put_wait_s
  // in turn (12 keys at 0.5 s blocked the caller for 6 s).
  Fixture f(2, 16);  // put_wait_s = 2
  f.Put({1, 2});
  std::vector<std::string_view> pinned = {"blk-1", "blk-2"};
  ASSERT_TRUE(f.store->Pin(pinned).ok());
  const auto t0 = std::chrono::steady_clock::now();
  const auto stored = f.Put({10, 11, 12, 13});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(stored, (std::vector<uint8_t>{0, 0, 0, 0}));
  EXPECT_LT(s, 2.0 * 2 + 1.0);  // one put_wait_s (2 s) in all, with slack; it was 4 x 2 s
  ASSERT_TRUE(f.store->Unpin(pinned).ok());
}

TEST(KVStore, SecondUsePolicySparesTheDisk) {
  StoreConfig cfg;
  cfg.policy = "second_use";
  cfg.writeback_batch = 1;
  Fixture f(2, 8, cfg);
  f.Put({1});
  EXPECT_EQ(f.Get({1}), (std::vector<uint8_t>{1}));  // second use: admitted below
  for (int i = 10; i < 16; ++i) f.Put({i});          // used once: dropped, never written
  ASSERT_TRUE(f.store->Flush(kWait).ok());
  EXPECT_EQ(f.Get({1}), (std::vector<uint8_t>{1}));
  EXPECT_EQ(f.Get({10, 11}), (std::vector<uint8_t>{0, 0}));
  EXPECT_EQ(f.disk->stats().blocks_written, 1u);
  EXPECT_EQ(f.store->stats().policy, "second_use");
}

TEST(KVStore, RealTiersWarmRestart) {
  namespace fs = std::filesystem;
  const std::string ns = "kvtest-" + std::to_string(getpid());
  const std::string dir = (fs::temp_directory_path() / ("tpusync-kv-" + ns)).string();
  KVStoreOptions o;
  o.block_bytes = kBytes;
  o.host_blocks = 4;
  o.name_space = ns;
  o.fingerprint = "m1";
  o.disk_dir = dir;
  o.disk_blocks = 16;
  o.writeback_batch = 2;
  auto engine = std::make_shared<concurrency::ThreadPool>(2);
  std::vector<uint8_t> buf(10 * kBytes);
  std::vector<std::string> keys;
  for (int i = 0; i < 10; ++i) {
    std::fill_n(buf.begin() + i * kBytes, kBytes, static_cast<uint8_t>(i + 1));
    keys.push_back(Key(i));
  }
  {
    auto s = std::move(KVStore::Open(o, engine).value());
    auto stored = std::make_shared<std::vector<uint8_t>>();
    ASSERT_TRUE(s->Put(keys, {buf.data(), kBytes, 10, {}}, stored)->Wait(kWait).ok());
    ASSERT_TRUE(s->Flush(kWait).ok());
  }
  auto s = std::move(KVStore::Open(o, engine).value());
  std::vector<uint8_t> out(10 * kBytes);
  auto found = std::make_shared<std::vector<uint8_t>>();
  ASSERT_TRUE(s->Get(keys, {out.data(), kBytes, 10, {}}, found)->Wait(kWait).ok());
  EXPECT_EQ(*found, std::vector<uint8_t>(10, 1));
  EXPECT_EQ(out, buf);
  s.reset();
  ::unlink(("/dev/shm/tpusync-" + ns + "-host").c_str());
  ::unlink(("/dev/shm/tpusync-" + ns + "-host.lock").c_str());
  fs::remove_all(dir);
}

// CLEAN CLOSE with real tiers (tier/disk_tier.h CLEAN-CLOSE and RESTART CONTRACTs): a store that
// closes cleanly leaves a manifest; the next store takes it without one header read.
class KVStoreManifest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = tier::UniqueTestDir("kvmanifest"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // The disk tier in dir_: segments of 8 slots, fingerprint "m1".
  tier::DiskTierOptions DiskOptions(size_t disk_blocks) {
    tier::DiskTierOptions d;
    d.directory = dir_;
    d.block_bytes = kBytes;
    d.num_blocks = disk_blocks;
    d.segment_blocks = 8;
    d.fingerprint = "m1";
    return d;
  }

  // A store over an anonymous host tier (0: none) and a disk tier in dir_; io_ops_ counts the
  // disk tier's I/O from its Open on.
  std::unique_ptr<KVStore> Open(size_t host_blocks, size_t disk_blocks, bool checkpoints = true) {
    std::vector<std::unique_ptr<tier::BlockTier>> tiers;
    if (host_blocks > 0) {
      tier::HostTierOptions h;
      h.block_bytes = kBytes;
      h.num_blocks = host_blocks;
      tiers.push_back(std::move(tier::HostTier::Open(h).value()));
    }
    tier::DiskTierOptions d = DiskOptions(disk_blocks);
    d.wrap_io = [this](std::unique_ptr<tier::IoBackend> in) -> std::unique_ptr<tier::IoBackend> {
      return std::make_unique<tier::CountingIo>(std::move(in), &io_ops_);
    };
    io_ops_ = 0;
    tiers.push_back(std::move(tier::DiskTier::Open(d).value()));
    open_io_ops_ = io_ops_.load();
    StoreConfig cfg;
    cfg.writeback_batch = 2;
    cfg.put_wait_s = 2.0;
    if (!checkpoints) cfg.checkpoint_s = 0, cfg.checkpoint_writes = 0;
    return std::move(KVStore::Open(std::move(tiers), cfg, engine_).value());
  }
  concurrency::Future PutAsync(KVStore& s, const std::vector<int>& ids,
                               std::shared_ptr<std::vector<uint8_t>> stored) {
    bufs_.emplace_back(ids.size() * kBytes);
    std::vector<uint8_t>& buf = bufs_.back();
    std::vector<std::string> keys;
    for (size_t i = 0; i < ids.size(); ++i) {
      std::fill_n(buf.begin() + i * kBytes, kBytes, static_cast<uint8_t>(ids[i]));
      keys.push_back(Key(ids[i]));
    }
    return s.Put(keys, {buf.data(), kBytes, ids.size(), {}}, stored);
  }
  void Put(KVStore& s, const std::vector<int>& ids) {
    auto stored = std::make_shared<std::vector<uint8_t>>();
    ASSERT_TRUE(PutAsync(s, ids, stored)->Wait(kWait).ok());
    ASSERT_EQ(*stored, std::vector<uint8_t>(ids.size(), 1));
  }
  // Found mask of ids; every hit's bytes are checked.
  std::vector<uint8_t> Get(KVStore& s, const std::vector<int>& ids) {
    std::vector<uint8_t> buf(ids.size() * kBytes, 0xee);
    std::vector<std::string> keys;
    for (int i : ids) keys.push_back(Key(i));
    auto found = std::make_shared<std::vector<uint8_t>>();
    EXPECT_TRUE(s.Get(keys, {buf.data(), kBytes, ids.size(), {}}, found)->Wait(kWait).ok());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!(*found)[i]) continue;
      for (size_t b = 0; b < kBytes; b += 512) {
        EXPECT_EQ(buf[i * kBytes + b], static_cast<uint8_t>(ids[i])) << ids[i];
      }
    }
    return *found;
  }
  std::vector<int> OnDisk(KVStore& s, int n) {
    std::vector<int> ids;
    for (int i = 0; i < n; ++i) {
      std::vector<std::string_view> k;
      const std::string key = Key(i);
      k.push_back(key);
      std::vector<block::Placement> where;
      if (s.Lookup(k, &where) == 1 && where[0].in(Tier::kDisk)) ids.push_back(i);
    }
    return ids;
  }
  bool HasManifest() const { return std::filesystem::exists(dir_ + "/manifest"); }

  std::shared_ptr<concurrency::ThreadPool> engine_ = std::make_shared<concurrency::ThreadPool>(2);
  std::string dir_;
  std::atomic<uint64_t> io_ops_{0};
  uint64_t open_io_ops_ = 0;
  std::deque<std::vector<uint8_t>> bufs_;
};

TEST_F(KVStoreManifest, CleanCloseThenReopenServesEveryDiskBlockWithoutReadingHeaders) {
  auto s = Open(4, 32);
  for (int i = 0; i < 20; ++i) Put(*s, {i});
  ASSERT_TRUE(s->Flush(kWait).ok());
  const std::vector<int> on_disk = OnDisk(*s, 20);
  ASSERT_GE(on_disk.size(), 16u);
  EXPECT_TRUE(HasManifest());  // the cold open's first checkpoint (tier.h FIRST CHECKPOINT)
  s.reset();                   // clean close
  ASSERT_TRUE(HasManifest());

  s = Open(4, 32);
  EXPECT_EQ(open_io_ops_, 0u) << "the disk tier read slot headers although a manifest was there";
  const auto st = s->stats();
  EXPECT_EQ(st.tiers[1].tier.recovery, "manifest");
  EXPECT_EQ(st.tiers[1].tier.recovered, on_disk.size());
  EXPECT_EQ(st.tiers[1].indexed, on_disk.size());
  EXPECT_TRUE(HasManifest());  // continued by a new journal generation
  EXPECT_EQ(Get(*s, on_disk), std::vector<uint8_t>(on_disk.size(), 1));
  EXPECT_EQ(s->stats().corrupted, 0u);
}

// FIRST CHECKPOINT (tier.h): a cold-started disk tier is checkpointed inside Open (an empty walk),
// so it journals from its first write and a crash before any periodic checkpoint costs no scan;
// a store with checkpoints off writes none.
TEST_F(KVStoreManifest, AColdOpenWritesTheFirstCheckpointBeforeServing) {
  auto s = Open(0, 16);
  EXPECT_TRUE(HasManifest());
  EXPECT_EQ(s->stats().tiers[0].tier.checkpoints, 1u);
  EXPECT_FALSE(s->tier_at(0).CheckpointMissing());
  EXPECT_EQ(s->tier_at(0).ChangesSinceCheckpoint(), 0u);
  Put(*s, {1, 2});
  EXPECT_EQ(s->tier_at(0).ChangesSinceCheckpoint(), 2u);
  s.reset();
  std::filesystem::remove_all(dir_);
  s = Open(0, 16, /*checkpoints=*/false);
  EXPECT_FALSE(HasManifest());
  EXPECT_TRUE(s->tier_at(0).CheckpointMissing());
  EXPECT_EQ(s->stats().tiers[0].tier.checkpoints, 0u);
}

// FIRST CHECKPOINT: a store that opened its disk tier by scan (holding blocks, no manifest) has
// it checkpointed by the checkpoint thread at once, though neither trigger (60 s, 65536 writes)
// would fire; Open itself does not wait for it.
TEST_F(KVStoreManifest, AnOpenByScanIsCheckpointedInTheBackgroundAtOnce) {
  {
    auto t = std::move(tier::DiskTier::Open(DiskOptions(16)).value());
    std::vector<uint8_t> data(kBytes, 7);
    for (int i = 0; i < 3; ++i) {
      const std::string key = Key(i);
      tier::BlockWrite w{key, data.data(), *t->Reserve(), static_cast<uint64_t>(i + 1), {}};
      t->WriteBatch({&w, 1});
      ASSERT_TRUE(w.status.ok());
    }
  }  // destroyed without CheckpointOnClose: what a crash leaves
  testing::internal::CaptureStderr();
  auto s = Open(0, 16);
  testing::internal::GetCapturedStderr();
  EXPECT_EQ(s->stats().tiers[0].tier.recovery, "scan");
  EXPECT_EQ(s->stats().tiers[0].indexed, 3u);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (s->stats().tiers[0].tier.checkpoints == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(s->stats().tiers[0].tier.checkpoints, 1u);
  EXPECT_TRUE(HasManifest());
  EXPECT_FALSE(s->tier_at(0).CheckpointMissing());
  EXPECT_EQ(s->tier_at(0).ChangesSinceCheckpoint(), 0u);
}

TEST_F(KVStoreManifest, WriteOrderAndTheSequenceCounterSurviveAManifestRestart) {
  // Disk-only store of 8 slots: the LRU victims after a restart are the oldest writes, as with a
  // header scan, and new writes continue the sequence past every recovered one.
  auto s = Open(0, 8);
  for (int i = 0; i < 8; ++i) Put(*s, {i});
  s.reset();
  s = Open(0, 8);
  ASSERT_EQ(s->stats().tiers[0].tier.recovery, "manifest");
  Put(*s, {8});
  Put(*s, {9});
  auto found = Get(*s, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  EXPECT_EQ(found, (std::vector<uint8_t>{0, 0, 1, 1, 1, 1, 1, 1, 1, 1}));
  s.reset();
  // Look at the sequences the next open recovers (through the manifest written just now).
  tier::DiskTierOptions d = DiskOptions(8);
  auto disk = std::move(tier::DiskTier::Open(d).value());
  EXPECT_EQ(disk->stats().recovery, "manifest");
  std::map<std::string, uint64_t> seq;
  for (const auto& b : disk->TakeRecovered()) seq[b.key] = b.sequence;
  ASSERT_EQ(seq.size(), 8u);
  for (int i = 2; i < 7; ++i) EXPECT_LT(seq[Key(i)], seq[Key(i + 1)]) << i;
  EXPECT_LT(seq[Key(7)], seq[Key(8)]);
  EXPECT_LT(seq[Key(8)], seq[Key(9)]);
}

TEST_F(KVStoreManifest, AStoreThatFailedToOpenLeavesNoEmptyManifestBehind) {
  auto s = Open(0, 16);
  for (int i = 0; i < 6; ++i) Put(*s, {i});
  s.reset();
  ASSERT_TRUE(HasManifest());
  {  // fails after its disk tier took the manifest, before indexing anything
    tier::DiskTierOptions d = DiskOptions(16);
    std::vector<std::unique_ptr<tier::BlockTier>> tiers;
    tiers.push_back(std::move(tier::DiskTier::Open(d).value()));
    StoreConfig bad;
    bad.policy = "no-such-policy";
    ASSERT_FALSE(KVStore::Open(std::move(tiers), bad, engine_).ok());
  }
  // No empty manifest replaced the one it took: the next open still finds every block in it.
  ASSERT_TRUE(HasManifest());
  s = Open(0, 16);
  EXPECT_EQ(s->stats().tiers[0].tier.recovery, "manifest");
  EXPECT_EQ(Get(*s, {0, 1, 2, 3, 4, 5}), std::vector<uint8_t>(6, 1));
}

TEST_F(KVStoreManifest, CloseWhileOpsAndWriteBackAreInFlightListsOnlyCompletedBlocks) {
  auto s = Open(4, 64);
  std::vector<concurrency::Future> puts;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> stored;
  for (int i = 0; i < 12; ++i) {
    stored.push_back(std::make_shared<std::vector<uint8_t>>());
    puts.push_back(PutAsync(*s, {4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3}, stored.back()));
  }
  s.reset();  // no Wait, no Flush: the destructor drains ops and write-back, then checkpoints
  for (auto& f : puts) EXPECT_TRUE(f->Wait(kWait).ok());
  ASSERT_TRUE(HasManifest());
  s = Open(4, 64);
  const auto st = s->stats();
  EXPECT_EQ(st.tiers[1].tier.recovery, "manifest");
  const std::vector<int> on_disk = OnDisk(*s, 48);
  EXPECT_EQ(on_disk.size(), st.tiers[1].tier.recovered);
  EXPECT_EQ(Get(*s, on_disk), std::vector<uint8_t>(on_disk.size(), 1));
  EXPECT_EQ(s->stats().corrupted, 0u);
}

}  // namespace
}  // namespace tpusync::store
