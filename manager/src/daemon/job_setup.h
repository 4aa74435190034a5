// What run_varuna sets up once, at start-up, before its loop runs: the job's
// token, its claim on the checkpoint store, the generation to continue from,
// the address agents and workers dial. Each throws ConfigError for a setup
// the operator must fix (the message names the flag and the fix).
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "varuna/common/certificate_credential.h"
#include "varuna/common/machine_list.h"
#include "varuna/manager/autoconfig.h"
#include "daemon/agent_pool.h"
#include "loop/event_log.h"
#include "varuna/manager/job_config.h"

namespace varuna {

// The per-job secret every connection must present. Kept in the state folder
// (mode 0600) so a restarted manager and the notifiers keep using it.
std::string loadOrCreateToken(const std::filesystem::path& stateDir);

// The job's certificate authority (certificate_credential.h), kept in
// <state_dir>/ca (mode 0600) beside the secret it belongs to: a restarted
// manager keeps it, so agents that ran on are still the job's; a new secret
// (the token deleted: a rotation) makes a new CA, and every certificate of
// the old one fails the handshake.
std::shared_ptr<const tls::CertificateCredential> loadOrCreateCa(const std::filesystem::path& stateDir,
                                                                 const std::string& jobSecret, const std::string& job);

// <state_dir>/join_token (mode 0600): the join credential hosts present to
// join by themselves (credentials.h), valid until `expiresUnixS`.
void writeJoinCredential(const std::filesystem::path& stateDir, const std::string& jobSecret, int64_t expiresUnixS);

// A checkpoint folder belongs to one job: a new job pointed at another job's
// store would silently resume that job's weights. The first manager to use a
// store writes its job name there; later managers of the same job continue,
// others are refused. (A store without the file, e.g. filled by
// scripts/varuna_launch.py, is adopted.)
void claimGlobalStore(const std::filesystem::path& store, const std::string& job);

// The agent pool's settings for this job (`ca` null: derived credentials).
AgentPool::Settings agentPoolSettings(const JobConfig& config, std::string address, std::string token,
                                     std::shared_ptr<const tls::CertificateCredential> ca,
                                     const std::vector<std::pair<std::string, std::string>>& env,
                                     std::chrono::milliseconds helloDeadline);

// A JSON file, or null if it is missing or not JSON.
nlohmann::json readJsonFile(const std::filesystem::path& path);

// state.json of an earlier manager, checked to be this job's (else ConfigError).
nlohmann::json previousState(const JobConfig& config);

// --master_port 0 (the default): a random rendezvous port, logged.
void chooseRendezvousPort(JobConfig& config);

// The first generation this manager launches: past the earlier manager's
// (state.json) and past the store's generation record (fencing), so that no
// worker of this manager counts as superseded.
int firstGeneration(const JobConfig& config, const nlohmann::json& previous, EventLog& events);

// host:port the agents and workers dial, from --manager_ip (required unless
// every listed machine is this one).
std::string advertisedAddress(const JobConfig& config, const std::vector<Machine>& listed, uint16_t port);

// AutoConfig's request for this job (machines filled in by the caller).
AutoConfigRequest autoConfigSettings(const JobConfig& config);
// --dry_run: the plan run_varuna would launch on the machine list now (with
// AutoConfig's ranked table when a profile is given). Throws ConfigError.
std::string dryRunReport(const JobConfig& config);

}  // namespace varuna
