// What a launch tells the agents (LaunchWorkers, without the per-host list of
// ranks the daemon fills in) and how a plan reads in events.jsonl and
// state.json.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "varuna/common/protocol.h"
#include "varuna/manager/job_config.h"
#include "varuna/manager/morph_controller.h"

namespace varuna {

// The program, its environment (with AutoConfig's schedule and piece costs
// when a profile plans the job: the workers must run what was simulated),
// the plan's shape and the generation's rendezvous port.
proto::LaunchWorkers launchMessage(const JobConfig& config, const action::Launch& launch,
                                   const std::vector<std::pair<std::string, std::string>>& env,
                                   const std::vector<std::pair<std::string, int64_t>>& profiledPieces);

nlohmann::json planJson(const Plan& plan);

}  // namespace varuna
