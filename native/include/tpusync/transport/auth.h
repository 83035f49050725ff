// Authentication of every transport connection: mutual challenge-response over a shared secret
// with HMAC-SHA256 (OpenSSL libcrypto).
//
//   server -> client  AuthChallenge  meta = Ns (32 random bytes)
//   client -> server  AuthResponse   meta = Nc (32 random bytes) + HMAC(K, "tpusync/1 client" Ns
//   Nc) server -> client  AuthProof      meta = HMAC(K, "tpusync/1 server" Nc Ns)
//
// AUTH CONTRACT: no frame other than the three above is accepted on a connection before the
// handshake completed; a wrong MAC, a malformed or out-of-order frame or a timeout ends the
// connection with kPermissionDenied (logged by the server with the peer's address) and the secret
// is never sent. Both sides prove knowledge of the secret (the client checks the server's proof),
// fresh nonces on both sides stop replay, MACs are compared in constant time (CRYPTO_memcmp).
// The handshake authenticates; it does not encrypt: run over a private network, WireGuard or a TLS
// tunnel when the wire itself is untrusted (docs/security.md).
//
// SECRET CONTRACT: the secret comes from a file or an environment variable, never a command-line
// argument (visible in ps and shell history); it is at least 16 bytes; a trailing newline in the
// file is dropped.
//
// Rejected alternatives: a bearer token sent in clear (replayable, leaks on the first MITM);
// mandatory TLS in-process (certificate management for every cache node, and a copy through the
// TLS record layer on the hot path, which a private network or tunnel avoids).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tpusync/base/status.h"
#include "tpusync/transport/stream.h"

namespace tpusync::transport {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;
inline constexpr size_t kMinSecretBytes = 16;
// HANDSHAKE LIMIT (stream.h): the most metadata a frame may carry on a connection that has not
// authenticated and bound yet (a challenge, response or proof is 32-64 bytes, a Bind 16, an Error
// frame its status).
inline constexpr uint32_t kHandshakeMetaBytes = 4096;
inline constexpr const char* kSecretEnvVar = "TPUSYNC_AUTH_SECRET";

class Secret {
 public:
  static Result<Secret> FromBytes(std::string bytes);
  // From `path` when non-empty, else from the environment variable `env_var`.
  static Result<Secret> Load(const std::string& path, const char* env_var = kSecretEnvVar);
  std::span<const uint8_t> bytes() const {
    return {reinterpret_cast<const uint8_t*>(bytes_.data()), bytes_.size()};
  }

 private:
  std::string bytes_;
};

using Mac = std::array<uint8_t, kMacBytes>;
Mac HmacSha256(std::span<const uint8_t> key, std::span<const uint8_t> message);
Status RandomBytes(std::span<uint8_t> out);

// Server side of the handshake on a fresh stream.
Status ServerHandshake(Stream& stream, const Secret& secret, Deadline deadline);
// Client side of the handshake on a fresh stream.
Status ClientHandshake(Stream& stream, const Secret& secret, Deadline deadline);

}  // namespace tpusync::transport
