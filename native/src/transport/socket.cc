#include "tpusync/transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <vector>

namespace tpusync::transport {
namespace {

int MsLeft(Deadline deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left, INT_MAX));
}

// Waits for `events` on fd; kTimeout when the deadline passes first.
Status WaitFor(int fd, short events, Deadline deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int ms = MsLeft(deadline);
    const int r = ::poll(&p, 1, ms);
    if (r > 0) {
      if ((p.revents & events) || (p.revents & (POLLHUP | POLLERR))) return Status::OK();
      if (p.revents & POLLNVAL) return Status::Unavailable(StrCat(what, ": socket closed"));
      continue;
    }
    if (r == 0)
      return Status::Timeout(StrCat(what, ": deadline passed while waiting for the peer"));
    if (errno != EINTR) return Status::FromErrno(errno, what);
  }
}

Status SetNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return Status::FromErrno(errno, "fcntl(O_NONBLOCK)");
  }
  return Status::OK();
}

struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = 0;
  int family = AF_INET;
};

Result<SockAddr> Resolve(const Address& addr) {
  SockAddr out;
  if (addr.is_unix) {
    auto* un = reinterpret_cast<sockaddr_un*>(&out.storage);
    if (addr.host.empty() || addr.host.size() >= sizeof(un->sun_path)) {
      return Status::InvalidArgument(StrCat("unix socket path '", addr.host,
                                            "' is empty or longer than ", sizeof(un->sun_path) - 1,
                                            " bytes"));
    }
    un->sun_family = AF_UNIX;
    std::memcpy(un->sun_path, addr.host.data(), addr.host.size());
    out.len = sizeof(sockaddr_un);
    out.family = AF_UNIX;
    return out;
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(addr.port);
  const int rc =
      ::getaddrinfo(addr.host.empty() ? nullptr : addr.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status::InvalidArgument(
        StrCat("cannot resolve '", addr.host, "': ", ::gai_strerror(rc)));
  }
  std::memcpy(&out.storage, res->ai_addr, res->ai_addrlen);
  out.len = res->ai_addrlen;
  out.family = res->ai_family;
  ::freeaddrinfo(res);
  return out;
}

}  // namespace

void Fd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string Address::ToString() const {
  if (is_unix) return "unix:" + host;
  if (host.find(':') != std::string::npos) return StrCat("[", host, "]:", port);
  return StrCat(host, ":", port);
}

Result<Address> ParseAddress(std::string_view text) {
  Address a;
  if (text.starts_with("unix:")) {
    a.is_unix = true;
    a.host = std::string(text.substr(5));
    if (a.host.empty()) return Status::InvalidArgument("unix: address without a path");
    return a;
  }
  std::string_view host, port;
  if (text.starts_with("[")) {
    const size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return Status::InvalidArgument(StrCat("address '", text, "' is not [HOST]:PORT"));
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) {
      return Status::InvalidArgument(StrCat("address '", text, "' is not HOST:PORT or unix:PATH"));
    }
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return Status::InvalidArgument(StrCat("address '", text, "' has no valid port"));
  }
  const int p = std::stoi(std::string(port));
  if (p > 65535) return Status::InvalidArgument(StrCat("port ", p, " is out of range"));
  a.host = std::string(host);
  a.port = static_cast<uint16_t>(p);
  return a;
}

Status ConfigureSocket(int fd, bool is_unix, const SocketOptions& options) {
  TPUSYNC_RETURN_IF_ERROR(SetNonBlocking(fd));
  if (options.buffer_bytes > 0) {
    // Best effort: the kernel clamps to net.core.[rw]mem_max; a refusal is not an error.
    (void)::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &options.buffer_bytes, sizeof(int));
    (void)::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &options.buffer_bytes, sizeof(int));
  }
  if (!is_unix) {
    const int one = 1;
    if (options.no_delay) (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    (void)::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  }
  return Status::OK();
}

namespace {
// UNIX PATH RULE: only a stale socket (one nobody accepts on) is removed before bind.
Status ClearStaleSocket(const Address& addr, const SockAddr& sa) {
  struct stat st {};
  if (::lstat(addr.host.c_str(), &st) != 0) {
    return errno == ENOENT ? Status::OK() : Status::FromErrno(errno, StrCat("stat ", addr.host));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return Status::AlreadyExists(StrCat(addr.host,
                                        " exists and is not a socket: refusing to replace it "
                                        "(pick another unix: path, or remove the file)"));
  }
  Fd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!probe.valid()) return Status::FromErrno(errno, "socket");
  if (::connect(probe.get(), reinterpret_cast<const sockaddr*>(&sa.storage), sa.len) == 0) {
    return Status::AlreadyExists(
        StrCat(addr.ToString(), " is in use: a live process listens on it"));
  }
  if (errno != ECONNREFUSED) return Status::FromErrno(errno, StrCat("probe ", addr.ToString()));
  if (::unlink(addr.host.c_str()) != 0 && errno != ENOENT) {
    return Status::FromErrno(errno, StrCat("remove the stale socket ", addr.host));
  }
  return Status::OK();
}
}  // namespace

Result<Fd> Listen(const Address& addr, int backlog) {
  TPUSYNC_ASSIGN_OR_RETURN(SockAddr sa, Resolve(addr));
  Fd fd(::socket(sa.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Status::FromErrno(errno, "socket");
  if (addr.is_unix) {
    TPUSYNC_RETURN_IF_ERROR(ClearStaleSocket(addr, sa));
  } else {
    const int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  }
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa.storage), sa.len) != 0) {
    return Status::FromErrno(errno, StrCat("bind ", addr.ToString()));
  }
  if (::listen(fd.get(), backlog) != 0) return Status::FromErrno(errno, "listen");
  TPUSYNC_RETURN_IF_ERROR(SetNonBlocking(fd.get()));
  return fd;
}

Result<Address> LocalAddress(int fd, bool is_unix) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) {
    return Status::FromErrno(errno, "getsockname");
  }
  Address a;
  a.is_unix = is_unix;
  if (is_unix) {
    a.host = reinterpret_cast<sockaddr_un*>(&ss)->sun_path;
    return a;
  }
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf));
    a.port = ntohs(in6->sin6_port);
  } else {
    auto* in = reinterpret_cast<sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    a.port = ntohs(in->sin_port);
  }
  a.host = buf;
  return a;
}

Result<Fd> Accept(int listen_fd, Deadline deadline, std::string* peer_name) {
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    const int c =
        ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c >= 0) {
      if (peer_name) {
        char buf[INET6_ADDRSTRLEN] = {};
        if (ss.ss_family == AF_INET) {
          auto* in = reinterpret_cast<sockaddr_in*>(&ss);
          ::inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
          *peer_name = StrCat(buf, ":", ntohs(in->sin_port));
        } else if (ss.ss_family == AF_INET6) {
          auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
          ::inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf));
          *peer_name = StrCat("[", buf, "]:", ntohs(in6->sin6_port));
        } else {
          *peer_name = "unix-peer";
        }
      }
      return Fd(c);
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return Status::FromErrno(errno, "accept");
    TPUSYNC_RETURN_IF_ERROR(WaitFor(listen_fd, POLLIN, deadline, "accept"));
  }
}

Result<Fd> Connect(const Address& addr, Deadline deadline, const SocketOptions& options) {
  TPUSYNC_ASSIGN_OR_RETURN(SockAddr sa, Resolve(addr));
  Fd fd(::socket(sa.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Status::FromErrno(errno, "socket");
  TPUSYNC_RETURN_IF_ERROR(ConfigureSocket(fd.get(), addr.is_unix, options));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa.storage), sa.len) != 0) {
    if (errno != EINPROGRESS && errno != EAGAIN) {
      return Status::Unavailable(StrCat("connect ", addr.ToString(), ": ", std::strerror(errno)));
    }
    TPUSYNC_RETURN_IF_ERROR(WaitFor(fd.get(), POLLOUT, deadline, "connect"));
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      return Status::Unavailable(StrCat("connect ", addr.ToString(), ": ", std::strerror(err)));
    }
  }
  return fd;
}

Status WriteAllV(int fd, std::span<const iovec> iov_in, Deadline deadline, int flags) {
  // Work on a copy so partial writes can advance the first entry.
  std::vector<iovec> iov(iov_in.begin(), iov_in.end());
  size_t first = 0;
  while (first < iov.size()) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    const int count = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    // sendmsg, not writev: MSG_NOSIGNAL turns a closed peer into EPIPE instead of SIGPIPE.
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = static_cast<size_t>(count);
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | flags);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        TPUSYNC_RETURN_IF_ERROR(WaitFor(fd, POLLOUT, deadline, "send"));
        continue;
      }
      if (errno == EPIPE || errno == ECONNRESET) {
        return Status::Unavailable(
            StrCat("send: peer closed the connection (", std::strerror(errno), ")"));
      }
      return Status::FromErrno(errno, "sendmsg");
    }
    size_t left = static_cast<size_t>(n);
    while (left > 0 && first < iov.size()) {
      if (left >= iov[first].iov_len) {
        left -= iov[first].iov_len;
        ++first;
      } else {
        iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
        left = 0;
      }
    }
  }
  return Status::OK();
}

Status ReadAllV(int fd, std::span<const iovec> iov_in, Deadline deadline) {
  std::vector<iovec> iov(iov_in.begin(), iov_in.end());
  size_t first = 0;
  while (first < iov.size()) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    const int count = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = ::readv(fd, iov.data() + first, count);
    if (n == 0) return Status::Unavailable("receive: peer closed the connection");
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        TPUSYNC_RETURN_IF_ERROR(WaitFor(fd, POLLIN, deadline, "receive"));
        continue;
      }
      if (errno == ECONNRESET) return Status::Unavailable("receive: connection reset by peer");
      return Status::FromErrno(errno, "readv");
    }
    size_t left = static_cast<size_t>(n);
    while (left > 0 && first < iov.size()) {
      if (left >= iov[first].iov_len) {
        left -= iov[first].iov_len;
        ++first;
      } else {
        iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
        left = 0;
      }
    }
  }
  return Status::OK();
}

Status WriteAll(int fd, const void* data, size_t bytes, Deadline deadline) {
  const iovec v{const_cast<void*>(data), bytes};
  return WriteAllV(fd, {&v, 1}, deadline);
}

Status ReadAll(int fd, void* data, size_t bytes, Deadline deadline) {
  const iovec v{data, bytes};
  return ReadAllV(fd, {&v, 1}, deadline);
}

Status SendFd(int socket_fd, int fd_to_send, Deadline deadline) {
  char byte = 'F';
  iovec v{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &v;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd_to_send, sizeof(int));
  for (;;) {
    const ssize_t n = ::sendmsg(socket_fd, &msg, MSG_NOSIGNAL);
    if (n == 1) return Status::OK();
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      TPUSYNC_RETURN_IF_ERROR(WaitFor(socket_fd, POLLOUT, deadline, "send fd"));
      continue;
    }
    return Status::FromErrno(errno, "sendmsg(SCM_RIGHTS)");
  }
}

Result<Fd> RecvFd(int socket_fd, Deadline deadline) {
  char byte = 0;
  iovec v{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &v;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  for (;;) {
    const ssize_t n = ::recvmsg(socket_fd, &msg, MSG_CMSG_CLOEXEC);
    if (n == 0) return Status::Unavailable("receive fd: peer closed the connection");
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      TPUSYNC_RETURN_IF_ERROR(WaitFor(socket_fd, POLLIN, deadline, "receive fd"));
      continue;
    }
    if (n < 0) return Status::FromErrno(errno, "recvmsg(SCM_RIGHTS)");
    break;
  }
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (c == nullptr || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
      c->cmsg_len != CMSG_LEN(sizeof(int))) {
    return Status::Corrupted("receive fd: the peer sent no file descriptor");
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return Fd(fd);
}

}  // namespace tpusync::transport
