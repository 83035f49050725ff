// Link: N authenticated parallel streams to one peer, and the server / client / pool that make
// them.
//
// LINK CONTRACT: a client opens `streams` connections to the same server, runs the auth handshake
// on each, then binds each with (link id, stream index, stream count). The server hands the
// handler a Link only once every stream of that id arrived, authenticated, within the handshake
// timeout; partial links are dropped. Stream 0 carries requests and replies; every stream carries
// payload, so large transfers are striped (SendStriped).
//
// POOL CONTRACT: LinkPool keeps idle healthy links per peer address and hands each out to one user
// at a time; a link with a broken stream is closed on release, never reused. Acquire hands out an
// idle link only if no stream of it is readable: on an idle link the peer has nothing to say, so
// readable means it closed its end (a server that dropped the link after its idle timeout, a
// restarted peer) or is out of step; such a link is closed and the next one tried, then a new one
// connected. A link closed in the window between
// that check and its first frame still fails its request (one poll per stream, no retry).
//
// CONNECTION LIMIT: a server runs one thread per connection until its link ends. It accepts at
// most ServerOptions::max_connections at a time and closes any further connection at once; a
// connection whose thread cannot be started (the process is out of threads or memory) is closed
// the same way. Either counts as rejected, and the server keeps serving the others (before this
// rule, a failed thread start ended the process). Rejections are logged at most
// kRejectLogsPerSecond a second, with a count of the rest, so a flood of peers cannot flood the
// log.
//
// SHUTDOWN CONTRACT: Server::Stop stops accepting, closes every live link's streams (blocked reads
// return), and joins every thread it started before it returns.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/transport/auth.h"
#include "tpusync/transport/socket.h"
#include "tpusync/transport/stream.h"

namespace tpusync::transport {

struct Link {
  uint64_t id = 0;
  Address peer;
  std::vector<std::unique_ptr<Stream>> streams;
  bool healthy() const;
  // POOL CONTRACT: no stream is broken and none is readable (checked without waiting; a stream
  // with no fd, like the fault double's memory stream, counts as open).
  bool idle_and_open() const;
  void Close();
  std::vector<Stream*> raw() const;
};

// Wraps a freshly authenticated stream (the fault double hooks in here); index = stream index.
using StreamWrapper = std::function<std::unique_ptr<Stream>(std::unique_ptr<Stream>, size_t)>;

inline constexpr uint32_t kRejectLogsPerSecond = 10;

struct ServerOptions {
  std::string listen = "127.0.0.1:0";  // HOST:PORT or unix:/path
  std::chrono::milliseconds handshake_timeout{5000};
  SocketOptions socket;
  size_t max_streams_per_link = 64;
  size_t max_connections = 4096;  // CONNECTION LIMIT
  StreamWrapper wrap;             // optional
};

class Server {
 public:
  // Runs on a server thread once per complete link; the link closes when it returns.
  using LinkHandler = std::function<void(std::shared_ptr<Link>)>;
  static Result<std::unique_ptr<Server>> Start(ServerOptions options, Secret secret,
                                               LinkHandler handler);
  ~Server();
  const Address& address() const { return address_; }
  void Stop();
  // Failed handshakes and connections refused by the CONNECTION LIMIT.
  uint64_t rejected() const { return rejected_.load(); }
  uint64_t links() const { return links_.load(); }

 private:
  Server() = default;
  void AcceptLoop();
  void HandleConnection(Fd fd, std::string peer);
  // Starts `fn` on a connection thread; false when no thread could be started.
  bool Spawn(std::function<void()> fn);
  // Counts a rejected peer and logs it, at most kRejectLogsPerSecond a second (CONNECTION LIMIT).
  void Reject(const std::string& message);
  // Logs how many rejections the last second's limit held back (acceptor thread, every pass).
  void FlushRejectLog();

  ServerOptions options_;
  Secret secret_;
  LinkHandler handler_;
  Address address_;
  std::pair<dev_t, ino_t> unix_id_{};  // a unix listener's socket file (UNIX PATH RULE)
  Fd listen_fd_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> rejected_{0}, links_{0};
  std::thread acceptor_;

  std::mutex mu_;
  std::condition_variable cv_;
  struct Pending {
    std::vector<std::unique_ptr<Stream>> streams;
    size_t arrived = 0;
    Deadline expires;
  };
  std::map<uint64_t, Pending> pending_;
  std::list<std::weak_ptr<Link>> live_;
  std::list<std::thread> threads_;
  std::vector<std::thread::id> finished_;
  std::mutex log_mu_;
  Deadline log_window_{};
  uint32_t logged_in_window_ = 0;
  uint64_t held_back_ = 0;
};

struct ConnectOptions {
  size_t streams = 4;
  std::chrono::milliseconds timeout{5000};  // connect + handshake, per stream
  SocketOptions socket;
  StreamWrapper wrap;  // optional
};

// Every stream's connect + handshake waits at most options.timeout, and never past `overall`.
Result<std::unique_ptr<Link>> ConnectLink(const Address& peer, const Secret& secret,
                                          const ConnectOptions& options,
                                          Deadline overall = Deadline::max());

class LinkPool {
 public:
  LinkPool(Secret secret, ConnectOptions options, size_t max_idle_per_peer = 4)
      : secret_(std::move(secret)), options_(std::move(options)), max_idle_(max_idle_per_peer) {}
  // An idle healthy link, else a new one connected by `deadline` at the latest.
  Result<std::unique_ptr<Link>> Acquire(const Address& peer, Deadline deadline = Deadline::max());
  void Release(std::unique_ptr<Link> link);
  size_t idle() const;
  void Clear();
  const ConnectOptions& options() const { return options_; }

 private:
  Secret secret_;
  ConnectOptions options_;
  size_t max_idle_;
  mutable std::mutex mu_;
  std::map<std::string, std::vector<std::unique_ptr<Link>>> idle_;
};

// Sends blocks[0..n) striped over `streams`: stream i gets one contiguous chunk as frames of at
// most kMaxBlocksPerFrame blocks, metadata from make_meta(first block index, count). Streams run
// in parallel; returns the first error.
using MetaFn = std::function<std::vector<uint8_t>(size_t first, size_t count)>;
Status SendStriped(std::span<Stream* const> streams, Op op, uint64_t request_id,
                   uint64_t block_bytes, std::span<const uint8_t* const> blocks,
                   const MetaFn& make_meta, Deadline deadline);

// Process-wide log of rejected peers and transport warnings (stderr; tests can capture it).
void LogWarning(const std::string& message);
void SetLogSink(std::function<void(const std::string&)> sink);

}  // namespace tpusync::transport
