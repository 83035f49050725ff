#include "tpusync/block/block_key.h"

#include "tpusync/base/checksum.h"

namespace tpusync::block {

Status ValidateKey(std::string_view key) {
  if (key.empty()) return Status::InvalidArgument("block key is empty");
  if (key.size() > kMaxKeyBytes) {
    return Status::InvalidArgument(
        StrCat("block key is ", key.size(), " bytes; at most ", kMaxKeyBytes, " are allowed"));
  }
  return Status::OK();
}

size_t BlockKeyHash::operator()(std::string_view key) const {
  return static_cast<size_t>(Checksum64(key.data(), key.size()));
}

}  // namespace tpusync::block
