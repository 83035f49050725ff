#include "tpusync/node/remote_tier.h"

#include <chrono>

namespace tpusync::node {
namespace {
using Clock = std::chrono::steady_clock;
uint64_t Ns(Clock::time_point t0) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}
}  // namespace

Result<std::unique_ptr<RemoteTier>> RemoteTier::Open(RemoteTierOptions options, Secret secret) {
  if (options.block_bytes == 0) return Status::InvalidArgument("a remote tier needs block_bytes");
  if (options.capacity_blocks == 0) {
    return Status::InvalidArgument("a remote tier needs capacity_blocks > 0");
  }
  std::unique_ptr<RemoteTier> t(new RemoteTier(options));
  TPUSYNC_ASSIGN_OR_RETURN(
      t->client_,
      StoreClient::CreateRaw(options.block_bytes, std::move(secret), std::move(options.client)));
  TPUSYNC_RETURN_IF_ERROR(t->client_->CheckNodes());
  t->slots_.resize(options.capacity_blocks);
  for (size_t i = options.capacity_blocks; i-- > 0;) t->free_.push_back(i);
  return t;
}

size_t RemoteTier::used() const {
  std::lock_guard<std::mutex> l(mu_);
  return slots_.size() - free_.size();
}

Result<uint64_t> RemoteTier::Reserve() {
  std::lock_guard<std::mutex> l(mu_);
  if (free_.empty()) {
    return Status::PoolExhausted(
        StrCat("remote tier: all ", slots_.size(), " block handles are in use"));
  }
  const uint64_t loc = free_.back();
  free_.pop_back();
  slots_[loc] = Slot{.used = true};
  return loc;
}

void RemoteTier::FreeLocked(uint64_t loc) {
  slots_[loc] = Slot{};
  free_.push_back(loc);
}

void RemoteTier::Release(uint64_t loc, bool forget) {
  std::string remove;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (loc >= slots_.size()) return;
    Slot& s = slots_[loc];
    if (!s.used || s.releasing) return;
    if (forget) remove = s.key;
    if (s.holds) {
      s.releasing = true;
    } else {
      FreeLocked(loc);
    }
  }
  // Explicit remove / corruption: the nodes forget the key too (best effort; a dead node's copy is
  // gone with it, and a later put of the key writes the same bytes).
  if (!remove.empty()) (void)client_->Remove({remove});
}

Status RemoteTier::Hold(uint64_t loc) {
  std::lock_guard<std::mutex> l(mu_);
  if (loc >= slots_.size() || !slots_[loc].used || slots_[loc].releasing) {
    return Status::FailedPrecondition(StrCat("remote location ", loc, " is not in use"));
  }
  ++slots_[loc].holds;
  return Status::OK();
}

void RemoteTier::Unhold(uint64_t loc) {
  std::lock_guard<std::mutex> l(mu_);
  if (loc >= slots_.size()) return;
  Slot& s = slots_[loc];
  if (s.holds == 0) return;
  if (--s.holds == 0 && s.releasing) FreeLocked(loc);
}

void RemoteTier::WriteBatch(std::span<tier::BlockWrite> ops) {
  if (ops.empty()) return;
  const auto t0 = Clock::now();
  std::vector<std::string> keys;
  std::vector<const uint8_t*> src;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& op : ops) {
      slots_[op.location].key = std::string(op.key);
      keys.emplace_back(op.key);
      src.push_back(op.data);
    }
  }
  auto res = client_->PutRaw(keys, src);
  std::lock_guard<std::mutex> l(mu_);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!res.ok()) {
      ops[i].status = res.status();
    } else if ((*res)[i] == 0) {
      ops[i].status = Status::NoSpace("remote tier: no store node replica took the block");
      ++stats_.no_space_errors;
    } else {
      ops[i].status = Status::OK();
      ++stats_.blocks_written;
      stats_.bytes_written += options_.block_bytes;
      continue;
    }
    ++stats_.write_errors;
  }
  stats_.write_ns += Ns(t0);
}

void RemoteTier::ReadBatch(std::span<tier::BlockRead> ops) {
  if (ops.empty()) return;
  const auto t0 = Clock::now();
  std::vector<std::string> keys;
  std::vector<uint8_t*> dst;
  std::vector<size_t> asked;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < ops.size(); ++i) {
      const Slot* s = ops[i].location < slots_.size() ? &slots_[ops[i].location] : nullptr;
      if (!s || !s->used || s->key != ops[i].key) {
        ops[i].status = Status::Corrupted("remote tier: the location does not hold this key");
        ++stats_.corrupted;
        continue;
      }
      keys.emplace_back(ops[i].key);
      dst.push_back(ops[i].dst);
      asked.push_back(i);
    }
  }
  if (keys.empty()) return;
  std::vector<uint64_t> sums(keys.size());
  auto res = client_->GetRaw(keys, dst, sums);
  std::lock_guard<std::mutex> l(mu_);
  for (size_t j = 0; j < asked.size(); ++j) {
    tier::BlockRead& op = ops[asked[j]];
    if (!res.ok()) {
      op.status = res.status();
      ++stats_.read_errors;
    } else if (!(*res)[j]) {
      op.status = Status::NotFound("remote tier: no store node holds the block any more");
    } else {
      op.status = Status::OK();
      op.checksum = sums[j];  // verified on arrival: the store's promotion checks its copy
      ++stats_.blocks_read;
      stats_.bytes_read += options_.block_bytes;
    }
  }
  stats_.read_ns += Ns(t0);
}

size_t RemoteTier::AdoptPrefix(std::span<const std::string_view> keys,
                               std::vector<uint64_t>* locations) {
  locations->clear();
  if (keys.empty()) return 0;
  std::vector<std::string> ks(keys.begin(), keys.end());
  std::vector<size_t> leased_on;
  auto n = client_->LookupPrefix(ks, options_.lease, &leased_on);
  if (!n.ok() || *n == 0) return 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < *n && !free_.empty(); ++i) {
      const uint64_t loc = free_.back();
      free_.pop_back();
      slots_[loc] = Slot{.used = true, .key = ks[i]};
      locations->push_back(loc);
    }
  }
  const size_t adopted = locations->size();
  if (adopted < *n) {  // LEASE CONTRACT: no handle, no lease
    client_->EndLeases({ks.begin() + adopted, ks.begin() + *n},
                       {leased_on.begin() + adopted, leased_on.begin() + *n});
  }
  return adopted;
}

tier::TierStats RemoteTier::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  tier::TierStats s = stats_;
  s.capacity_blocks = slots_.size();
  s.used_blocks = slots_.size() - free_.size();
  s.io_backend = "store-nodes";
  return s;
}

}  // namespace tpusync::node
