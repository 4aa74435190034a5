// ManagerDaemon: run_varuna, the long-lived manager of one job, as a program
// (daemon/run_varuna_main.cpp) or a test drives it. Its event loop and parts
// are private to varuna_manager_runtime (manager/src/daemon/, starting with
// manager_daemon_impl.h); this class only forwards to them.
//
// Single-threaded: every method runs on the thread of the io_context it was
// made with (docs/architecture.md, "Threads"); it must outlive the daemon, as
// must DaemonOptions::clock.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio/io_context.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "varuna/manager/checkpoint_scan.h"
#include "varuna/manager/clock.h"
#include "varuna/manager/host_launcher.h"
#include "varuna/manager/job_config.h"
#include "varuna/manager/pending_limits.h"

namespace varuna {

class JobMetrics;    // manager/src/daemon/job_metrics.h
class LocalNetwork;  // varuna/manager/local_network.h

// The daemon's lifecycle, one way through (the controller's Phase is the
// job's, within kRunning and kStopping):
//   kStartingAgents -> kRunning -> kStopping -> kFinished,
// and kFinished from any of them (a stop before the job started, a
// configuration error, the controller's Stop). In kFinished the parts are
// shut down: the pool reports no lost agent and starts none, the tick ends.
enum class DaemonPhase {
  kStartingAgents,  // start(): the listed agents' first start-ups; no job yet
  kRunning,         // every first start-up is over: the controller runs the job
  kStopping,        // requestStop while running: the controller checkpoints, then stops
  kFinished,        // doStop: the last store scan, the summary, then the loop ends
};

// What a ManagerDaemon takes besides its job and its launcher.
struct DaemonOptions {
  PendingLimits pendingLimits;  // connections before their hello
  // Every part's time and timers (the tick, deadlines, backoffs, the
  // shutdown's waits); must outlive the daemon. Tests hand in a fake one.
  Clock* clock = &realClock();
  // Set (by the daemon's fake-clock tests): peers connect through this
  // in-process network instead of TCP, and the control port is not bound at
  // all (port() is 0, the agents' --manager address says port 0), so such a
  // test runs with no socket. Must outlive the daemon.
  LocalNetwork* localConnections = nullptr;
};

class ManagerDaemon {
 public:
  ManagerDaemon(boost::asio::io_context& io, JobConfig config, std::unique_ptr<HostLauncher> launcher,
                DaemonOptions options = {});
  ~ManagerDaemon();
  ManagerDaemon(const ManagerDaemon&) = delete;
  ManagerDaemon& operator=(const ManagerDaemon&) = delete;

  // Binds the control port, starts the agents; the job starts when they are up.
  // Throws ConfigError for a bad setup (machine list, state folder, port).
  void start();
  // SIGTERM/SIGINT: checkpoint and stop (a second request kills at once).
  void requestStop(const std::string& reason);
  int exitCode() const;
  DaemonPhase phase() const;
  uint16_t port() const;
  // --metrics_port's, once started (0: no metrics).
  uint16_t metricsPort() const;
  const JobMetrics& metrics() const;

  // The seam to the checkpoint store's scan (default scanCheckpointStore),
  // e.g. a slow one in tests. Before start(); called on a background thread.
  void setStoreScanner(StoreScanner scanner);

  // Introspection (tests, state.json).
  size_t pendingConnections() const;
  size_t launchThreads() const;
  uint64_t acceptFailures() const;
  // Connections accepted over TCP / from DaemonOptions::localConnections.
  uint64_t tcpConnectionsAccepted() const;
  uint64_t localConnectionsAccepted() const;
  uint64_t handlerFailures() const;
  bool stateWriteFailing() const;
  // state.json is being written (the tick's rewrite goes on off the loop).
  bool stateWriting() const;
  // Work on other threads whose result the loop has not had yet: agent
  // start-ups and store or planning jobs (a test on a fake clock holds its
  // time still while there is any, as the real clock would barely move).
  size_t backgroundJobs() const;

  class Impl;  // manager/src/daemon/manager_daemon_impl.h

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace varuna
