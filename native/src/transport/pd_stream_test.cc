#include "tpusync/transport/pd_stream.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "tpusync/base/checksum.h"
#include "tpusync/transport/fault_stream.h"

namespace tpusync::transport {
namespace {

Secret TestSecret() { return *Secret::FromBytes("pd-test-secret-0123456789abcdef"); }

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

void Fill(BlockAllocator& pool, const std::vector<BlockId>& ids, uint8_t seed) {
  for (size_t b = 0; b < ids.size(); ++b) {
    uint8_t* p = *pool.Address(ids[b]);
    for (size_t i = 0; i < pool.block_bytes(); ++i) p[i] = static_cast<uint8_t>(seed + b * 13 + i);
  }
}

bool Same(BlockAllocator& a, const std::vector<BlockId>& x, BlockAllocator& b,
          const std::vector<BlockId>& y) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::memcmp(*a.Address(x[i]), *b.Address(y[i]), a.block_bytes()) != 0) return false;
  }
  return true;
}

// A producer's server whose every stream waits `delay` before each frame: a slow link, so a
// pull is still in flight when a test cancels or abandons it.
ServerOptions SlowFrames(std::chrono::milliseconds delay) {
  ServerOptions so;
  so.wrap = [delay](std::unique_ptr<Stream> s, size_t) -> std::unique_ptr<Stream> {
    return std::make_unique<FaultyStream>(std::move(s), FaultPlan{.delay = delay});
  };
  return so;
}

// Allocates `n` blocks of `pool`, fills them from `seed` and registers them as request `id`
// (`per_group` blocks per group, 60 s deadline), then drops the caller's reference: the producer
// holds the only one (OWNERSHIP CONTRACT), so the pool is whole again exactly when it let go.
void OfferFilled(PdProducer& p, BlockAllocator& pool, uint64_t id, size_t n, uint32_t per_group,
                 uint8_t seed) {
  auto src = *pool.Alloc(n);
  Fill(pool, src, seed);
  ASSERT_TRUE(p.RegisterSend(id, src, per_group, DeadlineInMs(60000)).ok());
  ASSERT_TRUE(pool.Free(src).ok());
}

PdStatus WaitEnd(PdConsumer& c, uint64_t id) {
  auto st = c.Wait(id, UINT32_MAX, DeadlineInMs(20000));
  EXPECT_TRUE(st.ok()) << st.status().ToString();
  return st.ok() ? *st : PdStatus{};
}

// Waits (bounded) until the producer reports request `id` as terminal.
PdStatus ProducerEnd(PdProducer& p, uint64_t id) {
  for (int i = 0; i < 1000; ++i) {
    for (auto& s : p.Poll()) {
      if (s.request_id == id && s.state != PdState::kPending) return s;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << "producer never finished request " << id;
  return {};
}

TEST(PdStream, StreamsGroupsAndFreesProducerBlocksOnlyAfterAck) {
  auto ppool = MakePool(64 << 10, 32), cpool = MakePool(64 << 10, 32);
  auto producer = PdProducer::Start(ppool, TestSecret(), {});
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 3}});
  ASSERT_TRUE(consumer.ok());

  auto src = *ppool->Alloc(20);
  Fill(*ppool, src, 3);
  ASSERT_TRUE((*producer)->RegisterSend(7, src, 4, DeadlineInMs(20000)).ok());
  ASSERT_TRUE(ppool->Free(src).ok());  // the transport holds its own reference
  EXPECT_EQ(ppool->num_free(), 12u);

  auto dst = *cpool->Alloc(20);
  ASSERT_TRUE((*consumer)
                  ->StartRecv(7, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(20000))
                  .ok());
  const PdStatus got = WaitEnd(**consumer, 7);
  ASSERT_EQ(got.state, PdState::kDone) << got.reason.ToString();
  EXPECT_EQ(got.groups_total, 5u);
  EXPECT_EQ(got.groups_ready, 5u);
  EXPECT_EQ(got.bytes, 20u * (64 << 10));
  EXPECT_FALSE(got.shm);
  const PdStatus sent = ProducerEnd(**producer, 7);
  EXPECT_EQ(sent.state, PdState::kDone);
  EXPECT_EQ(ppool->num_free(), 32u);  // the producer released its reference after the ack
  // Content check: re-fill a fresh producer request and compare.
  auto src2 = *ppool->Alloc(20);
  Fill(*ppool, src2, 3);
  for (size_t i = 0; i < 20; ++i) {
    ASSERT_EQ(0, std::memcmp(*ppool->Address(src2[i]), *cpool->Address(dst[i]), 64 << 10)) << i;
  }
  EXPECT_EQ((*consumer)->idle_links(), 1u);  // the link went back to the pool
}

TEST(PdStream, ConsumerMayPullBeforeTheProducerRegisters) {
  auto ppool = MakePool(4096, 8), cpool = MakePool(4096, 8);
  auto producer = PdProducer::Start(ppool, TestSecret(), {});
  auto consumer =
      PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 2}, .small_pull_bytes = 0});
  auto dst = *cpool->Alloc(8);
  ASSERT_TRUE((*consumer)
                  ->StartRecv(1, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(10000))
                  .ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto src = *ppool->Alloc(8);
  Fill(*ppool, src, 9);
  ASSERT_TRUE((*producer)->RegisterSend(1, src, 1, DeadlineInMs(10000)).ok());
  const PdStatus got = WaitEnd(**consumer, 1);
  ASSERT_EQ(got.state, PdState::kDone) << got.reason.ToString();
  EXPECT_EQ(got.groups_total, 8u);
  EXPECT_TRUE(Same(*ppool, src, *cpool, dst));
}

TEST(PdStream, CompleteOnlyWhenEverySenderLanded) {
  auto p1pool = MakePool(4096, 8), p2pool = MakePool(4096, 8), cpool = MakePool(4096, 16);
  auto p1 = PdProducer::Start(p1pool, TestSecret(), {});
  auto p2 = PdProducer::Start(p2pool, TestSecret(), {});
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  auto s1 = *p1pool->Alloc(4), s2 = *p2pool->Alloc(6);
  Fill(*p1pool, s1, 1);
  Fill(*p2pool, s2, 2);
  auto d = *cpool->Alloc(10);
  std::vector<BlockId> d1(d.begin(), d.begin() + 4), d2(d.begin() + 4, d.end());
  ASSERT_TRUE((*p1)->RegisterSend(5, s1, 2, DeadlineInMs(10000)).ok());
  ASSERT_TRUE(
      (*consumer)
          ->StartRecv(5, {{(*p1)->address().ToString(), d1}, {(*p2)->address().ToString(), d2}},
                      DeadlineInMs(10000))
          .ok());
  // Sender 1 alone is not enough.
  auto early = (*consumer)->Wait(5, UINT32_MAX, DeadlineInMs(300));
  EXPECT_EQ(early.status().code(), StatusCode::kTimeout);
  ASSERT_TRUE((*p2)->RegisterSend(5, s2, 3, DeadlineInMs(10000)).ok());
  const PdStatus got = WaitEnd(**consumer, 5);
  ASSERT_EQ(got.state, PdState::kDone) << got.reason.ToString();
  EXPECT_TRUE(Same(*p1pool, s1, *cpool, d1));
  EXPECT_TRUE(Same(*p2pool, s2, *cpool, d2));
}

TEST(PdStream, UnknownRequestSizeMismatchAndDeadlineFailCleanly) {
  auto ppool = MakePool(4096, 8), cpool = MakePool(4096, 8);
  PdProducerOptions po;
  po.max_pull_wait = std::chrono::milliseconds(100);
  auto producer = PdProducer::Start(ppool, TestSecret(), po);
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  auto dst = *cpool->Alloc(4);
  const std::string peer = (*producer)->address().ToString();
  ASSERT_TRUE((*consumer)->StartRecv(1, {{peer, dst}}, DeadlineInMs(5000)).ok());
  PdStatus got = WaitEnd(**consumer, 1);
  EXPECT_EQ(got.state, PdState::kFailed);
  EXPECT_EQ(got.reason.code(), StatusCode::kNotFound);

  auto src = *ppool->Alloc(3);
  ASSERT_TRUE((*producer)->RegisterSend(2, src, 0, DeadlineInMs(300)).ok());
  ASSERT_TRUE((*consumer)->StartRecv(2, {{peer, dst}}, DeadlineInMs(5000)).ok());
  got = WaitEnd(**consumer, 2);
  EXPECT_EQ(got.state, PdState::kFailed);
  EXPECT_EQ(got.reason.code(), StatusCode::kInvalidArgument);
  // Nobody pulls request 2 correctly: the deadline frees the producer's reference.
  const PdStatus expired = ProducerEnd(**producer, 2);
  EXPECT_EQ(expired.state, PdState::kFailed);
  EXPECT_EQ(expired.reason.code(), StatusCode::kTimeout);
  ASSERT_TRUE(ppool->Free(src).ok());
  EXPECT_EQ(ppool->num_free(), 8u);
  // Nothing listens: unavailable, not a hang.
  ASSERT_TRUE((*consumer)->StartRecv(3, {{"127.0.0.1:1", dst}}, DeadlineInMs(5000)).ok());
  got = WaitEnd(**consumer, 3);
  EXPECT_EQ(got.state, PdState::kFailed);
  EXPECT_EQ(got.reason.code(), StatusCode::kUnavailable);
}

// The fault double under the P/D layer: corruption, loss and disconnects end as clear failures,
// delay only slows the transfer down.
TEST(PdStream, FaultsBecomeCleanFailuresAndRetriesSucceed) {
  auto ppool = MakePool(16 << 10, 16), cpool = MakePool(16 << 10, 16);
  FaultPlan plan;
  ServerOptions so;
  so.wrap = [&plan](std::unique_ptr<Stream> s, size_t) -> std::unique_ptr<Stream> {
    return std::make_unique<FaultyStream>(std::move(s), plan);
  };
  auto producer = PdProducer::Start(ppool, TestSecret(), {.server = so});
  const std::string peer = (*producer)->address().ToString();
  auto src = *ppool->Alloc(8);
  Fill(*ppool, src, 5);
  auto dst = *cpool->Alloc(8);
  auto run = [&](uint64_t id, FaultPlan p, int64_t deadline_ms) {
    plan = p;  // a fresh consumer makes a fresh link, so the new plan applies
    auto consumer =
        PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 2}, .small_pull_bytes = 0});
    EXPECT_TRUE((*consumer)->StartRecv(id, {{peer, dst}}, DeadlineInMs(deadline_ms)).ok());
    return WaitEnd(**consumer, id);
  };
  ASSERT_TRUE((*producer)->RegisterSend(100, src, 2, DeadlineInMs(30000)).ok());
  // Corrupt every frame: the consumer refuses the data and says so.
  PdStatus got = run(100, {.corrupt_probability = 1.0}, 10000);
  EXPECT_EQ(got.state, PdState::kFailed);
  EXPECT_EQ(got.reason.code(), StatusCode::kCorrupted) << got.reason.ToString();
  // The producer kept the blocks; a clean retry of the same request succeeds.
  EXPECT_EQ((*producer)->pending(), 1u);
  got = run(100, {.delay = std::chrono::milliseconds(2), .seed = 2}, 10000);
  ASSERT_EQ(got.state, PdState::kDone) << got.reason.ToString();
  EXPECT_TRUE(Same(*ppool, src, *cpool, dst));
  // Lost frames: the consumer times out at its deadline.
  ASSERT_TRUE((*producer)->RegisterSend(101, src, 2, DeadlineInMs(30000)).ok());
  got = run(101, {.drop_probability = 1.0}, 500);
  EXPECT_EQ(got.state, PdState::kFailed);
  EXPECT_EQ(got.reason.code(), StatusCode::kTimeout) << got.reason.ToString();
  // Disconnect mid-transfer (after 3 frames on a stream): unavailable.
  got = run(101, {.disconnect_after_sends = 3}, 10000);
  EXPECT_EQ(got.state, PdState::kFailed);
  EXPECT_EQ(got.reason.code(), StatusCode::kUnavailable) << got.reason.ToString();
  plan = {};
  got = run(101, {}, 10000);
  ASSERT_EQ(got.state, PdState::kDone) << got.reason.ToString();
}

TEST(PdStream, SameHostPeersUseTheSharedMemorySegment) {
  const std::string shm = "tpusync-pd-test-" + std::to_string(::getpid());
  auto ppool = MakePool(64 << 10, 16, shm), cpool = MakePool(64 << 10, 16);
  PdProducerOptions po;
  po.unix_path = "/tmp/" + shm + ".sock";
  auto producer = PdProducer::Start(ppool, TestSecret(), po);
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto consumer =
      PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 2}, .small_pull_bytes = 0});
  auto src = *ppool->Alloc(10);
  Fill(*ppool, src, 77);
  auto dst = *cpool->Alloc(10);
  ASSERT_TRUE((*producer)->RegisterSend(9, src, 3, DeadlineInMs(10000)).ok());
  ASSERT_TRUE(
      (*consumer)->StartRecv(9, {{(*producer)->unix_address(), dst}}, DeadlineInMs(10000)).ok());
  const PdStatus got = WaitEnd(**consumer, 9);
  ASSERT_EQ(got.state, PdState::kDone) << got.reason.ToString();
  EXPECT_TRUE(got.shm);
  EXPECT_EQ(got.groups_ready, 4u);
  EXPECT_TRUE(Same(*ppool, src, *cpool, dst));
  EXPECT_EQ(ProducerEnd(**producer, 9).state, PdState::kDone);
}

// SHARED-SEND CONTRACT: a send pulled by two consumers naming 2 readers (one over TCP, one over
// the same-host path) stays registered after the first one's OK and ends, done, after the
// second's; a pull naming another reader count is refused and changes nothing; a failed receipt
// counts nothing.
TEST(PdStream, SharedSendEndsAfterEveryNamedReaderAcknowledged) {
  const std::string shm = "tpusync-pd-shared-" + std::to_string(::getpid());
  auto ppool = MakePool(16 << 10, 16, shm);
  auto apool = MakePool(16 << 10, 16), bpool = MakePool(16 << 10, 16);
  PdProducerOptions po;
  po.unix_path = "/tmp/" + shm + ".sock";
  auto producer = PdProducer::Start(ppool, TestSecret(), po);
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto a = PdConsumer::Create(apool, TestSecret(), {});
  auto b = PdConsumer::Create(bpool, TestSecret(), {});
  ASSERT_TRUE(a.ok() && b.ok());
  auto src = *ppool->Alloc(6);
  Fill(*ppool, src, 21);
  ASSERT_TRUE((*producer)->RegisterSend(11, src, 2, DeadlineInMs(20000)).ok());
  ASSERT_TRUE(ppool->Free(src).ok());
  const std::string tcp = (*producer)->address().ToString();

  auto da = *apool->Alloc(6);
  auto got = (*a)->Recv(11, {{tcp, da, 2}}, DeadlineInMs(10000));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
  EXPECT_EQ((*producer)->pending(), 1u);  // one reader of two acknowledged
  EXPECT_EQ(ppool->num_free(), 10u);

  // Another reader count for the same send: refused, the send stays for its real second reader.
  auto db = *bpool->Alloc(6);
  auto odd = (*b)->Recv(11, {{tcp, db, 3}}, DeadlineInMs(10000));
  ASSERT_TRUE(odd.ok()) << odd.status().ToString();
  EXPECT_EQ(odd->state, PdState::kFailed);
  EXPECT_EQ(odd->reason.code(), StatusCode::kInvalidArgument) << odd->reason.ToString();
  EXPECT_NE(odd->reason.message().find("names 3 reader(s), an earlier one 2"), std::string::npos)
      << odd->reason.ToString();
  EXPECT_EQ((*producer)->pending(), 1u);

  auto second = (*b)->Recv(11, {{(*producer)->unix_address(), db, 2}}, DeadlineInMs(10000));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  ASSERT_EQ(second->state, PdState::kDone) << second->reason.ToString();
  EXPECT_TRUE(second->shm);
  EXPECT_EQ(ProducerEnd(**producer, 11).state, PdState::kDone);
  EXPECT_EQ(ppool->num_free(), 16u);  // the last reader's ack freed the blocks
  EXPECT_TRUE(Same(*apool, da, *bpool, db));
  auto again = *ppool->Alloc(6);
  Fill(*ppool, again, 21);
  EXPECT_TRUE(Same(*ppool, again, *apool, da));

  // A single-reader pull of a send still ends it at its first OK (the frame it always was).
  OfferFilled(**producer, *ppool, 12, 2, 0, 5);
  auto one = (*a)->Recv(12, {{tcp, {da[0], da[1]}}}, DeadlineInMs(10000));
  ASSERT_TRUE(one.ok() && one->state == PdState::kDone);
  EXPECT_EQ(ProducerEnd(**producer, 12).state, PdState::kDone);
  EXPECT_FALSE((*a)->Recv(13, {{tcp, da, 0}}, DeadlineInMs(1000)).ok());  // 0 readers: refused
}

// INLINE CONTRACT: Recv pulls on the calling thread, returns the terminal status itself (Poll does
// not report it again) and keeps to its deadline when the producer never registers.
TEST(PdStream, RecvRunsOnTheCallingThreadAndKeepsItsDeadline) {
  auto ppool = MakePool(16 << 10, 8), cpool = MakePool(16 << 10, 8);
  PdProducerOptions po;
  auto producer = PdProducer::Start(ppool, TestSecret(), po);
  ASSERT_TRUE(producer.ok());
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  ASSERT_TRUE(consumer.ok());
  const std::string peer = (*producer)->address().ToString();
  auto src = *ppool->Alloc(1);
  Fill(*ppool, src, 21);
  auto dst = *cpool->Alloc(1);
  for (uint64_t id = 1; id <= 20; ++id) {  // warm link reused: every round trip inline
    ASSERT_TRUE((*producer)->RegisterSend(id, src, 0, DeadlineInMs(10000)).ok());
    auto got = (*consumer)->Recv(id, {{peer, dst}}, DeadlineInMs(10000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
    EXPECT_EQ(got->bytes, 16u << 10);
    ASSERT_TRUE(Same(*ppool, src, *cpool, dst));
    std::memset(*cpool->Address(dst[0]), 0, 16 << 10);
  }
  EXPECT_TRUE((*consumer)->Poll().empty());  // reported by Recv, not again
  EXPECT_EQ((*consumer)->idle_links(), 1u);
  // A duplicate of a live id is refused, as with StartRecv.
  ASSERT_TRUE((*consumer)->StartRecv(50, {{peer, dst}}, DeadlineInMs(800)).ok());
  EXPECT_EQ((*consumer)->Recv(50, {{peer, dst}}, DeadlineInMs(800)).status().code(),
            StatusCode::kAlreadyExists);
  // The producer waits for the registration as long as the pull's deadline: NotFound or Timeout.
  EXPECT_EQ(WaitEnd(**consumer, 50).state, PdState::kFailed);
  // Never registered: the producer waits for the registration until the pull's deadline, then
  // refuses; Recv returns a failure near its deadline, not later.
  const auto t0 = Clock::now();
  auto got = (*consumer)->Recv(51, {{peer, dst}}, DeadlineInMs(400));
  const auto waited = Clock::now() - t0;
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->state, PdState::kFailed);
  EXPECT_LT(waited, std::chrono::milliseconds(400) + std::chrono::seconds(2));
}

TEST(PdStream, RecvWithSeveralSourcesCompletesOnlyWhenAllLanded) {
  auto p1pool = MakePool(4096, 8), p2pool = MakePool(4096, 8), cpool = MakePool(4096, 16);
  auto p1 = PdProducer::Start(p1pool, TestSecret(), {});
  auto p2 = PdProducer::Start(p2pool, TestSecret(), {});
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  auto s1 = *p1pool->Alloc(3), s2 = *p2pool->Alloc(5);
  Fill(*p1pool, s1, 7);
  Fill(*p2pool, s2, 8);
  auto d = *cpool->Alloc(8);
  std::vector<BlockId> d1(d.begin(), d.begin() + 3), d2(d.begin() + 3, d.end());
  ASSERT_TRUE((*p1)->RegisterSend(9, s1, 0, DeadlineInMs(10000)).ok());
  // The second producer registers late: Recv waits for it (on a worker) within the deadline.
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE((*p2)->RegisterSend(9, s2, 0, DeadlineInMs(10000)).ok());
  });
  auto got =
      (*consumer)->Recv(9, {{(*p1)->address().ToString(), d1}, {(*p2)->address().ToString(), d2}},
                        DeadlineInMs(10000));
  late.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
  EXPECT_EQ(got->bytes, 8u * 4096);
  EXPECT_TRUE(Same(*p1pool, s1, *cpool, d1));
  EXPECT_TRUE(Same(*p2pool, s2, *cpool, d2));
}

// SMALL-PULL CONTRACT: a small source takes a 1-stream link, a large one the striped link.
TEST(PdStream, SmallPullsUseOneStreamLargePullsStripe) {
  auto ppool = MakePool(64 << 10, 16), cpool = MakePool(64 << 10, 16);
  auto producer = PdProducer::Start(ppool, TestSecret(), {});
  const std::string peer = (*producer)->address().ToString();
  std::mutex mu;
  size_t streams_made = 0;
  PdConsumerOptions co{.connect = {.streams = 4}, .small_pull_bytes = 128 << 10};
  co.connect.wrap = [&](std::unique_ptr<Stream> s, size_t) {
    std::lock_guard lock(mu);
    ++streams_made;
    return s;
  };
  auto consumer = PdConsumer::Create(cpool, TestSecret(), co);
  auto src = *ppool->Alloc(16);
  Fill(*ppool, src, 4);
  auto dst = *cpool->Alloc(16);
  auto pull = [&](uint64_t id, size_t n) {
    std::vector<BlockId> s(src.begin(), src.begin() + n), d(dst.begin(), dst.begin() + n);
    ASSERT_TRUE((*producer)->RegisterSend(id, s, 0, DeadlineInMs(10000)).ok());
    auto got = (*consumer)->Recv(id, {{peer, d}}, DeadlineInMs(10000));
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
    EXPECT_TRUE(Same(*ppool, s, *cpool, d));
  };
  pull(1, 2);  // 128 KiB: small
  EXPECT_EQ(streams_made, 1u);
  pull(2, 1);  // reuses the warm 1-stream link
  EXPECT_EQ(streams_made, 1u);
  pull(3, 16);  // 1 MiB: striped over a 4-stream link
  EXPECT_EQ(streams_made, 5u);
  pull(4, 3);  // 192 KiB: small again, same 1-stream link
  EXPECT_EQ(streams_made, 5u);
  EXPECT_EQ((*consumer)->idle_links(), 2u);
}

// DEADLINE CONTRACT on the connect: a peer that accepts TCP but never authenticates costs a Recv
// its deadline, not the (longer) per-stream connect timeout.
TEST(PdStream, RecvFromASilentPeerEndsAtItsDeadline) {
  auto cpool = MakePool(4096, 4);
  auto addr = ParseAddress("127.0.0.1:0");
  ASSERT_TRUE(addr.ok());
  auto listener = Listen(*addr);  // the kernel completes TCP handshakes; nobody ever answers
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  auto local = LocalAddress(listener->get(), false);
  ASSERT_TRUE(local.ok());
  auto consumer = PdConsumer::Create(
      cpool, TestSecret(), {.connect = {.streams = 1, .timeout = std::chrono::seconds(20)}});
  auto dst = *cpool->Alloc(1);
  const auto t0 = Clock::now();
  auto got = (*consumer)->Recv(1, {{local->ToString(), dst}}, DeadlineInMs(300));
  const auto waited = Clock::now() - t0;
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->state, PdState::kFailed);
  EXPECT_EQ(got->reason.code(), StatusCode::kTimeout) << got->reason.ToString();
  EXPECT_LT(waited, std::chrono::seconds(3));
}

// CHECKSUM CONTRACT: checksums given at RegisterSend travel instead of a fresh hash, are verified
// by the consumer on TCP and on the same-host path, come back in PdStatus::checksums, and a wrong
// one fails the receipt (the bytes are never trusted).
TEST(PdStream, OriginChecksumsTravelAreVerifiedAndReported) {
  const std::string shm = "tpusync-pd-sum-" + std::to_string(::getpid());
  auto ppool = MakePool(64 << 10, 16, shm), cpool = MakePool(64 << 10, 16);
  PdProducerOptions po;
  po.unix_path = "/tmp/" + shm + ".sock";
  auto producer = PdProducer::Start(ppool, TestSecret(), po);
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 2}});
  auto src = *ppool->Alloc(6);
  Fill(*ppool, src, 41);
  std::vector<uint64_t> sums;
  for (BlockId b : src) sums.push_back(Checksum64(*ppool->Address(b), ppool->block_bytes()));
  EXPECT_EQ((*producer)->RegisterSend(1, src, 2, DeadlineInMs(10000), {1, 2}).code(),
            StatusCode::kInvalidArgument);  // one per block or none
  uint64_t id = 10;
  for (const std::string& peer : {(*producer)->address().ToString(), (*producer)->unix_address()}) {
    SCOPED_TRACE(peer);
    auto dst = *cpool->Alloc(6);
    ASSERT_TRUE((*producer)->RegisterSend(id, src, 2, DeadlineInMs(10000), sums).ok());
    ASSERT_TRUE((*consumer)->StartRecv(id, {{peer, dst}}, DeadlineInMs(10000)).ok());
    PdStatus got = WaitEnd(**consumer, id);
    ASSERT_EQ(got.state, PdState::kDone) << got.reason.ToString();
    EXPECT_EQ(got.checksums, sums);
    EXPECT_TRUE(Same(*ppool, src, *cpool, dst));
    EXPECT_EQ(ProducerEnd(**producer, id).state, PdState::kDone);
    ++id;
    // A checksum that does not match the bytes (damage after it was taken) fails the receipt.
    std::vector<uint64_t> bad = sums;
    bad[3] ^= 1;
    ASSERT_TRUE((*producer)->RegisterSend(id, src, 2, DeadlineInMs(3000), bad).ok());
    ASSERT_TRUE((*consumer)->StartRecv(id, {{peer, dst}}, DeadlineInMs(3000)).ok());
    got = WaitEnd(**consumer, id);
    EXPECT_EQ(got.state, PdState::kFailed);
    EXPECT_EQ(got.reason.code(), StatusCode::kCorrupted) << got.reason.ToString();
    EXPECT_TRUE(got.checksums.empty());
    ++id;
    ASSERT_TRUE(cpool->Free(dst).ok());
  }
  // Without given checksums: TCP still reports the ones the producer computed; shm has none.
  auto dst = *cpool->Alloc(6);
  ASSERT_TRUE((*producer)->RegisterSend(id, src, 2, DeadlineInMs(10000)).ok());
  ASSERT_TRUE((*consumer)
                  ->StartRecv(id, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(10000))
                  .ok());
  const PdStatus computed = WaitEnd(**consumer, id);
  ASSERT_EQ(computed.state, PdState::kDone) << computed.reason.ToString();
  EXPECT_EQ(computed.checksums, sums);
  ++id;
  ASSERT_TRUE((*producer)->RegisterSend(id, src, 2, DeadlineInMs(10000)).ok());
  ASSERT_TRUE(
      (*consumer)->StartRecv(id, {{(*producer)->unix_address(), dst}}, DeadlineInMs(10000)).ok());
  const PdStatus plain = WaitEnd(**consumer, id);
  // Done (the link that carried the failed receipts above is still in step), without checksums.
  ASSERT_EQ(plain.state, PdState::kDone) << plain.reason.ToString();
  EXPECT_TRUE(plain.shm);
  EXPECT_TRUE(plain.checksums.empty());
  EXPECT_TRUE(Same(*ppool, src, *cpool, dst));
}

// HASH-AHEAD CONTRACT: many blocks on one stream (and on three), with no origin checksums and the
// hasher forced on, arrive intact, each in its own destination slot, and the consumer reports the
// producer-computed checksum of every block in order (a checksum paired with the wrong block
// would fail the receipt as kCorrupted instead).
TEST(PdStream, ManyBlocksArriveIntactInOrderWithHashAheadChecksums) {
  constexpr size_t kBlock = 128 << 10, kBlocks = 64;  // 8 MiB: above the hash-ahead threshold
  auto ppool = MakePool(kBlock, kBlocks), cpool = MakePool(kBlock, kBlocks);
  auto producer = PdProducer::Start(ppool, TestSecret(), {.hash_ahead_below_streams = 64});
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto src = *ppool->Alloc(kBlocks);
  Fill(*ppool, src, 9);  // every block differs from every other
  std::vector<uint64_t> sums;
  for (BlockId b : src) sums.push_back(Checksum64(*ppool->Address(b), kBlock));
  uint64_t id = 500;
  for (size_t streams : {size_t{1}, size_t{3}}) {
    SCOPED_TRACE(streams);
    auto consumer = PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = streams}});
    auto dst = *cpool->Alloc(kBlocks);
    ASSERT_TRUE((*producer)->RegisterSend(id, src, 4, DeadlineInMs(20000)).ok());
    auto got =
        (*consumer)->Recv(id, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(20000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
    EXPECT_EQ(got->groups_ready, kBlocks / 4);
    EXPECT_EQ(got->bytes, kBlocks * kBlock);
    EXPECT_EQ(got->checksums, sums);
    EXPECT_TRUE(Same(*ppool, src, *cpool, dst));
    EXPECT_EQ(ProducerEnd(**producer, id).state, PdState::kDone);
    ASSERT_TRUE(cpool->Free(dst).ok());
    ++id;
  }
}

// HASH-AHEAD CONTRACT: a damaged frame on the hash-ahead path is refused (kCorrupted), the link
// stays in step, and a clean retry of the same request lands every block.
TEST(PdStream, HashAheadPathRefusesDamagedBlocks) {
  constexpr size_t kBlock = 256 << 10, kBlocks = 24;  // 6 MiB on one stream
  auto ppool = MakePool(kBlock, kBlocks), cpool = MakePool(kBlock, kBlocks);
  FaultPlan plan;
  ServerOptions so;
  so.wrap = [&plan](std::unique_ptr<Stream> s, size_t) -> std::unique_ptr<Stream> {
    return std::make_unique<FaultyStream>(std::move(s), plan);
  };
  auto producer =
      PdProducer::Start(ppool, TestSecret(), {.server = so, .hash_ahead_below_streams = 64});
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto src = *ppool->Alloc(kBlocks);
  Fill(*ppool, src, 21);
  auto dst = *cpool->Alloc(kBlocks);
  ASSERT_TRUE((*producer)->RegisterSend(600, src, 0, DeadlineInMs(20000)).ok());
  plan = {.corrupt_probability = 1.0};
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 1}});
  auto got =
      (*consumer)->Recv(600, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(20000));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->state, PdState::kFailed);
  EXPECT_EQ(got->reason.code(), StatusCode::kCorrupted) << got->reason.ToString();
  plan = {};
  auto clean = PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 1}});
  got = (*clean)->Recv(600, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(20000));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
  EXPECT_TRUE(Same(*ppool, src, *cpool, dst));
}

// The same-host path copies large blocks with non-temporal stores (StreamCopy); every byte of
// every block still lands, with and without origin checksums.
TEST(PdStream, SameHostPathCopiesLargeBlocksExactly) {
  const std::string shm = "tpusync-pd-big-" + std::to_string(::getpid());
  constexpr size_t kBlock = (1 << 20) + 4096, kBlocks = 6;  // above kStreamMinBytes, odd size
  auto ppool = MakePool(kBlock, kBlocks, shm), cpool = MakePool(kBlock, kBlocks);
  PdProducerOptions po;
  po.unix_path = "/tmp/" + shm + ".sock";
  auto producer = PdProducer::Start(ppool, TestSecret(), po);
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 1}});
  auto src = *ppool->Alloc(kBlocks);
  Fill(*ppool, src, 55);
  std::vector<uint64_t> sums;
  for (BlockId b : src) sums.push_back(Checksum64(*ppool->Address(b), kBlock));
  uint64_t id = 700;
  for (bool with_sums : {false, true}) {
    SCOPED_TRACE(with_sums);
    auto dst = *cpool->Alloc(kBlocks);
    for (BlockId b : dst) std::memset(*cpool->Address(b), 0xEE, kBlock);
    ASSERT_TRUE((*producer)
                    ->RegisterSend(id, src, 2, DeadlineInMs(20000),
                                   with_sums ? sums : std::vector<uint64_t>{})
                    .ok());
    auto got = (*consumer)->Recv(id, {{(*producer)->unix_address(), dst}}, DeadlineInMs(20000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
    EXPECT_TRUE(got->shm);
    EXPECT_TRUE(Same(*ppool, src, *cpool, dst));
    EXPECT_EQ(got->checksums, with_sums ? sums : std::vector<uint64_t>{});
    ASSERT_TRUE(cpool->Free(dst).ok());
    ++id;
  }
}

// CANCEL CONTRACT: a cancelled send ends at once as failed with the given reason, reported once;
// its blocks are free again, a second Cancel and a later pull find nothing.
TEST(PdStream, CancelEndsASendAtOnceAndReportsItOnce) {
  auto ppool = MakePool(4096, 8), cpool = MakePool(4096, 8);
  auto producer =
      PdProducer::Start(ppool, TestSecret(), {.max_pull_wait = std::chrono::milliseconds(100)});
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto src = *ppool->Alloc(4);
  ASSERT_TRUE((*producer)->RegisterSend(41, src, 0, DeadlineInMs(60000)).ok());
  ASSERT_TRUE((*producer)->RegisterSend(42, src, 0, DeadlineInMs(60000)).ok());
  ASSERT_TRUE(ppool->Free(src).ok());
  EXPECT_EQ((*producer)->Cancel(41, Status::OK()).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*producer)->Cancel(41, Status::Unavailable("sampler 2:0 is dead")).ok());
  auto polled = (*producer)->Poll();
  ASSERT_EQ(polled.size(), 2u);  // 41 failed (reported once), 42 still pending
  const PdStatus& gone = polled[0].request_id == 41 ? polled[0] : polled[1];
  EXPECT_EQ(gone.state, PdState::kFailed);
  EXPECT_EQ(gone.reason.code(), StatusCode::kUnavailable);
  EXPECT_EQ(gone.reason.message(), "sampler 2:0 is dead");
  for (const PdStatus& s : (*producer)->Poll()) EXPECT_EQ(s.request_id, 42u);
  EXPECT_EQ((*producer)->pending(), 1u);
  EXPECT_EQ(ppool->num_free(), 4u);  // 42 still holds the 4 blocks (one owner left)
  EXPECT_EQ((*producer)->Cancel(41, Status::Cancelled("again")).code(), StatusCode::kNotFound);
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  auto dst = *cpool->Alloc(4);
  auto got = (*consumer)->Recv(41, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(5000));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->state, PdState::kFailed);
  // ENDED RULE: the pull is told the cancel's own reason.
  EXPECT_EQ(got->reason.code(), StatusCode::kUnavailable) << got->reason.ToString();
  EXPECT_NE(got->reason.message().find("ended on this producer before this pull: sampler 2:0 is "
                                       "dead"),
            std::string::npos)
      << got->reason.ToString();
  ASSERT_TRUE((*producer)->Cancel(42, Status::Cancelled("version over")).ok());
  EXPECT_EQ(ppool->num_free(), 8u);
}

// ENDED RULE: a pull of a request that was cancelled or expired fails at once with that reason;
// it waited the producer's whole max_pull_wait (10 s by default) for a registration that could
// not come. Registering the id again makes it a new request.
TEST(PdStream, APullOfAnEndedRequestFailsAtOnceWithItsReason) {
  auto ppool = MakePool(4096, 8), cpool = MakePool(4096, 8);
  auto producer = PdProducer::Start(ppool, TestSecret(), {});  // max_pull_wait 10 s
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto src = *ppool->Alloc(2);
  ASSERT_TRUE((*producer)->RegisterSend(51, src, 0, DeadlineInMs(60000)).ok());
  ASSERT_TRUE((*producer)->RegisterSend(52, src, 0, DeadlineInMs(50)).ok());
  ASSERT_TRUE((*producer)->Cancel(51, Status::Cancelled("room 7 aborted")).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // 52 expires (reaper: 20 ms)
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  ASSERT_TRUE(consumer.ok());
  auto dst = *cpool->Alloc(2);
  const std::string at = (*producer)->address().ToString();
  for (auto [id, code, why] : {std::tuple{51u, StatusCode::kCancelled, "room 7 aborted"},
                               std::tuple{52u, StatusCode::kTimeout, "deadline passed"}}) {
    const auto t0 = std::chrono::steady_clock::now();
    auto got = (*consumer)->Recv(id, {{at, dst}}, DeadlineInMs(30000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
    EXPECT_EQ(got->state, PdState::kFailed);
    EXPECT_EQ(got->reason.code(), code) << got->reason.ToString();
    EXPECT_NE(got->reason.message().find(why), std::string::npos) << got->reason.ToString();
  }
  ASSERT_TRUE((*producer)->RegisterSend(51, src, 0, DeadlineInMs(60000)).ok());  // anew
  auto again = (*consumer)->Recv(51, {{at, dst}}, DeadlineInMs(30000));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->state, PdState::kDone) << again->reason.ToString();
  ASSERT_TRUE(ppool->Free(src).ok());
}

// CANCEL CONTRACT, racing a pull in flight: the serving thread is between two frames (a slow
// link) when Cancel drops the producer's reference. The borrow of that pull keeps the slots out
// of the free list (a reuse attempt cannot get them) until the pull let go, which Cancel makes
// happen at once (the link is shut down), not at the 60 s deadline.
TEST(PdStream, CancelRacingAnInFlightPullNeverRecyclesBlocksUnderIt) {
  constexpr size_t kBlock = 1 << 20, kBlocks = 8, kTotal = 12;
  auto ppool = MakePool(kBlock, kTotal), cpool = MakePool(kBlock, kBlocks);
  auto producer = PdProducer::Start(ppool, TestSecret(),
                                    {.server = SlowFrames(std::chrono::milliseconds(150))});
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  OfferFilled(**producer, *ppool, 77, kBlocks, 1, 31);
  auto consumer =
      PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 2}, .small_pull_bytes = 0});
  auto dst = *cpool->Alloc(kBlocks);
  const auto t0 = Clock::now();
  ASSERT_TRUE((*consumer)
                  ->StartRecv(77, {{(*producer)->address().ToString(), dst}}, DeadlineInMs(60000))
                  .ok());
  // The first group landed: the producer is mid-transfer (6 more frames, 150 ms apart per stream).
  auto first = (*consumer)->Wait(77, 1, DeadlineInMs(20000));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->state, PdState::kPending);
  ASSERT_TRUE((*producer)->Cancel(77, Status::Unavailable("consumer presumed dead")).ok());
  auto stats = ppool->stats();
  // Either the pull still borrows the blocks (then none of them is free) or it already let go.
  EXPECT_EQ(stats.num_free + stats.num_borrowed, kTotal);
  if (stats.num_borrowed > 0) {
    EXPECT_FALSE(ppool->Alloc(kTotal).ok());  // a reuse attempt cannot get the borrowed slots
  }
  bool sent_failed = false;
  for (const PdStatus& s : (*producer)->Poll()) {
    sent_failed |= s.request_id == 77 && s.state == PdState::kFailed &&
                   s.reason.message() == "consumer presumed dead";
  }
  EXPECT_TRUE(sent_failed);
  // The consumer's pull ends (the link was shut down) and the slots come back, long before the
  // 60 s deadline.
  const PdStatus got = WaitEnd(**consumer, 77);
  EXPECT_EQ(got.state, PdState::kFailed);
  for (int i = 0; i < 1000 && ppool->num_free() != kTotal; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(ppool->num_free(), kTotal);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(20));
  auto reuse = ppool->Alloc(kTotal);  // now every slot is reusable
  ASSERT_TRUE(reuse.ok()) << reuse.status().ToString();
  EXPECT_TRUE((*producer)->Poll().empty());  // reported once, nothing left
}

// CANCEL CONTRACT, a pull whose last byte left: Cancel does not shut its link. The consumer, its
// ack delayed, has every block and puts the link back in its pool; its next pull reuses that link
// (seen in CI when the link was shut: an RL sampler's next version failed at once).
TEST(PdStream, CancelAfterTheLastByteLeftKeepsTheConsumersLinkUsable) {
  auto ppool = MakePool(4096, 8), cpool = MakePool(4096, 8);
  auto producer = PdProducer::Start(ppool, TestSecret(), {});
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  OfferFilled(**producer, *ppool, 51, 4, 0, 7);
  std::atomic<int> connected{0};
  PdConsumerOptions co;
  co.connect.streams = 1;
  co.connect.wrap = [&](std::unique_ptr<Stream> s, size_t) -> std::unique_ptr<Stream> {
    connected++;
    return std::make_unique<FaultyStream>(std::move(s),
                                          FaultPlan{.delay = std::chrono::milliseconds(800)});
  };
  auto consumer = PdConsumer::Create(cpool, TestSecret(), co);
  ASSERT_TRUE(consumer.ok());
  auto dst = *cpool->Alloc(4);
  const std::string tcp = (*producer)->address().ToString();
  ASSERT_TRUE((*consumer)->StartRecv(51, {{tcp, dst}}, DeadlineInMs(60000)).ok());
  auto landed = (*consumer)->Wait(51, 1, DeadlineInMs(20000));  // one group: every block
  ASSERT_TRUE(landed.ok()) << landed.status().ToString();
  // The producer's PdEnd follows its last frame at once; the consumer's ack waits 800 ms.
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  ASSERT_TRUE((*producer)->Cancel(51, Status::Cancelled("version over")).ok());
  EXPECT_EQ(WaitEnd(**consumer, 51).state, PdState::kDone);
  OfferFilled(**producer, *ppool, 52, 4, 0, 9);
  auto dst2 = *cpool->Alloc(4);
  auto again = (*consumer)->Recv(52, {{tcp, dst2}}, DeadlineInMs(20000));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->state, PdState::kDone) << again->reason.ToString();
  EXPECT_EQ(connected.load(), 1) << "the consumer had to connect anew: Cancel shut its link";
}

// CANCEL CONTRACT, same-host path: after the offer the consumer copies out of the producer's
// segment, so a cancelled request's slots stay borrowed until the consumer acknowledged; its copy
// is intact (the slots were not handed out under it).
TEST(PdStream, CancelDuringASameHostCopyKeepsTheSlotsUntilTheConsumerIsDone) {
  const std::string shm = "tpusync-pd-cancel-" + std::to_string(::getpid());
  constexpr size_t kBlock = 1 << 20, kBlocks = 6;
  auto ppool = MakePool(kBlock, kBlocks, shm), cpool = MakePool(kBlock, kBlocks);
  PdProducerOptions po;
  po.unix_path = "/tmp/" + shm + ".sock";
  auto producer = PdProducer::Start(ppool, TestSecret(), po);
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto src = *ppool->Alloc(kBlocks);
  Fill(*ppool, src, 91);
  std::vector<uint64_t> sums;
  for (BlockId b : src) sums.push_back(Checksum64(*ppool->Address(b), kBlock));
  ASSERT_TRUE((*producer)->RegisterSend(88, src, 1, DeadlineInMs(60000), sums).ok());
  ASSERT_TRUE(ppool->Free(src).ok());
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 1}});
  auto dst = *cpool->Alloc(kBlocks);
  std::atomic<bool> stop{false};
  // Cancel as soon as the offer went out: the serving thread then holds only its borrow.
  std::thread canceller([&] {
    while (!stop.load()) {
      if (ppool->stats().num_borrowed > 0) {
        EXPECT_TRUE((*producer)->Cancel(88, Status::Cancelled("cancelled mid-copy")).ok());
        // While the consumer may copy, its slots are not free.
        auto st = ppool->stats();
        EXPECT_EQ(st.num_free + st.num_borrowed, kBlocks);
        return;
      }
      std::this_thread::yield();
    }
  });
  auto got = (*consumer)->Recv(88, {{(*producer)->unix_address(), dst}}, DeadlineInMs(20000));
  stop.store(true);
  canceller.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  if (got->state == PdState::kDone) {  // the copy finished: every byte is the producer's
    EXPECT_TRUE(got->shm);
    EXPECT_EQ(got->checksums, sums);
  }
  for (int i = 0; i < 1000 && ppool->num_free() != kBlocks; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(ppool->num_free(), kBlocks);
}

// Waits (bounded, no speed assertion) until `pool` has `want` free blocks; returns the last count.
size_t WaitFree(BlockAllocator& pool, size_t want) {
  for (int i = 0; i < 2000 && pool.num_free() != want; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pool.num_free();
}

std::vector<uint8_t> Snapshot(BlockAllocator& pool, const std::vector<BlockId>& ids) {
  std::vector<uint8_t> out;
  for (BlockId b : ids) {
    const uint8_t* p = *pool.Address(b);
    out.insert(out.end(), p, p + pool.block_bytes());
  }
  return out;
}

// ABANDON CONTRACT over TCP: a consumer gives up mid-transfer (a slow link: 150 ms per frame).
// Its receive fails at once with its reason, its destination borrow is returned and nothing is
// written after Abandon returned; the producer ends the send as released and its blocks go back
// to the free list long before the 60 s deadline.
TEST(PdStream, AbandonMidTransferFreesTheProducersBlocksOverTcp) {
  constexpr size_t kBlock = 256 << 10, kBlocks = 8, kTotal = 12;
  auto ppool = MakePool(kBlock, kTotal), cpool = MakePool(kBlock, kBlocks);
  auto producer = PdProducer::Start(ppool, TestSecret(),
                                    {.server = SlowFrames(std::chrono::milliseconds(150))});
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  OfferFilled(**producer, *ppool, 61, kBlocks, 1, 17);
  EXPECT_EQ(ppool->num_free(), kTotal - kBlocks);
  auto consumer =
      PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 2}, .small_pull_bytes = 0});
  auto dst = *cpool->Alloc(kBlocks);
  const std::string peer = (*producer)->address().ToString();
  ASSERT_TRUE((*consumer)->StartRecv(61, {{peer, dst}}, DeadlineInMs(60000)).ok());
  auto first = (*consumer)->Wait(61, 1, DeadlineInMs(20000));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->state, PdState::kPending);  // 7 more frames, 150 ms apart per stream

  auto released = (*consumer)->Abandon(61, Status::Cancelled("decode request aborted"));
  ASSERT_TRUE(released.ok()) << released.status().ToString();
  ASSERT_EQ(released->size(), 1u);
  EXPECT_EQ((*released)[0].peer, peer);
  EXPECT_TRUE((*released)[0].status.ok()) << (*released)[0].status.ToString();
  EXPECT_EQ(cpool->stats().num_borrowed, 0u);  // the destination borrow is back
  const auto after = Snapshot(*cpool, dst);
  // The consumer reports it once, failed with the reason.
  auto polled = (*consumer)->Poll();
  ASSERT_EQ(polled.size(), 1u);
  EXPECT_EQ(polled[0].state, PdState::kFailed);
  EXPECT_EQ(polled[0].reason.code(), StatusCode::kCancelled);
  EXPECT_EQ(polled[0].reason.message(), "decode request aborted");
  EXPECT_TRUE((*consumer)->Poll().empty());
  // The producer ended the send as released and dropped its reference (no 60 s wait).
  const PdStatus sent = ProducerEnd(**producer, 61);
  EXPECT_EQ(sent.state, PdState::kFailed);
  EXPECT_EQ(sent.reason.code(), StatusCode::kCancelled);
  EXPECT_NE(sent.reason.message().find("released by consumer"), std::string::npos)
      << sent.reason.ToString();
  EXPECT_NE(sent.reason.message().find("decode request aborted"), std::string::npos);
  EXPECT_EQ(WaitFree(*ppool, kTotal), kTotal);
  EXPECT_EQ((*producer)->pending(), 0u);
  // Frames were still due (150 ms apart): none of them reached the abandoned blocks.
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_EQ(Snapshot(*cpool, dst), after);
  // A second Abandon has nothing left to end.
  EXPECT_EQ((*consumer)->Abandon(61, Status::Cancelled("again")).status().code(),
            StatusCode::kNotFound);
}

// ABANDON CONTRACT on the same-host path: the producer keeps a failed receipt's blocks for a
// retry (COMPLETION CONTRACT) until the consumer abandons it; the release travels on the Unix
// socket and frees them at once.
TEST(PdStream, AbandonAfterAFailedReceiptFreesTheProducersBlocksOnTheSameHostPath) {
  const std::string shm = "tpusync-pd-abandon-" + std::to_string(::getpid());
  constexpr size_t kBlock = 64 << 10, kBlocks = 6, kTotal = 8;
  auto ppool = MakePool(kBlock, kTotal, shm), cpool = MakePool(kBlock, kBlocks);
  PdProducerOptions po;
  po.unix_path = "/tmp/" + shm + ".sock";
  auto producer = PdProducer::Start(ppool, TestSecret(), po);
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  OfferFilled(**producer, *ppool, 62, kBlocks, 2, 5);
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  const std::string peer = (*producer)->unix_address();
  // A receipt that fails (the consumer expects one block fewer): the producer keeps the blocks.
  auto dst = *cpool->Alloc(kBlocks - 1);
  ASSERT_TRUE((*consumer)->StartRecv(62, {{peer, dst}}, DeadlineInMs(60000)).ok());
  const PdStatus failed = WaitEnd(**consumer, 62);  // Wait does not forget it; Poll would
  ASSERT_EQ(failed.state, PdState::kFailed);
  EXPECT_EQ(failed.reason.code(), StatusCode::kInvalidArgument) << failed.reason.ToString();
  EXPECT_EQ((*producer)->pending(), 1u);
  EXPECT_EQ(ppool->num_free(), kTotal - kBlocks);
  // The consumer will not retry: it says so.
  auto released = (*consumer)->Abandon(62, Status::Unavailable("decode worker shutting down"));
  ASSERT_TRUE(released.ok()) << released.status().ToString();
  ASSERT_EQ(released->size(), 1u);
  EXPECT_TRUE((*released)[0].status.ok()) << (*released)[0].status.ToString();
  const PdStatus sent = ProducerEnd(**producer, 62);
  EXPECT_EQ(sent.state, PdState::kFailed);
  EXPECT_EQ(sent.reason.code(), StatusCode::kUnavailable) << sent.reason.ToString();
  EXPECT_EQ(WaitFree(*ppool, kTotal), kTotal);
  // The earlier failure stays the request's reason (it happened first).
  auto polled = (*consumer)->Poll();
  ASSERT_EQ(polled.size(), 1u);
  EXPECT_EQ(polled[0].reason.code(), StatusCode::kInvalidArgument);

  // Mid-transfer on the same-host path (the offer is delayed 300 ms): the release frees the
  // blocks whichever way the race with the offer goes.
  po.server = SlowFrames(std::chrono::milliseconds(300));
  po.unix_path = "/tmp/" + shm + "-slow.sock";
  auto slow = PdProducer::Start(ppool, TestSecret(), po);
  ASSERT_TRUE(slow.ok()) << slow.status().ToString();
  auto src2 = *ppool->Alloc(kBlocks);
  ASSERT_TRUE((*slow)->RegisterSend(63, src2, 1, DeadlineInMs(60000)).ok());
  ASSERT_TRUE(ppool->Free(src2).ok());
  ASSERT_TRUE(cpool->Free(dst).ok());
  auto dst2 = *cpool->Alloc(kBlocks);
  ASSERT_TRUE(
      (*consumer)->StartRecv(63, {{(*slow)->unix_address(), dst2}}, DeadlineInMs(60000)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto released2 = (*consumer)->Abandon(63, Status::Cancelled("aborted"));
  ASSERT_TRUE(released2.ok()) << released2.status().ToString();
  ASSERT_EQ(released2->size(), 1u);
  EXPECT_TRUE((*released2)[0].status.ok()) << (*released2)[0].status.ToString();
  EXPECT_EQ(ProducerEnd(**slow, 63).state, PdState::kFailed);
  EXPECT_EQ(WaitFree(*ppool, kTotal), kTotal);
}

// ABANDON CONTRACT, refusals: an OK reason, an unknown request, a completed one; on the producer
// side a malformed or unknown release is refused on a link that stays usable and loses nothing.
TEST(PdStream, AbandonAndReleaseRefuseBadInputAndLoseNothing) {
  auto ppool = MakePool(4096, 8), cpool = MakePool(4096, 8);
  auto producer = PdProducer::Start(ppool, TestSecret(), {});
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  const std::string peer = (*producer)->address().ToString();
  EXPECT_EQ((*consumer)->Abandon(5, Status::Cancelled("x")).status().code(), StatusCode::kNotFound);
  EXPECT_EQ((*consumer)->Abandon(5, Status::OK()).status().code(), StatusCode::kInvalidArgument);
  // A completed receive: nothing to abandon, and it is still reported done.
  auto src = *ppool->Alloc(2);
  Fill(*ppool, src, 1);
  ASSERT_TRUE((*producer)->RegisterSend(6, src, 0, DeadlineInMs(20000)).ok());
  auto dst = *cpool->Alloc(2);
  ASSERT_TRUE((*consumer)->StartRecv(6, {{peer, dst}}, DeadlineInMs(20000)).ok());
  ASSERT_EQ(WaitEnd(**consumer, 6).state, PdState::kDone);
  EXPECT_EQ((*consumer)->Abandon(6, Status::Cancelled("late")).status().code(),
            StatusCode::kFailedPrecondition);
  auto polled = (*consumer)->Poll();
  ASSERT_EQ(polled.size(), 1u);
  EXPECT_EQ(polled[0].state, PdState::kDone);
  // The producer ends 6 when the consumer's ack reaches it, which may be after the consumer
  // reported done: wait for it, so 7 below is the only request left.
  ASSERT_EQ(ProducerEnd(**producer, 6).state, PdState::kDone);

  // Producer side, raw frames on one authenticated link.
  ASSERT_TRUE((*producer)->RegisterSend(7, src, 0, DeadlineInMs(20000)).ok());
  ASSERT_TRUE(ppool->Free(src).ok());  // only the producer's reference is left
  LinkPool links(TestSecret(), {.streams = 1});
  auto link = links.Acquire(*ParseAddress(peer), DeadlineInMs(5000));
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  Stream& s = *(*link)->streams[0];
  auto ask = [&](uint64_t id, std::vector<uint8_t> meta) -> Status {
    Status sent = s.SendMeta(Op::kPdRelease, id, meta, DeadlineInMs(5000));
    if (!sent.ok()) return sent;
    auto reply = s.Expect(Op::kPdReleased, DeadlineInMs(5000));
    if (!reply.ok()) return Status::Internal("no reply: " + reply.status().ToString());
    EXPECT_EQ(reply->header.request_id, id);
    return DecodeStatus(reply->meta);
  };
  EXPECT_EQ(ask(7, {0xFF, 1, 2}).code(), StatusCode::kInvalidArgument);                // malformed
  EXPECT_EQ(ask(7, EncodeStatus(Status::OK())).code(), StatusCode::kInvalidArgument);  // no reason
  EXPECT_EQ(ask(99, EncodeStatus(Status::Cancelled("x"))).code(), StatusCode::kNotFound);
  EXPECT_EQ((*producer)->pending(), 1u);  // nothing lost
  EXPECT_EQ(ppool->num_free(), 6u);       // 7 still holds its 2 blocks
  EXPECT_TRUE(ask(7, EncodeStatus(Status::Cancelled("gone"))).ok());
  EXPECT_EQ((*producer)->pending(), 0u);
  EXPECT_EQ(ppool->num_free(), 8u);  // dropped at once (no pull was in flight)
  EXPECT_EQ(ask(7, EncodeStatus(Status::Cancelled("gone"))).code(), StatusCode::kNotFound);
  // The link served a pull-less exchange only; the request stays consumable as a failed one.
  bool reported = false;
  for (const PdStatus& st : (*producer)->Poll()) {
    reported |= st.request_id == 7 && st.state == PdState::kFailed &&
                st.reason.message().find("gone") != std::string::npos;
  }
  EXPECT_TRUE(reported);
}

// ABANDON CONTRACT, racing a completing receive: either Abandon wins (the request fails with its
// reason) or the receive completed first (kFailedPrecondition, reported done); either way no
// destination byte changes after Abandon returned and the producer's blocks all come back.
TEST(PdStream, AbandonRacingACompletingReceiveNeverWritesAfterItReturns) {
  constexpr size_t kBlock = 64 << 10, kBlocks = 16;
  auto ppool = MakePool(kBlock, kBlocks * 2), cpool = MakePool(kBlock, kBlocks);
  auto producer = PdProducer::Start(ppool, TestSecret(), {});
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  const std::string peer = (*producer)->address().ToString();
  auto dst = *cpool->Alloc(kBlocks);
  int abandoned = 0, completed = 0;
  for (uint64_t id = 1000; id < 1040; ++id) {
    auto src = *ppool->Alloc(kBlocks);
    Fill(*ppool, src, static_cast<uint8_t>(id));
    ASSERT_TRUE((*producer)->RegisterSend(id, src, 1, DeadlineInMs(60000)).ok());
    ASSERT_TRUE(ppool->Free(src).ok());
    for (BlockId b : dst) std::memset(*cpool->Address(b), 0, kBlock);
    ASSERT_TRUE((*consumer)->StartRecv(id, {{peer, dst}}, DeadlineInMs(60000)).ok());
    // Spread the abandon over the transfer.
    const auto until = Clock::now() + std::chrono::microseconds((id % 5) * 150);
    while (Clock::now() < until) std::this_thread::yield();
    auto r = (*consumer)->Abandon(id, Status::Cancelled("raced"));
    const auto frozen = Snapshot(*cpool, dst);
    if (r.ok()) {
      ++abandoned;
      ASSERT_EQ(r->size(), 1u);
      const Status& told = (*r)[0].status;
      EXPECT_TRUE(told.ok() || told.code() == StatusCode::kNotFound) << told.ToString();
      EXPECT_EQ(cpool->stats().num_borrowed, 0u);
      bool failed = false;
      for (const PdStatus& st : (*consumer)->Poll()) {
        failed |= st.request_id == id && st.state == PdState::kFailed;
      }
      EXPECT_TRUE(failed);
    } else {
      ++completed;
      ASSERT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
      EXPECT_EQ(WaitEnd(**consumer, id).state, PdState::kDone);
      (void)(*consumer)->Poll();
    }
    (void)ProducerEnd(**producer, id);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_EQ(Snapshot(*cpool, dst), frozen) << "request " << id << " written after Abandon";
    ASSERT_EQ(WaitFree(*ppool, kBlocks * 2), kBlocks * 2) << "request " << id;
  }
  EXPECT_EQ(abandoned + completed, 40);
  std::printf("abandon race: %d abandoned, %d completed first\n", abandoned, completed);
}

// ---------------------------------------------------------------------------------------- relays
// RELAY CONTRACT: a send registered before its blocks exist, fed block by block as a receive
// lands them, so the next hop starts while the bucket is still on the wire.

std::vector<uint64_t> SumsOf(BlockAllocator& pool, const std::vector<BlockId>& ids) {
  std::vector<uint64_t> sums;
  for (BlockId b : ids) sums.push_back(Checksum64(*pool.Address(b), pool.block_bytes()));
  return sums;
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
  Fill(*opool, src, 5);
  const auto sums = SumsOf(*opool, src);
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
  Fill(*pool, blocks, 9);
  const auto sums = SumsOf(*pool, blocks);
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
  Fill(*pool, a, 1);
  Fill(*pool, b, 100);
  const auto sa = SumsOf(*pool, a), sb = SumsOf(*pool, b);

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
  Fill(*pool, blocks, 42);
  const auto sums = SumsOf(*pool, blocks);
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

namespace tpusync::transport {
namespace {

// FAIL-FAST CONTRACT: source 1 fails at once (its producer registered 2 blocks, it is asked for
// 3); source 2 waits for a registration that comes only later. Before, the request read failed at
// once but source 2 kept waiting (up to the producer's max_pull_wait, 10 s) and then wrote its
// destination blocks. Now its link is closed, the request ends (and is reported once) when no
// source writes any more, and registering source 2 afterwards writes nothing.
TEST(PdStream, TheFirstFailedSourceStopsTheOthersBeforeTheRequestIsReported) {
  auto p1pool = MakePool(4096, 8), p2pool = MakePool(4096, 8), cpool = MakePool(4096, 16);
  auto p1 = PdProducer::Start(p1pool, TestSecret(), {});
  auto p2 = PdProducer::Start(p2pool, TestSecret(), {});
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  auto d = *cpool->Alloc(5);
  std::memset(*cpool->Address(d[3]), 0xEE, cpool->block_bytes());
  std::memset(*cpool->Address(d[4]), 0xEE, cpool->block_bytes());
  std::vector<BlockId> d1(d.begin(), d.begin() + 3), d2(d.begin() + 3, d.end());
  OfferFilled(**p1, *p1pool, 7, 2, 0, 1);
  ASSERT_TRUE(
      (*consumer)
          ->StartRecv(7, {{(*p1)->address().ToString(), d1}, {(*p2)->address().ToString(), d2}},
                      DeadlineInMs(30000))
          .ok());
  auto got = (*consumer)->Wait(7, UINT32_MAX, DeadlineInMs(5000));
  ASSERT_TRUE(got.ok()) << got.status().ToString();  // well before source 2's 10 s wait
  EXPECT_EQ(got->state, PdState::kFailed);
  EXPECT_EQ(got->reason.code(), StatusCode::kInvalidArgument) << got->reason.ToString();
  size_t reported = 0;
  for (auto& s : (*consumer)->Poll()) reported += s.request_id == 7;
  EXPECT_EQ(reported, 1u);
  EXPECT_TRUE((*consumer)->Poll().empty());  // reported once
  OfferFilled(**p2, *p2pool, 7, 2, 0, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (BlockId b : d2) EXPECT_EQ((*cpool->Address(b))[0], 0xEE) << "block " << b << " written";
}

// DESTINATION CONTRACT: a receive into a block another live receive writes is refused; once that
// receive ended, the block may be received into again.
TEST(PdStream, TwoLiveReceivesNeverShareADestinationBlock) {
  auto ppool = MakePool(4096, 8), cpool = MakePool(4096, 8);
  auto producer = PdProducer::Start(ppool, TestSecret(), {});
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {});
  const std::string peer = (*producer)->address().ToString();
  auto d = *cpool->Alloc(3);
  ASSERT_TRUE((*consumer)->StartRecv(1, {{peer, {d[0], d[1]}}}, DeadlineInMs(30000)).ok());
  const Status second = (*consumer)->StartRecv(2, {{peer, {d[1], d[2]}}}, DeadlineInMs(30000));
  EXPECT_EQ(second.code(), StatusCode::kInvalidArgument) << second.ToString();
  EXPECT_NE(second.message().find("already being received by request 1"), std::string::npos);
  OfferFilled(**producer, *ppool, 1, 2, 0, 3);
  EXPECT_EQ(WaitEnd(**consumer, 1).state, PdState::kDone);
  (void)(*consumer)->Poll();
  OfferFilled(**producer, *ppool, 2, 2, 0, 4);
  ASSERT_TRUE((*consumer)->StartRecv(2, {{peer, {d[1], d[2]}}}, DeadlineInMs(30000)).ok());
  EXPECT_EQ(WaitEnd(**consumer, 2).state, PdState::kDone);
}

// SAME-HOST HOLD: a same-host consumer reads the slots straight out of the producer's segment, so
// they stay borrowed past the send's deadline and past a Cancel until it acknowledged or its
// socket closed. Before, both let go at once: a slow consumer then copied (and published as
// ready) blocks the producer's application had already refilled. The consumer here is a bare
// link that takes the offer and never answers.
TEST(PdStream, SameHostSlotsStayBorrowedUntilTheConsumerIsGone) {
  const std::string shm = "tpusync-pd-hold-" + std::to_string(::getpid());
  auto ppool = MakePool(4096, 4, shm);
  PdProducerOptions po;
  po.unix_path = "/tmp/" + shm + ".sock";
  auto producer = PdProducer::Start(ppool, TestSecret(), po);
  ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  for (bool cancel : {false, true}) {
    const uint64_t id = cancel ? 2 : 1;
    auto src = *ppool->Alloc(2);
    ASSERT_TRUE((*producer)->RegisterSend(id, src, 0, DeadlineInMs(cancel ? 60000 : 300)).ok());
    ASSERT_TRUE(ppool->Free(src).ok());
    auto link =
        ConnectLink(*ParseAddress((*producer)->unix_address()), TestSecret(), {.streams = 1});
    ASSERT_TRUE(link.ok()) << link.status().ToString();
    MetaWriter w;
    w.U32(2).U64(4096).U32(60000).U8(1);  // 2 blocks of 4096 bytes, 60 s, same-host copy ok
    ASSERT_TRUE((*link)->streams[0]->SendMeta(Op::kPdPull, id, w.bytes(), DeadlineInMs(5000)).ok());
    auto offer = (*link)->streams[0]->RecvHead(DeadlineInMs(5000));
    ASSERT_TRUE(offer.ok()) << offer.status().ToString();
    ASSERT_EQ(offer->op(), Op::kPdShmOffer);
    if (cancel) {
      ASSERT_TRUE((*producer)->Cancel(id, Status::Cancelled("given up")).ok());
    } else {
      EXPECT_EQ(ProducerEnd(**producer, id).reason.code(), StatusCode::kTimeout);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    // The registration ended; the consumer may still be reading: its slots are not free.
    EXPECT_EQ(ppool->num_free(), 2u) << (cancel ? "after a cancel" : "past the deadline");
    (*link)->Close();
    link->reset();
    EXPECT_EQ(WaitFree(*ppool, 4), 4u);
  }
}

// MAPPING CACHE: the segment of a producer that exited is unmapped once no receive uses it and a
// new segment is mapped; before, each restarted producer's whole pool stayed mapped for good.
TEST(PdStream, TheSegmentOfAGoneProducerIsUnmapped) {
  auto cpool = MakePool(4096, 4);
  auto consumer = PdConsumer::Create(cpool, TestSecret(), {.connect = {.streams = 1}});
  auto dst = *cpool->Alloc(1);
  for (int gen = 0; gen < 3; ++gen) {
    const std::string shm =
        "tpusync-pd-gen-" + std::to_string(::getpid()) + "-" + std::to_string(gen);
    {
      auto ppool = MakePool(4096, 4, shm);
      PdProducerOptions po;
      po.unix_path = "/tmp/" + shm + ".sock";
      auto producer = PdProducer::Start(ppool, TestSecret(), po);
      ASSERT_TRUE(producer.ok()) << producer.status().ToString();
      OfferFilled(**producer, *ppool, 1, 1, 0, static_cast<uint8_t>(gen));
      auto got = (*consumer)->Recv(1, {{(*producer)->unix_address(), dst}}, DeadlineInMs(10000));
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ASSERT_EQ(got->state, PdState::kDone) << got->reason.ToString();
      EXPECT_TRUE(got->shm);
      EXPECT_EQ((*consumer)->mapped_segments(), 1u) << "generation " << gen;
    }  // the producer and its pool (and so its segment) are gone
  }
}
}  // namespace
}  // namespace tpusync::transport
