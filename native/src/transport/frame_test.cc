#include "tpusync/transport/frame.h"

#include <gtest/gtest.h>

#include "tpusync/base/checksum.h"
#include "tpusync/transport/fault_stream.h"

namespace tpusync::transport {
namespace {

std::vector<uint8_t> OneFrame(std::vector<uint8_t>* payload = nullptr) {
  static std::vector<uint8_t> block_a(4096, 0xab), block_b(4096, 0xcd);
  const uint8_t* blocks[] = {block_a.data(), block_b.data()};
  const std::vector<uint8_t> meta = {1, 2, 3, 4};
  OutFrame f;
  f.op = Op::kPdData;
  f.request_id = 77;
  f.meta = meta;
  f.block_bytes = 4096;
  f.blocks = blocks;
  return SerializeFrame(f);
}

TEST(Frame, RoundTripsHeaderMetaAndPayload) {
  const auto bytes = OneFrame();
  ASSERT_EQ(bytes.size(), kHeaderBytes + 4 + 16 + 8192);
  InFrame f;
  ASSERT_TRUE(ParseFrameBytes(bytes, &f).ok());
  EXPECT_EQ(f.op(), Op::kPdData);
  EXPECT_EQ(f.header.request_id, 77u);
  EXPECT_EQ(f.header.num_blocks, 2u);
  EXPECT_EQ(f.header.block_bytes, 4096u);
  EXPECT_EQ(f.meta, (std::vector<uint8_t>{1, 2, 3, 4}));
}

TEST(Frame, UnknownVersionIsRefusedWithVersionMismatch) {
  auto bytes = OneFrame();
  bytes[4] = 9;  // version 9
  auto h = ParseHeader(bytes);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kVersionMismatch);
  EXPECT_NE(h.status().message().find("version 9"), std::string::npos);
}

TEST(Frame, BadMagicAndDamagedHeaderAreCorrupted) {
  auto bytes = OneFrame();
  bytes[0] ^= 1;
  EXPECT_EQ(ParseHeader(bytes).status().code(), StatusCode::kCorrupted);
  bytes = OneFrame();
  bytes[9] ^= 1;  // request id, covered by the header checksum
  EXPECT_EQ(ParseHeader(bytes).status().code(), StatusCode::kCorrupted);
  EXPECT_EQ(ParseHeader(std::span(bytes).first(10)).status().code(), StatusCode::kCorrupted);
}

TEST(Frame, LimitsAndUnknownOpsAreRefusedBeforeAnyAllocation) {
  auto forge = [](auto mutate) {
    FrameHeader h;
    h.op = static_cast<uint8_t>(Op::kPdData);
    h.num_blocks = 1;
    h.block_bytes = 64;
    mutate(h);
    auto raw = EncodeHeader(h, {});
    // EncodeHeader fixes meta_bytes from the meta span: patch it back, re-seal the checksum.
    FrameHeader g;
    std::memcpy(&g, raw.data(), kHeaderBytes);
    mutate(g);
    g.header_checksum = Checksum64(&g, offsetof(FrameHeader, header_checksum));
    std::memcpy(raw.data(), &g, kHeaderBytes);
    return ParseHeader(raw).status();
  };
  EXPECT_EQ(forge([](FrameHeader& h) { h.meta_bytes = kMaxMetaBytes + 1; }).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(forge([](FrameHeader& h) { h.num_blocks = kMaxBlocksPerFrame + 1; }).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(forge([](FrameHeader& h) { h.block_bytes = kMaxBlockBytes + 1; }).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(forge([](FrameHeader& h) { h.block_bytes = 0; }).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(forge([](FrameHeader& h) { h.op = 200; }).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(forge([](FrameHeader&) {}).ok());
}

TEST(Frame, CorruptPayloadAndMetaAreDetected) {
  auto bytes = OneFrame();
  bytes.back() ^= 0x10;  // last payload byte
  EXPECT_EQ(ParseFrameBytes(bytes).code(), StatusCode::kCorrupted);
  bytes = OneFrame();
  bytes[kHeaderBytes] ^= 0x10;  // first metadata byte
  EXPECT_EQ(ParseFrameBytes(bytes).code(), StatusCode::kCorrupted);
  bytes = OneFrame();
  bytes.resize(bytes.size() - 1);  // truncated payload
  EXPECT_EQ(ParseFrameBytes(bytes).code(), StatusCode::kCorrupted);
}

TEST(Frame, MemoryStreamReportsCorruptBlockButStaysUsable) {
  auto bytes = OneFrame();
  bytes[kHeaderBytes + 4 + 16 + 5] ^= 1;  // first block's payload
  const auto good = OneFrame();
  bytes.insert(bytes.end(), good.begin(), good.end());
  MemoryStream s(bytes);
  std::vector<uint8_t> a(4096), b(4096);
  uint8_t* dst[] = {a.data(), b.data()};
  auto f = s.RecvHead(DeadlineInMs(100));
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(s.RecvBlocks(*f, dst, DeadlineInMs(100)).code(), StatusCode::kCorrupted);
  auto g = s.RecvHead(DeadlineInMs(100));
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(s.RecvBlocks(*g, dst, DeadlineInMs(100)).ok());
  EXPECT_EQ(a[0], 0xab);
  EXPECT_EQ(b[4095], 0xcd);
}

TEST(Frame, MetaReaderRefusesTruncationAndOversizeStrings) {
  MetaWriter w;
  w.U32(5).Str("hello");
  MetaReader r(w.bytes());
  EXPECT_EQ(*r.U32(), 5u);
  EXPECT_EQ(*r.Str(), "hello");
  EXPECT_TRUE(r.ExpectEnd().ok());
  EXPECT_EQ(r.U8().status().code(), StatusCode::kInvalidArgument);
  MetaWriter big;
  big.U32(1u << 30);
  MetaReader r2(big.bytes());
  EXPECT_EQ(r2.Str().status().code(), StatusCode::kInvalidArgument);
}

TEST(Frame, StatusRoundTripsAndUnknownCodesAreRefused) {
  const Status s = DecodeStatus(EncodeStatus(Status::NotFound("no such request")));
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("no such request"), std::string::npos);
  EXPECT_TRUE(DecodeStatus(EncodeStatus(Status::OK())).ok());
  std::vector<uint8_t> bad = {99, 0, 0, 0, 0};
  EXPECT_EQ(DecodeStatus(bad).code(), StatusCode::kInvalidArgument);
}

// The strict decoder (kPdRelease): a malformed status is an error of its own, never mistaken
// for the status the peer meant to send.
TEST(Frame, ParseStatusTellsMalformedMetadataFromACarriedFailure) {
  Status got = Status::Internal("untouched");
  ASSERT_TRUE(ParseStatus(EncodeStatus(Status::Cancelled("aborted")), &got).ok());
  EXPECT_EQ(got.code(), StatusCode::kCancelled);
  EXPECT_EQ(got.message(), "aborted");  // as sent: no "peer: " prefix
  ASSERT_TRUE(ParseStatus(EncodeStatus(Status::OK()), &got).ok());
  EXPECT_TRUE(got.ok());
  got = Status::Internal("untouched");
  for (std::vector<uint8_t> bad :
       {std::vector<uint8_t>{}, std::vector<uint8_t>{99, 0, 0, 0, 0},
        std::vector<uint8_t>{7, 5, 0, 0, 0, 'a'}, std::vector<uint8_t>{7, 0, 0, 0, 0, 'x'}}) {
    EXPECT_EQ(ParseStatus(bad, &got).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(got.code(), StatusCode::kInternal);  // *out untouched on a refusal
  }
  EXPECT_TRUE(IsKnownOp(static_cast<uint8_t>(Op::kPdRelease)));
  EXPECT_TRUE(IsKnownOp(static_cast<uint8_t>(Op::kPdReleased)));
  EXPECT_FALSE(IsKnownOp(23));
  EXPECT_EQ(OpName(Op::kPdRelease), "PdRelease");
  EXPECT_EQ(OpName(Op::kPdReleased), "PdReleased");
}

}  // namespace
}  // namespace tpusync::transport
