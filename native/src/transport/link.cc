#include "tpusync/transport/link.h"

#include <poll.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <system_error>

namespace tpusync::transport {
namespace {

std::mutex g_log_mu;
std::function<void(const std::string&)> g_log_sink;

}  // namespace

void LogWarning(const std::string& message) {
  std::lock_guard lock(g_log_mu);
  if (g_log_sink) {
    g_log_sink(message);
  } else {
    std::fprintf(stderr, "tpusync transport: %s\n", message.c_str());
  }
}

void SetLogSink(std::function<void(const std::string&)> sink) {
  std::lock_guard lock(g_log_mu);
  g_log_sink = std::move(sink);
}

bool Link::healthy() const {
  return !streams.empty() &&
         std::none_of(streams.begin(), streams.end(), [](const auto& s) { return s->broken(); });
}

bool Link::idle_and_open() const {
  if (!healthy()) return false;
  std::vector<pollfd> fds;  // one poll for every stream (Acquire runs once per pull)
  for (const auto& s : streams) {
    if (s->fd() >= 0) fds.push_back({.fd = s->fd(), .events = POLLIN | POLLRDHUP, .revents = 0});
  }
  return fds.empty() || ::poll(fds.data(), fds.size(), 0) == 0;
}

void Link::Close() {
  for (auto& s : streams) s->Close();
}

std::vector<Stream*> Link::raw() const {
  std::vector<Stream*> out;
  for (const auto& s : streams) out.push_back(s.get());
  return out;
}

// ---------------------------------------------------------------------------------------- server

Result<std::unique_ptr<Server>> Server::Start(ServerOptions options, Secret secret,
                                              LinkHandler handler) {
  TPUSYNC_ASSIGN_OR_RETURN(Address addr, ParseAddress(options.listen));
  TPUSYNC_ASSIGN_OR_RETURN(Fd fd, Listen(addr));
  std::unique_ptr<Server> s(new Server());
  TPUSYNC_ASSIGN_OR_RETURN(s->address_, LocalAddress(fd.get(), addr.is_unix));
  if (addr.is_unix) {
    s->address_.host = addr.host;
    struct stat st {};
    if (::stat(addr.host.c_str(), &st) == 0) s->unix_id_ = {st.st_dev, st.st_ino};
  }
  s->options_ = std::move(options);
  s->secret_ = std::move(secret);
  s->handler_ = std::move(handler);
  s->listen_fd_ = std::move(fd);
  s->acceptor_ = std::thread([p = s.get()] { p->AcceptLoop(); });
  return s;
}

Server::~Server() { Stop(); }

bool Server::Spawn(std::function<void()> fn) {
  std::lock_guard lock(mu_);
  try {
    threads_.emplace_back([this, fn = std::move(fn)] {
      fn();
      std::lock_guard l(mu_);
      finished_.push_back(std::this_thread::get_id());
      cv_.notify_all();
    });
  } catch (const std::system_error&) {
    return false;  // CONNECTION LIMIT: the caller closes the connection
  }
  return true;
}

void Server::Reject(const std::string& message) {
  rejected_++;
  std::lock_guard lock(log_mu_);
  const auto now = Clock::now();
  if (now >= log_window_) {
    if (held_back_) {
      LogWarning(StrCat(held_back_, " more peers rejected in the last second (not logged)"));
    }
    log_window_ = now + std::chrono::seconds(1);
    logged_in_window_ = 0;
    held_back_ = 0;
  }
  if (logged_in_window_ < kRejectLogsPerSecond) {
    ++logged_in_window_;
    LogWarning(message);
  } else {
    ++held_back_;
  }
}

void Server::FlushRejectLog() {
  std::lock_guard lock(log_mu_);
  if (held_back_ == 0 || Clock::now() < log_window_) return;
  LogWarning(StrCat(held_back_, " more peers rejected in the last second (not logged)"));
  held_back_ = 0;
}

void Server::AcceptLoop() {
  while (!stop_.load()) {
    std::string peer;
    auto fd = Accept(listen_fd_.get(), DeadlineInMs(100), &peer);
    {
      // Reap finished connection threads and expired partial links.
      std::vector<std::thread> done;
      {
        std::lock_guard lock(mu_);
        for (auto it = threads_.begin(); it != threads_.end();) {
          if (std::find(finished_.begin(), finished_.end(), it->get_id()) != finished_.end()) {
            finished_.erase(std::find(finished_.begin(), finished_.end(), it->get_id()));
            done.push_back(std::move(*it));
            it = threads_.erase(it);
          } else {
            ++it;
          }
        }
        const auto now = Clock::now();
        for (auto it = pending_.begin(); it != pending_.end();) {
          if (it->second.expires < now) {
            LogWarning(StrCat("dropped partial link ", it->first, ": only ", it->second.arrived,
                              " of ", it->second.streams.size(), " streams arrived in time"));
            it = pending_.erase(it);
          } else {
            ++it;
          }
        }
        live_.remove_if([](const std::weak_ptr<Link>& w) { return w.expired(); });
      }
      for (auto& t : done) t.join();
      FlushRejectLog();
    }
    if (!fd.ok()) {
      if (fd.status().code() != StatusCode::kTimeout && !stop_.load()) {
        LogWarning("accept failed: " + fd.status().ToString());
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      continue;
    }
    size_t running;
    {
      std::lock_guard lock(mu_);
      running = threads_.size() - finished_.size();
    }
    if (running >= options_.max_connections) {
      Reject(StrCat("refused connection from ", peer, ": ", running, " connections open (",
                    options_.max_connections, " at most)"));
      continue;  // the Fd closes here
    }
    auto f = std::make_shared<Fd>(std::move(*fd));
    if (!Spawn([this, f, peer] { HandleConnection(std::move(*f), peer); })) {
      Reject(StrCat("refused connection from ", peer, ": no thread could be started for it (",
                    running, " connections open)"));
      f->Reset();
    }
  }
}

void Server::HandleConnection(Fd fd, std::string peer) {
  const Deadline deadline = Clock::now() + options_.handshake_timeout;
  if (Status s = ConfigureSocket(fd.get(), address_.is_unix, options_.socket); !s.ok()) {
    LogWarning(StrCat("configuring connection from ", peer, ": ", s.ToString()));
    return;
  }
  auto stream = std::make_unique<SocketStream>(std::move(fd), peer);
  stream->LimitFrames(kHandshakeMetaBytes, 0);  // HANDSHAKE LIMIT until bound
  if (Status s = ServerHandshake(*stream, secret_, deadline); !s.ok()) {
    Reject(StrCat("rejected unauthenticated peer ", peer, ": ", s.ToString()));
    return;
  }
  auto bind = stream->Expect(Op::kBind, deadline);
  uint64_t link_id = 0;
  uint32_t index = 0, count = 0;
  Status bad;
  if (!bind.ok()) {
    bad = bind.status();
  } else {
    MetaReader r(bind->meta);
    auto id = r.U64();
    auto i = r.U32();
    auto n = r.U32();
    if (!id.ok() || !i.ok() || !n.ok() || !r.ExpectEnd().ok()) {
      bad = Status::InvalidArgument("malformed Bind frame");
    } else if (*n == 0 || *n > options_.max_streams_per_link || *i >= *n) {
      bad = Status::InvalidArgument(StrCat("Bind of stream ", *i, " of ", *n, " is out of range (",
                                           options_.max_streams_per_link, " streams at most)"));
    } else {
      link_id = *id;
      index = *i;
      count = *n;
    }
  }
  if (!bad.ok()) {
    LogWarning(StrCat("dropping connection from ", peer, ": ", bad.ToString()));
    (void)stream->SendMeta(Op::kError, 0, EncodeStatus(bad), deadline);
    return;
  }
  stream->LimitFrames(kMaxMetaBytes, kMaxBlocksPerFrame);
  if (Status s = stream->SendMeta(Op::kBindOk, 0, {}, deadline); !s.ok()) return;
  std::unique_ptr<Stream> st = std::move(stream);
  if (options_.wrap) st = options_.wrap(std::move(st), index);

  std::shared_ptr<Link> link;
  {
    std::lock_guard lock(mu_);
    if (stop_.load()) return;
    Pending& p = pending_[link_id];
    if (p.streams.empty()) {
      p.streams.resize(count);
      p.expires = deadline;
    }
    if (p.streams.size() != count || p.streams[index] != nullptr) {
      LogWarning(StrCat("conflicting Bind for link ", link_id, " from ", peer));
      return;
    }
    p.streams[index] = std::move(st);
    if (++p.arrived < count) return;  // the last stream to arrive runs the handler
    link = std::make_shared<Link>();
    link->id = link_id;
    link->peer = Address{false, peer, 0};
    link->streams = std::move(p.streams);
    pending_.erase(link_id);
    live_.push_back(link);
  }
  links_++;
  handler_(link);
  link->Close();
}

void Server::Stop() {
  if (stop_.exchange(true)) {
    if (acceptor_.joinable()) acceptor_.join();
    return;
  }
  if (acceptor_.joinable()) acceptor_.join();
  std::list<std::thread> threads;
  {
    std::lock_guard lock(mu_);
    for (auto& w : live_) {
      if (auto l = w.lock()) l->Close();
    }
    for (auto& [id, p] : pending_) {
      for (auto& s : p.streams) {
        if (s) s->Close();
      }
    }
    pending_.clear();
    threads = std::move(threads_);
  }
  // Connections still in their handshake see the closed listener only at their deadline: bounded
  // by handshake_timeout.
  for (auto& t : threads) t.join();
  if (address_.is_unix && listen_fd_.valid()) {
    // UNIX PATH RULE: only our own socket (another process may have bound the path since).
    struct stat st {};
    if (::stat(address_.host.c_str(), &st) == 0 && unix_id_ == std::pair{st.st_dev, st.st_ino}) {
      ::unlink(address_.host.c_str());
    }
  }
  listen_fd_.Reset();
}

// ---------------------------------------------------------------------------------------- client

Result<std::unique_ptr<Link>> ConnectLink(const Address& peer, const Secret& secret,
                                          const ConnectOptions& options, Deadline overall) {
  if (options.streams == 0 || options.streams > 64) {
    return Status::InvalidArgument(StrCat("streams must be 1..64, got ", options.streams));
  }
  auto link = std::make_unique<Link>();
  TPUSYNC_RETURN_IF_ERROR(RandomBytes({reinterpret_cast<uint8_t*>(&link->id), 8}));
  link->peer = peer;
  for (size_t i = 0; i < options.streams; ++i) {
    const Deadline deadline = std::min(Clock::now() + options.timeout, overall);
    TPUSYNC_ASSIGN_OR_RETURN(Fd fd, Connect(peer, deadline, options.socket));
    auto stream = std::make_unique<SocketStream>(std::move(fd), peer.ToString());
    stream->LimitFrames(kHandshakeMetaBytes, 0);  // HANDSHAKE LIMIT until bound
    TPUSYNC_RETURN_IF_ERROR(ClientHandshake(*stream, secret, deadline));
    MetaWriter w;
    w.U64(link->id).U32(static_cast<uint32_t>(i)).U32(static_cast<uint32_t>(options.streams));
    TPUSYNC_RETURN_IF_ERROR(stream->SendMeta(Op::kBind, 0, w.bytes(), deadline));
    auto ok = stream->Expect(Op::kBindOk, deadline);
    if (!ok.ok()) return ok.status();
    stream->LimitFrames(kMaxMetaBytes, kMaxBlocksPerFrame);
    std::unique_ptr<Stream> st = std::move(stream);
    if (options.wrap) st = options.wrap(std::move(st), i);
    link->streams.push_back(std::move(st));
  }
  return link;
}

Result<std::unique_ptr<Link>> LinkPool::Acquire(const Address& peer, Deadline deadline) {
  {
    std::lock_guard lock(mu_);
    auto& idle = idle_[peer.ToString()];
    while (!idle.empty()) {
      auto link = std::move(idle.back());
      idle.pop_back();
      if (link->idle_and_open()) return link;
      link->Close();  // POOL CONTRACT: the peer closed it (or it is out of step)
    }
  }
  return ConnectLink(peer, secret_, options_, deadline);
}

void LinkPool::Release(std::unique_ptr<Link> link) {
  if (!link) return;
  if (!link->healthy()) {
    link->Close();
    return;
  }
  std::lock_guard lock(mu_);
  auto& idle = idle_[link->peer.ToString()];
  if (idle.size() >= max_idle_) {
    link->Close();
    return;
  }
  idle.push_back(std::move(link));
}

size_t LinkPool::idle() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const auto& [k, v] : idle_) n += v.size();
  return n;
}

void LinkPool::Clear() {
  std::lock_guard lock(mu_);
  for (auto& [k, v] : idle_) {
    for (auto& l : v) l->Close();
  }
  idle_.clear();
}

// --------------------------------------------------------------------------------------- striping

Status SendStriped(std::span<Stream* const> streams, Op op, uint64_t request_id,
                   uint64_t block_bytes, std::span<const uint8_t* const> blocks,
                   const MetaFn& make_meta, Deadline deadline) {
  if (streams.empty()) return Status::InvalidArgument("SendStriped needs at least one stream");
  const size_t n = blocks.size();
  const size_t k = std::min(streams.size(), std::max<size_t>(n, 1));
  auto send_chunk = [&](size_t s) -> Status {
    const size_t first = n * s / k, last = n * (s + 1) / k;
    for (size_t b = first; b < last; b += kMaxBlocksPerFrame) {
      const size_t count = std::min<size_t>(kMaxBlocksPerFrame, last - b);
      const auto meta = make_meta(b, count);
      OutFrame f;
      f.op = op;
      f.request_id = request_id;
      f.meta = meta;
      f.block_bytes = block_bytes;
      f.blocks = blocks.subspan(b, count);
      TPUSYNC_RETURN_IF_ERROR(streams[s]->Send(f, deadline));
    }
    return Status::OK();
  };
  if (k == 1) return send_chunk(0);
  std::vector<Status> results(k);
  std::vector<std::thread> threads;
  for (size_t s = 1; s < k; ++s) threads.emplace_back([&, s] { results[s] = send_chunk(s); });
  results[0] = send_chunk(0);
  for (auto& t : threads) t.join();
  for (auto& r : results) TPUSYNC_RETURN_IF_ERROR(r);
  return Status::OK();
}

}  // namespace tpusync::transport
