#include "tpusync/transport/stream.h"

#include <sys/socket.h>

#include <algorithm>

#include "tpusync/base/checksum.h"

namespace tpusync::transport {

Status Stream::SendMeta(Op op, uint64_t request_id, std::span<const uint8_t> meta,
                        Deadline deadline, uint8_t flags) {
  OutFrame f;
  f.op = op;
  f.flags = flags;
  f.request_id = request_id;
  f.meta = meta;
  return Send(f, deadline);
}

Result<InFrame> Stream::Expect(Op op, Deadline deadline) {
  TPUSYNC_ASSIGN_OR_RETURN(InFrame f, RecvHead(deadline));
  if (f.op() == Op::kError) {
    Status s = DecodeStatus(f.meta);
    if (s.ok()) s = Status::Internal("peer sent an Error frame carrying OK");
    if (f.header.num_blocks) (void)SkipBlocks(f, deadline);
    return s;
  }
  if (f.op() != op) {
    if (f.header.num_blocks) (void)SkipBlocks(f, deadline);
    return Status::InvalidArgument(
        StrCat("expected a ", OpName(op), " frame from ", peer(), ", got ", OpName(f.op())));
  }
  if (f.header.num_blocks != 0) {
    (void)SkipBlocks(f, deadline);
    return Status::InvalidArgument(StrCat(OpName(op), " frame must not carry a payload"));
  }
  return f;
}

Status SocketStream::Fail(Status s) {
  if (!s.ok()) broken_.store(true);
  return s;
}

void SocketStream::Close() {
  broken_.store(true);
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

Status SocketStream::Send(const OutFrame& f, Deadline deadline) {
  if (broken_.load()) return Status::Unavailable(StrCat("stream to ", peer_, " is closed"));
  const size_t n = f.blocks.size();
  if (n > kMaxBlocksPerFrame || f.block_bytes > kMaxBlockBytes || f.meta.size() > kMaxMetaBytes ||
      (n == 0) != (f.block_bytes == 0) || (!f.checksums.empty() && f.checksums.size() != n)) {
    return Status::InvalidArgument(StrCat("frame of ", n, " blocks x ", f.block_bytes,
                                          " bytes with ", f.meta.size(),
                                          " metadata bytes is outside the wire limits"));
  }
  FrameHeader h;
  h.op = static_cast<uint8_t>(f.op);
  h.flags = f.flags;
  h.request_id = f.request_id;
  h.num_blocks = static_cast<uint32_t>(n);
  h.block_bytes = f.block_bytes;
  const auto head = EncodeHeader(h, f.meta);
  std::vector<uint64_t> sums;
  if (f.checksums.empty()) {
    sums.resize(n);
    for (size_t i = 0; i < n; ++i) sums[i] = Checksum64(f.blocks[i], f.block_bytes);
  } else {
    sums.assign(f.checksums.begin(), f.checksums.end());
  }
  std::vector<iovec> iov;
  iov.reserve(3 + n);
  iov.push_back({const_cast<uint8_t*>(head.data()), head.size()});
  iov.push_back({const_cast<uint8_t*>(f.meta.data()), f.meta.size()});
  iov.push_back({sums.data(), sums.size() * sizeof(uint64_t)});
  for (const uint8_t* b : f.blocks) iov.push_back({const_cast<uint8_t*>(b), f.block_bytes});
  return Fail(WriteAllV(fd_.get(), iov, deadline, f.more ? MSG_MORE : 0));
}

void SocketStream::LimitFrames(uint32_t max_meta_bytes, uint32_t max_blocks) {
  max_meta_bytes_ = std::min(max_meta_bytes, kMaxMetaBytes);
  max_blocks_ = std::min(max_blocks, kMaxBlocksPerFrame);
}

Result<InFrame> SocketStream::RecvHead(Deadline deadline) {
  if (broken_.load()) return Status::Unavailable(StrCat("stream to ", peer_, " is closed"));
  std::array<uint8_t, kHeaderBytes> raw;
  if (Status s = ReadAll(fd_.get(), raw.data(), raw.size(), deadline); !s.ok()) return Fail(s);
  auto h = ParseHeader(raw);
  if (!h.ok()) return Fail(h.status());
  if (h->meta_bytes > max_meta_bytes_ || h->num_blocks > max_blocks_) {
    // HANDSHAKE LIMIT: refused from the header, before anything is allocated for the frame.
    return Fail(Status::InvalidArgument(
        StrCat("a ", OpName(static_cast<Op>(h->op)), " frame of ", h->meta_bytes,
               " metadata bytes and ", h->num_blocks, " blocks from ", peer_,
               " exceeds what this stream accepts before authentication (", max_meta_bytes_,
               " bytes, ", max_blocks_, " blocks)")));
  }
  InFrame f;
  f.header = *h;
  f.meta.resize(h->meta_bytes);
  f.checksums.resize(h->num_blocks);
  const iovec iov[2] = {{f.meta.data(), f.meta.size()},
                        {f.checksums.data(), f.checksums.size() * sizeof(uint64_t)}};
  if (Status s = ReadAllV(fd_.get(), iov, deadline); !s.ok()) return Fail(s);
  if (Status s = CheckMeta(f.header, f.meta); !s.ok()) return Fail(s);
  return f;
}

Status SocketStream::RecvBlocks(const InFrame& f, std::span<uint8_t* const> dst,
                                Deadline deadline) {
  if (broken_.load()) return Status::Unavailable(StrCat("stream to ", peer_, " is closed"));
  if (dst.size() != f.header.num_blocks) {
    return Fail(
        Status::InvalidArgument(StrCat("frame carries ", f.header.num_blocks, " blocks but ",
                                       dst.size(), " destinations were given")));
  }
  // VERIFY-WHILE-WARM: the payload is read in pieces of at most kVerifyPieceBytes and each piece
  // is folded into its block's checksum right after it landed, while it is still in L1/L2 (one
  // checksum pass per block on this side, over warm bytes). A block larger than a piece is hashed
  // incrementally (Checksum64Stream gives the one-shot digest for any split); smaller blocks are
  // read several to a piece and hashed one-shot. Measured (2 MiB blocks, 2-vCPU machine with 2 MiB
  // of L2 per core): hashing a whole 2 MiB block after its readv re-read part of it from L3 - the
  // kernel's socket buffers had pushed it out of L2. Rejected alternatives: one readv per frame or
  // per 1 MiB, then checksums (the previous rule: the second pass re-read cold bytes); hashing
  // whatever each readv returned (unbounded: one call can return megabytes when data queued up).
  const uint64_t bb = f.header.block_bytes;
  Status bad;
  auto check = [&](size_t i, uint64_t sum) {
    if (bad.ok() && sum != f.checksums[i]) {
      // The stream itself is still in step: only this payload is bad (read the rest anyway).
      bad = Status::Corrupted(StrCat("block ", i, " of a ", OpName(f.op()), " frame from ", peer_,
                                     " failed its checksum; it was not used"));
    }
  };
  if (bb >= kVerifyPieceBytes) {
    Checksum64Stream h;
    for (size_t i = 0; i < dst.size(); ++i) {
      h.Reset();
      for (uint64_t off = 0; off < bb; off += kVerifyPieceBytes) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kVerifyPieceBytes, bb - off));
        TPUSYNC_RETURN_IF_ERROR(Fail(ReadAll(fd_.get(), dst[i] + off, n, deadline)));
        if (bad.ok()) h.Update(dst[i] + off, n);  // after a bad block only read (no verdict left)
      }
      check(i, h.Digest());
    }
    return bad;
  }
  const size_t per = static_cast<size_t>(kVerifyPieceBytes / std::max<uint64_t>(bb, 1));
  std::vector<iovec> iov;
  iov.reserve(std::min(per, dst.size()));
  for (size_t lo = 0; lo < dst.size(); lo += per) {
    const size_t hi = std::min(dst.size(), lo + per);
    iov.clear();
    for (size_t i = lo; i < hi; ++i) iov.push_back({dst[i], bb});
    TPUSYNC_RETURN_IF_ERROR(Fail(ReadAllV(fd_.get(), iov, deadline)));
    for (size_t i = lo; i < hi && bad.ok(); ++i) check(i, Checksum64(dst[i], bb));
  }
  return bad;
}

Status SocketStream::SkipBlocks(const InFrame& f, Deadline deadline) {
  uint64_t left = PayloadBytes(f.header);
  std::vector<uint8_t> scratch(static_cast<size_t>(std::min<uint64_t>(left, 1 << 20)));
  while (left > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, scratch.size()));
    TPUSYNC_RETURN_IF_ERROR(Fail(ReadAll(fd_.get(), scratch.data(), n, deadline)));
    left -= n;
  }
  return Status::OK();
}

Status ParseFrameBytes(std::span<const uint8_t> bytes, InFrame* out) {
  TPUSYNC_ASSIGN_OR_RETURN(FrameHeader h, ParseHeader(bytes));
  size_t pos = kHeaderBytes;
  const uint64_t sums_bytes = uint64_t{h.num_blocks} * 8;
  if (bytes.size() - pos < h.meta_bytes + sums_bytes) {
    return Status::Corrupted("frame truncated in its metadata or checksums");
  }
  InFrame f;
  f.header = h;
  f.meta.assign(bytes.begin() + pos, bytes.begin() + pos + h.meta_bytes);
  pos += h.meta_bytes;
  TPUSYNC_RETURN_IF_ERROR(CheckMeta(h, f.meta));
  f.checksums.resize(h.num_blocks);
  if (sums_bytes) std::memcpy(f.checksums.data(), bytes.data() + pos, sums_bytes);
  pos += sums_bytes;
  if (bytes.size() - pos < PayloadBytes(h)) return Status::Corrupted("frame payload truncated");
  for (uint32_t i = 0; i < h.num_blocks; ++i) {
    if (Checksum64(bytes.data() + pos, h.block_bytes) != f.checksums[i]) {
      return Status::Corrupted(StrCat("payload block ", i, " failed its checksum"));
    }
    pos += h.block_bytes;
  }
  if (out) *out = std::move(f);
  return Status::OK();
}

}  // namespace tpusync::transport
