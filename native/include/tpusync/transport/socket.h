// Sockets for the transport: an owned fd, poll-based I/O with a deadline on every wait, and
// TCP / Unix-domain listen and connect.
//
// DEADLINE CONTRACT: every call that can block takes an absolute steady-clock Deadline and returns
// kTimeout once it passes; sockets are non-blocking and every wait is a poll() bounded by the time
// left, so a dead or silent peer can never hold a thread forever. A timeout in the middle of a
// frame leaves the byte stream out of step: callers close the socket after any I/O error.
//
// Rejected alternative: blocking sockets with SO_RCVTIMEO/SO_SNDTIMEO. Those bound each syscall,
// not the whole operation, so a peer trickling one byte per timeout keeps a transfer alive forever.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "tpusync/base/status.h"

namespace tpusync::transport {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline DeadlineIn(std::chrono::milliseconds ms) { return Clock::now() + ms; }
inline Deadline DeadlineInMs(int64_t ms) { return Clock::now() + std::chrono::milliseconds(ms); }

// An owned file descriptor (closed on destruction).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { Reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      Reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void Reset();

 private:
  int fd_ = -1;
};

// "HOST:PORT" (TCP; HOST may be [v6]) or "unix:/path" (Unix-domain stream socket).
struct Address {
  bool is_unix = false;
  std::string host;  // TCP host or unix path
  uint16_t port = 0;
  std::string ToString() const;
};
Result<Address> ParseAddress(std::string_view text);

struct SocketOptions {
  // SO_SNDBUF / SO_RCVBUF request; 0 (default) leaves the kernel's TCP autotuning on, which grows
  // buffers up to net.ipv4.tcp_[rw]mem max (32 MiB / 4 MiB by default). An explicit value is
  // clamped to net.core.[rw]mem_max and switches autotuning off: measured slower on loopback
  // (one stream: 0.30 vs 0.17 GB/s on the loaded 2-vCPU reference machine).
  int buffer_bytes = 0;
  bool no_delay = true;  // TCP_NODELAY: frames are written whole with writev
};

// Listens on `addr` (port 0 picks a free port). Non-blocking fd.
//
// UNIX PATH RULE: a unix path that exists is replaced only when it is a stale socket (nobody
// accepts on it: its process died). Any other file, or a socket a live process listens on, is
// refused (kAlreadyExists) and left alone; the server removes its path at stop only while the
// path is still its own socket. Before, any file there was unlinked, a live peer's socket taken
// over, and the new owner's socket removed by the old one's stop.
Result<Fd> Listen(const Address& addr, int backlog = 128);
// The bound address of a listening socket (to learn an ephemeral port).
Result<Address> LocalAddress(int fd, bool is_unix);
// Accepts one connection, waiting until `deadline`; kTimeout when none came.
Result<Fd> Accept(int listen_fd, Deadline deadline, std::string* peer_name = nullptr);
// Connects with a deadline (non-blocking connect + poll).
Result<Fd> Connect(const Address& addr, Deadline deadline, const SocketOptions& options = {});
Status ConfigureSocket(int fd, bool is_unix, const SocketOptions& options);

// Writes every byte of `iov` (any count: chunked by IOV_MAX), waiting with poll until `deadline`.
// flags: extra sendmsg flags for the last call (MSG_MORE: another write follows at once).
Status WriteAllV(int fd, std::span<const iovec> iov, Deadline deadline, int flags = 0);
// Fills every byte of `iov`, waiting with poll until `deadline`; kUnavailable on EOF.
Status ReadAllV(int fd, std::span<const iovec> iov, Deadline deadline);
Status WriteAll(int fd, const void* data, size_t bytes, Deadline deadline);
Status ReadAll(int fd, void* data, size_t bytes, Deadline deadline);

// Unix sockets only: passes one file descriptor with a one-byte message (SCM_RIGHTS).
Status SendFd(int socket_fd, int fd_to_send, Deadline deadline);
Result<Fd> RecvFd(int socket_fd, Deadline deadline);

}  // namespace tpusync::transport
