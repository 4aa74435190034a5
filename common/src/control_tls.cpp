#include "varuna/common/control_tls.h"

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/ssl.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace varuna::tls {
namespace {

// The one suite old-style PSK callbacks may use in TLS 1.3 (SHA-256).
constexpr const char* kCipherSuite = "TLS_AES_128_GCM_SHA256";
constexpr const char* kIdentityVersion = "varuna-control-1";

int exDataIndex() {
  static const int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(separator, start);
    parts.push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return parts;
    start = end + 1;
  }
}

bool parseInt(const std::string& text, int& value) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  return ec == std::errc() && end == text.data() + text.size();
}

unsigned int copyOut(const std::string& from, unsigned char* to, unsigned int capacity) {
  if (from.empty() || from.size() > capacity) return 0;
  std::memcpy(to, from.data(), from.size());
  return static_cast<unsigned int>(from.size());
}

unsigned int clientCallback(SSL* ssl, const char* /*hint*/, char* identity, unsigned int maxIdentity,
                            unsigned char* key, unsigned int maxKey) {
  const auto* psk = static_cast<const ClientPsk*>(SSL_get_ex_data(ssl, exDataIndex()));
  if (!psk || psk->identity.size() + 1 > maxIdentity) return 0;
  std::memcpy(identity, psk->identity.c_str(), psk->identity.size() + 1);
  return copyOut(psk->key, key, maxKey);
}

unsigned int serverCallback(SSL* ssl, const char* identity, unsigned char* key, unsigned int maxKey) {
  auto* psk = static_cast<ServerPsk*>(SSL_get_ex_data(ssl, exDataIndex()));
  if (!psk || !identity) return 0;
  const auto parsed = parseIdentity(identity);
  if (!parsed) {
    psk->refusal = "a malformed TLS identity";
    return 0;
  }
  const auto found = psk->keyFor ? psk->keyFor(*parsed) : std::nullopt;
  if (!found) {
    psk->refusal = strCat("no credential for the TLS identity of ", parsed->role, " '",
                          proto::boundedText(parsed->host, proto::kMaxLoggedPeerTextBytes), "'");
    return 0;
  }
  // A wrong key fails the handshake's binder check after this returns; the
  // identity is kept only as "presented" until the handshake completes.
  psk->presented = parsed;
  return copyOut(*found, key, maxKey);
}

// OpenSSL's socket BIO writes with plain send(): a peer that has gone would
// raise SIGPIPE and kill a process that did not ignore it (a worker is the
// user's program). The same BIO, but its writes never raise it.
int writeWithoutSigpipe(BIO* bio, const char* data, int size) {
  int fd = -1;
  BIO_get_fd(bio, &fd);
  BIO_clear_retry_flags(bio);
  const ssize_t n = ::send(fd, data, static_cast<size_t>(size), MSG_NOSIGNAL);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) BIO_set_retry_write(bio);
  return static_cast<int>(n);
}

const BIO_METHOD* socketWithoutSigpipe() {
  static BIO_METHOD* const method = [] {
    const BIO_METHOD* socket = BIO_s_socket();
    BIO_METHOD* m = BIO_meth_new(BIO_TYPE_SOCKET, "socket without SIGPIPE");
    BIO_meth_set_write(m, writeWithoutSigpipe);
    BIO_meth_set_read(m, BIO_meth_get_read(socket));
    BIO_meth_set_puts(m, BIO_meth_get_puts(socket));
    BIO_meth_set_ctrl(m, BIO_meth_get_ctrl(socket));
    BIO_meth_set_create(m, BIO_meth_get_create(socket));
    BIO_meth_set_destroy(m, BIO_meth_get_destroy(socket));
    return m;
  }();
  return method;
}

}  // namespace

bool attachSocket(SSL* ssl, int fd) {
  BIO* bio = BIO_new(socketWithoutSigpipe());
  if (!bio) return false;
  BIO_set_fd(bio, fd, BIO_NOCLOSE);
  SSL_set_bio(ssl, bio, bio);
  return true;
}

bool plaintextRequested() {
  const char* value = std::getenv(kPlaintextEnv);
  return value && std::strcmp(value, "1") == 0;
}

std::string formatIdentity(const PskIdentity& identity) {
  if (identity.host.size() > kMaxHostBytes) {
    throw ConfigError(strCat("host name '", proto::boundedText(identity.host, 64), "...' is longer than ",
                             kMaxHostBytes, " bytes: it cannot name a peer of the control plane"));
  }
  return strCat(kIdentityVersion, "\n", identity.role, "\n", identity.host, "\n", identity.rank, "\n",
                identity.generation, "\n", identity.hint);
}

std::optional<PskIdentity> parseIdentity(const std::string& text) {
  const auto parts = split(text, '\n');
  if (parts.size() != 6 || parts[0] != kIdentityVersion) return std::nullopt;
  PskIdentity identity{parts[1], parts[2], -1, -1, parts[5]};
  if (!parseInt(parts[3], identity.rank) || !parseInt(parts[4], identity.generation)) return std::nullopt;
  return identity;
}

PskIdentity identityOf(const proto::Hello& hello, std::string hint) {
  if (hint.empty() && hello.role == "join") {
    // A join credential's public part: "vj1.<expiry>" (never its MAC, which
    // the identity would show in clear).
    const size_t mac = hello.token.rfind('.');
    if (mac != std::string::npos) hint = hello.token.substr(0, mac);
  }
  return {hello.role, hello.host, hello.rank, hello.generation, std::move(hint)};
}

bool matches(const PskIdentity& identity, const proto::Hello& hello) {
  return identity.role == hello.role && identity.host == hello.host && identity.rank == hello.rank &&
         identity.generation == hello.generation;
}

std::string pskKey(const std::string& credential) {
  // Domain-separated from the credential itself: the key that encrypts is
  // not the string the hello carries.
  static constexpr char kLabel[] = "varuna control TLS 1.3 external PSK";
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), credential.data(), static_cast<int>(credential.size()),
       reinterpret_cast<const unsigned char*>(kLabel), sizeof(kLabel) - 1, mac, &length);
  return std::string(reinterpret_cast<const char*>(mac), length);
}

void configureContext(SSL_CTX* context, bool server) {
  SSL_CTX_set_min_proto_version(context, TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(context, TLS1_3_VERSION);
  SSL_CTX_set_ciphersuites(context, kCipherSuite);
  if (server) {
    SSL_CTX_set_verify(context, SSL_VERIFY_NONE, nullptr);  // no certificates: the PSK authenticates both ends
  } else {
    // A server may ignore the PSK and authenticate with a certificate instead
    // (TLS 1.3 allows it, and OpenSSL would go along): any certificate at all
    // fails the handshake, so only a server that proved the key gets a byte.
    SSL_CTX_set_verify(context, SSL_VERIFY_PEER, [](int, X509_STORE_CTX*) { return 0; });
  }
  SSL_CTX_set_num_tickets(context, 0);                    // every connection proves its credential afresh
  // A peer that closes without close_notify reads as the end of the stream,
  // as a plain TCP close does.
  SSL_CTX_set_options(context, SSL_OP_NO_TICKET | SSL_OP_IGNORE_UNEXPECTED_EOF);
  // Idle connections (thousands of workers between reports) give their
  // record buffers back to the allocator.
  SSL_CTX_set_mode(context,
                   SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER | SSL_MODE_RELEASE_BUFFERS);
  if (server) {
    SSL_CTX_set_psk_server_callback(context, serverCallback);
  } else {
    SSL_CTX_set_psk_client_callback(context, clientCallback);
  }
}

bool provedKey(const SSL* ssl) {
  return SSL_session_reused(const_cast<SSL*>(ssl)) == 1 && SSL_get0_peer_certificate(ssl) == nullptr;
}

void attachClient(SSL* ssl, ClientPsk* psk) { SSL_set_ex_data(ssl, exDataIndex(), psk); }
void attachServer(SSL* ssl, ServerPsk* psk) { SSL_set_ex_data(ssl, exDataIndex(), psk); }

std::string lastError() {
  std::string text;
  while (const unsigned long code = ERR_get_error()) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    text += (text.empty() ? "" : "; ") + std::string(buffer);
  }
  return text.empty() ? "no detail from OpenSSL" : text;
}

}  // namespace varuna::tls
