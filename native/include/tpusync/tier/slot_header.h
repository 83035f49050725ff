// SlotHeader: the self-describing header in front of every stored block, in /dev/shm metadata and
// in every disk slot. Layout is part of the on-disk format (kSlotHeaderVersion).
//
// HEADER CONTRACT: a header is valid only if magic, version and header_checksum match; the block
// behind it is valid only if its length equals the tier's block size, its key is the key asked
// for, and XXH3(payload) == checksum. A writer invalidates the header (or writes header and payload
// in one I/O) before new payload bytes can be observed, so a crash mid-write leaves a header whose
// checksum or payload checksum fails: the block reads as a miss, never as wrong data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "tpusync/base/status.h"
#include "tpusync/block/block_key.h"

namespace tpusync::tier {

inline constexpr uint32_t kSlotMagic = 0x4b425354;  // "TSBK" little-endian
inline constexpr uint16_t kSlotHeaderVersion = 1;
inline constexpr uint8_t kSlotValid = 1;

struct SlotHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t key_len;
  uint8_t flags;         // kSlotValid
  uint64_t length;       // payload bytes
  uint64_t checksum;     // XXH3-64 of the payload
  uint64_t sequence;     // store-wide write order
  uint64_t fingerprint;  // XXH3-64 of the model fingerprint string
  uint8_t key[block::kMaxKeyBytes];
  uint64_t header_checksum;  // XXH3-64 of every byte above
  uint8_t reserved[16];
};
static_assert(sizeof(SlotHeader) == 128, "SlotHeader is an on-disk format: 128 bytes");
static_assert(offsetof(SlotHeader, key) == 40);
static_assert(offsetof(SlotHeader, header_checksum) == 104);

// Fills every field (header_checksum last) for a valid block.
void FillSlotHeader(SlotHeader* h, std::string_view key, uint64_t length, uint64_t checksum,
                    uint64_t sequence, uint64_t fingerprint);
// OK when magic, version, flags, header checksum, fingerprint and length are right (the key and
// payload checksum are checked by the reader, who knows them). kCorrupted / kNotFound otherwise:
// kNotFound for an empty (never written or invalidated) header.
Status CheckSlotHeader(const SlotHeader& h, uint64_t length, uint64_t fingerprint);
std::string_view SlotKey(const SlotHeader& h);
// Verifies header, key and payload of a block read back.
Status VerifyBlock(const SlotHeader& h, std::string_view key, const uint8_t* payload,
                   uint64_t length, uint64_t fingerprint);

}  // namespace tpusync::tier
