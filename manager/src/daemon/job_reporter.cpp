#include "daemon/job_reporter.h"

#include <unistd.h>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/time_util.h"
#include "daemon/launch_message.h"

namespace varuna {

using nlohmann::json;

JobReporter::JobReporter(Options options, Parts parts, Hooks hooks, std::unique_ptr<StepLog> stepLog)
    : options_(std::move(options)),
      events_(parts.events),
      metrics_(parts.metrics),
      morph_(parts.morph),
      checkpoints_(parts.checkpoints),
      clock_(parts.clock),
      hooks_(std::move(hooks)),
      stepLog_(std::move(stepLog)),
      progress_(options_.globalBatch),
      slowDetector_(options_.slowThreshold, options_.slowWindow),
      stateFile_(options_.stateDir) {}

// --- what the workers report ------------------------------------------------------------------

void JobReporter::onStepReport(const proto::StepReport& report, const Plan& plan, int generation) {
  if (auto verdict = slowDetector_.add(report)) onSlowVerdict(*verdict);
  metrics_.stepReport(report);
  const auto step = progress_.add(report, plan.worldSize());
  if (!step) return;
  const auto now = clock_.now();
  metrics_.stepCompleted(step->step, step->loss, step->maxStepSeconds, now);
  stepLog_->add(generation, step->step, step->loss, step->maxStepSeconds, now, unixMillisNow());
  if (step->firstOfGeneration) morph_.firstStep(generation, plan, step->step, now);
  progress_.print(*step, plan, checkpointText(now), now);
}

void JobReporter::onLaunch(const Plan& plan) {
  stepLog_->flush();  // the last step of the generation before
  progress_.newGeneration();
  slowDetector_.reset(plan);
}

std::string JobReporter::checkpointText(TimePoint now) const {
  const auto latest = checkpoints_.latest();
  if (!latest) return "no checkpoint yet";
  const TimePoint seen = checkpoints_.latestSeenAt();
  return strCat("last checkpoint step ", *latest,
                seen != TimePoint{} ? strCat(" (", static_cast<int>(secondsBetween(seen, now)), " s ago)") : std::string());
}

void JobReporter::onCheckpointFailed(int rank, const proto::CheckpointFailed& failure, const Plan& plan) {
  const auto& placement = plan.placement;
  const std::string host = rank >= 0 && rank < static_cast<int>(placement.size()) ? placement[rank].host : "?";
  const std::string error = proto::boundedText(failure.error);
  ++checkpointFailures_;
  log::warn("rank ", rank, " on ", host, ": the checkpoint of step ", failure.step, " failed (", error,
            "); training goes on, the next checkpoint tries again");
  lastCheckpointFailure_ = {{"host", host}, {"rank", rank}, {"step", failure.step}, {"error", error}};
  metrics_.checkpointFailed();
  events_.write("checkpoint_failed", lastCheckpointFailure_);
}

// --- slow machines and hosts ------------------------------------------------------------------

void JobReporter::onSlowVerdict(const std::vector<SlowMachine>& slow) {
  std::vector<std::string> hosts;
  for (const auto& s : slow) hosts.push_back(s.host);
  if (hosts == slowHosts_) return;
  try {
    ckpt::writeFileAtomic(options_.stateDir, "slow_machines.out", formatSlowMachines(slow));
    slowHosts_ = hosts;
  } catch (const std::exception& e) {  // a full disk: the next verdict (a window later) tries again
    log::error("cannot write ", options_.stateDir, "/slow_machines.out: ", proto::boundedText(e.what()));
    return;
  }
  json list = json::array();
  for (const auto& s : slow) {
    log::warn("slow machine: ", s.host, " (rank ", s.rank, ", stage ", s.stage, ") takes ", s.ratio(),
              "x the stage median per micro-batch", options_.excludeSlow ? "; it leaves at the next morph" : "");
    list.push_back({{"host", s.host}, {"rank", s.rank}, {"stage", s.stage}, {"ratio", s.ratio()}});
    if (options_.excludeSlow) hooks_.excludeSlowHost(s.host);
  }
  events_.write("slow_machines", {{"machines", list}});
  const DaemonStatus status = hooks_.status();
  hostsChanged(status.hosts, *status.absences);
}

void JobReporter::hostsChanged(const json& hosts, const HostAbsences& absences) {
  metrics_.hosts(countHosts(hosts, absences, slowHosts_));
}

void JobReporter::slowHostReadmitted(const std::string& host) { std::erase(slowHosts_, host); }

void JobReporter::checkpointSeen() {
  metrics_.checkpointSeen(checkpoints_.latest(), checkpoints_.latestSeenAt(), checkpoints_.latestCompletedAt());
}

// --- state.json and the summary ---------------------------------------------------------------

void JobReporter::tick(TimePoint now) {
  checkpointSeen();
  metrics_.tick(now);
  if (stateFile_.due(now)) stateFile_.writeInBackground([this] { return stateSnapshot(); }, clock_.now());
}

void JobReporter::writeState() {
  stateFile_.write([this] { return stateSnapshot(); }, clock_.now());
}

std::shared_ptr<const json> JobReporter::cachedPlanJson(const DaemonStatus& status) {
  if (planJsonGeneration_ != status.generation || !planJson_) {
    planJson_ = std::make_shared<const json>(status.plan ? planJson(*status.plan) : json());
    planJsonGeneration_ = status.generation;
  }
  return planJson_;
}

StateFile::Snapshot JobReporter::stateSnapshot() {
  const auto now = clock_.now();
  DaemonStatus status = hooks_.status();
  const auto latest = checkpoints_.latest();
  hostsChanged(status.hosts, *status.absences);  // once a second at least
  json state = {{"job", options_.job},
                {"pid", ::getpid()},
          {"address", options_.address},
          {"phase", status.phase},
          {"generation", status.generation},
          {"last_checkpoint_step", latest ? json(*latest) : json()},
          {"checkpoint_failures", checkpointFailures_},
          {"last_checkpoint_failure", lastCheckpointFailure_},
          {"skipped_checkpoints", checkpoints_.skipped()},
          {"progress", progress_.toJson()},
          {"morphs", morph_.completed()},
          {"slow_machines", slowHosts_},
          {"uptime_s", secondsBetween(options_.startedAt, now)},
          {"updated", isoTimeNow()},
          {"stop_reason", status.stopReason},
          {"global_store", options_.globalStore},
          {"metrics_address", options_.metricsAddress},
          {"events", events_.path()},
          {"steps", stepLog_->path()}};
  // Moved in, not listed above: an initializer list copies (the hosts are
  // 0.1 MB at 1 250 hosts).
  state["hosts"] = std::move(status.hosts);
  state["connections"] = std::move(status.connections);
  return {std::move(state), {{"plan", cachedPlanJson(status)}}};
}

void JobReporter::printSummary() {
  const auto latest = checkpoints_.latest();
  log::info("summary: job '", options_.job, "', last step ", progress_.lastStep(), ", loss ", progress_.lastLoss(),
            ", ", morph_.completed(), " morph(s), last checkpoint ", latest ? std::to_string(*latest) : "none",
            ", ran ", static_cast<int>(secondsBetween(options_.startedAt, clock_.now())), " s; events in ",
            events_.path());
}

}  // namespace varuna
