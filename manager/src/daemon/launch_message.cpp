#include "daemon/launch_message.h"

#include "varuna/common/launch_contract.h"

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
                                  const std::vector<std::pair<std::string, int64_t>>& profiledPieces) {
  const Plan& plan = launch.plan;
  proto::LaunchWorkers message;
  message.argv = config.program;
  message.codeDir = config.codeDir;
  message.env = env;
  if (!config.profile.empty()) {
    // The workers must run the schedule and partition AutoConfig simulated.
    LaunchArgs chosen;
    chosen.schedule = toString(plan.schedule);
    chosen.pieceCosts = plan.pieceCosts;
    chosen.profiledPieces = profiledPieces;
    const auto entries = planEnvironment(chosen);
    message.env.insert(message.env.end(), entries.begin(), entries.end());
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
