#include "daemon/control_listener.h"

#include <fcntl.h>

#include "varuna/common/certificate_credential.h"
#include "varuna/common/log.h"
#include "varuna/common/secrets.h"
#include "varuna/manager/credentials.h"
#include "loop/tcp_stream.h"
#include "loop/tls_stream.h"

namespace varuna {
namespace {

namespace asio = boost::asio;

}  // namespace

ControlListener::ControlListener(asio::io_context& io, std::shared_ptr<HandlerGuard> guard, PendingLimits limits,
                                 Clock& clock)
    : io_(io), guard_(std::move(guard)), clock_(clock), acceptor_(io), retryTimer_(clock.makeTimer(io)), pending_(limits) {}

ControlListener::~ControlListener() {
  if (local_) local_->stopListening();
}

boost::system::error_code ControlListener::listen(const asio::ip::tcp::endpoint& endpoint) {
  boost::system::error_code ec;
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(1024, ec);
  if (ec) return ec;
  ::fcntl(acceptor_.native_handle(), F_SETFD, FD_CLOEXEC);
  port_ = acceptor_.local_endpoint().port();
  return {};
}

void ControlListener::start(std::string token, EventLog& events, OnHello onHello, ExpectedHellos expected) {
  token_ = std::move(token);
  events_ = &events;
  onHello_ = std::move(onHello);
  expected_ = std::move(expected);
  if (!plaintext_) {
    tls_ = makeControlTlsContext(true);
    if (ca_) tls::useServerCertificate(tls_->native_handle(), ca_->issue({"manager", "", -1, -1, ""}, false));
  }
  if (acceptor_.is_open()) doAccept();  // not listening on TCP: an accept would fail at once, forever
  if (local_) {
    local_->listen(guard_->wrap("accepting a local connection", [this](std::unique_ptr<ByteStream> stream) {
      if (closed_) return;
      ++localAccepted_;
      admit(std::move(stream));
    }));
  }
}

void ControlListener::stopAccepting() {
  closed_ = true;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  retryTimer_->cancel();
  if (local_) local_->stopListening();
}

void ControlListener::close() {
  stopAccepting();
  pending_.closeAll("manager exiting");
}

void ControlListener::doAccept() {
  acceptor_.async_accept(guard_->wrap("accepting a connection", [this](const boost::system::error_code& ec,
                                                                      asio::ip::tcp::socket socket) {
    onAccept(ec, std::move(socket));
  }));
}

void ControlListener::onAccept(const boost::system::error_code& ec, asio::ip::tcp::socket socket) {
  if (ec == asio::error::operation_aborted || closed_) return;
  if (ec) return onAcceptFailed(ec);
  backoff_.reset();
  ++tcpAccepted_;
  // Whatever goes wrong with this one connection, the next accept is armed.
  guard_->run("admitting a connection", [&] {
    ::fcntl(socket.native_handle(), F_SETFD, FD_CLOEXEC);
    if (!tls_) return admit(std::make_unique<TcpStream>(std::move(socket)));
    admit(TlsStream::server(
        std::move(socket), *tls_, [this](const tls::PskIdentity& identity) { return pskKeyFor(identity); }, ca_,
        acceptHostCa_));
  });
  doAccept();
}

void ControlListener::admit(std::unique_ptr<ByteStream> stream) {
  guard_->run("admitting a connection", [&] {
    auto connection = std::make_shared<FramedConnection>(std::move(stream));
    connection->setGuard(guard_);
    // At the cap, the peers this manager is waiting for raise it (a launch's
    // burst of workers); counted only then: it walks every worker.
    const size_t expected = pending_.size() >= pending_.limits().maxPending ? expected_() : 0;
    pending_.add(connection, clock_.now(), expected);  // may close the oldest pending one
    std::weak_ptr<FramedConnection> weak = connection;
    connection->start(
        [this, weak](const proto::Message& m) {
          if (auto c = weak.lock()) onFirstMessage(c, m);
        },
        [this, weak](const std::string&) {
          // Closed before a hello: by the peer, or for a bad or oversized
          // first frame (the deadline and the cap are counted by pending_).
          if (auto c = weak.lock()) onClosedBeforeHello(c);
        });
  });
}

void ControlListener::onClosedBeforeHello(const std::shared_ptr<FramedConnection>& connection) {
  const size_t before = pending_.size();
  pending_.erase(connection);
  if (pending_.size() == before) return;  // expired or evicted: counted by pending_
  const std::string failure = connection->stream().handshakeFailure();
  if (failure.empty()) {
    ++closedBeforeHello_;
    return;
  }
  ++unauthenticated_;  // summarised by reportDrops, never a line each
  lastRefusal_ = strCat("TLS handshake failed: ", failure, " (from ", connection->peer(), ")");
}

void ControlListener::onAcceptFailed(const boost::system::error_code& ec) {
  ++acceptFailures_;
  const int code = ec.value();
  // Errors of the one connection being accepted (Linux hands pending network
  // errors to accept, see accept(2)): the next accept can work at once.
  const bool thatConnection = ec == asio::error::connection_aborted || code == EPROTO || code == ENETDOWN ||
                              code == ENOPROTOOPT || code == EHOSTDOWN || code == ENONET || code == EHOSTUNREACH ||
                              code == EOPNOTSUPP || code == ENETUNREACH || code == EPERM;
  if (thatConnection) {
    doAccept();
    return;
  }
  // Out of descriptors (EMFILE, ENFILE) or memory (ENOBUFS, ENOMEM), or
  // anything else that would fail again at once: re-arming now would spin.
  // Back off, and free a descriptor from the oldest connection that has not
  // said hello, so that the next peer (perhaps a notice) gets one.
  const auto wait = backoff_.next();
  const bool shed = (code == EMFILE || code == ENFILE) && pending_.shedOldest("out of file descriptors");
  uint64_t suppressed = 0;
  if (failureLog_.allow(clock_.now(), &suppressed)) {
    log::error("accepting a connection failed: ", ec.message(),
               shed ? " (closed the oldest connection without a hello)" : "", "; retrying in ", wait.count(), " ms",
               suppressed ? strCat(" (", suppressed + 1, " failures since the last line)") : std::string(),
               code == EMFILE ? strCat("; the open-file limit is too low for the ", pending_.size(),
                                       " pending and the job's connections (docs/run_varuna.md)")
                              : std::string());
  }
  retryTimer_->expireAfter(wait, guard_->wrap("retrying accept", [this] {
    if (closed_) return;
    doAccept();
  }));
}

void ControlListener::onFirstMessage(const std::shared_ptr<FramedConnection>& connection,
                                     const proto::Message& message) {
  pending_.erase(connection);
  try {
    const auto identity = connection->stream().authenticatedIdentity();
    const auto& hello = checkCredential(message, identity && identity->certified);
    if (identity && !tls::matches(*identity, hello)) {
      throw proto::ProtocolError(strCat("a hello as ", proto::boundedText(hello.role, 64), " of '",
                                        proto::boundedText(hello.host, proto::kMaxLoggedPeerTextBytes), "' rank ",
                                        hello.rank, " generation ", hello.generation,
                                        " over a connection authenticated as ", identity->role, " of '",
                                        proto::boundedText(identity->host, proto::kMaxLoggedPeerTextBytes), "' rank ",
                                        identity->rank, " generation ", identity->generation));
    }
    onHello_(connection, hello);
  } catch (const proto::ProtocolError& e) {
    // What a refused peer sent is its own: bounded and valid UTF-8 before it
    // reaches the log and the event log (checkHello bounds the host it quotes).
    const std::string reason = proto::boundedText(e.what(), 2 * proto::kMaxLoggedPeerTextBytes);
    recordRefusal(connection, reason);
    connection->send(proto::Ack{false, reason});
    connection->closeAfterSending("refused");
  }
}

void ControlListener::recordRefusal(const std::shared_ptr<FramedConnection>& connection, const std::string& reason) {
  ++refused_;
  lastRefusal_ = strCat(reason, " (from ", connection->peer(), ")");
  const TimePoint now = clock_.now();
  if (refusalLog_.allow(now)) log::warn("refused a connection from ", connection->peer(), ": ", reason);
  if (refusalEvents_.allow(now)) events_->write("connection_refused", {{"peer", connection->peer()}, {"reason", reason}});
}

const proto::Hello& ControlListener::checkCredential(const proto::Message& message, bool certified) const {
  const auto* hello = std::get_if<proto::Hello>(&message);
  if (!hello) return proto::checkHello(message, token_);  // refuses it, naming what came instead
  if (certified) {
    // The certificate was the credential: a hello over it carries none.
    if (!hello->token.empty()) throw proto::ProtocolError("a hello with a credential over a certificate's connection");
    return proto::checkHello(message, hello->token);  // the version
  }
  std::string expected;
  if (hello->role == "join") {
    // A host that joins by itself: the join credential (no host in it) and
    // its expiry, before anything else of the hello counts.
    const auto check = credentials::checkJoin(token_, hello->token, unixSecondsNow());
    if (check != credentials::JoinCheck::kValid) {
      throw proto::ProtocolError(strCat("join of host '", proto::boundedText(hello->host, proto::kMaxLoggedPeerTextBytes),
                                        "' refused: ", credentials::toString(check)));
    }
    expected = hello->token;
  } else if (hello->role == "notifier" && constantTimeEquals(hello->token, token_)) {
    expected = token_;  // the operator's notifier (--token_file): any host
  } else if (ca_) {
    // Every other role proves itself with a certificate where the job has a CA.
    throw proto::ProtocolError(strCat("a hello as ", proto::boundedText(hello->role, 64),
                                      " without a certificate of the job's CA"));
  } else {
    expected = expectedCredential(hello->role, hello->host, hello->rank, hello->generation);
  }
  if (expected.empty()) {
    throw proto::ProtocolError(strCat("unknown role '", proto::boundedText(hello->role, 64), "'"));
  }
  return proto::checkHello(message, expected);  // the version, then the credential in constant time
}

std::string ControlListener::expectedCredential(const std::string& role, const std::string& host, int rank,
                                                int generation) const {
  const std::string agentCredential = agentCredentialOf_ ? agentCredentialOf_(host) : credentials::agent(token_, host);
  return credentials::expected(agentCredential, role, rank, generation);
}

std::optional<std::string> ControlListener::pskKeyFor(const tls::PskIdentity& identity) const {
  if (identity.role == "join") {
    // "vj1.<expiry>": the join credential of that expiry (checked, with the
    // clock, at the hello).
    const auto expiry = credentials::joinExpiry(identity.hint + ".x");
    if (expiry < 0) return std::nullopt;
    return tls::pskKey(credentials::join(token_, expiry));
  }
  if (identity.role == "notifier" && identity.hint == "secret") return tls::pskKey(token_);
  if (ca_) return std::nullopt;  // the job has a CA: every other role proves itself with a certificate
  const std::string credential = expectedCredential(identity.role, identity.host, identity.rank, identity.generation);
  if (credential.empty()) return std::nullopt;
  return tls::pskKey(credential);
}

void ControlListener::tick(TimePoint now) {
  pending_.expire(now);
  reportDrops(now);
}

void ControlListener::reportDrops(TimePoint now) {
  const DropCounts totals{closedBeforeHello_, pending_.expired(), pending_.evicted(), refused_, unauthenticated_};
  const auto limits = pending_.limits();
  if (totals != dropsLogged_ && now - dropsLoggedAt_ >= std::chrono::seconds(10)) {
    log::warn("connections closed before their hello since the last report: ", totals.expired - dropsLogged_.expired,
              " sent none within ", limits.helloDeadline.count(), " ms, ", totals.evicted - dropsLogged_.evicted,
              " were the oldest of more than ", limits.maxPending, " waiting, ", totals.closed - dropsLogged_.closed,
              " closed by the peer or for a bad first frame, ", totals.unauthenticated - dropsLogged_.unauthenticated,
              " failed the TLS handshake, ", totals.refused - dropsLogged_.refused, " hellos refused",
              totals.refused != dropsLogged_.refused || totals.unauthenticated != dropsLogged_.unauthenticated
                  ? strCat(", the last: ", lastRefusal_)
                  : "",
              " (", pending_.size(), " waiting now)");
    dropsLogged_ = totals;
    dropsLoggedAt_ = now;
  }
  // The event log gets one line a minute at most: a flood must not fill it.
  if (totals != dropsRecorded_ && now - dropsRecordedAt_ >= std::chrono::seconds(60)) {
    nlohmann::json counts = {{"no_hello_in_time", totals.expired - dropsRecorded_.expired},
                             {"over_the_cap", totals.evicted - dropsRecorded_.evicted},
                             {"closed_before_hello", totals.closed - dropsRecorded_.closed},
                             {"refused", totals.refused - dropsRecorded_.refused},
                             {"unauthenticated", totals.unauthenticated - dropsRecorded_.unauthenticated}};
    // "refused" counts those written in full (connection_refused) too.
    if (totals.refused != dropsRecorded_.refused || totals.unauthenticated != dropsRecorded_.unauthenticated) {
      counts["last_refusal"] = lastRefusal_;
    }
    events_->write("connections_dropped", counts);
    dropsRecorded_ = totals;
    dropsRecordedAt_ = now;
  }
}

nlohmann::json ControlListener::stats() const {
  return {{"pending", pending_.size()},
          {"closed_before_hello", closedBeforeHello_},
          {"no_hello_in_time", pending_.expired()},
          {"over_the_cap", pending_.evicted()},
          {"refused", refused_},
          {"unauthenticated", unauthenticated_},
          {"accept_failures", acceptFailures_}};
}

}  // namespace varuna
