// Checkpoint manifests and the slot journal of the disk tier (tier/disk_tier.h CHECKPOINT and
// RESTART CONTRACTs, tier/disk_journal.h JOURNAL CONTRACT). A "crash" here destroys the tier
// without CheckpointOnClose: its files are then exactly what a SIGKILL leaves (every write(2) done,
// nothing else); the real SIGKILL is in packages/tpusync-core/tests/test_store_checkpoint.py.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "test_io.h"
#include "tpusync/base/checksum.h"
#include "tpusync/tier/disk_journal.h"
#include "tpusync/tier/disk_manifest.h"
#include "tpusync/tier/disk_tier.h"

namespace tpusync::tier {
namespace {

namespace fs = std::filesystem;

constexpr size_t kBytes = 4096;
constexpr size_t kSlots = 256;

using Blocks = std::map<std::string, std::pair<uint64_t, uint64_t>>;  // key -> (slot, sequence)

Blocks AsMap(const std::vector<RecoveredBlock>& rec) {
  Blocks m;
  for (const RecoveredBlock& b : rec) m[b.key] = {b.location, b.sequence};
  return m;
}

std::vector<uint8_t> Data(const std::string& key) {
  std::vector<uint8_t> v(kBytes);
  const uint64_t seed = Checksum64(key.data(), key.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed + i * 131);
  return v;
}

class DiskCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = UniqueTestDir("checkpoint"); }
  void TearDown() override {
    fs::remove_all(dir_);
    fs::remove_all(dir_ + "-scan");
  }

  DiskTierOptions Options(const std::string& dir) {
    DiskTierOptions o;
    o.directory = dir;
    o.manifest_progressive_write_back = progressive_;
    o.block_bytes = kBytes;
    o.num_blocks = kSlots;
    o.segment_blocks = 64;
    o.fingerprint = "model-a";
    o.wrap_io = [this](std::unique_ptr<IoBackend> inner) -> std::unique_ptr<IoBackend> {
      return std::make_unique<CountingIo>(std::move(inner), &io_ops_);
    };
    return o;
  }
  std::unique_ptr<DiskTier> Open(const std::string& dir) {
    io_ops_ = 0;
    auto t = DiskTier::Open(Options(dir));
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return std::move(t.value());
  }
  std::unique_ptr<DiskTier> Open() { return Open(dir_); }

  // The index of the tests: key -> slot, guarded like the store's.
  void Put(DiskTier& t, const std::string& key) {
    const auto d = Data(key);
    BlockWrite w{key, d.data(), *t.Reserve(), ++seq_, {}};
    t.WriteBatch({&w, 1});
    ASSERT_TRUE(w.status.ok()) << w.status.ToString();
    std::lock_guard<std::mutex> lock(mu_);
    index_[key] = {w.location, w.sequence};
  }
  void Remove(DiskTier& t, const std::string& key) {  // index first, then the tier (the store)
    uint64_t slot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      slot = index_.at(key).first;
      index_.erase(key);
    }
    t.Release(slot, /*forget=*/true);
  }
  void Evict(DiskTier& t, const std::string& key) {
    uint64_t slot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      slot = index_.at(key).first;
      index_.erase(key);
    }
    t.Release(slot, /*forget=*/false);
  }
  Status Checkpoint(DiskTier& t) {
    return t.Checkpoint(OneChunk([this](const BlockVisitor& visit) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [key, where] : index_) visit(key, where.first);
    }));
  }
  // What a full scan of the same files finds: a copy of the directory without its manifest.
  Blocks ScanOfACopy() {
    const std::string copy = dir_ + "-scan";
    fs::remove_all(copy);
    fs::copy(dir_, copy, fs::copy_options::recursive);
    fs::remove(copy + "/LOCK");
    fs::remove(copy + "/manifest");
    testing::internal::CaptureStderr();
    auto t = Open(copy);
    testing::internal::GetCapturedStderr();
    EXPECT_EQ(t->stats().recovery, "scan");
    return AsMap(t->TakeRecovered());
  }
  void ExpectReadable(DiskTier& t, const Blocks& blocks) {
    for (const auto& [key, where] : blocks) {
      std::vector<uint8_t> out(kBytes);
      BlockRead r{key, out.data(), where.first, {}};
      t.ReadBatch({&r, 1});
      ASSERT_TRUE(r.status.ok()) << key << ": " << r.status.ToString();
      EXPECT_EQ(out, Data(key)) << key;
    }
  }
  // Keys only (a scan and the index agree on slots too; sequences are compared where known).
  static std::map<std::string, uint64_t> Slots(const Blocks& b) {
    std::map<std::string, uint64_t> m;
    for (const auto& [k, v] : b) m[k] = v.first;
    return m;
  }

  std::string dir_;
  bool progressive_ = true;  // DiskTierOptions::manifest_progressive_write_back (the default)
  std::atomic<uint64_t> io_ops_{0};
  std::mutex mu_;
  Blocks index_;
  uint64_t seq_ = 0;
};

TEST_F(DiskCheckpointTest, ACrashAfterACheckpointReadsOnlyTheJournaledSlotsAndMatchesAScan) {
  auto t = Open();
  for (int i = 0; i < 100; ++i) Put(*t, "a" + std::to_string(i));
  ASSERT_TRUE(Checkpoint(*t).ok());
  EXPECT_EQ(t->stats().checkpoints, 1u);
  EXPECT_EQ(t->stats().journaled, 0u);
  // After the checkpoint: 10 new blocks, 4 removed, 3 evicted and their slots re-used by 3 more
  // (the free list is LIFO), 2 evicted and left alone (their bytes stay: no journal record).
  for (int i = 0; i < 10; ++i) Put(*t, "b" + std::to_string(i));
  for (int i = 0; i < 4; ++i) Remove(*t, "a" + std::to_string(i));
  std::set<uint64_t> reused;
  for (int i = 10; i < 13; ++i) {
    reused.insert(index_.at("a" + std::to_string(i)).first);
    Evict(*t, "a" + std::to_string(i));
  }
  for (int i = 0; i < 3; ++i) Put(*t, "c" + std::to_string(i));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(reused.count(index_.at("c" + std::to_string(i)).first), 1u);
  Blocks evicted_intact;
  for (int i = 20; i < 22; ++i) {
    const std::string k = "a" + std::to_string(i);
    evicted_intact[k] = index_.at(k);
    Evict(*t, k);
  }
  EXPECT_EQ(t->stats().journaled, 10u + 4u + 3u);
  t.reset();  // crash

  const Blocks scan = ScanOfACopy();
  t = Open();
  const auto st = t->stats();
  EXPECT_EQ(st.recovery, "checkpoint");
  // The 4 forgotten slots, the 10 + 3 written ones: each header read once, nothing else.
  EXPECT_EQ(st.recovery_slots_read, 17u);
  EXPECT_EQ(io_ops_.load(), 17u);
  const Blocks got = AsMap(t->TakeRecovered());
  EXPECT_EQ(got, scan) << "the checkpoint restart must find what a full scan finds";
  Blocks want = index_;
  want.insert(evicted_intact.begin(), evicted_intact.end());  // a scan finds them too
  EXPECT_EQ(got, want);
  ExpectReadable(*t, got);
  EXPECT_EQ(t->used(), got.size());
}

TEST_F(DiskCheckpointTest, TheRestartContinuesTheJournalSoASecondCrashStillNeedsNoScan) {
  auto t = Open();
  for (int i = 0; i < 20; ++i) Put(*t, "a" + std::to_string(i));
  ASSERT_TRUE(Checkpoint(*t).ok());
  for (int i = 0; i < 5; ++i) Put(*t, "b" + std::to_string(i));
  t.reset();  // crash 1
  t = Open();
  ASSERT_EQ(t->stats().recovery, "checkpoint");
  EXPECT_EQ(AsMap(t->TakeRecovered()), index_);
  for (int i = 0; i < 3; ++i) Put(*t, "c" + std::to_string(i));
  Remove(*t, "a0");
  t.reset();  // crash 2, before any new checkpoint
  const Blocks scan = ScanOfACopy();
  t = Open();
  EXPECT_EQ(t->stats().recovery, "checkpoint");
  EXPECT_EQ(t->stats().recovery_slots_read, 5u + 3u + 1u);
  const Blocks got = AsMap(t->TakeRecovered());
  EXPECT_EQ(got, index_);
  EXPECT_EQ(got, scan);
  // A checkpoint now folds the journals into a new manifest and deletes them.
  ASSERT_TRUE(Checkpoint(*t).ok());
  EXPECT_EQ(ListJournals(dir_).size(), 1u);
  t.reset();
  t = Open();
  EXPECT_EQ(t->stats().recovery, "checkpoint");
  EXPECT_EQ(t->stats().recovery_slots_read, 0u);
  EXPECT_EQ(AsMap(t->TakeRecovered()), index_);
}

// Damage: the restart falls back to the scan with one stderr line naming why, and still finds
// every block.
enum class Damage { kTruncatedJournal, kOtherGeneration, kMissingGeneration, kRecord, kManifest };

class DiskCheckpointDamage : public DiskCheckpointTest,
                             public ::testing::WithParamInterface<std::tuple<Damage, const char*>> {
};

void Patch(const std::string& path, size_t offset, const void* bytes, size_t n) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
}

TEST_P(DiskCheckpointDamage, FallsBackToTheScan) {
  const auto [damage, reason] = GetParam();
  auto t = Open();
  for (int i = 0; i < 30; ++i) Put(*t, "a" + std::to_string(i));
  ASSERT_TRUE(Checkpoint(*t).ok());
  for (int i = 0; i < 6; ++i) Put(*t, "b" + std::to_string(i));
  Remove(*t, "a1");
  t.reset();  // crash
  const std::vector<uint64_t> gens = ListJournals(dir_);
  ASSERT_EQ(gens.size(), 1u);
  const std::string j = JournalPath(dir_, gens[0]);
  switch (damage) {
    case Damage::kTruncatedJournal: fs::resize_file(j, fs::file_size(j) - 3); break;
    case Damage::kOtherGeneration: {
      // A well-formed header of another generation (checksum recomputed) under this name.
      JournalHeader h{};
      std::ifstream(j, std::ios::binary).read(reinterpret_cast<char*>(&h), sizeof(h));
      h.generation += 7;
      h.header_checksum = Checksum64(&h, offsetof(JournalHeader, header_checksum));
      Patch(j, 0, &h, sizeof(h));
      break;
    }
    case Damage::kMissingGeneration: fs::rename(j, JournalPath(dir_, gens[0] + 1)); break;
    case Damage::kRecord: {
      const uint32_t slot = 200;  // a record whose check no longer matches
      Patch(j, sizeof(JournalHeader) + 2 * sizeof(JournalRecord), &slot, sizeof(slot));
      break;
    }
    case Damage::kManifest: {
      const std::string m = dir_ + "/manifest";
      const uint8_t x = 0x5a;
      Patch(m, fs::file_size(m) - sizeof(ManifestEntry) + 20, &x, 1);
      break;
    }
  }
  testing::internal::CaptureStderr();
  t = Open();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(t->stats().recovery, "scan");
  EXPECT_EQ(t->stats().recovery_slots_read, kSlots);
  EXPECT_NE(err.find(reason), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_TRUE(ListJournals(dir_).empty());
  EXPECT_FALSE(fs::exists(dir_ + "/manifest"));
  const Blocks got = AsMap(t->TakeRecovered());
  EXPECT_EQ(got, index_);
  ExpectReadable(*t, got);
}

std::string DamageName(const ::testing::TestParamInfo<std::tuple<Damage, const char*>>& info) {
  static const char* const kNames[] = {"TruncatedJournal", "OtherGeneration", "MissingGeneration",
                                       "Record", "Manifest"};
  return kNames[static_cast<int>(std::get<0>(info.param))];
}

INSTANTIATE_TEST_SUITE_P(
    EveryKind, DiskCheckpointDamage,
    ::testing::Values(
        std::make_tuple(Damage::kTruncatedJournal, "checkpoint not used: journal 1 is truncated"),
        std::make_tuple(Damage::kOtherGeneration,
                        "checkpoint not used: journal file of generation 1 holds generation 8"),
        std::make_tuple(Damage::kMissingGeneration,
                        "checkpoint not used: journal generation 1 is missing"),
        std::make_tuple(Damage::kRecord, "checkpoint not used: journal 1 record 2 is damaged"),
        std::make_tuple(Damage::kManifest, "manifest not used: manifest checksum mismatch")),
    DamageName);

// The two windows of a checkpoint, made deterministic: a block written before the checkpoint but
// indexed only after it (the store indexes after the write returns), and a block written while
// the walk runs. Neither is in the manifest; both must be in the new journal generation.
TEST_F(DiskCheckpointTest, BlocksWrittenButNotYetIndexedOrWrittenDuringTheWalkAreJournaled) {
  auto t = Open();
  for (int i = 0; i < 10; ++i) Put(*t, "a" + std::to_string(i));
  ASSERT_TRUE(Checkpoint(*t).ok());
  auto write = [&](const std::string& key) {
    const auto d = Data(key);
    BlockWrite w{key, d.data(), *t->Reserve(), ++seq_, {}};
    t->WriteBatch({&w, 1});
    EXPECT_TRUE(w.status.ok());
    return std::make_pair(w.location, w.sequence);
  };
  const auto pending = write("pending");  // written, not indexed yet
  std::pair<uint64_t, uint64_t> during;
  ASSERT_TRUE(t->Checkpoint(OneChunk([&](const BlockVisitor& visit) {
                 during = write("during-walk");
                 std::lock_guard<std::mutex> lock(mu_);
                 for (const auto& [key, where] : index_) visit(key, where.first);
               })).ok());
  index_["pending"] = pending;
  index_["during-walk"] = during;
  t.reset();  // crash
  t = Open();
  EXPECT_EQ(t->stats().recovery, "checkpoint");
  EXPECT_EQ(t->stats().recovery_slots_read, 2u);
  const Blocks got = AsMap(t->TakeRecovered());
  EXPECT_EQ(got, index_);
  ExpectReadable(*t, got);
}

// CHUNKED WALK (tier.h; CHECKPOINT CONTRACT): the walk's chunks come with the index lock
// released between them, so blocks move between chunks - deterministically here: a visited block
// evicted and its slot re-used by a key visited later (the same slot twice), a visited block
// removed, one evicted before its visit and its slot re-used, one re-put after its visit, and a
// block written before the rotation but indexed only after the walk passed its place. The restart
// must find exactly what the index holds, at the same slots, and what a scan finds.
TEST_F(DiskCheckpointTest, ChunkedWalkWithBlocksMovingBetweenChunksLosesNothing) {
  auto t = Open();
  std::vector<std::string> order;  // the walk's id order (new ids are appended, like the index)
  for (int i = 0; i < 12; ++i) {
    order.push_back("a" + std::to_string(i));
    Put(*t, order.back());
  }
  ASSERT_TRUE(Checkpoint(*t).ok());
  const auto d = Data("late");
  BlockWrite late{"late", d.data(), *t->Reserve(), ++seq_, {}};
  t->WriteBatch({&late, 1});  // written before the checkpoint, indexed during it
  ASSERT_TRUE(late.status.ok());
  size_t pos = 0;
  int calls = 0;
  const BlockChunks chunks = [&](const BlockVisitor& visit) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t n = 0; n < 3 && pos < order.size(); ++pos) {
        auto it = index_.find(order[pos]);
        if (it == index_.end()) continue;
        visit(it->first, it->second.first);
        ++n;
      }
    }
    ++calls;
    if (calls == 1) {                                   // a0, a1, a2 visited
      index_["late"] = {late.location, late.sequence};  // behind the cursor: never visited
      Evict(*t, "a0");
      Put(*t, "b0");  // a0's slot (the free list is LIFO)
      order.push_back("b0");
      Remove(*t, "a1");
      Evict(*t, "a2");
      Put(*t, "a2");
      order.push_back("a2");
    } else if (calls == 2) {  // a3, a4, a5 visited
      Evict(*t, "a8");
      Put(*t, "c0");  // a8's slot; its id is behind the cursor
    }
    return pos < order.size();
  };
  ASSERT_TRUE(t->Checkpoint(chunks).ok());
  EXPECT_GT(calls, 4);
  t.reset();  // crash
  const Blocks scan = ScanOfACopy();
  t = Open();
  EXPECT_EQ(t->stats().recovery, "checkpoint");
  const Blocks got = AsMap(t->TakeRecovered());
  EXPECT_EQ(Slots(got), Slots(index_));
  EXPECT_EQ(got, scan);
  ExpectReadable(*t, got);
}

// Checkpoints racing writers: every block written before the crash (written, then indexed, as
// the store does) is found by the restart - from the manifest or from the journal - and the
// restart finds exactly what a scan finds.
TEST_F(DiskCheckpointTest, CheckpointsRacingWritersLoseNoBlock) {
  auto t = Open();
  std::atomic<bool> stop{false};
  std::atomic<int> checkpoints{0};
  std::thread ck([&] {
    while (!stop.load()) {
      ASSERT_TRUE(Checkpoint(*t).ok());
      ++checkpoints;
    }
  });
  constexpr int kThreads = 3;
  constexpr int kPerThread = 400;
  constexpr int kWindow = 80;  // 3 x 80 blocks + 3 in flight < kSlots
  std::vector<std::thread> writers;
  for (int w = 0; w < kThreads; ++w) {
    writers.emplace_back([&, w] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::string key = "w" + std::to_string(w) + "-" + std::to_string(i);
        const auto d = Data(key);
        // Each writer keeps its newest kWindow blocks (removing the oldest), so the tier never
        // fills and forgetting releases race the checkpoints too.
        if (i >= kWindow) Remove(*t, "w" + std::to_string(w) + "-" + std::to_string(i - kWindow));
        auto slot = t->Reserve();
        ASSERT_TRUE(slot.ok());
        uint64_t seq;
        {
          std::lock_guard<std::mutex> lock(mu_);
          seq = ++seq_;
        }
        BlockWrite bw{key, d.data(), *slot, seq, {}};
        t->WriteBatch({&bw, 1});
        ASSERT_TRUE(bw.status.ok());
        std::this_thread::yield();  // the store indexes a block some time after its write
        std::lock_guard<std::mutex> lock(mu_);
        index_[key] = {bw.location, bw.sequence};
      }
    });
  }
  for (auto& th : writers) th.join();
  stop = true;
  ck.join();
  EXPECT_GE(checkpoints.load(), 2);
  t.reset();  // crash
  const Blocks scan = ScanOfACopy();
  t = Open();
  EXPECT_EQ(t->stats().recovery, "checkpoint");
  const Blocks got = AsMap(t->TakeRecovered());
  EXPECT_EQ(Slots(got), Slots(index_)) << "a block written during a checkpoint was lost";
  EXPECT_EQ(got, scan);
  ExpectReadable(*t, got);
}

// Both manifest write-backs (tier/disk_manifest.h WRITE-BACK CONTRACT) give a checkpoint that a
// crash restart reads: the same entries, only the journaled slots' headers read, every block back.
TEST_F(DiskCheckpointTest, EitherManifestWriteBackGivesTheSameCheckpointAndCrashRestart) {
  std::map<bool, Blocks> manifests;
  for (const bool progressive : {false, true}) {
    progressive_ = progressive;
    index_.clear();
    seq_ = 0;
    fs::remove_all(dir_);
    auto t = Open();
    for (int i = 0; i < 200; ++i) Put(*t, "a" + std::to_string(i));
    ASSERT_TRUE(Checkpoint(*t).ok());
    for (int i = 0; i < 5; ++i) Put(*t, "b" + std::to_string(i));
    t.reset();  // crash
    DiskMeta meta;
    std::ifstream(dir_ + "/tier.meta", std::ios::binary)
        .read(reinterpret_cast<char*>(&meta), sizeof(meta));
    ManifestContents mc;
    ASSERT_TRUE(ReadManifest(dir_, meta, kSlots / 64, kSlots, &mc).ok());
    EXPECT_EQ(mc.kind, ManifestKind::kCheckpoint);
    manifests[progressive] = AsMap(mc.blocks);
    t = Open();
    EXPECT_EQ(t->stats().recovery, "checkpoint") << "progressive " << progressive;
    EXPECT_EQ(t->stats().recovery_slots_read, 5u);
    const Blocks got = AsMap(t->TakeRecovered());
    EXPECT_EQ(got, index_);
    ExpectReadable(*t, got);
  }
  EXPECT_EQ(manifests[false].size(), 200u);
  EXPECT_EQ(manifests[false], manifests[true]);
}

// OLD-MANIFEST CONTRACT through the tier: a checkpoint leaves no manifest.old behind (the one it
// replaced is freed after the publish), and a manifest.old left by a crash - never read - is
// freed by the next checkpoint, which is then what a crash restart reads.
TEST_F(DiskCheckpointTest, ReplacedManifestIsFreedAndALeftoverIsRemovedByTheNextCheckpoint) {
  auto t = Open();
  for (int i = 0; i < 50; ++i) Put(*t, "a" + std::to_string(i));
  ASSERT_TRUE(Checkpoint(*t).ok());
  for (int i = 0; i < 5; ++i) Put(*t, "b" + std::to_string(i));
  ASSERT_TRUE(Checkpoint(*t).ok());
  EXPECT_FALSE(fs::exists(dir_ + "/manifest.old"));
  {
    std::ofstream junk(dir_ + "/manifest.old", std::ios::binary);  // a crash's leftover
    junk << std::string(3 << 20, 'x');
  }
  Put(*t, "c");
  ASSERT_TRUE(Checkpoint(*t).ok());
  EXPECT_FALSE(fs::exists(dir_ + "/manifest.old"));
  Put(*t, "d");
  t.reset();  // crash
  t = Open();
  EXPECT_EQ(t->stats().recovery, "checkpoint");
  EXPECT_EQ(t->stats().recovery_slots_read, 1u);
  const Blocks got = AsMap(t->TakeRecovered());
  EXPECT_EQ(got, index_);
  ExpectReadable(*t, got);
}

}  // namespace
}  // namespace tpusync::tier
