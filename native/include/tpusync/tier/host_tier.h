// HostTier: the host DRAM tier - blocks in one prefaulted HostPool (memory/host_pool.h), slots from
// a BlockAllocator (location = BlockId), optionally in /dev/shm under a namespace so that a
// restarted process re-attaches the warm cache.
//
// SHM LAYOUT (at the start of the segment, before the block slots):
//   [0, 4096)                      HostRegionHeader (magic, version, sizes, model fingerprint)
//   [4096, 4096 + n*128 rounded)    one SlotHeader per block slot (key, length, checksum, sequence)
//   [meta_bytes, ...)               block slots at BlockAllocator::StrideFor(block_bytes)
//
// WARM-RESTART CONTRACT: with a shm name, Open locks /dev/shm/<name>.lock (a second process gets
// kFailedPrecondition, never a shared corruption), then maps the segment. If the region header
// matches (same block size, block count and fingerprint) every slot header is checked and every
// payload's XXH3 recomputed; valid blocks are claimed and returned by TakeRecovered(), the rest
// are counted as corrupted and cleared. Any mismatch (fingerprint, size, version) is a cold start
// with one clear stderr line and cold_start_reason set - never stale data.
//
// Reads from DRAM are not checksummed (the bytes never left this process's memory); Rejected
// alternative: verifying every host read - halves get throughput for no failure it could catch
// that a re-attach check does not. For the same reason only a /dev/shm tier hashes on write (fused
// with the copy, for the re-attach check); an anonymous tier's headers carry checksum 0.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "tpusync/memory/block_allocator.h"
#include "tpusync/tier/slot_header.h"
#include "tpusync/tier/tier.h"

namespace tpusync::tier {

struct HostTierOptions {
  size_t block_bytes = 0;
  size_t num_blocks = 0;
  std::string shm_name;     // empty: anonymous private memory; else /dev/shm/<name> (persists)
  std::string fingerprint;  // model fingerprint; a re-attach with another one is a cold start
  bool prefault = true;
  bool huge_pages = false;
};

inline constexpr uint32_t kHostRegionMagic = 0x52485354;  // "TSHR"
inline constexpr uint16_t kHostRegionVersion = 1;

struct HostRegionHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t reserved0;
  uint64_t block_bytes;
  uint64_t num_blocks;
  uint64_t meta_bytes;
  uint64_t fingerprint;       // XXH3-64 of fingerprint_text
  char fingerprint_text[96];  // for the cold-start log line (truncated)
  uint64_t header_checksum;   // XXH3-64 of every byte above
};
static_assert(sizeof(HostRegionHeader) == 144, "HostRegionHeader is a shared-memory format");
static_assert(offsetof(HostRegionHeader, fingerprint_text) == 40);

class HostTier final : public BlockTier {
 public:
  static Result<std::unique_ptr<HostTier>> Open(const HostTierOptions& options);
  ~HostTier() override;

  block::Tier kind() const override { return block::Tier::kHost; }
  size_t block_bytes() const override { return blocks_->block_bytes(); }
  size_t capacity() const override { return blocks_->num_blocks(); }
  size_t used() const override { return blocks_->num_blocks() - blocks_->num_free(); }
  Result<uint64_t> Reserve() override;
  void Release(uint64_t location, bool forget) override;
  Status Hold(uint64_t location) override;
  void Unhold(uint64_t location) override;
  void WriteBatch(std::span<BlockWrite> ops) override;
  void ReadBatch(std::span<BlockRead> ops) override;
  const uint8_t* Address(uint64_t location) const override;
  std::vector<RecoveredBlock> TakeRecovered() override;
  TierStats stats() const override;

  // Bytes in front of the block slots for a pool of n blocks (region header + slot headers).
  static size_t MetaBytes(size_t num_blocks);
  const std::string& shm_name() const { return shm_name_; }

 private:
  HostTier() = default;
  SlotHeader* Header(uint64_t location) const;
  void Recover(const HostRegionHeader& expected);

  std::shared_ptr<memory::BlockAllocator> blocks_;
  std::string shm_name_;
  int lock_fd_ = -1;
  uint64_t fingerprint_ = 0;
  SlotHeader* headers_ = nullptr;
  std::vector<RecoveredBlock> recovered_;
  std::string cold_start_reason_;
  uint64_t recovered_count_ = 0;
  std::atomic<uint64_t> blocks_written_{0}, blocks_read_{0}, corrupted_{0}, write_ns_{0},
      read_ns_{0};
};

}  // namespace tpusync::tier
