// HostPool: one contiguous, page-aligned region of host memory that blocks are carved from.
//
// PREFAULT CONTRACT: every page of the pool is faulted in before Create returns (MAP_POPULATE, and
// a touch of every page where the kernel ignored it), so no copy into the pool ever pays
// first-touch page faults (measured ~10x slower than a warm memcpy on the reference machine).
//
// SHARED-SEGMENT CONTRACT: with a non-empty `shm_name` the pool lives in /dev/shm/<shm_name>. It is
// created if absent; if present with the same size and `attach_existing`, it is mapped as is (its
// bytes kept: this is how a restarted server re-attaches a warm cache); a size mismatch is an
// error, never a silent resize. With `persist` false the segment is unlinked when the pool is
// destroyed; a process killed by SIGKILL never runs that, which is the point of warm restart.
// While the pool lives it holds a shared flock on the segment, so a dead owner's non-persistent
// segment can be told from a live one and reclaimed (OWNER LOCK CONTRACT, shm_reclaim.h).
//
// Huge pages and mlock are best-effort: a refusal is recorded (huge_pages_active(), locked()) and
// the pool still works.
//
// HUGE-PAGE CONTRACT (shared segments): /dev/shm pages are 4 KiB unless the administrator enabled
// shmem huge pages (shmem_enabled is "never" on many hosts, and /dev/shm is rarely mounted with
// huge=). With `huge_pages`, a shared segment is rebuilt from 2 MiB pages with
// madvise(MADV_COLLAPSE) (Linux 6.1+, honoured unless shmem huge pages are "deny"), which keeps
// the bytes (a re-attached warm segment is collapsed in place). Measured on the development VM:
// copies into a 4 KiB-page segment ran at 0.4-0.5x the speed of copies into huge-page memory,
// collapsed ones at 1.0x (docs/tiers.md). The collapse costs ~3 s per GiB here, so it runs on a
// background thread in 32 MiB steps after Create returns: the pool is usable at once (the kernel
// collapses live memory safely, bytes kept, concurrent copies just wait on the range being
// rebuilt), copies speed up as it proceeds, destruction stops it between steps.
// WaitHugePages(timeout) waits for its end (benchmarks, tests). Rejected: collapsing inside Create
// (a 100 GiB host tier would add minutes to every server start) and leaving the segment on 4 KiB
// pages with translation prefetch in the copy loops (measured +10%, not 2x).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "tpusync/base/status.h"

namespace tpusync::memory {

struct HostPoolOptions {
  size_t size_bytes = 0;
  std::string shm_name;         // empty: anonymous private mapping
  bool attach_existing = true;  // shm only: map an existing segment instead of failing
  bool persist = false;         // shm only: keep the segment after destruction
  bool prefault = true;
  bool huge_pages = false;  // try MAP_HUGETLB, then transparent huge pages (madvise)
  bool mlock = false;       // try to lock the pool in RAM
};

class HostPool {
 public:
  static Result<std::unique_ptr<HostPool>> Create(const HostPoolOptions& options);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& shm_name() const { return shm_name_; }
  // True when an existing /dev/shm segment was mapped (its previous contents are visible).
  bool attached() const { return attached_; }
  // True when the pool is (being) backed by huge pages: MAP_HUGETLB / THP for anonymous pools;
  // for shared segments, once the background collapse's first step succeeded.
  bool huge_pages_active() const { return huge_pages_active_.load(std::memory_order_acquire); }
  // Waits up to `timeout` for a shared segment's background collapse to finish; true when no
  // collapse is running (finished, refused, or never started).
  bool WaitHugePages(std::chrono::milliseconds timeout) const;
  // True while a shared segment's background collapse runs.
  bool collapsing() const { return collapsing_.load(std::memory_order_acquire); }
  bool locked() const { return locked_; }
  // Unlinks the /dev/shm segment now (the mapping stays valid until destruction).
  Status Unlink();

 private:
  HostPool() = default;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string shm_name_;
  bool persist_ = false;
  bool attached_ = false;
  std::atomic<bool> huge_pages_active_{false};
  bool locked_ = false;
  bool unlinked_ = false;
  int owner_fd_ = -1;  // shm only: the segment, open and flock'ed shared (OWNER LOCK CONTRACT)
  // Background collapse of a shared segment (HUGE-PAGE CONTRACT).
  void StartCollapse();
  std::atomic<bool> stop_collapse_{false};
  std::atomic<bool> collapsing_{false};
  std::thread collapser_;
};

}  // namespace tpusync::memory
