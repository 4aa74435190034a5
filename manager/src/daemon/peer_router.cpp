#include "daemon/peer_router.h"

#include <optional>

#include "varuna/common/log.h"
#include "varuna/common/secrets.h"

namespace varuna {
namespace {

// The rank a worker's frame speaks for, if it names one.
std::optional<int> rankClaimed(const proto::Message& message) {
  if (const auto* m = std::get_if<proto::StepReport>(&message)) return m->rank;
  if (const auto* m = std::get_if<proto::CheckpointFailed>(&message)) return m->rank;
  if (const auto* m = std::get_if<proto::SalvageReady>(&message)) return m->rank;
  return std::nullopt;
}

}  // namespace

void PeerRouter::route(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello,
                       TimePoint now) {
  if (hello.role == "agent") {
    sink_.agentHello(connection, hello);
  } else if (hello.role == "join") {
    sink_.joinHello(connection, hello);  // the listener checked the join credential
  } else if (hello.role == "worker") {
    onWorkerHello(connection, hello);
  } else if (hello.role == "notifier") {
    onNotifierHello(connection, hello, now);
  } else {
    throw proto::ProtocolError(strCat("unknown role '", hello.role, "'"));
  }
}

void PeerRouter::onWorkerHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
  // A worker whose host CA the job revoked (an earlier start of its agent,
  // a join that is over) is a straggler whatever generation it names.
  const auto identity = connection->stream().authenticatedIdentity();
  if ((identity && identity->revoked) || hello.generation != sink_.runningGeneration() ||
      !sink_.expectsWorker(hello.rank)) {
    return orderOut(connection, hello, identity && identity->revoked);
  }
  if (const std::string placed = sink_.hostOf(hello.rank); placed != hello.host) {
    throw proto::ProtocolError(strCat("rank ", hello.rank, " of generation ", hello.generation, " runs on ", placed,
                                      ", not on '", proto::boundedText(hello.host, proto::kMaxLoggedPeerTextBytes),
                                      "'"));
  }
  const int rank = hello.rank;
  const bool all = sink_.workerConnected(rank, connection);
  std::weak_ptr<FramedConnection> weak = connection;
  connection->start([&sink = sink_, refusals = refusals_, weak, rank](const proto::Message& m) {
                      if (const auto claimed = rankClaimed(m); claimed && *claimed != rank) {
                        if (auto c = weak.lock()) {
                          refusals->record(c->peer(), strCat("rank ", rank, " sent a ", proto::typeName(m),
                                                             " for rank ", *claimed));
                        }
                        return;
                      }
                      sink.workerMessage(rank, m);
                    },
                    [rank](const std::string& reason) {
                      // Exits are reported by the agents. A worker that exits
                      // (_Exit) with a pong it has not read yet resets the
                      // connection instead of closing it: that is an exit too.
                      const bool exited = reason == "closed by peer" || reason == "Connection reset by peer";
                      if (!exited) log::warn("connection of rank ", rank, " closed: ", reason);
                    });
  connection->send(proto::Welcome{hello.generation, options_.lostManagerGrace.count(), options_.salvageTimeout.count()});
  if (all) sink_.allWorkersConnected();
}

void PeerRouter::orderOut(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello,
                          bool revoked) {
  // A worker of a generation that is over or that this manager never
  // launched (one an earlier manager left, or one written off as hung or
  // lost), or one started by an agent whose certificates are revoked:
  // ordered out, not merely refused, so it stops training into the store
  // at once.
  const int generation = sink_.runningGeneration();
  const std::string reason =
      revoked ? strCat("the agent that started rank ", hello.rank, " of generation ", hello.generation,
                       " was replaced: its certificates are revoked (current generation ", generation, ")")
              : strCat("generation ", hello.generation, " is over: this manager expects no rank ", hello.rank,
                       " of it (current generation ", generation, ")");
  const std::string host = proto::boundedText(hello.host, proto::kMaxLoggedPeerTextBytes);
  log::warn("ordering rank ", hello.rank, " of generation ", hello.generation, " on ", host, " (", connection->peer(),
            ") to exit: ", reason);
  events_.write("stale_worker", {{"generation", hello.generation}, {"rank", hello.rank}, {"host", host},
                                 {"peer", connection->peer()}, {"revoked", revoked}});
  connection->send(proto::ExitNow{hello.generation, reason});
  connection->closeAfterSending("stale worker");
}

void PeerRouter::onNotifierHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello,
                                 TimePoint now) {
  std::weak_ptr<FramedConnection> weak = connection;
  notifiers_.emplace_back(weak, now);
  // The operator's notifier holds the job's secret; a host's, that host's credential.
  const bool anyHost = !options_.jobSecret.empty() && constantTimeEquals(hello.token, options_.jobSecret);
  connection->start(
      [&sink = sink_, refusals = refusals_, weak, anyHost, host = hello.host](const proto::Message& m) {
        auto c = weak.lock();
        if (!c) return;
        const auto* notice = std::get_if<proto::PreemptNotice>(&m);
        if (notice && (anyHost || notice->host == host)) return sink.preemptNotice(c, *notice);
        std::string why = "expected a preempt notice";
        if (notice) {
          why = strCat("the notifier of ", proto::boundedText(host, proto::kMaxLoggedPeerTextBytes),
                       " may announce only that host, not '",
                       proto::boundedText(notice->host, proto::kMaxLoggedPeerTextBytes), "'");
          refusals->record(c->peer(), why);
        }
        c->send(proto::Ack{false, why});
        c->closeAfterSending("bad notifier");
      },
      [](const std::string&) {});
}

void PeerRouter::Refusals::record(const std::string& peer, const std::string& why) {
  ++count;
  if (!limit.allow(std::chrono::steady_clock::now())) return;
  log::warn("refused a message from ", peer, ": ", why, " (", count, " refused so far)");
  events.write("message_refused", {{"peer", peer}, {"reason", why}, {"refused", count}});
}

void PeerRouter::closeIdleNotifiers(TimePoint now) {
  // Oldest first: the front is the first to reach its deadline. A notifier
  // that sent its notice was answered and closes itself: only dropped here.
  while (!notifiers_.empty()) {
    auto& [weak, since] = notifiers_.front();
    auto connection = weak.lock();
    if (connection && connection->open()) {
      if (now - since < options_.notifierDeadline) break;
      connection->close(strCat("a notifier that sent no notice within ", options_.notifierDeadline.count(), " ms"));
    }
    notifiers_.pop_front();
  }
}

}  // namespace varuna
