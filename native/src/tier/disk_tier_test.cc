#include "tpusync/tier/disk_tier.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "test_io.h"
#include "tpusync/base/checksum.h"

namespace tpusync::tier {
namespace {

namespace fs = std::filesystem;

class DiskTierTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = UniqueTestDir("disk"); }
  void TearDown() override { fs::remove_all(dir_); }
  DiskTierOptions Options(const std::string& fp = "model-a") {
    DiskTierOptions o;
    o.directory = dir_;
    o.block_bytes = kBytes;
    o.num_blocks = 6;
    o.segment_blocks = 4;
    o.fingerprint = fp;
    return o;
  }
  std::vector<uint8_t> Data(int seed) {
    std::vector<uint8_t> v(kBytes);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(i * 31 + seed);
    return v;
  }
  uint64_t WriteOne(DiskTier& t, const std::string& key, const std::vector<uint8_t>& d,
                    uint64_t seq = 1) {
    BlockWrite w{key, d.data(), *t.Reserve(), seq, {}};
    t.WriteBatch({&w, 1});
    EXPECT_TRUE(w.status.ok()) << w.status.ToString();
    return w.location;
  }
  Status ReadOne(DiskTier& t, const std::string& key, uint64_t loc, std::vector<uint8_t>* out) {
    out->assign(kBytes, 0);
    BlockRead r{key, out->data(), loc, {}};
    t.ReadBatch({&r, 1});
    return r.status;
  }
  static constexpr size_t kBytes = 16384;
  std::string dir_;
};

TEST_F(DiskTierTest, LayoutIsSegmentedAndAligned) {
  auto t = std::move(DiskTier::Open(Options()).value());
  EXPECT_EQ(t->slot_bytes(), 4096 + kBytes);
  EXPECT_TRUE(fs::exists(fs::path(dir_) / "tier.meta"));
  EXPECT_TRUE(fs::exists(fs::path(dir_) / "seg-000000.tps"));
  EXPECT_TRUE(fs::exists(fs::path(dir_) / "seg-000001.tps"));
  EXPECT_EQ(t->SegmentPath(5), (fs::path(dir_) / "seg-000001.tps").string());
  EXPECT_EQ(t->SlotOffset(5), t->slot_bytes());
  EXPECT_EQ(t->SlotOffset(5) % 4096, 0u);
}

TEST_F(DiskTierTest, ReopenRecoversBlocksFromHeaders) {
  std::vector<uint64_t> locs;
  {
    auto t = std::move(DiskTier::Open(Options()).value());
    for (int i = 0; i < 5; ++i)
      locs.push_back(WriteOne(*t, "k" + std::to_string(i), Data(i), i + 1));
    t->Release(locs[2], /*forget=*/true);  // removed: must not come back
  }
  auto t = std::move(DiskTier::Open(Options()).value());
  auto rec = t->TakeRecovered();
  ASSERT_EQ(rec.size(), 4u);
  EXPECT_EQ(t->used(), 4u);
  EXPECT_EQ(t->stats().recovered, 4u);
  for (const auto& r : rec) {
    EXPECT_NE(r.key, "k2");
    std::vector<uint8_t> out;
    ASSERT_TRUE(ReadOne(*t, r.key, r.location, &out).ok());
    EXPECT_EQ(out, Data(r.key[1] - '0'));
    EXPECT_EQ(r.sequence, uint64_t(r.key[1] - '0' + 1));
  }
}

TEST_F(DiskTierTest, ForgettingAHeldSlotWaitsForItsReaderThenKeepsItFromComingBack) {
  // HELD FORGET RULE: a remove while a get holds the slot used to zero the header under the
  // reader, which then counted a corruption.
  {
    auto t = std::move(DiskTier::Open(Options()).value());
    const uint64_t held = WriteOne(*t, "held", Data(7));
    const uint64_t kept = WriteOne(*t, "kept", Data(8), 2);
    ASSERT_TRUE(t->Hold(held).ok());
    t->Release(held, /*forget=*/true);
    EXPECT_FALSE(t->Hold(held).ok());  // no new reader of a released slot
    std::vector<uint8_t> out;
    ASSERT_TRUE(ReadOne(*t, "held", held, &out).ok());  // the holder still reads it whole
    EXPECT_EQ(out, Data(7));
    EXPECT_EQ(t->stats().corrupted, 0u);
    EXPECT_EQ(t->used(), 2u);  // not reusable while held
    t->Unhold(held);
    EXPECT_EQ(t->used(), 1u);
    ASSERT_TRUE(ReadOne(*t, "kept", kept, &out).ok());
  }
  auto t = std::move(DiskTier::Open(Options()).value());
  auto rec = t->TakeRecovered();
  ASSERT_EQ(rec.size(), 1u);  // the forgotten block's header was zeroed at the last Unhold
  EXPECT_EQ(rec[0].key, "kept");
}

TEST_F(DiskTierTest, OtherFingerprintIsAColdStart) {
  {
    auto t = std::move(DiskTier::Open(Options("model-a")).value());
    WriteOne(*t, "k", Data(1));
  }
  testing::internal::CaptureStderr();
  auto t = std::move(DiskTier::Open(Options("model-b")).value());
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("model fingerprint changed ('model-a' -> 'model-b'): cold start"),
            std::string::npos)
      << log;
  EXPECT_TRUE(t->TakeRecovered().empty());
  EXPECT_EQ(t->used(), 0u);
  EXPECT_NE(t->stats().cold_start_reason, "");
}

TEST_F(DiskTierTest, CorruptedPayloadIsDetected) {
  auto t = std::move(DiskTier::Open(Options()).value());
  const uint64_t loc = WriteOne(*t, "k", Data(3));
  {
    const int fd = open(t->SegmentPath(loc).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    uint8_t b = 0;
    const off_t off = static_cast<off_t>(t->SlotOffset(loc) + 4096 + 100);
    ASSERT_EQ(pread(fd, &b, 1, off), 1);
    b ^= 0x5a;
    ASSERT_EQ(pwrite(fd, &b, 1, off), 1);
    close(fd);
  }
  std::vector<uint8_t> out;
  const Status s = ReadOne(*t, "k", loc, &out);
  EXPECT_EQ(s.code(), StatusCode::kCorrupted) << s.ToString();
  EXPECT_NE(s.message().find("checksum"), std::string::npos);
  EXPECT_EQ(t->stats().corrupted, 1u);
}

TEST_F(DiskTierTest, TruncatedSegmentIsDetected) {
  auto t = std::move(DiskTier::Open(Options()).value());
  const uint64_t loc = WriteOne(*t, "k", Data(4));
  ASSERT_EQ(truncate(t->SegmentPath(loc).c_str(), static_cast<off_t>(t->SlotOffset(loc) + 6000)),
            0);
  std::vector<uint8_t> out;
  const Status s = ReadOne(*t, "k", loc, &out);
  EXPECT_EQ(s.code(), StatusCode::kCorrupted) << s.ToString();
  EXPECT_NE(s.message().find("truncated"), std::string::npos);
}

TEST_F(DiskTierTest, SecondOpenerGetsALockError) {
  auto first = DiskTier::Open(Options());
  ASSERT_TRUE(first.ok());
  auto second = DiskTier::Open(Options());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("in use by another process"), std::string::npos);
}

TEST_F(DiskTierTest, UnwritableDirectoryIsAClearError) {
  fs::create_directories(dir_);
  std::ofstream(fs::path(dir_) / "file") << "x";
  DiskTierOptions o = Options();
  o.directory = (fs::path(dir_) / "file" / "sub").string();  // a path below a regular file
  auto t = DiskTier::Open(o);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("cannot be created"), std::string::npos)
      << t.status().ToString();
}

TEST_F(DiskTierTest, UnalignedSourceAndOddSizesUseBounceBuffers) {
  DiskTierOptions o = Options();
  o.block_bytes = 1000;
  auto t = std::move(DiskTier::Open(o).value());
  std::vector<uint8_t> buf(1001);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i);
  BlockWrite w{"odd", buf.data() + 1, *t->Reserve(), 1, {}};
  t->WriteBatch({&w, 1});
  ASSERT_TRUE(w.status.ok()) << w.status.ToString();
  std::vector<uint8_t> out(1001);
  BlockRead r{"odd", out.data() + 1, w.location, {}};
  t->ReadBatch({&r, 1});
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_TRUE(std::equal(out.begin() + 1, out.end(), buf.begin() + 1));
}

TEST_F(DiskTierTest, AdjacentSlotsAcrossSegmentsRoundTripInOneBatch) {
  auto t = std::move(DiskTier::Open(Options()).value());  // 6 slots, 4 per segment
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::string> keys;
  std::vector<BlockWrite> w;
  for (int i = 0; i < 6; ++i) {
    data.push_back(Data(10 + i));
    keys.push_back("adj" + std::to_string(i));
  }
  for (int i = 0; i < 6; ++i) w.push_back({keys[i], data[i].data(), *t->Reserve(), 1, {}});
  std::swap(w[1], w[4]);  // out of order: the tier sorts and merges adjacent slots itself
  t->WriteBatch(w);
  for (auto& op : w) ASSERT_TRUE(op.status.ok()) << op.status.ToString();
  std::vector<std::vector<uint8_t>> out(6, std::vector<uint8_t>(kBytes));
  std::vector<BlockRead> r;
  for (int i = 5; i >= 0; --i) r.push_back({w[i].key, out[i].data(), w[i].location, {}});
  t->ReadBatch(r);
  for (auto& op : r) ASSERT_TRUE(op.status.ok()) << op.status.ToString();
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(out[i], std::vector<uint8_t>(w[i].data, w[i].data + kBytes));
  // A slot read under another key is still caught inside a merged read.
  std::swap(r[0].key, r[1].key);
  t->ReadBatch(r);
  EXPECT_EQ(r[0].status.code(), StatusCode::kCorrupted);
  EXPECT_EQ(r[1].status.code(), StatusCode::kCorrupted);
  EXPECT_TRUE(r[2].status.ok());
}

TEST_F(DiskTierTest, ABlockChangedInTheCallersBufferIsReadAgainNotCalledCorrupted) {
  // CONFIRMED CORRUPTION: a read straight into the caller's buffer that another thread wrote
  // (a scratch buffer shared by two gets) failed its check, and the tier called the block
  // corrupted and the store dropped its slot: a good block lost for good.
  DiskTierOptions o = Options();
  o.wrap_io = [](std::unique_ptr<IoBackend> inner) -> std::unique_ptr<IoBackend> {
    class ScribblesOnce final : public IoBackend {
     public:
      explicit ScribblesOnce(std::unique_ptr<IoBackend> in) : inner_(std::move(in)) {}
      std::string_view name() const override { return inner_->name(); }
      void Run(std::span<IoOp> ops) override {
        inner_->Run(ops);
        for (IoOp& op : ops) {
          if (!op.write && op.iov.size() == 2 && op.iov[1].iov_len >= kBytes && !done_) {
            static_cast<uint8_t*>(op.iov[1].iov_base)[0] ^= 0xff;  // "another thread" wrote
            done_ = true;
          }
        }
      }
      bool done_ = false;

     private:
      std::unique_ptr<IoBackend> inner_;
    };
    return std::make_unique<ScribblesOnce>(std::move(inner));
  };
  auto t = std::move(DiskTier::Open(o).value());
  const auto a = Data(5);
  const uint64_t loc = WriteOne(*t, "a", a);
  // An aligned destination, so that direct I/O too lands in it (no bounce buffer).
  std::unique_ptr<uint8_t, decltype(&std::free)> dst(
      static_cast<uint8_t*>(std::aligned_alloc(4096, kBytes)), &std::free);
  BlockRead r{"a", dst.get(), loc, {}};
  t->ReadBatch({&r, 1});
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_TRUE(std::equal(a.begin(), a.end(), dst.get()));
  EXPECT_EQ(t->stats().corrupted, 0u);
  ASSERT_TRUE(r.checksum.has_value());
  EXPECT_EQ(*r.checksum, Checksum64(a.data(), a.size()));
}

TEST_F(DiskTierTest, DirectIoRefusedPerIoFallsBackToBufferedWithoutLosingBlocks) {
  DiskTierOptions o = Options();
  RefusesDirectIo* wrapper = nullptr;
  o.wrap_io = [&](std::unique_ptr<IoBackend> inner) -> std::unique_ptr<IoBackend> {
    auto w = std::make_unique<RefusesDirectIo>(std::move(inner));
    wrapper = w.get();
    return w;
  };
  auto t = std::move(DiskTier::Open(o).value());
  if (!t->stats().direct_io) GTEST_SKIP() << "the test directory's filesystem refuses O_DIRECT";
  ASSERT_NE(wrapper, nullptr);
  // Open's header scan already hit the refusal (fresh tier: every slot reads as empty either way).
  const auto a = Data(1), b = Data(2), c = Data(3);
  std::vector<uint8_t> unaligned(kBytes + 1);
  std::copy(c.begin(), c.end(), unaligned.begin() + 1);
  BlockWrite w[3] = {{"a", a.data(), *t->Reserve(), 1, {}},
                     {"b", b.data(), *t->Reserve(), 1, {}},
                     {"c", unaligned.data() + 1, *t->Reserve(), 1, {}}};
  t->WriteBatch(w);
  for (const BlockWrite& x : w) EXPECT_TRUE(x.status.ok()) << x.status.ToString();
  EXPECT_GT(wrapper->refused.load(), 0);
  EXPECT_FALSE(t->stats().direct_io);
  EXPECT_EQ(t->stats().write_errors, 0u);
  std::vector<uint8_t> out;
  ASSERT_TRUE(ReadOne(*t, "a", w[0].location, &out).ok());
  EXPECT_EQ(out, a);
  ASSERT_TRUE(ReadOne(*t, "c", w[2].location, &out).ok());
  EXPECT_EQ(out, c);
  const uint64_t locs[3] = {w[0].location, w[1].location, w[2].location};
  t.reset();
  // A restart on the same filesystem: the scan refuses again, falls back, and recovers all three.
  auto again = std::move(DiskTier::Open(o).value());
  auto rec = again->TakeRecovered();
  ASSERT_EQ(rec.size(), 3u);
  ASSERT_TRUE(ReadOne(*again, "b", locs[1], &out).ok());
  EXPECT_EQ(out, b);
  EXPECT_EQ(again->stats().read_errors, 0u);
}

TEST_F(DiskTierTest, BatchRefusedBeforeAnotherThreadDroppedDirectIoIsRunAgain) {
  // Thread A's batch is refused while O_DIRECT is still set, but A only looks at its results
  // after thread B has dropped O_DIRECT: A's batch must be run again, not counted as errors.
  DiskTierOptions o = Options();
  std::atomic<int> calls{0};
  o.wrap_io = [&](std::unique_ptr<IoBackend> inner) -> std::unique_ptr<IoBackend> {
    class HoldFirstRefusal final : public IoBackend {
     public:
      HoldFirstRefusal(std::unique_ptr<IoBackend> in, std::atomic<int>* c)
          : inner_(std::move(in)), calls_(c) {}
      std::string_view name() const override { return inner_.name(); }
      void Run(std::span<IoOp> ops) override {
        const bool refused = !ops.empty() && (fcntl(ops[0].fd, F_GETFL) & O_DIRECT);
        inner_.Run(ops);
        if (!refused || calls_->fetch_add(1) != 0) return;
        // The first refused batch: wait (at most 5 s) until another batch dropped O_DIRECT.
        for (int i = 0; i < 500 && (fcntl(ops[0].fd, F_GETFL) & O_DIRECT); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }

     private:
      RefusesDirectIo inner_;
      std::atomic<int>* calls_;
    };
    return std::make_unique<HoldFirstRefusal>(std::move(inner), &calls);
  };
  auto t = std::move(DiskTier::Open(o).value());
  if (!t->stats().direct_io) GTEST_SKIP() << "the test directory's filesystem refuses O_DIRECT";
  ASSERT_EQ(calls.load(), 0);  // a fresh tier (cold start) reads no headers at open
  const auto a = Data(1), b = Data(2);
  const uint64_t la = *t->Reserve(), lb = *t->Reserve();
  BlockWrite wa{"a", a.data(), la, 1, {}}, wb{"b", b.data(), lb, 1, {}};
  std::thread ta([&] { t->WriteBatch({&wa, 1}); });
  while (calls.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  t->WriteBatch({&wb, 1});  // refused, drops O_DIRECT, runs again
  ta.join();
  EXPECT_TRUE(wa.status.ok()) << wa.status.ToString();
  EXPECT_TRUE(wb.status.ok()) << wb.status.ToString();
  EXPECT_EQ(t->stats().write_errors, 0u);
  std::vector<uint8_t> out;
  ASSERT_TRUE(ReadOne(*t, "a", la, &out).ok());
  EXPECT_EQ(out, a);
}

TEST_F(DiskTierTest, UnknownBackendIsRefused) {
  DiskTierOptions o = Options();
  o.io_backend = "carrier-pigeon";
  auto t = DiskTier::Open(o);
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tpusync::tier
