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
//   <dir>/manifest        present only between a clean close and the next open: the blocks the
//                         tier held at close (tier/disk_manifest.h), so that open reads no header
//
// RESTART CONTRACT: a tier.meta that disagrees with the options (fingerprint, block size, segment
// size, slot count) means a cold start: old segments (and any manifest) are deleted with one
// stderr line naming the reason. Otherwise Open rebuilds the slot table one of two ways, then
// deletes the manifest before serving (stats().recovery says which way was taken):
// - "manifest": the store closed cleanly (CheckpointOnClose) and left a manifest that passes every
//   check of the MANIFEST CONTRACT (tier/disk_manifest.h): its entries are taken as they are, with
//   no header read - one sequential read of ~80 bytes per block instead of a 4 KiB random read
//   per slot (~10 us each on the development VM: 0.6 s at 60k slots, minutes at 16M);
// - "scan": anything else (no manifest: a crash or SIGKILL; or a truncated, checksum-failing,
//   stale or mismatching one: one stderr line names why) - one 4 KiB header read per slot,
//   batched through the io backend, as before manifests existed.
// Payload checksums are verified on every read, never at open, so either way a wrong slot table
// can cost a counted miss but never serve stale bytes (CHECKSUM CONTRACT).
//
// CLEAN-CLOSE CONTRACT (CheckpointOnClose): called by the store after its last write to the tier
// finished (write-back and write-through joined, every op drained). The keys come from the
// store's index (a streaming walk of the keys it places in this tier); the write sequence of
// each slot comes from this tier, which keeps one uint64_t per slot (sequence_: 128 MiB at 16M
// slots, next to the ~9 bytes per slot of state_/holds_/free_ and the index's >= 128 bytes per
// key). Rejected alternatives: the tier keeping every slot's key too (up to 72 bytes per slot,
// ~1.1 GiB at 16M slots, a second copy of what the index holds); a full index Snapshot() at
// close (~130 bytes per key allocated at once, ~2 GB at 16M keys); sequences synthesised from the
// index's recency order (no per-slot memory, but the order and sequence counter a later crash
// scan would find in the headers would disagree with the manifest's). Any write or release after
// the manifest was written deletes it again (a caller that keeps using the tier cannot leave a
// stale one). A failure (disk full, I/O error) only leaves no manifest: counted in
// stats().manifest_errors, one stderr line; the tier and its blocks are untouched.
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
  Status CheckpointOnClose(const std::function<void(const BlockVisitor&)>& for_each_block) override;

  size_t slot_bytes() const { return slot_bytes_; }
  // Where a location lives (for tests that damage slots on purpose).
  std::string SegmentPath(uint64_t location) const;
  uint64_t SlotOffset(uint64_t location) const;

 private:
  DiskTier() = default;
  Status OpenSegments(bool cold);
  void Recover();  // RESTART CONTRACT: the manifest, else Scan
  void Scan();
  Status WriteManifest(const std::function<void(const BlockVisitor&)>& for_each_block);
  void InvalidateManifest();
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
  static constexpr uint64_t kNoSequence = ~uint64_t{0};
  // Write sequence of the block in each slot (kNoSequence: none completely written). Written by
  // WriteBatch for the slots it owns (between Reserve and Release), read at CheckpointOnClose.
  std::vector<uint64_t> sequence_;
  DiskMeta meta_{};
  std::atomic<bool> manifest_live_{false};  // a manifest this tier wrote is on disk
  std::string recovery_;

  std::vector<RecoveredBlock> recovered_;
  uint64_t recovered_count_ = 0;
  std::string cold_start_reason_;
  std::atomic<uint64_t> blocks_written_{0}, blocks_read_{0}, write_errors_{0}, no_space_{0},
      read_errors_{0}, corrupted_{0}, write_ns_{0}, read_ns_{0}, manifest_errors_{0};
};

}  // namespace tpusync::tier
