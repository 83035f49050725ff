#include "tpusync/tier/slot_header.h"

#include <cstring>

#include "tpusync/base/checksum.h"

namespace tpusync::tier {

void FillSlotHeader(SlotHeader* h, std::string_view key, uint64_t length, uint64_t checksum,
                    uint64_t sequence, uint64_t fingerprint) {
  std::memset(h, 0, sizeof(*h));
  h->magic = kSlotMagic;
  h->version = kSlotHeaderVersion;
  h->key_len = static_cast<uint8_t>(key.size());
  h->flags = kSlotValid;
  h->length = length;
  h->checksum = checksum;
  h->sequence = sequence;
  h->fingerprint = fingerprint;
  std::memcpy(h->key, key.data(), key.size());
  h->header_checksum = Checksum64(h, offsetof(SlotHeader, header_checksum));
}

Status CheckSlotHeader(const SlotHeader& h, uint64_t length, uint64_t fingerprint) {
  if (h.magic == 0 && h.flags == 0) return Status::NotFound("empty slot");
  if (h.magic != kSlotMagic) return Status::Corrupted("slot header magic mismatch");
  if (h.version != kSlotHeaderVersion) {
    return Status::Corrupted(
        StrCat("slot header version ", h.version, " (expected ", kSlotHeaderVersion, ")"));
  }
  if (h.header_checksum != Checksum64(&h, offsetof(SlotHeader, header_checksum))) {
    return Status::Corrupted("slot header checksum mismatch (torn or overwritten header)");
  }
  if (h.flags != kSlotValid) return Status::NotFound("invalidated slot");
  if (h.key_len == 0 || h.key_len > block::kMaxKeyBytes) {
    return Status::Corrupted("slot header key length out of range");
  }
  if (h.fingerprint != fingerprint) {
    return Status::Corrupted("slot written under another model fingerprint");
  }
  if (h.length != length) {
    return Status::Corrupted(
        StrCat("slot holds a ", h.length, "-byte block, the tier stores ", length, "-byte blocks"));
  }
  return Status::OK();
}

std::string_view SlotKey(const SlotHeader& h) {
  return {reinterpret_cast<const char*>(h.key), h.key_len};
}

Status VerifyBlock(const SlotHeader& h, std::string_view key, const uint8_t* payload,
                   uint64_t length, uint64_t fingerprint) {
  Status s = CheckSlotHeader(h, length, fingerprint);
  if (s.code() == StatusCode::kNotFound) return Status::Corrupted("slot is empty or invalidated");
  TPUSYNC_RETURN_IF_ERROR(s);
  if (SlotKey(h) != key) return Status::Corrupted("slot holds another key");
  if (Checksum64(payload, length) != h.checksum) {
    return Status::Corrupted("block payload checksum mismatch");
  }
  return Status::OK();
}

}  // namespace tpusync::tier
