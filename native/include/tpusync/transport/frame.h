// The tpusync wire frame: a fixed 48-byte header, then metadata, then one XXH3 checksum per
// payload block, then the payload blocks themselves.
//
//   offset size field
//        0    4 magic          "TSYN" (0x4E595354 little-endian)
//        4    2 version        kWireVersion; any other value is refused with kVersionMismatch
//        6    1 op             Op below; unknown values are refused (kInvalidArgument)
//        7    1 flags          op-specific bits
//        8    8 request_id     caller's id, echoed in replies
//       16    4 meta_bytes     <= kMaxMetaBytes
//       20    4 num_blocks     <= kMaxBlocksPerFrame
//       24    8 block_bytes    bytes per payload block, <= kMaxBlockBytes (0 iff num_blocks == 0)
//       32    8 meta_checksum  Checksum64(meta)
//       40    8 header_checksum Checksum64(bytes 0..39)
//   48 + meta_bytes + 8 * num_blocks + num_blocks * block_bytes = frame size
//
// All integers little-endian (static_asserted: the supported hosts are x86-64 and aarch64).
//
// FRAME CONTRACT: a header is trusted only after magic, version, header checksum and every limit
// check passed. The parser allocates nothing; the receiver allocates at most kMaxMetaBytes +
// 8 * kMaxBlocksPerFrame for metadata and checksums (a server, kHandshakeMetaBytes and nothing for
// checksums until a connection authenticated: HANDSHAKE LIMIT in stream.h), and payload bytes go
// only into memory the
// receiver chose for them (pool blocks) after it checked the count and size against what it
// expects. A payload block whose checksum does not match is kCorrupted and never used as data.
//
// Rejected alternative: protobuf/flatbuffers framing. It would add a dependency and a copy, and the
// payload (pool blocks written with writev straight from pool memory) must stay outside any
// serialised message anyway.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tpusync/base/status.h"

namespace tpusync::transport {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

inline constexpr uint32_t kFrameMagic = 0x4E595354;  // "TSYN"
inline constexpr uint16_t kWireVersion = 1;
inline constexpr uint32_t kMaxMetaBytes = 1u << 20;
inline constexpr uint32_t kMaxBlocksPerFrame = 1u << 16;
inline constexpr uint64_t kMaxBlockBytes = 1ull << 30;

enum class Op : uint8_t {
  kAuthChallenge = 1,  // server -> client: meta = server nonce (32 bytes)
  kAuthResponse = 2,   // client -> server: meta = client nonce (32) + HMAC (32)
  kAuthProof = 3,      // server -> client: meta = HMAC (32), mutual authentication
  kBind = 4,           // client -> server: meta = link id (8) + stream index (4) + streams (4)
  kBindOk = 5,         // server -> client
  kError = 6,          // either way: meta = status code (1) + message
  kPing = 7,
  kPong = 8,
  kPdPull = 16,       // consumer -> producer: meta = PdPull
  kPdData = 17,       // producer -> consumer: meta = PdData, payload = the blocks
  kPdEnd = 18,        // producer -> consumer, once per stream: no meta (no more data on it)
  kPdAck = 19,        // consumer -> producer: meta = status code (1) + message
  kPdShmOffer = 20,   // producer -> consumer (unix socket): meta = PdShmOffer, then an fd
  kPdRelease = 21,    // consumer -> producer: meta = status code (1) + message, never OK
  kPdReleased = 22,   // producer -> consumer: meta = status code (1) + message (OK: released)
  kStorePut = 32,     // client -> store node: meta = keys, payload = one block per key
  kStoreGet = 33,     // client -> store node: meta = keys
  kStoreLookup = 34,  // client -> store node: meta = keys
  kStoreRemove = 35,  // client -> store node: meta = keys
  kStoreReply = 36,   // store node -> client: meta = status + per-key bytes, payload (Get)
};
bool IsKnownOp(uint8_t op);
std::string_view OpName(Op op);

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t version = kWireVersion;
  uint8_t op = 0;
  uint8_t flags = 0;
  uint64_t request_id = 0;
  uint32_t meta_bytes = 0;
  uint32_t num_blocks = 0;
  uint64_t block_bytes = 0;
  uint64_t meta_checksum = 0;
  uint64_t header_checksum = 0;
};
static_assert(sizeof(FrameHeader) == 48, "wire header is 48 bytes");
static_assert(offsetof(FrameHeader, version) == 4);
static_assert(offsetof(FrameHeader, op) == 6);
static_assert(offsetof(FrameHeader, request_id) == 8);
static_assert(offsetof(FrameHeader, meta_bytes) == 16);
static_assert(offsetof(FrameHeader, num_blocks) == 20);
static_assert(offsetof(FrameHeader, block_bytes) == 24);
static_assert(offsetof(FrameHeader, meta_checksum) == 32);
static_assert(offsetof(FrameHeader, header_checksum) == 40);
inline constexpr size_t kHeaderBytes = sizeof(FrameHeader);

// Fills meta_bytes, meta_checksum and header_checksum of `h` for `meta` and returns its bytes.
std::array<uint8_t, kHeaderBytes> EncodeHeader(FrameHeader h, std::span<const uint8_t> meta);
// Validates 48 header bytes (magic, version, checksum, op, limits). Never reads past `bytes`.
Result<FrameHeader> ParseHeader(std::span<const uint8_t> bytes);
// Checks `meta` against the header's meta checksum.
Status CheckMeta(const FrameHeader& h, std::span<const uint8_t> meta);
// Total payload bytes (num_blocks * block_bytes; bounded by the parser's limits).
inline uint64_t PayloadBytes(const FrameHeader& h) { return h.num_blocks * h.block_bytes; }

// Little-endian metadata builder and bounds-checked reader (every read can fail cleanly).
class MetaWriter {
 public:
  MetaWriter& U8(uint8_t v) { return Raw(&v, 1); }
  MetaWriter& U32(uint32_t v) { return Raw(&v, 4); }
  MetaWriter& U64(uint64_t v) { return Raw(&v, 8); }
  MetaWriter& Bytes(std::span<const uint8_t> b) { return Raw(b.data(), b.size()); }
  MetaWriter& Str(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    return Raw(s.data(), s.size());
  }
  MetaWriter& Raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
    return *this;
  }
  const std::vector<uint8_t>& bytes() const { return buf_; }
  std::vector<uint8_t> Take() { return std::move(buf_); }

 private:
  std::vector<uint8_t> buf_;
};

class MetaReader {
 public:
  explicit MetaReader(std::span<const uint8_t> b) : b_(b) {}
  Result<uint8_t> U8() { return Get<uint8_t>(); }
  Result<uint32_t> U32() { return Get<uint32_t>(); }
  Result<uint64_t> U64() { return Get<uint64_t>(); }
  Result<std::span<const uint8_t>> Bytes(size_t n);
  Result<std::string> Str(size_t max_len = 4096);
  size_t remaining() const { return b_.size() - pos_; }
  Status ExpectEnd() const;

 private:
  template <typename T>
  Result<T> Get() {
    if (remaining() < sizeof(T)) return Truncated(sizeof(T));
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  Status Truncated(size_t want) const;
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
};

// kError / kPdAck / kPdRelease / kPdReleased metadata: a StatusCode and a message (<= 4 KiB).
std::vector<uint8_t> EncodeStatus(const Status& s);
// The status a peer sent ("peer: " before its message), or the reason its metadata is malformed:
// the two cannot be told apart, which suits replies (both are failures of the exchange).
Status DecodeStatus(std::span<const uint8_t> meta);
// Strict form for requests that carry a status: fails only for malformed metadata (truncated,
// unknown code, trailing bytes); else OK, with the peer's status as sent in `*out` (message
// unprefixed). (Not Result<Status>: its value and error constructors would collide.)
Status ParseStatus(std::span<const uint8_t> meta, Status* out);

}  // namespace tpusync::transport
