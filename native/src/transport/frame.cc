#include "tpusync/transport/frame.h"

#include <algorithm>

#include "tpusync/base/checksum.h"

namespace tpusync::transport {
namespace {
constexpr size_t kChecksummedHeaderBytes = offsetof(FrameHeader, header_checksum);
constexpr uint8_t kMaxStatusCode = static_cast<uint8_t>(StatusCode::kInternal);
}  // namespace

bool IsKnownOp(uint8_t op) {
  return (op >= 1 && op <= 8) || (op >= 16 && op <= 22) || (op >= 32 && op <= 36);
}

std::string_view OpName(Op op) {
  switch (op) {
    case Op::kAuthChallenge: return "AuthChallenge";
    case Op::kAuthResponse: return "AuthResponse";
    case Op::kAuthProof: return "AuthProof";
    case Op::kBind: return "Bind";
    case Op::kBindOk: return "BindOk";
    case Op::kError: return "Error";
    case Op::kPing: return "Ping";
    case Op::kPong: return "Pong";
    case Op::kPdPull: return "PdPull";
    case Op::kPdData: return "PdData";
    case Op::kPdEnd: return "PdEnd";
    case Op::kPdAck: return "PdAck";
    case Op::kPdShmOffer: return "PdShmOffer";
    case Op::kPdRelease: return "PdRelease";
    case Op::kPdReleased: return "PdReleased";
    case Op::kStorePut: return "StorePut";
    case Op::kStoreGet: return "StoreGet";
    case Op::kStoreLookup: return "StoreLookup";
    case Op::kStoreRemove: return "StoreRemove";
    case Op::kStoreReply: return "StoreReply";
  }
  return "Unknown";
}

std::array<uint8_t, kHeaderBytes> EncodeHeader(FrameHeader h, std::span<const uint8_t> meta) {
  h.magic = kFrameMagic;
  h.version = kWireVersion;
  h.meta_bytes = static_cast<uint32_t>(meta.size());
  h.meta_checksum = Checksum64(meta.data(), meta.size());
  h.header_checksum = Checksum64(&h, kChecksummedHeaderBytes);
  std::array<uint8_t, kHeaderBytes> out;
  std::memcpy(out.data(), &h, kHeaderBytes);
  return out;
}

Result<FrameHeader> ParseHeader(std::span<const uint8_t> bytes) {
  if (bytes.size() < kHeaderBytes) {
    return Status::Corrupted(
        StrCat("frame header truncated: ", bytes.size(), " of ", kHeaderBytes, " bytes"));
  }
  FrameHeader h;
  std::memcpy(&h, bytes.data(), kHeaderBytes);
  if (h.magic != kFrameMagic) {
    return Status::Corrupted(StrCat("bad frame magic 0x", std::hex, h.magic,
                                    ": the peer is not speaking the tpusync wire protocol"));
  }
  if (h.version != kWireVersion) {
    return Status::VersionMismatch(StrCat("peer speaks tpusync wire version ", h.version,
                                          ", this build speaks version ", kWireVersion,
                                          "; upgrade both ends to the same tpusync release"));
  }
  if (Checksum64(bytes.data(), kChecksummedHeaderBytes) != h.header_checksum) {
    return Status::Corrupted("frame header checksum mismatch (bytes damaged in flight)");
  }
  if (!IsKnownOp(h.op)) {
    return Status::InvalidArgument(StrCat("unknown frame op ", static_cast<int>(h.op)));
  }
  if (h.meta_bytes > kMaxMetaBytes) {
    return Status::InvalidArgument(
        StrCat("frame metadata of ", h.meta_bytes, " bytes exceeds the limit of ", kMaxMetaBytes));
  }
  if (h.num_blocks > kMaxBlocksPerFrame) {
    return Status::InvalidArgument(StrCat("frame declares ", h.num_blocks,
                                          " blocks, more than the limit of ", kMaxBlocksPerFrame));
  }
  if (h.block_bytes > kMaxBlockBytes) {
    return Status::InvalidArgument(
        StrCat("frame block size ", h.block_bytes, " exceeds the limit of ", kMaxBlockBytes));
  }
  if ((h.num_blocks == 0) != (h.block_bytes == 0)) {
    return Status::InvalidArgument(StrCat("frame declares ", h.num_blocks, " blocks of ",
                                          h.block_bytes, " bytes: both or neither must be 0"));
  }
  return h;
}

Status CheckMeta(const FrameHeader& h, std::span<const uint8_t> meta) {
  if (meta.size() != h.meta_bytes) {
    return Status::Internal(StrCat("metadata size ", meta.size(), " != header's ", h.meta_bytes));
  }
  if (Checksum64(meta.data(), meta.size()) != h.meta_checksum) {
    return Status::Corrupted("frame metadata checksum mismatch (bytes damaged in flight)");
  }
  return Status::OK();
}

Result<std::span<const uint8_t>> MetaReader::Bytes(size_t n) {
  if (remaining() < n) return Truncated(n);
  auto out = b_.subspan(pos_, n);
  pos_ += n;
  return out;
}

Result<std::string> MetaReader::Str(size_t max_len) {
  TPUSYNC_ASSIGN_OR_RETURN(uint32_t len, U32());
  if (len > max_len) {
    return Status::InvalidArgument(
        StrCat("frame metadata string of ", len, " bytes exceeds ", max_len));
  }
  TPUSYNC_ASSIGN_OR_RETURN(auto b, Bytes(len));
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

Status MetaReader::ExpectEnd() const {
  if (remaining() != 0) {
    return Status::InvalidArgument(
        StrCat("frame metadata has ", remaining(), " unexpected trailing bytes"));
  }
  return Status::OK();
}

Status MetaReader::Truncated(size_t want) const {
  return Status::InvalidArgument(StrCat("frame metadata truncated: wanted ", want,
                                        " more bytes at offset ", pos_, ", ", remaining(),
                                        " left"));
}

std::vector<uint8_t> EncodeStatus(const Status& s) {
  MetaWriter w;
  w.U8(static_cast<uint8_t>(s.code()));
  const std::string& m = s.message();
  w.Str(std::string_view(m).substr(0, 4096));
  return w.Take();
}

Status ParseStatus(std::span<const uint8_t> meta, Status* out) {
  MetaReader r(meta);
  TPUSYNC_ASSIGN_OR_RETURN(uint8_t code, r.U8());
  if (code > kMaxStatusCode) {
    return Status::InvalidArgument(StrCat("peer sent unknown status code ", int{code}));
  }
  TPUSYNC_ASSIGN_OR_RETURN(std::string msg, r.Str());
  TPUSYNC_RETURN_IF_ERROR(r.ExpectEnd());
  *out = code == 0 ? Status::OK() : Status(static_cast<StatusCode>(code), std::move(msg));
  return Status::OK();
}

Status DecodeStatus(std::span<const uint8_t> meta) {
  Status s;
  TPUSYNC_RETURN_IF_ERROR(ParseStatus(meta, &s));
  if (s.ok()) return s;
  return Status(s.code(), "peer: " + s.message());
}

}  // namespace tpusync::transport
