// SimHostLauncher: the HostLauncher seam of an in-process ManagerDaemon,
// starting a simulated agent in a SimCluster instead of running the agent
// command over /bin/sh or SSH. It reads what the real agent would from the
// daemon's command line (`--manager 'ADDRESS'`, `--token_stdin`) and its
// stdin (the job token's line); a command without a token fails as
// varuna_agent does (exit 2, a configuration error that stops the job), a
// host made unreachable (SimCluster::setHostReachable) fails as SSH to a
// dead host does. Like `varuna_agent --daemonize` it returns once the agent
// has connected and said hello.
// Called on the daemon's launch threads: each call posts the start-up to the
// cluster's io_context (the daemon's own) and waits for its result; it gives
// up when the cluster shuts down or after `timeout`. Callable from several
// threads at once.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "sim_cluster.h"
#include "varuna/manager/host_launcher.h"

namespace varuna::sim {

class SimHostLauncher : public HostLauncher {
 public:
  explicit SimHostLauncher(SimCluster& cluster, std::chrono::milliseconds timeout = std::chrono::seconds(10))
      : io_(cluster.io()), gate_(cluster.launchGate()), timeout_(timeout) {}
  HostCommandResult run(const std::string& host, const std::string& command, const std::string& input) override;
  // The agent commands it was given (with a manager address), oldest first.
  std::vector<std::string> commands() const {
    std::lock_guard<std::mutex> lock(commandsMutex_);
    return commands_;
  }

 private:
  boost::asio::io_context& io_;
  std::shared_ptr<LaunchGate> gate_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex commandsMutex_;  // run() is called on several launch threads
  std::vector<std::string> commands_;
};

}  // namespace varuna::sim
