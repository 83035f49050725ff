#include "tpusync/base/status.h"

#include <cerrno>

#include <gtest/gtest.h>

#include "tpusync/base/checksum.h"

namespace tpusync {
namespace {

Result<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  int h = 0;
  TPUSYNC_ASSIGN_OR_RETURN(h, Half(x));
  return Half(h);
}

TEST(Status, OkIsCheapAndEmpty) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(Status, CarriesCodeAndMessage) {
  Status s = Status::PoolExhausted("full");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kPoolExhausted);
  EXPECT_EQ(s.ToString(), "PoolExhausted: full");
}

TEST(Status, FromErrnoMapsSpaceAndPermission) {
  EXPECT_EQ(Status::FromErrno(ENOSPC, "write").code(), StatusCode::kNoSpace);
  EXPECT_EQ(Status::FromErrno(EACCES, "open").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(Status::FromErrno(EIO, "read").code(), StatusCode::kIOError);
  EXPECT_NE(Status::FromErrno(EIO, "read").message().find("read: "), std::string::npos);
}

TEST(Result, PropagatesErrors) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), StatusCode::kInvalidArgument);
}

TEST(Result, OkStatusWithoutValueIsInternal) {
  Result<int> r{Status::OK()};
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(Checksum, DetectsSingleBitFlip) {
  std::string data(4096, 'x');
  const uint64_t a = Checksum64(data.data(), data.size());
  data[1234] ^= 1;
  EXPECT_NE(a, Checksum64(data.data(), data.size()));
  EXPECT_NE(Checksum64(data.data(), data.size(), 1), Checksum64(data.data(), data.size(), 2));
}

}  // namespace
}  // namespace tpusync
