// DiskTier: blocks in big segment files in one directory (local SSD or a shared filesystem).
//
// LAYOUT (docs/tiers.md has the full picture):
//   <dir>/LOCK            flock'ed by the owning process (a second opener gets a clear error)
//   <dir>/tier.meta       DiskMeta: format version, block size, slot size, segment size, slot
//                         count, model fingerprint - written atomically (tmp + rename)
//   <dir>/seg-NNNNNN.tps  segment files of segment_blocks slots each; slot i of a segment starts
//                         at i * slot_bytes: a 4 KiB header page (SlotHeader) then the payload
//                         padded to 4 KiB, so every slot is O_DIRECT-aligned
// Location = global slot number (segment * segment_blocks + slot).
//
// WRITE CONTRACT: header and payload go to disk in one vectored write, so a block is replaced
// atomically as far as a reader after a crash can tell: either the new header and payload match
// (checksum) or the slot reads as corrupted and is reclaimed. No fsync per block: a KV cache can
// always be recomputed; power-loss durability is out of scope (docs/tiers.md: crash semantics).
//
// RESTART CONTRACT: Open rebuilds the slot table from the headers (one 4 KiB read per slot, batched
// through the io backend); payload checksums are verified on every read, not at scan. A tier.meta
// that disagrees with the options (fingerprint, block size, segment size, slot count) means a cold
// start: old segments are deleted with one stderr line naming the reason.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tpusync/tier/io_backend.h"
#include "tpusync/tier/segment_file.h"
#include "tpusync/tier/slot_header.h"
#include "tpusync/tier/tier.h"

namespace tpusync::tier {

struct DiskTierOptions {
  std::string directory;
  size_t block_bytes = 0;
  size_t num_blocks = 0;
  size_t segment_blocks = 0;  // 0: about 1 GiB per segment
  std::string fingerprint;
  bool direct_io = true;            // try O_DIRECT, fall back to buffered where refused
  std::string io_backend = "auto";  // auto | io_uring | pread
  size_t io_threads = 4;            // pread backend threads / io_uring depth hint
  // Tests only: wraps the chosen backend (to inject I/O faults). Empty: the backend as is.
  std::function<std::unique_ptr<IoBackend>(std::unique_ptr<IoBackend>)> wrap_io;
};

inline constexpr uint32_t kDiskMetaMagic = 0x4d445354;  // "TSDM"
inline constexpr uint16_t kDiskMetaVersion = 1;
inline constexpr size_t kSlotHeaderBytes = 4096;

struct DiskMeta {
  uint32_t magic;
  uint16_t version;
  uint16_t reserved0;
  uint64_t block_bytes;
  uint64_t slot_bytes;
  uint64_t segment_blocks;
  uint64_t num_blocks;
  uint64_t fingerprint;
  char fingerprint_text[96];
  uint64_t header_checksum;
};
static_assert(sizeof(DiskMeta) == 152, "DiskMeta is an on-disk format");
static_assert(offsetof(DiskMeta, fingerprint_text) == 48);

class DiskTier final : public BlockTier {
 public:
  static Result<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options);
  ~DiskTier() override;

  block::Tier kind() const override { return block::Tier::kDisk; }
  size_t block_bytes() const override { return block_bytes_; }
  size_t capacity() const override { return num_blocks_; }
  size_t used() const override;
  Result<uint64_t> Reserve() override;
  void Release(uint64_t location, bool forget) override;
  Status Hold(uint64_t location) override;
  void Unhold(uint64_t location) override;
  void WriteBatch(std::span<BlockWrite> ops) override;
  void ReadBatch(std::span<BlockRead> ops) override;
  std::vector<RecoveredBlock> TakeRecovered() override;
  TierStats stats() const override;

  size_t slot_bytes() const { return slot_bytes_; }
  // Where a location lives (for tests that damage slots on purpose).
  std::string SegmentPath(uint64_t location) const;
  uint64_t SlotOffset(uint64_t location) const;

 private:
  DiskTier() = default;
  Status OpenSegments(bool cold);
  void Scan();
  void Free(uint64_t slot);  // mu_ held
  void RunCoalesced(std::vector<IoOp>& ops);
  void RunIo(std::span<IoOp> ops);  // io_->Run, then the DIRECT I/O CONTRACT's per-I/O fallback
  void DropDirectIo();
  const SegmentFile& SegmentOf(uint64_t location) const;

  std::string dir_;
  size_t block_bytes_ = 0, payload_bytes_ = 0, slot_bytes_ = 0, segment_blocks_ = 0,
         num_blocks_ = 0;
  uint64_t fingerprint_ = 0;
  std::atomic<bool> direct_{false};
  bool opened_direct_ = false;  // segments were opened with O_DIRECT (set once, in Open)
  std::mutex direct_mu_;        // serialises DropDirectIo
  int lock_fd_ = -1;
  std::unique_ptr<IoBackend> io_;
  std::vector<SegmentFile> segments_;

  mutable std::mutex mu_;
  enum : uint8_t { kFree = 0, kUsed = 1, kReleasing = 2 };
  std::vector<uint8_t> state_;
  std::vector<uint32_t> holds_;
  std::vector<uint32_t> free_;  // stack, lowest slot on top
  size_t num_used_ = 0;

  std::vector<RecoveredBlock> recovered_;
  uint64_t recovered_count_ = 0;
  std::string cold_start_reason_;
  std::atomic<uint64_t> blocks_written_{0}, blocks_read_{0}, write_errors_{0}, no_space_{0},
      read_errors_{0}, corrupted_{0}, write_ns_{0}, read_ns_{0};
};

}  // namespace tpusync::tier
