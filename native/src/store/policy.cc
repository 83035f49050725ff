#include "tpusync/store/policy.h"

#include <deque>
#include <string>
#include <unordered_map>

#include "tpusync/block/block_key.h"

namespace tpusync::store {
namespace {

class LruPolicy final : public TierPolicy {
 public:
  std::string_view name() const override { return "lru"; }
  void OnAccess(std::string_view) override {}
  bool AdmitBelow(std::string_view, block::Tier) override { return true; }
};

class SecondUsePolicy final : public TierPolicy {
 public:
  explicit SecondUsePolicy(size_t history) : history_(history ? history : 1) {}
  std::string_view name() const override { return "second_use"; }
  void OnAccess(std::string_view key) override {
    auto it = uses_.find(key);
    if (it != uses_.end()) {
      if (it->second < 2) ++it->second;
      return;
    }
    if (uses_.size() >= history_) {  // forget the oldest remembered key (FIFO)
      uses_.erase(order_.front());
      order_.pop_front();
    }
    uses_.emplace(std::string(key), 1);
    order_.emplace_back(key);
  }
  bool AdmitBelow(std::string_view key, block::Tier from) override {
    if (from != block::Tier::kHost) return true;
    auto it = uses_.find(key);
    return it != uses_.end() && it->second >= 2;
  }

 private:
  size_t history_;
  std::unordered_map<std::string, uint8_t, block::BlockKeyHash, std::equal_to<>> uses_;
  std::deque<std::string> order_;
};

}  // namespace

std::unique_ptr<TierPolicy> MakeLruPolicy() { return std::make_unique<LruPolicy>(); }
std::unique_ptr<TierPolicy> MakeSecondUsePolicy(size_t history) {
  return std::make_unique<SecondUsePolicy>(history);
}

Result<std::unique_ptr<TierPolicy>> MakePolicy(std::string_view name, size_t history) {
  if (name == "lru" || name.empty()) return MakeLruPolicy();
  if (name == "second_use") return MakeSecondUsePolicy(history);
  return Status::InvalidArgument(StrCat("unknown tier policy '", name, "': use lru or second_use"));
}

}  // namespace tpusync::store
