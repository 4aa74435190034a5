#include "sim_host_launcher.h"

#include <condition_variable>
#include <mutex>
#include <regex>

#include "varuna/common/errors.h"

namespace varuna::sim {

namespace {

// One start-up's result, handed from the cluster's thread to the launch thread.
struct Pending {
  std::mutex mutex;
  std::condition_variable done;
  bool ready = false;
  HostCommandResult result;
};

}  // namespace

void SimHostLauncher::hold(const std::string& host) {
  std::lock_guard<std::mutex> lock(mutex_);
  held_.insert(host);
}

void SimHostLauncher::release(const std::string& host) {
  std::lock_guard<std::mutex> lock(mutex_);
  held_.erase(host);
  released_.notify_all();
}

size_t SimHostLauncher::calls(const std::string& host) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = calls_.find(host);
  return it == calls_.end() ? 0 : it->second;
}

bool SimHostLauncher::waitWhileHeld(const std::string& host) {
  std::unique_lock<std::mutex> lock(mutex_);
  ++calls_[host];
  // In slices: the cluster may shut down (nobody releases the host then).
  while (held_.count(host) && !gate_->closed) released_.wait_for(lock, std::chrono::milliseconds(50));
  return !gate_->closed;
}

HostCommandResult SimHostLauncher::run(const std::string& host, const std::string& command, const std::string& input) {
  HostCommandResult result;
  if (!waitWhileHeld(host)) {
    result.message = strCat("the simulated cluster shut down while the start-up of ", host, " was held");
    return result;
  }
  std::smatch match;
  if (!std::regex_search(command, match, std::regex("--manager '([^']+)'"))) {
    result.exitStatus = kExitConfigError;
    result.output = "simulated agent: no --manager 'ADDRESS' in the agent command: " + command;
    result.message = result.output;
    return result;
  }
  const std::string address = match[1].str();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    commands_.push_back(command);
    inputs_.push_back(input);
  }
  // The token as varuna_agent takes it (agent_main.cpp, readJobToken): the
  // first line of stdin with --token_stdin.
  const std::string token = input.substr(0, input.find('\n'));
  if (command.find("--token_stdin") == std::string::npos || token.empty()) {
    result.exitStatus = kExitConfigError;
    result.output = strCat("config error: simulated agent for ", host,
                           ": no job token (--token_stdin without a line on stdin)");
    result.message = result.output;
    return result;
  }
  auto pending = std::make_shared<Pending>();
  auto finish = [pending](HostCommandResult r) {
    std::lock_guard<std::mutex> lock(pending->mutex);
    if (pending->ready) return;
    pending->result = std::move(r);
    pending->ready = true;
    pending->done.notify_all();
  };
  boost::asio::post(io_, [gate = gate_, host, address, token, finish] {
    SimCluster* cluster = gate->cluster;
    HostCommandResult r;
    if (!cluster) {
      r.message = "the simulated cluster is shut down";
      return finish(r);
    }
    if (!cluster->hostReachable(host) || cluster->takeStartFailure(host)) {
      cluster->countStartAttempt(host);
      r.exitStatus = -1;
      r.message = strCat("cannot reach ", host, ":22 (simulated: the host is unreachable); check that it is up");
      return finish(r);
    }
    cluster->startAgent(host, address, token, [host, finish](bool ok, const std::string& error) {
      HostCommandResult r;
      r.ok = ok;
      r.exitStatus = ok ? 0 : 1;
      r.output = ok ? strCat("simulated agent for ", host, " is up") : error;
      if (!ok) r.message = strCat("the agent on ", host, " failed: ", error);
      finish(r);
    });
  });
  std::unique_lock<std::mutex> lock(pending->mutex);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  // In slices: the cluster may shut down (its thread then never answers).
  while (!pending->ready && !gate_->closed && std::chrono::steady_clock::now() < deadline) {
    pending->done.wait_for(lock, std::chrono::milliseconds(50));
  }
  if (pending->ready) return pending->result;
  result.message = gate_->closed ? strCat("the simulated cluster shut down while starting the agent of ", host)
                                 : strCat("the simulated agent of ", host, " did not start within ",
                                          timeout_.count(), " ms");
  return result;
}

}  // namespace varuna::sim
