// MorphTimer: the phases of one morph (or relaunch after a failure), for the
// `morph_complete` event and the "morph done in" line. A morph starts at its
// cause (a notice, a machine change, a failure); events during it fold into
// it (start() is a no-op then); it ends at the first step of the generation
// it launched. Pure bookkeeping with the time passed in: the ManagerDaemon
// owns one and uses it on its event-loop thread.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace varuna {

struct MorphPhases {
  std::string cause;
  double checkpointAndTeardownS = 0;   // cause -> the new generation's launch
  double launchAndConnectS = 0;        // launch -> every worker said hello (0 if never seen)
  double rendezvousLoadFirstStepS = 0; // all connected -> the first step (0 if never seen)
  double totalS = 0;                   // cause -> the first step
  // {"cause", "checkpoint_and_teardown_s", "launch_and_connect_s",
  //  "rendezvous_load_first_step_s", "total_s"}
  nlohmann::json toJson() const;
};

class MorphTimer {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  // A morph begins for `cause`, unless one is under way already.
  void start(const std::string& cause, TimePoint now);
  // The generation that ends the morph was launched / is all connected (no-ops without a morph).
  void launched(TimePoint now);
  void connected(TimePoint now);
  // Its first step: the phases, and the timer is idle again. nullopt without a morph.
  std::optional<MorphPhases> finish(TimePoint now);

  bool active() const { return active_; }
  const std::string& cause() const { return cause_; }

 private:
  std::string cause_;
  TimePoint begin_{}, launched_{}, connected_{};
  bool active_ = false;
};

}  // namespace varuna
