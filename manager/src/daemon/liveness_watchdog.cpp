#include "daemon/liveness_watchdog.h"

#include <algorithm>

#include "varuna/common/errors.h"
#include "varuna/common/time_util.h"

namespace varuna {
namespace {

using nlohmann::json;

// Calls visit(rank, state) for each rank of `running` the registry knows, or
// visit(rank, nullptr) for one it does not. Both are ordered by rank, so one
// walk over each, not a lookup per rank: this runs every tick over every
// rank (10 000 on a big job), and a tree lookup each cost the loop 1.6 ms.
template <typename Visit>
void forEachRunning(const std::set<int>& running, const WorkerRegistry& workers, Visit visit) {
  auto w = workers.all().begin();
  const auto end = workers.all().end();
  for (const int rank : running) {
    while (w != end && w->first < rank) ++w;
    if (!visit(rank, w != end && w->first == rank ? &w->second : nullptr)) return;
  }
}

}  // namespace

void LivenessWatchdog::launched(TimePoint now) {
  launchedAt_ = now;
  progressAt_.reset();
  allHeardSince_.reset();
}

void LivenessWatchdog::noteStep(WorkerState& worker, int64_t step, bool report, TimePoint now) {
  if (report && !progressAt_) progressAt_ = now;  // the generation's first step: the hang timeout applies from here
  if (step <= worker.step) return;
  worker.step = step;
  if (progressAt_) progressAt_ = now;  // before the generation's first step, a step is only the resume point
}

std::vector<LivenessWatchdog::SilentRank> LivenessWatchdog::silentRanks(const std::set<int>& running,
                                                                        const WorkerRegistry& workers,
                                                                        TimePoint now) {
  std::vector<SilentRank> silent;
  const auto heartbeatTimeout = millis(limits_.heartbeatTimeoutS);
  if (allHeardSince_ && now - *allHeardSince_ <= heartbeatTimeout) return silent;
  const bool startupOver = now - launchedAt_ > millis(limits_.startupTimeoutS);
  bool allConnected = true;
  TimePoint oldest = now;
  forEachRunning(running, workers, [&](int rank, const WorkerState* w) {
    if (!w) return true;
    allConnected &= w->connected;
    if (w->connected) oldest = std::min(oldest, w->lastSeen);
    if (w->connected && now - w->lastSeen > heartbeatTimeout) {
      silent.push_back({rank, strCat("no heartbeat for ", limits_.heartbeatTimeoutS, " s"), w->lastSeen});
    } else if (!w->connected && startupOver) {
      silent.push_back({rank, strCat("never connected within ", limits_.startupTimeoutS, " s of the launch"), std::nullopt});
    }
    return true;
  });
  if (allConnected) {
    allHeardSince_ = oldest;
  } else {
    allHeardSince_.reset();
  }
  return silent;
}

bool LivenessWatchdog::silenceIsTheAgents(const SilentRank& silent, std::optional<TimePoint> agentLastHeard,
                                          TimePoint now) {
  if (!agentLastHeard || !silent.lastHeard) return false;  // no agent connected, or a rank that never said hello
  // An agent sends a frame at least every 1.6 s (its heartbeat every second,
  // left out while its relays, every --beat_relay_ms of at most 500 ms, come
  // more often). Heard from no later than this after the rank's last beat: it
  // fell silent with the rank.
  constexpr auto kSameSilence = std::chrono::milliseconds(1000);
  constexpr auto kAgentSilent = std::chrono::milliseconds(2000);
  return *agentLastHeard - *silent.lastHeard <= kSameSilence || now - *agentLastHeard > kAgentSilent;
}

std::optional<LivenessWatchdog::Hang> LivenessWatchdog::findHang(const std::set<int>& running,
                                                                 const WorkerRegistry& workers, const Plan& plan,
                                                                 TimePoint now) const {
  if (limits_.hangTimeoutS <= 0) return std::nullopt;
  // Before the first step (rendezvous, loading a checkpoint, the first step
  // itself, all slow on a big model) the larger of the startup and hang
  // timeouts counts from the launch; from the first step on, the hang
  // timeout from the last step. Checked first: it is the cheap test, and
  // the ranks are walked only once it fails.
  const bool started = progressAt_.has_value();
  const TimePoint since = started ? *progressAt_ : launchedAt_;
  const double timeoutS = started ? limits_.hangTimeoutS : std::max(limits_.startupTimeoutS, limits_.hangTimeoutS);
  if (now - since <= millis(timeoutS)) return std::nullopt;
  std::vector<int> ranks;
  bool allConnected = true;
  forEachRunning(running, workers, [&](int rank, const WorkerState* w) {
    allConnected = w && w->connected;
    if (allConnected) ranks.push_back(rank);
    return allConnected;
  });
  if (!allConnected || ranks.empty()) return std::nullopt;
  // The culprit computes (or is stuck in its own code) while its peers wait
  // for it; if none or all wait, every rank is named.
  std::vector<int> computing, waiting;
  for (const int rank : ranks) (workers.find(rank)->waiting ? waiting : computing).push_back(rank);
  Hang hang;
  hang.ranks = !waiting.empty() && !computing.empty() ? computing : ranks;
  const double stalledS = std::chrono::duration<double>(now - since).count();
  json named = json::array();
  int64_t lastStep = -1;
  for (const int rank : ranks) lastStep = std::max(lastStep, workers.find(rank)->step);
  for (const int rank : hang.ranks) {
    const WorkerState& w = *workers.find(rank);
    const std::string host = rank < static_cast<int>(plan.placement.size()) ? plan.placement[rank].host : "?";
    named.push_back({{"rank", rank}, {"host", host}, {"step", w.step}, {"waiting", w.waiting}});
    hang.summary += strCat(hang.summary.empty() ? "" : ", ", rank, " on ", host, " (step ", w.step, ")");
  }
  const std::string what =
      started ? strCat("no rank finished a step for ", static_cast<int>(stalledS), " s (--hang_timeout_s ", timeoutS, ")")
              : strCat("no step finished within ", static_cast<int>(stalledS), " s of the launch (the larger of "
                       "--startup_timeout_s and --hang_timeout_s: ", timeoutS, ")");
  const std::string whose = hang.ranks.size() == ranks.size()
                                ? std::string(waiting.empty() ? "none of the ranks waits on a peer"
                                                              : "every rank waits on a peer")
                                : strCat(waiting.size(), " rank(s) wait on it");
  hang.reason = strCat("rank(s) ", hang.summary, " hung: ", what, "; ", whose);
  hang.event = {{"ranks", named},       {"stalled_s", stalledS},   {"timeout_s", timeoutS},
                {"before_first_step", !started}, {"last_step", lastStep}, {"waiting_ranks", waiting},
                {"reason", hang.reason}};
  return hang;
}

}  // namespace varuna
