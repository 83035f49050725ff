// Stream: one ordered, authenticated byte stream carrying frames (a TCP or Unix-domain socket),
// and the interface every layer above the transport talks to.
//
// ZERO-COPY CONTRACT: Send writes header, metadata, checksums and the caller's block memory in one
// writev-style call, straight from the blocks (no staging buffer); RecvBlocks reads the payload
// straight into the destinations the caller chose (readv, in pieces), verifying every block
// checksum piece by piece while the bytes are warm (VERIFY-WHILE-WARM in stream.cc). The caller
// keeps the block memory valid and unchanged for the duration of the call.
//
// BROKEN CONTRACT: after any error from Send / RecvHead / RecvBlocks the stream is out of step and
// is marked broken; every later call fails with kUnavailable. Callers drop broken streams (the
// link pool never hands one out again).
//
// Rejected alternative: a message-queue interface (send(bytes) / recv() -> bytes). It would force a
// copy of every payload into a message buffer, the copy the transport exists to avoid.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/transport/frame.h"
#include "tpusync/transport/socket.h"

namespace tpusync::transport {

struct OutFrame {
  Op op = Op::kPing;
  uint8_t flags = 0;
  uint64_t request_id = 0;
  std::span<const uint8_t> meta;
  uint64_t block_bytes = 0;                // every block has this size
  std::span<const uint8_t* const> blocks;  // payload, written in this order
  // Optional precomputed checksums (one per block). The fault double uses this to send damaged
  // bytes under the checksums of the intact ones.
  std::span<const uint64_t> checksums;
  // Another frame follows on this stream at once: the socket may hold this one back to send both
  // in one segment (MSG_MORE). Only for a frame whose successor is sent without any wait.
  bool more = false;
};

struct InFrame {
  FrameHeader header;
  std::vector<uint8_t> meta;
  std::vector<uint64_t> checksums;
  Op op() const { return static_cast<Op>(header.op); }
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual Status Send(const OutFrame& frame, Deadline deadline) = 0;
  // Reads the next frame's header, metadata and block checksums (not its payload).
  virtual Result<InFrame> RecvHead(Deadline deadline) = 0;
  // Reads the payload of `frame` into dst[i] (block_bytes each) and checks every checksum.
  virtual Status RecvBlocks(const InFrame& frame, std::span<uint8_t* const> dst,
                            Deadline deadline) = 0;
  // Reads and drops the payload of `frame` (bounded scratch buffer).
  virtual Status SkipBlocks(const InFrame& frame, Deadline deadline) = 0;
  // Shuts the stream down; blocked calls on other threads return promptly.
  virtual void Close() = 0;
  virtual bool broken() const = 0;
  // The socket fd (for fd passing on Unix sockets), or -1.
  virtual int fd() const = 0;
  virtual std::string peer() const = 0;

  // Convenience: a frame with metadata only.
  Status SendMeta(Op op, uint64_t request_id, std::span<const uint8_t> meta, Deadline deadline,
                  uint8_t flags = 0);
  // Reads the next frame and requires `op` (a kError frame becomes its Status); the frame must
  // carry no payload.
  Result<InFrame> Expect(Op op, Deadline deadline);
};

// A Stream over a connected socket it owns.
class SocketStream final : public Stream {
 public:
  // RecvBlocks reads and verifies the payload in pieces of this size (VERIFY-WHILE-WARM,
  // stream.cc): an eighth of a 2 MiB L2, so a piece and the kernel's copy of it both stay there.
  static constexpr uint64_t kVerifyPieceBytes = uint64_t{256} << 10;

  SocketStream(Fd fd, std::string peer) : fd_(std::move(fd)), peer_(std::move(peer)) {}
  // HANDSHAKE LIMIT: until lifted (LimitFrames(kMaxMetaBytes, kMaxBlocksPerFrame)), RecvHead
  // refuses a frame with more than `max_meta_bytes` of metadata or more than `max_blocks` payload
  // blocks from its header alone, before allocating anything for it (the stream is then broken).
  // Servers hold every connection to kHandshakeMetaBytes (auth.h) and no payload until it
  // authenticated and bound, so a peer without the secret cannot make them allocate kMaxMetaBytes +
  // 8 x kMaxBlocksPerFrame per connection with one header.
  void LimitFrames(uint32_t max_meta_bytes, uint32_t max_blocks);
  Status Send(const OutFrame& frame, Deadline deadline) override;
  Result<InFrame> RecvHead(Deadline deadline) override;
  Status RecvBlocks(const InFrame& frame, std::span<uint8_t* const> dst,
                    Deadline deadline) override;
  Status SkipBlocks(const InFrame& frame, Deadline deadline) override;
  void Close() override;
  bool broken() const override { return broken_.load(); }
  int fd() const override { return fd_.get(); }
  std::string peer() const override { return peer_; }

 private:
  Status Fail(Status s);
  Fd fd_;
  std::string peer_;
  std::atomic<bool> broken_{false};
  uint32_t max_meta_bytes_ = kMaxMetaBytes;
  uint32_t max_blocks_ = kMaxBlocksPerFrame;
};

// Parses one whole frame (header, metadata, checksums, payload) from memory: used by the fuzz
// harness and by tests. Payload blocks are checked against their checksums.
Status ParseFrameBytes(std::span<const uint8_t> bytes, InFrame* out = nullptr);

}  // namespace tpusync::transport
