#include "tpusync/transport/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace tpusync::transport {
namespace {

constexpr std::string_view kClientLabel = "tpusync/1 client";
constexpr std::string_view kServerLabel = "tpusync/1 server";

Mac Tag(const Secret& secret, std::string_view label, std::span<const uint8_t> a,
        std::span<const uint8_t> b) {
  std::vector<uint8_t> msg(label.begin(), label.end());
  msg.insert(msg.end(), a.begin(), a.end());
  msg.insert(msg.end(), b.begin(), b.end());
  return HmacSha256(secret.bytes(), msg);
}

Status Denied(std::string why) { return Status::PermissionDenied("authentication failed: " + why); }

}  // namespace

Result<Secret> Secret::FromBytes(std::string bytes) {
  if (bytes.size() < kMinSecretBytes) {
    return Status::InvalidArgument(StrCat("the shared secret has ", bytes.size(),
                                          " bytes; at least ", kMinSecretBytes, " are required"));
  }
  Secret s;
  s.bytes_ = std::move(bytes);
  return s;
}

Result<Secret> Secret::Load(const std::string& path, const char* env_var) {
  if (!path.empty()) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return Status::NotFound(StrCat("cannot read the secret file '", path, "'"));
    std::stringstream ss;
    ss << in.rdbuf();
    std::string bytes = ss.str();
    while (!bytes.empty() && (bytes.back() == '\n' || bytes.back() == '\r')) bytes.pop_back();
    return FromBytes(std::move(bytes));
  }
  const char* env = env_var ? std::getenv(env_var) : nullptr;
  if (env == nullptr || *env == '\0') {
    return Status::InvalidArgument(
        StrCat("no shared secret: pass a secret file or set $", env_var ? env_var : kSecretEnvVar));
  }
  return FromBytes(env);
}

Mac HmacSha256(std::span<const uint8_t> key, std::span<const uint8_t> message) {
  Mac out{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), message.data(), message.size(),
       out.data(), &len);
  return out;
}

Status RandomBytes(std::span<uint8_t> out) {
  if (RAND_bytes(out.data(), static_cast<int>(out.size())) != 1) {
    return Status::Internal("OpenSSL RAND_bytes failed: no entropy for a nonce");
  }
  return Status::OK();
}

Status ServerHandshake(Stream& stream, const Secret& secret, Deadline deadline) {
  std::array<uint8_t, kNonceBytes> ns;
  TPUSYNC_RETURN_IF_ERROR(RandomBytes(ns));
  TPUSYNC_RETURN_IF_ERROR(stream.SendMeta(Op::kAuthChallenge, 0, ns, deadline));
  auto resp = stream.Expect(Op::kAuthResponse, deadline);
  if (!resp.ok()) {
    if (resp.status().code() == StatusCode::kVersionMismatch) return resp.status();
    return Denied(StrCat("no valid response (", resp.status().ToString(), ")"));
  }
  if (resp->meta.size() != kNonceBytes + kMacBytes) {
    return Denied(StrCat("response of ", resp->meta.size(), " bytes"));
  }
  std::span<const uint8_t> nc(resp->meta.data(), kNonceBytes);
  std::span<const uint8_t> mac(resp->meta.data() + kNonceBytes, kMacBytes);
  const Mac want = Tag(secret, kClientLabel, ns, nc);
  if (CRYPTO_memcmp(want.data(), mac.data(), kMacBytes) != 0) {
    (void)stream.SendMeta(
        Op::kError, 0, EncodeStatus(Status::PermissionDenied("authentication failed")), deadline);
    return Denied("wrong MAC (the peer does not hold the shared secret)");
  }
  const Mac proof = Tag(secret, kServerLabel, nc, ns);
  return stream.SendMeta(Op::kAuthProof, 0, proof, deadline);
}

Status ClientHandshake(Stream& stream, const Secret& secret, Deadline deadline) {
  auto ch = stream.Expect(Op::kAuthChallenge, deadline);
  if (!ch.ok()) return ch.status();
  if (ch->meta.size() != kNonceBytes) {
    return Denied(StrCat("server challenge of ", ch->meta.size(), " bytes"));
  }
  std::array<uint8_t, kNonceBytes + kMacBytes> resp;
  std::span<uint8_t> nc(resp.data(), kNonceBytes);
  TPUSYNC_RETURN_IF_ERROR(RandomBytes(nc));
  const Mac mac = Tag(secret, kClientLabel, ch->meta, nc);
  std::memcpy(resp.data() + kNonceBytes, mac.data(), kMacBytes);
  TPUSYNC_RETURN_IF_ERROR(stream.SendMeta(Op::kAuthResponse, 0, resp, deadline));
  auto proof = stream.Expect(Op::kAuthProof, deadline);
  if (!proof.ok()) {
    if (proof.status().code() == StatusCode::kPermissionDenied) {
      return Denied("the server rejected our secret");
    }
    return proof.status();
  }
  const Mac want = Tag(secret, kServerLabel, nc, ch->meta);
  if (proof->meta.size() != kMacBytes ||
      CRYPTO_memcmp(want.data(), proof->meta.data(), kMacBytes) != 0) {
    return Denied("the server's proof is wrong (it does not hold the shared secret)");
  }
  return Status::OK();
}

}  // namespace tpusync::transport
