// Clean-shutdown manifest of the disk tier (tier/disk_manifest.h MANIFEST CONTRACT,
// tier/disk_tier.h RESTART / CLEAN-CLOSE CONTRACTs).
#include "tpusync/tier/disk_manifest.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "test_io.h"
#include "tpusync/base/checksum.h"
#include "tpusync/tier/disk_journal.h"
#include "tpusync/tier/disk_tier.h"

namespace tpusync::tier {
namespace {

namespace fs = std::filesystem;

constexpr size_t kBytes = 8192;
constexpr size_t kSlots = 64;

using Blocks = std::map<std::string, std::pair<uint64_t, uint64_t>>;  // key -> (slot, sequence)

class DiskManifestTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = UniqueTestDir("manifest"); }
  void TearDown() override { fs::remove_all(dir_); }

  DiskTierOptions Options(const std::string& fp = "model-a") {
    DiskTierOptions o;
    o.directory = dir_;
    o.block_bytes = kBytes;
    o.num_blocks = kSlots;
    o.segment_blocks = 16;  // 4 segments
    o.fingerprint = fp;
    o.wrap_io = [this](std::unique_ptr<IoBackend> inner) -> std::unique_ptr<IoBackend> {
      return std::make_unique<CountingIo>(std::move(inner), &io_ops_);
    };
    return o;
  }
  std::unique_ptr<DiskTier> Open(const std::string& fp = "model-a") {
    io_ops_ = 0;
    auto t = DiskTier::Open(Options(fp));
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return std::move(t.value());
  }
  static std::vector<uint8_t> Data(const std::string& key) {
    std::vector<uint8_t> v(kBytes);
    const uint64_t seed = Checksum64(key.data(), key.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(seed + i * 131);
    return v;
  }
  // Writes keys "k<first>".."k<first+n-1>" with sequences seq0, seq0+1, ...
  void Write(DiskTier& t, int first, int n, uint64_t seq0) {
    for (int i = 0; i < n; ++i) {
      const std::string key = "k" + std::to_string(first + i);
      const auto d = Data(key);
      BlockWrite w{key, d.data(), *t.Reserve(), seq0 + i, {}};
      t.WriteBatch({&w, 1});
      ASSERT_TRUE(w.status.ok()) << w.status.ToString();
      blocks_[key] = {w.location, w.sequence};
    }
  }
  Status Checkpoint(DiskTier& t) {
    return t.CheckpointOnClose(OneChunk([this](const BlockVisitor& visit) {
      for (const auto& [key, where] : blocks_) visit(key, where.first);
    }));
  }
  static Blocks AsMap(const std::vector<RecoveredBlock>& rec) {
    Blocks m;
    for (const RecoveredBlock& b : rec) m[b.key] = {b.location, b.sequence};
    return m;
  }
  // Every block reads back verified from the slot the tier recovered it in.
  void ExpectAllReadable(DiskTier& t) {
    for (const auto& [key, where] : blocks_) {
      std::vector<uint8_t> out(kBytes);
      BlockRead r{key, out.data(), where.first, {}};
      t.ReadBatch({&r, 1});
      ASSERT_TRUE(r.status.ok()) << key << ": " << r.status.ToString();
      EXPECT_EQ(out, Data(key)) << key;
    }
  }
  std::string ManifestPath() const { return dir_ + "/manifest"; }
  bool HasManifest() const { return fs::exists(ManifestPath()); }

  std::string dir_;
  std::atomic<uint64_t> io_ops_{0};
  Blocks blocks_;
};

TEST_F(DiskManifestTest, CleanCloseThenOpenTakesTheManifestWithoutReadingAnyHeader) {
  auto t = Open();
  EXPECT_EQ(t->stats().recovery, "cold");
  Write(*t, 0, 40, 100);
  ASSERT_TRUE(Checkpoint(*t).ok());
  EXPECT_TRUE(HasManifest());
  t.reset();

  t = Open();
  EXPECT_EQ(io_ops_.load(), 0u) << "a manifest-based open must not read slot headers";
  EXPECT_EQ(t->stats().recovery, "manifest");
  EXPECT_TRUE(HasManifest()) << "the manifest stays: a new journal generation continues it";
  EXPECT_FALSE(fs::exists(dir_ + "/manifest.tmp"));
  EXPECT_EQ(t->stats().recovered, 40u);
  EXPECT_EQ(t->used(), 40u);
  const Blocks from_manifest = AsMap(t->TakeRecovered());
  EXPECT_EQ(from_manifest, blocks_);  // every key, in its slot, with its write sequence
  ExpectAllReadable(*t);
  // The slots it took are reserved: new blocks go elsewhere.
  for (size_t i = 0; i < kSlots - 40; ++i) {
    const uint64_t loc = *t->Reserve();
    for (const auto& [key, where] : blocks_) ASSERT_NE(loc, where.first);
  }
  EXPECT_FALSE(t->Reserve().ok());
  t.reset();

  // The same files without the manifest: a full scan finds the same.
  fs::remove(ManifestPath());
  t = Open();
  EXPECT_EQ(t->stats().recovery, "scan");
  EXPECT_GE(io_ops_.load(), kSlots);  // one header read per slot
  EXPECT_EQ(AsMap(t->TakeRecovered()), from_manifest);
}

TEST_F(DiskManifestTest, OnlyBlocksTheTierHoldsGoIntoTheManifest) {
  auto t = Open();
  Write(*t, 0, 5, 1);
  Blocks real = blocks_;
  blocks_["ghost-out-of-range"] = {kSlots + 3, 0};
  const uint64_t free_slot = *t->Reserve();  // reserved but never written
  blocks_["ghost-unwritten"] = {free_slot, 0};
  blocks_["zz-duplicate"] = {real.begin()->second.first, 0};
  testing::internal::CaptureStderr();
  ASSERT_TRUE(Checkpoint(*t).ok());
  EXPECT_NE(testing::internal::GetCapturedStderr().find("3 indexed blocks left out"),
            std::string::npos);
  t.reset();
  t = Open();
  EXPECT_EQ(t->stats().recovery, "manifest");
  auto got = AsMap(t->TakeRecovered());
  EXPECT_EQ(got.size(), 5u);
  for (const auto& [key, where] : real) EXPECT_EQ(got.count(key), 1u) << key;
}

TEST_F(DiskManifestTest, ACrashAfterAManifestBasedOpenReadsOnlyTheJournaledSlots) {
  auto t = Open();
  Write(*t, 0, 10, 1);
  ASSERT_TRUE(Checkpoint(*t).ok());
  t.reset();
  t = Open();
  ASSERT_EQ(t->stats().recovery, "manifest");
  t->TakeRecovered();
  Write(*t, 10, 5, 11);
  t.reset();  // a crash: no CheckpointOnClose
  t = Open();
  EXPECT_EQ(t->stats().recovery, "checkpoint");
  EXPECT_EQ(t->stats().recovery_slots_read, 5u);
  EXPECT_EQ(io_ops_.load(), 5u) << "only the 5 journaled slot headers may be read";
  EXPECT_EQ(AsMap(t->TakeRecovered()), blocks_);
  ExpectAllReadable(*t);
}

TEST_F(DiskManifestTest, WritesAndForgettingReleasesAfterTheManifestAreJournaled) {
  auto t = Open();
  Write(*t, 0, 3, 1);
  ASSERT_TRUE(Checkpoint(*t).ok());
  ASSERT_TRUE(HasManifest());
  EXPECT_EQ(t->stats().journaled, 0u);
  Write(*t, 3, 1, 4);
  EXPECT_TRUE(HasManifest());
  EXPECT_EQ(t->stats().journaled, 1u);
  t->Release(blocks_["k0"].first, /*forget=*/true);
  EXPECT_EQ(t->stats().journaled, 2u);
  t->Release(blocks_["k1"].first, /*forget=*/false);  // an eviction changes no byte
  EXPECT_EQ(t->stats().journaled, 2u);
}

// A damaged or foreign manifest: the open falls back to the scan, says why on stderr, recovers
// every block all the same, and deletes the bad manifest.
enum class Damage { kTruncated, kPadded, kEntryByte, kHeaderByte, kVersion, kSegmentTouched };

class DiskManifestDamage : public DiskManifestTest,
                           public ::testing::WithParamInterface<std::tuple<Damage, const char*>> {};

void Patch(const std::string& path, size_t offset, const void* bytes, size_t n) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
}

TEST_P(DiskManifestDamage, FallsBackToTheScanAndStillRecoversEverything) {
  const auto [damage, reason] = GetParam();
  auto t = Open();
  Write(*t, 0, 20, 1);
  ASSERT_TRUE(Checkpoint(*t).ok());
  const std::string seg0 = t->SegmentPath(0);
  t.reset();
  const std::string m = ManifestPath();
  const size_t size = fs::file_size(m);
  switch (damage) {
    case Damage::kTruncated: fs::resize_file(m, size - 7); break;
    case Damage::kPadded: fs::resize_file(m, size + sizeof(ManifestEntry)); break;
    case Damage::kEntryByte: {
      const uint8_t x = 0x5a;
      Patch(m, size - sizeof(ManifestEntry) + 20, &x, 1);  // a key byte of the last entry
      break;
    }
    case Damage::kHeaderByte: {
      const uint64_t n = 19;  // num_entries: one fewer
      Patch(m, offsetof(ManifestHeader, num_entries), &n, sizeof(n));
      break;
    }
    case Damage::kVersion: {
      // A well-formed manifest of a future format version (header checksum recomputed).
      ManifestHeader h{};
      std::ifstream(m, std::ios::binary).read(reinterpret_cast<char*>(&h), sizeof(h));
      h.version = kManifestVersion + 1;
      h.header_checksum = Checksum64(&h, offsetof(ManifestHeader, header_checksum));
      Patch(m, 0, &h, sizeof(h));
      break;
    }
    case Damage::kSegmentTouched: {
      // Another writer (an older tpusync) changed a segment after the manifest: its mtime moves.
      struct timespec times[2] = {{0, UTIME_OMIT}, {12345, 0}};
      ASSERT_EQ(utimensat(AT_FDCWD, seg0.c_str(), times, 0), 0);
      break;
    }
  }
  testing::internal::CaptureStderr();
  t = Open();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(t->stats().recovery, "scan");
  EXPECT_NE(err.find(std::string("manifest not used: ") + reason), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;  // one line
  EXPECT_FALSE(HasManifest());
  EXPECT_EQ(AsMap(t->TakeRecovered()), blocks_);
  ExpectAllReadable(*t);
}

std::string DamageName(const ::testing::TestParamInfo<std::tuple<Damage, const char*>>& info) {
  static const char* const kNames[] = {"Truncated",  "Padded",  "EntryByte",
                                       "HeaderByte", "Version", "SegmentTouched"};
  return kNames[static_cast<int>(std::get<0>(info.param))];
}

INSTANTIATE_TEST_SUITE_P(
    EveryKind, DiskManifestDamage,
    ::testing::Values(std::make_tuple(Damage::kTruncated, "manifest is truncated"),
                      std::make_tuple(Damage::kPadded, "manifest is truncated or padded"),
                      std::make_tuple(Damage::kEntryByte, "manifest checksum mismatch"),
                      std::make_tuple(Damage::kHeaderByte, "manifest header checksum mismatch"),
                      std::make_tuple(Damage::kVersion, "manifest format version 3"),
                      std::make_tuple(Damage::kSegmentTouched, "segment 0 changed after")),
    DamageName);

TEST_F(DiskManifestTest, ASegmentTruncatedSinceTheManifestIsCaughtAndScanned) {
  // The open sized the truncated segment back to full length before the manifest's size stamp
  // was compared, so the manifest was trusted: lookups hit blocks whose slots now read as zeros
  // (each get a counted corruption).
  auto t = Open();
  Write(*t, 0, 20, 1);
  ASSERT_TRUE(Checkpoint(*t).ok());
  const std::string seg0 = t->SegmentPath(0);
  t.reset();
  fs::resize_file(seg0, fs::file_size(seg0) / 2);
  testing::internal::CaptureStderr();
  t = Open();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(t->stats().recovery, "scan");
  EXPECT_NE(err.find("bytes at open (truncated or replaced since the last run)"), std::string::npos)
      << err;
  const Blocks rec = AsMap(t->TakeRecovered());
  EXPECT_LT(rec.size(), blocks_.size());  // the slots cut off are gone, not served
  EXPECT_GT(rec.size(), 0u);
  blocks_ = rec;
  ExpectAllReadable(*t);
  EXPECT_EQ(t->stats().corrupted, 0u);
}

TEST_F(DiskManifestTest, AManifestOfAnotherTierMetaIsNotUsed) {
  auto t = Open("model-a");
  Write(*t, 0, 6, 1);
  ASSERT_TRUE(Checkpoint(*t).ok());
  t.reset();
  const std::string saved = dir_ + "-saved-manifest";
  fs::copy_file(ManifestPath(), saved);
  // Another model: a cold start deletes segments and manifest alike.
  t = Open("model-b");
  EXPECT_EQ(t->stats().recovery, "cold");
  EXPECT_FALSE(HasManifest());
  blocks_.clear();
  Write(*t, 100, 4, 1);
  t.reset();                             // no clean close
  fs::copy_file(saved, ManifestPath());  // model-a's manifest beside model-b's tier
  fs::remove(saved);
  testing::internal::CaptureStderr();
  t = Open("model-b");
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(t->stats().recovery, "scan");
  EXPECT_NE(err.find("manifest was written under another tier.meta"), std::string::npos) << err;
  EXPECT_EQ(AsMap(t->TakeRecovered()), blocks_);
  EXPECT_FALSE(HasManifest());
}

TEST_F(DiskManifestTest, EvenAStaleManifestThatPassesEveryCheckServesNoStaleBytes) {
  // The worst case the checks cannot see: an old manifest put back and the segments' stamps
  // forged to match. The CHECKSUM CONTRACT still holds: slots that now hold other blocks (or
  // nothing) read as counted corruption, never as data.
  auto t = Open();
  Write(*t, 0, 8, 1);
  ASSERT_TRUE(Checkpoint(*t).ok());
  std::vector<std::pair<std::string, struct timespec>> before;
  for (size_t s = 0; s < kSlots / 16; ++s) {
    struct stat st {};
    ASSERT_EQ(stat(t->SegmentPath(s * 16).c_str(), &st), 0);
    before.emplace_back(t->SegmentPath(s * 16), st.st_mtim);
  }
  t.reset();
  const std::string saved = dir_ + "-saved-manifest";
  fs::copy_file(ManifestPath(), saved);
  const std::vector<uint64_t> gens = ListJournals(dir_);
  ASSERT_EQ(gens.size(), 1u);
  const std::string saved_journal = dir_ + "-saved-journal";
  fs::copy_file(JournalPath(dir_, gens[0]), saved_journal);
  t = Open();
  ASSERT_EQ(t->stats().recovery, "manifest");
  const Blocks old = blocks_;
  // k0's slot is forgotten (zeroed header), k1's slot is reused for another key.
  t->Release(old.at("k0").first, /*forget=*/true);
  t->Release(old.at("k1").first, /*forget=*/false);
  blocks_.clear();
  Write(*t, 50, 1, 9);
  ASSERT_EQ(blocks_.at("k50").first, old.at("k1").first) << "test premise: the slot is reused";
  t.reset();  // no clean close
  // Put the old manifest and its (empty) journal back, as if nothing had been written since.
  for (uint64_t g : ListJournals(dir_)) fs::remove(JournalPath(dir_, g));
  fs::copy_file(saved, ManifestPath(), fs::copy_options::overwrite_existing);
  fs::copy_file(saved_journal, JournalPath(dir_, gens[0]));
  fs::remove(saved);
  fs::remove(saved_journal);
  for (const auto& [path, mtime] : before) {
    struct timespec times[2] = {{0, UTIME_OMIT}, mtime};
    ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  }
  t = Open();
  ASSERT_EQ(t->stats().recovery, "manifest");  // the forgery passed every check
  std::vector<uint8_t> out(kBytes);
  for (const char* key : {"k0", "k1"}) {
    BlockRead r{key, out.data(), old.at(key).first, {}};
    t->ReadBatch({&r, 1});
    EXPECT_EQ(r.status.code(), StatusCode::kCorrupted) << key;
  }
  EXPECT_EQ(t->stats().corrupted, 2u);
  blocks_ = old;
  blocks_.erase("k0");
  blocks_.erase("k1");
  ExpectAllReadable(*t);  // the others are still right
}

// Disk full while writing the manifest: no manifest (and no temp file), counted and logged; the
// tier and its blocks are untouched and the next open scans. Needs root to mount a small tmpfs.
TEST_F(DiskManifestTest, DiskFullWhileWritingTheManifestLosesNothingButTheShortcut) {
  if (geteuid() != 0) GTEST_SKIP() << "mounting a tmpfs needs root (CI runs as root)";
  fs::create_directories(dir_);
  if (mount("tmpfs", dir_.c_str(), "tmpfs", 0, "size=1m") != 0) {
    GTEST_SKIP() << "mount -t tmpfs refused here";
  }
  struct Unmount {
    std::string dir;
    ~Unmount() { umount2(dir.c_str(), MNT_DETACH); }
  } unmount{dir_};
  DiskTierOptions o = Options();
  o.block_bytes = 4096;  // 8 KiB slots: 64 slots fit the 1 MiB tmpfs
  o.direct_io = false;
  auto t = std::move(DiskTier::Open(o).value());
  std::vector<uint8_t> d(4096, 7);
  for (int i = 0; i < 40; ++i) {
    const std::string key = "k" + std::to_string(i);
    BlockWrite w{key, d.data(), *t->Reserve(), uint64_t(i + 1), {}};
    t->WriteBatch({&w, 1});
    ASSERT_TRUE(w.status.ok()) << w.status.ToString();
    blocks_[key] = {w.location, w.sequence};
  }
  {  // fill what is left of the tmpfs
    std::ofstream filler(dir_ + "/filler", std::ios::binary);
    const std::vector<char> chunk(4096, 1);
    for (int i = 0; i < 1024 && filler.write(chunk.data(), chunk.size()); ++i) filler.flush();
  }
  testing::internal::CaptureStderr();
  const Status s = Checkpoint(*t);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.ToString();
  EXPECT_NE(err.find("no clean-shutdown manifest written"), std::string::npos) << err;
  EXPECT_EQ(t->stats().manifest_errors, 1u);
  EXPECT_FALSE(HasManifest());
  EXPECT_FALSE(fs::exists(dir_ + "/manifest.tmp"));
  t.reset();
  fs::remove(dir_ + "/filler");
  t = std::move(DiskTier::Open(o).value());
  EXPECT_EQ(t->stats().recovery, "scan");
  EXPECT_EQ(AsMap(t->TakeRecovered()), blocks_);
}

// WRITE-BACK CONTRACT: progressive write-back changes only when the page cache goes out, never the
// bytes. 40,000 entries (3.2 MB) make several 1 MiB buffers, so the waits on earlier ranges run.
TEST_F(DiskManifestTest, ProgressiveWriteBackWritesTheSameManifestAsWriteBackAtTheFsync) {
  constexpr uint64_t kEntries = 40000;
  DiskMeta meta;
  std::memset(&meta, 0, sizeof(meta));
  meta.magic = kDiskMetaMagic;
  meta.num_blocks = kEntries * 2;
  const std::vector<SegmentStamp> stamps = {{1, 2, 3, 4}, {5, 6, 7, 8}};
  std::map<ManifestWriteBack, std::string> bytes;
  for (const ManifestWriteBack mode :
       {ManifestWriteBack::kAtSync, ManifestWriteBack::kProgressive}) {
    const std::string dir =
        dir_ + (mode == ManifestWriteBack::kAtSync ? "-at-sync" : "-progressive");
    fs::create_directories(dir);
    {
      auto w = ManifestWriter::Begin(dir, meta, stamps, ManifestKind::kCheckpoint, 7, mode);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      for (uint64_t i = 0; i < kEntries; ++i) {
        ASSERT_TRUE((*w)->Add(i * 2, 1000 + i, "key-" + std::to_string(i)).ok());
      }
      ASSERT_TRUE((*w)->Commit().ok());
      ASSERT_TRUE(SyncManifestDir(dir).ok());
    }
    std::ifstream in(dir + "/manifest", std::ios::binary);
    bytes[mode] = std::string(std::istreambuf_iterator<char>(in), {});
    EXPECT_FALSE(fs::exists(dir + "/manifest.tmp"));
    ManifestContents mc;
    ASSERT_TRUE(ReadManifest(dir, meta, stamps.size(), meta.num_blocks, &mc).ok());
    ASSERT_EQ(mc.blocks.size(), kEntries);
    EXPECT_EQ(mc.generation, 7u);
    EXPECT_EQ(mc.stamps, stamps);
    EXPECT_EQ(mc.blocks.back().key, "key-" + std::to_string(kEntries - 1));
    EXPECT_EQ(mc.blocks.back().location, (kEntries - 1) * 2);
    EXPECT_EQ(mc.blocks.back().sequence, 1000 + kEntries - 1);
    fs::remove_all(dir);
  }
  EXPECT_EQ(bytes[ManifestWriteBack::kAtSync].size(),
            sizeof(ManifestHeader) + 2 * sizeof(SegmentStamp) + kEntries * sizeof(ManifestEntry));
  EXPECT_TRUE(bytes[ManifestWriteBack::kAtSync] == bytes[ManifestWriteBack::kProgressive])
      << "the two write-backs wrote different manifests";
}

// OLD-MANIFEST CONTRACT: a Commit over an existing manifest keeps the replaced one as
// manifest.old (the same bytes: the rename freed nothing), RemoveOldManifest frees it; a Commit
// with no manifest before leaves none. 30,000 entries (2.4 MB): freed in several 1 MiB steps.
TEST_F(DiskManifestTest, CommitKeepsTheReplacedManifestUntilRemoveOldManifestFreesIt) {
  fs::create_directories(dir_);
  DiskMeta meta;
  std::memset(&meta, 0, sizeof(meta));
  meta.magic = kDiskMetaMagic;
  meta.num_blocks = 30000;
  const auto write = [&](uint64_t generation, uint64_t entries) {
    auto w = ManifestWriter::Begin(dir_, meta, {}, ManifestKind::kCheckpoint, generation);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    for (uint64_t i = 0; i < entries; ++i)
      ASSERT_TRUE((*w)->Add(i, i, "k" + std::to_string(i)).ok());
    ASSERT_TRUE((*w)->Commit().ok());
  };
  const auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string manifest = dir_ + "/manifest", old = dir_ + "/manifest.old";
  write(1, 30000);
  EXPECT_FALSE(fs::exists(old)) << "no manifest was replaced";
  const std::string first = read(manifest);
  ASSERT_GT(first.size(), size_t{2} << 20);
  write(2, 10);
  ASSERT_TRUE(fs::exists(old)) << "the replaced manifest was freed by the rename";
  EXPECT_TRUE(read(old) == first);
  ManifestContents mc;
  ASSERT_TRUE(ReadManifest(dir_, meta, 0, meta.num_blocks, &mc).ok());
  EXPECT_EQ(mc.generation, 2u);
  EXPECT_EQ(mc.blocks.size(), 10u);
  ASSERT_TRUE(RemoveOldManifest(dir_).ok());
  EXPECT_FALSE(fs::exists(old));
  EXPECT_TRUE(RemoveOldManifest(dir_).ok()) << "nothing to free is fine";
  ASSERT_TRUE(ReadManifest(dir_, meta, 0, meta.num_blocks, &mc).ok()) << "the new one stays";
  EXPECT_EQ(mc.generation, 2u);
  // A crash between Commit's link and its rename: manifest.old is a second name of the live
  // manifest. Freeing it must only unlink that name, never truncate the live manifest.
  ASSERT_EQ(link(manifest.c_str(), old.c_str()), 0);
  ASSERT_TRUE(RemoveOldManifest(dir_).ok());
  EXPECT_FALSE(fs::exists(old));
  ASSERT_TRUE(ReadManifest(dir_, meta, 0, meta.num_blocks, &mc).ok()) << "the live one was cut";
  EXPECT_EQ(mc.blocks.size(), 10u);
  write(3, 10);
  ASSERT_TRUE(fs::exists(old));
  ASSERT_TRUE(RemoveManifest(dir_).ok());
  EXPECT_FALSE(fs::exists(old)) << "RemoveManifest leaves manifest.old behind";
  EXPECT_FALSE(fs::exists(manifest));
}

}  // namespace
}  // namespace tpusync::tier
