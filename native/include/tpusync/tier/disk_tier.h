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
//   <dir>/manifest        the blocks the tier held at its last checkpoint or clean close, with the
//                         generation of the journal that follows it (tier/disk_manifest.h)
//   <dir>/journal-<gen>   slot journal: the slots changed after that manifest (tier/disk_journal.h)
//
// RESTART CONTRACT: a tier.meta that disagrees with the options (fingerprint, block size, segment
// size, slot count) means a cold start: old segments, manifest and journals are deleted with one
// stderr line naming the reason. Otherwise Open rebuilds the slot table one of three ways
// (stats().recovery says which; stats().recovery_slots_read how many slot headers it read):
// - "manifest": the store closed cleanly (CheckpointOnClose) and nothing was journaled after it:
//   the manifest's entries are taken as they are, with no header read - one sequential read of
//   ~80 bytes per block instead of a 4 KiB random read per slot (~10 us each on the development
//   VM: 0.6 s at 60k slots, minutes at 16M);
// - "checkpoint": a manifest (periodic checkpoint or clean close) followed by journaled slots,
//   typically after a crash or SIGKILL: the entries are taken, then the headers of ONLY the
//   journaled slots are read (batched through the io backend) and override them: a valid header
//   is that block, an empty or invalid one a free slot (a duplicate key keeps the newest write);
// - "scan": anything else (no manifest: a crash before any checkpoint; a truncated, checksum-
//   failing or mismatching manifest; a journal missing, truncated mid-record, damaged or of
//   another generation: one stderr line names why) - one 4 KiB header read per slot.
// After "manifest" / "checkpoint" the files stay and a new journal generation continues them; after
// "scan" or "cold" they are deleted before the tier serves and journaling starts with the next
// checkpoint. Payload checksums are verified on every read, never at open, so a wrong slot table
// can cost a counted miss but never serve stale bytes (CHECKSUM CONTRACT).
//
// CHECKPOINT CONTRACT (Checkpoint, CheckpointOnClose): a manifest is written while the tier serves,
// and every later change of a slot's bytes is journaled (tier/disk_journal.h JOURNAL CONTRACT:
// the slot number is appended before the write or the zeroed header of Release(forget); plain
// evictions change no byte and are not journaled). One checkpoint, serialised with the others:
//   1. ROTATE: under the journal lock, journal-<G+1> is created and becomes the current journal;
//      journal-<G> and the manifest of G stay valid (a crash now replays G and G+1).
//   2. WALK, in chunks (tier.h CHUNKED WALK): the store's enumerator visits the keys it places
//      in this tier a chunk at a time (4096 keys under its index lock, released between chunks);
//      after each chunk the tier, under its own lock, gives each entry its slot's sequence
//      (leaving out a free slot, a slot with no completed write, a slot listed already) and
//      streams the chunk into manifest.tmp with no lock held - no copy of the whole tier, the
//      index lock never held for more than one chunk. AFTER the whole walk it journals into
//      G+1 every slot it holds that the walk did not list (a write or a forgetting release in
//      flight, a write done but not indexed yet, a block indexed under an entry id the cursor
//      had already passed), scanning its slots in ranges of 65536 under its own lock.
//      WHY A CHUNKED WALK KEEPS THE ARGUMENT: the manifest's entries must be right only for
//      slots whose bytes do not change after the rotation (any change after it is journaled in
//      G+1 and its header overrides the entry at a restart). For such a slot S holding key K:
//      - K stays indexed at S through the walk: its entry id does not move (block_index.h CURSOR
//        CONTRACT: no rehash or resize moves an entry), so it is visited exactly once, listed;
//      - K is indexed at S only after the cursor passed its id (a write finished before the
//        rotation, indexed later), or was moved out and back in under a new id: S is held and
//        unlisted after the walk, so the pass journals it;
//      - K left S during the walk (evicted: no byte changes; S may stay free) - it may be listed
//        or not; listed, a restart finds K's intact bytes at S (what a scan finds too: every
//        read verifies key and checksum), unlisted, S is free at a restart, like in the store.
//      A slot visited twice (K evicted after its visit, S re-used by K2 visited later) is listed
//      once; S's new bytes were journaled by K2's write. Keys inserted, moved or removed between
//      chunks are thus all covered by the rotation BEFORE the walk plus the pass AFTER it.
//   3. WRITE: the header, fsync (manifest.tmp went to the disk 1 MiB at a time while it
//      streamed, so the fsync has ~1 MiB left: tier/disk_manifest.h WRITE-BACK CONTRACT); then,
//      under the journal lock (so a failed journal append cannot slip in between), rename over
//      manifest and fsync the directory; then journals below G+1 are deleted. Puts and gets
//      wait on the index lock for one chunk at most, on this tier's lock for one chunk's
//      sequences or one range of slots, and on the journal lock for one rename (the dir fsync
//      is after it). The manifest the rename replaces is kept as manifest.old and freed 1 MiB at
//      a time after the publish, no lock held (tier/disk_manifest.h OLD-MANIFEST CONTRACT). The
//      segment stamps are taken at the rotation; their mtime is compared at a restart only for a
//      clean-close manifest with nothing journaled after it (a write in flight at the rotation
//      may still move it).
// FIRST CHECKPOINT (tier.h): CheckpointMissing() is true while no manifest of this tier is on disk
// (cold start, scan, failed journal); the store then checkpoints at once (inside Open for an empty
// tier), so a crash soon after a cold start or an open by scan does not cost another scan.
// A journal append that fails (disk full) deletes the manifest and stops journaling until the next
// checkpoint: the next crash restart scans. A failed checkpoint is counted (manifest_errors) and
// logged; the previous manifest and its journals stay valid. The clean close is the same
// procedure with nothing in flight (kind "clean close"; nothing held-but-unlisted is journaled).
// The segment stamps' mtime is compared only for a clean-close manifest with empty journals: the
// tier's own writes change it, and those are journaled (a writer that knows no journal - an older
// tpusync - is then caught only by size / inode; correctness never rested on the manifest).
// Rejected alternatives: the tier keeping every slot's key (up to 72 bytes per slot, a second
// copy of the index); a full index Snapshot() (~130 bytes per key allocated under the store lock);
// one walk of the whole index under its lock, copying 80 bytes per key (the walk before tiers8:
// at 10^6 disk blocks the index lock held ~60 ms at a time, 77 MiB allocated; docs/tiers.md);
// the journal rotated AFTER the walk (a block written between the visit of its slot and the
// rotation would be in neither file); waiting for in-flight writes at the rotation (a stalled
// write would stall the checkpoint; the unlisted-slot pass in 2 needs no wait); replaying every
// journal ever written (unbounded restart time); an fsync per journal append (the crash model is
// a process crash; the page cache keeps the appends in order).
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

class JournalWriter;  // tier/disk_journal.h

struct DiskTierOptions {
  std::string directory;
  size_t block_bytes = 0;
  size_t num_blocks = 0;
  size_t segment_blocks = 0;  // 0: about 1 GiB per segment
  std::string fingerprint;
  bool direct_io = true;            // try O_DIRECT, fall back to buffered where refused
  std::string io_backend = "auto";  // auto | io_uring | pread
  size_t io_threads = 4;            // pread backend threads / io_uring depth hint
  // false: the checkpoint manifest is written back only by its fsync, as before tiers9 (tests and
  // drivers compare the two; tier/disk_manifest.h WRITE-BACK CONTRACT). true: progressively.
  bool manifest_progressive_write_back = true;
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
  Status CheckpointOnClose(const BlockChunks& next_chunk) override;
  Status Checkpoint(const BlockChunks& next_chunk) override;
  uint64_t ChangesSinceCheckpoint() const override;
  bool CheckpointMissing() const override;

  size_t slot_bytes() const { return slot_bytes_; }
  // Where a location lives (for tests that damage slots on purpose).
  std::string SegmentPath(uint64_t location) const;
  uint64_t SlotOffset(uint64_t location) const;

 private:
  DiskTier() = default;
  Status OpenSegments(bool cold);
  void Recover();  // RESTART CONTRACT: the manifest (+ journal), else Scan
  Status RecoverFromManifest(std::string* why);
  void Scan();
  // Reads the slot headers of slot_at(0 .. n-1), batched; visit(slot, header or nullptr).
  void ReadHeaders(size_t n, const std::function<uint64_t(size_t)>& slot_at,
                   const std::function<void(uint64_t, const SlotHeader*)>& visit);
  Status WriteCheckpoint(const BlockChunks& next_chunk, bool clean_close);
  void Journal(std::span<const uint64_t> slots);  // JOURNAL CONTRACT: before the bytes change
  void Free(uint64_t slot);                       // mu_ held
  void RunCoalesced(std::vector<IoOp>& ops);
  // CONFIRMED CORRUPTION: a block read straight into the caller's buffer that fails its check
  // is read again into the tier's own memory before it is called corrupted (and its slot freed):
  // another thread writing that buffer meanwhile (a shared scratch buffer) is not corruption. On
  // success the verified bytes are copied to op.dst.
  Status RereadPrivately(BlockRead& op);
  // RAM a slot costs at open, for the BOOKKEEPING BOUND: the tier's per-slot state (state, holds,
  // forget flag, free stack, sequence: 18 bytes) plus what a KVStore above it reserves (36 bytes
  // a slot measured in all). A full tier costs more: the store's index keeps ~150 bytes a key.
  static constexpr uint64_t kRamPerSlot = 36;
  void RunIo(std::span<IoOp> ops);  // io_->Run, then the DIRECT I/O CONTRACT's per-I/O fallback
  void DropDirectIo();
  const SegmentFile& SegmentOf(uint64_t location) const;

  std::string dir_;
  size_t block_bytes_ = 0, payload_bytes_ = 0, slot_bytes_ = 0, segment_blocks_ = 0,
         num_blocks_ = 0;
  uint64_t fingerprint_ = 0;
  std::atomic<bool> direct_{false};
  bool opened_direct_ = false;        // segments were opened with O_DIRECT (set once, in Open)
  bool progressive_manifest_ = true;  // DiskTierOptions::manifest_progressive_write_back
  std::mutex direct_mu_;              // serialises DropDirectIo
  int lock_fd_ = -1;
  std::unique_ptr<IoBackend> io_;
  std::vector<SegmentFile> segments_;

  mutable std::mutex mu_;
  enum : uint8_t { kFree = 0, kUsed = 1, kReleasing = 2 };
  std::vector<uint8_t> state_;
  std::vector<uint32_t> holds_;
  // HELD FORGET RULE: Release(forget) of a slot a reader holds zeroes its header only when the
  // last hold ends (Unhold), so the reader reads the block whole instead of a zeroed header (it
  // counted a false corruption). Until then the slot is kReleasing: no new hold, no reuse.
  std::vector<uint8_t> forget_on_free_;
  // Journal + zeroed header of a forgotten slot (no lock held: it does I/O).
  void ForgetHeader(uint64_t location);
  std::vector<uint32_t> free_;  // stack, lowest slot on top
  size_t num_used_ = 0;
  static constexpr uint64_t kNoSequence = ~uint64_t{0};
  // Write sequence of the block in each slot (kNoSequence: none completely written). Written by
  // WriteBatch for the slots it owns (between Reserve and Release), read at CheckpointOnClose.
  // Atomic: checkpoints read it while WriteBatch writes other slots' entries.
  std::unique_ptr<std::atomic<uint64_t>[]> sequence_;
  DiskMeta meta_{};
  std::string recovery_;

  std::mutex ckpt_mu_;      // one checkpoint at a time
  mutable std::mutex jmu_;  // journal_, generation_, manifest_generation_ (JOURNAL CONTRACT)
  std::unique_ptr<JournalWriter> journal_;  // null: not journaling (no manifest to follow)
  uint64_t generation_ = 0;                 // newest journal generation created
  uint64_t manifest_generation_ = 0;        // 0: no manifest of this tier on disk
  std::atomic<uint64_t> changes_{0};        // slots journaled since the last manifest
  std::atomic<uint64_t> checkpoints_{0};
  uint64_t recovery_slots_read_ = 0;

  std::vector<RecoveredBlock> recovered_;
  uint64_t recovered_count_ = 0;
  std::string cold_start_reason_;
  std::atomic<uint64_t> blocks_written_{0}, blocks_read_{0}, write_errors_{0}, no_space_{0},
      read_errors_{0}, corrupted_{0}, write_ns_{0}, read_ns_{0}, manifest_errors_{0};
};

}  // namespace tpusync::tier
