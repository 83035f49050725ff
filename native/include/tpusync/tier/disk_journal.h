// Disk slot journal: the slots a disk tier changed since its last checkpoint manifest, so that a
// restart after a crash reads the manifest plus the headers of only those slots instead of every
// slot header (tier/disk_tier.h RESTART and CHECKPOINT CONTRACTs; docs/tiers.md "Crash semantics").
//
// FILE: <dir>/journal-<generation as 16 hex digits>, created as <name>.tmp holding only its header
// and renamed in (so a journal file present under its final name always has a whole header), then
// appended to with O_APPEND:
//   JournalHeader                  magic, version, generation, tier.meta checksum, own checksum
//   JournalRecord x n              slot number + a check of (slot, generation)
// A size that is not header + a whole number of records is a journal truncated mid-record.
//
// JOURNAL CONTRACT: a slot's number is appended to the current journal BEFORE its bytes on disk
// change (a block write, or the zeroed header of a forgotten block), in one write(2) per batch.
// No fsync: the crash model is a process crash (SIGKILL, OOM kill, abort), after which the page
// cache still holds every completed write(2), in order; power loss is out of scope (a KV cache can
// be recomputed; docs/tiers.md). A manifest of generation G (tier/disk_manifest.h) is valid only
// together with journal-G and every later generation, contiguous: the slots they list are exactly
// those whose bytes may differ from the manifest's entries, and recovery reads their headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/tier/disk_tier.h"

namespace tpusync::tier {

inline constexpr uint32_t kJournalMagic = 0x4e4a5354;  // "TSJN" little-endian
inline constexpr uint16_t kJournalVersion = 1;

struct JournalHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t reserved0;
  uint64_t generation;
  uint64_t meta_checksum;    // DiskMeta::header_checksum of the tier it belongs to
  uint64_t header_checksum;  // XXH3-64 of every byte above
};
static_assert(sizeof(JournalHeader) == 32, "JournalHeader is an on-disk format");
static_assert(offsetof(JournalHeader, header_checksum) == 24);

struct JournalRecord {
  uint32_t slot;
  uint32_t check;  // low 32 bits of XXH3-64 over (slot, generation): a stray or torn record fails
};
static_assert(sizeof(JournalRecord) == 8, "JournalRecord is an on-disk format");

std::string JournalPath(const std::string& dir, uint64_t generation);

// One journal generation, open for appending.
class JournalWriter {
 public:
  // Creates <dir>/journal-<generation> (tmp + rename; an existing one is replaced).
  static Result<std::unique_ptr<JournalWriter>> Create(const std::string& dir, uint64_t generation,
                                                       const DiskMeta& meta);
  ~JournalWriter();
  JournalWriter(const JournalWriter&) = delete;
  JournalWriter& operator=(const JournalWriter&) = delete;

  // Appends one record per slot in one write(2) (JOURNAL CONTRACT). Not thread-safe.
  Status Append(std::span<const uint64_t> slots);
  uint64_t generation() const { return generation_; }

 private:
  JournalWriter() = default;
  std::string path_;
  std::string what_;  // "journal <path>", built once: Append runs on every write batch
  int fd_ = -1;
  uint64_t generation_ = 0;
};

struct JournalContents {
  std::vector<uint64_t> slots;  // every record of every generation read, in order
  uint64_t last_generation = 0;
};

// Reads journal-<from> and every later generation. kCorrupted (with the reason) when journal-<from>
// is missing, a generation is skipped, or a file is truncated mid-record, damaged, of another
// generation or another tier.meta; generations below `from` are ignored.
Status ReadJournals(const std::string& dir, const DiskMeta& meta, uint64_t from,
                    uint64_t num_blocks, JournalContents* out);

// Generations of the journal files in dir (sorted; .tmp leftovers are not listed).
std::vector<uint64_t> ListJournals(const std::string& dir);

// Deletes every journal (and .tmp leftover) whose generation is below `below`. Best effort: the
// first failure is returned, the rest are still tried.
Status RemoveJournals(const std::string& dir, uint64_t below);

}  // namespace tpusync::tier
