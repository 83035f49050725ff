#include "tpusync/transport/fault_stream.h"

#include <thread>

#include "tpusync/base/checksum.h"

namespace tpusync::transport {

FaultyStream::FaultyStream(std::unique_ptr<Stream> inner, FaultPlan plan)
    : inner_(std::move(inner)), plan_(plan), rng_(plan.seed) {}

FaultCounters FaultyStream::counters() const {
  std::lock_guard lock(mu_);
  return counters_;
}

Status FaultyStream::Send(const OutFrame& frame, Deadline deadline) {
  bool drop = false, corrupt = false;
  size_t victim = 0, victim_byte = 0;
  {
    std::lock_guard lock(mu_);
    if (plan_.disconnect_after_sends >= 0 &&
        counters_.sent >= static_cast<uint64_t>(plan_.disconnect_after_sends)) {
      counters_.disconnected++;
      inner_->Close();
      return Status::Unavailable("fault injection: disconnected");
    }
    std::uniform_real_distribution<double> u(0.0, 1.0);
    drop = u(rng_) < plan_.drop_probability;
    corrupt = !drop && !frame.blocks.empty() && u(rng_) < plan_.corrupt_probability;
    if (corrupt) {
      victim = std::uniform_int_distribution<size_t>(0, frame.blocks.size() - 1)(rng_);
      victim_byte = std::uniform_int_distribution<size_t>(0, frame.block_bytes - 1)(rng_);
    }
    if (plan_.delay.count() > 0) counters_.delayed++;
    if (drop) counters_.dropped++;
    if (corrupt) counters_.corrupted++;
    counters_.sent++;
  }
  if (plan_.delay.count() > 0) std::this_thread::sleep_for(plan_.delay);
  if (drop) return Status::OK();  // the frame is lost on the wire
  if (!corrupt) return inner_->Send(frame, deadline);
  // Damage one byte of one block in a private copy, keep the intact checksums.
  std::vector<uint64_t> sums(frame.blocks.size());
  for (size_t i = 0; i < sums.size(); ++i) sums[i] = Checksum64(frame.blocks[i], frame.block_bytes);
  std::vector<uint8_t> damaged(frame.blocks[victim], frame.blocks[victim] + frame.block_bytes);
  damaged[victim_byte] ^= 0x5a;
  std::vector<const uint8_t*> blocks(frame.blocks.begin(), frame.blocks.end());
  blocks[victim] = damaged.data();
  OutFrame f = frame;
  f.blocks = blocks;
  f.checksums = sums;
  return inner_->Send(f, deadline);
}

std::vector<uint8_t> SerializeFrame(const OutFrame& f) {
  FrameHeader h;
  h.op = static_cast<uint8_t>(f.op);
  h.flags = f.flags;
  h.request_id = f.request_id;
  h.num_blocks = static_cast<uint32_t>(f.blocks.size());
  h.block_bytes = f.block_bytes;
  const auto head = EncodeHeader(h, f.meta);
  const size_t n = f.blocks.size();
  std::vector<uint8_t> out(kHeaderBytes + f.meta.size() + n * 8 + n * f.block_bytes);
  uint8_t* p = out.data();
  std::memcpy(p, head.data(), kHeaderBytes);
  p += kHeaderBytes;
  if (!f.meta.empty()) std::memcpy(p, f.meta.data(), f.meta.size());
  p += f.meta.size();
  for (size_t i = 0; i < n; ++i, p += 8) {
    const uint64_t c =
        f.checksums.empty() ? Checksum64(f.blocks[i], f.block_bytes) : f.checksums[i];
    std::memcpy(p, &c, 8);
  }
  for (const uint8_t* b : f.blocks) {
    std::memcpy(p, b, f.block_bytes);
    p += f.block_bytes;
  }
  return out;
}

Status MemoryStream::Send(const OutFrame& frame, Deadline) {
  if (broken_) return Status::Unavailable("memory stream closed");
  const auto bytes = SerializeFrame(frame);
  out_.insert(out_.end(), bytes.begin(), bytes.end());
  return Status::OK();
}

Status MemoryStream::Take(void* dst, size_t n) {
  if (broken_) return Status::Unavailable("memory stream closed");
  if (in_.size() - pos_ < n) {
    broken_ = true;
    return Status::Unavailable("receive: peer closed the connection (end of input)");
  }
  if (n == 0) return Status::OK();  // dst may be null for an empty vector
  std::memcpy(dst, in_.data() + pos_, n);
  pos_ += n;
  return Status::OK();
}

Result<InFrame> MemoryStream::RecvHead(Deadline) {
  std::array<uint8_t, kHeaderBytes> raw;
  TPUSYNC_RETURN_IF_ERROR(Take(raw.data(), raw.size()));
  auto h = ParseHeader(raw);
  if (!h.ok()) {
    broken_ = true;
    return h.status();
  }
  InFrame f;
  f.header = *h;
  // Bound allocation by the bytes actually available, as a socket bounds it by the limits.
  if (in_.size() - pos_ < h->meta_bytes + uint64_t{h->num_blocks} * 8) {
    broken_ = true;
    return Status::Unavailable("receive: peer closed the connection (end of input)");
  }
  f.meta.resize(h->meta_bytes);
  f.checksums.resize(h->num_blocks);
  TPUSYNC_RETURN_IF_ERROR(Take(f.meta.data(), f.meta.size()));
  TPUSYNC_RETURN_IF_ERROR(Take(f.checksums.data(), f.checksums.size() * 8));
  if (Status s = CheckMeta(f.header, f.meta); !s.ok()) {
    broken_ = true;
    return s;
  }
  return f;
}

Status MemoryStream::RecvBlocks(const InFrame& f, std::span<uint8_t* const> dst, Deadline) {
  if (dst.size() != f.header.num_blocks) {
    broken_ = true;
    return Status::InvalidArgument("destination count does not match the frame");
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    TPUSYNC_RETURN_IF_ERROR(Take(dst[i], f.header.block_bytes));
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    if (Checksum64(dst[i], f.header.block_bytes) != f.checksums[i]) {
      return Status::Corrupted(StrCat("block ", i, " failed its checksum; it was not used"));
    }
  }
  return Status::OK();
}

Status MemoryStream::SkipBlocks(const InFrame& f, Deadline) {
  const uint64_t n = PayloadBytes(f.header);
  if (in_.size() - pos_ < n) {
    broken_ = true;
    return Status::Unavailable("receive: peer closed the connection (end of input)");
  }
  pos_ += n;
  return Status::OK();
}

}  // namespace tpusync::transport
