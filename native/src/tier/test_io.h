// Test helpers for the disk tier and the stores above it: a unique scratch directory, and I/O
// backend wrappers (DiskTierOptions::wrap_io) that count I/O or inject a filesystem's refusals.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tpusync/tier/io_backend.h"

namespace tpusync::tier {

// <tmp>/tpusync-<prefix>-<pid>-<random>: unique per test, not created.
inline std::string UniqueTestDir(const std::string& prefix) {
  return (std::filesystem::temp_directory_path() /
          ("tpusync-" + prefix + "-" + std::to_string(getpid()) + "-" +
           std::to_string(std::random_device{}())))
      .string();
}

// Counts every I/O op the tier hands its backend (header reads at open included).
class CountingIo final : public IoBackend {
 public:
  CountingIo(std::unique_ptr<IoBackend> inner, std::atomic<uint64_t>* ops)
      : inner_(std::move(inner)), ops_(ops) {}
  std::string_view name() const override { return inner_->name(); }
  void Run(std::span<IoOp> ops) override {
    *ops_ += ops.size();
    inner_->Run(ops);
  }

 private:
  std::unique_ptr<IoBackend> inner_;
  std::atomic<uint64_t>* ops_;
};

// A filesystem that accepts O_DIRECT at open and refuses it per I/O (some FUSE and network
// filesystems): every op on a descriptor that has O_DIRECT set fails with EINVAL, the others run.
class RefusesDirectIo final : public IoBackend {
 public:
  explicit RefusesDirectIo(std::unique_ptr<IoBackend> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  void Run(std::span<IoOp> ops) override {
    std::vector<IoOp> pass;
    std::vector<size_t> where;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (fcntl(ops[i].fd, F_GETFL) & O_DIRECT) {
        ops[i].result = -EINVAL;
        ++refused;
      } else {
        pass.push_back(ops[i]);
        where.push_back(i);
      }
    }
    inner_->Run(pass);
    for (size_t j = 0; j < pass.size(); ++j) ops[where[j]].result = pass[j].result;
  }
  std::atomic<int> refused{0};

 private:
  std::unique_ptr<IoBackend> inner_;
};

}  // namespace tpusync::tier
