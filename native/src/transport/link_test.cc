#include "tpusync/transport/link.h"

#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
#include <thread>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "tpusync/transport/fault_stream.h"

namespace tpusync::transport {
namespace {

Secret TestSecret(const char* s = "a-test-secret-of-32-bytes-length") {
  return *Secret::FromBytes(s);
}

// A server whose handler echoes every PdData frame's blocks back on the same stream index.
struct EchoServer {
  explicit EchoServer(ServerOptions opts = {}) {
    auto s = Server::Start(std::move(opts), TestSecret(), [](std::shared_ptr<Link> link) {
      std::vector<std::thread> readers;
      for (size_t i = 0; i < link->streams.size(); ++i) {
        readers.emplace_back([&link, i] {
          Stream& st = *link->streams[i];
          for (;;) {
            auto f = st.RecvHead(DeadlineInMs(10000));
            if (!f.ok()) return;
            std::vector<std::vector<uint8_t>> bufs(f->header.num_blocks,
                                                   std::vector<uint8_t>(f->header.block_bytes));
            std::vector<uint8_t*> dst;
            for (auto& b : bufs) dst.push_back(b.data());
            Status s = st.RecvBlocks(*f, dst, DeadlineInMs(10000));
            if (!s.ok()) {
              (void)st.SendMeta(Op::kError, f->header.request_id, EncodeStatus(s),
                                DeadlineInMs(1000));
              continue;
            }
            std::vector<const uint8_t*> src(dst.begin(), dst.end());
            OutFrame out;
            out.op = Op::kPdData;
            out.request_id = f->header.request_id;
            out.meta = f->meta;
            out.block_bytes = f->header.block_bytes;
            out.blocks = src;
            if (!st.Send(out, DeadlineInMs(10000)).ok()) return;
          }
        });
      }
      for (auto& t : readers) t.join();
    });
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    server = std::move(*s);
  }
  std::unique_ptr<Server> server;
};

// Collects LogWarning lines for one test. The sink is reset on every exit, a failed ASSERT too: a
// sink left behind points at a dead test's mutex, and the next test's server threads would block
// on it (seen as a hang of the next Auth test after one timed out on a loaded machine).
struct LogCapture {
  LogCapture() {
    SetLogSink([this](const std::string& m) {
      std::lock_guard l(mu);
      lines.push_back(m);
    });
  }
  ~LogCapture() { SetLogSink(nullptr); }
  std::vector<std::string> Starting(const std::string& prefix) {
    std::lock_guard l(mu);
    std::vector<std::string> out;
    for (auto& m : lines) {
      if (m.rfind(prefix, 0) == 0) out.push_back(m);
    }
    return out;
  }
  std::mutex mu;
  std::vector<std::string> lines;
};

TEST(Auth, HmacMatchesRfc4231TestCase2) {
  const std::string key = "Jefe", msg = "what do ya want for nothing?";
  const Mac mac = HmacSha256({reinterpret_cast<const uint8_t*>(key.data()), key.size()},
                             {reinterpret_cast<const uint8_t*>(msg.data()), msg.size()});
  const uint8_t want[] = {0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e, 0x6a, 0x04, 0x24,
                          0x26, 0x08, 0x95, 0x75, 0xc7, 0x5a, 0x00, 0x3f, 0x08, 0x9d, 0x27,
                          0x39, 0x83, 0x9d, 0xec, 0x58, 0xb9, 0x64, 0xec, 0x38, 0x43};
  EXPECT_EQ(0, std::memcmp(mac.data(), want, 32));
}

TEST(Auth, SecretsAreAtLeast16BytesAndComeFromFileOrEnv) {
  EXPECT_EQ(Secret::FromBytes("short").status().code(), StatusCode::kInvalidArgument);
  ::unsetenv("TPUSYNC_TEST_SECRET");
  EXPECT_EQ(Secret::Load("", "TPUSYNC_TEST_SECRET").status().code(), StatusCode::kInvalidArgument);
  ::setenv("TPUSYNC_TEST_SECRET", "0123456789abcdef0123", 1);
  EXPECT_TRUE(Secret::Load("", "TPUSYNC_TEST_SECRET").ok());
  EXPECT_EQ(Secret::Load("/nonexistent/secret").status().code(), StatusCode::kNotFound);
}

TEST(Auth, MatchingSecretsConnectAndWrongSecretIsRejectedAndLogged) {
  LogCapture log;
  EchoServer echo;
  auto ok = ConnectLink(echo.server->address(), TestSecret(), {.streams = 2});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  auto bad = ConnectLink(echo.server->address(), TestSecret("a-wrong-secret-of-32-bytes-long!"),
                         {.streams = 1});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kPermissionDenied);
  for (int i = 0; i < 200 && echo.server->rejected() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(echo.server->rejected(), 1u);
  echo.server->Stop();
  EXPECT_FALSE(log.Starting("rejected unauthenticated peer 127.0.0.1").empty());
}

TEST(Auth, ServerRefusesFramesBeforeTheHandshakeAndGarbage) {
  EchoServer echo;
  // A client that skips the handshake and sends a Bind straight away.
  auto fd = Connect(echo.server->address(), DeadlineInMs(2000));
  ASSERT_TRUE(fd.ok());
  SocketStream s(std::move(*fd), "server");
  ASSERT_TRUE(s.Expect(Op::kAuthChallenge, DeadlineInMs(2000)).ok());
  MetaWriter w;
  w.U64(1).U32(0).U32(1);
  ASSERT_TRUE(s.SendMeta(Op::kBind, 0, w.bytes(), DeadlineInMs(2000)).ok());
  auto reply = s.RecvHead(DeadlineInMs(2000));
  EXPECT_FALSE(reply.ok());  // the server closed the connection
  // Pure garbage.
  auto fd2 = Connect(echo.server->address(), DeadlineInMs(2000));
  ASSERT_TRUE(fd2.ok());
  std::vector<uint8_t> junk(100, 0x41);
  ASSERT_TRUE(WriteAll(fd2->get(), junk.data(), junk.size(), DeadlineInMs(2000)).ok());
  for (int i = 0; i < 400 && echo.server->rejected() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(echo.server->rejected(), 2u);
  EXPECT_EQ(echo.server->links(), 0u);
}

TEST(Auth, ServerRefusesAnOversizedFrameBeforeTheHandshakeFromItsHeaderAlone) {
  // HANDSHAKE LIMIT: a header announcing 1 MiB of metadata and 64 Ki checksums, with none of them
  // sent, ends the connection at once (not at the 10 s handshake deadline, holding the memory).
  LogCapture log;
  EchoServer echo({.handshake_timeout = std::chrono::milliseconds(10000)});
  auto fd = Connect(echo.server->address(), DeadlineInMs(2000));
  ASSERT_TRUE(fd.ok());
  SocketStream s(std::move(*fd), "server");
  ASSERT_TRUE(s.Expect(Op::kAuthChallenge, DeadlineInMs(2000)).ok());
  FrameHeader h;
  h.op = static_cast<uint8_t>(Op::kAuthResponse);
  h.meta_bytes = kMaxMetaBytes;
  h.num_blocks = kMaxBlocksPerFrame;
  h.block_bytes = 1;
  const std::vector<uint8_t> meta(kMaxMetaBytes);
  const auto head = EncodeHeader(h, meta);
  const auto t0 = Clock::now();
  ASSERT_TRUE(WriteAll(s.fd(), head.data(), head.size(), DeadlineInMs(2000)).ok());
  uint8_t byte;
  const Status closed = ReadAll(s.fd(), &byte, 1, DeadlineInMs(5000));
  EXPECT_NE(closed.code(), StatusCode::kTimeout) << closed.ToString();  // closed, not waiting
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  for (int i = 0; i < 400 && echo.server->rejected() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(echo.server->rejected(), 1u);
  const auto lines = log.Starting("rejected unauthenticated peer");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("exceeds what this stream accepts before authentication (4096 bytes, 0 "
                          "blocks)"),
            std::string::npos)
      << lines[0];
  // The server serves an honest client afterwards.
  auto ok = ConnectLink(echo.server->address(), TestSecret(), {.streams = 1});
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
}

TEST(Transport, ServerRefusesConnectionsOverItsLimitAndKeepsServing) {
  // CONNECTION LIMIT: two silent connections fill a server of two; the third is closed at once
  // and counted; once the silent ones go, an honest client gets in.
  LogCapture log;
  EchoServer echo({.handshake_timeout = std::chrono::milliseconds(10000), .max_connections = 2});
  std::vector<Fd> silent;
  for (int i = 0; i < 2; ++i) {
    auto fd = Connect(echo.server->address(), DeadlineInMs(2000));
    ASSERT_TRUE(fd.ok());
    SocketStream probe(Fd(::dup(fd->get())), "server");
    ASSERT_TRUE(probe.Expect(Op::kAuthChallenge, DeadlineInMs(2000)).ok());  // its thread runs
    silent.push_back(std::move(*fd));
  }
  auto third = Connect(echo.server->address(), DeadlineInMs(2000));
  ASSERT_TRUE(third.ok());
  uint8_t byte;
  const Status closed = ReadAll(third->get(), &byte, 1, DeadlineInMs(5000));
  EXPECT_NE(closed.code(), StatusCode::kTimeout) << closed.ToString();
  EXPECT_EQ(echo.server->rejected(), 1u);
  const auto lines = log.Starting("refused connection from 127.0.0.1");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("2 connections open (2 at most)"), std::string::npos) << lines[0];
  silent.clear();  // their handshakes fail; the threads end
  Result<std::unique_ptr<Link>> ok = Status::Unavailable("not tried");
  for (int i = 0; i < 100 && !ok.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ok = ConnectLink(echo.server->address(), TestSecret(), {.streams = 1});
  }
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
}

TEST(Auth, RejectedPeersAreLoggedAtMostTenASecondAndCountedInFull) {
  LogCapture log;
  EchoServer echo;
  constexpr int kPeers = 40;
  const std::vector<uint8_t> junk(48, 0x41);  // a header's worth of garbage: rejected at once
  for (int i = 0; i < kPeers; ++i) {
    auto fd = Connect(echo.server->address(), DeadlineInMs(2000));
    ASSERT_TRUE(fd.ok());
    ASSERT_TRUE(WriteAll(fd->get(), junk.data(), junk.size(), DeadlineInMs(2000)).ok());
  }
  for (int i = 0; i < 1000 && echo.server->rejected() < kPeers; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(echo.server->rejected(), static_cast<uint64_t>(kPeers));
  std::this_thread::sleep_for(std::chrono::milliseconds(1300));  // the acceptor flushes the count
  const size_t logged = log.Starting("rejected unauthenticated peer").size();
  uint64_t held = 0;
  for (const auto& m : log.Starting("")) {
    if (m.find(" more peers rejected in the last second (not logged)") != std::string::npos) {
      held += std::stoull(m);
    }
  }
  EXPECT_EQ(logged + held, static_cast<uint64_t>(kPeers));
  EXPECT_GT(held, 0u);
  EXPECT_LT(logged, static_cast<size_t>(kPeers));
}

TEST(Auth, HandshakeOverMemoryRejectsAWrongMac) {
  // Replay: a response computed for another challenge must fail.
  MemoryStream client_side({});
  std::array<uint8_t, 64> resp{};
  MetaWriter none;
  OutFrame f;
  f.op = Op::kAuthResponse;
  f.meta = resp;
  MemoryStream server_in(SerializeFrame(f));
  const Status s = ServerHandshake(server_in, TestSecret(), DeadlineInMs(100));
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
}

TEST(Transport, StripedTransferOverLoopbackIsByteExact) {
  EchoServer echo;
  for (size_t streams : {1, 3, 4}) {
    auto link = ConnectLink(echo.server->address(), TestSecret(), {.streams = streams});
    ASSERT_TRUE(link.ok()) << link.status().ToString();
    constexpr size_t kBlocks = 37, kBytes = 64 << 10;
    std::vector<std::vector<uint8_t>> src(kBlocks, std::vector<uint8_t>(kBytes));
    for (size_t b = 0; b < kBlocks; ++b) {
      for (size_t i = 0; i < kBytes; ++i) src[b][i] = static_cast<uint8_t>(b * 31 + i * 7);
    }
    std::vector<const uint8_t*> ptrs;
    for (auto& b : src) ptrs.push_back(b.data());
    auto streams_raw = (*link)->raw();
    ASSERT_TRUE(SendStriped(
                    streams_raw, Op::kPdData, 5, kBytes, ptrs,
                    [](size_t first, size_t count) {
                      MetaWriter w;
                      w.U32(static_cast<uint32_t>(first)).U32(static_cast<uint32_t>(count));
                      return w.Take();
                    },
                    DeadlineInMs(10000))
                    .ok());
    // Each stream echoes its chunk back: land every block at its index, like the P/D consumer.
    std::vector<std::vector<uint8_t>> dst(kBlocks, std::vector<uint8_t>(kBytes));
    size_t landed = 0;
    for (size_t s = 0; s < std::min(streams, kBlocks); ++s) {
      auto f = streams_raw[s]->RecvHead(DeadlineInMs(10000));
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      MetaReader r(f->meta);
      const uint32_t first = *r.U32(), count = *r.U32();
      ASSERT_EQ(count, f->header.num_blocks);
      std::vector<uint8_t*> into;
      for (uint32_t i = 0; i < count; ++i) into.push_back(dst[first + i].data());
      ASSERT_TRUE(streams_raw[s]->RecvBlocks(*f, into, DeadlineInMs(10000)).ok());
      landed += count;
    }
    EXPECT_EQ(landed, kBlocks);
    EXPECT_EQ(src, dst) << streams << " streams";
  }
}

TEST(Transport, LinkPoolReusesHealthyLinksAndDropsBrokenOnes) {
  EchoServer echo;
  LinkPool pool(TestSecret(), {.streams = 2});
  auto a = pool.Acquire(echo.server->address());
  ASSERT_TRUE(a.ok());
  const uint64_t id = (*a)->id;
  pool.Release(std::move(*a));
  EXPECT_EQ(pool.idle(), 1u);
  auto b = pool.Acquire(echo.server->address());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->id, id);
  (*b)->streams[1]->Close();
  pool.Release(std::move(*b));
  EXPECT_EQ(pool.idle(), 0u);
}

TEST(Transport, LinkPoolNeverHandsOutALinkThePeerClosedWhileIdle) {
  // A server that answers one ping per link and then drops the link, the way a producer's
  // Cancel or its idle timeout does while the consumer's pool holds the link.
  std::atomic<int> served{0};
  auto server = Server::Start({}, TestSecret(), [&](std::shared_ptr<Link> link) {
    Stream& s = *link->streams[0];
    auto f = s.Expect(Op::kPing, DeadlineInMs(5000));
    if (f.ok()) (void)s.SendMeta(Op::kPong, f->header.request_id, {}, DeadlineInMs(5000));
    served++;
  });
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  LinkPool pool(TestSecret(), {.streams = 2});
  auto ping = [&](Link& l, uint64_t id) {
    Status sent = l.streams[0]->SendMeta(Op::kPing, id, {}, DeadlineInMs(5000));
    if (!sent.ok()) return sent;
    return l.streams[0]->Expect(Op::kPong, DeadlineInMs(5000)).status();
  };
  auto a = pool.Acquire((*server)->address());
  ASSERT_TRUE(a.ok());
  const uint64_t first = (*a)->id;
  ASSERT_TRUE(ping(**a, 1).ok());
  pool.Release(std::move(*a));
  ASSERT_EQ(pool.idle(), 1u);  // healthy on our side: the close has not been seen yet
  for (int i = 0; i < 500 && served.load() < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(served.load(), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the FIN reaches our socket
  auto b = pool.Acquire((*server)->address());
  ASSERT_TRUE(b.ok());
  EXPECT_NE((*b)->id, first) << "the pool handed out the link its peer had closed";
  EXPECT_TRUE(ping(**b, 2).ok());
  EXPECT_EQ(pool.idle(), 0u);
}

TEST(Transport, DeadPeerTimesOutInsteadOfHanging) {
  // A listener that accepts and never answers: the handshake must end at its deadline.
  auto lfd = Listen(*ParseAddress("127.0.0.1:0"));
  ASSERT_TRUE(lfd.ok());
  auto addr = LocalAddress(lfd->get(), false);
  ASSERT_TRUE(addr.ok());
  const auto t0 = Clock::now();
  auto link =
      ConnectLink(*addr, TestSecret(), {.streams = 1, .timeout = std::chrono::milliseconds(200)});
  const auto took = Clock::now() - t0;
  ASSERT_FALSE(link.ok());
  EXPECT_EQ(link.status().code(), StatusCode::kTimeout);
  EXPECT_LT(took, std::chrono::seconds(5));
  // Nothing listens on a closed port: unavailable, not a hang.
  const Address gone = *addr;
  lfd->Reset();
  auto refused = ConnectLink(gone, TestSecret(), {.streams = 1});
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
}

TEST(Transport, FaultDoubleDropsCorruptsAndDisconnects) {
  EchoServer echo;
  std::vector<FaultyStream*> faulty;
  ConnectOptions opts{.streams = 1};
  opts.wrap = [&](std::unique_ptr<Stream> s, size_t) -> std::unique_ptr<Stream> {
    auto f = std::make_unique<FaultyStream>(std::move(s), FaultPlan{.corrupt_probability = 1.0});
    faulty.push_back(f.get());
    return f;
  };
  auto link = ConnectLink(echo.server->address(), TestSecret(), opts);
  ASSERT_TRUE(link.ok());
  std::vector<uint8_t> block(4096, 9);
  const uint8_t* ptr = block.data();
  OutFrame f;
  f.op = Op::kPdData;
  f.block_bytes = block.size();
  f.blocks = {&ptr, 1};
  ASSERT_TRUE((*link)->streams[0]->Send(f, DeadlineInMs(2000)).ok());
  // The echo server saw the damage and answered with a Corrupted error.
  auto reply = (*link)->streams[0]->Expect(Op::kPdData, DeadlineInMs(2000));
  EXPECT_EQ(reply.status().code(), StatusCode::kCorrupted);
  EXPECT_EQ(faulty[0]->counters().corrupted, 1u);

  // Drop: the frame never arrives, the reader times out.
  FaultyStream drop(std::move((*link)->streams[0]), FaultPlan{.drop_probability = 1.0});
  ASSERT_TRUE(drop.Send(f, DeadlineInMs(2000)).ok());
  EXPECT_EQ(drop.RecvHead(DeadlineInMs(100)).status().code(), StatusCode::kTimeout);
  EXPECT_EQ(drop.counters().dropped, 1u);

  // Disconnect after one send; delay is applied before sending.
  auto link2 = ConnectLink(echo.server->address(), TestSecret(), {.streams = 1});
  ASSERT_TRUE(link2.ok());
  FaultyStream cut(std::move((*link2)->streams[0]),
                   FaultPlan{.delay = std::chrono::milliseconds(20), .disconnect_after_sends = 1});
  ASSERT_TRUE(cut.Send(f, DeadlineInMs(2000)).ok());
  ASSERT_TRUE(cut.RecvHead(DeadlineInMs(2000)).ok());
  EXPECT_EQ(cut.Send(f, DeadlineInMs(2000)).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(cut.broken());
  EXPECT_EQ(cut.counters().delayed, 1u);
}

TEST(Transport, UnixSocketLinksWork) {
  ServerOptions opts;
  opts.listen = "unix:/tmp/tpusync-link-test-" + std::to_string(::getpid()) + ".sock";
  EchoServer echo(opts);
  EXPECT_TRUE(echo.server->address().is_unix);
  auto link = ConnectLink(echo.server->address(), TestSecret(), {.streams = 2});
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  EXPECT_TRUE((*link)->healthy());
}

// UNIX PATH RULE: a listener replaces only a stale socket at its path; a file or a live peer's
// socket is refused and left alone, and a stop removes the path only while it is its own socket.
TEST(Transport, AUnixListenerNeverRemovesWhatIsNotItsStaleSocket) {
  const std::string path = "/tmp/tpusync-link-path-" + std::to_string(::getpid()) + ".sock";
  auto listen = [&] {
    ServerOptions o;
    o.listen = "unix:" + path;
    return Server::Start(std::move(o), TestSecret(), [](std::shared_ptr<Link>) {});
  };
  ::unlink(path.c_str());
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("notes", f);
  std::fclose(f);
  auto on_file = listen();
  EXPECT_EQ(on_file.status().code(), StatusCode::kAlreadyExists) << on_file.status().ToString();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));  // the file is still there
  ASSERT_EQ(::unlink(path.c_str()), 0);

  auto first = listen();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = listen();  // a live listener's socket is not taken over
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists) << second.status().ToString();
  EXPECT_TRUE(ConnectLink((*first)->address(), TestSecret(), {}).ok());

  // Another process replaced the path: the first listener's stop leaves it alone.
  ASSERT_EQ(::unlink(path.c_str()), 0);
  f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  (*first)->Stop();
  EXPECT_EQ(::stat(path.c_str(), &st), 0);
  ASSERT_EQ(::unlink(path.c_str()), 0);

  // A stale socket (its process died without removing it) is replaced.
  int raw = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
  ASSERT_EQ(::bind(raw, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ::close(raw);
  auto fresh = listen();
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  (*fresh)->Stop();
  EXPECT_NE(::stat(path.c_str(), &st), 0);  // its own socket is removed at stop
}

TEST(Transport, StopJoinsEverythingWithLinksOpen) {
  EchoServer echo;
  auto link = ConnectLink(echo.server->address(), TestSecret(), {.streams = 4});
  ASSERT_TRUE(link.ok());
  const auto t0 = Clock::now();
  echo.server->Stop();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  EXPECT_EQ((*link)->streams[0]->RecvHead(DeadlineInMs(2000)).status().code(),
            StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tpusync::transport
