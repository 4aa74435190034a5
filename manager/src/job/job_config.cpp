#include "varuna/manager/job_config.h"

#include <algorithm>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <fstream>
#include <map>
#include <random>
#include <variant>

#include "varuna/common/errors.h"
#include "varuna/common/agent_beat.h"
#include "varuna/common/control_tls.h"
#include "varuna/common/loopback.h"
#include "varuna/common/launch_contract.h"

namespace varuna {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// One table drives JSON parsing, JSON output and (in run_varuna's CLI) the
// option names, so the three never drift apart.
using Member = std::variant<std::string JobConfig::*, int JobConfig::*, int64_t JobConfig::*, double JobConfig::*,
                            bool JobConfig::*, std::vector<std::string> JobConfig::*>;
template <typename M>
struct MemberType;
template <typename T>
struct MemberType<T JobConfig::*> {
  using type = T;
};

struct Field {
  const char* key;
  Member member;
  const char* help;
};

const std::vector<Field>& fields() {
  static const std::vector<Field> table = {
      {"job", &JobConfig::job, "job name: logs, state folder, agent folders"},
      {"machine_list", &JobConfig::machineList, "file: one host per line, `host [slots=N]`; watched while the job runs"},
      {"machine_source", &JobConfig::machineSource,
       "list (default: the hosts of --machine_list) or join (no list: hosts join by themselves with "
       "`varuna_agent --join`, e.g. tasks of a Slurm job array or Kubernetes pods)"},
      {"min_hosts", &JobConfig::minHosts,
       "start training once this many hosts are usable, growing as more come (default 0: with a list, once every "
       "listed agent started or failed; with joins, at the first host)"},
      {"join_ttl_h", &JobConfig::joinTtlH,
       "hours the join credential in <state_dir>/join_token stays valid; run_varuna renews the file at half of it "
       "(default 720)"},
      {"gpus_per_node", &JobConfig::gpusPerNode, "slots of a host without slots=N (default 1)"},
      {"nstages", &JobConfig::nstages, "pipeline stages P (without --profile: required)"},
      {"chunk_size", &JobConfig::chunkSize, "micro-batch size (without --profile: required)"},
      {"batch_size", &JobConfig::batchSize, "global batch, constant across morphs"},
      {"code_dir", &JobConfig::codeDir, "folder the workers start in (default: here)"},
      {"env_file", &JobConfig::envFile, "KEY=VALUE lines for agents and workers"},
      {"no_morphing", &JobConfig::noMorphing, "run once: any failure stops the job"},
      {"manager_ip", &JobConfig::managerIp, "this head node's address agents and workers dial"},
      {"port", &JobConfig::port, "control port (default 0: any free port)"},
      {"insecure_plaintext_control", &JobConfig::insecurePlaintextControl,
       "control connections without TLS: whoever can reach the port or read the traffic speaks for the job; only "
       "with a loopback --manager_ip (127.0.0.1), for development"},
      {"master_port", &JobConfig::masterPort, "workers' rendezvous port on rank 0's host, + generation offset (default 0: a random one)"},
      {"metrics_port", &JobConfig::metricsPort,
       "serve Prometheus metrics at http://<manager_ip>:PORT/metrics (0: any free port, named in state.json; "
       "default -1: off)"},
      {"global_store", &JobConfig::globalStore, "checkpoint folder every worker can reach"},
      {"keep_checkpoints", &JobConfig::keepCheckpoints,
       "complete checkpoints kept in --global_store; older ones and the remains of interrupted ones are removed "
       "(default 3; 0: keep every checkpoint)"},
      {"state_dir", &JobConfig::stateDir, "state.json, events.jsonl, slow_machines.out, token"},
      {"heartbeat_timeout_s", &JobConfig::heartbeatTimeoutS, "a worker silent this long is hung (default 10)"},
      {"hang_timeout_s", &JobConfig::hangTimeoutS,
       "no rank finished a step this long: the generation is hung and relaunched from the latest checkpoint; set it "
       "well above the longest step or pause between steps (default 600; 0: off)"},
      {"startup_timeout_s", &JobConfig::startupTimeoutS, "launch to a worker's first hello (default 120)"},
      {"checkpoint_timeout_s", &JobConfig::checkpointTimeoutS, "a preemption's checkpoint must finish within this (default 120)"},
      {"no_salvage", &JobConfig::noSalvage,
       "on a sudden loss (no notice), roll back to the latest checkpoint instead of checkpointing the step the "
       "survivors hold (docs/salvage.md)"},
      {"salvage_timeout_s", &JobConfig::salvageTimeoutS,
       "the survivors' reports, then the salvage writes, must each finish within this, else the job falls back to "
       "the latest checkpoint (default 30)"},
      {"agent_grace_s", &JobConfig::agentGraceS, "agents kill their workers when the manager is gone this long (default 5)"},
      {"agent_sigterm_notice_s", &JobConfig::agentSigtermNoticeS,
       "a SIGTERM to an agent is its scheduler's preemption notice: the host goes this long after it (Slurm's "
       "GraceTime, Kubernetes' terminationGracePeriodSeconds); 0 (default): a SIGTERM stops the agent at once"},
      {"max_failures", &JobConfig::maxFailures, "failures within --failure_window_s before giving up (default 3)"},
      {"failure_window_s", &JobConfig::failureWindowS, "window of --max_failures (default 600)"},
      {"restart_backoff_s", &JobConfig::restartBackoffS, "wait before relaunching after a failure, doubling (default 1)"},
      {"host_retry_s", &JobConfig::hostRetryS,
       "a lost host's agent is started again after this, doubling up to --host_retry_max_s (default 2; 0: only when "
       "the machine list is written)"},
      {"host_retry_max_s", &JobConfig::hostRetryMaxS, "longest wait between start-ups of a lost host's agent (default 60)"},
      {"exclude_slow", &JobConfig::excludeSlow, "leave machines in slow_machines.out out of the next plan"},
      {"slow_threshold", &JobConfig::slowThreshold, "slower than the stage median by this fraction flags a machine (default 0.15)"},
      {"slow_window", &JobConfig::slowWindow, "steps per slow-machine verdict (default 20)"},
      {"ssh_user", &JobConfig::sshUser, "SSH user, and whom run_varuna as root starts this machine's own agents as (default: the current user)"},
      {"ssh_port", &JobConfig::sshPort, "SSH port (default 22)"},
      {"ssh_identity", &JobConfig::sshIdentity, "SSH private key (default: libssh's)"},
      {"ssh_known_hosts", &JobConfig::sshKnownHosts, "known_hosts file (default ~/.ssh/known_hosts)"},
      {"ssh_connect_timeout_s", &JobConfig::sshConnectTimeoutS, "SSH connect timeout (default 10)"},
      {"agent_path", &JobConfig::agentPath, "varuna_agent on every host (default: next to run_varuna)"},
      {"log_level", &JobConfig::logLevel, "debug, info, warn or error"},
      {"profile", &JobConfig::profile, "the Profiler's profile.json: AutoConfig plans every launch"},
      {"memory_per_device_gb", &JobConfig::memoryPerDeviceGb, "AutoConfig's memory limit per worker (default 0: unlimited)"},
      {"schedules", &JobConfig::schedules, "schedules AutoConfig may use: varuna,1f1b,gpipe,zb-h1,interleaved[:chunks],zbv or all (default varuna)"},
      {"dry_run", &JobConfig::dryRun, "print the plan for the machine list and exit"},
      {"program", &JobConfig::program, ""},
  };
  return table;
}

template <typename T>
const char* typeWord() {
  if constexpr (std::is_same_v<T, std::string>) return "a string";
  if constexpr (std::is_same_v<T, bool>) return "true or false";
  if constexpr (std::is_same_v<T, double>) return "a number";
  if constexpr (std::is_same_v<T, std::vector<std::string>>) return "a list of strings";
  return "an integer";
}

template <typename T>
bool hasType(const json& value) {
  if constexpr (std::is_same_v<T, std::string>) return value.is_string();
  if constexpr (std::is_same_v<T, bool>) return value.is_boolean();
  if constexpr (std::is_same_v<T, double>) return value.is_number();
  if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    if (!value.is_array()) return false;
    for (const auto& item : value) {
      if (!item.is_string()) return false;
    }
    return true;
  }
  if constexpr (std::is_same_v<T, int> || std::is_same_v<T, int64_t>) {
    return value.is_number_integer() &&
           (std::is_same_v<T, int64_t> || (value.get<int64_t>() >= INT32_MIN && value.get<int64_t>() <= INT32_MAX));
  }
}

std::string knownKeys() {
  std::string out;
  for (const auto& f : fields()) out += (out.empty() ? "" : ", ") + std::string(f.key);
  return out;
}

void requirePositive(double value, const char* option) {
  if (!(value > 0)) throw ConfigError(strCat("--", option, " must be > 0, got ", value));
}

std::string unquote(std::string value) {
  if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'') && value.back() == value.front()) {
    return value.substr(1, value.size() - 2);
  }
  return value;
}

std::string trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string_view::npos) return "";
  const auto e = s.find_last_not_of(" \t\r");
  return std::string(s.substr(b, e - b + 1));
}

}  // namespace

JobConfig applyJobJson(JobConfig base, const json& object, const std::string& source) {
  if (!object.is_object()) throw ConfigError(strCat(source, ": a job config must be a JSON object {\"key\": value}"));
  for (const auto& item : object.items()) {
    const std::string key = item.key();  // named copies: lambdas cannot capture structured bindings on clang 14
    const json& value = item.value();
    const auto it = std::find_if(fields().begin(), fields().end(), [&](const Field& f) { return key == f.key; });
    if (it == fields().end()) {
      throw ConfigError(strCat(source, ": unknown key '", key, "'; known keys: ", knownKeys()));
    }
    std::visit(
        [&](auto member) {
          using T = typename MemberType<decltype(member)>::type;
          if (!hasType<T>(value)) {
            throw ConfigError(strCat(source, ": '", key, "' must be ", typeWord<T>(), ", got ", value.dump()));
          }
          base.*member = value.get<T>();
        },
        it->member);
  }
  return base;
}

JobConfig parseJobConfigText(std::string_view text, const std::string& source) {
  json object;
  try {
    object = json::parse(text);
  } catch (const json::exception& e) {  // parse_error; out_of_range (a number too large)
    throw ConfigError(strCat(source, ": not valid JSON (", e.what(), ")"));
  }
  return applyJobJson(JobConfig{}, object, source);
}

json toJson(const JobConfig& config) {
  json out = json::object();
  for (const auto& f : fields()) {
    std::visit([&](auto member) { out[f.key] = config.*member; }, f.member);
  }
  return out;
}

void validateJobConfig(JobConfig& config, const std::string& selfExecutable) {
  if (config.job.empty() || config.job.find_first_of("/ \t\n") != std::string::npos) {
    throw ConfigError(strCat("--job '", config.job, "' must be a non-empty name without '/' or spaces"));
  }
  const bool joinOnly = config.machineSource == "join";
  if (!joinOnly && config.machineSource != "list") {
    throw ConfigError(strCat("--machine_source must be list or join, got '", config.machineSource, "'"));
  }
  if (joinOnly && !config.machineList.empty()) {
    throw ConfigError("--machine_list and --machine_source join exclude each other: with join, hosts join by "
                      "themselves (drop --machine_list, or use --machine_source list)");
  }
  if (!joinOnly && config.machineList.empty()) {
    throw ConfigError("--machine_list is required: a file with one host per line (e.g. `127.0.0.1 slots=2`), or "
                      "--machine_source join for hosts that join by themselves");
  }
  if (joinOnly && config.dryRun) {
    throw ConfigError("--dry_run plans for the hosts of a machine list: give --machine_list (with --machine_source "
                      "join there are no hosts before they join)");
  }
  if (config.minHosts < 0) throw ConfigError(strCat("--min_hosts must be >= 0, got ", config.minHosts));
  if (!(config.joinTtlH > 0) || config.joinTtlH > 24 * 365 * 10) {
    throw ConfigError(strCat("--join_ttl_h must be > 0 and at most ten years, got ", config.joinTtlH));
  }
  if (config.gpusPerNode < 1) throw ConfigError(strCat("--gpus_per_node must be >= 1, got ", config.gpusPerNode));
  const bool autoConfig = !config.profile.empty();
  if (config.nstages < 0 || (config.nstages == 0 && !autoConfig)) {
    throw ConfigError(strCat("--nstages must be >= 1 (got ", config.nstages,
                             "), or leave it out and give --profile so AutoConfig chooses"));
  }
  if (config.batchSize < 1) throw ConfigError(strCat("--batch_size (global) must be >= 1, got ", config.batchSize));
  if (config.chunkSize < 0 || (config.chunkSize == 0 && !autoConfig)) {
    throw ConfigError(strCat("--chunk_size (micro-batch) must be >= 1 (got ", config.chunkSize,
                             "), or leave it out and give --profile so AutoConfig chooses"));
  }
  if (config.memoryPerDeviceGb < 0) throw ConfigError("--memory_per_device_gb must be >= 0 (0: unlimited)");
  parseScheduleList(config.schedules);
  if (autoConfig) config.profile = fs::absolute(config.profile).lexically_normal().string();
  if (autoConfig && !fs::exists(config.profile)) {
    throw ConfigError(strCat("--profile ", config.profile, " does not exist (run the profiler first, docs/profile.md)"));
  }
  if (config.port < 0 || config.port > 65535) throw ConfigError(strCat("--port must be 0..65535, got ", config.port));
  if (config.metricsPort < -1 || config.metricsPort > 65535) {
    throw ConfigError(strCat("--metrics_port must be 0..65535 (0: any free port; leave it out for no metrics), got ",
                             config.metricsPort));
  }
  if (config.insecurePlaintextControl && !tls::isLoopbackAddress(config.managerIp)) {
    throw ConfigError(strCat("--insecure_plaintext_control needs a loopback --manager_ip (127.0.0.1 or ::1), got '",
                             config.managerIp, "': over a network the control plane must be TLS (drop the flag)"));
  }
  if (config.masterPort != 0 && (config.masterPort < 1024 || config.masterPort > 65000)) {
    throw ConfigError(strCat("--master_port must be 1024..65000 (or 0: a random one), got ", config.masterPort));
  }
  if (config.sshPort < 1 || config.sshPort > 65535) {
    throw ConfigError(strCat("--ssh_port must be 1..65535, got ", config.sshPort));
  }
  requirePositive(config.heartbeatTimeoutS, "heartbeat_timeout_s");
  requirePositive(config.startupTimeoutS, "startup_timeout_s");
  if (!(config.hangTimeoutS >= 0)) {
    throw ConfigError(strCat("--hang_timeout_s must be >= 0 (0 turns hang detection off), got ", config.hangTimeoutS));
  }
  requirePositive(config.checkpointTimeoutS, "checkpoint_timeout_s");
  requirePositive(config.agentGraceS, "agent_grace_s");
  if (!(config.agentSigtermNoticeS >= 0)) {
    throw ConfigError(strCat("--agent_sigterm_notice_s must be >= 0 (0: off), got ", config.agentSigtermNoticeS));
  }
  requirePositive(config.sshConnectTimeoutS, "ssh_connect_timeout_s");
  requirePositive(config.failureWindowS, "failure_window_s");
  if (config.restartBackoffS < 0) throw ConfigError("--restart_backoff_s must be >= 0");
  if (!(config.salvageTimeoutS > 0)) {
    throw ConfigError(strCat("--salvage_timeout_s must be > 0 (turn salvage off with --no_salvage), got ",
                             config.salvageTimeoutS));
  }
  if (config.hostRetryS < 0) throw ConfigError("--host_retry_s must be >= 0 (0: lost hosts come back only when the machine list is written)");
  if (config.hostRetryS > 0 && config.hostRetryMaxS < config.hostRetryS) {
    throw ConfigError(strCat("--host_retry_max_s (", config.hostRetryMaxS, ") must be >= --host_retry_s (",
                             config.hostRetryS, ")"));
  }
  if (config.maxFailures < 0) throw ConfigError("--max_failures must be >= 0");
  if (!(config.slowThreshold > 0)) throw ConfigError("--slow_threshold must be > 0 (e.g. 0.15 for 15 %)");
  if (config.slowWindow < 1) throw ConfigError("--slow_window must be >= 1 step");
  if (config.keepCheckpoints < 0) {
    throw ConfigError(strCat("--keep_checkpoints must be >= 0 (0 keeps every checkpoint), got ", config.keepCheckpoints));
  }
  if (config.program.empty()) {
    throw ConfigError("no training program: put it and its arguments after `--` (e.g. run_varuna ... -- ./train_gpt "
                      "--steps 100) or as \"program\" in the job config");
  }
  if (config.globalStore.empty()) {
    throw ConfigError("--global_store is required: the checkpoint folder every worker can reach (a shared filesystem)");
  }
  std::error_code ec;
  if (config.codeDir.empty()) config.codeDir = fs::current_path().string();
  config.codeDir = fs::absolute(config.codeDir, ec).lexically_normal().string();
  config.globalStore = fs::absolute(config.globalStore, ec).lexically_normal().string();
  if (!joinOnly) {
    config.machineList = fs::absolute(config.machineList, ec).lexically_normal().string();
    if (!fs::exists(config.machineList)) {
      throw ConfigError(strCat("--machine_list ", config.machineList, " does not exist"));
    }
  }
  if (!config.envFile.empty() && !fs::exists(config.envFile)) {
    throw ConfigError(strCat("--env_file ", config.envFile, " does not exist"));
  }
  if (config.stateDir.empty()) {
    config.stateDir = (::geteuid() == 0 ? fs::path("/var/lib/varuna") : fs::path(".varuna")) / config.job;
  }
  config.stateDir = fs::absolute(config.stateDir, ec).lexically_normal().string();
  if (config.agentPath.empty()) {
    config.agentPath = (fs::path(selfExecutable).parent_path() / "varuna_agent").string();
  }
}

std::optional<JobConfig> parseCommandLine(int argc, const char* const* argv, int& exitCode) {
  CLI::App app{"run_varuna: runs a training job on the machines of a machine list and keeps it running as they come "
               "and go.\n  run_varuna [options] -- ./train_program [its arguments]\n"
               "  run_varuna status --state_dir DIR [--json] [--watch [--interval S] [--count N]]"};
  std::string configFile;
  app.add_option("--config", configFile, "JSON job config (keys: the option names); the command line overrides it");
  std::map<std::string, std::string> given;
  std::map<std::string, bool> flags;
  std::vector<std::string> program;
  for (const auto& f : fields()) {
    const std::string key = f.key;
    if (key == "program") continue;
    if (std::holds_alternative<bool JobConfig::*>(f.member)) {
      app.add_flag("--" + key, flags[key], f.help);
    } else {
      app.add_option("--" + key, given[key], f.help);
    }
  }
  app.add_option("program", program, "the training program and its arguments, after --");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    exitCode = app.exit(e);
    if (exitCode != 0) exitCode = kExitConfigError;
    return std::nullopt;
  }
  JobConfig config;
  if (!configFile.empty()) {
    std::ifstream in(configFile);
    if (!in) throw ConfigError(strCat("--config ", configFile, " cannot be read"));
    std::string text((std::istreambuf_iterator<char>(in)), {});
    config = parseJobConfigText(text, configFile);
  }
  json overrides = json::object();
  for (const auto& f : fields()) {
    const std::string key = f.key;
    if (flags.count(key) && app.count("--" + key)) overrides[key] = true;
    if (!given.count(key) || !app.count("--" + key)) continue;
    const std::string& text = given[key];
    std::visit(
        [&](auto member) {
          using T = typename MemberType<decltype(member)>::type;
          if constexpr (std::is_same_v<T, std::string>) {
            overrides[key] = text;
          } else if constexpr (std::is_same_v<T, int> || std::is_same_v<T, int64_t> || std::is_same_v<T, double>) {
            try {
              size_t used = 0;
              const double value = std::stod(text, &used);
              if (used != text.size()) throw std::invalid_argument(text);
              if (std::is_same_v<T, double>) {
                overrides[key] = value;
              } else {
                overrides[key] = std::stoll(text, &used);
                if (used != text.size()) throw std::invalid_argument(text);
              }
            } catch (const std::exception&) {
              throw ConfigError(strCat("--", key, " must be ", typeWord<T>(), ", got '", text, "'"));
            }
          }
        },
        f.member);
  }
  if (!program.empty()) overrides["program"] = program;
  return applyJobJson(config, overrides, "the command line");
}

std::vector<ScheduleChoice> parseScheduleList(const std::string& text) {
  if (text == "all") {
    std::vector<ScheduleChoice> all;
    for (const auto& name : scheduleNames()) all.push_back(parseScheduleKind(name));
    all.push_back({ScheduleKind::kInterleaved1F1B, 4});
    return all;
  }
  std::vector<ScheduleChoice> kinds;
  for (size_t start = 0; start <= text.size();) {
    const auto end = std::min(text.find(',', start), text.size());
    const std::string name = trim(std::string_view(text).substr(start, end - start));
    try {
      kinds.push_back(parseScheduleChoice(name));
    } catch (const std::exception& e) {
      throw ConfigError(strCat("--schedules '", text, "': ", e.what()));
    }
    start = end + 1;
  }
  return kinds;
}

std::vector<std::pair<std::string, std::string>> jobEnvironment(
    const JobConfig& config, std::vector<std::pair<std::string, std::string>> envFile) {
  auto env = std::move(envFile);
  LaunchArgs store;
  store.globalStore = config.globalStore;
  store.keepCheckpoints = config.keepCheckpoints;
  const auto entries = storeEnvironment(store);
  env.insert(env.end(), entries.begin(), entries.end());
  return env;
}

std::vector<std::pair<std::string, std::string>> parseEnvFile(std::string_view text, const std::string& source) {
  std::vector<std::pair<std::string, std::string>> out;
  int lineNumber = 0;
  size_t pos = 0;
  while (pos <= text.size()) {
    const auto end = std::min(text.find('\n', pos), text.size());
    ++lineNumber;
    std::string line = trim(text.substr(pos, end - pos));
    pos = end + 1;
    if (line.empty() || line.front() == '#') continue;
    if (line.rfind("export ", 0) == 0) line = trim(line.substr(7));
    const auto eq = line.find('=');
    const std::string key = eq == std::string::npos ? line : trim(line.substr(0, eq));
    const bool validKey = !key.empty() && !std::isdigit(static_cast<unsigned char>(key[0])) &&
                          key.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_") ==
                              std::string::npos;
    if (eq == std::string::npos || !validKey) {
      throw ConfigError(strCat(source, ":", lineNumber, ": expected KEY=VALUE (letters, digits, _), got '", line, "'"));
    }
    if (isControlPlaneVariable(key)) {
      throw ConfigError(strCat(source, ":", lineNumber, ": ", key,
                               " is set by varuna itself, not by an env_file: it carries a credential or decides "
                               "whether the control plane is encrypted (use run_varuna's --insecure_plaintext_control "
                               "for loopback development); remove the line"));
    }
    out.emplace_back(key, unquote(trim(line.substr(eq + 1))));
  }
  return out;
}

bool isControlPlaneVariable(std::string_view name) {
  for (const char* reserved : {contract::kJobTokenEnv, contract::kJobTokenFdEnv, kAgentBeatFdEnv, tls::kPlaintextEnv}) {
    if (name == reserved) return true;
  }
  return false;
}

std::chrono::milliseconds agentBeatRelayInterval(const JobConfig& config) {
  const auto twentieth = std::chrono::milliseconds(static_cast<int64_t>(config.heartbeatTimeoutS * 1000 / 20));
  return std::clamp(twentieth, std::chrono::milliseconds(100), std::chrono::milliseconds(500));
}

int randomRendezvousPort() {
  // Below Linux's ephemeral ports (32768 and up), so no connection's local
  // port takes it, with room for the generation offset (+99).
  constexpr int kFirst = 20000, kLast = 32768 - 100;
  std::random_device entropy;
  return std::uniform_int_distribution<int>(kFirst, kLast)(entropy);
}

}  // namespace varuna
