// Reclaiming /dev/shm segments left behind by killed processes.
//
// OWNER LOCK CONTRACT: every HostPool on a /dev/shm segment keeps the segment's file open for its
// whole life and holds a shared flock(2) on it (host_pool.cc). The kernel drops that lock when
// the last descriptor goes, i.e. when the owner is destroyed or its process dies by any means
// (SIGKILL, OOM kill), so "no lock can be taken exclusively" means "a live pool owns it". Peers
// that only map a segment (P/D consumers, same-host samplers) take no lock: once the owner is
// gone, their mappings stay valid after the name is unlinked. A child forked (without exec) by
// the owner shares the locked descriptor, so the segment counts as owned while the child lives.
//
// ReclaimStaleSegments(prefix) unlinks every /dev/shm/<prefix>* segment that no live pool owns
// and returns what it removed. It is for the families of NON-persistent names (e.g. a P/D
// producer's "tpusync-pd-" pools, whose names carry a pid and are never re-attached): a process
// killed before its exit handler ran (host_pool.cc, EXIT CONTRACT) otherwise leaves its segment
// in RAM until reboot, one per crash. Never call it with the prefix of a persistent (warm
// restart) namespace: a crashed server's warm cache holds no lock either, and would be removed.
// The caller names the prefix; a prefix shorter than 8 characters is refused so that a typo
// cannot sweep every segment on the host.
//
// Races: the test and the unlink act on one inode. The sweeper takes the exclusive lock on the
// descriptor it opened, then unlinks only if the name still refers to that inode; a creator takes
// its shared lock right after O_EXCL creation and re-checks that the name still refers to its
// inode (HostPool::Create retries otherwise), so a segment is never unlinked under a live pool.
// Segments written by a tpusync older than this contract hold no lock and count as stale.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tpusync/base/status.h"

namespace tpusync::memory {

struct ShmSegment {
  std::string name;  // without the /dev/shm/ prefix
  uint64_t bytes = 0;
  bool owned = false;  // a live pool held its owner lock when looked at
};

// A name /dev/shm/<name> may have: 1-200 letters, digits, '-', '_' and '.', not "." or "..".
bool ValidShmName(std::string_view name);

// Unlinks the stale /dev/shm/<prefix>* segments (OWNER LOCK CONTRACT) and returns them (owned is
// false). Segments that vanish during the scan or cannot be opened are skipped; only a bad prefix
// or an unreadable /dev/shm is an error.
Result<std::vector<ShmSegment>> ReclaimStaleSegments(std::string_view prefix);

// Every /dev/shm/<prefix>* segment with its size and whether a live pool owns it, removing
// nothing (an operator's view: what a reclaim would remove, or which warm caches lost their
// server). The probe takes and drops the exclusive lock, so a pool being created meanwhile waits
// for it a moment. Same prefix rules and errors as ReclaimStaleSegments.
Result<std::vector<ShmSegment>> ListSegments(std::string_view prefix);

// Takes the owner's shared lock on `fd`, the descriptor of /dev/shm/<name>, and checks that the
// name still refers to it. False when a sweeper unlinked the name first (the caller creates the
// segment again); an error only when flock itself fails.
Result<bool> LockSegmentOwner(int fd, const std::string& name);

}  // namespace tpusync::memory
