// SocketStream's receive path (VERIFY-WHILE-WARM, stream.cc): payloads are read and verified in
// pieces of kVerifyPieceBytes. These tests feed hand-built frames through a socket pair in odd
// chunks, so reads end at arbitrary places inside and across pieces and blocks.
#include "tpusync/transport/stream.h"

#include <sys/socket.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "tpusync/base/checksum.h"

namespace tpusync::transport {
namespace {

constexpr uint64_t kPiece = SocketStream::kVerifyPieceBytes;

// The bytes of one PdData-like frame: header, no metadata, the checksums of the intact blocks,
// then the payload - with byte `damage_at` of block `damage_block` flipped when given.
std::vector<uint8_t> FrameBytes(const std::vector<std::vector<uint8_t>>& blocks,
                                int damage_block = -1, uint64_t damage_at = 0) {
  FrameHeader h;
  h.op = static_cast<uint8_t>(Op::kPdData);
  h.request_id = 9;
  h.num_blocks = static_cast<uint32_t>(blocks.size());
  h.block_bytes = blocks.empty() ? 0 : blocks[0].size();
  const auto head = EncodeHeader(h, {});
  std::vector<uint8_t> out(head.begin(), head.end());
  for (const auto& b : blocks) {
    const uint64_t sum = Checksum64(b.data(), b.size());
    const auto* p = reinterpret_cast<const uint8_t*>(&sum);
    out.insert(out.end(), p, p + sizeof(sum));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    const size_t at = out.size();
    out.insert(out.end(), blocks[i].begin(), blocks[i].end());
    if (static_cast<int>(i) == damage_block) out[at + damage_at] ^= 0x5a;
  }
  return out;
}

std::vector<std::vector<uint8_t>> RandomBlocks(size_t n, size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<uint8_t>> out(n, std::vector<uint8_t>(bytes));
  for (auto& b : out) {
    for (auto& x : b) x = static_cast<uint8_t>(rng());
  }
  return out;
}

// A connected pair: `reader` is a non-blocking SocketStream (as links configure them), `writer`
// the raw other end.
struct Pair {
  Pair() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    EXPECT_TRUE(ConfigureSocket(sv[0], true, {}).ok());
    reader = std::make_unique<SocketStream>(Fd(sv[0]), "pair");
    writer = Fd(sv[1]);
  }
  std::unique_ptr<SocketStream> reader;
  Fd writer;
};

// Writes `bytes` in chunks of `chunk` with a short pause between them (so the reader waits in
// the middle of pieces), then closes the writer when `close_after` is set.
std::thread Dribble(Pair& p, std::vector<uint8_t> bytes, size_t chunk, bool close_after) {
  return std::thread([&p, bytes = std::move(bytes), chunk, close_after] {
    for (size_t off = 0; off < bytes.size(); off += chunk) {
      const size_t n = std::min(chunk, bytes.size() - off);
      ASSERT_TRUE(WriteAll(p.writer.get(), bytes.data() + off, n, DeadlineInMs(10000)).ok());
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (close_after) p.writer.Reset();
  });
}

Status Receive(Pair& p, std::vector<std::vector<uint8_t>>& dst_bufs) {
  auto f = p.reader->RecvHead(DeadlineInMs(10000));
  if (!f.ok()) return f.status();
  std::vector<uint8_t*> dst;
  for (auto& b : dst_bufs) dst.push_back(b.data());
  return p.reader->RecvBlocks(*f, dst, DeadlineInMs(10000));
}

// Blocks larger than a piece (not a multiple of it) and blocks smaller than one (several to a
// read), each delivered in chunks that end at odd places: every byte lands, the checksums pass.
TEST(SocketStreamRecv, PiecesAreExactAcrossShortReads) {
  struct Case {
    size_t blocks, bytes, chunk;
  };
  for (const Case c : {Case{3, 3 * kPiece + 5, 100003}, Case{2, kPiece, 4099}, Case{200, 4096, 777},
                       Case{5, kPiece - 1, 65537}}) {
    Pair p;
    const auto blocks = RandomBlocks(c.blocks, c.bytes, static_cast<uint32_t>(c.chunk));
    std::thread w = Dribble(p, FrameBytes(blocks), c.chunk, false);
    std::vector<std::vector<uint8_t>> got(c.blocks, std::vector<uint8_t>(c.bytes));
    const Status s = Receive(p, got);
    w.join();
    ASSERT_TRUE(s.ok()) << s.ToString() << " (" << c.blocks << " x " << c.bytes << ")";
    EXPECT_EQ(got, blocks);
    EXPECT_FALSE(p.reader->broken());
  }
}

// One flipped byte anywhere in a multi-piece block - the first byte, the last byte of a piece,
// the first of the next, the last of the block - is refused as kCorrupted naming that block; the
// stream stays in step (the next frame is read intact) and is not marked broken.
TEST(SocketStreamRecv, DamageInsideAnyPieceIsRefusedAndTheStreamStaysInStep) {
  const size_t bytes = 2 * kPiece + 4097;
  for (uint64_t at : {uint64_t{0}, kPiece - 1, kPiece, 2 * kPiece + 10, uint64_t{bytes - 1}}) {
    Pair p;
    const auto blocks = RandomBlocks(3, bytes, static_cast<uint32_t>(at));
    auto wire = FrameBytes(blocks, 1, at);
    const auto next = FrameBytes(RandomBlocks(1, 1000, 3));
    wire.insert(wire.end(), next.begin(), next.end());
    std::thread w = Dribble(p, std::move(wire), 300007, false);
    std::vector<std::vector<uint8_t>> got(3, std::vector<uint8_t>(bytes));
    const Status s = Receive(p, got);
    EXPECT_EQ(s.code(), StatusCode::kCorrupted) << "damage at " << at << ": " << s.ToString();
    EXPECT_NE(s.message().find("block 1 "), std::string::npos) << s.message();
    EXPECT_FALSE(p.reader->broken());
    std::vector<std::vector<uint8_t>> after(1, std::vector<uint8_t>(1000));
    EXPECT_TRUE(Receive(p, after).ok()) << "the stream is out of step after damage at " << at;
    EXPECT_EQ(after, RandomBlocks(1, 1000, 3));
    w.join();
  }
  // Small blocks (the batched path): damage in the middle of a batch.
  Pair p;
  const auto blocks = RandomBlocks(100, 4096, 8);
  std::thread w = Dribble(p, FrameBytes(blocks, 70, 4095), 5000, false);
  std::vector<std::vector<uint8_t>> got(100, std::vector<uint8_t>(4096));
  const Status s = Receive(p, got);
  w.join();
  EXPECT_EQ(s.code(), StatusCode::kCorrupted);
  EXPECT_NE(s.message().find("block 70 "), std::string::npos) << s.message();
}

// A peer that closes in the middle of a piece: a clean kUnavailable, the stream marked broken.
TEST(SocketStreamRecv, TruncatedInsideAPieceFailsCleanly) {
  Pair p;
  const auto blocks = RandomBlocks(2, 2 * kPiece, 4);
  auto wire = FrameBytes(blocks);
  wire.resize(wire.size() - kPiece - kPiece / 2);  // stops half-way through a piece of block 1
  std::thread w = Dribble(p, std::move(wire), 65536, true);
  std::vector<std::vector<uint8_t>> got(2, std::vector<uint8_t>(2 * kPiece));
  const Status s = Receive(p, got);
  w.join();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_TRUE(p.reader->broken());
}

}  // namespace
}  // namespace tpusync::transport
