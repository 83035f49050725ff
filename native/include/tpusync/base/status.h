// Status and Result<T>: the one error channel of the native core.
//
// ERROR CONTRACT: no exception crosses a module boundary or a thread. Every fallible call returns a
// Status (or a Result<T> holding a value or a Status). The binding layer turns a non-OK Status into
// the Python exception class of its StatusCode (tpusync.core.errors), so each code below maps to
// exactly one Python exception type. Adding a code means adding its Python class.
//
// Rejected alternative: C++ exceptions. They cannot cross the engine's worker threads into a future
// without extra machinery, and an uncaught one in a worker would abort the serving process.
#pragma once

#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace tpusync {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument = 1,     // the caller passed something malformed (shape, dtype, id, size)
  kPoolExhausted = 2,       // a fixed-capacity pool or tier cannot satisfy the request
  kNotFound = 3,            // key or id unknown
  kAlreadyExists = 4,       // key or name already taken
  kFailedPrecondition = 5,  // object in the wrong state (freed block, closed store, stale id)
  kTimeout = 6,             // a wait ran past its deadline
  kCancelled = 7,           // the operation was cancelled before it completed
  kIOError = 8,             // the OS refused a read/write/mmap (errno in the message)
  kNoSpace = 9,             // ENOSPC / EDQUOT on a storage tier
  kCorrupted = 10,          // checksum or header mismatch; the data was not used
  kUnavailable = 11,        // a peer is dead or unreachable
  kPermissionDenied = 12,   // authentication failed or access refused
  kVersionMismatch = 13,    // incompatible wire, on-disk or API version
  kInternal = 14,           // a broken invariant inside tpusync (a bug: please report)
};

// Human-readable name of a code ("InvalidArgument"); stable, used by the Python mapping.
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status PoolExhausted(std::string m) { return {StatusCode::kPoolExhausted, std::move(m)}; }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
  static Status FailedPrecondition(std::string m) {
    return {StatusCode::kFailedPrecondition, std::move(m)};
  }
  static Status Timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
  static Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
  static Status IOError(std::string m) { return {StatusCode::kIOError, std::move(m)}; }
  static Status NoSpace(std::string m) { return {StatusCode::kNoSpace, std::move(m)}; }
  static Status Corrupted(std::string m) { return {StatusCode::kCorrupted, std::move(m)}; }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status PermissionDenied(std::string m) {
    return {StatusCode::kPermissionDenied, std::move(m)};
  }
  static Status VersionMismatch(std::string m) {
    return {StatusCode::kVersionMismatch, std::move(m)};
  }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  // An IOError (or NoSpace for ENOSPC/EDQUOT) carrying strerror(err) after `what`.
  static Status FromErrno(int err, std::string_view what);

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const { return ok() ? StatusCode::kOk : state_->code; }
  const std::string& message() const;
  // "Code: message", or "OK".
  std::string ToString() const;

  bool operator==(const Status& other) const {
    return code() == other.code() && message() == other.message();
  }

 private:
  struct State {
    StatusCode code;
    std::string message;
  };
  // Shared and immutable: copying a Status is one refcount bump, OK is a null pointer.
  std::shared_ptr<const State> state_;
};

// A value or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) {
      v_ = Status::Internal("Result constructed from an OK status without a value");
    }
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<Status, T> v_;
};

// Concatenates streamable arguments into a string (gcc 12 has no <format>).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

}  // namespace tpusync

#define TPUSYNC_CONCAT_INNER(a, b) a##b
#define TPUSYNC_CONCAT(a, b) TPUSYNC_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define TPUSYNC_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::tpusync::Status _tpusync_status = (expr);        \
    if (!_tpusync_status.ok()) return _tpusync_status; \
  } while (0)

#define TPUSYNC_ASSIGN_OR_RETURN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                  \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

// `lhs = value of rexpr`, or return its Status from the enclosing function.
#define TPUSYNC_ASSIGN_OR_RETURN(lhs, rexpr) \
  TPUSYNC_ASSIGN_OR_RETURN_IMPL(TPUSYNC_CONCAT(_tpusync_result_, __LINE__), lhs, rexpr)
