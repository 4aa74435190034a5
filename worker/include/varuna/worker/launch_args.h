// The arguments a launcher (run_varuna, scripts/varuna_launch.py, torchrun or a
// person) passes to every worker, parsed from the command line and the
// torchrun-style environment. Read in main(); nothing else reads the environment.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace varuna {

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
  std::string jobToken;     // VARUNA_JOB_TOKEN
  int generation = -1;      // VARUNA_GENERATION
  std::string hostAddr;     // VARUNA_HOST
  int agentBeatFd = -1;     // VARUNA_AGENT_BEAT_FD: the agent's beat socket (agent_beat.h); -1: none
  std::string globalStore;  // VARUNA_GLOBAL_STORE: the job's checkpoint root
  int keepCheckpoints = -1; // VARUNA_KEEP_CHECKPOINTS (run_varuna --keep_checkpoints); -1: not given
  // run_varuna's AutoConfig choices (environment only); they win over the
  // program's own settings so the partition that runs is the one simulated.
  std::string schedule;             // VARUNA_SCHEDULE: varuna, 1f1b or gpipe
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

// Parses `--rank --local_rank --stage_to_rank_map --chunk_size --batch-size
// --resume_step --master_addr --master_port --external_store`; missing values
// fall back to RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in `env`.
// Throws ConfigError naming the bad argument.
LaunchArgs parseLaunchArgs(int argc, const char* const* argv,
                           const std::map<std::string, std::string>& env);

// The process environment as a map (call from main()).
std::map<std::string, std::string> currentEnvironment();

}  // namespace varuna
