#include "varuna/manager/credentials.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdio>

#include "varuna/common/certificate_credential.h"
#include "varuna/common/errors.h"
#include "varuna/common/secrets.h"

namespace varuna::credentials {
namespace {

std::string toHex(const unsigned char* bytes, size_t size) {
  std::string hex(2 * size, '0');
  for (size_t i = 0; i < size; ++i) std::snprintf(&hex[2 * i], 3, "%02x", bytes[i]);
  return hex;
}

std::string hmacHex(const std::string& key, const std::string& message) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
           message.size(), digest, &length) == nullptr) {
    throw Error("HMAC-SHA256 failed (OpenSSL)", 1);
  }
  return toHex(digest, length);
}

}  // namespace

std::string agent(const std::string& jobSecret, const std::string& host) { return hmacHex(jobSecret, "agent\n" + host); }

std::string joinedAgent(const std::string& jobSecret, const std::string& host, const std::string& joinNonce) {
  if (joinNonce.empty()) throw Error("a joined host's agent credential needs its join's nonce", 1);
  return hmacHex(jobSecret, strCat("agent\n", host, "\n", joinNonce));
}

std::string newNonce() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof bytes) != 1) throw Error("RAND_bytes failed (OpenSSL): no nonce", 1);
  return toHex(bytes, sizeof bytes);
}

namespace {
// A leaf certificate issued by the host's CA an agent holds.
std::string issuedBy(const std::string& agentCredential, const std::string& role, int rank, int generation) {
  const auto hostCa = tls::CertificateCredential::parse(agentCredential, "agent's credential");
  return hostCa.issue({role, hostCa.identity().host, rank, generation, ""}, /*isCa=*/false).encode();
}
}  // namespace

std::string notifier(const std::string& agentCredential) {
  if (tls::isCertificateCredential(agentCredential)) return issuedBy(agentCredential, "notifier", -1, -1);
  return hmacHex(agentCredential, "notifier");
}

std::string worker(const std::string& agentCredential, int rank, int generation) {
  if (tls::isCertificateCredential(agentCredential)) return issuedBy(agentCredential, "worker", rank, generation);
  return hmacHex(agentCredential, strCat("worker\n", rank, "\n", generation));
}

std::string caTag(const std::string& jobSecret) { return hmacHex(jobSecret, "certificate authority"); }

namespace {
constexpr std::string_view kJoinPrefix = "vj1.";
}  // namespace

std::string join(const std::string& jobSecret, int64_t expiresUnixS) {
  const std::string expiry = std::to_string(expiresUnixS);
  return strCat(kJoinPrefix, expiry, ".", hmacHex(jobSecret, "join\n" + expiry));
}

int64_t joinExpiry(const std::string& credential) {
  if (credential.size() > 128 || credential.rfind(kJoinPrefix, 0) != 0) return -1;
  const size_t dot = credential.find('.', kJoinPrefix.size());
  if (dot == std::string::npos || dot == kJoinPrefix.size() || dot - kJoinPrefix.size() > 12) return -1;
  int64_t expiry = 0;
  for (size_t i = kJoinPrefix.size(); i < dot; ++i) {
    const char c = credential[i];
    if (c < '0' || c > '9') return -1;
    expiry = expiry * 10 + (c - '0');
  }
  return expiry;
}

JoinCheck checkJoin(const std::string& jobSecret, const std::string& credential, int64_t nowUnixS) {
  const int64_t expiry = joinExpiry(credential);
  if (expiry < 0) return JoinCheck::kMalformed;
  // The MAC first: an expiry the holder wrote itself says nothing.
  if (!constantTimeEquals(credential, join(jobSecret, expiry))) return JoinCheck::kWrong;
  return nowUnixS < expiry ? JoinCheck::kValid : JoinCheck::kExpired;
}

const char* toString(JoinCheck check) {
  switch (check) {
    case JoinCheck::kValid: return "valid";
    case JoinCheck::kMalformed: return "not a join credential";
    case JoinCheck::kWrong: return "a wrong join credential (not this job's)";
    case JoinCheck::kExpired: return "an expired join credential (read the current one from run_varuna's state_dir/join_token)";
  }
  return "unknown";
}

std::string expected(const std::string& agentCredential, const std::string& role, int rank, int generation) {
  if (role == "agent") return agentCredential;
  if (role == "notifier") return notifier(agentCredential);
  if (role == "worker") return worker(agentCredential, rank, generation);
  return "";
}

}  // namespace varuna::credentials
