#include "varuna/common/control_tls.h"

#include "varuna/common/certificate_credential.h"

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

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
  const auto* auth = static_cast<const ClientAuth*>(SSL_get_ex_data(ssl, exDataIndex()));
  if (!auth || auth->certificate || auth->identity.size() + 1 > maxIdentity) return 0;  // a certificate: no PSK offered
  std::memcpy(identity, auth->identity.c_str(), auth->identity.size() + 1);
  return copyOut(auth->key, key, maxKey);
}

unsigned int serverCallback(SSL* ssl, const char* identity, unsigned char* key, unsigned int maxKey) {
  auto* auth = static_cast<ServerAuth*>(SSL_get_ex_data(ssl, exDataIndex()));
  if (!auth || !identity) return 0;
  const auto parsed = parseIdentity(identity);
  if (!parsed) {
    auth->refusal = "a malformed TLS identity";
    return 0;
  }
  const auto found = auth->keyFor ? auth->keyFor(*parsed) : std::nullopt;
  if (!found) {
    auth->refusal = strCat("no credential for the TLS identity of ", parsed->role, " '",
                          proto::boundedText(parsed->host, proto::kMaxLoggedPeerTextBytes), "'");
    return 0;
  }
  // A wrong key fails the handshake's binder check after this returns; the
  // identity is kept only as "presented" until the handshake completes.
  auth->presented = parsed;
  return copyOut(*found, key, maxKey);
}

SSL* sslOf(X509_STORE_CTX* store) {
  return static_cast<SSL*>(X509_STORE_CTX_get_ex_data(store, SSL_get_ex_data_X509_STORE_CTX_idx()));
}

// The client's check of the server's certificate (replacing OpenSSL's chain
// building: the only certificate it accepts is the manager's, signed by the
// job's root itself). A client holding a pre-shared key accepts none: a
// server that ignores the PSK and offers a certificate instead fails.
int verifyServer(X509_STORE_CTX* store, void* /*unused*/) {
  auto* auth = static_cast<ClientAuth*>(SSL_get_ex_data(sslOf(store), exDataIndex()));
  if (!auth || !auth->certificate) return 0;
  if (!checkManagerCertificate(auth->certificate->root(), X509_STORE_CTX_get0_cert(store), auth->refusal)) return 0;
  auth->managerVerified = true;
  return 1;
}

// The manager's check of a client's chain (certificate_credential.h).
int verifyClient(X509_STORE_CTX* store, void* /*unused*/) {
  auto* auth = static_cast<ServerAuth*>(SSL_get_ex_data(sslOf(store), exDataIndex()));
  if (!auth || !auth->ca) return 0;
  const auto checked =
      checkPeerChain(auth->ca->root(), X509_STORE_CTX_get0_cert(store), X509_STORE_CTX_get0_untrusted(store), auth->refusal);
  if (!checked) return 0;
  if (!auth->acceptHostCa) return 0;
  const HostCaStanding standing = auth->acceptHostCa(checked->hostCa, checked->peer, auth->refusal);
  if (standing == HostCaStanding::kRefused) return 0;
  auth->presented = checked->peer;
  auth->presented->certified = true;
  auth->presented->revoked = standing == HostCaStanding::kRevoked;
  auth->presented->hostCaNonce = checked->hostCa.hint;
  return 1;
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
    // Pre-shared keys only, until useServerCertificate.
    SSL_CTX_set_verify(context, SSL_VERIFY_NONE, nullptr);
    // OpenSSL counts an external PSK as a resumption, and a resumption on a
    // server that verifies peers needs a session context (any constant).
    static constexpr unsigned char kSessionContext[] = "varuna-control";
    SSL_CTX_set_session_id_context(context, kSessionContext, sizeof(kSessionContext) - 1);
    SSL_CTX_set_cert_verify_callback(context, verifyClient, nullptr);
  } else {
    // The server's certificate is checked by verifyServer alone.
    SSL_CTX_set_verify(context, SSL_VERIFY_PEER, nullptr);
    SSL_CTX_set_cert_verify_callback(context, verifyServer, nullptr);
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

void useServerCertificate(SSL_CTX* context, const CertificateCredential& manager) {
  if (SSL_CTX_use_certificate(context, manager.certificate()) != 1 ||
      SSL_CTX_use_PrivateKey(context, manager.key()) != 1) {
    throw Error(strCat("cannot use the manager's certificate: ", lastError()), 1);
  }
  // No PSK, then a certificate, or the handshake fails (a PSK handshake
  // requests none).
  SSL_CTX_set_verify(context, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
}

void useServerCertificate(SSL* ssl, const CertificateCredential& manager) {
  if (SSL_use_certificate(ssl, manager.certificate()) != 1 || SSL_use_PrivateKey(ssl, manager.key()) != 1) {
    throw Error(strCat("cannot use the manager's certificate: ", lastError()), 1);
  }
  SSL_set_verify(ssl, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
}

bool provedKey(const SSL* ssl) {
  const auto* auth = static_cast<const ClientAuth*>(SSL_get_ex_data(ssl, exDataIndex()));
  if (auth && auth->certificate) return auth->managerVerified && SSL_get0_peer_certificate(ssl) != nullptr;
  return SSL_session_reused(const_cast<SSL*>(ssl)) == 1 && SSL_get0_peer_certificate(ssl) == nullptr;
}

ClientAuth clientCredential(const proto::Hello& hello, const std::string& hint) {
  ClientAuth auth;
  if (isCertificateCredential(hello.token)) {
    auth.certificate = std::make_shared<const CertificateCredential>(
        CertificateCredential::parse(hello.token, strCat(hello.role, "'s credential")));
  } else {
    auth.identity = formatIdentity(identityOf(hello, hint));
    auth.key = pskKey(hello.token);
  }
  return auth;
}

proto::Hello wireHello(proto::Hello hello) {
  if (isCertificateCredential(hello.token)) hello.token.clear();
  return hello;
}

void attachClient(SSL* ssl, ClientAuth* auth) {
  SSL_set_ex_data(ssl, exDataIndex(), auth);
  if (!auth || !auth->certificate) return;
  // The chain up to (not including) the root the manager holds.
  const auto& credential = *auth->certificate;
  bool loaded = SSL_use_certificate(ssl, credential.certificate()) == 1 && SSL_use_PrivateKey(ssl, credential.key()) == 1;
  const auto issuers = credential.issuers();
  for (size_t i = 0; loaded && i + 1 < issuers.size(); ++i) loaded = SSL_add1_chain_cert(ssl, issuers[i]) == 1;
  if (!loaded) throw Error(strCat("cannot use the credential's certificate: ", lastError()), 1);
}
void attachServer(SSL* ssl, ServerAuth* auth) { SSL_set_ex_data(ssl, exDataIndex(), auth); }

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
