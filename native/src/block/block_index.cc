#include "tpusync/block/block_index.h"

namespace tpusync::block {

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kDisk: return "disk";
    case Tier::kRemote: return "remote";
  }
  return "unknown";
}

std::optional<Tier> Placement::best() const {
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (tier_mask & (1u << t)) return static_cast<Tier>(t);
  }
  return std::nullopt;
}

void BlockIndex::Link(Entry* e, size_t tier) {
  List& l = lists_[tier];
  Hook& h = e->lru[tier];
  h.prev = l.tail;
  h.next = nullptr;
  if (l.tail) l.tail->lru[tier].next = e;
  l.tail = e;
  if (!l.head) l.head = e;
  ++l.count;
}

void BlockIndex::Unlink(Entry* e, size_t tier) {
  List& l = lists_[tier];
  Hook& h = e->lru[tier];
  if (h.prev)
    h.prev->lru[tier].next = h.next;
  else
    l.head = h.next;
  if (h.next)
    h.next->lru[tier].prev = h.prev;
  else
    l.tail = h.prev;
  h.prev = h.next = nullptr;
  --l.count;
}

void BlockIndex::Touch(Entry* e) {
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (e->placement.tier_mask & (1u << t) && lists_[t].tail != e) {
      Unlink(e, t);
      Link(e, t);
    }
  }
}

Status BlockIndex::Insert(std::string_view key, Tier tier, uint64_t location) {
  TPUSYNC_RETURN_IF_ERROR(ValidateKey(key));
  const size_t t = static_cast<size_t>(tier);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) it = map_.emplace(BlockKey(key), Entry{}).first;
  Entry& e = it->second;
  if (e.key.empty()) e.key = it->first;
  if (e.placement.in(tier)) {
    return Status::AlreadyExists(StrCat("block already indexed in the ", TierName(tier), " tier"));
  }
  e.placement.tier_mask |= static_cast<uint8_t>(1u << t);
  e.placement.location[t] = location;
  Link(&e, t);
  Touch(&e);
  return Status::OK();
}

std::optional<Placement> BlockIndex::Lookup(std::string_view key, bool touch) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return std::nullopt;
  if (touch) Touch(&it->second);
  return it->second.placement;
}

size_t BlockIndex::LookupPrefix(std::span<const std::string_view> keys,
                                std::vector<Placement>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (std::string_view key : keys) {
    auto it = map_.find(key);
    if (it == map_.end()) break;
    Touch(&it->second);
    if (out) out->push_back(it->second.placement);
    ++n;
  }
  return n;
}

Result<uint64_t> BlockIndex::Remove(std::string_view key, Tier tier) {
  const size_t t = static_cast<size_t>(tier);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end() || !it->second.placement.in(tier)) {
    return Status::NotFound(StrCat("block not indexed in the ", TierName(tier), " tier"));
  }
  Entry& e = it->second;
  const uint64_t loc = e.placement.location[t];
  Unlink(&e, t);
  e.placement.tier_mask &= static_cast<uint8_t>(~(1u << t));
  if (e.placement.tier_mask == 0) map_.erase(it);
  return loc;
}

Result<Placement> BlockIndex::Erase(std::string_view key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return Status::NotFound("block not indexed");
  Placement p = it->second.placement;
  for (size_t t = 0; t < kNumTiers; ++t) {
    if (p.tier_mask & (1u << t)) Unlink(&it->second, t);
  }
  map_.erase(it);
  return p;
}

Status BlockIndex::Pin(std::string_view key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return Status::NotFound("cannot pin a block that is not indexed");
  ++it->second.placement.pins;
  return Status::OK();
}

Status BlockIndex::Unpin(std::string_view key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) return Status::NotFound("cannot unpin a block that is not indexed");
  if (it->second.placement.pins == 0) {
    return Status::FailedPrecondition("unpin of a block that is not pinned (unbalanced pin/unpin)");
  }
  --it->second.placement.pins;
  return Status::OK();
}

std::vector<Victim> BlockIndex::EvictionCandidates(Tier tier, size_t n) const {
  const size_t t = static_cast<size_t>(tier);
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Victim> out;
  for (const Entry* e = lists_[t].head; e && out.size() < n; e = e->lru[t].next) {
    if (e->placement.pins == 0) out.push_back({e->key, e->placement.location[t]});
  }
  return out;
}

size_t BlockIndex::Count(Tier tier) const {
  std::lock_guard<std::mutex> lock(mu_);
  return lists_[static_cast<size_t>(tier)].count;
}

size_t BlockIndex::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.size();
}

std::vector<std::pair<BlockKey, Placement>> BlockIndex::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<BlockKey, Placement>> out;
  out.reserve(map_.size());
  for (const auto& [key, e] : map_) out.emplace_back(key, e.placement);
  return out;
}

void BlockIndex::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  map_.clear();
  lists_ = {};
}

}  // namespace tpusync::block
