#include "tpusync/base/status.h"

#include <cerrno>
#include <cstring>

namespace tpusync {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kPoolExhausted: return "PoolExhausted";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kFailedPrecondition: return "FailedPrecondition";
    case StatusCode::kTimeout: return "Timeout";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kIOError: return "IOError";
    case StatusCode::kNoSpace: return "NoSpace";
    case StatusCode::kCorrupted: return "Corrupted";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kPermissionDenied: return "PermissionDenied";
    case StatusCode::kVersionMismatch: return "VersionMismatch";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message) {
  if (code != StatusCode::kOk) {
    state_ = std::make_shared<const State>(State{code, std::move(message)});
  }
}

Status Status::FromErrno(int err, std::string_view what) {
  std::string msg = StrCat(what, ": ", std::strerror(err), " (errno ", err, ")");
  if (err == ENOSPC || err == EDQUOT) return NoSpace(std::move(msg));
  if (err == EACCES || err == EPERM || err == EROFS) return PermissionDenied(std::move(msg));
  return IOError(std::move(msg));
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return ok() ? kEmpty : state_->message;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return StrCat(StatusCodeName(code()), ": ", state_->message);
}

}  // namespace tpusync
