#include "varuna/common/launch_contract.h"

#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "varuna/common/errors.h"
#include "varuna/common/schedule.h"
#include "varuna/common/stage_map.h"

extern char** environ;

namespace varuna {
namespace {

using namespace contract;

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

std::string envText(const std::map<std::string, std::string>& env, const char* key) {
  auto it = env.find(key);
  return it == env.end() ? std::string() : it->second;
}

std::vector<double> decodePieceCosts(const std::string& costs) {
  std::vector<double> out;
  for (size_t start = 0; start < costs.size();) {
    const auto end = std::min(costs.find(',', start), costs.size());
    const std::string item = costs.substr(start, end - start);
    char* tail = nullptr;
    const double value = std::strtod(item.c_str(), &tail);
    if (item.empty() || *tail != '\0' || !(value >= 0)) {
      throw ConfigError(strCat(kPieceCostsEnv, "='", costs, "': '", item, "' is not a non-negative number"));
    }
    out.push_back(value);
    start = end + 1;
  }
  return out;
}

std::vector<std::pair<std::string, int64_t>> decodeProfilePieces(const std::string& pieces) {
  std::vector<std::pair<std::string, int64_t>> out;
  if (pieces.empty()) return out;
  try {
    for (const auto& item : nlohmann::json::parse(pieces)) {
      out.emplace_back(item.at(0).get<std::string>(), item.at(1).get<int64_t>());
    }
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(strCat(kProfilePiecesEnv, " is not a JSON list of [name, parameters] (", e.what(), ")"));
  }
  return out;
}

// The credential on the descriptor the agent named: read to its end and
// closed, once per process (a second parse, e.g. a profiler then the
// runtime, gets the same value). Throws ConfigError naming the variable.
std::string readTokenFromDescriptor(const std::string& text) {
  static std::mutex mutex;
  static std::map<int, std::string> read;
  int fd = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), fd);
  if (ec != std::errc() || end != text.data() + text.size() || fd < 0) {
    throw ConfigError(strCat(kJobTokenFdEnv, "='", text, "' is not a file descriptor number"));
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = read.find(fd); it != read.end()) return it->second;
  std::string token, error;
  char buffer[256];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      token.append(buffer, static_cast<size_t>(n));
      if (token.size() <= 16384) continue;  // a certificate credential is about 3 KB
      error = "holds more than a credential";
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0) {
      error = strCat("cannot read the credential (", std::strerror(errno), ")");
    }
    break;
  }
  ::close(fd);
  if (!error.empty()) throw ConfigError(strCat(kJobTokenFdEnv, "=", fd, ": ", error));
  read[fd] = token;
  return token;
}

// Values run_varuna sets in the environment only.
void readManagerEnvironment(const std::map<std::string, std::string>& env, LaunchArgs& args) {
  args.managerAddr = envText(env, kManagerAddrEnv);
  args.jobToken = env.count(kJobTokenFdEnv) ? readTokenFromDescriptor(env.at(kJobTokenFdEnv)) : envText(env, kJobTokenEnv);
  args.job = envText(env, kJobEnv);
  args.generation = envNumber<int>(env, kGenerationEnv, -1);
  args.hostAddr = envText(env, kHostEnv);
  args.agentBeatFd = envNumber<int>(env, contract::kAgentBeatFdEnv, -1);
  args.globalStore = envText(env, kGlobalStoreEnv);
  args.keepCheckpoints = envNumber<int>(env, kKeepCheckpointsEnv, -1);
  if (env.count(kKeepCheckpointsEnv) && args.keepCheckpoints < 0) {
    throw ConfigError(strCat(kKeepCheckpointsEnv, "='", envText(env, kKeepCheckpointsEnv),
                             "' must be >= 0 (0 keeps every checkpoint)"));
  }
  args.schedule = envText(env, kScheduleEnv);
  if (!args.schedule.empty()) parseScheduleChoice(args.schedule);  // fails early, naming the value
  args.pieceCosts = decodePieceCosts(envText(env, kPieceCostsEnv));
  args.profiledPieces = decodeProfilePieces(envText(env, kProfilePiecesEnv));
}

}  // namespace

LaunchArgs parseLaunchArgs(int argc, const char* const* argv, const std::map<std::string, std::string>& env) {
  LaunchArgs args;
  args.rank = envNumber<int>(env, kRankEnv, 0);
  args.localRank = envNumber<int>(env, kLocalRankEnv, args.rank);
  args.worldSize = envNumber<int>(env, kWorldSizeEnv, 1);
  args.masterPort = envNumber<int>(env, kMasterPortEnv, 29500);
  if (const auto addr = envText(env, kMasterAddrEnv); !addr.empty()) args.masterAddr = addr;
  // Under torchrun the agent already hosts the TCPStore on MASTER_PORT.
  if (envText(env, kTorchAgentStoreEnv) == "True") args.externalStore = true;
  readManagerEnvironment(env, args);

  CLI::App app{"varuna worker"};
  app.allow_extras();
  app.set_help_flag();  // --help belongs to the training program
  bool localRankGiven = false;
  app.add_option(kRankArg, args.rank, "global rank")->check(CLI::NonNegativeNumber);
  app.add_option_function<int>(strCat(kLocalRankArg, ",--local-rank"), [&](int v) { args.localRank = v; localRankGiven = true; },
                               "rank within this machine")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--world_size", args.worldSize, "number of workers")->check(CLI::PositiveNumber);
  app.add_option(kStageToRankMapArg, args.stageToRankMap, "e.g. 0,2;1,3;");
  app.add_option(kChunkSizeArg, args.chunkSize, "micro-batch size")->check(CLI::PositiveNumber);
  app.add_option(strCat(kBatchSizeArg, ",--batch_size"), args.replicaBatchSize, "this replica's share of the global batch")
      ->check(CLI::PositiveNumber);
  app.add_option(kResumeStepArg, args.resumeStep, "checkpoint step to resume from")->check(CLI::NonNegativeNumber);
  app.add_option(kMasterAddrArg, args.masterAddr, "rendezvous host");
  app.add_option(kMasterPortArg, args.masterPort, "rendezvous port")->check(CLI::Range(1, 65535));
  app.add_flag(kExternalStoreArg, args.externalStore, "the rendezvous store is not hosted by rank 0");
  std::vector<std::string> tokens;
  for (int i = argc - 1; i >= 1; --i) tokens.emplace_back(argv[i]);  // CLI11 parses a reversed vector
  try {
    app.parse(tokens);
  } catch (const CLI::ParseError& e) {
    throw ConfigError(strCat("bad worker argument: ", e.what()));
  }
  args.userArgs = app.remaining();
  if (!localRankGiven && env.find(kLocalRankEnv) == env.end()) args.localRank = args.rank;
  if (args.rank >= args.worldSize && args.stageToRankMap.empty()) {
    throw ConfigError(strCat(kRankArg, " ", args.rank, " is not below WORLD_SIZE ", args.worldSize));
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

std::vector<std::string> launcherArgv(const LaunchArgs& args) {
  std::vector<std::string> argv = {kRankArg, std::to_string(args.rank), kLocalRankArg, std::to_string(args.localRank)};
  if (!args.stageToRankMap.empty()) argv.insert(argv.end(), {kStageToRankMapArg, args.stageToRankMap});
  if (args.chunkSize > 0) argv.insert(argv.end(), {kChunkSizeArg, std::to_string(args.chunkSize)});
  if (args.replicaBatchSize > 0) argv.insert(argv.end(), {kBatchSizeArg, std::to_string(args.replicaBatchSize)});
  if (args.resumeStep >= 0) argv.insert(argv.end(), {kResumeStepArg, std::to_string(args.resumeStep)});
  return argv;
}

EnvEntries rendezvousEnvironment(const LaunchArgs& args) {
  return {{kRankEnv, std::to_string(args.rank)},
          {kLocalRankEnv, std::to_string(args.localRank)},
          {kWorldSizeEnv, std::to_string(args.worldSize)},
          {kMasterAddrEnv, args.masterAddr},
          {kMasterPortEnv, std::to_string(args.masterPort)}};
}

EnvEntries managerEnvironment(const LaunchArgs& args) {
  EnvEntries env = {{kManagerAddrEnv, args.managerAddr},
                    args.jobTokenFd >= 0 ? std::pair<std::string, std::string>{kJobTokenFdEnv, std::to_string(args.jobTokenFd)}
                                         : std::pair<std::string, std::string>{kJobTokenEnv, args.jobToken},
                    {kJobEnv, args.job},
                    {kHostEnv, args.hostAddr},
                    {kGenerationEnv, std::to_string(args.generation)}};
  if (args.agentBeatFd >= 0) env.emplace_back(contract::kAgentBeatFdEnv, std::to_string(args.agentBeatFd));
  return env;
}

EnvEntries storeEnvironment(const LaunchArgs& args) {
  EnvEntries env = {{kGlobalStoreEnv, args.globalStore}};
  if (args.keepCheckpoints >= 0) env.emplace_back(kKeepCheckpointsEnv, std::to_string(args.keepCheckpoints));
  return env;
}

EnvEntries planEnvironment(const LaunchArgs& args) {
  EnvEntries env;
  if (!args.schedule.empty()) env.emplace_back(kScheduleEnv, args.schedule);
  std::string costs;
  for (double c : args.pieceCosts) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.17g", c);  // exact: the same partition on both sides
    costs += (costs.empty() ? "" : ",") + std::string(text);
  }
  if (!costs.empty()) env.emplace_back(kPieceCostsEnv, costs);
  if (!args.profiledPieces.empty()) env.emplace_back(kProfilePiecesEnv, nlohmann::json(args.profiledPieces).dump());
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
