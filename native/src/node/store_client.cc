#include "tpusync/node/store_client.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_set>

#include "tpusync/base/checksum.h"
#include "tpusync/block/block_key.h"

namespace tpusync::node {

using transport::DeadlineInMs;
using transport::MetaReader;
using transport::Op;

StoreClient::StoreClient(std::shared_ptr<BlockAllocator> pool, Secret secret,
                         StoreClientOptions options)
    : pool_(std::move(pool)),
      options_(std::move(options)),
      links_(std::move(secret), options_.connect) {}

Result<std::unique_ptr<StoreClient>> StoreClient::Make(std::shared_ptr<BlockAllocator> pool,
                                                       size_t block_bytes, Secret secret,
                                                       StoreClientOptions options) {
  if (block_bytes == 0) return Status::InvalidArgument("StoreClient needs block_bytes > 0");
  if (options.nodes.empty()) return Status::InvalidArgument("StoreClient needs at least one node");
  if (options.replication == 0 || options.replication > options.nodes.size()) {
    return Status::InvalidArgument(
        StrCat("replication ", options.replication, " with ", options.nodes.size(), " nodes"));
  }
  std::unique_ptr<StoreClient> c(new StoreClient(std::move(pool), std::move(secret), options));
  c->block_bytes_ = block_bytes;
  for (const auto& n : options.nodes) {
    TPUSYNC_ASSIGN_OR_RETURN(auto a, transport::ParseAddress(n));
    const std::string canon = a.ToString();
    for (const auto& seen : c->addrs_) {
      if (seen.ToString() == canon) {  // NODE LIST RULE
        return Status::InvalidArgument(StrCat("node ", canon,
                                              " is listed twice (its replicas would be one node); "
                                              "list each node once"));
      }
    }
    c->addrs_.push_back(a);
    c->seeds_.push_back(Checksum64(canon.data(), canon.size()));
  }
  return c;
}

Result<std::unique_ptr<StoreClient>> StoreClient::Create(std::shared_ptr<BlockAllocator> pool,
                                                         Secret secret,
                                                         StoreClientOptions options) {
  if (!pool) return Status::InvalidArgument("StoreClient needs a block pool");
  const size_t bytes = pool->block_bytes();
  return Make(std::move(pool), bytes, std::move(secret), std::move(options));
}

Result<std::unique_ptr<StoreClient>> StoreClient::CreateRaw(size_t block_bytes, Secret secret,
                                                            StoreClientOptions options) {
  return Make(nullptr, block_bytes, std::move(secret), std::move(options));
}

namespace {
// Every key as a node would check it (block::ValidateKey), before any request leaves.
Status ValidateKeys(const std::vector<std::string>& keys) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (Status s = block::ValidateKey(keys[i]); !s.ok()) {
      return Status::InvalidArgument(StrCat("key ", i, " of ", keys.size(), ": ", s.message()));
    }
  }
  return Status::OK();
}
}  // namespace

std::vector<size_t> StoreClient::Rank(std::string_view key) const {
  std::vector<std::pair<uint64_t, size_t>> scored;
  for (size_t i = 0; i < seeds_.size(); ++i) {
    scored.emplace_back(Checksum64(key.data(), key.size(), seeds_[i]), i);
  }
  std::sort(scored.begin(), scored.end(), std::greater<>());
  std::vector<size_t> out;
  for (auto& [s, i] : scored) out.push_back(i);
  return out;
}

template <typename Fn>
auto StoreClient::ForEachNode(const std::map<size_t, std::vector<size_t>>& per_node, Fn fn)
    -> std::vector<decltype(fn(size_t{}, per_node.begin()->second))> {
  using R = decltype(fn(size_t{}, per_node.begin()->second));
  std::vector<std::optional<R>> out(per_node.size());
  std::vector<std::thread> threads;
  size_t e = 0;
  for (const auto& [node, idx] : per_node) {
    auto run = [&, node = node, e] { out[e].emplace(fn(node, per_node.at(node))); };
    if (e++ == 0) continue;  // the first entry runs on the calling thread, below
    try {
      threads.emplace_back(run);
    } catch (const std::system_error&) {
      run();  // no thread to spare: this node is asked on the calling thread
    }
  }
  if (!per_node.empty()) out[0].emplace(fn(per_node.begin()->first, per_node.begin()->second));
  for (auto& t : threads) t.join();
  std::vector<R> results;
  results.reserve(out.size());
  for (auto& r : out) results.push_back(std::move(*r));
  return results;
}

Result<std::vector<uint8_t>> StoreClient::Call(size_t n, Op op,
                                               const std::vector<std::string>& keys,
                                               std::span<const uint8_t* const> payload,
                                               std::span<uint8_t* const> dst, uint8_t flags,
                                               std::span<const uint8_t> extra_meta,
                                               std::span<uint64_t> sums) {
  TPUSYNC_ASSIGN_OR_RETURN(auto link, links_.Acquire(addrs_[n]));
  transport::Stream& s = *link->streams[0];
  const auto deadline = transport::Clock::now() + options_.timeout;
  auto meta = EncodeKeys(keys);
  meta.insert(meta.end(), extra_meta.begin(), extra_meta.end());
  transport::OutFrame f;
  f.op = op;
  f.flags = flags;
  f.meta = meta;
  f.blocks = payload;
  f.block_bytes = payload.empty() ? 0 : block_bytes_;
  TPUSYNC_RETURN_IF_ERROR(s.Send(f, deadline));
  auto reply = s.RecvHead(deadline);
  if (!reply.ok()) return reply.status();
  if (reply->op() != Op::kStoreReply) {
    link->Close();
    return Status::Corrupted(StrCat("store node sent ", transport::OpName(reply->op())));
  }
  MetaReader r(reply->meta);
  auto code = r.U8();
  auto msg = r.Str();
  auto count = r.U32();
  if (!code.ok() || !msg.ok() || !count.ok()) {
    link->Close();
    return Status::Corrupted("malformed store reply");
  }
  auto per_key = r.Bytes(*count);
  if (per_key.ok() && r.remaining() >= 8) {  // the node's block size (store_node.h)
    auto theirs = r.U64();
    if (theirs.ok() && *theirs != block_bytes_) {
      link->Close();
      return Status::InvalidArgument(StrCat("store node ", addrs_[n].ToString(), " serves ",
                                            *theirs, "-byte blocks; this client's are ",
                                            block_bytes_,
                                            " bytes (give both the same block size)"));
    }
  }
  const Status st = transport::DecodeStatus(std::span(reply->meta).first(5 + msg->size()));
  std::vector<uint8_t> out;
  if (per_key.ok()) out.assign(per_key->begin(), per_key->end());
  if (st.ok() && (!per_key.ok() || out.size() != keys.size())) {
    link->Close();
    return Status::Corrupted("store reply has the wrong number of per-key results");
  }
  // Get: the payload holds the found blocks, in key order.
  std::vector<uint8_t*> into;
  if (!dst.empty() && st.ok()) {
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i]) into.push_back(dst[i]);
    }
  }
  if (reply->header.num_blocks != 0 && reply->header.block_bytes != block_bytes_) {
    link->Close();
    return Status::InvalidArgument(StrCat("store node ", addrs_[n].ToString(), " serves ",
                                          reply->header.block_bytes,
                                          "-byte blocks; this client's are ", block_bytes_,
                                          " bytes (give both the same block size)"));
  }
  if (reply->header.num_blocks != into.size()) {
    link->Close();
    return Status::Corrupted("store reply payload does not match its found flags");
  }
  if (!into.empty()) {
    Status got = s.RecvBlocks(*reply, into, deadline);
    if (!got.ok()) {
      links_.Release(std::move(link));
      return got;
    }
    if (!sums.empty()) {  // RecvBlocks verified block j against reply->checksums[j]
      for (size_t i = 0, j = 0; i < out.size(); ++i) {
        if (out[i]) sums[i] = reply->checksums[j++];
      }
    }
  }
  links_.Release(std::move(link));
  if (!st.ok()) return st;
  return out;
}

Result<std::vector<uint8_t>> StoreClient::CallRange(size_t n, Op op,
                                                    const std::vector<std::string>& keys,
                                                    std::span<const uint8_t* const> payload,
                                                    std::span<uint8_t* const> dst, size_t lo,
                                                    size_t hi, std::span<uint64_t> sums) {
  const size_t per = std::max<size_t>(1, kMaxRequestBytes / block_bytes_);
  std::vector<uint8_t> out;
  out.reserve(hi - lo);
  for (size_t a = lo; a < hi; a += per) {
    const size_t b = std::min(hi, a + per);
    std::vector<std::string> ks(keys.begin() + a, keys.begin() + b);
    auto res = Call(n, op, ks, payload.empty() ? payload : payload.subspan(a, b - a),
                    dst.empty() ? dst : dst.subspan(a, b - a), 0, {},
                    sums.empty() ? sums : sums.subspan(a, b - a));
    if (!res.ok()) return res.status();
    out.insert(out.end(), res->begin(), res->end());
  }
  return out;
}

Result<std::vector<uint8_t>> StoreClient::CallChunked(size_t n, Op op,
                                                      const std::vector<std::string>& keys,
                                                      std::span<const uint8_t* const> payload,
                                                      std::span<uint8_t* const> dst,
                                                      std::span<uint64_t> sums) {
  const size_t bytes = keys.size() * block_bytes_;
  const size_t stripes = std::clamp<size_t>(bytes / kStripeMinBytes, 1, kMaxStripes);
  if (stripes == 1) return CallRange(n, op, keys, payload, dst, 0, keys.size(), sums);
  const size_t part = (keys.size() + stripes - 1) / stripes;
  std::vector<Status> status(stripes);
  std::vector<std::vector<uint8_t>> results(stripes);
  auto run = [&](size_t i) {
    const size_t lo = i * part;
    const size_t hi = std::min(keys.size(), lo + part);
    if (lo >= hi) return;
    auto res = CallRange(n, op, keys, payload, dst, lo, hi, sums);
    if (res.ok()) {
      results[i] = std::move(*res);
    } else {
      status[i] = res.status();
    }
  };
  std::vector<std::thread> threads;
  for (size_t i = 1; i < stripes; ++i) {
    try {
      threads.emplace_back(run, i);
    } catch (const std::system_error&) {
      run(i);  // no thread to spare: this part goes on the calling thread
    }
  }
  run(0);
  for (auto& t : threads) t.join();
  std::vector<uint8_t> out;
  out.reserve(keys.size());
  for (size_t i = 0; i < stripes; ++i) {
    if (!status[i].ok()) return status[i];
    out.insert(out.end(), results[i].begin(), results[i].end());
  }
  return out;
}

Result<std::vector<uint32_t>> StoreClient::Put(const std::vector<std::string>& keys,
                                               const std::vector<BlockId>& blocks) {
  if (!pool_) return Status::FailedPrecondition("this StoreClient has no block pool");
  if (keys.size() != blocks.size()) {
    return Status::InvalidArgument(StrCat(keys.size(), " keys for ", blocks.size(), " blocks"));
  }
  TPUSYNC_RETURN_IF_ERROR(pool_->AcquireBorrow(blocks));
  std::vector<const uint8_t*> src;
  for (BlockId b : blocks) src.push_back(pool_->SlotAddress(BlockAllocator::SlotOf(b)));
  auto res = PutRaw(keys, src);
  pool_->ReleaseBorrow(blocks);
  return res;
}

Result<std::vector<uint32_t>> StoreClient::PutRaw(const std::vector<std::string>& keys,
                                                  std::span<const uint8_t* const> blocks) {
  if (keys.size() != blocks.size()) {
    return Status::InvalidArgument(StrCat(keys.size(), " keys for ", blocks.size(), " blocks"));
  }
  TPUSYNC_RETURN_IF_ERROR(ValidateKeys(keys));
  std::map<size_t, std::vector<size_t>> per_node;  // node -> key indices
  for (size_t i = 0; i < keys.size(); ++i) {
    auto rank = Rank(keys[i]);
    for (size_t k = 0; k < options_.replication; ++k) per_node[rank[k]].push_back(i);
  }
  std::vector<uint32_t> replicas(keys.size(), 0);
  Status last;
  size_t accepted = 0;
  auto results = ForEachNode(per_node, [&](size_t node, const std::vector<size_t>& idx) {
    std::vector<std::string> ks;
    std::vector<const uint8_t*> bs;
    for (size_t i : idx) {
      ks.push_back(keys[i]);
      bs.push_back(blocks[i]);
    }
    return CallChunked(node, Op::kStorePut, ks, bs, {});
  });
  size_t e = 0;
  for (auto& [node, idx] : per_node) {
    auto& res = results[e++];
    if (!res.ok()) {
      // Unreachable, or it refused the request (a payload damaged in flight, another block size,
      // our secret): its replicas do not count, and if every node did the same the put fails.
      last = res.status();
      continue;
    }
    accepted++;
    for (size_t j = 0; j < idx.size(); ++j) {
      if ((*res)[j] != static_cast<uint8_t>(PutResult::kNoSpace)) replicas[idx[j]]++;
    }
  }
  if (accepted == 0 && !last.ok()) return last;  // no node took the request: say why
  return replicas;
}

Result<std::vector<bool>> StoreClient::Get(const std::vector<std::string>& keys,
                                           const std::vector<BlockId>& dst) {
  if (!pool_) return Status::FailedPrecondition("this StoreClient has no block pool");
  if (keys.size() != dst.size()) {
    return Status::InvalidArgument(StrCat(keys.size(), " keys for ", dst.size(), " blocks"));
  }
  TPUSYNC_RETURN_IF_ERROR(pool_->AcquireBorrow(dst));
  std::vector<uint8_t*> into;
  for (BlockId b : dst) into.push_back(pool_->SlotAddress(BlockAllocator::SlotOf(b)));
  auto res = GetRaw(keys, into);
  pool_->ReleaseBorrow(dst);
  return res;
}

Result<std::vector<bool>> StoreClient::GetRaw(const std::vector<std::string>& keys,
                                              std::span<uint8_t* const> dst,
                                              std::span<uint64_t> sums) {
  if (keys.size() != dst.size() || (!sums.empty() && sums.size() != keys.size())) {
    return Status::InvalidArgument(StrCat(keys.size(), " keys for ", dst.size(), " blocks and ",
                                          sums.size(), " checksum slots"));
  }
  TPUSYNC_RETURN_IF_ERROR(ValidateKeys(keys));
  std::vector<bool> found(keys.size(), false);
  std::vector<std::vector<size_t>> ranks;
  for (const auto& k : keys) ranks.push_back(Rank(k));
  Status last;
  size_t reached = 0;
  for (size_t round = 0; round < options_.replication; ++round) {
    std::map<size_t, std::vector<size_t>> per_node;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!found[i]) per_node[ranks[i][round]].push_back(i);
    }
    std::vector<std::vector<uint64_t>> got_sums(per_node.size());
    size_t e = 0;
    for (auto& [node, idx] : per_node) got_sums[e++].resize(sums.empty() ? 0 : idx.size());
    std::map<size_t, size_t> entry;  // node -> its index in per_node's order
    for (auto& [node, idx] : per_node) entry.emplace(node, entry.size());
    auto results = ForEachNode(per_node, [&](size_t node, const std::vector<size_t>& idx) {
      std::vector<std::string> ks;
      std::vector<uint8_t*> ds;
      for (size_t i : idx) {
        ks.push_back(keys[i]);
        ds.push_back(dst[i]);
      }
      return CallChunked(node, Op::kStoreGet, ks, {}, ds, got_sums[entry.at(node)]);
    });
    e = 0;
    for (auto& [node, idx] : per_node) {
      const size_t at = e++;
      auto& res = results[at];
      if (!res.ok()) {
        last = res.status();  // failover: the next round asks the next replica
        continue;
      }
      reached++;
      for (size_t j = 0; j < idx.size(); ++j) {
        if (!(*res)[j]) continue;
        found[idx[j]] = true;
        if (!sums.empty()) sums[idx[j]] = got_sums[at][j];
      }
    }
  }
  if (reached == 0 && !last.ok()) return last;  // no node answered at all: say why
  return found;
}

Result<size_t> StoreClient::LookupPrefix(const std::vector<std::string>& keys) {
  return Lookup(keys, 0, nullptr);
}

Result<size_t> StoreClient::LookupPrefix(const std::vector<std::string>& keys,
                                         std::chrono::milliseconds lease,
                                         std::vector<size_t>* leased_on) {
  const auto ms = std::clamp<int64_t>(lease.count(), 1, kMaxLeaseMs);
  return Lookup(keys, static_cast<uint32_t>(ms), leased_on);
}

void StoreClient::EndLeases(const std::vector<std::string>& keys,
                            const std::vector<size_t>& nodes) {
  std::map<size_t, std::vector<size_t>> per_node;
  for (size_t i = 0; i < keys.size() && i < nodes.size(); ++i) {
    if (nodes[i] < addrs_.size()) per_node[nodes[i]].push_back(i);
  }
  ForEachNode(per_node, [&](size_t node, const std::vector<size_t>& idx) {
    std::vector<std::string> ks;
    for (size_t i : idx) ks.push_back(keys[i]);
    return Call(node, Op::kStoreLookup, ks, {}, {}, kUnleaseFlag).status();
  });  // best effort: a lease a node did not hear about expires
}

Status StoreClient::CheckNodes() {
  std::map<size_t, std::vector<size_t>> all;
  for (size_t n = 0; n < addrs_.size(); ++n) all[n] = {};
  const std::vector<std::string> probe = {"tpusync-check-nodes"};
  auto results = ForEachNode(all, [&](size_t node, const std::vector<size_t>&) {
    return Call(node, Op::kStoreLookup, probe, {}, {}).status();
  });
  for (const Status& st : results) {
    const StatusCode c = st.code();
    if (c == StatusCode::kInvalidArgument || c == StatusCode::kPermissionDenied ||
        c == StatusCode::kVersionMismatch || c == StatusCode::kCorrupted) {
      return st;
    }
  }
  return Status::OK();
}

Result<size_t> StoreClient::Lookup(const std::vector<std::string>& keys, uint32_t lease_ms,
                                   std::vector<size_t>* leased_on) {
  TPUSYNC_RETURN_IF_ERROR(ValidateKeys(keys));
  std::vector<bool> found(keys.size(), false);
  std::vector<size_t> on(keys.size(), 0);  // the node that found (and leased) each key
  std::vector<std::vector<size_t>> ranks;
  for (const auto& k : keys) ranks.push_back(Rank(k));
  size_t prefix_bound = keys.size();
  Status last;
  size_t reached = 0;
  transport::MetaWriter extra;
  if (lease_ms) extra.U32(lease_ms);
  for (size_t round = 0; round < options_.replication; ++round) {
    std::map<size_t, std::vector<size_t>> per_node;
    for (size_t i = 0; i < prefix_bound; ++i) {
      if (!found[i]) per_node[ranks[i][round]].push_back(i);
    }
    if (per_node.empty()) break;
    auto results = ForEachNode(per_node, [&](size_t node, const std::vector<size_t>& idx) {
      std::vector<std::string> ks;
      for (size_t i : idx) ks.push_back(keys[i]);
      return Call(node, Op::kStoreLookup, ks, {}, {}, lease_ms ? kLeaseFlag : uint8_t{0},
                  extra.bytes());
    });
    size_t e = 0;
    for (auto& [node, idx] : per_node) {
      auto& res = results[e++];
      if (!res.ok()) {
        last = res.status();
        continue;
      }
      reached++;
      for (size_t j = 0; j < idx.size(); ++j) {
        if ((*res)[j] && !found[idx[j]]) {
          found[idx[j]] = true;
          on[idx[j]] = node;
        }
      }
    }
  }
  if (reached == 0 && !last.ok()) return last;  // no node answered at all: say why
  size_t n = 0;
  while (n < keys.size() && found[n]) ++n;
  if (lease_ms) {
    // LEASED PREFIX CONTRACT: the keys found past the first miss were leased too; end those
    // leases (a key that also sits in the prefix keeps its one lease per request).
    std::unordered_set<std::string_view> kept(keys.begin(), keys.begin() + n);
    std::vector<std::string> past;
    std::vector<size_t> past_on;
    for (size_t i = n; i < keys.size(); ++i) {
      if (found[i] && !kept.contains(keys[i]) && kept.insert(keys[i]).second) {
        past.push_back(keys[i]);
        past_on.push_back(on[i]);
      }
    }
    if (!past.empty()) EndLeases(past, past_on);
    if (leased_on) leased_on->assign(on.begin(), on.begin() + n);
  }
  return n;
}

Result<std::vector<bool>> StoreClient::Remove(const std::vector<std::string>& keys) {
  TPUSYNC_RETURN_IF_ERROR(ValidateKeys(keys));
  std::map<size_t, std::vector<size_t>> per_node;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto rank = Rank(keys[i]);
    for (size_t k = 0; k < options_.replication; ++k) per_node[rank[k]].push_back(i);
  }
  std::vector<bool> removed(keys.size(), false);
  Status last;
  size_t reached = 0;
  auto results = ForEachNode(per_node, [&](size_t node, const std::vector<size_t>& idx) {
    std::vector<std::string> ks;
    for (size_t i : idx) ks.push_back(keys[i]);
    return Call(node, Op::kStoreRemove, ks, {}, {});
  });
  size_t e = 0;
  for (auto& [node, idx] : per_node) {
    auto& res = results[e++];
    if (!res.ok()) {
      last = res.status();
      continue;
    }
    reached++;
    for (size_t j = 0; j < idx.size(); ++j) removed[idx[j]] = removed[idx[j]] || (*res)[j];
  }
  if (reached == 0 && !last.ok()) return last;
  return removed;
}

}  // namespace tpusync::node
