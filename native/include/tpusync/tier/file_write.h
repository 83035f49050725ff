// write(2) until every byte is stored, for the disk tier's small metadata files (the checkpoint
// manifest, tier/disk_manifest.h, and the slot journal, tier/disk_journal.h).
#pragma once

#include <cstddef>
#include <string>

#include "tpusync/base/status.h"

namespace tpusync::tier {

// Writes `bytes` from `data` to fd, retrying short writes and EINTR. Errors name `what` (e.g.
// "journal <path>"): kNoSpace for ENOSPC / EDQUOT (Status::FromErrno) and for a write that
// stores 0 bytes; the errno's code otherwise. The file offset is wherever the failed write left it.
Status WriteAll(int fd, const void* data, size_t bytes, const std::string& what);

}  // namespace tpusync::tier
