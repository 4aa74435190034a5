// Joining: a host that comes to the manager by itself (`varuna_agent --join`)
// instead of being started by it. Schedulers (a Slurm job array, Kubernetes
// pods) start the agent; it presents the job's join credential
// (<state_dir>/join_token, credentials.h) with its host name and slots, and
// gets back the host's own agent credential and the job's env_file
// variables (proto::Joined). From there it is an agent like any other: it
// dials again and says hello as its host's agent. docs/deployment.md.
#pragma once

#include <chrono>
#include <string>

#include "varuna/common/protocol.h"

namespace varuna {

struct JoinRequest {
  std::string manager;     // host:port
  std::string credential;  // the join credential
  std::string host;
  int slots = 1;
  // How long to keep trying while the manager cannot be reached yet (its job
  // may start after ours) or still holds an earlier agent of this host (a
  // requeued task whose predecessor's loss it has not seen yet).
  std::chrono::milliseconds wait{120000};
};

// The manager's answer. Throws ConfigError when the manager refuses the join
// for good (a wrong or expired credential, a bad name or slot count: its
// reason), Error when it could not be done within `wait`.
proto::Joined joinManager(const JoinRequest& request);

// The join credential: the first line of `path` (a file only the user can
// read: its mode must not let group or others read it), else
// VARUNA_JOIN_TOKEN (scrubbed from the environment once read).
std::string readJoinCredential(const std::string& path);

}  // namespace varuna
