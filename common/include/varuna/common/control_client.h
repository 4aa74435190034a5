// ControlClient: a blocking TCP connection to the manager speaking the control
// protocol (protocol.h), inside TLS 1.3 with the peer's credential as the
// pre-shared key (control_tls.h) unless tls::plaintextRequested(). Used where an event loop would be overkill: the
// worker's reporter thread and notify_manager_preempt. One thread uses a
// client at a time; it is movable, not copyable, and closes on destruction.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "varuna/common/control_tls.h"
#include "varuna/common/protocol.h"

struct ssl_st;

namespace varuna::proto {

// The manager cannot be reached, or the connection broke.
class ConnectionError : public Error {
 public:
  explicit ConnectionError(const std::string& what) : Error(what, 1) {}
};

// "host:port" or "[v6addr]:port" -> (host, port). Throws ConfigError naming `what`.
std::pair<std::string, int> splitHostPort(const std::string& address, const std::string& what);

class ControlClient {
 public:
  // Connects within `timeout`. Throws Error saying which address failed and why.
  // Only TCP: the caller makes it TLS (connectAs), or hands the socket to
  // Asio (release()) which does.
  static ControlClient connect(const std::string& address, std::chrono::milliseconds timeout);
  // Connects, proves `hello`'s credential in a TLS handshake whose identity
  // names what `hello` claims (`pskHint`: see tls::PskIdentity), and sends
  // `hello`, all within `timeout`. Throws ConnectionError; AuthenticationError
  // when the handshake fails (a wrong credential, or not the job's manager).
  static ControlClient connectAs(const std::string& address, std::chrono::milliseconds timeout,
                                 const proto::Hello& hello, const std::string& pskHint = {});
  // Connects and completes a TLS handshake presenting `auth`, sending nothing
  // yet (connectAs's first half; tests use it to claim one thing and say another).
  static ControlClient connectTls(const std::string& address, std::chrono::milliseconds timeout, tls::ClientAuth auth);
  // The server's side, for test stand-ins of run_varuna: a TLS handshake on
  // an accepted socket within `timeout`, keys from `keyFor`. Throws
  // AuthenticationError when the peer cannot prove an identity.
  static ControlClient acceptTls(int fd, std::string address, tls::KeyForIdentity keyFor,
                                 std::chrono::milliseconds timeout);
  // The same presenting `manager` (the manager's certificate) and checking
  // client certificates against `server.ca`, as run_varuna does.
  static ControlClient acceptTls(int fd, std::string address, tls::ServerAuth server,
                                 std::shared_ptr<const tls::CertificateCredential> manager,
                                 std::chrono::milliseconds timeout);
  // Takes over a connected socket (the inverse of release()), e.g. one a
  // listener accepted; `address` names the peer in errors.
  static ControlClient adopt(int fd, std::string address) { return ControlClient(fd, std::move(address)); }

  ControlClient(ControlClient&& other) noexcept;
  ControlClient& operator=(ControlClient&& other) noexcept;
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;
  ~ControlClient();

  // Throws Error when the connection is gone.
  void send(const Message& message);
  // The same, but gives up after `timeout` without the frame fully handed to
  // the kernel (the peer stopped reading, or a partition filled the send
  // buffer): the connection is closed (a frame may be half sent) and
  // ConnectionError thrown. A thread that must stay responsive never blocks
  // longer than that.
  void send(const Message& message, std::chrono::milliseconds timeout);
  // The next message, or nullopt if none arrived within `timeout`. Throws
  // Error when the manager closed the connection.
  std::optional<Message> receive(std::chrono::milliseconds timeout);
  bool connected() const { return fd_ >= 0; }
  void close();
  // Gives up ownership of a plain TCP socket (e.g. to an Asio socket); the
  // client is closed after. A TLS connection cannot be handed over: throws.
  int release();
  // The identity a TLS peer proved (acceptTls), nullopt on plain TCP.
  std::optional<tls::PskIdentity> peerIdentity() const;

 private:
  using Deadline = std::optional<std::chrono::steady_clock::time_point>;
  ControlClient(int fd, std::string address)
      : fd_(fd), address_(std::move(address)), serverAuth_(std::make_unique<tls::ServerAuth>()) {}
  // One OpenSSL call's outcome: rc > 0 worked; else SSL_get_error's answer,
  // whether the deadline passed, and errno as the call left it.
  struct TlsResult {
    int rc = 0;
    int sslError = 0;
    bool timedOut = false;
    int savedErrno = 0;
  };
  void startTls(bool server, Deadline deadline);
  // Closes and throws: AuthenticationError where the other end refused in
  // TLS (or proved no key), ConnectionError for a timeout, reset or EOF.
  [[noreturn]] void failHandshake(bool server, const TlsResult& result);
  // Runs one OpenSSL call until it completes or `deadline` passes, waiting
  // for the socket as OpenSSL asks.
  template <typename Call>
  TlsResult tlsCall(Call call, Deadline deadline);
  void sendFrame(const std::string& frame, Deadline deadline);
  void sendFrameTls(const std::string& frame, Deadline deadline);
  // Appends what arrived to the decoder; false when nothing did by `deadline`.
  bool readSome(std::chrono::steady_clock::time_point deadline);
  // A connection failed after the handshake (`detail`): closes and throws.
  // In TLS 1.3 a client's handshake is over before the manager has checked
  // its certificate, so a client holding one that has heard nothing yet
  // looks for the manager's alert: if there is one, the certificate was
  // refused (AuthenticationError); otherwise the connection was lost.
  [[noreturn]] void failConnection(const std::string& detail, int sslError);
  int fd_ = -1;
  bool answered_ = false;  // something came from the other end after the handshake
  std::string address_;
  FrameDecoder decoder_;
  ssl_st* ssl_ = nullptr;
  // Where OpenSSL's callbacks find the keys (stable addresses across moves).
  std::unique_ptr<tls::ClientAuth> clientAuth_;
  std::unique_ptr<tls::ServerAuth> serverAuth_;
  std::shared_ptr<const tls::CertificateCredential> managerCertificate_;  // a server's, if it presents one
};

// The TLS handshake failed: this peer's credential is not what the other end
// expects (or the other end is not the job's manager).
class AuthenticationError : public ConnectionError {
 public:
  using ConnectionError::ConnectionError;
};

// Tells the manager at `address` that `host` will be taken at
// `deadlineUnixMs` (0: unknown), as a notifier holding `credential` (the
// host's notifier credential, or the job's secret), and waits for the
// acknowledgement. Throws ConnectionError when the manager cannot be reached
// within `timeout`, does not answer, or refuses the notice (its reason).
// `isJobSecret`: the credential is the job's secret (the operator's), not N(host).
// notify_manager_preempt, and an agent told by its scheduler (SIGTERM).
void notifyPreemption(const std::string& address, const std::string& credential, const std::string& host,
                      int64_t deadlineUnixMs, std::chrono::milliseconds timeout, bool isJobSecret = false);

}  // namespace varuna::proto
