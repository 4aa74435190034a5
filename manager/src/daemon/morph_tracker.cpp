#include "daemon/morph_tracker.h"

#include <nlohmann/json.hpp>

#include "varuna/common/log.h"

namespace varuna {

void MorphTracker::begin(const std::string& cause, JobMetrics::MorphCause kind, TimePoint now, bool counted) {
  timer_.start(cause, now);
  if (counted) metrics_.morphStarted(kind);  // folds into the morph under way, as the timer does
}

void MorphTracker::firstStep(int generation, const Plan& plan, int64_t step, TimePoint now) {
  const auto phases = timer_.finish(now);
  if (!phases) return;
  metrics_.morphFinished(*phases);
  ++completed_;
  log::info("morph done in ", phases->totalS, " s (", phases->cause, "): first step ", step, " on ", plan.stages, "x",
            plan.replicas);
  if (!events_) return;
  nlohmann::json fields = phases->toJson();
  fields["generation"] = generation;
  fields["plan"] = plan.describe();
  events_->write("morph_complete", fields);
}

}  // namespace varuna
