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
// threads at once. A host's start-ups can be held on their launch thread (a
// slow SSH connection) while the loop and the time go on: what only the real
// clock shows, as a fake one holds still while a start-up is under way.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
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
    std::lock_guard<std::mutex> lock(mutex_);
    return commands_;
  }
  // Their stdin, in the same order.
  std::vector<std::string> inputs() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return inputs_;
  }
  // From now on, start-ups of `host` wait on their launch thread until
  // release(host) (or the cluster shuts down: they fail). Any thread.
  void hold(const std::string& host);
  void release(const std::string& host);
  // Start-ups of `host` asked for so far, held ones included (the cluster's
  // agentStarts counts one only once it reaches the cluster's thread).
  size_t calls(const std::string& host) const;

 private:
  // Waits while `host` is held; false if the cluster shut down meanwhile.
  bool waitWhileHeld(const std::string& host);

  boost::asio::io_context& io_;
  std::shared_ptr<LaunchGate> gate_;
  std::chrono::milliseconds timeout_;
  // run() is called on several launch threads, hold() and release() on the test's.
  mutable std::mutex mutex_;
  std::condition_variable released_;
  std::vector<std::string> commands_;
  std::vector<std::string> inputs_;
  std::set<std::string> held_;
  std::map<std::string, size_t> calls_;
};

}  // namespace varuna::sim
