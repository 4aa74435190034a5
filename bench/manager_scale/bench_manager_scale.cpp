// bench/manager_scale: run_varuna under many simulated workers.
//
// The bench starts the real run_varuna (a child process, its own process
// group) on a machine list of H loopback hosts (127.0.x.y count as "this
// machine": no SSH) with S slots each, and with an agent shim as --agent_path.
// The shim takes the job token the way varuna_agent does (first line of
// stdin with --token_stdin, as run_varuna starts agents), hands (host,
// manager address, job token) to this process through a FIFO and exits 0;
// this process then plays every agent and every worker over real TCP
// connections to the manager, on one thread and one Asio event loop, with the
// simulated cluster the tests share (tests/support/sim_cluster.h):
//  - agents: Hello, a heartbeat a second (left out after a relay, as
//    varuna_agent leaves it out); LaunchWorkers -> one worker
//    connection per rank; CheckpointAndExit / KillWorkers -> the host's worker
//    connections close and WorkerExited (75 / signal 9) goes out per rank;
//  - workers: Hello, then Heartbeat{rank, step} at --heartbeat_hz, spread
//    evenly over the period (rank r's beats are offset by r/N of it), and
//    once all are connected a StepReport a second (every rank of every step,
//    so the manager's step aggregation and slow-machine detector run;
//    relayed by the agent with the beats, as varuna_agent does, or with
//    --direct_reports each over the worker's connection), and
//    for --ping_workers of them a Ping a second. The Pong's round trip is the
//    latency sample: it waits behind whatever the manager has queued, which
//    is the point.
// After --warmup_s of load, over --seconds: the manager's CPU (utime+stime of
// /proc/PID/stat) per wall second, the round trips' p50/p99/max, and how
// contended the CPUs were (the manager's run-queue wait from
// /proc/PID/schedstat, the machine's PSI cpu "some"): on a shared 2-core VM
// the tail latency is mostly that. Then SIGTERM to run_varuna, which orders a
// checkpoint the simulated agents answer (SIGKILL to its group after 10 s).
// Progress lines and a summary on stdout; the last line is one JSON object.
// Exit status 0 when the run was clean (1 manager launch, no lost connection
// or pong, run_varuna exited 0), whether or not the targets were met.
// --smoke: a few seconds at a tiny size (4 hosts x 4 slots, 2 stages, 1 s
// warm-up, 2 s window), figures printed but not judged: CTest runs it so that a bench that
// no longer runs fails CI.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "varuna/common/control_tls.h"
#include "varuna/common/errors.h"
#include "varuna/common/protocol.h"
#include "varuna/common/stage_map.h"
#include "proc_stats.h"
#include "sim_cluster.h"

namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using varuna::strCat;
namespace proto = varuna::proto;
namespace sim = varuna::sim;

constexpr auto kTick = std::chrono::milliseconds(1);
constexpr auto kStopGrace = std::chrono::seconds(10);
// After the window: wait for the pongs of pings sent inside it, until all are
// in or this long (a missing pong then makes the run unclean).
constexpr double kPongDrainS = 5;

struct Options {
  int hosts = 125;
  int slots = 8;
  int stages = 8;
  double seconds = 20;
  double warmupS = 5;
  double heartbeatHz = 10;
  // How often each agent relays (run_varuna gives its agents a twentieth of
  // heartbeat_timeout_s, at most 500 ms: 500 for this bench's 30 s).
  int beatRelayMs = 500;
  int pingWorkers = 100;
  double startupTimeoutS = 120;
  std::string runVaruna;
  bool keep = false;
  bool smoke = false;
  bool directBeats = false;  // each worker heartbeats the manager itself instead of through its agent
  bool directReports = false;  // each worker sends its step reports to the manager itself
  bool plaintext = false;      // the control plane without TLS (for comparison)
};

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int64_t steadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// The bench failed (setup, the manager died, a deadline passed): printed, exit 1.
class BenchError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// utime + stime of a process, in seconds (all its threads).
double processCpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  const auto paren = text.rfind(')');
  if (paren == std::string::npos) throw BenchError(strCat("cannot read /proc/", pid, "/stat"));
  std::istringstream fields(text.substr(paren + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {  // field 3 is the state
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

double selfCpuSeconds() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
  return s(usage.ru_utime) + s(usage.ru_stime);
}

std::string tail(const fs::path& path, size_t bytes) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  return text.size() > bytes ? "..." + text.substr(text.size() - bytes) : text;
}

// Nearest-rank percentile of sorted values.
double percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const auto rank = static_cast<size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size() - 1, rank == 0 ? 0 : rank - 1)];
}

struct Results {
  int workers = 0;
  double windowS = 0;
  double managerCpuS = 0;
  double benchCpuS = 0;
  double pressureS = 0;      // machine: time some runnable task waited for a CPU (PSI)
  double managerWaitS = 0;   // the manager's loop thread: runnable, waiting for a CPU
  double managerSlices = 0;  // ... times it was scheduled (about its wake-ups)
  uint64_t messages = 0;  // frames to the manager inside the window
  uint64_t pings = 0, pongs = 0;
  std::vector<double> rttMs;  // sorted
  double connectS = 0;        // first LaunchWorkers -> every worker connected
  double agentsS = 0;         // manager started -> every agent connected
  int launches = 0;
  int unexpectedCloses = 0;
  int managerExit = -1;
  bool managerKilled = false;
  double stopS = 0;
  double managerRssMiB = 0, managerPeakRssMiB = 0;  // at the window's end
};

// The simulator and the bench's phases, all on `io_`'s thread.
class Bench {
 public:
  Bench(Options options, fs::path dir)
      : options_(std::move(options)), dir_(std::move(dir)), cluster_(io_, simOptions(options_)) {
    sim::SimCluster::Callbacks callbacks;
    callbacks.onOrder = [this](const sim::Order& order) { onOrder(order); };
    callbacks.onAgentUp = [this](const std::string&) { onAgentUp(); };
    callbacks.onAllWorkersConnected = [this](int generation, int worldSize) { onAllWorkersConnected(generation, worldSize); };
    callbacks.onConnectionLost = [this](const std::string& who, const std::string& reason) {
      onUnexpectedClose(who, reason);
    };
    callbacks.onTick = [this](Clock::time_point) { onTick(); };  // the cluster's tick, every kTick
    cluster_.setCallbacks(std::move(callbacks));
  }

  Results run() {
    writeFiles();
    startManager();
    openFifo();
    startedAt_ = Clock::now();
    signals_.async_wait([this](const boost::system::error_code& ec, int signal) {
      if (!ec) abort(strCat("interrupted by ", ::strsignal(signal)));
    });
    io_.run();
    if (!error_.empty()) throw BenchError(error_);
    return results_;
  }

  // Leaves nothing behind: SIGKILL to the manager's process group (it and any
  // shim still running), then reaps the manager. Safe to call twice.
  void killManager() {
    if (managerPid_ <= 0) return;
    ::kill(-managerPid_, SIGKILL);  // the group is still ours: the leader is not reaped yet
    int status = 0;
    ::waitpid(managerPid_, &status, 0);
    managerPid_ = -1;
  }
  pid_t managerPid() const { return managerPid_; }
  fs::path managerLog() const { return dir_ / "run_varuna.log"; }

 private:
  // The load: heartbeats at --heartbeat_hz from each worker's hello (to its
  // agent, which relays them every --beat_relay_ms, as varuna_agent does; with
  // --direct_beats each to the manager), one step report a second per rank
  // from the rendezvous, one agent heartbeat a second unless a relay went out
  // just before (proto::relayStandsForHeartbeat); a checkpoint order is
  // answered at once (exit 75).
  static sim::SimOptions simOptions(const Options& options) {
    sim::SimOptions sim;
    sim.tick = kTick;
    sim.agentHeartbeat = std::chrono::seconds(1);
    sim.workerHeartbeat = std::chrono::milliseconds(std::max<int64_t>(1, std::llround(1000.0 / options.heartbeatHz)));
    // This one thread makes every simulated worker's certificate and TLS
    // handshake (about 2 ms each, where real hosts work in parallel): a few
    // at a time, so none waits past the manager's hello deadline for it.
    sim.maxDialling = 32;
    sim.beatsThroughAgent = !options.directBeats;
    sim.reportsThroughAgent = !options.directReports;
    sim.agentBeatForward = std::chrono::milliseconds(options.beatRelayMs);
    sim.step = std::chrono::seconds(1);
    sim.checkpointDelay = std::chrono::milliseconds(0);
    sim.agentGrace = std::chrono::seconds(5);
    return sim;
  }

  // --- setup ----------------------------------------------------------------------

  std::string hostName(int i) const { return strCat("127.0.", 1 + i / 250, ".", 1 + i % 250); }

  void writeFiles() {
    {
      std::ofstream list(dir_ / "machines.txt");
      for (int i = 0; i < options_.hosts; ++i) list << hostName(i) << " slots=" << options_.slots << "\n";
    }
    const fs::path fifo = dir_ / "agents.fifo";
    if (::mkfifo(fifo.c_str(), 0600) != 0) throw BenchError(strCat("mkfifo ", fifo.string(), ": ", std::strerror(errno)));
    // run_varuna runs `exec SHIM --daemonize --token_stdin --manager A --host H ...` per host with the job
    // token as the first line of stdin (ManagerDaemon::agentCommand / startAgent). The shim takes the
    // token exactly as varuna_agent does (manager/src/agent/agent_main.cpp, readJobToken): from stdin with
    // --token_stdin, else from VARUNA_JOB_TOKEN, and fails like it (exit 2) with neither.
    const fs::path shim = dir_ / "agent_shim.sh";
    {
      std::ofstream out(shim);
      out << R"sh(#!/bin/sh
# bench_manager_scale's stand-in for varuna_agent: hands the host, the manager's
# address and the job token to the simulator and exits.
host= manager= token_stdin= token=
while [ $# -gt 0 ]; do
  case "$1" in
    --host) host=$2; shift 2 ;;
    --manager) manager=$2; shift 2 ;;
    --token_stdin) token_stdin=1; shift ;;
    *) shift ;;
  esac
done
if [ -n "$token_stdin" ]; then
  IFS= read -r token || true
else
  token=$VARUNA_JOB_TOKEN
fi
if [ -z "$token" ]; then
  echo "config error: simulated agent for $host: no job token (--token_stdin without a line on stdin, or no VARUNA_JOB_TOKEN)" >&2
  exit 2
fi
printf '%s %s %s\n' "$host" "$manager" "$token" > ')sh"
          << fifo.string() << R"sh('
echo "simulated agent for $host"
)sh";
    }
    fs::permissions(shim, fs::perms::owner_all);
  }

  void startManager() {
    const int totalSlots = options_.hosts * options_.slots;
    const int replicas = totalSlots / options_.stages;
    if (replicas < 1) throw BenchError(strCat("--hosts x --slots (", totalSlots, ") is less than --stages"));
    std::vector<std::string> args = {
        options_.runVaruna,
        "--job", "bench_scale",
        "--machine_list", (dir_ / "machines.txt").string(),
        "--nstages", std::to_string(options_.stages),
        "--batch_size", std::to_string(replicas * 8),  // every replica gets 8 samples: all slots are used
        "--chunk_size", "1",
        "--agent_path", (dir_ / "agent_shim.sh").string(),
        "--heartbeat_timeout_s", "30",
        "--startup_timeout_s", "120",
        "--manager_ip", "127.0.0.1",
        "--port", "0",
        "--state_dir", (dir_ / "state").string(),
        "--global_store", (dir_ / "store").string(),
        "--code_dir", dir_.string(),
        "--", "/bin/true"};
    if (options_.plaintext) args.insert(args.end() - 2, "--insecure_plaintext_control");
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const std::string log = managerLog().string();
    const pid_t pid = ::fork();
    if (pid < 0) throw BenchError(strCat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      ::setpgid(0, 0);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      const int devNull = ::open("/dev/null", O_RDONLY);
      if (devNull >= 0) ::dup2(devNull, 0);
      ::close_range(3, ~0U, 0);
      ::execv(argv[0], argv.data());
      std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here: no race with the child's own call
    managerPid_ = pid;
    std::cout << "started " << options_.runVaruna << " (pid " << pid << "): " << options_.hosts << " hosts x "
              << options_.slots << " slots, " << options_.stages << " stages; log " << log << std::endl;
  }

  void openFifo() {
    const fs::path fifo = dir_ / "agents.fifo";
    const int readFd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    // A writer of our own, so the reader never sees EOF between two shims.
    fifoKeepOpen_ = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);
    if (readFd < 0 || fifoKeepOpen_ < 0) throw BenchError(strCat("open ", fifo.string(), ": ", std::strerror(errno)));
    fifo_.assign(readFd);
    doReadFifo();
  }

  void doReadFifo() {
    fifo_.async_read_some(asio::buffer(fifoBuffer_), [this](const boost::system::error_code& ec, size_t bytes) {
      if (ec) return abort("reading the agent FIFO: " + ec.message());
      fifoText_.append(fifoBuffer_.data(), bytes);
      for (size_t nl; (nl = fifoText_.find('\n')) != std::string::npos;) {
        std::istringstream line(fifoText_.substr(0, nl));
        fifoText_.erase(0, nl + 1);
        std::string host, address, token;
        line >> host >> address >> token;
        if (!host.empty()) startAgent(host, address, token);
      }
      doReadFifo();
    });
  }

  // --- the simulated agents and workers (tests/support/sim_cluster.h) ---------------

  void startAgent(const std::string& host, const std::string& address, const std::string& token) {
    cluster_.startAgent(host, address, token);
  }

  void onAgentUp() {
    if (++agentsUp_ == options_.hosts) {
      results_.agentsS = secondsSince(startedAt_);
      std::cout << "all " << agentsUp_ << " agents connected (" << fmt(results_.agentsS) << " s)" << std::endl;
    }
  }

  void onOrder(const sim::Order& order) {
    if (const auto* launch = std::get_if<proto::LaunchWorkers>(&order.message)) return onLaunch(*launch);
    if (const auto* pong = std::get_if<proto::Pong>(&order.message)) {
      const int64_t now = steadyNs();
      if (pong->sentNs >= windowStartNs_ && pong->sentNs < windowEndNs_) {
        results_.rttMs.push_back(static_cast<double>(now - pong->sentNs) / 1e6);
        ++results_.pongs;
      }
      return;
    }
    if (const auto* ack = std::get_if<proto::Ack>(&order.message); ack && !ack->ok) {
      abort(order.to == sim::PeerKind::kAgent ? strCat("the manager refused the agent of ", order.host, ": ", ack->error)
                                              : strCat("the manager refused worker ", order.rank, ": ", ack->error));
    }
  }

  void onLaunch(const proto::LaunchWorkers& launch) {
    if (launch.generation == generation_) return;
    if (generation_ >= 0) {
      std::cout << "warning: the manager relaunched (generation " << launch.generation
                << "): the figures include a morph" << std::endl;
    }
    generation_ = launch.generation;
    ++results_.launches;
    worldSize_ = launch.worldSize;
    loadRunning_ = false;
    const auto stageMap = varuna::StageToRankMap::parse(launch.stageToRankMap);
    launchedAt_ = Clock::now();
    std::cout << "generation " << launch.generation << ": launching " << launch.worldSize << " workers ("
              << stageMap.numStages() << " stages x " << stageMap.numReplicas() << " replicas)" << std::endl;
  }

  void onUnexpectedClose(const std::string& who, const std::string& reason) {
    if (stopping_) return;
    if (++results_.unexpectedCloses <= 5) std::cout << "warning: " << who << " lost its connection: " << reason << std::endl;
  }

  // --- the load --------------------------------------------------------------------------
  // Heartbeats (from each worker's hello) and step reports (from the
  // rendezvous) are the cluster's; the pings are the bench's.

  void onAllWorkersConnected(int generation, int worldSize) {
    if (generation != generation_) return;
    results_.workers = worldSize;
    results_.connectS = secondsSince(launchedAt_);
    pingTargets_ = pingTargets();
    std::cout << "all " << worldSize << " workers connected (" << fmt(results_.connectS)
              << " s after the launch); load: " << options_.heartbeatHz << " heartbeats/s and 1 step report/s per "
              << "worker, " << pingTargets_.size() << " workers ping once a second; warm-up " << options_.warmupS
              << " s" << std::endl;
    loadRunning_ = true;
    loadStart_ = Clock::now();
    pingsDone_ = 0;
    const auto windowStart = loadStart_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.warmupS));
    phaseTimer_.expires_at(windowStart);
    phaseTimer_.async_wait([this](const boost::system::error_code& ec) {
      if (!ec) beginWindow();
    });
  }

  std::vector<int> pingTargets() const {
    std::vector<int> ranks;
    const int n = worldSize_;
    const int k = std::clamp(options_.pingWorkers, 0, n);
    for (int i = 0; i < k; ++i) ranks.push_back(static_cast<int>(static_cast<int64_t>(i) * n / k));
    return ranks;
  }

  void onTick() {
    if (!stopping_) checkManagerAlive();
    if (!error_.empty()) return;
    if (!stopping_ && agentsUp_ < options_.hosts && secondsSince(startedAt_) > options_.startupTimeoutS) {
      return abort(strCat("only ", agentsUp_, " of ", options_.hosts, " agents connected within ",
                          options_.startupTimeoutS, " s"));
    }
    if (!stopping_ && generation_ >= 0 && !loadRunning_ && secondsSince(launchedAt_) > options_.startupTimeoutS) {
      return abort(strCat("only ", cluster_.connectedWorkers(generation_), " of ", worldSize_,
                          " workers connected within ", options_.startupTimeoutS, " s"));
    }
    if (!loadRunning_ || stopping_) return;
    // Pings: each target once a second, the targets spread over the second.
    const double t = secondsSince(loadStart_);
    const auto pingTarget = static_cast<uint64_t>(t * static_cast<double>(pingTargets_.size()));
    for (; !pingTargets_.empty() && pingsDone_ < pingTarget; ++pingsDone_) {
      const int rank = pingTargets_[pingsDone_ % pingTargets_.size()];
      const int64_t sent = steadyNs();
      if (cluster_.sendFromWorker(rank, proto::encode(proto::Ping{static_cast<int64_t>(pingsDone_), sent})) &&
          sent >= windowStartNs_ && sent < windowEndNs_) {
        ++results_.pings;
      }
    }
  }

  // --- measurement ------------------------------------------------------------------------------

  void beginWindow() {
    std::cout << "measuring for " << options_.seconds << " s" << std::endl;
    windowStart_ = Clock::now();
    windowStartNs_ = steadyNs();
    windowEndNs_ = std::numeric_limits<int64_t>::max();
    cpuStart_ = processCpuSeconds(managerPid_);
    selfCpuStart_ = selfCpuSeconds();
    pressureStart_ = cpuPressureSomeSeconds();
    schedStart_ = schedStat(managerPid_);
    messagesStart_ = cluster_.framesSent();
    progress(0);
  }

  // A line every 5 s of the window: the manager's CPU so far.
  void progress(int elapsedS) {
    const int step = 5;
    const int next = elapsedS + step;
    if (next >= options_.seconds) {
      phaseTimer_.expires_at(windowStart_ + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(options_.seconds)));
      phaseTimer_.async_wait([this](const boost::system::error_code& ec) {
        if (!ec) endWindow();
      });
      return;
    }
    phaseTimer_.expires_at(windowStart_ + std::chrono::seconds(next));
    phaseTimer_.async_wait([this, next](const boost::system::error_code& ec) {
      if (ec) return;
      const double wall = secondsSince(windowStart_);
      std::cout << "  " << next << " s: manager CPU " << fmt((processCpuSeconds(managerPid_) - cpuStart_) / wall, 3)
                << " of a core, " << results_.pongs << " pongs" << std::endl;
      progress(next);
    });
  }

  void endWindow() {
    results_.windowS = secondsSince(windowStart_);
    windowEndNs_ = steadyNs();
    results_.managerCpuS = processCpuSeconds(managerPid_) - cpuStart_;
    results_.benchCpuS = selfCpuSeconds() - selfCpuStart_;
    results_.pressureS = cpuPressureSomeSeconds() - pressureStart_;
    const SchedStat sched = schedStat(managerPid_);
    results_.managerWaitS = sched.waitS - schedStart_.waitS;
    results_.managerSlices = sched.slices - schedStart_.slices;
    results_.messages = cluster_.framesSent() - messagesStart_;
    std::tie(results_.managerRssMiB, results_.managerPeakRssMiB) = residentMiB(managerPid_);
    // Pongs of the last pings may still be on their way.
    drainPongs(Clock::now());
  }

  void drainPongs(Clock::time_point since) {
    if (results_.pongs >= results_.pings || secondsSince(since) > kPongDrainS) return stopManager();
    phaseTimer_.expires_after(std::chrono::milliseconds(20));
    phaseTimer_.async_wait([this, since](const boost::system::error_code& ec) {
      if (!ec) drainPongs(since);
    });
  }

  // --- shutdown ----------------------------------------------------------------------------------

  void stopManager() {
    std::cout << "stopping run_varuna (SIGTERM); the simulated agents answer its checkpoint order" << std::endl;
    stopping_ = true;
    loadRunning_ = false;
    stopAt_ = Clock::now();
    ::kill(managerPid_, SIGTERM);
    waitForExit();
  }

  void waitForExit() {
    phaseTimer_.expires_after(std::chrono::milliseconds(20));
    phaseTimer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      siginfo_t info{};
      ::waitid(P_PID, static_cast<id_t>(managerPid_), &info, WEXITED | WNOHANG | WNOWAIT);
      if (info.si_pid == managerPid_) {
        results_.managerExit = info.si_code == CLD_EXITED ? info.si_status : 128 + info.si_status;
        results_.stopS = secondsSince(stopAt_);
        return finish();
      }
      if (Clock::now() - stopAt_ > kStopGrace) {
        std::cout << "warning: run_varuna did not exit within " << kStopGrace.count() << " s of SIGTERM: SIGKILL"
                  << std::endl;
        results_.managerKilled = true;
        results_.stopS = secondsSince(stopAt_);
        return finish();
      }
      waitForExit();
    });
  }

  void checkManagerAlive() {
    if (managerPid_ <= 0) return;
    siginfo_t info{};
    ::waitid(P_PID, static_cast<id_t>(managerPid_), &info, WEXITED | WNOHANG | WNOWAIT);
    if (info.si_pid == managerPid_) {
      abort(strCat("run_varuna exited early (", info.si_code == CLD_EXITED ? "code " : "signal ", info.si_status,
                   "); the end of its log:\n", tail(managerLog(), 3000)));
    }
  }

  void finish() {
    killManager();
    closeAll();
  }

  void abort(const std::string& message) {
    if (error_.empty()) error_ = message;
    stopping_ = true;
    finish();
  }

  void closeAll() {
    boost::system::error_code ignored;
    phaseTimer_.cancel();
    signals_.cancel(ignored);
    fifo_.close(ignored);
    if (fifoKeepOpen_ >= 0) ::close(fifoKeepOpen_);
    fifoKeepOpen_ = -1;
    cluster_.shutdown();
    io_.stop();
  }

  static std::string fmt(double value, int decimals = 1) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.*f", decimals, value);
    return text;
  }

  Options options_;
  fs::path dir_;
  asio::io_context io_{1};
  asio::signal_set signals_{io_, SIGINT, SIGTERM};
  asio::steady_timer phaseTimer_{io_};
  asio::posix::stream_descriptor fifo_{io_};
  int fifoKeepOpen_ = -1;
  std::array<char, 4096> fifoBuffer_{};
  std::string fifoText_;
  pid_t managerPid_ = -1;
  sim::SimCluster cluster_;

  int agentsUp_ = 0;
  int generation_ = -1;
  int worldSize_ = 0;  // of generation_
  std::vector<int> pingTargets_;

  Clock::time_point startedAt_, launchedAt_, loadStart_, windowStart_, stopAt_;
  bool loadRunning_ = false;
  bool stopping_ = false;
  uint64_t pingsDone_ = 0;
  uint64_t messagesStart_ = 0;
  int64_t windowStartNs_ = std::numeric_limits<int64_t>::max();
  int64_t windowEndNs_ = std::numeric_limits<int64_t>::max();
  double cpuStart_ = 0, selfCpuStart_ = 0;
  double pressureStart_ = 0;
  SchedStat schedStart_;
  Results results_;
  std::string error_;
};

std::string defaultRunVaruna() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return (self.parent_path().parent_path() / "bin" / "run_varuna").string();  // <build>/bench -> <build>/bin
}

// Each side of 1000+ connections needs a descriptor per connection: this
// process one per simulated agent and worker, run_varuna (a process of its
// own, which raises its soft limit to the hard one at start) as many again.
void raiseFileLimit(int needed) {
  rlimit limit{};
  ::getrlimit(RLIMIT_NOFILE, &limit);
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
  if (limit.rlim_cur < static_cast<rlim_t>(needed)) {
    throw BenchError(strCat("the open-file limit (", limit.rlim_cur, ") is below the ", needed,
                            " descriptors each side of this run needs (one per simulated agent and worker, "
                            "in this process and in run_varuna): raise the hard limit (`ulimit -Hn`, "
                            "LimitNOFILE=) or use fewer --hosts/--slots"));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"bench_manager_scale: run_varuna under N simulated workers heartbeating at 10 Hz"};
  auto* hosts = app.add_option("--hosts", options.hosts, "simulated hosts (127.0.x.y)")->check(CLI::Range(1, 10000));
  auto* slots = app.add_option("--slots", options.slots, "workers per host")->check(CLI::Range(1, 1024));
  auto* stages = app.add_option("--stages", options.stages, "pipeline stages (--nstages)")->check(CLI::PositiveNumber);
  auto* seconds = app.add_option("--seconds", options.seconds, "measurement window")->check(CLI::PositiveNumber);
  auto* warmup = app.add_option("--warmup_s", options.warmupS, "load before the window")->check(CLI::NonNegativeNumber);
  app.add_option("--heartbeat_hz", options.heartbeatHz, "heartbeats per worker per second")->check(CLI::PositiveNumber);
  app.add_option("--beat_relay_ms", options.beatRelayMs,
                 "each agent relays its workers' beats and step reports this often (default 500, what run_varuna "
                 "gives its agents at this bench's heartbeat_timeout_s of 30)")
      ->check(CLI::Range(10, 1000));  // as varuna_agent's
  app.add_option("--ping_workers", options.pingWorkers, "workers that ping once a second (latency samples)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--startup_timeout_s", options.startupTimeoutS, "for the agents, then the workers, to connect")
      ->check(CLI::PositiveNumber);
  app.add_option("--run_varuna", options.runVaruna, "the run_varuna to measure (default: <build>/bin/run_varuna)");
  app.add_flag("--direct_beats", options.directBeats,
               "every worker heartbeats the manager over its own connection (the protocol before agents relayed "
               "them; for comparison)");
  app.add_flag("--direct_reports", options.directReports,
               "every worker sends its step reports over its own connection (the protocol before agents relayed "
               "them with the beats; for comparison)");
  app.add_flag("--insecure_plaintext_control", options.plaintext,
               "run_varuna and the simulated peers without TLS on the control plane (what TLS costs, by comparison)");
  app.add_flag("--keep", options.keep, "keep the temp folder (run_varuna's log, state, events)");
  app.add_flag("--smoke", options.smoke,
               "a few seconds at a tiny size (4 hosts x 4 slots, 2 stages, 1 s warm-up, 2 s window; options given "
               "explicitly win), figures not judged: does the bench still run?");
  CLI11_PARSE(app, argc, argv);
  // The simulated peers (SimPeer) follow the process's environment.
  options.plaintext ? ::setenv(varuna::tls::kPlaintextEnv, "1", 1) : ::unsetenv(varuna::tls::kPlaintextEnv);
  if (options.smoke) {
    if (!hosts->count()) options.hosts = 4;
    if (!slots->count()) options.slots = 4;
    if (!stages->count()) options.stages = 2;
    if (!warmup->count()) options.warmupS = 1;
    if (!seconds->count()) options.seconds = 2;
  }
  if (options.runVaruna.empty()) options.runVaruna = defaultRunVaruna();
  if (::access(options.runVaruna.c_str(), X_OK) != 0) {
    std::cerr << "bench_manager_scale: " << options.runVaruna
              << " is not an executable run_varuna; build it (ninja -C build run_varuna) or pass --run_varuna"
              << std::endl;
    return 2;
  }
  ::signal(SIGPIPE, SIG_IGN);

  std::string dirTemplate = (fs::temp_directory_path() / "varuna_bench_scale.XXXXXX").string();
  if (!::mkdtemp(dirTemplate.data())) {
    std::cerr << "bench_manager_scale: mkdtemp: " << std::strerror(errno) << std::endl;
    return 1;
  }
  const fs::path dir = dirTemplate;
  Bench bench(options, dir);
  Results r;
  int status = 0;
  try {
    raiseFileLimit(options.hosts * (options.slots + 1) + 256);
    r = bench.run();
  } catch (const std::exception& e) {
    bench.killManager();
    std::cerr << "bench_manager_scale failed: " << e.what() << "\n(files kept in " << dir.string() << ")" << std::endl;
    return 1;
  }
  bench.killManager();  // reaps it; nothing of it is left

  std::sort(r.rttMs.begin(), r.rttMs.end());
  const double cpu = r.windowS > 0 ? r.managerCpuS / r.windowS : 0;
  const double benchCpu = r.windowS > 0 ? r.benchCpuS / r.windowS : 0;
  const double rate = r.windowS > 0 ? static_cast<double>(r.messages) / r.windowS : 0;
  const double waitFraction = r.windowS > 0 ? r.managerWaitS / r.windowS : 0;
  const double wakeups = r.windowS > 0 ? r.managerSlices / r.windowS : 0;
  const double pressure = r.windowS > 0 ? r.pressureS / r.windowS : 0;
  const double p50 = percentile(r.rttMs, 0.50), p99 = percentile(r.rttMs, 0.99);
  const double maxMs = r.rttMs.empty() ? 0 : r.rttMs.back();
  const bool cpuMet = cpu <= 0.10, latencyMet = !r.rttMs.empty() && p99 <= 5.0;
  const bool clean = r.managerExit == 0 && !r.managerKilled && r.launches == 1 && r.unexpectedCloses == 0 &&
                     r.pongs == r.pings;
  if (!clean) status = 1;

  char line[1024];
  const std::string relayed = strCat("relayed by their agents every ", options.beatRelayMs, " ms");
  std::printf("\nrun_varuna with %d simulated workers on %d hosts, %.0f heartbeats/s each (%s), %s, over %.1f s:\n",
              r.workers, options.hosts, options.heartbeatHz,
              options.directBeats ? "each to the manager" : relayed.c_str(),
              options.plaintext ? "control plane in plaintext" : "control plane in TLS 1.3", r.windowS);
  std::printf("  messages to the manager   %.0f /s (%s, %s, pings, agent heartbeats)\n", rate,
              options.directBeats ? "heartbeats" : "relayed beats",
              options.directReports ? "step reports" : "step reports relayed with them");
  // A smoke run is too short and too small for the targets: its figures are not judged.
  auto verdict = [&](bool met) { return options.smoke ? "not judged: --smoke" : met ? "met" : "MISSED"; };
  std::printf("  manager CPU               %.3f of a core   (target <= 0.10: %s)\n", cpu, verdict(cpuMet));
  std::printf("  ping -> pong round trip   p50 %.3f ms, p99 %.3f ms, max %.3f ms over %llu samples   "
              "(target p99 <= 5 ms: %s)\n",
              p50, p99, maxMs, static_cast<unsigned long long>(r.rttMs.size()), verdict(latencyMet));
  std::printf("  this bench's own CPU      %.3f of a core\n", benchCpu);
  std::printf("  manager memory            %.0f MiB resident (peak %.0f MiB)\n", r.managerRssMiB, r.managerPeakRssMiB);
  std::printf("  contention                the manager waited for a CPU %.1f %% of the time and woke %.0f times/s; "
              "some task waited %.1f %% of the time (PSI)\n",
              100 * waitFraction, wakeups, 100 * pressure);
  std::printf("  start-up                  agents %.1f s after the start, workers %.1f s after the launch\n",
              r.agentsS, r.connectS);
  std::printf("  stop                      run_varuna %s %.1f s after SIGTERM\n",
              r.managerKilled ? "was SIGKILLed" : strCat("exited with ", r.managerExit).c_str(), r.stopS);
  if (r.pongs != r.pings) {
    std::printf("  warning: %llu of %llu pings sent in the window got no pong\n",
                static_cast<unsigned long long>(r.pings - std::min(r.pings, r.pongs)),
                static_cast<unsigned long long>(r.pings));
  }
  if (r.launches != 1) std::printf("  warning: %d launches (the manager morphed during the run)\n", r.launches);
  if (r.unexpectedCloses) std::printf("  warning: %d connections lost\n", r.unexpectedCloses);
  if (options.keep) {
    std::printf("  files kept in %s\n", dir.c_str());
  } else {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::snprintf(line, sizeof(line),
                "{\"workers\": %d, \"seconds\": %.1f, \"cpu_fraction_of_core\": %.4f, \"p50_ms\": %.3f, "
                "\"p99_ms\": %.3f, \"max_ms\": %.3f, \"messages_per_s\": %.0f, \"latency_samples\": %zu, "
                "\"bench_cpu_fraction_of_core\": %.4f, \"manager_cpu_wait_fraction\": %.4f, \"manager_wakeups_per_s\": %.0f, "
                "\"cpu_pressure_some\": %.4f, \"manager_exit\": %d, \"clean\": %s, \"smoke\": %s, \"beats\": \"%s\", "
                "\"reports\": \"%s\", \"control\": \"%s\", \"manager_rss_mib\": %.0f, \"connect_s\": %.3f}",
                r.workers, r.windowS, cpu, p50, p99, maxMs, rate, r.rttMs.size(), benchCpu, waitFraction, wakeups, pressure,
                r.managerKilled ? -9 : r.managerExit, clean ? "true" : "false", options.smoke ? "true" : "false",
                options.directBeats ? "direct" : "relayed", options.directReports ? "direct" : "relayed",
                options.plaintext ? "plaintext" : "tls", r.managerRssMiB, r.connectS);
  std::cout << std::flush;
  std::printf("%s\n", line);
  return status;
}
