// BlockTier: one storage level of the KV store (host DRAM, local/shared disk, later remote nodes).
//
// TIER CONTRACT: a tier stores fixed-size blocks (block_bytes(), set at creation) in numbered
// locations. It knows nothing about LRU, pins or other tiers: the store (store/kv_store.h) owns
// those decisions and calls, for one block, Reserve -> WriteBatch -> (ReadBatch)* -> Release.
// Every written block carries its key, length and XXH3 checksum (tier/slot_header.h); ReadBatch
// verifies all three and reports kCorrupted (never data) on a mismatch or a truncated slot.
//
// HOLD CONTRACT: Hold(location) keeps a location's bytes valid while a read or a demotion copies
// them; Release of a held location frees it only when the last hold ends, so a concurrent evict
// never lets a reused slot be read as someone else's block.
//
// BATCH CONTRACT: WriteBatch / ReadBatch are synchronous, report one Status per op (a full disk
// fails only the ops it hit), and are safe to call from several threads on distinct locations.
// The store runs them on engine threads and turns them into futures. Rejected alternative: an
// asynchronous tier interface (callbacks per op) - every backend would re-implement completion
// plumbing; the store already has a thread pool and futures, and io_uring batches within a call.
//
// Recovered() lists the valid blocks found when the tier attached existing storage (warm restart)
// with the sequence they were written in, so the store can rebuild its index in LRU order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/block/block_index.h"

namespace tpusync::tier {

struct BlockWrite {
  std::string_view key;
  const uint8_t* data = nullptr;  // block_bytes() readable bytes
  uint64_t location = 0;
  uint64_t sequence = 0;  // store-wide write order (persisted in the header)
  Status status;          // out
  // in, optional: the XXH3-64 the bytes must have. The host tier hashes them as it copies and
  // fails the op kCorrupted (slot left empty) on a mismatch: a copy out of memory the store does
  // not own (a caller's get buffer, when a disk or remote hit is promoted) may have changed since
  // it was verified. Other tiers ignore it: the store only sets it when promoting a hit of a lower
  // tier, and the host tier is the only tier promoted into.
  std::optional<uint64_t> expect_checksum;
};

struct BlockRead {
  std::string_view key;    // the key the slot must hold (checked against its header)
  uint8_t* dst = nullptr;  // block_bytes() writable bytes
  uint64_t location = 0;
  Status status;  // out: kCorrupted on checksum / key / length mismatch or a truncated slot
  // out: the XXH3-64 the tier verified the bytes against: the slot header's (disk), the one the
  // reply frame carried for the block (remote); unset where the tier checks none itself.
  std::optional<uint64_t> checksum;
};

struct RecoveredBlock {
  std::string key;
  uint64_t location = 0;
  uint64_t sequence = 0;
};

struct TierStats {
  size_t capacity_blocks = 0;
  size_t used_blocks = 0;
  uint64_t blocks_written = 0;
  uint64_t blocks_read = 0;
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  uint64_t write_errors = 0;  // every failed write, ENOSPC included
  uint64_t no_space_errors = 0;
  uint64_t read_errors = 0;  // I/O errors on read (not corruption)
  uint64_t corrupted = 0;    // checksum / header mismatches and truncated slots
  uint64_t recovered = 0;    // valid blocks found at attach
  uint64_t write_ns = 0;     // summed wall time of WriteBatch calls
  uint64_t read_ns = 0;
  bool direct_io = false;         // disk: O_DIRECT in use
  std::string io_backend;         // disk: "io_uring" or "pread"
  std::string huge_pages;         // host: "on", "collapsing" (HostPool HUGE-PAGE CONTRACT), "off"
  std::string cold_start_reason;  // non-empty when existing storage was discarded at attach
  // disk: how Open found its blocks: "cold", "scan", "manifest" (a clean-close manifest, nothing
  // journaled after it) or "checkpoint" (a manifest plus the headers of the journaled slots).
  std::string recovery;
  uint64_t recovery_slots_read = 0;  // disk: slot headers read by Open (all of them for "scan")
  uint64_t manifest_errors = 0;      // disk: manifests (clean-close or checkpoint) not written
  uint64_t checkpoints = 0;          // disk: checkpoint manifests written while serving
  uint64_t journaled = 0;            // disk: slots journaled since the last manifest
  // disk: how a checkpoint's manifest is written back (tier/disk_manifest.h WRITE-BACK CONTRACT):
  // "progressive" or "at_fsync" (DiskTierOptions::manifest_progressive_write_back).
  std::string manifest_write_back;
};

// Called once per block by a checkpoint's enumerator.
using BlockVisitor = std::function<void(std::string_view key, uint64_t location)>;
// CHUNKED WALK: the enumerator a checkpoint gets. Each call visits the NEXT chunk of the blocks
// the store indexes in the tier (the store: at most 4096 keys, under its index lock held for that
// call only, block/block_index.h CURSOR CONTRACT) and returns true while more may follow, false
// once the walk is complete. The tier does its own work (locks, file writes) between calls, so
// neither the index lock nor memory is held for the whole tier at once. Rejected: one call over
// every key (what this was: the index lock held for the whole walk - 60 ms at 10^6 keys, seconds
// at 1.6 * 10^7 - and ~80 bytes per key copied out, 1.3 GB at 1.6 * 10^7).
using BlockChunks = std::function<bool(const BlockVisitor& visit)>;
// An enumerator that visits everything in one chunk (tests, small fixed lists).
inline BlockChunks OneChunk(std::function<void(const BlockVisitor&)> all) {
  return [all = std::move(all)](const BlockVisitor& visit) {
    all(visit);
    return false;
  };
}

class BlockTier {
 public:
  virtual ~BlockTier() = default;

  virtual block::Tier kind() const = 0;
  virtual size_t block_bytes() const = 0;
  virtual size_t capacity() const = 0;  // blocks
  virtual size_t used() const = 0;      // reserved + held-for-release locations

  // A free location, or kPoolExhausted when every location is in use.
  virtual Result<uint64_t> Reserve() = 0;
  // Returns a location. With `forget` the block is also invalidated in storage so that a restart
  // does not recover it (explicit remove / corruption); plain eviction may leave the bytes behind
  // because a later write to the slot replaces them and a key always names the same content.
  virtual void Release(uint64_t location, bool forget) = 0;
  virtual Status Hold(uint64_t location) = 0;
  virtual void Unhold(uint64_t location) = 0;

  virtual void WriteBatch(std::span<BlockWrite> ops) = 0;
  virtual void ReadBatch(std::span<BlockRead> ops) = 0;
  // Memory address of a location when the tier is byte-addressable host memory, else nullptr.
  virtual const uint8_t* Address(uint64_t location) const { return nullptr; }

  // SHARED TIER HOOK: a tier that other processes also write (the remote tier over store nodes)
  // may hold blocks this store never wrote. AdoptPrefix finds the leading run of `keys` it holds,
  // reserves a location for each (the caller indexes them, or Releases those it does not want)
  // and returns how many; locations->size() equals the result. Private tiers hold nothing they
  // were not given: the default finds nothing.
  virtual size_t AdoptPrefix(std::span<const std::string_view> keys,
                             std::vector<uint64_t>* locations) {
    locations->clear();
    return 0;
  }

  // Valid blocks found when existing storage was attached (empty after a cold start). Their
  // locations are already reserved.
  virtual std::vector<RecoveredBlock> TakeRecovered() = 0;
  virtual TierStats stats() const = 0;

  // CLEAN-CLOSE HOOK: the store calls this once when it closes cleanly, after its last write to
  // the tier finished and before the tier is destroyed. next_chunk(visit) calls visit(key,
  // location) for the blocks the store indexes in this tier, one chunk per call (CHUNKED WALK). A
  // tier whose next attach can skip work with that list records it (the disk tier's manifest,
  // tier/disk_tier.h CLEAN-CLOSE CONTRACT); the default does nothing. A failure costs the next
  // attach its shortcut, nothing else (the tier counts and logs it).
  virtual Status CheckpointOnClose(const BlockChunks& next_chunk) {
    (void)next_chunk;
    return Status::OK();
  }

  // CHECKPOINT HOOK: the same list, taken while the store serves (puts and gets keep running),
  // by the store's checkpoint thread when ChangesSinceCheckpoint() says it is worth it (or at
  // once when CheckpointMissing()). Keys move between chunks and while one is visited: the tier
  // must make that safe (the disk tier's journal, tier/disk_tier.h CHECKPOINT CONTRACT). The
  // default does nothing and reports 0.
  virtual Status Checkpoint(const BlockChunks& next_chunk) {
    (void)next_chunk;
    return Status::OK();
  }
  // Slots changed since the last checkpoint (or, with none on disk, blocks held: a first one is
  // due). 0: nothing to checkpoint.
  virtual uint64_t ChangesSinceCheckpoint() const { return 0; }
  // FIRST CHECKPOINT: true while the tier has no checkpoint on disk to restart from (a cold start,
  // an open by scan, a journal that failed): a crash now would cost the next open a scan of every
  // slot. The store's checkpoint thread then writes one at once instead of waiting for its time
  // or count (at Open itself when the tier is empty: an empty walk, no wait). Default: false.
  virtual bool CheckpointMissing() const { return false; }
};

}  // namespace tpusync::tier
