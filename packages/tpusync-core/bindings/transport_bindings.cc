// The P/D streaming primitive (PdProducer / PdConsumer) over the native transport. Thin: argument
// conversion, GIL release around every call that can block, Status -> exception.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "tpusync/base/seconds.h"
#include "tpusync/node/remote_tier.h"
#include "tpusync/node/store_client.h"
#include "tpusync/node/store_node.h"
#include "tpusync/store/kv_store.h"
#include "tpusync/transport/pd_stream.h"

namespace tpusync::bindings {
namespace {

using memory::BlockAllocator;
using memory::BlockId;
using transport::Deadline;
using transport::PdConsumer;
using transport::PdProducer;
using transport::PdStatus;

Deadline After(double seconds, const char* what) {
  if (!(seconds >= 0)) {
    ThrowIfError(Status::InvalidArgument(StrCat(what, " must be >= 0 seconds, got ", seconds)));
  }
  return transport::Clock::now() + SecondsToDuration(seconds);  // inf: for ever
}

// A timeout or interval that must be positive (a zero one would fail every request).
std::chrono::milliseconds Ms(double seconds, const char* what = "a timeout") {
  if (!(seconds > 0)) {
    ThrowIfError(Status::InvalidArgument(StrCat(what, " must be > 0 seconds, got ", seconds)));
  }
  return std::max(SecondsToMs(seconds), std::chrono::milliseconds(1));
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
  d["checksums"] = s.checksums;
  return d;
}

// `readers`: empty (every source has one reader) or one count per source (SHARED-SEND CONTRACT).
std::vector<transport::PdSource> Sources(
    std::vector<std::pair<std::string, std::vector<BlockId>>> sources,
    const std::vector<uint32_t>& readers) {
  if (!readers.empty() && readers.size() != sources.size()) {
    ThrowIfError(Status::InvalidArgument(StrCat(sources.size(), " sources with ", readers.size(),
                                                " reader counts (one per source)")));
  }
  std::vector<transport::PdSource> out;
  for (size_t i = 0; i < sources.size(); ++i) {
    out.push_back({std::move(sources[i].first), std::move(sources[i].second),
                   readers.empty() ? 1u : readers[i]});
  }
  return out;
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
            o.server.handshake_timeout = Ms(handshake_timeout, "handshake_timeout");
            o.server.socket.buffer_bytes = socket_buffer_bytes;
            auto s = MakeSecret(secret);
            nb::gil_scoped_release release;
            return OwnedGilFree(
                Unwrap(PdProducer::Start(std::move(pool), std::move(s), o)).release());
          },
          nb::arg("pool"), nb::arg("secret"), nb::arg("listen") = "127.0.0.1:0",
          nb::arg("unix_path") = "", nb::arg("handshake_timeout") = 5.0,
          nb::arg("socket_buffer_bytes") = 0)
      .def_prop_ro("address", [](const PdProducer& p) { return p.address().ToString(); })
      .def_prop_ro("unix_address", &PdProducer::unix_address)
      .def_prop_ro("pending", &PdProducer::pending)
      .def(
          "register_send",
          [](PdProducer& p, uint64_t request_id, std::vector<BlockId> blocks, double deadline,
             uint32_t blocks_per_group, std::vector<uint64_t> checksums) {
            const Deadline d = After(deadline, "deadline");
            nb::gil_scoped_release release;
            ThrowIfError(p.RegisterSend(request_id, std::move(blocks), blocks_per_group, d,
                                        std::move(checksums)));
          },
          nb::arg("request_id"), nb::arg("blocks"), nb::arg("deadline"),
          nb::arg("blocks_per_group") = 0, nb::arg("checksums") = std::vector<uint64_t>{})
      .def(
          "register_relay",
          [](PdProducer& p, uint64_t request_id, uint32_t num_blocks, double deadline,
             uint32_t blocks_per_group) {
            const Deadline d = After(deadline, "deadline");
            nb::gil_scoped_release release;
            ThrowIfError(p.RegisterRelay(request_id, num_blocks, blocks_per_group, d));
          },
          nb::arg("request_id"), nb::arg("num_blocks"), nb::arg("deadline"),
          nb::arg("blocks_per_group") = 0)
      .def(
          "open",
          [](PdProducer& p, uint64_t request_id, uint32_t first, std::vector<BlockId> blocks,
             std::vector<uint64_t> checksums) {
            nb::gil_scoped_release release;
            ThrowIfError(p.Open(request_id, first, blocks, checksums));
          },
          nb::arg("request_id"), nb::arg("first"), nb::arg("blocks"), nb::arg("checksums"))
      .def(
          "cancel",
          [](PdProducer& p, uint64_t request_id, const std::string& reason) {
            nb::gil_scoped_release release;
            ThrowIfError(p.Cancel(request_id, Status::Cancelled(reason)));
          },
          nb::arg("request_id"), nb::arg("reason"))
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
             double connect_timeout, int socket_buffer_bytes, size_t small_pull_bytes,
             double abandon_timeout) {
            transport::PdConsumerOptions o;
            o.small_pull_bytes = small_pull_bytes;
            o.abandon_timeout = Ms(abandon_timeout, "abandon_timeout");
            o.connect.streams = streams;
            o.connect.timeout = Ms(connect_timeout, "connect_timeout");
            o.connect.socket.buffer_bytes = socket_buffer_bytes;
            auto s = MakeSecret(secret);
            nb::gil_scoped_release release;
            return OwnedGilFree(
                Unwrap(PdConsumer::Create(std::move(pool), std::move(s), o)).release());
          },
          nb::arg("pool"), nb::arg("secret"), nb::arg("streams") = 4,
          nb::arg("connect_timeout") = 5.0, nb::arg("socket_buffer_bytes") = 0,
          nb::arg("small_pull_bytes") = size_t{256} << 10, nb::arg("abandon_timeout") = 2.0)
      .def(
          "recv",
          [](PdConsumer& c, uint64_t request_id,
             std::vector<std::pair<std::string, std::vector<BlockId>>> sources, double deadline,
             const std::vector<uint32_t>& readers) {
            auto src = Sources(std::move(sources), readers);
            const Deadline d = After(deadline, "deadline");
            Result<PdStatus> r = Status::Internal("unset");
            {
              nb::gil_scoped_release release;
              r = c.Recv(request_id, std::move(src), d);
            }
            return ToDict(Unwrap(std::move(r)));
          },
          nb::arg("request_id"), nb::arg("sources"), nb::arg("deadline"),
          nb::arg("readers") = std::vector<uint32_t>{})
      .def(
          "start_recv",
          [](PdConsumer& c, uint64_t request_id,
             std::vector<std::pair<std::string, std::vector<BlockId>>> sources, double deadline,
             const std::vector<uint32_t>& readers, std::shared_ptr<PdProducer> relay,
             std::vector<uint64_t> relay_ids) {
            auto src = Sources(std::move(sources), readers);
            const Deadline d = After(deadline, "deadline");
            transport::PdLanded on_landed;
            if (relay && !relay_ids.empty()) {
              // RELAY CONTRACT: each landed run is opened on every relay, natively (no GIL). A
              // relay that ended (its reader died, it was cancelled) refuses; the others go on.
              on_landed = [relay, relay_ids](uint32_t first, std::span<const BlockId> blocks,
                                             std::span<const uint64_t> checksums) {
                for (uint64_t id : relay_ids) (void)relay->Open(id, first, blocks, checksums);
              };
            }
            nb::gil_scoped_release release;
            ThrowIfError(c.StartRecv(request_id, std::move(src), d, std::move(on_landed)));
          },
          nb::arg("request_id"), nb::arg("sources"), nb::arg("deadline"),
          nb::arg("readers") = std::vector<uint32_t>{}, nb::arg("relay").none() = nullptr,
          nb::arg("relay_ids") = std::vector<uint64_t>{})
      .def(
          "abandon",
          [](PdConsumer& c, uint64_t request_id, const std::string& reason) {
            Result<std::vector<transport::PdRelease>> r = Status::Internal("unset");
            {
              nb::gil_scoped_release release;
              r = c.Abandon(request_id, Status::Cancelled(reason));
            }
            nb::list out;
            for (const auto& rel : Unwrap(std::move(r))) {
              nb::dict d;
              d["peer"] = rel.peer;
              if (rel.status.ok()) {
                d["code"] = nb::none();
                d["reason"] = nb::none();
              } else {
                d["code"] = std::string(StatusCodeName(rel.status.code()));
                d["reason"] = rel.status.ToString();
              }
              out.append(d);
            }
            return out;
          },
          nb::arg("request_id"), nb::arg("reason"))
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
            const Deadline d = After(timeout, "timeout");
            Result<PdStatus> r = Status::Internal("unset");
            {
              nb::gil_scoped_release release;
              r = c.Wait(request_id, groups, d);
            }
            return ToDict(Unwrap(std::move(r)));
          },
          nb::arg("request_id"), nb::arg("groups"), nb::arg("timeout"))
      .def_prop_ro("idle_links", &PdConsumer::idle_links);

  nb::class_<node::StoreNode>(m, "StoreNode", "A distributed prefix cache node (put/get/lookup).")
      .def_static(
          "start",
          [](nb::bytes secret, const std::string& listen, size_t capacity_bytes, size_t block_bytes,
             const std::string& disk_dir, size_t disk_capacity_bytes, const std::string& name_space,
             const std::string& fingerprint) {
            node::StoreNodeOptions o;
            o.listen = listen;
            o.capacity_bytes = capacity_bytes;
            o.block_bytes = block_bytes;
            o.disk_dir = disk_dir;
            o.disk_capacity_bytes = disk_capacity_bytes;
            o.name_space = name_space;
            o.fingerprint = fingerprint;
            auto s = MakeSecret(secret);
            nb::gil_scoped_release release;
            return OwnedGilFree(Unwrap(node::StoreNode::Start(o, std::move(s))).release());
          },
          nb::arg("secret"), nb::arg("listen") = "127.0.0.1:0",
          nb::arg("capacity_bytes") = size_t{1} << 30, nb::arg("block_bytes") = 256 << 10,
          nb::arg("disk_dir") = "", nb::arg("disk_capacity_bytes") = 0, nb::arg("name_space") = "",
          nb::arg("fingerprint") = "")
      .def_prop_ro("address", [](const node::StoreNode& n) { return n.address().ToString(); })
      .def_prop_ro("cold_start_reason", &node::StoreNode::cold_start_reason)
      .def_prop_ro("block_bytes", &node::StoreNode::block_bytes)
      .def("stats",
           [](node::StoreNode& n) {
             const auto s = n.stats();
             nb::dict d;
             d["blocks_total"] = s.blocks_total;
             d["blocks_used"] = s.blocks_used;
             d["puts"] = s.puts;
             d["put_blocks"] = s.put_blocks;
             d["put_exists"] = s.put_exists;
             d["put_corrupt"] = s.put_corrupt;
             d["put_no_space"] = s.put_no_space;
             d["gets"] = s.gets;
             d["get_hits"] = s.get_hits;
             d["get_misses"] = s.get_misses;
             d["lookups"] = s.lookups;
             d["removes"] = s.removes;
             d["evictions"] = s.evictions;
             d["leases"] = s.leases;
             d["leases_expired"] = s.leases_expired;
             d["leases_refused"] = s.leases_refused;
             d["leases_active"] = s.leases_active;
             d["disk_blocks_total"] = s.disk_blocks_total;
             d["disk_blocks_used"] = s.disk_blocks_used;
             d["bytes_in"] = s.bytes_in;
             d["bytes_out"] = s.bytes_out;
             d["rejected_peers"] = s.rejected_peers;
             d["links"] = s.links;
             d["requests_failed"] = s.requests_failed;
             d["recovered_blocks"] = s.recovered_blocks;
             return d;
           })
      .def("stop", &node::StoreNode::Stop, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<node::StoreClient>(m, "StoreClient",
                                "Client of several store nodes: rendezvous hashing, replicas.")
      .def_static(
          "create",
          [](std::shared_ptr<BlockAllocator> pool, nb::bytes secret, std::vector<std::string> nodes,
             size_t replication, double timeout) {
            node::StoreClientOptions o;
            o.nodes = std::move(nodes);
            o.replication = replication;
            o.timeout = Ms(timeout);
            o.connect.timeout = Ms(timeout);
            auto s = MakeSecret(secret);
            return OwnedGilFree(
                Unwrap(node::StoreClient::Create(std::move(pool), std::move(s), o)).release());
          },
          nb::arg("pool"), nb::arg("secret"), nb::arg("nodes"), nb::arg("replication") = 1,
          nb::arg("timeout") = 10.0)
      .def(
          "rank",
          [](const node::StoreClient& c, nb::bytes key) {
            return c.Rank(std::string_view(key.c_str(), key.size()));
          },
          nb::arg("key"))
      .def(
          "put",
          [](node::StoreClient& c, const std::vector<nb::bytes>& keys,
             const std::vector<BlockId>& blocks) {
            auto ks = Keys(keys);
            nb::gil_scoped_release release;
            return Unwrap(c.Put(ks, blocks));
          },
          nb::arg("keys"), nb::arg("blocks"))
      .def(
          "get",
          [](node::StoreClient& c, const std::vector<nb::bytes>& keys,
             const std::vector<BlockId>& dst) {
            auto ks = Keys(keys);
            nb::gil_scoped_release release;
            return Unwrap(c.Get(ks, dst));
          },
          nb::arg("keys"), nb::arg("dst"))
      .def(
          "lookup_prefix",
          [](node::StoreClient& c, const std::vector<nb::bytes>& keys, double lease) {
            if (!(lease >= 0)) {  // NaN too
              ThrowIfError(Status::InvalidArgument(
                  StrCat("lease must be >= 0 seconds (0: no lease), got ", lease)));
            }
            auto ks = Keys(keys);
            nb::gil_scoped_release release;
            if (lease > 0) return Unwrap(c.LookupPrefix(ks, Ms(lease)));
            return Unwrap(c.LookupPrefix(ks));
          },
          nb::arg("keys"), nb::arg("lease") = 0.0)
      .def(
          "remove",
          [](node::StoreClient& c, const std::vector<nb::bytes>& keys) {
            auto ks = Keys(keys);
            nb::gil_scoped_release release;
            return Unwrap(c.Remove(ks));
          },
          nb::arg("keys"))
      .def(
          "check_nodes", [](node::StoreClient& c) { ThrowIfError(c.CheckNodes()); },
          nb::call_guard<nb::gil_scoped_release>());

  // A KVStore whose last tier is the remote tier over store nodes (node/remote_tier.h).
  m.def(
      "open_remote_kv_store",
      [](std::shared_ptr<engine::ThreadPool> engine, size_t block_bytes, size_t host_blocks,
         std::vector<std::string> nodes, nb::bytes secret, const std::string& disk_dir,
         size_t disk_blocks, size_t disk_segment_blocks, bool disk_direct_io,
         const std::string& io_backend, size_t io_threads, const std::string& policy,
         size_t writeback_batch, size_t writeback_headroom, double put_wait_s, bool prefault,
         bool huge_pages, const std::string& name_space, const std::string& fingerprint,
         size_t replicas, size_t remote_blocks, double lease, double timeout, bool write_through,
         block::Recency index_recency, double disk_checkpoint_s, size_t disk_checkpoint_writes,
         bool disk_manifest_progressive_write_back) {
        const store::KVStoreOptions o = StoreOptions(
            block_bytes, host_blocks, name_space, fingerprint, disk_dir, disk_blocks,
            disk_segment_blocks, disk_direct_io, io_backend, io_threads, policy, writeback_batch,
            writeback_headroom, put_wait_s, prefault, huge_pages, write_through, index_recency,
            disk_checkpoint_s, disk_checkpoint_writes, disk_manifest_progressive_write_back);
        node::RemoteTierOptions r;
        r.block_bytes = block_bytes;
        r.capacity_blocks = remote_blocks;
        r.lease = Ms(lease, "lease_s");
        r.client.nodes = std::move(nodes);
        r.client.replication = replicas;
        r.client.timeout = Ms(timeout, "remote_timeout");
        r.client.connect.timeout = r.client.timeout;
        auto sec = MakeSecret(secret);
        nb::gil_scoped_release release;
        if (block_bytes == 0)
          ThrowIfError(Status::InvalidArgument("KVStore needs block_bytes > 0"));
        // The remote tier first: a refused open must not leave a /dev/shm host tier behind.
        auto remote = Unwrap(node::RemoteTier::Open(std::move(r), std::move(sec)));
        auto tiers = Unwrap(store::KVStore::OpenTiers(o, /*tiers_below=*/1));
        tiers.push_back(std::move(remote));
        return OwnedGilFree(
            Unwrap(store::KVStore::Open(std::move(tiers), store::KVStore::ConfigFrom(o),
                                        std::move(engine)))
                .release());
      },
      nb::arg("engine"), nb::arg("block_bytes"), nb::arg("host_blocks"), nb::arg("nodes"),
      nb::arg("secret"), nb::arg("disk_dir") = "", nb::arg("disk_blocks") = 0,
      nb::arg("disk_segment_blocks") = 0, nb::arg("disk_direct_io") = true,
      nb::arg("io_backend") = "auto", nb::arg("io_threads") = 4, nb::arg("policy") = "lru",
      nb::arg("writeback_batch") = 32, nb::arg("writeback_headroom") = 0,
      nb::arg("put_wait_s") = 5.0, nb::arg("prefault") = true, nb::arg("huge_pages") = false,
      nb::arg("name_space") = "", nb::arg("fingerprint") = "", nb::arg("replicas") = 1,
      nb::arg("remote_blocks") = 1 << 16, nb::arg("lease") = 10.0, nb::arg("timeout") = 10.0,
      nb::arg("write_through") = false,
      nb::arg("index_recency") = block::BlockIndex::kDefaultRecency,
      nb::arg("disk_checkpoint_s") = 60.0, nb::arg("disk_checkpoint_writes") = 1 << 16,
      nb::arg("disk_manifest_progressive_write_back") = true,
      "A KVStore over host [-> disk] -> store nodes (host demotes to disk first, then remote).");
}

}  // namespace tpusync::bindings
