// The launch contract: the arguments and environment a launcher (run_varuna's
// agent, scripts/varuna_launch.py, torchrun or a person) hands every worker,
// as one codec. Writers build a LaunchArgs and encode it (launcherArgv and
// the *Environment functions); the worker decodes it (parseLaunchArgs). The
// names live here only; scripts/varuna_launch.py mirrors the launcher
// arguments and the rendezvous environment, and
// tests/python/launch_contract_test.py checks that the two agree.
// docs/worker-api.md, "Launch contract", lists every name.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "varuna/common/agent_beat.h"

namespace varuna {

namespace contract {
// Launcher arguments (names as in the original Varuna manual).
inline constexpr const char* kRankArg = "--rank";
inline constexpr const char* kLocalRankArg = "--local_rank";
inline constexpr const char* kStageToRankMapArg = "--stage_to_rank_map";
inline constexpr const char* kChunkSizeArg = "--chunk_size";
inline constexpr const char* kBatchSizeArg = "--batch-size";  // this replica's share of the global batch
inline constexpr const char* kResumeStepArg = "--resume_step";
inline constexpr const char* kMasterAddrArg = "--master_addr";
inline constexpr const char* kMasterPortArg = "--master_port";
inline constexpr const char* kExternalStoreArg = "--external_store";
// The torchrun-style rendezvous environment.
inline constexpr const char* kRankEnv = "RANK";
inline constexpr const char* kLocalRankEnv = "LOCAL_RANK";
inline constexpr const char* kWorldSizeEnv = "WORLD_SIZE";
inline constexpr const char* kLocalWorldSizeEnv = "LOCAL_WORLD_SIZE";
inline constexpr const char* kMasterAddrEnv = "MASTER_ADDR";
inline constexpr const char* kMasterPortEnv = "MASTER_PORT";
inline constexpr const char* kTorchAgentStoreEnv = "TORCHELASTIC_USE_AGENT_STORE";
// run_varuna's (environment only).
inline constexpr const char* kManagerAddrEnv = "VARUNA_MANAGER_ADDR";
inline constexpr const char* kJobTokenEnv = "VARUNA_JOB_TOKEN";
// The descriptor run_varuna's agent hands a worker its credential on (a pipe
// the worker reads once and closes), named in the environment; the value
// itself is never in the environment, which /proc/<pid>/environ shows.
inline constexpr const char* kJobTokenFdEnv = "VARUNA_JOB_TOKEN_FD";
inline constexpr int kJobTokenFd = 4;  // after the beat socket's 3
inline constexpr const char* kJobEnv = "VARUNA_JOB";
inline constexpr const char* kHostEnv = "VARUNA_HOST";
inline constexpr const char* kGenerationEnv = "VARUNA_GENERATION";
inline constexpr const char* kAgentBeatFdEnv = ::varuna::kAgentBeatFdEnv;  // agent_beat.h
inline constexpr const char* kGlobalStoreEnv = "VARUNA_GLOBAL_STORE";
inline constexpr const char* kKeepCheckpointsEnv = "VARUNA_KEEP_CHECKPOINTS";
inline constexpr const char* kScheduleEnv = "VARUNA_SCHEDULE";
inline constexpr const char* kPieceCostsEnv = "VARUNA_PIECE_COSTS";
inline constexpr const char* kProfilePiecesEnv = "VARUNA_PROFILE_PIECES";
}  // namespace contract

using EnvEntries = std::vector<std::pair<std::string, std::string>>;

struct LaunchArgs {
  int rank = 0;
  int localRank = 0;
  int worldSize = 1;
  std::string stageToRankMap;  // empty: one stage, every rank a data-parallel replica
  int64_t chunkSize = 0;       // micro-batch size; 0: not given
  // This replica's share of the global batch: what the launch contract's
  // --batch-size carries (the original's "per process batch size"); 0: not
  // given. globalBatchSize() is the job's batch.
  int64_t replicaBatchSize = 0;
  int64_t resumeStep = -1;     // -1: fresh start
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;
  // The rendezvous store is hosted by someone else (a test harness or the
  // manager) instead of rank 0.
  bool externalStore = false;
  // Set by run_varuna's agent (environment only): where to report, as whom,
  // and this host's address (Gloo binds it).
  std::string managerAddr;  // VARUNA_MANAGER_ADDR; empty: no manager
  std::string jobToken;     // read from VARUNA_JOB_TOKEN_FD (the agent's way) or VARUNA_JOB_TOKEN
  // Encoding: the descriptor the token is on (the agent's launch), named as
  // VARUNA_JOB_TOKEN_FD instead of the token; -1: VARUNA_JOB_TOKEN itself.
  int jobTokenFd = -1;
  std::string job;          // VARUNA_JOB: the job's name
  int generation = -1;      // VARUNA_GENERATION
  std::string hostAddr;     // VARUNA_HOST
  int agentBeatFd = -1;     // VARUNA_AGENT_BEAT_FD: the agent's beat socket (agent_beat.h); -1: none
  std::string globalStore;  // VARUNA_GLOBAL_STORE: the job's checkpoint root
  int keepCheckpoints = -1; // VARUNA_KEEP_CHECKPOINTS (run_varuna --keep_checkpoints); -1: not given
  // run_varuna's AutoConfig choices (environment only); they win over the
  // program's own settings so the partition that runs is the one simulated.
  std::string schedule;             // VARUNA_SCHEDULE: a schedule name, e.g. 1f1b or interleaved:4
  std::vector<double> pieceCosts;   // VARUNA_PIECE_COSTS: comma-separated, one per piece
  // VARUNA_PROFILE_PIECES: the pieces of the profile run_varuna planned with,
  // JSON [[name, parameter count], ...]; the runtime refuses a model that differs.
  std::vector<std::pair<std::string, int64_t>> profiledPieces;
  // Everything the runtime did not recognise, for the training program itself.
  std::vector<std::string> userArgs;

  // The layout the stage-to-rank map gives (no map: one stage, every rank a
  // replica) and this rank's place in it.
  int stages() const;
  int replicas() const;
  int stage() const;
  int replica() const;
  // The global batch: replicaBatchSize x replicas(); 0 when not given.
  int64_t globalBatchSize() const { return replicaBatchSize * replicas(); }
};

// Decoding. Parses `--rank --local_rank --stage_to_rank_map --chunk_size
// --batch-size --resume_step --master_addr --master_port --external_store`;
// missing values fall back to RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT in `env`; run_varuna's values come from `env` only.
// Throws ConfigError naming the bad argument or variable.
LaunchArgs parseLaunchArgs(int argc, const char* const* argv, const std::map<std::string, std::string>& env);

// The process environment as a map (call from main()).
std::map<std::string, std::string> currentEnvironment();

// Encoding, by who knows what. Each writes only what is set.
// The launcher arguments: --rank --local_rank --stage_to_rank_map
// --chunk_size --batch-size [--resume_step].
std::vector<std::string> launcherArgv(const LaunchArgs& args);
// RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT.
EnvEntries rendezvousEnvironment(const LaunchArgs& args);
// What run_varuna's agent adds: the manager's address, the token, the job,
// the host, the generation and the beat socket.
EnvEntries managerEnvironment(const LaunchArgs& args);
// What the job's configuration adds: the checkpoint store and retention.
EnvEntries storeEnvironment(const LaunchArgs& args);
// What AutoConfig's plan adds: the schedule, the piece costs (exact:
// "%.17g", the same partition on both sides) and the profile's pieces.
EnvEntries planEnvironment(const LaunchArgs& args);

}  // namespace varuna
