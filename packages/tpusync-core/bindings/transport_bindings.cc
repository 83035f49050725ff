// The P/D streaming primitive (PdProducer / PdConsumer) over the native transport. Thin: argument
// conversion, GIL release around every call that can block, Status -> exception.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "tpusync/transport/pd_stream.h"

namespace tpusync::bindings {
namespace {

using memory::BlockAllocator;
using memory::BlockId;
using transport::Deadline;
using transport::PdConsumer;
using transport::PdProducer;
using transport::PdStatus;

Deadline After(double seconds) {
  if (!(seconds >= 0)) ThrowIfError(Status::InvalidArgument("a timeout must be >= 0 seconds"));
  return transport::Clock::now() + std::chrono::duration_cast<transport::Clock::duration>(
                                       std::chrono::duration<double>(seconds));
}

std::chrono::milliseconds Ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

transport::Secret MakeSecret(const nb::bytes& secret) {
  return Unwrap(transport::Secret::FromBytes(std::string(secret.c_str(), secret.size())));
}

nb::dict ToDict(const PdStatus& s) {
  nb::dict d;
  d["request_id"] = s.request_id;
  d["state"] = std::string(transport::PdStateName(s.state));
  if (s.reason.ok()) {
    d["code"] = nb::none();
    d["reason"] = nb::none();
  } else {
    d["code"] = std::string(StatusCodeName(s.reason.code()));
    d["reason"] = s.reason.ToString();
  }
  d["groups_total"] = s.groups_total;
  d["groups_ready"] = s.groups_ready;
  d["bytes"] = s.bytes;
  d["shm"] = s.shm;
  return d;
}

nb::list ToList(const std::vector<PdStatus>& v) {
  nb::list out;
  for (const auto& s : v) out.append(ToDict(s));
  return out;
}

}  // namespace

void init_transport(nb::module_& m) {
  nb::class_<PdProducer>(m, "PdProducer",
                         "P/D producer: serves registered pool blocks to authenticated consumers.")
      .def_static(
          "start",
          [](std::shared_ptr<BlockAllocator> pool, nb::bytes secret, const std::string& listen,
             const std::string& unix_path, double handshake_timeout, int socket_buffer_bytes) {
            transport::PdProducerOptions o;
            o.listen = listen;
            o.unix_path = unix_path;
            o.server.handshake_timeout = Ms(handshake_timeout);
            o.server.socket.buffer_bytes = socket_buffer_bytes;
            auto s = MakeSecret(secret);
            nb::gil_scoped_release release;
            return std::shared_ptr<PdProducer>(
                Unwrap(PdProducer::Start(std::move(pool), std::move(s), o)));
          },
          nb::arg("pool"), nb::arg("secret"), nb::arg("listen") = "127.0.0.1:0",
          nb::arg("unix_path") = "", nb::arg("handshake_timeout") = 5.0,
          nb::arg("socket_buffer_bytes") = 8 << 20)
      .def_prop_ro("address", [](const PdProducer& p) { return p.address().ToString(); })
      .def_prop_ro("unix_address", &PdProducer::unix_address)
      .def_prop_ro("pending", &PdProducer::pending)
      .def(
          "register_send",
          [](PdProducer& p, uint64_t request_id, std::vector<BlockId> blocks, double deadline,
             uint32_t blocks_per_group) {
            const Deadline d = After(deadline);
            nb::gil_scoped_release release;
            ThrowIfError(p.RegisterSend(request_id, std::move(blocks), blocks_per_group, d));
          },
          nb::arg("request_id"), nb::arg("blocks"), nb::arg("deadline"),
          nb::arg("blocks_per_group") = 0)
      .def("poll",
           [](PdProducer& p) {
             std::vector<PdStatus> v;
             {
               nb::gil_scoped_release release;
               v = p.Poll();
             }
             return ToList(v);
           })
      .def("stop", &PdProducer::Stop, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<PdConsumer>(m, "PdConsumer",
                         "P/D consumer: pulls registered blocks into its own pool blocks.")
      .def_static(
          "create",
          [](std::shared_ptr<BlockAllocator> pool, nb::bytes secret, size_t streams,
             double connect_timeout, int socket_buffer_bytes) {
            transport::PdConsumerOptions o;
            o.connect.streams = streams;
            o.connect.timeout = Ms(connect_timeout);
            o.connect.socket.buffer_bytes = socket_buffer_bytes;
            auto s = MakeSecret(secret);
            nb::gil_scoped_release release;
            return std::shared_ptr<PdConsumer>(
                Unwrap(PdConsumer::Create(std::move(pool), std::move(s), o)));
          },
          nb::arg("pool"), nb::arg("secret"), nb::arg("streams") = 4,
          nb::arg("connect_timeout") = 5.0, nb::arg("socket_buffer_bytes") = 8 << 20)
      .def(
          "start_recv",
          [](PdConsumer& c, uint64_t request_id,
             std::vector<std::pair<std::string, std::vector<BlockId>>> sources, double deadline) {
            std::vector<transport::PdSource> src;
            for (auto& [peer, blocks] : sources) src.push_back({peer, std::move(blocks)});
            const Deadline d = After(deadline);
            nb::gil_scoped_release release;
            ThrowIfError(c.StartRecv(request_id, std::move(src), d));
          },
          nb::arg("request_id"), nb::arg("sources"), nb::arg("deadline"))
      .def("poll",
           [](PdConsumer& c) {
             std::vector<PdStatus> v;
             {
               nb::gil_scoped_release release;
               v = c.Poll();
             }
             return ToList(v);
           })
      .def(
          "wait",
          [](PdConsumer& c, uint64_t request_id, uint32_t groups, double timeout) {
            const Deadline d = After(timeout);
            Result<PdStatus> r = Status::Internal("unset");
            {
              nb::gil_scoped_release release;
              r = c.Wait(request_id, groups, d);
            }
            return ToDict(Unwrap(std::move(r)));
          },
          nb::arg("request_id"), nb::arg("groups"), nb::arg("timeout"))
      .def_prop_ro("idle_links", &PdConsumer::idle_links);
}

}  // namespace tpusync::bindings
