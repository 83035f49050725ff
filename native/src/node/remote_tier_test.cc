// The remote tier inside a KVStore: host DRAM demotes to store nodes, a second store finds those
// blocks by prefix lookup (leased on the nodes), replicas cover a dead node, and a block the nodes
// dropped is a miss, never data.
#include "tpusync/node/remote_tier.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "tpusync/base/checksum.h"
#include "tpusync/node/store_node.h"
#include "tpusync/store/kv_store.h"

namespace tpusync::node {
namespace {

constexpr size_t kBlock = 8 << 10;

Secret TestSecret() { return *Secret::FromBytes("remote-tier-test-secret-0123456789"); }

struct Cluster {
  std::vector<std::unique_ptr<StoreNode>> nodes;
  std::vector<std::string> addrs;
};

Cluster StartNodes(size_t n, size_t blocks = 256) {
  Cluster c;
  for (size_t i = 0; i < n; ++i) {
    auto node = StoreNode::Start(
        {.capacity_bytes = blocks * kBlock, .block_bytes = kBlock, .engine_threads = 1},
        TestSecret());
    EXPECT_TRUE(node.ok()) << node.status().ToString();
    c.addrs.push_back((*node)->address().ToString());
    c.nodes.push_back(std::move(*node));
  }
  return c;
}

std::unique_ptr<store::KVStore> OpenStore(
    size_t host_blocks, const Cluster& c, size_t replicas,
    std::shared_ptr<concurrency::ThreadPool> engine,
    std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  store::KVStoreOptions o;
  o.block_bytes = kBlock;
  o.host_blocks = host_blocks;
  o.put_wait_s = 5.0;
  auto tiers = store::KVStore::OpenTiers(o);
  EXPECT_TRUE(tiers.ok());
  RemoteTierOptions ro;
  ro.block_bytes = kBlock;
  ro.capacity_blocks = 1024;
  ro.client.nodes = c.addrs;
  ro.client.replication = replicas;
  ro.client.timeout = timeout;
  ro.client.connect.timeout = timeout;
  auto remote = RemoteTier::Open(ro, TestSecret());
  EXPECT_TRUE(remote.ok()) << remote.status().ToString();
  tiers->push_back(std::move(*remote));
  auto s = store::KVStore::Open(std::move(*tiers), store::KVStore::ConfigFrom(o), engine);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(*s);
}

std::vector<std::string> Keys(size_t n, const std::string& prefix) {
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) out.push_back(prefix + std::to_string(i));
  return out;
}

// The bytes every store must hold for `key` (derived from the key alone).
void FillFor(const std::string& key, uint8_t* row) {
  uint64_t x = Checksum64(key.data(), key.size());
  for (size_t i = 0; i < kBlock; i += 8) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    std::memcpy(row + i, &x, 8);
  }
}

void PutAll(store::KVStore& s, const std::vector<std::string>& keys) {
  for (size_t lo = 0; lo < keys.size(); lo += 4) {
    const size_t n = std::min<size_t>(4, keys.size() - lo);
    std::vector<std::string> ks(keys.begin() + lo, keys.begin() + lo + n);
    std::vector<uint8_t> rows(n * kBlock);
    for (size_t i = 0; i < n; ++i) FillFor(ks[i], rows.data() + i * kBlock);
    auto stored = std::make_shared<std::vector<uint8_t>>();
    auto f = s.Put(ks, {rows.data(), kBlock, n, {}}, stored);
    ASSERT_TRUE(f->Wait(std::chrono::seconds(30)).ok());
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE((*stored)[i]) << ks[i];
  }
}

// Gets keys; returns found flags and checks every found row's bytes (a wrong byte fails the test).
std::vector<uint8_t> GetAll(store::KVStore& s, const std::vector<std::string>& keys) {
  std::vector<uint8_t> rows(keys.size() * kBlock), want(kBlock);
  auto found = std::make_shared<std::vector<uint8_t>>();
  auto f = s.Get(keys, {rows.data(), kBlock, keys.size(), {}}, found);
  EXPECT_TRUE(f->Wait(std::chrono::seconds(30)).ok());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!(*found)[i]) continue;
    FillFor(keys[i], want.data());
    EXPECT_EQ(std::memcmp(rows.data() + i * kBlock, want.data(), kBlock), 0) << keys[i];
  }
  return *found;
}

size_t Lookup(store::KVStore& s, const std::vector<std::string>& keys) {
  std::vector<std::string_view> v(keys.begin(), keys.end());
  std::vector<block::Placement> out;
  return s.Lookup(v, &out);
}

TEST(RemoteTierStore, HostDemotesToStoreNodesWhenFull) {
  auto cluster = StartNodes(2);
  auto engine = std::make_shared<concurrency::ThreadPool>(2);
  auto store = OpenStore(8, cluster, 1, engine);
  const auto keys = Keys(40, "d");
  PutAll(*store, keys);
  ASSERT_TRUE(store->Flush(std::chrono::seconds(30)).ok());
  EXPECT_EQ(GetAll(*store, keys), std::vector<uint8_t>(40, 1));
  const auto st = store->stats();
  ASSERT_EQ(st.tiers.size(), 2u);
  EXPECT_EQ(st.tiers[1].kind, block::Tier::kRemote);
  EXPECT_GE(st.tiers[1].demotions_in, 32u);
  EXPECT_GT(st.tiers[1].hits, 0u);  // served from the nodes
  uint64_t on_nodes = 0;
  for (auto& n : cluster.nodes) on_nodes += n->stats().put_blocks;
  EXPECT_GE(on_nodes, 32u);
}

TEST(RemoteTierStore, SecondStoreFindsThePrefixOnTheNodesUnderALease) {
  auto cluster = StartNodes(1);
  auto engine = std::make_shared<concurrency::ThreadPool>(2);
  auto a = OpenStore(4, cluster, 1, engine);
  const auto keys = Keys(24, "p");
  PutAll(*a, keys);
  ASSERT_TRUE(a->Flush(std::chrono::seconds(30)).ok());
  auto b = OpenStore(32, cluster, 1, engine);
  auto probe = keys;
  probe.push_back("never-stored");
  EXPECT_EQ(Lookup(*b, probe), 24u);  // local tiers empty: the whole prefix came from the node
  EXPECT_EQ(cluster.nodes[0]->stats().leases_active, 24u);
  EXPECT_EQ(GetAll(*b, keys), std::vector<uint8_t>(24, 1));
  EXPECT_EQ(cluster.nodes[0]->stats().leases_active, 0u);  // each read ended its lease
  EXPECT_EQ(b->stats().tiers[0].promotions_in, 24u);       // and landed in B's DRAM
  EXPECT_EQ(Lookup(*b, keys), 24u);
}

TEST(RemoteTierStore, ReadsFallBackToAnotherReplicaWhenANodeDies) {
  auto cluster = StartNodes(3);
  auto engine = std::make_shared<concurrency::ThreadPool>(2);
  auto a = OpenStore(4, cluster, 2, engine);
  const auto keys = Keys(30, "r");
  PutAll(*a, keys);
  ASSERT_TRUE(a->Flush(std::chrono::seconds(30)).ok());
  cluster.nodes[0]->Stop();
  auto b = OpenStore(64, cluster, 2, engine);
  EXPECT_EQ(Lookup(*b, keys), 30u);
  EXPECT_EQ(GetAll(*b, keys), std::vector<uint8_t>(30, 1));
}

TEST(RemoteTierStore, OneReplicaAndADeadNodeMeansCleanMissesWithinTheDeadline) {
  auto cluster = StartNodes(3);
  auto engine = std::make_shared<concurrency::ThreadPool>(2);
  auto a = OpenStore(4, cluster, 1, engine, std::chrono::milliseconds(1500));
  const auto keys = Keys(30, "m");
  PutAll(*a, keys);
  ASSERT_TRUE(a->Flush(std::chrono::seconds(30)).ok());
  auto b = OpenStore(64, cluster, 1, engine, std::chrono::milliseconds(1500));
  ASSERT_EQ(Lookup(*b, keys), 30u);  // adopted while every node is up
  cluster.nodes[1]->Stop();
  const auto t0 = std::chrono::steady_clock::now();
  auto found = GetAll(*b, keys);  // bytes of every hit are checked inside
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  size_t hits = 0;
  for (auto f : found) hits += f;
  EXPECT_GT(hits, 0u);
  EXPECT_LT(hits, 30u);  // the dead node's keys are misses, not errors and not data
  EXPECT_EQ(Lookup(*b, keys) < 30u, true);  // and forgotten by B
}

TEST(RemoteTierStore, ABlockTheNodesDroppedIsAMissAndForgotten) {
  auto cluster = StartNodes(1);
  auto engine = std::make_shared<concurrency::ThreadPool>(2);
  auto a = OpenStore(4, cluster, 1, engine);
  const auto keys = Keys(12, "g");
  PutAll(*a, keys);
  ASSERT_TRUE(a->Flush(std::chrono::seconds(30)).ok());
  auto b = OpenStore(32, cluster, 1, engine);
  ASSERT_EQ(Lookup(*b, keys), 12u);
  auto direct = StoreClient::CreateRaw(kBlock, TestSecret(), {.nodes = cluster.addrs});
  ASSERT_TRUE((*direct)->Remove({"g0"}).ok());
  auto found = GetAll(*b, keys);
  EXPECT_EQ(found[0], 0);
  for (size_t i = 1; i < 12; ++i) EXPECT_EQ(found[i], 1) << i;
  EXPECT_EQ(Lookup(*b, keys), 0u);  // g0 is gone everywhere now
  EXPECT_EQ(b->stats().corrupted, 0u);
}

// A remote tier alone (no KVStore above it) over the cluster's nodes.
Result<std::unique_ptr<RemoteTier>> OpenRemote(const Cluster& c, size_t handles,
                                               size_t block = kBlock) {
  RemoteTierOptions ro;
  ro.block_bytes = block;
  ro.capacity_blocks = handles;
  ro.client.nodes = c.addrs;
  return RemoteTier::Open(ro, TestSecret());
}

// LEASE CONTRACT: only adopted keys stay leased - not those past the nodes' prefix, nor those
// the tier has no handle for; and a node with another block size fails the open by name.
TEST(RemoteTierStore, OnlyAdoptedKeysStayLeasedAndABlockSizeMismatchFailsTheOpen) {
  auto cluster = StartNodes(1);
  auto direct = StoreClient::CreateRaw(kBlock, TestSecret(), {.nodes = cluster.addrs});
  const auto keys = Keys(6, "l");
  std::vector<uint8_t> rows(keys.size() * kBlock, 3);
  std::vector<const uint8_t*> src;
  for (size_t i = 0; i < keys.size(); ++i) src.push_back(rows.data() + i * kBlock);
  ASSERT_TRUE((*direct)->PutRaw(keys, src).ok());
  ASSERT_TRUE((*direct)->Remove({"l1"}).ok());  // l0, a gap, then l2..l5
  auto remote = OpenRemote(cluster, 2);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  std::vector<uint64_t> locs;
  std::vector<std::string_view> all(keys.begin(), keys.end());
  EXPECT_EQ((*remote)->AdoptPrefix(all, &locs), 1u);
  EXPECT_EQ(cluster.nodes[0]->stats().leases_active, 1u);  // l0 only
  std::vector<std::string_view> tail(keys.begin() + 2, keys.end());
  EXPECT_EQ((*remote)->AdoptPrefix(tail, &locs), 1u);  // one handle left for four hits
  EXPECT_EQ(cluster.nodes[0]->stats().leases_active, 2u);
  auto wide = OpenRemote(cluster, 2, 2 * kBlock);
  EXPECT_EQ(wide.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wide.status().message().find("serves 8192-byte blocks"), std::string::npos)
      << wide.status().ToString();
}

// A remote hit reports the checksum its bytes were verified against on arrival (the sender's
// XXH3 from the frame), so the store can check the copy it promotes out of the caller's row
// (PROMOTION CHECK: the row may have changed after the read verified it).
TEST(RemoteTierStore, AHitReportsTheChecksumItWasVerifiedAgainst) {
  auto cluster = StartNodes(2);
  auto remote = OpenRemote(cluster, 16);
  ASSERT_TRUE(remote.ok()) << remote.status().ToString();
  const auto keys = Keys(6, "c");
  std::vector<uint8_t> rows(keys.size() * kBlock);
  std::vector<tier::BlockWrite> writes(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    FillFor(keys[i], rows.data() + i * kBlock);
    auto loc = (*remote)->Reserve();
    ASSERT_TRUE(loc.ok());
    writes[i] = {.key = keys[i], .data = rows.data() + i * kBlock, .location = *loc};
  }
  (*remote)->WriteBatch(writes);
  for (auto& w : writes) ASSERT_TRUE(w.status.ok()) << w.status.ToString();
  std::vector<uint8_t> into(keys.size() * kBlock);
  std::vector<tier::BlockRead> reads(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    reads[i] = {.key = keys[i], .dst = into.data() + i * kBlock, .location = writes[i].location};
  }
  (*remote)->ReadBatch(reads);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(reads[i].status.ok()) << reads[i].status.ToString();
    ASSERT_TRUE(reads[i].checksum.has_value()) << keys[i];
    EXPECT_EQ(*reads[i].checksum, Checksum64(rows.data() + i * kBlock, kBlock)) << keys[i];
  }
}

}  // namespace
}  // namespace tpusync::node
