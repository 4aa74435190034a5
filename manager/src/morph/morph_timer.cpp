#include "varuna/manager/morph_timer.h"
#include "varuna/common/time_util.h"

#include <nlohmann/json.hpp>

namespace varuna {
nlohmann::json MorphPhases::toJson() const {
  return {{"cause", cause},
          {"checkpoint_and_teardown_s", checkpointAndTeardownS},
          {"launch_and_connect_s", launchAndConnectS},
          {"rendezvous_load_first_step_s", rendezvousLoadFirstStepS},
          {"total_s", totalS}};
}

void MorphTimer::start(const std::string& cause, TimePoint now) {
  if (active_) return;  // folded into the morph under way
  cause_ = cause;
  begin_ = now;
  launched_ = connected_ = TimePoint{};
  active_ = true;
}

void MorphTimer::launched(TimePoint now) {
  if (!active_) return;
  launched_ = now;
  connected_ = TimePoint{};  // a relaunch within the morph: connecting starts again
}

void MorphTimer::connected(TimePoint now) {
  if (active_) connected_ = now;
}

std::optional<MorphPhases> MorphTimer::finish(TimePoint now) {
  if (!active_) return std::nullopt;
  active_ = false;
  MorphPhases phases;
  phases.cause = cause_;
  const TimePoint launched = launched_ == TimePoint{} ? now : launched_;
  phases.checkpointAndTeardownS = secondsBetween(begin_, launched);
  if (connected_ > launched_ && launched_ != TimePoint{}) {
    phases.launchAndConnectS = secondsBetween(launched_, connected_);
    phases.rendezvousLoadFirstStepS = secondsBetween(connected_, now);
  }
  phases.totalS = secondsBetween(begin_, now);
  return phases;
}

}  // namespace varuna
