// One conformance suite, run against every BlockTier: the in-memory mock, the host DRAM tier
// (anonymous and /dev/shm), the disk tier with each io backend, and the remote tier against a real
// in-process store node.
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "mock_tier.h"
#include "test_io.h"
#include "tpusync/node/remote_tier.h"
#include "tpusync/node/store_node.h"
#include "tpusync/tier/disk_tier.h"
#include "tpusync/tier/host_tier.h"

namespace tpusync::tier {
namespace {

namespace fs = std::filesystem;

std::string TempDir(const std::string& tag) {
  const std::string p = UniqueTestDir("conf-" + tag);
  fs::create_directories(p);
  return p;
}

struct MockFactory {
  static std::unique_ptr<BlockTier> Make(size_t bytes, size_t n, const std::string&) {
    return std::make_unique<MockTier>(block::Tier::kHost, bytes, n);
  }
};
struct HostFactory {
  static std::unique_ptr<BlockTier> Make(size_t bytes, size_t n, const std::string&) {
    HostTierOptions o;
    o.block_bytes = bytes;
    o.num_blocks = n;
    return std::move(HostTier::Open(o).value());
  }
};
struct ShmHostFactory {
  static std::unique_ptr<BlockTier> Make(size_t bytes, size_t n, const std::string& dir) {
    HostTierOptions o;
    o.block_bytes = bytes;
    o.num_blocks = n;
    o.shm_name = "tpusync-conf-" + fs::path(dir).filename().string();
    auto t = std::move(HostTier::Open(o).value());
    // The test owns the name: unlink now, the mapping stays valid.
    ::unlink(("/dev/shm/" + o.shm_name).c_str());
    ::unlink(("/dev/shm/" + o.shm_name + ".lock").c_str());
    return t;
  }
};
template <const char* Backend>
struct DiskFactory {
  static std::unique_ptr<BlockTier> Make(size_t bytes, size_t n, const std::string& dir) {
    DiskTierOptions o;
    o.directory = dir;
    o.block_bytes = bytes;
    o.num_blocks = n;
    o.segment_blocks = 3;  // several segments even in small tests
    o.io_backend = Backend;
    auto t = DiskTier::Open(o);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return std::move(t).value();
  }
};
// The remote tier, owning the in-process store node it talks to (forwards every call).
class NodeBackedRemoteTier final : public BlockTier {
 public:
  NodeBackedRemoteTier(size_t bytes, size_t n) {
    const auto secret = *node::Secret::FromBytes("conformance-remote-secret-0123456789");
    auto started = node::StoreNode::Start(
        {.capacity_bytes = bytes * (n + 4), .block_bytes = bytes, .engine_threads = 1}, secret);
    EXPECT_TRUE(started.ok()) << started.status().ToString();
    node_ = std::move(started).value();
    node::RemoteTierOptions o;
    o.block_bytes = bytes;
    o.capacity_blocks = n;
    o.client.nodes = {node_->address().ToString()};
    auto t = node::RemoteTier::Open(o, secret);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    tier_ = std::move(t).value();
  }
  ~NodeBackedRemoteTier() override {
    tier_.reset();
    node_.reset();
  }
  block::Tier kind() const override { return tier_->kind(); }
  size_t block_bytes() const override { return tier_->block_bytes(); }
  size_t capacity() const override { return tier_->capacity(); }
  size_t used() const override { return tier_->used(); }
  Result<uint64_t> Reserve() override { return tier_->Reserve(); }
  void Release(uint64_t l, bool f) override { tier_->Release(l, f); }
  Status Hold(uint64_t l) override { return tier_->Hold(l); }
  void Unhold(uint64_t l) override { tier_->Unhold(l); }
  void WriteBatch(std::span<BlockWrite> ops) override { tier_->WriteBatch(ops); }
  void ReadBatch(std::span<BlockRead> ops) override { tier_->ReadBatch(ops); }
  std::vector<RecoveredBlock> TakeRecovered() override { return tier_->TakeRecovered(); }
  TierStats stats() const override { return tier_->stats(); }

 private:
  std::unique_ptr<node::StoreNode> node_;
  std::unique_ptr<node::RemoteTier> tier_;
};
struct RemoteFactory {
  static std::unique_ptr<BlockTier> Make(size_t bytes, size_t n, const std::string&) {
    return std::make_unique<NodeBackedRemoteTier>(bytes, n);
  }
};

constexpr char kPread[] = "pread";
constexpr char kUring[] = "auto";

template <typename F>
class TierConformance : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir("t");
    tier_ = F::Make(kBytes, kBlocks, dir_);
    ASSERT_NE(tier_, nullptr);
  }
  void TearDown() override {
    tier_.reset();
    fs::remove_all(dir_);
  }
  std::vector<uint8_t> Pattern(int seed) {
    std::vector<uint8_t> v(kBytes);
    std::mt19937 rng(seed);
    for (auto& b : v) b = static_cast<uint8_t>(rng());
    return v;
  }
  static constexpr size_t kBytes = 8192 + 100;  // not a page multiple: exercises padding
  static constexpr size_t kBlocks = 8;
  std::string dir_;
  std::unique_ptr<BlockTier> tier_;
};

using Factories = ::testing::Types<MockFactory, HostFactory, ShmHostFactory, DiskFactory<kPread>,
                                   DiskFactory<kUring>, RemoteFactory>;
TYPED_TEST_SUITE(TierConformance, Factories);

TYPED_TEST(TierConformance, WriteThenReadRoundTrips) {
  auto& t = *this->tier_;
  EXPECT_EQ(t.block_bytes(), this->kBytes);
  EXPECT_EQ(t.capacity(), this->kBlocks);
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::string> keys;
  std::vector<BlockWrite> writes;
  for (int i = 0; i < 5; ++i) {
    data.push_back(this->Pattern(i));
    keys.push_back("key-" + std::to_string(i));
  }
  for (int i = 0; i < 5; ++i) {
    auto loc = t.Reserve();
    ASSERT_TRUE(loc.ok());
    writes.push_back({keys[i], data[i].data(), *loc, uint64_t(i + 1), Status()});
  }
  t.WriteBatch(writes);
  for (auto& w : writes) ASSERT_TRUE(w.status.ok()) << w.status.ToString();
  std::vector<std::vector<uint8_t>> out(5, std::vector<uint8_t>(this->kBytes));
  std::vector<BlockRead> reads;
  for (int i = 4; i >= 0; --i) reads.push_back({keys[i], out[i].data(), writes[i].location, {}});
  t.ReadBatch(reads);
  for (auto& r : reads) ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(out[i], data[i]) << i;
  EXPECT_EQ(t.used(), 5u);
  const TierStats s = t.stats();
  EXPECT_EQ(s.blocks_written, 5u);
  EXPECT_EQ(s.blocks_read, 5u);
}

TYPED_TEST(TierConformance, SmallBlocksCapacityIsExact) {
  // 64-byte blocks: a page-rounded pool could hold 64 of them; the tier must still hold 3.
  auto t = TypeParam::Make(64, 3, this->dir_ + "-small");
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(t->Reserve().ok());
  EXPECT_EQ(t->Reserve().status().code(), StatusCode::kPoolExhausted);
  EXPECT_EQ(t->capacity(), 3u);
  t.reset();
  std::filesystem::remove_all(this->dir_ + "-small");
}

TYPED_TEST(TierConformance, CapacityIsExactAndReleaseFrees) {
  auto& t = *this->tier_;
  std::vector<uint64_t> locs;
  for (size_t i = 0; i < this->kBlocks; ++i) locs.push_back(*t.Reserve());
  EXPECT_EQ(t.Reserve().status().code(), StatusCode::kPoolExhausted);
  EXPECT_EQ(t.used(), this->kBlocks);
  t.Release(locs[3], false);
  EXPECT_EQ(t.used(), this->kBlocks - 1);
  EXPECT_TRUE(t.Reserve().ok());
  EXPECT_EQ(t.Reserve().status().code(), StatusCode::kPoolExhausted);
}

TYPED_TEST(TierConformance, HoldDefersRelease) {
  auto& t = *this->tier_;
  std::vector<uint64_t> locs;
  for (size_t i = 0; i < this->kBlocks; ++i) locs.push_back(*t.Reserve());
  ASSERT_TRUE(t.Hold(locs[0]).ok());
  t.Release(locs[0], false);
  EXPECT_EQ(t.Reserve().status().code(), StatusCode::kPoolExhausted);  // still held
  t.Unhold(locs[0]);
  EXPECT_TRUE(t.Reserve().ok());
}

TYPED_TEST(TierConformance, WrongKeyOrDamageIsNeverData) {
  auto& t = *this->tier_;
  auto data = this->Pattern(7);
  BlockWrite w{"right", data.data(), *t.Reserve(), 1, {}};
  t.WriteBatch({&w, 1});
  ASSERT_TRUE(w.status.ok());
  std::vector<uint8_t> out(this->kBytes);
  BlockRead r{"wrong", out.data(), w.location, {}};
  t.ReadBatch({&r, 1});
  if (t.kind() == block::Tier::kHost && dynamic_cast<MockTier*>(&t) == nullptr) {
    // HOST CONTRACT: DRAM reads are not verified (the store never asks a slot for another key).
    EXPECT_TRUE(r.status.ok());
  } else {
    EXPECT_EQ(r.status.code(), StatusCode::kCorrupted);
  }
}

TYPED_TEST(TierConformance, ConcurrentWritersOnDistinctLocations) {
  auto& t = *this->tier_;
  std::vector<uint64_t> locs;
  for (size_t i = 0; i < this->kBlocks; ++i) locs.push_back(*t.Reserve());
  std::vector<std::vector<uint8_t>> data;
  for (size_t i = 0; i < this->kBlocks; ++i) data.push_back(this->Pattern(100 + int(i)));
  std::vector<std::string> keys;
  for (size_t i = 0; i < this->kBlocks; ++i) keys.push_back("k" + std::to_string(i));
  std::vector<std::thread> threads;
  for (size_t th = 0; th < 2; ++th) {
    threads.emplace_back([&, th] {
      for (size_t i = th; i < this->kBlocks; i += 2) {
        BlockWrite w{keys[i], data[i].data(), locs[i], i + 1, {}};
        t.WriteBatch({&w, 1});
        EXPECT_TRUE(w.status.ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  for (size_t i = 0; i < this->kBlocks; ++i) {
    std::vector<uint8_t> out(this->kBytes);
    BlockRead r{keys[i], out.data(), locs[i], {}};
    t.ReadBatch({&r, 1});
    ASSERT_TRUE(r.status.ok());
    EXPECT_EQ(out, data[i]);
  }
}

}  // namespace
}  // namespace tpusync::tier
