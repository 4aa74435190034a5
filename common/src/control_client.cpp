#include "varuna/common/control_client.h"

#include <fcntl.h>
#include <netdb.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>

#include <cerrno>
#include <cstring>

namespace varuna::proto {
namespace {

using Clock = std::chrono::steady_clock;

int remainingMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

// Non-blocking connect bounded by the deadline; returns the fd or -1 with errno set.
int connectOne(const addrinfo& ai, Clock::time_point deadline) {
  const int fd = ::socket(ai.ai_family, ai.ai_socktype | SOCK_CLOEXEC, ai.ai_protocol);
  if (fd < 0) return -1;
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, ai.ai_addr, ai.ai_addrlen);
  if (rc < 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    do {
      rc = ::poll(&p, 1, remainingMs(deadline));
    } while (rc < 0 && errno == EINTR);  // a signal meanwhile is no failure to connect
    if (rc == 0) {
      errno = ETIMEDOUT;
      rc = -1;
    } else if (rc > 0) {
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      errno = err;
      rc = err == 0 ? 0 : -1;
    }
  }
  if (rc < 0) {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  }
  ::fcntl(fd, F_SETFL, flags);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

// Whether the connected socket's peer is this machine.
bool peerIsLoopback(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return false;
  return tls::isLoopback(reinterpret_cast<const sockaddr&>(address));
}

SSL_CTX* sharedContext(bool server) {
  // One per side for the process, made on first use (thread-safe), never
  // freed: every connection's SSL holds a reference anyway.
  static SSL_CTX* const client = [] {
    SSL_CTX* context = SSL_CTX_new(TLS_client_method());
    if (context) tls::configureContext(context, false);
    return context;
  }();
  static SSL_CTX* const serverSide = [] {
    SSL_CTX* context = SSL_CTX_new(TLS_server_method());
    if (context) tls::configureContext(context, true);
    return context;
  }();
  return server ? serverSide : client;
}

}  // namespace

std::pair<std::string, int> splitHostPort(const std::string& address, const std::string& what) {
  std::string host;
  std::string port;
  if (!address.empty() && address.front() == '[') {
    const auto close = address.find(']');
    if (close != std::string::npos && close + 1 < address.size() && address[close + 1] == ':') {
      host = address.substr(1, close - 1);
      port = address.substr(close + 2);
    }
  } else if (const auto colon = address.rfind(':'); colon != std::string::npos) {
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  char* end = nullptr;
  const long value = port.empty() ? -1 : std::strtol(port.c_str(), &end, 10);
  if (host.empty() || value < 1 || value > 65535 || *end != '\0') {
    throw ConfigError(strCat(what, " '", address, "' is not host:port (e.g. 10.0.0.1:29400 or [::1]:29400)"));
  }
  return {host, static_cast<int>(value)};
}

ControlClient ControlClient::connect(const std::string& address, std::chrono::milliseconds timeout) {
  const auto [host, port] = splitHostPort(address, "manager address");
  const auto deadline = Clock::now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const std::string portText = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), portText.c_str(), &hints, &list); rc != 0) {
    throw ConnectionError(strCat("cannot resolve manager address ", address, ": ", ::gai_strerror(rc)));
  }
  int fd = -1;
  int lastErrno = 0;
  for (addrinfo* ai = list; ai && fd < 0; ai = ai->ai_next) {
    fd = connectOne(*ai, deadline);
    if (fd < 0) lastErrno = errno;
  }
  ::freeaddrinfo(list);
  if (fd < 0) throw ConnectionError(strCat("cannot connect to the manager at ", address, ": ", std::strerror(lastErrno)));
  return ControlClient(fd, address);
}

ControlClient ControlClient::connectAs(const std::string& address, std::chrono::milliseconds timeout,
                                      const Hello& hello, const std::string& pskHint) {
  const auto deadline = Clock::now() + timeout;
  if (!tls::plaintextRequested()) {
    auto client = connectTls(address, timeout, tls::clientCredential(hello, pskHint));
    client.sendFrame(encode(tls::wireHello(hello)), deadline);
    return client;
  }
  auto client = connect(address, timeout);
  // A credential goes out in clear only to this machine (--insecure_plaintext_control is loopback only).
  if (!peerIsLoopback(client.fd_)) {
    throw ConfigError(strCat("refusing to send a credential in plaintext to ", address, ": ", tls::kPlaintextEnv,
                             " is set, but the manager is not on this machine (unset it: over a network the control "
                             "plane is TLS)"));
  }
  client.sendFrame(encode(tls::wireHello(hello)), deadline);  // a certificate credential's key never goes
  return client;
}

ControlClient ControlClient::connectTls(const std::string& address, std::chrono::milliseconds timeout,
                                       tls::ClientAuth auth) {
  const auto deadline = Clock::now() + timeout;
  auto client = connect(address, timeout);
  client.clientAuth_ = std::make_unique<tls::ClientAuth>(std::move(auth));
  client.startTls(false, deadline);
  return client;
}

ControlClient ControlClient::acceptTls(int fd, std::string address, tls::KeyForIdentity keyFor,
                                      std::chrono::milliseconds timeout) {
  ControlClient client(fd, std::move(address));
  client.serverAuth_->keyFor = std::move(keyFor);
  client.startTls(true, Clock::now() + timeout);
  return client;
}

ControlClient ControlClient::acceptTls(int fd, std::string address, tls::ServerAuth server,
                                      std::shared_ptr<const tls::CertificateCredential> manager,
                                      std::chrono::milliseconds timeout) {
  ControlClient client(fd, std::move(address));
  *client.serverAuth_ = std::move(server);
  client.managerCertificate_ = std::move(manager);
  client.startTls(true, Clock::now() + timeout);
  return client;
}

void ControlClient::startTls(bool server, Deadline deadline) {
  SSL_CTX* context = sharedContext(server);
  ssl_ = context ? SSL_new(context) : nullptr;
  if (!ssl_) throw ConnectionError(strCat("cannot set up TLS: ", tls::lastError()));
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL, 0) | O_NONBLOCK);  // every wait is a poll with a deadline
  if (!tls::attachSocket(ssl_, fd_)) throw ConnectionError(strCat("cannot set up TLS: ", tls::lastError()));
  if (server) {
    tls::attachServer(ssl_, serverAuth_.get());
    if (managerCertificate_) tls::useServerCertificate(ssl_, *managerCertificate_);
    SSL_set_accept_state(ssl_);
  } else {
    tls::attachClient(ssl_, clientAuth_.get());
    SSL_set_connect_state(ssl_);
  }
  const TlsResult result = tlsCall([&] { return SSL_do_handshake(ssl_); }, deadline);
  if (result.rc == 1 && (server || tls::provedKey(ssl_))) return;
  failHandshake(server, result);
}

void ControlClient::failHandshake(bool server, const TlsResult& result) {
  const bool certificate = result.rc == 1;  // completed, but with a certificate instead of the key
  // Only what the other end said in TLS counts against the credential; a
  // timeout, a reset or an end of file is a connection's failure, retried.
  const bool refused = certificate || result.sslError == SSL_ERROR_SSL;
  const std::string detail = result.timedOut ? "no answer in time"
                             : refused       ? tls::lastError()
                             : result.savedErrno != 0 ? std::strerror(result.savedErrno)
                                                      : "the connection was closed";
  const std::string refusal = serverAuth_->refusal;
  serverAuth_->presented.reset();
  close();
  if (!refused) {
    throw ConnectionError(strCat("the TLS handshake with ", server ? "" : "the manager at ", address_,
                                 " did not complete: ", detail));
  }
  if (server) throw AuthenticationError(strCat("TLS handshake with ", address_, " failed: ",
                                               refusal.empty() ? detail : refusal));
  if (clientAuth_ && clientAuth_->certificate) {
    throw AuthenticationError(strCat("the manager at ", address_, " did not prove it is this job's manager or did not "
                                     "accept this credential in the TLS handshake (",
                                     clientAuth_->refusal.empty() ? detail : clientAuth_->refusal,
                                     "): a stale credential (the job's CA was made anew), a manager of another job, "
                                     "or a plaintext manager (--insecure_plaintext_control); nothing was sent"));
  }
  if (certificate) {
    throw AuthenticationError(strCat("the manager at ", address_, " answered with a certificate, not the job's key: "
                                     "it is not this job's run_varuna; nothing was sent"));
  }
  throw AuthenticationError(strCat("the manager at ", address_, " did not accept this credential in the TLS handshake (",
                                   detail, "): a wrong or stale credential, a manager of another job, or a plaintext "
                                   "manager (--insecure_plaintext_control)"));
}

template <typename Call>
ControlClient::TlsResult ControlClient::tlsCall(Call call, Deadline deadline) {
  while (true) {
    ERR_clear_error();
    errno = 0;
    const int rc = call();
    if (rc > 0) return {rc, SSL_ERROR_NONE, false, 0};
    const int error = SSL_get_error(ssl_, rc);
    const int savedErrno = errno;
    short events = 0;
    if (error == SSL_ERROR_WANT_READ) events = POLLIN;
    if (error == SSL_ERROR_WANT_WRITE) events = POLLOUT;
    if (events == 0) return {rc, error, false, savedErrno};
    pollfd p{fd_, events, 0};
    const int ready = ::poll(&p, 1, deadline ? remainingMs(*deadline) : -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return {-1, SSL_ERROR_SYSCALL, false, errno};
    if (ready == 0) return {0, error, true, 0};
  }
}

ControlClient::ControlClient(ControlClient&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      answered_(std::exchange(other.answered_, false)),
      address_(std::move(other.address_)),
      decoder_(std::move(other.decoder_)),
      ssl_(std::exchange(other.ssl_, nullptr)),
      clientAuth_(std::move(other.clientAuth_)),
      serverAuth_(std::move(other.serverAuth_)),
      managerCertificate_(std::move(other.managerCertificate_)) {}

ControlClient& ControlClient::operator=(ControlClient&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    answered_ = std::exchange(other.answered_, false);
    address_ = std::move(other.address_);
    decoder_ = std::move(other.decoder_);
    ssl_ = std::exchange(other.ssl_, nullptr);
    clientAuth_ = std::move(other.clientAuth_);
    serverAuth_ = std::move(other.serverAuth_);
    managerCertificate_ = std::move(other.managerCertificate_);
  }
  return *this;
}

ControlClient::~ControlClient() { close(); }

void ControlClient::close() {
  if (ssl_) {
    // A close_notify if the socket takes it now (never waits); not after a
    // failed handshake, where OpenSSL says not to.
    if (SSL_is_init_finished(ssl_)) SSL_shutdown(ssl_);
    ERR_clear_error();
    SSL_free(ssl_);
    ssl_ = nullptr;
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int ControlClient::release() {
  if (ssl_) throw ConnectionError("a TLS control connection cannot be handed over (release())");
  return std::exchange(fd_, -1);
}

std::optional<tls::PskIdentity> ControlClient::peerIdentity() const {
  return serverAuth_ && ssl_ ? serverAuth_->presented : std::nullopt;
}

void ControlClient::send(const Message& message) { sendFrame(encode(message), std::nullopt); }

void ControlClient::send(const Message& message, std::chrono::milliseconds timeout) {
  sendFrame(encode(message), Clock::now() + timeout);
}

void ControlClient::sendFrameTls(const std::string& frame, Deadline deadline) {
  size_t sent = 0;
  while (sent < frame.size()) {
    const TlsResult result =
        tlsCall([&] { return SSL_write(ssl_, frame.data() + sent, static_cast<int>(frame.size() - sent)); }, deadline);
    const int n = result.rc;
    if (n <= 0) {
      const std::string detail = result.timedOut                   ? "took no data for longer than the send timeout"
                                 : result.sslError == SSL_ERROR_SSL ? tls::lastError()
                                 : result.savedErrno != 0           ? std::strerror(result.savedErrno)
                                                                    : "closed";
      failConnection(detail, result.timedOut ? SSL_ERROR_NONE : result.sslError);
    }
    sent += static_cast<size_t>(n);
  }
}

void ControlClient::sendFrame(const std::string& frame, Deadline deadline) {
  if (fd_ < 0) throw ConnectionError(strCat("the connection to the manager at ", address_, " is closed"));
  if (ssl_) return sendFrameTls(frame, deadline);
  size_t sent = 0;
  while (sent < frame.size()) {
    const int flags = MSG_NOSIGNAL | (deadline ? MSG_DONTWAIT : 0);
    const ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent, flags);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && deadline && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_, POLLOUT, 0};
      const int rc = ::poll(&p, 1, remainingMs(*deadline));
      if (rc < 0 && errno == EINTR) continue;
      if (rc == 0) {
        close();
        throw ConnectionError(strCat("the manager at ", address_, " took no data for ",
                                     "longer than the send timeout (not reading, or unreachable)"));
      }
      continue;  // writable, or an error the next send reports
    }
    if (n <= 0) {
      const int err = errno;
      close();
      throw ConnectionError(strCat("lost the connection to the manager at ", address_, ": ", std::strerror(err)));
    }
    sent += static_cast<size_t>(n);
  }
}

std::optional<Message> ControlClient::receive(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    if (auto message = decoder_.next()) return message;
    if (fd_ < 0) throw ConnectionError(strCat("the connection to the manager at ", address_, " is closed"));
    if (!readSome(deadline)) return std::nullopt;
  }
}

bool ControlClient::readSome(Clock::time_point deadline) {
  char buffer[16384];
  ssize_t n = 0;
  if (ssl_) {
    const TlsResult result = tlsCall([&] { return SSL_read(ssl_, buffer, sizeof(buffer)); }, deadline);
    if (result.timedOut) return false;
    n = result.rc;
    if (n <= 0 && result.sslError == SSL_ERROR_SSL) failConnection(tls::lastError(), result.sslError);
  } else {
    pollfd p{fd_, POLLIN, 0};
    const int rc = ::poll(&p, 1, remainingMs(deadline));
    if (rc < 0 && errno == EINTR) return true;
    if (rc == 0) return false;
    n = ::recv(fd_, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) return true;
  }
  if (n <= 0) {
    close();
    throw ConnectionError(strCat("the manager at ", address_, " closed the connection"));
  }
  answered_ = true;
  decoder_.feed(std::string_view(buffer, static_cast<size_t>(n)));
  return true;
}

void ControlClient::failConnection(const std::string& detail, int sslError) {
  std::string alert;
  if (ssl_ && clientAuth_ && clientAuth_->certificate && !answered_ && sslError != SSL_ERROR_NONE) {
    // The alert, if the manager sent one, came before anything else: it is
    // read now if this call did not (a write that failed first).
    alert = sslError == SSL_ERROR_SSL ? detail : std::string();  // the caller took it off OpenSSL's queue
    if (alert.empty()) {
      char scratch[256];
      ERR_clear_error();
      const int rc = SSL_read(ssl_, scratch, sizeof(scratch));
      if (rc <= 0 && SSL_get_error(ssl_, rc) == SSL_ERROR_SSL) alert = tls::lastError();
    }
  }
  close();
  if (alert.empty() || alert.find("alert") == std::string::npos) {
    throw ConnectionError(strCat("lost the connection to the manager at ", address_, ": ", detail));
  }
  throw AuthenticationError(strCat("the manager at ", address_, " refused this certificate after the TLS handshake (",
                                   alert, "): a certificate of an agent start it replaced, of a host it no longer "
                                   "has, or of another job; nothing was accepted"));
}

void notifyPreemption(const std::string& address, const std::string& credential, const std::string& host,
                      int64_t deadlineUnixMs, std::chrono::milliseconds timeout, bool isJobSecret) {
  auto client = ControlClient::connectAs(address, timeout, Hello{kVersion, credential, "notifier", host, -1, -1},
                                         isJobSecret ? "secret" : "");
  client.send(PreemptNotice{host, deadlineUnixMs}, timeout);
  const auto reply = client.receive(timeout);
  const auto* ack = reply ? std::get_if<Ack>(&*reply) : nullptr;
  if (!ack) {
    throw ConnectionError(strCat("the manager at ", address, " did not acknowledge within ",
                                 std::chrono::duration<double>(timeout).count(), " s"));
  }
  if (!ack->ok) throw ConnectionError(strCat("the manager refused the notice: ", ack->error));
}

}  // namespace varuna::proto
