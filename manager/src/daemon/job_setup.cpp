#include "daemon/job_setup.h"

#include <sys/stat.h>

#include <fstream>
#include <optional>
#include <random>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/secrets.h"
#include "varuna/common/time_util.h"
#include "varuna/manager/credentials.h"
#include "varuna/manager/autoconfig.h"
#include "varuna/manager/host_launcher.h"
#include "varuna/manager/planner.h"

namespace varuna {

namespace fs = std::filesystem;
using nlohmann::json;

std::string loadOrCreateToken(const fs::path& stateDir) {
  const fs::path path = stateDir / "token";
  if (std::ifstream in(path); in) {
    std::string token;
    std::getline(in, token);
    if (token.size() >= 32) return token;
  }
  std::random_device random;
  std::string token;
  const char* hex = "0123456789abcdef";
  for (int i = 0; i < 48; ++i) token += hex[random() % 16];
  ckpt::writePrivateFileAtomic(stateDir, "token", token + "\n");
  return token;
}

std::shared_ptr<const tls::CertificateCredential> loadOrCreateCa(const fs::path& stateDir, const std::string& jobSecret,
                                                                 const std::string& job) {
  // The CA file names the secret it was made with (a MAC of it, never the
  // secret): a rotated secret finds a CA of another secret and replaces it.
  const std::string tag = credentials::caTag(jobSecret);
  if (std::ifstream in(stateDir / "ca"); in) {
    std::string text, fileTag;
    std::getline(in, text);
    std::getline(in, fileTag);
    if (constantTimeEquals(fileTag, tag)) {
      try {
        return std::make_shared<const tls::CertificateCredential>(
            tls::CertificateCredential::parse(text, (stateDir / "ca").string()));
      } catch (const ConfigError& e) {
        log::warn(e.what(), "; making a new CA (agents and workers of the old one must start again)");
      }
    } else {
      log::info("the job's secret is new: making a new certificate authority (", (stateDir / "ca").string(), ")");
    }
  }
  auto ca = std::make_shared<const tls::CertificateCredential>(tls::CertificateCredential::makeRoot(job));
  ckpt::writePrivateFileAtomic(stateDir, "ca", ca->encode() + "\n" + tag + "\n");
  return ca;
}

void writeJoinCredential(const fs::path& stateDir, const std::string& jobSecret, int64_t expiresUnixS) {
  ckpt::writePrivateFileAtomic(stateDir, "join_token", credentials::join(jobSecret, expiresUnixS) + "\n");
}

AgentPool::Settings agentPoolSettings(const JobConfig& config, std::string address, std::string token,
                                     std::shared_ptr<const tls::CertificateCredential> ca,
                                     const std::vector<std::pair<std::string, std::string>>& env,
                                     std::chrono::milliseconds helloDeadline) {
  AgentPool::Settings settings;
  settings.advertisedAddress = std::move(address);
  settings.token = std::move(token);
  settings.ca = std::move(ca);
  settings.launchesFile = (fs::path(config.stateDir) / "agent_launches").string();
  settings.agentEnvironment = env;
  settings.heartbeatTimeout = millis(std::max(config.heartbeatTimeoutS, 3.0));
  settings.helloWait = helloDeadline;
  // A joined agent's timing, as agentCommand's --grace_s, --lost_manager_ms and --beat_relay_ms.
  settings.joinedAgentGrace = millis(config.agentGraceS);
  settings.joinedAgentLostManager = millis(std::max(config.heartbeatTimeoutS, 3.0) + config.agentGraceS);
  settings.joinedAgentBeatRelay = agentBeatRelayInterval(config);
  settings.retry = {config.hostRetryS > 0 ? millis(config.hostRetryS) : std::chrono::milliseconds(0),
                    millis(config.hostRetryMaxS)};
  return settings;
}

json readJsonFile(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return json();
  try {
    return json::parse(in);
  } catch (const std::exception&) {
    return json();
  }
}

void claimGlobalStore(const fs::path& store, const std::string& job) {
  const json owner = readJsonFile(store / ckpt::kJobFile);
  if (owner.is_object() && owner.contains("job") && owner["job"].is_string()) {
    const std::string holder = owner["job"].get<std::string>();
    if (holder == job) return;
    throw ConfigError(strCat("--global_store ", store.string(), " holds the checkpoints of job '", holder,
                             "', not of job '", job, "': give this job its own --global_store, or run it as --job ",
                             holder, " to continue that job"));
  }
  json claimed = owner.is_object() ? owner : json::object();  // keeps a generation record already there
  claimed["job"] = job;
  ckpt::writeFileAtomic(store, ckpt::kJobFile, claimed.dump() + "\n");
}

json previousState(const JobConfig& config) {
  const fs::path stateDir = config.stateDir;
  const json previous = readJsonFile(stateDir / "state.json");
  if (previous.is_object() && previous.contains("job") && previous["job"] != config.job) {
    throw ConfigError(strCat("--state_dir ", stateDir.string(), " holds the state of job ", previous["job"].dump(),
                             ", not of job '", config.job, "': give each job its own --state_dir (the default, ",
                             "/var/lib/varuna/JOB or .varuna/JOB, is one per job)"));
  }
  return previous;
}

int firstGeneration(const JobConfig& config, const json& previous, EventLog& events) {
  // A state file from an earlier manager of this job: continue its numbering.
  int first = 1;
  if (previous.is_object() && previous.value("job", "") == config.job) {
    first = previous.value("generation", 0) + 1;
    const std::string phase = previous.value("phase", "");
    log::warn("state of an earlier manager of job '", config.job, "' found (phase ", phase, ", generation ", first - 1,
              "): continuing from the last complete checkpoint");
    events.write("manager_restarted", {{"previous_phase", phase}, {"previous_generation", first - 1}});
  }
  // The store's generation record (fencing) is the other memory of earlier
  // launches: without state.json (a new --state_dir) the numbering must still
  // go past it, or this manager's workers would count as superseded.
  std::optional<int64_t> recorded;
  try {
    recorded = ckpt::recordedGeneration(config.globalStore);
  } catch (const std::exception& e) {
    log::warn("cannot read the generation record in ", config.globalStore, ": ", e.what());
  }
  if (recorded && *recorded >= first) {
    log::warn("the store records generation ", *recorded, " of job '", config.job, "': continuing with generation ",
              *recorded + 1);
    first = static_cast<int>(*recorded + 1);
  }
  return first;
}

std::string advertisedAddress(const JobConfig& config, const std::vector<Machine>& listed, uint16_t port) {
  bool allLocal = true;
  for (const auto& m : listed) allLocal &= isLocalHost(m.host);
  std::string dialIp = config.managerIp;
  if (dialIp.empty() || dialIp == "0.0.0.0") {
    if (!allLocal) {
      throw ConfigError("--manager_ip is required when the machine list has other machines: the address of this "
                        "head node the hosts can reach");
    }
    dialIp = "127.0.0.1";
  }
  return dialIp.find(':') != std::string::npos ? strCat("[", dialIp, "]:", port) : strCat(dialIp, ":", port);
}

// --- declared in manager_daemon.h (run_varuna's --dry_run uses them) ---------

AutoConfigRequest autoConfigSettings(const JobConfig& config) {
  AutoConfigRequest settings;
  settings.globalBatch = config.batchSize;
  settings.memoryPerDeviceBytes = static_cast<int64_t>(config.memoryPerDeviceGb * (1LL << 30));
  settings.schedules = parseScheduleList(config.schedules);
  settings.fixedStages = config.nstages;
  settings.fixedChunk = config.chunkSize;
  return settings;
}

std::string dryRunReport(const JobConfig& config) {
  const auto machines = readMachineList(config.machineList, config.gpusPerNode);
  if (config.profile.empty()) {
    const Plan plan = makePlan({machines, config.nstages, config.batchSize, config.chunkSize, {}});
    return strCat("dry run: ", machines.size(), " machine(s) in ", config.machineList, "\nplan: ", plan.describe(),
                  "\n(no --profile: P and the micro-batch are as given; give a profile to let AutoConfig choose)\n");
  }
  AutoConfigRequest request = autoConfigSettings(config);
  request.machines = machines;
  const auto result = autoConfigure(profile::readProfile(config.profile), request);
  return strCat("dry run: ", machines.size(), " machine(s) in ", config.machineList, ", profile ", config.profile,
                "\n", result.explain(), "\nplan: ", result.best.plan.describe(), "\n\n", result.table(), "\n");
}

void chooseRendezvousPort(JobConfig& config) {
  if (config.masterPort != 0) return;
  config.masterPort = randomRendezvousPort();
  log::info("workers rendezvous on port ", config.masterPort, " of rank 0's host (+ the generation's offset, ",
            "--master_port to choose)");
}

}  // namespace varuna
