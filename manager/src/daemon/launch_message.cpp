#include "varuna/manager/daemon/launch_message.h"

#include <cstdio>

namespace varuna {

using nlohmann::json;

json planJson(const Plan& plan) {
  json placement = json::array();
  for (const auto& p : plan.placement) placement.push_back({{"rank", p.rank}, {"host", p.host}, {"local_rank", p.localRank}});
  return {{"stages", plan.stages},       {"replicas", plan.replicas},     {"chunk_size", plan.chunkSize},
          {"global_batch", plan.globalBatch}, {"per_replica_batch", plan.perReplicaBatch},
          {"stage_to_rank_map", plan.stageToRankMap}, {"hosts", plan.hosts}, {"placement", placement}};
}

proto::LaunchWorkers launchMessage(const JobConfig& config, const action::Launch& launch,
                                  const std::vector<std::pair<std::string, std::string>>& env,
                                  const std::string& profiledPieces) {
  const Plan& plan = launch.plan;
  proto::LaunchWorkers message;
  message.argv = config.program;
  message.codeDir = config.codeDir;
  message.env = env;
  if (!config.profile.empty()) {
    // The workers must run the schedule and partition AutoConfig simulated.
    message.env.emplace_back("VARUNA_SCHEDULE", toString(plan.schedule));
    std::string costs;
    for (double c : plan.pieceCosts) {
      char text[32];
      std::snprintf(text, sizeof(text), "%.17g", c);  // exact: the same partition on both sides
      costs += (costs.empty() ? "" : ",") + std::string(text);
    }
    if (!costs.empty()) message.env.emplace_back("VARUNA_PIECE_COSTS", costs);
    message.env.emplace_back("VARUNA_PROFILE_PIECES", profiledPieces);
  }
  message.stageToRankMap = plan.stageToRankMap;
  message.chunkSize = plan.chunkSize;
  message.batchSize = plan.perReplicaBatch;
  message.resumeStep = launch.resumeStep;
  message.masterAddr = plan.placement.front().host;
  // A fresh port per generation: the previous store may linger in TIME_WAIT.
  message.masterPort = config.masterPort + (launch.generation - 1) % 100;
  message.worldSize = plan.worldSize();
  message.generation = launch.generation;
  return message;
}

}  // namespace varuna
