#include "daemon/peer_router.h"

#include "varuna/common/log.h"

namespace varuna {

void PeerRouter::route(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello,
                       TimePoint now) {
  if (hello.role == "agent") {
    sink_.agentHello(connection, hello);
  } else if (hello.role == "worker") {
    onWorkerHello(connection, hello);
  } else if (hello.role == "notifier") {
    onNotifierHello(connection, now);
  } else {
    throw proto::ProtocolError(strCat("unknown role '", hello.role, "'"));
  }
}

void PeerRouter::onWorkerHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
  if (hello.generation != sink_.runningGeneration() || !sink_.expectsWorker(hello.rank)) {
    return orderOut(connection, hello);
  }
  const int rank = hello.rank;
  const bool all = sink_.workerConnected(rank, connection);
  connection->start([&sink = sink_, rank](const proto::Message& m) { sink.workerMessage(rank, m); },
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

void PeerRouter::orderOut(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
  // A worker of a generation that is over or that this manager never
  // launched (one an earlier manager left, or one written off as hung or
  // lost): ordered out, not merely refused, so it stops training into the
  // store at once.
  const int generation = sink_.runningGeneration();
  const std::string reason = strCat("generation ", hello.generation, " is over: this manager expects no rank ",
                                    hello.rank, " of it (current generation ", generation, ")");
  const std::string host = proto::boundedText(hello.host, proto::kMaxLoggedPeerTextBytes);
  log::warn("ordering rank ", hello.rank, " of generation ", hello.generation, " on ", host, " (", connection->peer(),
            ") to exit: ", reason);
  events_.write("stale_worker", {{"generation", hello.generation}, {"rank", hello.rank}, {"host", host},
                                 {"peer", connection->peer()}});
  connection->send(proto::ExitNow{hello.generation, reason});
  connection->closeAfterSending("stale worker");
}

void PeerRouter::onNotifierHello(const std::shared_ptr<FramedConnection>& connection, TimePoint now) {
  std::weak_ptr<FramedConnection> weak = connection;
  notifiers_.emplace_back(weak, now);
  connection->start(
      [&sink = sink_, weak](const proto::Message& m) {
        auto c = weak.lock();
        if (!c) return;
        if (const auto* notice = std::get_if<proto::PreemptNotice>(&m)) return sink.preemptNotice(c, *notice);
        c->send(proto::Ack{false, "expected a preempt notice"});
        c->closeAfterSending("bad notifier");
      },
      [](const std::string&) {});
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
