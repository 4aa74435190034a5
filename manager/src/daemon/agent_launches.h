// AgentLaunches: which starts of each listed host's agent its certificates
// may speak for (P15: an agent credential per host and launch). With the
// job's CA, every start of a host's agent gets a host CA naming a random
// nonce of that start (certificate_credential.h); the agent's notifier and
// workers hold certificates that CA issued, so they stand or fall with it.
//
// The rules:
//  - the latest start's nonce is valid;
//  - earlier starts' stay valid until the latest start's agent says hello:
//    run_varuna starts a new agent while the old one may still run (a lost
//    connection, a restarted manager), and that one's notifier must still
//    be heard (a preemption notice in that window must not be lost);
//  - once it has said hello, every earlier start is revoked (kRevoked), as
//    is a nonce this job never issued for the host, or a host forgotten.
//  - a restarted manager reads its predecessor's nonces back (toJson /
//    restore) as earlier starts: its own agents start anew, and the running
//    ones stay valid until the new ones say hello.
// Bookkeeping only, no I/O: the agent pool persists toJson() in the state
// folder.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace varuna {

class AgentLaunches {
 public:
  enum class Standing { kLatest, kEarlier, kRevoked };
  // Earlier starts kept per host (a host whose starts keep failing must not
  // pile them up): the oldest go first.
  static constexpr size_t kMaxEarlier = 8;

  // A new start of `host`'s agent: its nonce, for the host CA it is given.
  std::string start(const std::string& host);
  // The agent that holds `nonce` said hello: if it is the latest start's,
  // every earlier start of the host is revoked from here. Returns whether
  // anything changed.
  bool agentUp(const std::string& host, const std::string& nonce);
  Standing standing(const std::string& host, const std::string& nonce) const;
  // The host left the job: every start of it is revoked.
  bool forget(const std::string& host);
  // Hosts with a start held valid.
  std::vector<std::string> hosts() const;

  // {"host": ["latest", "earlier", ...]}.
  nlohmann::json toJson() const;
  // What toJson wrote (by an earlier manager): every nonce an earlier start.
  // Entries that are not host -> list of strings are skipped.
  void restore(const nlohmann::json& saved);

 private:
  struct Host {
    std::string latest;
    std::vector<std::string> earlier;  // oldest first
  };
  std::map<std::string, Host> hosts_;
};

}  // namespace varuna
