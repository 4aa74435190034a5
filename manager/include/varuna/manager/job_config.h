// JobConfig: everything run_varuna needs to run one job, from a JSON job file
// and/or the command line (the command line wins). Option names are the
// original Varuna's (`--machine_list`, `--nstages`, ...); JSON keys are the
// same names without dashes. Parsing is pure and reports the first bad input
// by name (and file:line for the env file), with the fix.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "varuna/common/schedule.h"

namespace varuna {

struct JobConfig {
  std::string job = "varuna";       // name: log prefix, state and run folders
  std::string machineList;          // path, watched for changes
  // "list": the machine list's hosts (agents started by run_varuna, SSH or
  // local); "join": none listed, hosts join by themselves (varuna_agent
  // --join, under Slurm or Kubernetes). Joins are accepted in either mode.
  std::string machineSource = "list";
  // Start training once this many hosts are usable (0: with a list, when
  // every listed agent started or failed; with joins, at the first host).
  int minHosts = 0;
  double joinTtlH = 720;            // life of <state_dir>/join_token; renewed at half of it
  int gpusPerNode = 1;              // slots of a host without slots=N
  int nstages = 0;                  // P; 0: AutoConfig chooses (needs `profile`)
  int64_t chunkSize = 0;            // micro-batch size; 0: AutoConfig chooses
  int64_t batchSize = 0;            // global batch, constant across morphs
  std::string codeDir;              // where workers start (default: the current folder)
  std::string envFile;              // KEY=VALUE lines for agents and workers
  bool noMorphing = false;
  std::string managerIp;            // address agents and workers dial (default: guessed)
  int port = 0;                     // manager's control port (0: any free port)
  bool insecurePlaintextControl = false;  // no TLS on the control plane: loopback development only
  int masterPort = 0;               // workers' rendezvous port on rank 0's host (+ generation offset); 0: random
  int metricsPort = -1;             // Prometheus metrics at http://manager_ip:PORT/metrics (-1: off, 0: any free port)
  std::string globalStore;          // checkpoint root shared by the workers
  int keepCheckpoints = 3;          // complete checkpoints the workers keep (0: all); VARUNA_KEEP_CHECKPOINTS
  std::string stateDir;             // state.json, events.jsonl, slow_machines.out, token
  double heartbeatTimeoutS = 10;    // a worker silent this long is hung
  double hangTimeoutS = 600;        // no rank finished a step this long: the generation is hung (0: off)
  double startupTimeoutS = 120;     // launch -> first heartbeat of a worker
  double checkpointTimeoutS = 120;  // preemption notice -> all workers checkpointed
  bool noSalvage = false;           // a sudden loss rolls back to the last checkpoint (docs/salvage.md)
  double salvageTimeoutS = 30;      // each salvage round (reports, writes) finishes within this
  double agentGraceS = 5;           // agents kill their workers when the manager is gone this long
  double agentSigtermNoticeS = 0;   // > 0: an agent's SIGTERM is a preemption notice this far ahead
  int maxFailures = 3;              // within failureWindowS; one more stops the job
  double failureWindowS = 600;
  double restartBackoffS = 1;
  double hostRetryS = 2;            // a lost host's agent is started again after this, doubling (0: never)
  double hostRetryMaxS = 60;        // up to this
  bool excludeSlow = false;         // leave machines in slow_machines.out out of the next plan
  double slowThreshold = 0.15;      // slower than the stage median by this fraction
  int slowWindow = 20;              // steps per slow-machine verdict (two in a row flag a machine)
  std::string sshUser;
  int sshPort = 22;
  std::string sshIdentity;
  std::string sshKnownHosts;
  double sshConnectTimeoutS = 10;
  std::string agentPath;            // varuna_agent on every host (default: next to run_varuna)
  std::string logLevel = "info";
  std::string profile;              // the Profiler's profile.json: AutoConfig plans every launch
  double memoryPerDeviceGb = 0;     // AutoConfig's memory limit per worker (0: unlimited)
  std::string schedules = "varuna"; // AutoConfig considers these (comma list, or "all")
  bool dryRun = false;              // print the plan for the machine list and exit
  std::vector<std::string> program; // the training program and its arguments (after `--`)
};

// Reads a JSON job object; unknown keys and wrong types are ConfigErrors naming
// `source` and the key. Keys absent from `json` keep the values of `base`.
JobConfig applyJobJson(JobConfig base, const nlohmann::json& json, const std::string& source);
JobConfig parseJobConfigText(std::string_view text, const std::string& source);

// Checks values and fills defaults that depend on the machine (code_dir,
// state_dir, agent path). Throws ConfigError with the option name and the fix.
void validateJobConfig(JobConfig& config, const std::string& selfExecutable);

// The job as JSON (for state.json and `run_varuna status`).
nlohmann::json toJson(const JobConfig& config);

// How often an agent relays its workers' heartbeats (and step reports) to
// the manager (varuna_agent --beat_relay_ms): a twentieth of the heartbeat
// timeout, within 100..500 ms (500 at the default 10 s). Slower relays are
// fewer frames for the manager (at 10 000 workers most of what it reads);
// the relay's delay stays a small part of the timeout a silent rank has.
std::chrono::milliseconds agentBeatRelayInterval(const JobConfig& config);

// A rendezvous port for a job that set none (--master_port 0): random, so
// nobody on rank 0's host can count on taking it first; in 20000..32668,
// below the kernel's ephemeral ports, with room for the generation offset.
int randomRendezvousPort();

// run_varuna's command line: `--config FILE` (JSON) first, then every option
// given on the command line on top of it; the program after `--`. Throws
// ConfigError naming the option. Help and usage errors are CLI11's to print:
// returns nullopt and sets `exitCode` when the caller should exit at once.
std::optional<JobConfig> parseCommandLine(int argc, const char* const* argv, int& exitCode);

// "varuna,1f1b,interleaved:4" or "all" -> schedules (with their chunks);
// ConfigError naming --schedules. "all" is every kind, interleaved with 2
// and with 4 chunks.
std::vector<ScheduleChoice> parseScheduleList(const std::string& text);

// The variables run_varuna hands every agent and (through LaunchWorkers)
// every worker: the env file's `envFile` first, then the job's own
// (VARUNA_GLOBAL_STORE, VARUNA_KEEP_CHECKPOINTS), which win over the file's
// because the agent applies them in order.
std::vector<std::pair<std::string, std::string>> jobEnvironment(
    const JobConfig& config, std::vector<std::pair<std::string, std::string>> envFile);

// KEY=VALUE lines (optional `export `, optional quotes, # comments). Errors
// name source:line; a control-plane variable is one.
std::vector<std::pair<std::string, std::string>> parseEnvFile(std::string_view text, const std::string& source);

// The variables only varuna sets (a credential, its descriptor, the beat
// socket's, the plaintext switch): an env_file may not, and an agent drops
// them from what a manager sends.
bool isControlPlaneVariable(std::string_view name);

}  // namespace varuna
