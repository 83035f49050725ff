#include "tpusync/node/store_node.h"

#include <gtest/gtest.h>

#include "tpusync/node/store_client.h"
#include "tpusync/transport/fault_stream.h"

namespace tpusync::node {
namespace {

constexpr size_t kBlock = 16 << 10;

Secret TestSecret() { return *Secret::FromBytes("store-node-test-secret-0123456789"); }

std::shared_ptr<BlockAllocator> MakePool(size_t blocks) {
  auto pool = memory::HostPool::Create({.size_bytes = BlockAllocator::StrideFor(kBlock) * blocks});
  return std::shared_ptr<BlockAllocator>(
      std::move(*BlockAllocator::Create(std::move(*pool), kBlock)));
}

std::unique_ptr<StoreNode> StartNode(size_t blocks = 64) {
  auto n =
      StoreNode::Start({.capacity_bytes = blocks * kBlock, .block_bytes = kBlock}, TestSecret());
  EXPECT_TRUE(n.ok()) << n.status().ToString();
  return std::move(*n);
}

std::vector<std::string> Keys(size_t n, const std::string& prefix = "k") {
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) out.push_back(prefix + std::to_string(i));
  return out;
}

void Fill(BlockAllocator& p, const std::vector<BlockId>& ids, uint8_t seed) {
  for (size_t i = 0; i < ids.size(); ++i) std::memset(*p.Address(ids[i]), seed + i, kBlock);
}

TEST(StoreNode, PutGetLookupRemoveRoundTrip) {
  auto node = StartNode();
  auto pool = MakePool(32);
  auto client = StoreClient::Create(pool, TestSecret(), {.nodes = {node->address().ToString()}});
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto src = *pool->Alloc(8);
  Fill(*pool, src, 10);
  const auto keys = Keys(8);
  auto put = (*client)->Put(keys, src);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  EXPECT_EQ(*put, std::vector<uint32_t>(8, 1));
  auto dst = *pool->Alloc(8);
  auto got = (*client)->Get(keys, dst);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, std::vector<bool>(8, true));
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ((*pool->Address(dst[i]))[kBlock - 1], 10 + i);
  // Longest prefix: k0..k3 then a missing key.
  auto probe = Keys(4);
  probe.push_back("missing");
  probe.push_back("k5");
  EXPECT_EQ(*(*client)->LookupPrefix(probe), 4u);
  auto rm = (*client)->Remove({"k0", "nope"});
  ASSERT_TRUE(rm.ok());
  EXPECT_EQ(*rm, (std::vector<bool>{true, false}));
  EXPECT_EQ(*(*client)->LookupPrefix(keys), 0u);
  const auto st = node->stats();
  EXPECT_EQ(st.put_blocks, 8u);
  EXPECT_EQ(st.get_hits, 8u);
  EXPECT_EQ(st.blocks_used, 7u);
}

TEST(StoreNode, CorruptPutCommitsNothingAndFirstWriterWins) {
  auto node = StartNode();
  auto pool = MakePool(16);
  transport::ConnectOptions co{.streams = 1};
  co.wrap = [](std::unique_ptr<transport::Stream> s, size_t) -> std::unique_ptr<transport::Stream> {
    return std::make_unique<transport::FaultyStream>(
        std::move(s), transport::FaultPlan{.corrupt_probability = 1});
  };
  auto bad = StoreClient::Create(pool, TestSecret(),
                                 {.nodes = {node->address().ToString()}, .connect = co});
  auto src = *pool->Alloc(4);
  Fill(*pool, src, 1);
  auto put = (*bad)->Put(Keys(4), src);
  ASSERT_TRUE(put.ok());
  EXPECT_EQ(*put, std::vector<uint32_t>(4, 0));  // the node refused the damaged payload
  EXPECT_EQ(node->stats().put_corrupt, 1u);
  EXPECT_EQ(node->stats().blocks_used, 0u);  // the reservation was released
  auto good = StoreClient::Create(pool, TestSecret(), {.nodes = {node->address().ToString()}});
  EXPECT_EQ(*(*good)->LookupPrefix(Keys(4)), 0u);
  ASSERT_TRUE((*good)->Put(Keys(4), src).ok());
  Fill(*pool, src, 50);
  ASSERT_TRUE((*good)->Put(Keys(4), src).ok());  // same keys again: exists, bytes dropped
  EXPECT_EQ(node->stats().put_exists, 4u);
  auto dst = *pool->Alloc(4);
  ASSERT_TRUE((*good)->Get(Keys(4), dst).ok());
  EXPECT_EQ((*pool->Address(dst[0]))[0], 1);  // the first writer's bytes
}

TEST(StoreNode, FullNodeEvictsLeastRecentlyUsed) {
  auto node = StartNode(8);
  auto pool = MakePool(16);
  auto client = StoreClient::Create(pool, TestSecret(), {.nodes = {node->address().ToString()}});
  auto src = *pool->Alloc(8);
  ASSERT_TRUE((*client)->Put(Keys(8, "a"), src).ok());
  EXPECT_EQ(*(*client)->LookupPrefix({"a7"}), 1u);  // touch a7
  ASSERT_TRUE(
      (*client)->Put(Keys(2, "b"), std::vector<BlockId>(src.begin(), src.begin() + 2)).ok());
  EXPECT_EQ(node->stats().evictions, 2u);
  EXPECT_EQ(*(*client)->LookupPrefix({"a0"}), 0u);  // the oldest went first
  EXPECT_EQ(*(*client)->LookupPrefix({"a7", "b0", "b1"}), 3u);
}

TEST(StoreNode, RendezvousReplicationSurvivesANodeLoss) {
  std::vector<std::unique_ptr<StoreNode>> nodes;
  std::vector<std::string> addrs;
  for (int i = 0; i < 3; ++i) {
    nodes.push_back(StartNode());
    addrs.push_back(nodes.back()->address().ToString());
  }
  auto pool = MakePool(64);
  auto client = StoreClient::Create(pool, TestSecret(), {.nodes = addrs, .replication = 2});
  ASSERT_TRUE(client.ok());
  const auto keys = Keys(24);
  auto src = *pool->Alloc(24);
  Fill(*pool, src, 3);
  auto put = (*client)->Put(keys, src);
  ASSERT_TRUE(put.ok());
  EXPECT_EQ(*put, std::vector<uint32_t>(24, 2));
  uint64_t total = 0;
  for (auto& n : nodes) {
    total += n->stats().blocks_used;
    EXPECT_GT(n->stats().blocks_used, 0u);  // every node took a share
  }
  EXPECT_EQ(total, 48u);
  // A second client with the same node list computes the same placement.
  auto other = StoreClient::Create(pool, TestSecret(), {.nodes = addrs, .replication = 2});
  for (const auto& k : keys) EXPECT_EQ((*client)->Rank(k), (*other)->Rank(k));
  nodes[0]->Stop();
  auto dst = *pool->Alloc(24);
  auto got = (*client)->Get(keys, dst);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, std::vector<bool>(24, true));
  for (size_t i = 0; i < 24; ++i)
    EXPECT_EQ((*pool->Address(dst[i]))[7], static_cast<uint8_t>(3 + i));
  EXPECT_EQ(*(*client)->LookupPrefix(keys), 24u);
}

TEST(StoreNode, MalformedRequestsGetClearErrors) {
  auto node = StartNode();
  auto link = transport::ConnectLink(node->address(), TestSecret(), {.streams = 1});
  ASSERT_TRUE(link.ok());
  auto& s = *(*link)->streams[0];
  transport::MetaWriter w;
  w.U32(2).Str("only-one-key");
  ASSERT_TRUE(
      s.SendMeta(transport::Op::kStoreGet, 1, w.bytes(), transport::DeadlineInMs(2000)).ok());
  auto reply = s.RecvHead(transport::DeadlineInMs(2000));
  ASSERT_TRUE(reply.ok());
  transport::MetaReader r(reply->meta);
  EXPECT_EQ(*r.U8(), static_cast<uint8_t>(StatusCode::kInvalidArgument));
  // The link is still usable after a refused request.
  ASSERT_TRUE(
      s.SendMeta(transport::Op::kStoreLookup, 2, EncodeKeys({"x"}), transport::DeadlineInMs(2000))
          .ok());
  EXPECT_TRUE(s.RecvHead(transport::DeadlineInMs(2000)).ok());
}

}  // namespace
}  // namespace tpusync::node
