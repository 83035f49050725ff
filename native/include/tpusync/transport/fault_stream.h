// Test doubles of Stream: FaultyStream injects drop / delay / corrupt / disconnect faults into a
// real stream, MemoryStream reads frames from a byte buffer (unit tests and the fuzz harness).
//
// FAULT CONTRACT: faults are drawn from a seeded generator, so a failing test replays exactly.
// A dropped frame is never written (the peer sees silence and must time out); a corrupted frame
// carries the checksums of the intact bytes over damaged payload (the peer must report
// kCorrupted); a disconnect closes the inner stream, after which every call is kUnavailable.
// Faults apply to Send; receive calls pass through (wrap the other end to fault the other way).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "tpusync/transport/stream.h"

namespace tpusync::transport {

struct FaultPlan {
  double drop_probability = 0.0;        // per frame sent
  double corrupt_probability = 0.0;     // per frame with a payload
  std::chrono::milliseconds delay{0};   // before each frame sent
  int64_t disconnect_after_sends = -1;  // close after this many successful sends (-1: never)
  uint64_t seed = 1;
};

struct FaultCounters {
  uint64_t sent = 0, dropped = 0, corrupted = 0, delayed = 0, disconnected = 0;
};

class FaultyStream final : public Stream {
 public:
  FaultyStream(std::unique_ptr<Stream> inner, FaultPlan plan);
  Status Send(const OutFrame& frame, Deadline deadline) override;
  Result<InFrame> RecvHead(Deadline deadline) override { return inner_->RecvHead(deadline); }
  Status RecvBlocks(const InFrame& f, std::span<uint8_t* const> dst, Deadline d) override {
    return inner_->RecvBlocks(f, dst, d);
  }
  Status SkipBlocks(const InFrame& f, Deadline d) override { return inner_->SkipBlocks(f, d); }
  void Close() override { inner_->Close(); }
  bool broken() const override { return inner_->broken(); }
  int fd() const override { return inner_->fd(); }
  std::string peer() const override { return inner_->peer(); }
  FaultCounters counters() const;

 private:
  std::unique_ptr<Stream> inner_;
  FaultPlan plan_;
  mutable std::mutex mu_;
  std::mt19937_64 rng_;
  FaultCounters counters_;
};

// Frames read from a fixed byte buffer; frames sent are appended to `sent()`. Running out of input
// is kUnavailable (like a peer that closed the connection).
class MemoryStream final : public Stream {
 public:
  explicit MemoryStream(std::vector<uint8_t> input) : in_(std::move(input)) {}
  Status Send(const OutFrame& frame, Deadline deadline) override;
  Result<InFrame> RecvHead(Deadline deadline) override;
  Status RecvBlocks(const InFrame& f, std::span<uint8_t* const> dst, Deadline d) override;
  Status SkipBlocks(const InFrame& f, Deadline d) override;
  void Close() override { broken_ = true; }
  bool broken() const override { return broken_; }
  int fd() const override { return -1; }
  std::string peer() const override { return "memory"; }
  const std::vector<uint8_t>& sent() const { return out_; }

 private:
  Status Take(void* dst, size_t n);
  std::vector<uint8_t> in_;
  size_t pos_ = 0;
  std::vector<uint8_t> out_;
  bool broken_ = false;
};

// Serialises a frame the way SocketStream::Send writes it (tests, corpus generation).
std::vector<uint8_t> SerializeFrame(const OutFrame& frame);

}  // namespace tpusync::transport
