#include "varuna/manager/credentials.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstdio>

#include "varuna/common/errors.h"

namespace varuna::credentials {
namespace {

std::string hmacHex(const std::string& key, const std::string& message) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
           message.size(), digest, &length) == nullptr) {
    throw Error("HMAC-SHA256 failed (OpenSSL)", 1);
  }
  std::string hex(2 * length, '0');
  for (unsigned int i = 0; i < length; ++i) std::snprintf(&hex[2 * i], 3, "%02x", digest[i]);
  return hex;
}

}  // namespace

std::string agent(const std::string& jobSecret, const std::string& host) { return hmacHex(jobSecret, "agent\n" + host); }

std::string notifier(const std::string& agentCredential) { return hmacHex(agentCredential, "notifier"); }

std::string worker(const std::string& agentCredential, int rank, int generation) {
  return hmacHex(agentCredential, strCat("worker\n", rank, "\n", generation));
}

std::string expected(const std::string& jobSecret, const std::string& role, const std::string& host, int rank,
                     int generation) {
  if (role == "agent") return agent(jobSecret, host);
  if (role == "notifier") return notifier(agent(jobSecret, host));
  if (role == "worker") return worker(agent(jobSecret, host), rank, generation);
  return "";
}

}  // namespace varuna::credentials
