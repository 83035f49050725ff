// libFuzzer harness for everything that reads bytes from a peer before or without trusting it:
// the frame header parser, a stream reading frames from the input, both sides of the auth
// handshake and the status (lenient and strict: kPdRelease) / metadata / store-key decoders.
//
// FUZZ CONTRACT: for any input, no crash, no sanitizer report, no allocation beyond the wire limits
// and no wait (MemoryStream never blocks; an exhausted input is kUnavailable).
// Run: bash ci/nox.sh -s fuzz (10^6 inputs, ASan + UBSan, corpus in native/fuzz/corpus).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tpusync/node/store_node.h"
#include "tpusync/transport/auth.h"
#include "tpusync/transport/fault_stream.h"
#include "tpusync/transport/frame.h"
#include "tpusync/transport/stream.h"

using namespace tpusync;
using namespace tpusync::transport;

namespace {

const Secret& FuzzSecret() {
  static const Secret s = *Secret::FromBytes("fuzz-secret-0123456789abcdef");
  return s;
}

// Reads frames as a receiver would: payloads of plausible size land in a scratch buffer, others
// are skipped; metadata goes through the readers the protocol uses.
void ReadFrames(std::span<const uint8_t> input) {
  MemoryStream s(std::vector<uint8_t>(input.begin(), input.end()));
  static std::vector<uint8_t> scratch(64 << 10);
  for (int i = 0; i < 16 && !s.broken(); ++i) {
    auto f = s.RecvHead(DeadlineInMs(10));
    if (!f.ok()) return;
    (void)DecodeStatus(f->meta);
    Status carried;  // kPdRelease / kPdReleased: the strict status decoder
    (void)ParseStatus(f->meta, &carried);
    MetaReader r(f->meta);
    (void)r.U32();
    (void)r.U64();
    (void)r.Str(64);
    MetaReader keys(f->meta);
    (void)node::DecodeKeys(keys);  // store node request metadata
    const uint64_t payload = PayloadBytes(f->header);
    if (payload <= scratch.size()) {
      std::vector<uint8_t*> dst(f->header.num_blocks);
      for (uint32_t b = 0; b < f->header.num_blocks; ++b) {
        dst[b] = scratch.data() + b * f->header.block_bytes;
      }
      (void)s.RecvBlocks(*f, dst, DeadlineInMs(10));
    } else {
      (void)s.SkipBlocks(*f, DeadlineInMs(10));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> input(data, size);
  (void)ParseHeader(input);
  (void)ParseFrameBytes(input);
  ReadFrames(input);
  {
    MemoryStream server_side(std::vector<uint8_t>(input.begin(), input.end()));
    (void)ServerHandshake(server_side, FuzzSecret(), DeadlineInMs(10));
  }
  {
    MemoryStream client_side(std::vector<uint8_t>(input.begin(), input.end()));
    (void)ClientHandshake(client_side, FuzzSecret(), DeadlineInMs(10));
  }
  return 0;
}
