// Built instead of io_uring_backend.cc when liburing is not found at configure time.
#include "tpusync/tier/io_backend.h"

namespace tpusync::tier {

Result<std::unique_ptr<IoBackend>> MakeIoUringBackend(unsigned) {
  return Status::Unavailable("tpusync was built without liburing (install liburing-dev)");
}

}  // namespace tpusync::tier
