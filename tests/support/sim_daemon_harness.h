// SimDaemonHarness: the in-process ManagerDaemon (DaemonHarness) with a
// SimCluster playing its agents and workers, started through SimHostLauncher.
// One harness for both kinds of daemon test: on a FakeClock and the daemon's
// in-process network (call useFakeClock() before simulate: the unit
// tests), or on the real clock over loopback TCP (the integration tests that
// need real sockets or real time: EMFILE, a start-up held on its launch
// thread, a store scan stalled for seconds).
// Single-threaded like DaemonHarness: the daemon and the cluster share its
// io_context, which the test thread runs.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "daemon_harness.h"
#include "sim_cluster.h"
#include "sim_host_launcher.h"

namespace varuna::test {

struct SimDaemonHarness : DaemonHarness {
  std::unique_ptr<sim::SimCluster> cluster;
  sim::SimHostLauncher* launcher = nullptr;  // owned by the daemon

  using DaemonHarness::DaemonHarness;
  ~SimDaemonHarness() {
    if (cluster) cluster->shutdown();  // first: a launch thread waiting for its agent gives up
    daemon.reset();                    // joins the launch threads
    cluster.reset();
  }

  // The cluster, on the harness's clock and (useFakeClock first) its
  // in-process network, else over loopback TCP. Before startSimulated.
  sim::SimCluster& simulate(sim::SimOptions options) {
    options.localNetwork = localNetwork.get();
    cluster = std::make_unique<sim::SimCluster>(io, options, clock());
    return *cluster;
  }
  // Starts the daemon with a launcher that starts the cluster's agents.
  void startSimulated(const JobConfig& config, PendingLimits limits = {}, StoreScanner scanner = {}) {
    auto simLauncher = std::make_unique<sim::SimHostLauncher>(*cluster);
    launcher = simLauncher.get();
    startDaemon(config, std::move(simLauncher), limits, std::move(scanner));
  }
};

}  // namespace varuna::test
