// ManagerDaemon's part in a salvage (docs/salvage.md): it passes the
// survivors' reports to the controller and carries out its salvage actions
// over the workers' own connections (their agents play no part: a salvage
// must not depend on a host's agent being responsive). The decisions are the
// MorphController's (morph_controller_salvage.cpp).
#include "varuna/common/log.h"
#include "daemon/manager_daemon_impl.h"

namespace varuna {
namespace {

using nlohmann::json;

}  // namespace

void ManagerDaemon::Impl::onSalvageReady(int rank, const proto::SalvageReady& ready) {
  if (ready.generation != controller_->generation()) return;
  log::info("rank ", rank, " (stage ", ready.stage, ", replica ", ready.replica, ") lost a peer and holds ",
            ready.step >= 0 ? strCat("step ", ready.step) : std::string("no whole step"),
            ready.finishableStep >= 0 ? strCat(" (and can finish step ", ready.finishableStep, ")") : std::string());
  json fields = {{"generation", ready.generation}, {"rank", rank}, {"stage", ready.stage},
                 {"replica", ready.replica}, {"step", ready.step}};
  if (ready.finishableStep >= 0) fields["finishable_step"] = ready.finishableStep;
  // A rank that holds no whole step may still hold the exchange result of one.
  if (!ready.exchange.empty() && ready.exchangeStep >= 0 && ready.exchangeStep != ready.step) {
    fields["exchange_step"] = ready.exchangeStep;
  }
  events_->write("salvage_report", fields);
  apply(controller_->salvageReady(
      SalvageReport{rank, ready.stage, ready.step, {}, ready.finishableStep, ready.exchange, ready.exchangeStep},
      clock_.now()));
}

void ManagerDaemon::Impl::doSalvageStop(const action::SalvageStop& stop) {
  morph_.begin(stop.reason, JobMetrics::MorphCause::kOther, clock_.now(), phase_ != DaemonPhase::kStopping);
  const int generation = controller_->generation();
  log::warn("salvaging generation ", generation, ": ", stop.reason, "; asking the survivors which step they hold");
  events_->write("salvage_started", {{"generation", generation}, {"reason", stop.reason},
                                     {"reached_step", reachedStep_}});
  for (const auto& [rank, worker] : workers_.all()) {
    if (worker.connection) worker.connection->send(proto::SalvageStop{generation, stop.reason});
  }
}

void ManagerDaemon::Impl::doSalvageWrite(const action::SalvageWrite& write) {
  const int generation = controller_->generation();
  const int writers = static_cast<int>(write.writers.size());
  log::info("salvage: step ", write.step, " is held by every stage; writers (by stage): ",
            json(write.writers).dump(),
            write.finishing.empty() ? std::string()
                                    : strCat("; finishing it from the relayed exchange: ", json(write.finishing).dump()));
  events_->write("salvage_writing", {{"generation", generation}, {"step", write.step}, {"writers", write.writers},
                                     {"finishing", write.finishing},
                                     {"steps_lost", std::max<int64_t>(0, reachedStep_ - write.step)}});
  salvageStep_ = write.step;
  std::set<int> chosen(write.writers.begin(), write.writers.end());
  for (int index = 0; index < writers; ++index) {
    if (auto* worker = workers_.find(write.writers[index]); worker && worker->connection) {
      worker->connection->send(proto::SalvageWrite{generation, write.step, index, writers, write.exchange});
    }
  }
  std::vector<int> others;
  for (const auto& [rank, worker] : workers_.all()) {
    if (!chosen.count(rank)) others.push_back(rank);
  }
  for (int rank : others) workers_.orderRankOut(rank, generation, "not a salvage writer");
}

void ManagerDaemon::Impl::doSalvageAbandoned(const action::SalvageAbandoned& abandoned) {
  const auto latest = checkpoints_->latest();
  log::warn("salvage abandoned: ", abandoned.reason, "; resuming from the latest complete checkpoint",
            latest ? strCat(" (step ", *latest, ")") : std::string());
  events_->write("salvage_abandoned", {{"generation", controller_->generation()}, {"reason", abandoned.reason},
                                       {"reached_step", reachedStep_},
                                       {"latest_checkpoint", latest ? json(*latest) : json(nullptr)}});
}

}  // namespace varuna
