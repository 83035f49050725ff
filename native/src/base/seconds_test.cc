#include "tpusync/base/seconds.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace tpusync {
namespace {

TEST(Seconds, InfinityAndHugeValuesMeanForeverNotAnExpiredWait) {
  const auto forever = SecondsToDuration(kForeverSeconds);
  EXPECT_GT(forever, std::chrono::hours(24 * 365 * 30));
  for (double s : {std::numeric_limits<double>::infinity(), 1e300, 1e10, 9.3e9}) {
    EXPECT_EQ(SecondsToDuration(s), forever) << s;
    // now() + the duration must still lie in the future (it overflowed to the past before).
    EXPECT_GT(std::chrono::steady_clock::now() + SecondsToDuration(s),
              std::chrono::steady_clock::now())
        << s;
  }
  EXPECT_EQ(SecondsToMs(std::numeric_limits<double>::infinity()),
            std::chrono::duration_cast<std::chrono::milliseconds>(forever));
}

TEST(Seconds, OrdinaryValuesConvertAndNonPositiveOrNanAreZero) {
  EXPECT_EQ(SecondsToDuration(1.5), std::chrono::milliseconds(1500));
  EXPECT_EQ(SecondsToMs(0.0015), std::chrono::milliseconds(1));
  for (double s : {0.0, -1.0, -std::numeric_limits<double>::infinity(), std::nan("")}) {
    EXPECT_EQ(SecondsToDuration(s), std::chrono::steady_clock::duration::zero()) << s;
  }
}

}  // namespace
}  // namespace tpusync
