#include "tpusync/engine/copy.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "tpusync/base/stream_copy.h"

namespace tpusync::engine {

namespace {
constexpr size_t kStreamSpanBytes = 4096;
// Runs handed to StreamStoreRuns at once (and cancellation checked between): enough for the lanes
// to stay full across runs, small enough to stop soon after a cancel.
constexpr size_t kStreamGroupRuns = 256;
constexpr size_t kStreamGroupBytes = size_t{4} << 20;
}  // namespace

std::vector<CopySpan> CoalesceSpans(std::vector<CopySpan> spans) {
  size_t out = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const CopySpan& s = spans[i];
    if (s.bytes == 0) continue;
    if (out > 0) {
      CopySpan& last = spans[out - 1];
      if (last.dst + last.bytes == s.dst && last.src + last.bytes == s.src) {
        last.bytes += s.bytes;
        continue;
      }
    }
    spans[out++] = s;
  }
  spans.resize(out);
  return spans;
}

std::vector<std::vector<CopySpan>> PartitionCopies(const std::vector<CopySpan>& spans, size_t parts,
                                                   size_t chunk) {
  size_t total = 0;
  for (const auto& s : spans) total += s.bytes;
  if (total == 0 || parts == 0) return {};
  chunk = std::max<size_t>(chunk, 4096);
  // Fewer parts than workers when there is too little work to be worth a thread hop.
  parts = std::clamp<size_t>(total / (256 * 1024), 1, parts);
  const size_t target = (total + parts - 1) / parts;
  std::vector<std::vector<CopySpan>> out(1);
  size_t in_part = 0;
  for (const auto& s : spans) {
    size_t off = 0;
    while (off < s.bytes) {
      if (in_part >= target && out.size() < parts) {
        out.emplace_back();
        in_part = 0;
      }
      const size_t room = target > in_part ? target - in_part : chunk;
      const size_t n = std::min({s.bytes - off, room, chunk});
      out.back().push_back({s.dst + off, s.src + off, n});
      off += n;
      in_part += n;
    }
  }
  return out;
}

Future CopyAsync(ThreadPool& pool, std::vector<CopySpan> spans) {
  auto parts = PartitionCopies(CoalesceSpans(std::move(spans)), pool.num_threads());
  std::vector<ThreadPool::Task> tasks;
  tasks.reserve(parts.size());
  for (auto& part : parts) {
    tasks.push_back([part = std::move(part)](const FutureCore& self) -> Status {
      // Spans of kStreamSpanBytes and up use non-temporal stores: a batch copy's destination
      // (pool blocks, or cache blocks about to be overwritten) is not read back soon, and
      // ordinary stores would first read every destination line (see base/stream_copy.h).
      // They go to StreamStoreRuns in groups, which copies several runs at once (LANE
      // CONTRACT): a gather of many short runs keeps several page streams in flight.
      // Cancellation is checked between groups.
      std::vector<StreamRun> group;
      group.reserve(kStreamGroupRuns);
      size_t group_bytes = 0;
      bool streamed = false;
      auto flush = [&] {
        if (group.empty()) return;
        StreamStoreRuns(group.data(), group.size());
        streamed = true;
        group.clear();
        group_bytes = 0;
      };
      for (const auto& s : part) {
        if (s.bytes < kStreamSpanBytes) {
          std::memcpy(s.dst, s.src, s.bytes);
          continue;
        }
        group.push_back({s.dst, s.src, s.bytes});
        group_bytes += s.bytes;
        if (group.size() == kStreamGroupRuns || group_bytes >= kStreamGroupBytes) {
          flush();
          if (self.cancel_requested()) {
            StreamFence();
            return Status::Cancelled("copy cancelled");
          }
        }
      }
      flush();
      if (streamed) StreamFence();  // visible before the future completes
      return Status::OK();
    });
  }
  return pool.SubmitBatch(std::move(tasks));
}

double TimedMemcpySeconds(void* dst, const void* src, size_t bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  std::memcpy(dst, src, bytes);
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

}  // namespace tpusync::engine
