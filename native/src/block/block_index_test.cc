#include "tpusync/block/block_index.h"

#include <algorithm>
#include <array>
#include <list>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <tuple>

#include <gtest/gtest.h>

namespace tpusync::block {
namespace {

std::string Key(int i) { return "key-" + std::to_string(i); }

TEST(BlockIndex, InsertLookupRemove) {
  BlockIndex idx;
  ASSERT_TRUE(idx.Insert(Key(1), Tier::kHost, 7).ok());
  ASSERT_TRUE(idx.Insert(Key(1), Tier::kDisk, 9).ok());
  EXPECT_EQ(idx.Insert(Key(1), Tier::kHost, 8).code(), StatusCode::kAlreadyExists);
  auto p = idx.Lookup(Key(1));
  ASSERT_TRUE(p.has_value());
  EXPECT_TRUE(p->in(Tier::kHost));
  EXPECT_TRUE(p->in(Tier::kDisk));
  EXPECT_EQ(p->location[static_cast<int>(Tier::kDisk)], 9u);
  EXPECT_EQ(*p->best(), Tier::kHost);
  EXPECT_EQ(*idx.Remove(Key(1), Tier::kHost), 7u);
  EXPECT_EQ(*idx.Lookup(Key(1))->best(), Tier::kDisk);
  EXPECT_EQ(idx.Remove(Key(1), Tier::kHost).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(idx.Remove(Key(1), Tier::kDisk).ok());
  EXPECT_FALSE(idx.Lookup(Key(1)).has_value());
  EXPECT_EQ(idx.size(), 0u);
}

TEST(BlockIndex, KeysAreOpaqueBytes) {
  BlockIndex idx;
  const std::string binary("\0\x01\xff\0", 4);
  ASSERT_TRUE(idx.Insert(binary, Tier::kHost, 1).ok());
  EXPECT_FALSE(idx.Lookup(std::string("\0\x01\xff", 3)).has_value());
  EXPECT_TRUE(idx.Lookup(binary).has_value());
  EXPECT_EQ(idx.Insert("", Tier::kHost, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(idx.Insert(std::string(65, 'k'), Tier::kHost, 1).code(), StatusCode::kInvalidArgument);
}

TEST(BlockIndex, LruOrderFollowsTouches) {
  BlockIndex idx(Recency::kExactLru);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(idx.Insert(Key(i), Tier::kHost, i).ok());
  idx.Lookup(Key(0));  // 0 becomes most recent
  auto v = idx.EvictionCandidates(Tier::kHost, 4);
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[0].key, Key(1));
  EXPECT_EQ(v[3].key, Key(0));
  idx.Lookup(Key(1), /*touch=*/false);
  EXPECT_EQ(idx.EvictionCandidates(Tier::kHost, 1)[0].key, Key(1));
}

TEST(BlockIndex, PinnedKeysAreNeverCandidates) {
  BlockIndex idx;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(idx.Insert(Key(i), Tier::kHost, i).ok());
  ASSERT_TRUE(idx.Pin(Key(0)).ok());
  ASSERT_TRUE(idx.Pin(Key(0)).ok());
  auto v = idx.EvictionCandidates(Tier::kHost, 10);
  ASSERT_EQ(v.size(), 2u);
  for (auto& x : v) EXPECT_NE(x.key, Key(0));
  ASSERT_TRUE(idx.Unpin(Key(0)).ok());
  EXPECT_EQ(idx.EvictionCandidates(Tier::kHost, 10).size(), 2u);
  ASSERT_TRUE(idx.Unpin(Key(0)).ok());
  EXPECT_EQ(idx.EvictionCandidates(Tier::kHost, 10).size(), 3u);
  EXPECT_EQ(idx.Unpin(Key(0)).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(idx.Pin(Key(9)).code(), StatusCode::kNotFound);
}

TEST(BlockIndex, TiersHaveSeparateLruLists) {
  BlockIndex idx;
  ASSERT_TRUE(idx.Insert(Key(0), Tier::kDisk, 0).ok());
  ASSERT_TRUE(idx.Insert(Key(1), Tier::kHost, 1).ok());
  EXPECT_EQ(idx.Count(Tier::kHost), 1u);
  EXPECT_EQ(idx.Count(Tier::kDisk), 1u);
  EXPECT_EQ(idx.EvictionCandidates(Tier::kDisk, 5).size(), 1u);
  EXPECT_EQ(idx.EvictionCandidates(Tier::kDisk, 5)[0].key, Key(0));
}

TEST(BlockIndex, LookupPrefixStopsAtFirstMiss) {
  BlockIndex idx;
  for (int i : {0, 1, 3}) ASSERT_TRUE(idx.Insert(Key(i), Tier::kHost, i).ok());
  std::vector<std::string> keys = {Key(0), Key(1), Key(2), Key(3)};
  std::vector<std::string_view> views(keys.begin(), keys.end());
  std::vector<Placement> out;
  EXPECT_EQ(idx.LookupPrefix(views, &out), 2u);
  EXPECT_EQ(out.size(), 2u);
}

TEST(BlockIndex, EraseDropsEveryTierAndPins) {
  BlockIndex idx;
  ASSERT_TRUE(idx.Insert(Key(0), Tier::kHost, 1).ok());
  ASSERT_TRUE(idx.Insert(Key(0), Tier::kDisk, 2).ok());
  ASSERT_TRUE(idx.Pin(Key(0)).ok());
  auto p = idx.Erase(Key(0));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->pins, 1u);
  EXPECT_EQ(idx.Count(Tier::kHost), 0u);
  EXPECT_EQ(idx.Count(Tier::kDisk), 0u);
  EXPECT_EQ(idx.Erase(Key(0)).status().code(), StatusCode::kNotFound);
}

TEST(BlockIndex, ConcurrentInsertRemove) {
  BlockIndex idx;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 5000; ++i) {
        const std::string k = Key(t * 100000 + i);
        ASSERT_TRUE(idx.Insert(k, Tier::kHost, i).ok());
        if (i % 2) ASSERT_TRUE(idx.Remove(k, Tier::kHost).ok());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(idx.size(), 4u * 2500u);
  EXPECT_EQ(idx.Count(Tier::kHost), 4u * 2500u);
}

// The open-addressing table against a model (std::map + per-tier recency lists): heavy churn
// exercises growth, backward-shift deletion and entry reuse; LRU order must match exactly.
TEST(BlockIndex, MatchesAModelUnderChurn) {
  BlockIndex idx(Recency::kExactLru);
  std::map<std::string, std::map<int, uint64_t>> model;  // key -> tier -> location
  std::array<std::list<std::string>, kNumTiers> lru;     // least recent first
  std::mt19937_64 rng(7);
  auto touch = [&](const std::string& k) {
    for (auto& [t, loc] : model[k]) {
      lru[t].remove(k);
      lru[t].push_back(k);
    }
  };
  const Tier tiers[] = {Tier::kHost, Tier::kDisk};
  for (int step = 0; step < 20000; ++step) {
    // Keys of 1..64 bytes; a small key space so inserts, hits and removes all happen often.
    const int id = static_cast<int>(rng() % 1500);
    std::string k = "k" + std::to_string(id);
    k.resize(1 + (id * 7) % kMaxKeyBytes, static_cast<char>('a' + id % 26));
    const Tier tier = tiers[rng() % 2];
    const int t = static_cast<int>(tier);
    switch (rng() % 4) {
      case 0:
      case 1: {
        const Status s = idx.Insert(k, tier, step);
        if (model.count(k) && model[k].count(t)) {
          ASSERT_EQ(s.code(), StatusCode::kAlreadyExists);
        } else {
          ASSERT_TRUE(s.ok()) << s.ToString();
          model[k][t] = step;
          lru[t].push_back(k);
          touch(k);
        }
        break;
      }
      case 2: {
        auto r = idx.Remove(k, tier);
        if (model.count(k) && model[k].count(t)) {
          ASSERT_TRUE(r.ok());
          ASSERT_EQ(*r, model[k][t]);
          model[k].erase(t);
          lru[t].remove(k);
          if (model[k].empty()) model.erase(k);
        } else {
          ASSERT_EQ(r.status().code(), StatusCode::kNotFound);
        }
        break;
      }
      default: {
        auto p = idx.Lookup(k);
        ASSERT_EQ(p.has_value(), model.count(k) > 0);
        if (p) {
          for (auto& [mt, loc] : model[k]) ASSERT_EQ(p->location[mt], loc);
          touch(k);
        }
      }
    }
  }
  ASSERT_EQ(idx.size(), model.size());
  for (Tier tier : tiers) {
    const int t = static_cast<int>(tier);
    auto v = idx.EvictionCandidates(tier, 1u << 20);
    ASSERT_EQ(v.size(), lru[t].size());
    size_t i = 0;
    for (const std::string& k : lru[t]) ASSERT_EQ(v[i++].key, k);
  }
  EXPECT_EQ(idx.Snapshot().size(), model.size());
  idx.Clear();
  EXPECT_EQ(idx.size(), 0u);
  EXPECT_FALSE(idx.Lookup("k1").has_value());
  ASSERT_TRUE(idx.Insert("k1", Tier::kHost, 3).ok());
  EXPECT_EQ(idx.Lookup("k1")->location[static_cast<int>(Tier::kHost)], 3u);
}

// LookupPrefix's pipeline (prefetch stages running ahead of the touches) must leave exactly the
// LRU order of touching the leading hits one by one: batches longer and shorter than the
// pipeline, repeated keys inside a batch (a key's LRU neighbours change under the prefetch), a
// miss anywhere (nothing after it touched), keys present in one or two tiers.
TEST(BlockIndex, LookupPrefixMatchesAModelOfExactLru) {
  BlockIndex idx(Recency::kExactLru);
  std::array<std::list<std::string>, kNumTiers> lru;  // least recent first
  std::map<std::string, std::vector<int>> tiers_of;
  std::mt19937_64 rng(13);
  const Tier tiers[] = {Tier::kHost, Tier::kDisk};
  for (int i = 0; i < 3000; ++i) {
    const std::string k = Key(i);
    for (Tier tier : tiers) {
      if (tier == Tier::kDisk && i % 3 != 0) continue;
      ASSERT_TRUE(idx.Insert(k, tier, i).ok());
      const int t = static_cast<int>(tier);
      lru[t].push_back(k);
      tiers_of[k].push_back(t);
      for (int u : tiers_of[k]) {  // Insert touches every tier the key is in
        lru[u].remove(k);
        lru[u].push_back(k);
      }
    }
  }
  for (int round = 0; round < 300; ++round) {
    const size_t n = 1 + rng() % 100;
    std::vector<std::string> keys;
    for (size_t j = 0; j < n; ++j) {
      const uint64_t r = rng();
      // Mostly a small hot set (repeats and neighbour changes inside a batch), rarely absent.
      if (r % 97 == 0) {
        keys.push_back("absent-" + std::to_string(r));
      } else {
        keys.push_back(Key(static_cast<int>(r % 2 ? (r >> 8) % 40 : (r >> 8) % 3000)));
      }
    }
    std::vector<std::string_view> views(keys.begin(), keys.end());
    std::vector<Placement> out;
    const size_t hits = idx.LookupPrefix(views, &out);
    size_t expect = 0;
    for (const std::string& k : keys) {
      if (!tiers_of.count(k)) break;
      for (int u : tiers_of[k]) {
        lru[u].remove(k);
        lru[u].push_back(k);
      }
      ++expect;
    }
    ASSERT_EQ(hits, expect) << "round " << round;
    ASSERT_EQ(out.size(), expect);
    for (size_t j = 0; j < expect; ++j) {
      const int id = std::stoi(keys[j].substr(4));
      ASSERT_EQ(out[j].location[static_cast<int>(Tier::kHost)], static_cast<uint64_t>(id));
    }
  }
  for (Tier tier : tiers) {
    const int t = static_cast<int>(tier);
    auto v = idx.EvictionCandidates(tier, 1u << 20);
    ASSERT_EQ(v.size(), lru[t].size());
    size_t i = 0;
    for (const std::string& k : lru[t]) ASSERT_EQ(v[i++].key, k);
  }
}

// kClock against a model of the RECENCY CONTRACT's second-chance walk on plain std::lists: the
// same victims in the same order, under inserts, removes, pins, touching and non-touching
// lookups, batched LookupPrefix and partial candidate walks; pinned keys never come back.
TEST(BlockIndex, ClockMatchesASecondChanceModel) {
  BlockIndex idx(Recency::kClock);
  ASSERT_EQ(idx.recency(), Recency::kClock);
  struct Tiered {
    std::list<std::string> order;  // least recent (next to go) first
    std::map<std::string, bool> referenced;
  };
  std::array<Tiered, kNumTiers> model;
  std::map<std::string, std::map<int, uint64_t>> where;
  std::map<std::string, int> pins;
  std::mt19937_64 rng(21);
  auto touch = [&](const std::string& k) {
    for (auto& [t, loc] : where[k]) model[t].referenced[k] = true;
  };
  auto walk = [&](int t, size_t n) {  // the contract's walk, on the model
    Tiered& m = model[t];
    std::vector<std::string> out;
    size_t budget = 2 * m.order.size();
    auto it = m.order.begin();
    std::string first_kept;
    bool have_kept = false;
    while (it != m.order.end() && out.size() < n && budget-- > 0) {
      const std::string k = *it;
      auto next = std::next(it);
      if (m.referenced[k]) {
        m.referenced[k] = false;
        m.order.erase(it);
        m.order.push_back(k);
        if (next == m.order.end()) next = std::prev(m.order.end());  // k itself, now unreferenced
      } else {
        if (have_kept && k == first_kept) break;
        if (!have_kept) first_kept = k, have_kept = true;
        if (pins[k] == 0) out.push_back(k);
      }
      it = next != m.order.end() ? next : m.order.begin();
    }
    return out;
  };
  const Tier tiers[] = {Tier::kHost, Tier::kDisk};
  for (int step = 0; step < 20000; ++step) {
    const std::string k = Key(static_cast<int>(rng() % 300));
    const Tier tier = tiers[rng() % 2];
    const int t = static_cast<int>(tier);
    const bool present = where.count(k) > 0;
    switch (rng() % 9) {
      case 0:
      case 1: {
        const Status s = idx.Insert(k, tier, step);
        if (present && where[k].count(t)) {
          ASSERT_EQ(s.code(), StatusCode::kAlreadyExists);
        } else {
          ASSERT_TRUE(s.ok()) << s.ToString();
          touch(k);  // a use in the tiers it was already in
          where[k][t] = step;
          model[t].order.push_back(k);
          model[t].referenced[k] = false;
        }
        break;
      }
      case 2: {
        auto r = idx.Remove(k, tier);
        ASSERT_EQ(r.ok(), present && where[k].count(t) > 0);
        if (r.ok()) {
          ASSERT_EQ(*r, where[k][t]);
          where[k].erase(t);
          model[t].order.remove(k);
          model[t].referenced.erase(k);
          if (where[k].empty()) where.erase(k), pins.erase(k);
        }
        break;
      }
      case 3:
        if (present && pins[k] < 2) {
          ASSERT_TRUE(idx.Pin(k).ok());
          ++pins[k];
        } else if (present) {
          ASSERT_TRUE(idx.Unpin(k).ok());
          --pins[k];
        }
        break;
      case 4: {
        const bool hit = idx.Lookup(k, /*touch=*/false).has_value();
        ASSERT_EQ(hit, present);
        break;
      }
      case 5: {  // a batch, stopping at the first miss
        std::vector<std::string> keys;
        for (size_t j = 0, n = 1 + rng() % 20; j < n; ++j) keys.push_back(Key(rng() % 300));
        std::vector<std::string_view> views(keys.begin(), keys.end());
        const size_t hits = idx.LookupPrefix(views, nullptr);
        size_t expect = 0;
        while (expect < keys.size() && where.count(keys[expect])) touch(keys[expect++]);
        ASSERT_EQ(hits, expect);
        break;
      }
      case 6: {  // a partial walk, as the store's eviction does it
        const size_t n = 1 + rng() % 8;
        auto v = idx.EvictionCandidates(tier, n);
        auto want = walk(t, n);
        ASSERT_EQ(v.size(), want.size()) << "step " << step;
        for (size_t j = 0; j < v.size(); ++j) {
          ASSERT_EQ(v[j].key, want[j]) << "step " << step;
          ASSERT_EQ(pins[v[j].key], 0);
          ASSERT_EQ(v[j].location, where[want[j]][t]);
        }
        break;
      }
      default: {
        auto p = idx.Lookup(k);
        ASSERT_EQ(p.has_value(), present);
        if (p) touch(k);
      }
    }
  }
  for (Tier tier : tiers) {  // a full walk returns every unpinned key of the tier exactly once
    const int t = static_cast<int>(tier);
    auto v = idx.EvictionCandidates(tier, 1u << 20);
    auto want = walk(t, 1u << 20);
    size_t unpinned = 0;
    for (const std::string& k : model[t].order) unpinned += pins[k] == 0;
    ASSERT_EQ(v.size(), unpinned);
    ASSERT_EQ(want.size(), unpinned);
    for (size_t j = 0; j < v.size(); ++j) ASSERT_EQ(v[j].key, want[j]);
    EXPECT_EQ(idx.Count(tier), model[t].order.size());
  }
}

TEST(BlockIndex, ClockGivesTouchedKeysASecondChance) {
  BlockIndex idx(Recency::kClock);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(idx.Insert(Key(i), Tier::kHost, i).ok());
  idx.Lookup(Key(0));
  idx.Lookup(Key(2), /*touch=*/false);  // not a use
  auto v = idx.EvictionCandidates(Tier::kHost, 2);
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].key, Key(1));
  EXPECT_EQ(v[1].key, Key(2));
  // Key 0 was moved behind key 3 by the walk: it goes last.
  v = idx.EvictionCandidates(Tier::kHost, 4);
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[2].key, Key(3));
  EXPECT_EQ(v[3].key, Key(0));
  // Every key touched and one pinned: one full walk, still every unpinned key, none twice.
  for (int i = 0; i < 4; ++i) idx.Lookup(Key(i));
  ASSERT_TRUE(idx.Pin(Key(3)).ok());
  v = idx.EvictionCandidates(Tier::kHost, 100);
  ASSERT_EQ(v.size(), 3u);
  for (const Victim& x : v) EXPECT_NE(x.key, Key(3));
}

TEST(BlockIndex, ClockWalkPastAReferencedTailStillReturnsIt) {
  BlockIndex idx(Recency::kClock);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(idx.Insert(Key(i), Tier::kHost, i).ok());
  idx.Lookup(Key(3));  // the most recent key, referenced: relinked in place, then returned last
  auto v = idx.EvictionCandidates(Tier::kHost, 100);
  ASSERT_EQ(v.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(v[i].key, Key(i));
}

TEST(BlockIndex, ReserveAndGrowthKeepEveryKey) {
  BlockIndex idx;
  ASSERT_TRUE(idx.Reserve(1000).ok());
  for (int i = 0; i < 200000; ++i) ASSERT_TRUE(idx.Insert(Key(i), Tier::kHost, i).ok());
  std::vector<std::string> keys;
  for (int i = 0; i < 200000; i += 3) keys.push_back(Key(i));
  keys.push_back("absent");
  keys.push_back(Key(1));
  std::vector<std::string_view> views(keys.begin(), keys.end());
  std::vector<Placement> out;
  EXPECT_EQ(idx.LookupPrefix(views, &out), keys.size() - 2);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].location[static_cast<int>(Tier::kHost)], i * 3);
  }
  EXPECT_EQ(idx.size(), 200000u);
}

// Degenerate hashes (BlockIndex's test seam): every key the same tag and home bucket (one probe
// chain holding every key; every tag compare matches and the key compare decides), or eight
// distinct hashes (colliding tags, interleaved chains, backward-shift deletion moving buckets).
uint64_t ConstantHash(std::string_view) { return 0x5a5a5a5a00000000ull; }
uint64_t EightHashes(std::string_view key) {
  uint64_t h = 0;
  for (char c : key) h = h * 31 + static_cast<unsigned char>(c);
  return (h % 8) * 0x9E3779B97F4A7C15ull;
}

// The hot / cold split (FLAT LOOKUP CONTRACT): locations are stored by rank, two in the hot line
// and two in the cold one; keys straddle the hot (40 bytes), cold (16) and side (8) arrays. A
// random model over all four tiers, keys of 1..64 bytes, inserts and removes in every order,
// under the default hash and both degenerate ones, in both recency modes.
class BlockIndexLayout : public ::testing::TestWithParam<std::tuple<Recency, BlockIndex::HashFn>> {
};

TEST_P(BlockIndexLayout, MatchesAModelOverFourTiersAndEveryKeyLength) {
  BlockIndex idx(std::get<0>(GetParam()), std::get<1>(GetParam()));
  std::map<std::string, std::map<int, uint64_t>> model;  // key -> tier -> location
  std::map<std::string, uint32_t> pins;
  std::mt19937_64 rng(11);
  auto key_of = [](int id) {
    // Lengths cover every boundary: 1, 39..41 (hot), 55..57 (cold), 63..64 (side array).
    static const size_t kLens[] = {1, 8, 32, 39, 40, 41, 55, 56, 57, 63, 64};
    // Keys of one length differ only in their LAST byte: telling them apart needs the hot line
    // (<= 40 bytes), the cold line (41..56) or the side array (57..64).
    std::string k(kLens[id % 11], 'k');
    k.back() = static_cast<char>('A' + id / 11);
    return k;
  };
  for (int step = 0; step < 6000; ++step) {
    const std::string k = key_of(static_cast<int>(rng() % 400));
    const int t = static_cast<int>(rng() % kNumTiers);
    const Tier tier = static_cast<Tier>(t);
    switch (rng() % 6) {
      case 0:
      case 1: {
        const Status s = idx.Insert(k, tier, rng());
        if (model.count(k) && model[k].count(t)) {
          ASSERT_EQ(s.code(), StatusCode::kAlreadyExists);
        } else {
          ASSERT_TRUE(s.ok()) << s.ToString();
          const auto p = idx.Lookup(k, false);
          ASSERT_TRUE(p.has_value());
          model[k][t] = p->location[t];
        }
        break;
      }
      case 2: {
        auto r = idx.Remove(k, tier);
        if (model.count(k) && model[k].count(t)) {
          ASSERT_TRUE(r.ok());
          ASSERT_EQ(*r, model[k][t]);
          model[k].erase(t);
          if (model[k].empty()) {
            model.erase(k);
            pins.erase(k);
          }
        } else {
          ASSERT_EQ(r.status().code(), StatusCode::kNotFound);
        }
        break;
      }
      case 3: {
        if (model.count(k)) {
          ASSERT_TRUE(idx.Pin(k).ok());
          ++pins[k];
        } else {
          ASSERT_EQ(idx.Pin(k).code(), StatusCode::kNotFound);
        }
        break;
      }
      default: {
        auto p = idx.Lookup(k);
        ASSERT_EQ(p.has_value(), model.count(k) > 0) << k.size();
        if (!p) break;
        uint8_t mask = 0;
        for (auto& [mt, loc] : model[k]) {
          mask |= static_cast<uint8_t>(1u << mt);
          ASSERT_EQ(p->location[mt], loc) << "tier " << mt << " key length " << k.size();
        }
        ASSERT_EQ(p->tier_mask, mask);
        ASSERT_EQ(p->pins, pins.count(k) ? pins[k] : 0u);
      }
    }
  }
  ASSERT_EQ(idx.size(), model.size());
  // Every key, through the batched pipeline too (hits only: the prefix never stops early).
  std::vector<std::string> keys;
  for (auto& [k, tiers] : model) keys.push_back(k);
  std::shuffle(keys.begin(), keys.end(), rng);
  std::vector<std::string_view> views(keys.begin(), keys.end());
  std::vector<Placement> out;
  ASSERT_EQ(idx.LookupPrefix(views, &out), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    for (auto& [mt, loc] : model[keys[i]]) ASSERT_EQ(out[i].location[mt], loc);
  }
  for (size_t t = 0; t < kNumTiers; ++t) {
    size_t n = 0;
    for (auto& [k, tiers] : model) n += tiers.count(static_cast<int>(t));
    ASSERT_EQ(idx.Count(static_cast<Tier>(t)), n);
    // Candidates carry the right location, whatever the key's rank in that tier.
    for (const Victim& v : idx.EvictionCandidates(static_cast<Tier>(t), 1u << 20)) {
      ASSERT_EQ(v.location, model.at(v.key).at(static_cast<int>(t)));
      ASSERT_EQ(pins.count(v.key) ? pins[v.key] : 0u, 0u);
    }
  }
  const auto snap = idx.Snapshot();
  ASSERT_EQ(snap.size(), model.size());
  for (auto& [k, p] : snap) {
    for (auto& [mt, loc] : model.at(k)) ASSERT_EQ(p.location[mt], loc);
  }
}

INSTANTIATE_TEST_SUITE_P(HashesAndModes, BlockIndexLayout,
                         ::testing::Combine(::testing::Values(Recency::kExactLru, Recency::kClock),
                                            ::testing::Values(BlockIndex::HashFn{nullptr},
                                                              &EightHashes, &ConstantHash)),
                         [](const auto& info) {  // stable names (not function addresses) for ctest
                           const BlockIndex::HashFn h = std::get<1>(info.param);
                           return std::string(RecencyName(std::get<0>(info.param))) + "_" +
                                  (h == nullptr        ? "xxh3"
                                   : h == &EightHashes ? "eight_hashes"
                                                       : "constant_hash");
                         });

// Growth with every tag colliding: a rehash moves buckets by tag only, and the key compare (not
// the tag) must still find each key afterwards; deletion by backward shift keeps the chain whole.
TEST(BlockIndex, GrowthAndDeletionWithCollidingTags) {
  BlockIndex idx(BlockIndex::kDefaultRecency, &EightHashes);
  for (int i = 0; i < 3000; ++i) ASSERT_TRUE(idx.Insert(Key(i), Tier::kHost, i).ok());
  for (int i = 0; i < 3000; i += 2) ASSERT_EQ(*idx.Remove(Key(i), Tier::kHost), uint64_t(i));
  for (int i = 0; i < 3000; ++i) {
    const auto p = idx.Lookup(Key(i), false);
    ASSERT_EQ(p.has_value(), i % 2 == 1) << i;
    if (p) ASSERT_EQ(p->location[static_cast<int>(Tier::kHost)], uint64_t(i));
  }
  EXPECT_EQ(idx.size(), 1500u);
  EXPECT_FALSE(idx.Lookup("absent").has_value());
}

// Growth (every rehash moves buckets) and backward-shift deletion (moves the buckets behind the
// hole) must leave every key findable with its locations, pins and LRU position; freed entry ids
// are reused. Exact LRU, so the eviction order is a checkable list: keys are inserted without
// Reserve (many rehashes), some into a second tier, some pinned, some touched (moved to the most
// recent end), some removed, then more inserted. Under each degenerate hash as well: with one
// chain holding every key, every deletion moves buckets. (Also what the rejected one-line table,
// docs/tiers.md, needed: its records themselves moved.)
class BlockIndexMoves : public ::testing::TestWithParam<BlockIndex::HashFn> {};

TEST_P(BlockIndexMoves, GrowthAndDeletionKeepLocationsPinsAndLruOrder) {
  BlockIndex idx(Recency::kExactLru, GetParam());
  std::map<std::string, std::map<int, uint64_t>> model;  // key -> tier -> location
  std::map<std::string, uint32_t> pins;
  std::array<std::list<std::string>, kNumTiers> order;  // least recent first
  const int host = static_cast<int>(Tier::kHost), disk = static_cast<int>(Tier::kDisk);
  auto insert = [&](const std::string& k, int t, uint64_t loc) {
    ASSERT_TRUE(idx.Insert(k, static_cast<Tier>(t), loc).ok());
    model[k][t] = loc;
    order[t].push_back(k);
  };
  auto touch = [&](const std::string& k) {
    ASSERT_TRUE(idx.Lookup(k).has_value());
    for (auto& [t, loc] : model[k]) {
      order[t].remove(k);
      order[t].push_back(k);
    }
  };
  constexpr int kN = 1200;
  for (int i = 0; i < kN; ++i) {
    insert(Key(i), host, i);
    if (i % 5 == 0) insert(Key(i), disk, 100000 + i);
    if (i % 7 == 0) {
      ASSERT_TRUE(idx.Pin(Key(i)).ok());
      ++pins[Key(i)];
    }
  }
  // Every key findable with its locations and pins, every tier's eviction order the model's, the
  // batched pipeline too; checked after each phase (a later rehash would hide a stale position).
  auto verify = [&](const char* phase) {
    SCOPED_TRACE(phase);
    ASSERT_EQ(idx.size(), model.size());
    for (int i = 0; i < 2 * kN; ++i) {
      const auto p = idx.Lookup(Key(i), false);
      ASSERT_EQ(p.has_value(), model.count(Key(i)) > 0) << i;
      if (!p) continue;
      for (auto& [t, loc] : model[Key(i)]) ASSERT_EQ(p->location[t], loc) << i;
      ASSERT_EQ(p->pins, pins.count(Key(i)) ? pins[Key(i)] : 0u) << i;
    }
    for (int t : {host, disk}) {
      ASSERT_EQ(idx.Count(static_cast<Tier>(t)), order[t].size());
      std::vector<std::string> want;
      for (const std::string& k : order[t]) {
        if (!pins.count(k)) want.push_back(k);
      }
      std::vector<std::string> got;
      for (const Victim& v : idx.EvictionCandidates(static_cast<Tier>(t), 1u << 20)) {
        got.emplace_back(v.key);
        ASSERT_EQ(v.location, model.at(v.key).at(t));
      }
      ASSERT_EQ(got, want) << "tier " << t;
    }
    std::vector<std::string> keys;
    for (auto& [k, tiers] : model) keys.push_back(k);
    std::vector<std::string_view> views(keys.begin(), keys.end());
    std::vector<Placement> out;
    ASSERT_EQ(idx.LookupPrefix(views, &out), keys.size());  // a touching lookup: relinks
    for (size_t i = 0; i < keys.size(); ++i) {
      for (auto& [t, loc] : model[keys[i]]) ASSERT_EQ(out[i].location[t], loc);
      for (auto& [t, loc] : model[keys[i]]) {  // ... so the model relinks too, in batch order
        order[t].remove(keys[i]);
        order[t].push_back(keys[i]);
      }
    }
  };
  auto remove_host = [&](int i) {
    ASSERT_EQ(*idx.Remove(Key(i), Tier::kHost), static_cast<uint64_t>(i));
    model[Key(i)].erase(host);
    order[host].remove(Key(i));
    if (model[Key(i)].empty()) {
      model.erase(Key(i));
      pins.erase(Key(i));
    }
  };
  for (int i = kN - 1; i >= 0; i -= 3) touch(Key(i));
  ASSERT_NO_FATAL_FAILURE(verify("after growth"));
  for (int i = 0; i < kN; i += 4) remove_host(i);
  ASSERT_NO_FATAL_FAILURE(verify("after deletion"));
  for (int i = kN; i < 2 * kN; ++i) insert(Key(i), host, i);
  for (int i = kN; i < 2 * kN; i += 5) touch(Key(i));
  ASSERT_NO_FATAL_FAILURE(verify("after reinsertion and more growth"));
  for (int i = kN + 1; i < 2 * kN; i += 3) remove_host(i);
  ASSERT_NO_FATAL_FAILURE(verify("after a second deletion"));
  // Clear empties every slot; the index refills from id 0 with the same table.
  idx.Clear();
  EXPECT_EQ(idx.size(), 0u);
  for (int i = 0; i < 2 * kN; i += 97) EXPECT_FALSE(idx.Lookup(Key(i), false).has_value());
  ASSERT_TRUE(idx.Insert(Key(3), Tier::kHost, 3).ok());
  EXPECT_EQ(idx.Snapshot().size(), 1u);
  EXPECT_EQ(idx.Lookup(Key(3))->location[host], 3u);
}

INSTANTIATE_TEST_SUITE_P(Hashes, BlockIndexMoves,
                         ::testing::Values(BlockIndex::HashFn{nullptr}, &EightHashes,
                                           &ConstantHash),
                         [](const auto& info) {
                           return info.param == nullptr        ? std::string("xxh3")
                                  : info.param == &EightHashes ? std::string("eight_hashes")
                                                               : std::string("constant_hash");
                         });

// A key in all four tiers: the third and fourth locations live in the cold line; removing the
// fastest tier moves the others down a rank, and each keeps its own location.
TEST(BlockIndex, LocationsMoveByRankAsTiersComeAndGo) {
  BlockIndex idx;
  const std::string k(64, 'z');
  ASSERT_TRUE(idx.Insert(k, Tier::kRemote, 40).ok());
  ASSERT_TRUE(idx.Insert(k, Tier::kDisk, 30).ok());
  ASSERT_TRUE(idx.Insert(k, Tier::kDevice, 10).ok());
  ASSERT_TRUE(idx.Insert(k, Tier::kHost, 20).ok());
  auto p = idx.Lookup(k);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->tier_mask, 0xf);
  EXPECT_EQ(p->location, (std::array<uint64_t, kNumTiers>{10, 20, 30, 40}));
  EXPECT_EQ(*idx.Remove(k, Tier::kDevice), 10u);
  EXPECT_EQ(*idx.Remove(k, Tier::kDisk), 30u);
  p = idx.Lookup(k);
  EXPECT_EQ(p->location[static_cast<int>(Tier::kHost)], 20u);
  EXPECT_EQ(p->location[static_cast<int>(Tier::kRemote)], 40u);
  EXPECT_EQ(idx.EvictionCandidates(Tier::kRemote, 1)[0].location, 40u);
}

// CURSOR CONTRACT: a chunked walk survives inserts (rehashes included), removals and re-inserts
// between its chunks: every key that stays in the tier throughout is visited exactly once, no
// call visits more than max_keys, and a key that left and came back is visited at most twice.
TEST(BlockIndex, ChunkedWalkVisitsEveryStableKeyOnceAcrossRehashes) {
  BlockIndex idx;
  auto key = [](const char* p, int i) { return std::string(p) + std::to_string(i); };
  for (int i = 0; i < 300; ++i) {
    ASSERT_TRUE(idx.Insert(key("stable-", i), Tier::kDisk, i).ok());
    ASSERT_TRUE(idx.Insert(key("going-", i), Tier::kDisk, 1000 + i).ok());
    ASSERT_TRUE(idx.Insert(key("host-", i), Tier::kHost, i).ok());  // another tier: never visited
  }
  std::map<std::string, int> seen;
  uint64_t cursor = 0;
  int calls = 0;
  int added = 0;
  for (bool more = true; more; ++calls) {
    size_t visited = 0;
    more = idx.ForEachInChunk(Tier::kDisk, &cursor, 7, [&](std::string_view k, uint64_t loc) {
      ++visited;
      ++seen[std::string(k)];
      if (k.starts_with("stable-")) EXPECT_EQ(loc, std::stoul(std::string(k.substr(7))));
    });
    EXPECT_LE(visited, 7u);
    // Between chunks: grow the table (2000 more keys over the walk: several rehashes), drop a
    // "going" key and re-insert an earlier one (a freed id, maybe below the cursor).
    for (int j = 0; j < 50 && calls < 60; ++j, ++added) {
      ASSERT_TRUE(idx.Insert(key("new-", added), Tier::kDisk, 5000 + added).ok());
    }
    if (calls < 300) {
      ASSERT_TRUE(idx.Remove(key("going-", calls), Tier::kDisk).ok());
      if (calls % 2 == 0) ASSERT_TRUE(idx.Insert(key("going-", calls), Tier::kDisk, 9).ok());
    }
    ASSERT_LT(calls, 10000) << "the walk does not end";
  }
  for (int i = 0; i < 300; ++i) {
    EXPECT_EQ(seen[key("stable-", i)], 1) << i;
    EXPECT_LE(seen[key("going-", i)], 2) << i;
    EXPECT_EQ(seen.count(key("host-", i)), 0u);
  }
  EXPECT_GT(added, 2000);
}

// Without changes, a walk in chunks of any size visits exactly what ForEachIn visits, once each.
TEST(BlockIndex, ChunkedWalkWithoutChangesMatchesForEachIn) {
  BlockIndex idx;
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(idx.Insert("d" + std::to_string(i), Tier::kDisk, i).ok());
    if (i % 3 == 0) ASSERT_TRUE(idx.Insert("h" + std::to_string(i), Tier::kHost, i).ok());
  }
  std::map<std::string, uint64_t> all;
  idx.ForEachIn(Tier::kDisk, [&](std::string_view k, uint64_t loc) { all[std::string(k)] = loc; });
  ASSERT_EQ(all.size(), 200u);
  for (size_t chunk : {1, 2, 5, 64, 1000}) {
    std::map<std::string, uint64_t> got;
    uint64_t cursor = 0;
    while (idx.ForEachInChunk(Tier::kDisk, &cursor, chunk, [&](std::string_view k, uint64_t loc) {
      EXPECT_TRUE(got.emplace(std::string(k), loc).second) << "visited twice: " << k;
    })) {
    }
    EXPECT_EQ(got, all) << "chunks of " << chunk;
  }
}

// A Clear() between chunks ends the walk (ids restart at 0) instead of reading freed entries.
TEST(BlockIndex, ChunkedWalkEndsAfterAClear) {
  BlockIndex idx;
  for (int i = 0; i < 100; ++i)
    ASSERT_TRUE(idx.Insert("k" + std::to_string(i), Tier::kDisk, i).ok());
  uint64_t cursor = 0;
  size_t n = 0;
  EXPECT_TRUE(
      idx.ForEachInChunk(Tier::kDisk, &cursor, 50, [&](std::string_view, uint64_t) { ++n; }));
  idx.Clear();
  ASSERT_TRUE(idx.Insert("after", Tier::kDisk, 1).ok());
  EXPECT_FALSE(
      idx.ForEachInChunk(Tier::kDisk, &cursor, 50, [&](std::string_view, uint64_t) { ++n; }));
  EXPECT_EQ(n, 50u);
}

}  // namespace
}  // namespace tpusync::block
