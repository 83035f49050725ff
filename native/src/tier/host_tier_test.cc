#include "tpusync/tier/host_tier.h"

#include <unistd.h>

#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tpusync/base/checksum.h"

namespace tpusync::tier {
namespace {

class HostTierShmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    name_ = "tpusync-hosttest-" + std::to_string(getpid()) + "-" +
            std::to_string(std::random_device{}() % 100000);
  }
  void TearDown() override {
    ::unlink(("/dev/shm/" + name_).c_str());
    ::unlink(("/dev/shm/" + name_ + ".lock").c_str());
  }
  HostTierOptions Options(const std::string& fp = "fp-1") {
    HostTierOptions o;
    o.block_bytes = 4096;
    o.num_blocks = 4;
    o.shm_name = name_;
    o.fingerprint = fp;
    return o;
  }
  uint64_t Write(HostTier& t, const std::string& key, uint8_t fill, uint64_t seq) {
    std::vector<uint8_t> d(4096, fill);
    BlockWrite w{key, d.data(), *t.Reserve(), seq, {}};
    t.WriteBatch({&w, 1});
    EXPECT_TRUE(w.status.ok());
    return w.location;
  }
  std::string name_;
};

TEST_F(HostTierShmTest, ReattachRecoversVerifiedBlocks) {
  {
    auto t = std::move(HostTier::Open(Options()).value());
    Write(*t, "a", 1, 1);
    const uint64_t b = Write(*t, "b", 2, 2);
    Write(*t, "c", 3, 3);
    t->Release(b, false);  // a freed slot is never re-attached
  }
  auto t = std::move(HostTier::Open(Options()).value());
  auto rec = t->TakeRecovered();
  ASSERT_EQ(rec.size(), 2u);
  EXPECT_EQ(t->used(), 2u);
  for (const auto& r : rec) {
    std::vector<uint8_t> out(4096);
    BlockRead rd{r.key, out.data(), r.location, {}};
    t->ReadBatch({&rd, 1});
    EXPECT_EQ(out[4095], r.key == "a" ? 1 : 3);
  }
}

TEST_F(HostTierShmTest, AWriteWhoseBytesMissTheExpectedChecksumLeavesNoBlock) {
  // BlockWrite::expect_checksum (the store's PROMOTION CHECK): bytes that changed since they were
  // verified are not stored, in an anonymous tier or in /dev/shm (where a re-attach would have
  // served them).
  std::vector<uint8_t> d(4096, 7);
  const uint64_t good = Checksum64(d.data(), d.size());
  for (bool shm : {false, true}) {
    HostTierOptions o = Options();
    if (!shm) o.shm_name.clear();
    {
      auto t = std::move(HostTier::Open(o).value());
      BlockWrite bad{"bad", d.data(), *t->Reserve(), 1, {}, good ^ 1};
      BlockWrite ok{"ok", d.data(), *t->Reserve(), 2, {}, good};
      t->WriteBatch({&bad, 1});
      t->WriteBatch({&ok, 1});
      EXPECT_EQ(bad.status.code(), StatusCode::kCorrupted) << shm;
      EXPECT_TRUE(ok.status.ok()) << shm;
      t->Release(bad.location, false);
    }
    if (shm) {
      auto t = std::move(HostTier::Open(o).value());
      auto rec = t->TakeRecovered();
      ASSERT_EQ(rec.size(), 1u);
      EXPECT_EQ(rec[0].key, "ok");
    }
  }
}

TEST_F(HostTierShmTest, DamagedPayloadIsDroppedAtAttach) {
  {
    auto t = std::move(HostTier::Open(Options()).value());
    const uint64_t a = Write(*t, "a", 1, 1);
    Write(*t, "b", 2, 2);
    const_cast<uint8_t*>(t->Address(a))[17] ^= 0xff;  // bit rot while nobody watched
  }
  auto t = std::move(HostTier::Open(Options()).value());
  auto rec = t->TakeRecovered();
  ASSERT_EQ(rec.size(), 1u);
  EXPECT_EQ(rec[0].key, "b");
  EXPECT_EQ(t->stats().corrupted, 1u);
  EXPECT_EQ(t->used(), 1u);
}

TEST_F(HostTierShmTest, OtherFingerprintIsAColdStartWithALogLine) {
  {
    auto t = std::move(HostTier::Open(Options("fp-1")).value());
    Write(*t, "a", 1, 1);
  }
  testing::internal::CaptureStderr();
  auto t = std::move(HostTier::Open(Options("fp-2")).value());
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("model fingerprint changed ('fp-1' -> 'fp-2'): cold start"), std::string::npos)
      << log;
  EXPECT_TRUE(t->TakeRecovered().empty());
  EXPECT_EQ(t->used(), 0u);
}

TEST_F(HostTierShmTest, OtherSizeIsAColdStart) {
  { auto t = std::move(HostTier::Open(Options()).value()); }
  HostTierOptions o = Options();
  o.num_blocks = 8;
  testing::internal::CaptureStderr();
  auto t = HostTier::Open(o);
  const std::string log = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_NE(log.find("cold start"), std::string::npos);
  EXPECT_EQ((*t)->capacity(), 8u);
}

TEST_F(HostTierShmTest, SecondProcessOnTheNamespaceIsRefused) {
  auto first = HostTier::Open(Options());
  ASSERT_TRUE(first.ok());
  auto second = HostTier::Open(Options());
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("in use by another process"), std::string::npos);
}

}  // namespace
}  // namespace tpusync::tier
