// Disk manifest: the clean-shutdown list of a disk tier's blocks, so the next open need not read
// every slot header (tier/disk_tier.h RESTART CONTRACT; docs/tiers.md "Layout on disk").
//
// FILE: <dir>/manifest, written as <dir>/manifest.tmp, fsync'ed, renamed over, directory fsync'ed.
//   ManifestHeader                 magic, version, a byte copy of tier.meta (DiskMeta), counts,
//                                  the checksum of everything after the header, its own checksum
//   SegmentStamp x num_segments    size, inode and mtime of every segment file at write time
//   ManifestEntry x num_entries    slot, write sequence, key of every block the tier holds
// The file's size is exactly header + stamps + entries: anything else is a truncated manifest.
//
// MANIFEST CONTRACT: a manifest is written only after the last write to the tier finished (the
// store's clean close: tier.h CLEAN-CLOSE HOOK), by the one process holding the directory's flock,
// and deleted by the next open before the tier serves, whether it was used or not - so after a
// crash (no clean close) there is no manifest and the next open scans the headers. It is trusted
// only when its tier.meta copy is byte-equal to the current one, its format version, counts,
// size and checksums are right, every slot is in range and listed once, and every segment file
// still has the size, inode and mtime it had at write time (a writer that does not know about
// manifests - an older tpusync - changes the mtime; the mtime is only as fine as the filesystem's
// timestamp clock, so this is a guard against other writers, not the correctness argument).
// Entries are then taken WITHOUT reading headers. That is safe because it cannot serve wrong
// bytes: every read verifies the slot header's key and the payload checksum (base/checksum.h
// CHECKSUM CONTRACT, tier/slot_header.h HEADER CONTRACT), so a wrong entry can only cost a
// counted miss (kCorrupted, the slot reclaimed) - never stale data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tpusync/base/checksum.h"
#include "tpusync/base/status.h"
#include "tpusync/block/block_key.h"
#include "tpusync/tier/disk_tier.h"
#include "tpusync/tier/tier.h"

namespace tpusync::tier {

inline constexpr uint32_t kManifestMagic = 0x4e4d5354;  // "TSMN" little-endian
// Version 2 added `kind` and `generation` (the slot journal, tier/disk_journal.h); a version-1
// manifest left by an older build is not used (one scan).
inline constexpr uint16_t kManifestVersion = 2;
inline constexpr char kManifestFile[] = "manifest";
// The manifest a Commit replaced, until RemoveOldManifest frees it (OLD-MANIFEST CONTRACT).
inline constexpr char kOldManifestFile[] = "manifest.old";

enum class ManifestKind : uint16_t {
  kCleanClose = 1,  // written by CheckpointOnClose: nothing was writing the tier
  kCheckpoint = 2,  // written while the tier served (DiskTier::Checkpoint)
};

struct ManifestHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t kind;  // ManifestKind
  DiskMeta meta;  // byte copy of the tier.meta the manifest was written under
  uint64_t num_segments;
  uint64_t num_entries;
  // JOURNAL CONTRACT (tier/disk_journal.h): every slot changed after the entries were taken is
  // listed in journal-<generation> or a later generation.
  uint64_t generation;
  uint64_t body_checksum;    // XXH3-64 of the stamps and entries, in file order
  uint64_t header_checksum;  // XXH3-64 of every byte above
};
static_assert(sizeof(ManifestHeader) == 200, "ManifestHeader is an on-disk format");
static_assert(offsetof(ManifestHeader, meta) == 8);
static_assert(offsetof(ManifestHeader, generation) == 176);
static_assert(offsetof(ManifestHeader, header_checksum) == 192);

struct SegmentStamp {
  uint64_t size;
  uint64_t inode;
  int64_t mtime_s;
  int64_t mtime_ns;
  bool operator==(const SegmentStamp&) const = default;
};
static_assert(sizeof(SegmentStamp) == 32, "SegmentStamp is an on-disk format");

struct ManifestEntry {
  uint64_t sequence;  // the write sequence in the slot's header
  uint32_t slot;      // global slot number (DiskTier location)
  uint8_t key_len;
  uint8_t reserved[3];
  char key[block::kMaxKeyBytes];
};
static_assert(sizeof(ManifestEntry) == 80, "ManifestEntry is an on-disk format");
static_assert(offsetof(ManifestEntry, key) == 16);

// The stamp of an open segment file (fstat).
Result<SegmentStamp> StampSegment(int fd, const std::string& path);

// How manifest.tmp reaches the disk before its fsync (WRITE-BACK CONTRACT below).
enum class ManifestWriteBack : uint8_t {
  kProgressive = 0,  // the default: each 1 MiB written is pushed out while the walk goes on
  kAtSync = 1,       // the whole file left dirty until the fsync (before tiers9; tests, drivers)
};

// Streams a manifest into <dir>/manifest.tmp; Commit publishes it atomically. A writer destroyed
// without a successful Commit removes its temp file (a full disk leaves no partial manifest).
//
// WRITE-BACK CONTRACT: with kProgressive, every 1 MiB buffer written to manifest.tmp is handed to
// the disk at once (sync_file_range WRITE) and the buffer before it is waited for (WAIT_BEFORE |
// WRITE | WAIT_AFTER), so at most ~2 MiB of the manifest is dirty or in flight at any moment and
// the final fsync finds ~1 MiB plus the header left. The bytes, the order of the writes and the
// fsync + rename + directory fsync are exactly those of kAtSync (same file, byte for byte:
// DiskManifestTest.ProgressiveWriteBackWritesTheSameManifestAsWriteBackAtTheFsync); only WHEN the
// page cache is written out changes. WHY: a disk put / get (O_DIRECT) running during a checkpoint
// waited behind the manifest's write-out - at 80 MB (10^6 blocks) on the development VM's virtio
// disk (ext4, mq-deadline) 4 KiB O_DIRECT puts / gets saw a p99 of ~30 ms during the write +
// fsync vs ~0.3 ms without; with 1 MiB progressive write-back ~2-4 ms (~3-8 ms on a loaded VM),
// the write paced at the disk's speed instead of memcpy's; through the store at 10^6 blocks, put
// / get p99 19 / 12 ms -> 7 / 1.5 ms (docs/tiers.md "Checkpoints and the slot journal"). The
// writer only waits for its own earlier range, never holding a lock (the tier calls Add with no
// lock held, CHECKPOINT CONTRACT). A filesystem that refuses sync_file_range (EINVAL, ENOSYS,
// EOPNOTSUPP, ESPIPE) gets kAtSync silently; any other error fails the checkpoint like a failed
// write (the fsync would report it too).
// Rejected, with the same driver's figures: dropping the fsync (the crash model is a process
// crash, and a manifest torn by a power loss fails its size / checksum checks: one scan; but the
// stall is not the fsync's: buffered writes of the manifest with no fsync at all still gave puts
// a p99 of 30-45 ms while they ran, the dirty pages' write-out queueing on the same disk and ext4
// journal); the checkpoint thread at IOPRIO_CLASS_IDLE (mq-deadline honours it: p99 ~1.5 ms, but
// the write 3-5x longer, the priority is per thread - KVStore.checkpoint() runs on the caller's
// thread - and an idle-class write may wait prio_aging_expire, 10 s, under sustained load);
// windows of 8 MiB (p99 8-12 ms: a read waits behind more queued writes); PACING the write-out
// (tiers10: each MiB written out and waited for alone, then the disk left idle 1x or 3x as long
// as it took; the checkpoint ~1.3-2.4x longer). Through the store (the bench's checkpoint code,
// variants interleaved, several runs; docs/tiers.md) it lowered the put p99 at 10^6 blocks from
// 2.4-3.5 to 1.7-1.9 (1x) / 1.35-1.75 ms (3x) but not the max (22-41 ms: the free of the
// replaced manifest, OLD-MANIFEST CONTRACT below); once that is freed stepwise, progressive alone
// gives 1.45-2.2 ms, max 3.4-8.4, and pacing adds nothing clear (10^6: 1.6-2.2 ms at 1x, 1.5-1.9
// at 3x, max up to 69; 2 * 10^5 blocks of 16 KiB: 1.8-2.2 -> 1.7-1.9 / 1.3-1.8 ms).
class ManifestWriter {
 public:
  static Result<std::unique_ptr<ManifestWriter>> Begin(
      const std::string& dir, const DiskMeta& meta, std::vector<SegmentStamp> stamps,
      ManifestKind kind, uint64_t generation,
      ManifestWriteBack write_back = ManifestWriteBack::kProgressive);
  ~ManifestWriter();
  ManifestWriter(const ManifestWriter&) = delete;
  ManifestWriter& operator=(const ManifestWriter&) = delete;

  // Appends one entry (buffered). The caller lists each slot once.
  Status Add(uint64_t slot, uint64_t sequence, std::string_view key);
  // Writes the header and fsyncs the temp file (Commit does it when not done yet).
  Status Sync();
  // Renames the temp file over <dir>/manifest (SyncManifestDir then makes that durable).
  Status Commit();
  uint64_t entries() const { return num_entries_; }

 private:
  ManifestWriter() = default;
  Status Drain();  // writes buf_ at the end of the file (and pushes it out: WRITE-BACK CONTRACT)
  Status WriteBack(uint64_t offset, uint64_t bytes);

  std::string dir_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
  bool synced_ = false;
  bool progressive_ = true;
  uint64_t written_ = 0;  // bytes of manifest.tmp written so far
  uint64_t pushed_ = 0;   // [pushed_, written_): written, not yet handed to sync_file_range
  uint64_t waited_ = 0;   // [waited_, pushed_): handed to the disk, not yet waited for
  ManifestHeader header_{};
  uint64_t num_entries_ = 0;
  std::vector<uint8_t> buf_;
  std::unique_ptr<Checksum64Stream> sum_;
};

struct ManifestContents {
  ManifestKind kind = ManifestKind::kCleanClose;
  uint64_t generation = 0;
  std::vector<SegmentStamp> stamps;    // as written
  std::vector<RecoveredBlock> blocks;  // one per entry, in file order
};

// Reads <dir>/manifest and checks it against the tier's current meta and its segment and slot
// counts (MANIFEST CONTRACT). kNotFound when there is none; kCorrupted (with the reason) when it
// must not be trusted; an errno status when it cannot be read. Reads nothing but the manifest.
// The segment stamps are compared by CheckStamps (the caller knows whether the journal is empty).
Status ReadManifest(const std::string& dir, const DiskMeta& want, size_t num_segments,
                    uint64_t num_blocks, ManifestContents* out);

// kCorrupted naming the first segment whose size or inode (and, with `with_mtime`, mtime) differs.
Status CheckStamps(std::span<const SegmentStamp> written, std::span<const SegmentStamp> now,
                   bool with_mtime);

// fsync of the directory (after a Commit; a filesystem refusing it on a directory is fine).
Status SyncManifestDir(const std::string& dir);

// OLD-MANIFEST CONTRACT: Commit links the manifest it replaces as <dir>/manifest.old before the
// rename; this frees that file 1 MiB at a time (ftruncate down, then unlink; nothing to do when
// there is none). WHY: on the development VM (ext4 mounted with `discard`, virtio disk) freeing
// an 80 MB file in one go (the rename over the previous manifest at 10^6 blocks, or an unlink)
// took ~20-35 ms during which 4 KiB O_DIRECT reads on the same disk stalled as long (max 15-30
// ms vs 0.1 ms); freed 1 MiB per ftruncate they stayed at 0.3-0.6 ms (once 2.1; 4 MiB steps:
// 1.2-1.6 ms, 16 MiB: 4-5 ms; an fsync per step changed nothing). Those stalls were the 20-50 ms
// single outliers of puts and gets at the end of a checkpoint: through the store at 10^6 blocks
// the max during a checkpoint went from 22-32 to 3.2-8.4 ms (docs/tiers.md). The file is never
// read; a crash before it is freed leaves it to the next checkpoint or RemoveManifest. A file
// with a second link (a crash between the link and the rename: it names the live manifest) is
// only unlinked, never truncated.
Status RemoveOldManifest(const std::string& dir);

// Deletes <dir>/manifest, a leftover <dir>/manifest.tmp and <dir>/manifest.old, then fsyncs the
// directory so the deletion survives a crash of the machine too. OK when there was nothing to
// delete.
Status RemoveManifest(const std::string& dir);

}  // namespace tpusync::tier
