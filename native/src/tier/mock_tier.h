// MockTier: an in-memory BlockTier for tests - the reference the conformance suite is checked
// against, and a tier whose writes can be made to fail (ENOSPC) or whose bytes can be damaged.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tpusync/base/checksum.h"
#include "tpusync/tier/tier.h"

namespace tpusync::tier {

class MockTier final : public BlockTier {
 public:
  MockTier(block::Tier kind, size_t block_bytes, size_t n)
      : kind_(kind), block_bytes_(block_bytes), slots_(n) {
    for (size_t i = n; i-- > 0;) free_.push_back(i);
  }
  block::Tier kind() const override { return kind_; }
  size_t block_bytes() const override { return block_bytes_; }
  size_t capacity() const override { return slots_.size(); }
  size_t used() const override {
    std::lock_guard<std::mutex> l(mu_);
    return slots_.size() - free_.size();
  }
  Result<uint64_t> Reserve() override {
    std::lock_guard<std::mutex> l(mu_);
    if (free_.empty()) return Status::PoolExhausted("mock tier full");
    const uint64_t loc = free_.back();
    free_.pop_back();
    slots_[loc].used = true;
    return loc;
  }
  void Release(uint64_t loc, bool forget) override {
    std::lock_guard<std::mutex> l(mu_);
    Slot& s = slots_[loc];
    if (!s.used || s.releasing) return;
    if (forget) {
      s.key.clear();
      ++forgets_;
    }
    if (s.holds) {
      s.releasing = true;
    } else {
      s.used = false;
      free_.push_back(loc);
    }
  }
  Status Hold(uint64_t loc) override {
    std::lock_guard<std::mutex> l(mu_);
    if (loc >= slots_.size() || !slots_[loc].used) return Status::FailedPrecondition("not used");
    ++slots_[loc].holds;
    return Status::OK();
  }
  void Unhold(uint64_t loc) override {
    std::lock_guard<std::mutex> l(mu_);
    Slot& s = slots_[loc];
    if (s.holds == 0) return;
    if (--s.holds == 0 && s.releasing) {
      s.releasing = false;
      s.used = false;
      free_.push_back(loc);
    }
  }
  void WriteBatch(std::span<BlockWrite> ops) override {
    {
      // A closed gate holds every write batch here (test hook: a device that stalls), at most 30 s.
      std::unique_lock<std::mutex> l(mu_);
      ++waiting_writes_;
      gate_cv_.wait_for(l, std::chrono::seconds(30), [this] { return !writes_held_; });
      --waiting_writes_;
    }
    for (auto& op : ops) {
      std::lock_guard<std::mutex> l(mu_);
      if (fail_writes_ > 0) {
        --fail_writes_;
        op.status = Status::NoSpace("mock tier: no space left on device");
        ++stats_.write_errors;
        ++stats_.no_space_errors;
        continue;
      }
      Slot& s = slots_[op.location];
      s.key = std::string(op.key);
      s.bytes.assign(op.data, op.data + block_bytes_);
      s.checksum = Checksum64(op.data, block_bytes_);
      op.status = Status::OK();
      ++stats_.blocks_written;
    }
  }
  void ReadBatch(std::span<BlockRead> ops) override {
    for (auto& op : ops) {
      std::lock_guard<std::mutex> l(mu_);
      const Slot& s = slots_[op.location];
      if (s.key != op.key || s.bytes.size() != block_bytes_ ||
          Checksum64(s.bytes.data(), block_bytes_) != s.checksum) {
        op.status = Status::Corrupted("mock tier: key or checksum mismatch");
        ++stats_.corrupted;
        continue;
      }
      std::memcpy(op.dst, s.bytes.data(), block_bytes_);
      op.status = Status::OK();
      ++stats_.blocks_read;
    }
  }
  std::vector<RecoveredBlock> TakeRecovered() override { return {}; }
  TierStats stats() const override {
    std::lock_guard<std::mutex> l(mu_);
    TierStats s = stats_;
    s.capacity_blocks = slots_.size();
    s.used_blocks = slots_.size() - free_.size();
    return s;
  }

  // Test hooks.
  void FailNextWrites(size_t n) {
    std::lock_guard<std::mutex> l(mu_);
    fail_writes_ = n;
  }
  // Closes (true) or opens (false) the write gate; waiting_writes() counts batches held at it.
  void HoldWrites(bool hold) {
    {
      std::lock_guard<std::mutex> l(mu_);
      writes_held_ = hold;
    }
    gate_cv_.notify_all();
  }
  size_t waiting_writes() const {
    std::lock_guard<std::mutex> l(mu_);
    return waiting_writes_;
  }
  // Slots released with forget (a disk tier zeroes their headers: no restart brings them back).
  size_t forgets() const {
    std::lock_guard<std::mutex> l(mu_);
    return forgets_;
  }
  // Slots whose key is set (what a restart of a persistent tier would find).
  size_t keyed() const {
    std::lock_guard<std::mutex> l(mu_);
    size_t n = 0;
    for (const Slot& s : slots_) n += !s.key.empty();
    return n;
  }
  void Damage(uint64_t loc) {
    std::lock_guard<std::mutex> l(mu_);
    if (!slots_[loc].bytes.empty()) slots_[loc].bytes[0] ^= 0xff;
  }

 private:
  struct Slot {
    bool used = false;
    bool releasing = false;
    uint32_t holds = 0;
    std::string key;
    std::vector<uint8_t> bytes;
    uint64_t checksum = 0;
  };
  block::Tier kind_;
  size_t block_bytes_;
  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<uint64_t> free_;
  size_t fail_writes_ = 0;
  bool writes_held_ = false;
  size_t waiting_writes_ = 0;
  std::condition_variable gate_cv_;
  size_t forgets_ = 0;
  TierStats stats_;
};

}  // namespace tpusync::tier
