// RELAY CONTRACT (pd_stream.h): a send registered before its blocks exist, fed block by block as
// a receive lands them, so the next hop starts while the bucket is still on the wire.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "tpusync/base/checksum.h"
#include "tpusync/transport/fault_stream.h"
#include "tpusync/transport/pd_stream.h"

namespace tpusync::transport {
namespace {

Secret TestSecret() { return *Secret::FromBytes("pd-relay-secret-0123456789abcdef"); }

std::shared_ptr<BlockAllocator> MakePool(size_t block_bytes, size_t blocks,
                                         const std::string& shm = "") {
  memory::HostPoolOptions o;
  o.size_bytes = BlockAllocator::StrideFor(block_bytes) * blocks;
  o.shm_name = shm;
  auto pool = memory::HostPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  auto a = BlockAllocator::Create(std::move(*pool), block_bytes);
  EXPECT_TRUE(a.ok());
  return std::shared_ptr<BlockAllocator>(std::move(*a));
}

// Fills blocks from `seed` and returns their Checksum64s.
std::vector<uint64_t> Fill(BlockAllocator& pool, const std::vector<BlockId>& ids, uint8_t seed) {
  std::vector<uint64_t> sums;
  for (size_t b = 0; b < ids.size(); ++b) {
    uint8_t* p = *pool.Address(ids[b]);
    for (size_t i = 0; i < pool.block_bytes(); ++i) p[i] = static_cast<uint8_t>(seed + b * 7 + i);
    sums.push_back(Checksum64(p, pool.block_bytes()));
  }
  return sums;
}

std::vector<uint64_t> SumsOf(BlockAllocator& pool, const std::vector<BlockId>& ids) {
  std::vector<uint64_t> sums;
  for (BlockId b : ids) sums.push_back(Checksum64(*pool.Address(b), pool.block_bytes()));
  return sums;
}

// A producer whose every stream waits `delay` before each frame: a slow first hop.
ServerOptions SlowFrames(std::chrono::milliseconds delay) {
  ServerOptions so;
  so.wrap = [delay](std::unique_ptr<Stream> s, size_t) -> std::unique_ptr<Stream> {
    return std::make_unique<FaultyStream>(std::move(s), FaultPlan{.delay = delay});
  };
  return so;
}

PdStatus ProducerEnd(PdProducer& p, uint64_t id) {
  for (int i = 0; i < 2000; ++i) {
    for (auto& s : p.Poll()) {
      if (s.request_id == id && s.state != PdState::kPending) return s;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << "producer never finished request " << id;
  return {};
}

bool StillReceiving(PdConsumer& c, uint64_t id) {
  for (auto& s : c.Poll()) {
    if (s.request_id == id) return s.state == PdState::kPending;
  }
  return false;
}

// origin --(slow link)--> middle (consumer + relay producer on one pool) --> end.
TEST(PdRelay, ForwardsBlocksAsTheyLandWithTheOriginsChecksums) {
  constexpr size_t kBlocks = 8, kBytes = 64 << 10;
  auto opool = MakePool(kBytes, kBlocks), mpool = MakePool(kBytes, kBlocks),
       epool = MakePool(kBytes, kBlocks);
  PdProducerOptions slow;
  slow.server = SlowFrames(std::chrono::milliseconds(60));
  auto origin = PdProducer::Start(opool, TestSecret(), slow);
  auto relay = PdProducer::Start(mpool, TestSecret(), {});
  auto middle = PdConsumer::Create(mpool, TestSecret(), {.connect = {.streams = 1}});
  auto end = PdConsumer::Create(epool, TestSecret(), {.connect = {.streams = 1}});
  ASSERT_TRUE(origin.ok() && relay.ok() && middle.ok() && end.ok());

  auto src = *opool->Alloc(kBlocks);
  const auto sums = Fill(*opool, src, 5);
  ASSERT_TRUE((*origin)->RegisterSend(1, src, 1, DeadlineInMs(20000), sums).ok());
  ASSERT_TRUE(opool->Free(src).ok());

  ASSERT_TRUE((*relay)->RegisterRelay(2, kBlocks, 1, DeadlineInMs(20000)).ok());
  auto mid = *mpool->Alloc(kBlocks);
  PdProducer* r = relay->get();
  std::atomic<int> open_errors{0};
  ASSERT_TRUE((*middle)
                  ->StartRecv(1, {{(*origin)->address().ToString(), mid}}, DeadlineInMs(20000),
                              [r, &open_errors](uint32_t first, std::span<const BlockId> blocks,
                                                std::span<const uint64_t> checksums) {
                                if (!r->Open(2, first, blocks, checksums).ok()) ++open_errors;
                              })
                  .ok());
  auto dst = *epool->Alloc(kBlocks);
  ASSERT_TRUE(
      (*end)->StartRecv(2, {{(*relay)->address().ToString(), dst}}, DeadlineInMs(20000)).ok());

  // Cut-through: the end has a whole group while the middle still receives the bucket (each
  // origin frame takes 60 ms, so the middle needs ~0.5 s for all eight).
  auto first = (*end)->Wait(2, 1, DeadlineInMs(20000));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_GE(first->groups_ready, 1u);
  EXPECT_TRUE(StillReceiving(**middle, 1));

  auto got = (*end)->Wait(2, UINT32_MAX, DeadlineInMs(20000));
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
  EXPECT_EQ(got->checksums, sums);  // the origin's hash, checked at the end
  EXPECT_EQ(SumsOf(*epool, dst), sums);
  EXPECT_EQ(open_errors.load(), 0);
  EXPECT_EQ(ProducerEnd(**relay, 2).state, PdState::kDone);

  // The relay held its own reference on every block: the middle may free its own at once, and
  // the pool is whole once the end acknowledged (OWNERSHIP CONTRACT).
  ASSERT_TRUE(mpool->Free(mid).ok());
  for (int i = 0; i < 400 && mpool->num_free() != kBlocks; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(mpool->num_free(), kBlocks);
}

TEST(PdRelay, APullWaitsForOpenBlocksAndCancelEndsItAtOnce) {
  constexpr size_t kBlocks = 4, kBytes = 16 << 10;
  auto pool = MakePool(kBytes, kBlocks), cpool = MakePool(kBytes, kBlocks);
  auto producer = PdProducer::Start(pool, TestSecret(), {});
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 1}});
  ASSERT_TRUE(producer.ok() && consumer.ok());
  ASSERT_TRUE((*producer)->RegisterRelay(5, kBlocks, 1, DeadlineInMs(30000)).ok());
  auto blocks = *pool->Alloc(2);
  const auto sums = Fill(*pool, blocks, 9);
  ASSERT_TRUE((*producer)->Open(5, 0, blocks, sums).ok());
  ASSERT_TRUE(pool->Free(blocks).ok());  // the relay holds its own reference
  EXPECT_EQ(pool->num_free(), kBlocks - 2);

  auto dst = *cpool->Alloc(kBlocks);
  ASSERT_TRUE((*consumer)
                  ->StartRecv(5, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(30000))
                  .ok());
  auto two = (*consumer)->Wait(5, 2, DeadlineInMs(20000));
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->groups_ready, 2u);
  // Blocks 2 and 3 never come: the pull waits for them, not past the relay's end.
  auto three = (*consumer)->Wait(5, 3, DeadlineInMs(300));
  EXPECT_EQ(three.status().code(), StatusCode::kTimeout);

  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE((*producer)->Cancel(5, Status::Unavailable("the forwarder lost its source")).ok());
  auto got = (*consumer)->Wait(5, UINT32_MAX, DeadlineInMs(20000));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->state, PdState::kFailed);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(ProducerEnd(**producer, 5).state, PdState::kFailed);
  for (int i = 0; i < 400 && pool->num_free() != kBlocks; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(pool->num_free(), kBlocks);  // the opened blocks went back
}

TEST(PdRelay, ARelayNobodyFillsEndsAtItsDeadline) {
  auto pool = MakePool(16 << 10, 2), cpool = MakePool(16 << 10, 2);
  auto producer = PdProducer::Start(pool, TestSecret(), {});
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  ASSERT_TRUE(producer.ok() && consumer.ok());
  ASSERT_TRUE((*producer)->RegisterRelay(6, 2, 0, DeadlineInMs(400)).ok());
  auto dst = *cpool->Alloc(2);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE((*consumer)
                  ->StartRecv(6, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(30000))
                  .ok());
  auto got = (*consumer)->Wait(6, UINT32_MAX, DeadlineInMs(20000));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->state, PdState::kFailed);
  // The consumer hears the relay's reason, not its own deadline (30 s) expiring.
  EXPECT_NE(got->reason.message().find("did not land here by the deadline"), std::string::npos)
      << got->reason.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  EXPECT_EQ(ProducerEnd(**producer, 6).state, PdState::kFailed);
}

TEST(PdRelay, OpenRefusesBadInputAndKeepsTheFirstCopy) {
  constexpr size_t kBytes = 16 << 10;
  auto pool = MakePool(kBytes, 8), cpool = MakePool(kBytes, 8);
  auto producer = PdProducer::Start(pool, TestSecret(), {});
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  ASSERT_TRUE(producer.ok() && consumer.ok());
  PdProducer& p = **producer;
  auto a = *pool->Alloc(2), b = *pool->Alloc(2);
  const auto sa = Fill(*pool, a, 1), sb = Fill(*pool, b, 100);

  EXPECT_EQ(p.Open(9, 0, a, sa).code(), StatusCode::kNotFound);
  EXPECT_EQ(p.RegisterRelay(9, 0, 0, DeadlineInMs(20000)).code(), StatusCode::kInvalidArgument);
  auto plain = *pool->Alloc(1);
  ASSERT_TRUE(p.RegisterSend(8, plain, 0, DeadlineInMs(20000)).ok());
  ASSERT_TRUE(pool->Free(plain).ok());
  EXPECT_EQ(p.Open(8, 0, a, sa).code(), StatusCode::kInvalidArgument);  // not a relay
  ASSERT_TRUE(p.RegisterRelay(9, 2, 0, DeadlineInMs(20000)).ok());
  EXPECT_EQ(p.RegisterRelay(9, 2, 0, DeadlineInMs(20000)).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(p.Open(9, 1, a, sa).code(), StatusCode::kInvalidArgument);  // [1, 3) of 2
  EXPECT_EQ(p.Open(9, 0, a, std::span<const uint64_t>(sa).first(1)).code(),
            StatusCode::kInvalidArgument);
  const size_t free_before = pool->num_free();
  // Block 0 from `a`, then both from `b`: block 0 keeps `a`'s copy, block 1 takes `b`'s.
  ASSERT_TRUE(p.Open(9, 0, std::span<const BlockId>(a).first(1), std::span(sa).first(1)).ok());
  ASSERT_TRUE(p.Open(9, 0, b, sb).ok());
  ASSERT_TRUE(pool->Free(a).ok());
  ASSERT_TRUE(pool->Free(b).ok());
  // a[1] and b[0] were never taken by the relay: freed now. a[0] and b[1] stay referenced.
  EXPECT_EQ(pool->num_free(), free_before + 2);

  auto dst = *cpool->Alloc(2);
  ASSERT_TRUE(
      consumer->get()->StartRecv(9, {{p.address().ToString(), dst}}, DeadlineInMs(20000)).ok());
  auto got = (*consumer)->Wait(9, UINT32_MAX, DeadlineInMs(20000));
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
  EXPECT_EQ(got->checksums, (std::vector<uint64_t>{sa[0], sb[1]}));
  EXPECT_EQ(SumsOf(*cpool, dst), (std::vector<uint64_t>{sa[0], sb[1]}));
  EXPECT_EQ(ProducerEnd(p, 9).state, PdState::kDone);
  for (int i = 0; i < 400 && pool->num_free() != 7; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(pool->num_free(), 7u);  // only the plain send's block is still registered
}

TEST(PdRelay, TheSameHostPathOffersOnlyOnceEveryBlockIsOpen) {
  constexpr size_t kBlocks = 4, kBytes = 64 << 10;
  const std::string shm = "tpusync-pd-relay-" + std::to_string(::getpid());
  auto pool = MakePool(kBytes, kBlocks, shm), cpool = MakePool(kBytes, kBlocks);
  PdProducerOptions po;
  po.unix_path = "/tmp/" + shm + ".sock";
  auto producer = PdProducer::Start(pool, TestSecret(), po);
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  ASSERT_TRUE(producer.ok() && consumer.ok());
  ASSERT_TRUE((*producer)->RegisterRelay(3, kBlocks, 1, DeadlineInMs(20000)).ok());
  auto blocks = *pool->Alloc(kBlocks);
  const auto sums = Fill(*pool, blocks, 42);
  ASSERT_TRUE((*producer)
                  ->Open(3, 0, std::span<const BlockId>(blocks).first(3),
                         std::span<const uint64_t>(sums).first(3))
                  .ok());
  auto dst = *cpool->Alloc(kBlocks);
  ASSERT_TRUE(
      (*consumer)->StartRecv(3, {{(*producer)->unix_address(), dst}}, DeadlineInMs(20000)).ok());
  auto early = (*consumer)->Wait(3, 1, DeadlineInMs(300));
  EXPECT_EQ(early.status().code(), StatusCode::kTimeout);  // no offer with a block missing
  ASSERT_TRUE((*producer)
                  ->Open(3, 3, std::span<const BlockId>(blocks).subspan(3),
                         std::span<const uint64_t>(sums).subspan(3))
                  .ok());
  auto got = (*consumer)->Wait(3, UINT32_MAX, DeadlineInMs(20000));
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
  EXPECT_TRUE(got->shm);
  EXPECT_EQ(got->checksums, sums);
  EXPECT_EQ(SumsOf(*cpool, dst), sums);
  ASSERT_TRUE(pool->Free(blocks).ok());
  EXPECT_EQ(ProducerEnd(**producer, 3).state, PdState::kDone);
  (*producer)->Stop();
  ::unlink(po.unix_path.c_str());
}

}  // namespace
}  // namespace tpusync::transport
