// ControlListener: run_varuna's TCP listener for agents, workers and
// notify_manager_preempt. It accepts connections, holds each one until its
// first frame (capped and with a deadline: PendingConnections), checks that
// frame is a hello with the job's token and hands the connection to the
// daemon by role; anything else is refused (bounded, escaped text in the
// log). A failing accept backs off instead of spinning (EMFILE), freeing the
// oldest connection without a hello so that the next peer (perhaps a notice)
// gets a descriptor. docs/run_varuna.md ("Connections and limits").
// Besides (or, in the daemon's fake-clock tests, instead of) TCP it can
// listen on a LocalNetwork: those connections are in-memory streams that take
// the same path from admission on. Owned by ManagerDaemon::Impl; runs on the
// daemon's loop.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <boost/asio/ssl/context.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "varuna/common/protocol.h"
#include "varuna/common/time_util.h"
#include "varuna/manager/clock.h"
#include "varuna/manager/local_network.h"
#include "loop/event_log.h"
#include "loop/framed_connection.h"
#include "loop/handler_guard.h"
#include "loop/pending_connections.h"
#include "loop/rate_limiter.h"

namespace varuna {

class ControlListener {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  // A hello with the right token, by role; throws proto::ProtocolError to refuse it.
  using OnHello = std::function<void(const std::shared_ptr<FramedConnection>&, const proto::Hello&)>;
  // How many peers the manager waits for (agents starting, launched workers
  // without a hello): a burst of connections from them may exceed the cap.
  using ExpectedHellos = std::function<size_t()>;
  // The agent credential of a host (what its agent's, notifier's and workers'
  // credentials derive from): by default A(H) from the job's secret; the
  // daemon's answers a joined host's own (credentials.h).
  using AgentCredentialOf = std::function<std::string(const std::string& host)>;

  // Accept errors that mean "out of descriptors or memory" back off from
  // this, doubling, to kAcceptBackoffMax.
  static constexpr std::chrono::milliseconds kAcceptBackoffMin{50};
  static constexpr std::chrono::milliseconds kAcceptBackoffMax{1000};

  // `clock` (hello deadlines, the accept backoff's timer) outlives the listener.
  ControlListener(boost::asio::io_context& io, std::shared_ptr<HandlerGuard> guard, PendingLimits limits, Clock& clock);
  // Leaves the local network: a later dial must not reach a listener that is gone.
  ~ControlListener();
  ControlListener(const ControlListener&) = delete;
  ControlListener& operator=(const ControlListener&) = delete;

  // Binds and listens; no error, or why it could not.
  boost::system::error_code listen(const boost::asio::ip::tcp::endpoint& endpoint);
  uint16_t port() const { return port_; }
  // Before start(): accept from `network` too (it outlives the listener).
  void listenLocal(LocalNetwork& network) { local_ = &network; }
  // Starts accepting (TCP once listen() worked, the local network if any). `token` is the job's; `events` gets refusals and drop counts.
  void start(std::string token, EventLog& events, OnHello onHello, ExpectedHellos expected);
  // Before start(): TCP connections in plaintext, no TLS (run_varuna's
  // --insecure_plaintext_control, loopback development only).
  void setPlaintext(bool plaintext) { plaintext_ = plaintext; }
  // Before start(): agents, workers and notifiers prove who they are with
  // certificates of the job's CA `root` (certificate_credential.h), whose
  // host CAs `acceptHostCa` vouches for; pre-shared keys remain for joins and
  // the operator's secret only. Without it (and always over the local
  // network, a test seam), hellos carry credentials derived from the secret.
  void setCertificateAuthority(std::shared_ptr<const tls::CertificateCredential> root, tls::AcceptHostCa acceptHostCa) {
    ca_ = std::move(root);
    acceptHostCa_ = std::move(acceptHostCa);
  }
  // Before start(): where hellos' credentials come from (see AgentCredentialOf).
  void setAgentCredentials(AgentCredentialOf agentCredentialOf) { agentCredentialOf_ = std::move(agentCredentialOf); }
  // The tick: expires connections past their hello deadline, reports drops.
  void tick(TimePoint now);
  // The job stopped: no more accepts (connections already in go on).
  void stopAccepting();
  // Leaving the loop: no more accepts, pending connections closed.
  void close();

  size_t pendingConnections() const { return pending_.size(); }
  uint64_t acceptFailures() const { return acceptFailures_; }
  // Connections accepted over TCP and from the local network.
  uint64_t tcpAccepted() const { return tcpAccepted_; }
  uint64_t localAccepted() const { return localAccepted_; }
  nlohmann::json stats() const;  // state.json's "connections" (without the handler failures)

 private:
  void doAccept();
  void onAccept(const boost::system::error_code& ec, boost::asio::ip::tcp::socket socket);
  // An accepted connection, TCP or local: pending until its hello.
  void admit(std::unique_ptr<ByteStream> stream);
  // At once again for an error of that one connection, after a backoff for a
  // lack of descriptors or memory.
  void onAcceptFailed(const boost::system::error_code& ec);
  void onFirstMessage(const std::shared_ptr<FramedConnection>& connection, const proto::Message& message);
  // The first message as a hello whose version and credential hold (the
  // credential its role, host, rank and generation must carry: credentials.h);
  // throws proto::ProtocolError otherwise.
  // A hello over a connection whose certificate proved its identity carries
  // no credential: only its version counts (the identity is matched after).
  const proto::Hello& checkCredential(const proto::Message& message, bool certified) const;
  // The credential a hello of that role, host, rank and generation must
  // carry (the hello's, when its TLS identity is known); "" if none.
  std::string expectedCredential(const std::string& role, const std::string& host, int rank, int generation) const;
  // The TLS key of a PSK identity: the key of the credential it must hold.
  std::optional<std::string> pskKeyFor(const tls::PskIdentity& identity) const;
  // A connection closed before its hello: counted by why.
  void onClosedBeforeHello(const std::shared_ptr<FramedConnection>& connection);
  // A refused hello: the first few of a window in full, the rest counted
  // for reportDrops' summary (a flood of bad hellos must not fill the disk).
  void recordRefusal(const std::shared_ptr<FramedConnection>& connection, const std::string& reason);
  // Rate-limited summary of connections closed before their hello or refused.
  void reportDrops(TimePoint now);

  boost::asio::io_context& io_;
  std::shared_ptr<HandlerGuard> guard_;
  Clock& clock_;
  boost::asio::ip::tcp::acceptor acceptor_;
  std::unique_ptr<Timer> retryTimer_;
  uint16_t port_ = 0;
  LocalNetwork* local_ = nullptr;
  uint64_t tcpAccepted_ = 0, localAccepted_ = 0;
  std::string token_;  // the job's secret, from which every role's credential is derived
  AgentCredentialOf agentCredentialOf_;
  std::shared_ptr<const tls::CertificateCredential> ca_;
  tls::AcceptHostCa acceptHostCa_;
  EventLog* events_ = nullptr;
  OnHello onHello_;
  ExpectedHellos expected_;
  bool closed_ = false;
  DoublingBackoff backoff_{kAcceptBackoffMin, kAcceptBackoffMax};  // reset when an accept works
  uint64_t acceptFailures_ = 0;
  RateLimiter failureLog_{std::chrono::seconds(10), 1};
  PendingConnections pending_;      // before their hello: capped, with a deadline
  bool plaintext_ = false;
  std::unique_ptr<boost::asio::ssl::context> tls_;  // made by start() unless plaintext_
  uint64_t closedBeforeHello_ = 0;  // by the peer, or for a bad or oversized first frame
  uint64_t unauthenticated_ = 0;    // failed the TLS handshake (no or a wrong credential)
  uint64_t refused_ = 0;             // hellos refused (token, version, malformed)
  std::string lastRefusal_;          // "<reason> (from <peer>)", for the summary
  // Refusals written in full: to the log 3 per 10 s, to the event log 3 a minute.
  RateLimiter refusalLog_{std::chrono::seconds(10), 3};
  RateLimiter refusalEvents_{std::chrono::seconds(60), 3};
  struct DropCounts {
    uint64_t closed = 0, expired = 0, evicted = 0, refused = 0, unauthenticated = 0;
    bool operator==(const DropCounts&) const = default;
  };
  DropCounts dropsLogged_, dropsRecorded_;  // totals when last logged / written to the event log
  TimePoint dropsLoggedAt_{}, dropsRecordedAt_{};
};

}  // namespace varuna
