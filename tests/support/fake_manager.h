// FakeManager: a blocking stand-in for run_varuna's control port in tests of
// the processes that dial it (the worker's ManagerLink, varuna_agent). It
// listens on 127.0.0.1:0; the test accepts connections and speaks the control
// protocol (protocol.h) on them frame by frame, with deadlines, from its own
// thread. No Asio, no threads of its own: safe to use around fork().
// Plaintext by default: while one lives, the test process's environment says
// so (tls::kPlaintextEnv), for the ManagerLinks it runs; an agent it starts
// needs --insecure_plaintext_control. Given a key function, it is TLS, as
// run_varuna is.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "varuna/common/control_client.h"

namespace varuna::test {

// One accepted connection: a ControlClient on the accepted socket, its
// failures turned into return values. Closes on destruction.
class FakePeer {
 public:
  explicit FakePeer(proto::ControlClient client) : client_(std::move(client)) {}
  // The identity the peer proved (TLS), nullopt in plaintext.
  std::optional<tls::PskIdentity> identity() const { return client_.peerIdentity(); }

  // False if the peer has gone.
  bool send(const proto::Message& message);
  // The next message within `timeout`; nullopt on timeout or once the peer
  // closed (closed() says which). Throws ProtocolError on a bad frame.
  std::optional<proto::Message> receive(std::chrono::milliseconds timeout);
  bool closed() const { return !client_.connected(); }
  void close() { client_.close(); }
  // Plays a live manager for `duration`: sends a manager heartbeat
  // (Heartbeat{-1, 0}) every `interval`, and reads and drops what the peer
  // sends meanwhile (the waits between heartbeats are those reads). False as
  // soon as the peer has gone.
  bool sendHeartbeatsFor(std::chrono::milliseconds duration, std::chrono::milliseconds interval);

 private:
  proto::ControlClient client_;
};

class FakeManager {
 public:
  FakeManager();  // listening on 127.0.0.1, a free port, plaintext
  // TLS: peers must prove the key `keyFor` gives their identity.
  explicit FakeManager(tls::KeyForIdentity keyFor);
  // TLS with the job's CA `ca` (certificate_credential.h), as run_varuna
  // has it: its manager certificate, and clients' chains checked against
  // `ca` (any listed host's CA, as a manager's that knows no joins).
  explicit FakeManager(std::shared_ptr<const tls::CertificateCredential> ca);
  ~FakeManager();
  FakeManager(const FakeManager&) = delete;

  std::string address() const;  // "127.0.0.1:<port>"
  int port() const { return port_; }
  // The next connection within `timeout` (its TLS handshake done); nullopt
  // when none came or its handshake failed (lastRefusal() says why).
  std::optional<FakePeer> accept(std::chrono::milliseconds timeout);
  const std::string& lastRefusal() const { return lastRefusal_; }
  // The next connection within `timeout`, closed at once, before any TLS:
  // a connection that fails under its peer. False when none came.
  bool acceptAndDrop(std::chrono::milliseconds timeout);
  // Stops listening: from now on connections to the port are refused.
  void close();

 private:
  int fd_ = -1;
  int port_ = 0;
  tls::KeyForIdentity keyFor_;  // empty: plaintext (unless ca_)
  std::shared_ptr<const tls::CertificateCredential> ca_, managerCertificate_;
  std::string lastRefusal_;
};

}  // namespace varuna::test
