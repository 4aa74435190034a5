#include "varuna/worker/launch_args.h"

#include <CLI/CLI.hpp>

#include <charconv>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "varuna/common/agent_beat.h"
#include "varuna/common/errors.h"
#include "varuna/common/schedule.h"
#include "varuna/common/stage_map.h"

extern char** environ;

namespace varuna {
namespace {

template <typename T>
T envNumber(const std::map<std::string, std::string>& env, const char* key, T fallback) {
  auto it = env.find(key);
  if (it == env.end() || it->second.empty()) return fallback;
  T value{};
  const char* end = it->second.data() + it->second.size();
  auto [ptr, ec] = std::from_chars(it->second.data(), end, value);
  if (ec != std::errc() || ptr != end) {
    throw ConfigError(strCat("environment variable ", key, "='", it->second, "' is not a number"));
  }
  return value;
}

}  // namespace

LaunchArgs parseLaunchArgs(int argc, const char* const* argv, const std::map<std::string, std::string>& env) {
  LaunchArgs args;
  args.rank = envNumber<int>(env, "RANK", 0);
  args.localRank = envNumber<int>(env, "LOCAL_RANK", args.rank);
  args.worldSize = envNumber<int>(env, "WORLD_SIZE", 1);
  args.masterPort = envNumber<int>(env, "MASTER_PORT", 29500);
  if (auto it = env.find("MASTER_ADDR"); it != env.end() && !it->second.empty()) args.masterAddr = it->second;
  // Under torchrun the agent already hosts the TCPStore on MASTER_PORT.
  if (auto it = env.find("TORCHELASTIC_USE_AGENT_STORE"); it != env.end() && it->second == "True") {
    args.externalStore = true;
  }

  auto envText = [&](const char* key) {
    auto it = env.find(key);
    return it == env.end() ? std::string() : it->second;
  };
  args.managerAddr = envText("VARUNA_MANAGER_ADDR");
  args.jobToken = envText("VARUNA_JOB_TOKEN");
  args.generation = envNumber<int>(env, "VARUNA_GENERATION", -1);
  args.hostAddr = envText("VARUNA_HOST");
  args.agentBeatFd = envNumber<int>(env, kAgentBeatFdEnv, -1);
  args.globalStore = envText("VARUNA_GLOBAL_STORE");
  args.keepCheckpoints = envNumber<int>(env, "VARUNA_KEEP_CHECKPOINTS", -1);
  if (env.count("VARUNA_KEEP_CHECKPOINTS") && args.keepCheckpoints < 0) {
    throw ConfigError(strCat("VARUNA_KEEP_CHECKPOINTS='", envText("VARUNA_KEEP_CHECKPOINTS"),
                             "' must be >= 0 (0 keeps every checkpoint)"));
  }
  args.schedule = envText("VARUNA_SCHEDULE");
  if (!args.schedule.empty()) parseScheduleKind(args.schedule);  // fails early, naming the value
  const std::string costs = envText("VARUNA_PIECE_COSTS");
  for (size_t start = 0; start < costs.size();) {
    const auto end = std::min(costs.find(',', start), costs.size());
    const std::string item = costs.substr(start, end - start);
    char* tail = nullptr;
    const double value = std::strtod(item.c_str(), &tail);
    if (item.empty() || *tail != '\0' || !(value >= 0)) {
      throw ConfigError(strCat("VARUNA_PIECE_COSTS='", costs, "': '", item, "' is not a non-negative number"));
    }
    args.pieceCosts.push_back(value);
    start = end + 1;
  }
  const std::string pieces = envText("VARUNA_PROFILE_PIECES");
  if (!pieces.empty()) {
    try {
      for (const auto& item : nlohmann::json::parse(pieces)) {
        args.profiledPieces.emplace_back(item.at(0).get<std::string>(), item.at(1).get<int64_t>());
      }
    } catch (const nlohmann::json::exception& e) {
      throw ConfigError(strCat("VARUNA_PROFILE_PIECES is not a JSON list of [name, parameters] (", e.what(), ")"));
    }
  }

  CLI::App app{"varuna worker"};
  app.allow_extras();
  app.set_help_flag();  // --help belongs to the training program
  bool localRankGiven = false;
  app.add_option("--rank", args.rank, "global rank")->check(CLI::NonNegativeNumber);
  app.add_option_function<int>("--local_rank,--local-rank", [&](int v) { args.localRank = v; localRankGiven = true; },
                               "rank within this machine")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--world_size", args.worldSize, "number of workers")->check(CLI::PositiveNumber);
  app.add_option("--stage_to_rank_map", args.stageToRankMap, "e.g. 0,2;1,3;");
  app.add_option("--chunk_size", args.chunkSize, "micro-batch size")->check(CLI::PositiveNumber);
  app.add_option("--batch-size,--batch_size", args.replicaBatchSize, "this replica's share of the global batch")
      ->check(CLI::PositiveNumber);
  app.add_option("--resume_step", args.resumeStep, "checkpoint step to resume from")->check(CLI::NonNegativeNumber);
  app.add_option("--master_addr", args.masterAddr, "rendezvous host");
  app.add_option("--master_port", args.masterPort, "rendezvous port")->check(CLI::Range(1, 65535));
  app.add_flag("--external_store", args.externalStore, "the rendezvous store is not hosted by rank 0");
  std::vector<std::string> tokens;
  for (int i = argc - 1; i >= 1; --i) tokens.emplace_back(argv[i]);  // CLI11 parses a reversed vector
  try {
    app.parse(tokens);
  } catch (const CLI::ParseError& e) {
    throw ConfigError(strCat("bad worker argument: ", e.what()));
  }
  args.userArgs = app.remaining();
  if (!localRankGiven && env.find("LOCAL_RANK") == env.end()) args.localRank = args.rank;
  if (args.rank >= args.worldSize && args.stageToRankMap.empty()) {
    throw ConfigError(strCat("--rank ", args.rank, " is not below WORLD_SIZE ", args.worldSize));
  }
  return args;
}

std::map<std::string, std::string> currentEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return env;
}

int LaunchArgs::stages() const {
  return stageToRankMap.empty() ? 1 : StageToRankMap::parse(stageToRankMap).numStages();
}

int LaunchArgs::replicas() const {
  return stageToRankMap.empty() ? worldSize : StageToRankMap::parse(stageToRankMap).numReplicas();
}

int LaunchArgs::stage() const { return stageToRankMap.empty() ? 0 : StageToRankMap::parse(stageToRankMap).stageOf(rank); }

int LaunchArgs::replica() const {
  return stageToRankMap.empty() ? rank : StageToRankMap::parse(stageToRankMap).replicaOf(rank);
}

}  // namespace varuna
