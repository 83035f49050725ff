// Seconds (a double: Python timeouts, config intervals) to a steady-clock duration.
//
// SECONDS CONTRACT: SecondsToDuration never overflows. NaN and anything at or below 0 give zero;
// anything above kForeverSeconds (about 31 years, far inside the clock's int64 nanoseconds even
// when added to now()) gives kForeverSeconds. So `inf` or 1e300 mean "for ever", where a plain
// duration_cast overflowed to a negative duration: an already-expired wait (seen: wait(inf)
// returning False at once, flush(inf) raising TimeoutError, checkpoint_s=inf checkpointing every
// 100 ms). Callers that must refuse NaN or non-positive values check before converting.
#pragma once

#include <chrono>
#include <cmath>

namespace tpusync {

inline constexpr double kForeverSeconds = 1e9;

inline std::chrono::steady_clock::duration SecondsToDuration(double seconds) {
  if (!(seconds > 0)) return std::chrono::steady_clock::duration::zero();  // NaN too
  const double s = seconds < kForeverSeconds ? seconds : kForeverSeconds;
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(s));
}

// Whole milliseconds, with the same rules.
inline std::chrono::milliseconds SecondsToMs(double seconds) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(SecondsToDuration(seconds));
}

}  // namespace tpusync
