#include "agent/agent.h"
#include "varuna/common/worker_exit.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "agent/run_dir.h"
#include "varuna/common/agent_beat.h"
#include "varuna/common/launch_contract.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/manager/credentials.h"
#include "varuna/manager/job_config.h"

extern char** environ;

namespace varuna {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;

// Uniform in [0, 1), different in every agent (the phase of its relays).
double randomFraction() {
  std::mt19937_64 generator{std::random_device{}()};
  return std::uniform_real_distribution<double>(0.0, 1.0)(generator);
}

bool processAlive(pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

std::string readCmdline(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  std::replace(text.begin(), text.end(), '\0', ' ');
  return text;
}

// One worker's part of the launch contract (launch_contract.h).
LaunchArgs workerLaunch(const proto::LaunchWorkers& launch, const proto::WorkerSpec& spec, const AgentOptions& options,
                        const std::string& managerAddress, bool beatSocket) {
  LaunchArgs args;
  args.rank = spec.rank;
  args.localRank = spec.localRank;
  args.worldSize = launch.worldSize;
  args.stageToRankMap = launch.stageToRankMap;
  args.chunkSize = launch.chunkSize;
  args.replicaBatchSize = launch.batchSize;
  args.resumeStep = launch.resumeStep;
  args.masterAddr = launch.masterAddr;
  args.masterPort = launch.masterPort;
  args.managerAddr = managerAddress;
  args.jobToken = credentials::worker(options.credential, spec.rank, launch.generation);  // this rank's only
  args.jobTokenFd = contract::kJobTokenFd;  // on a pipe, never in the environment
  args.job = options.job;
  args.hostAddr = options.host;
  args.generation = launch.generation;
  args.agentBeatFd = beatSocket ? kAgentBeatFd : -1;
  return args;
}

// The worker's command line: the program's own arguments, then the launcher's.
std::vector<std::string> workerArgv(const std::string& program, const proto::LaunchWorkers& launch,
                                    const LaunchArgs& args) {
  std::vector<std::string> argv{program};
  argv.insert(argv.end(), launch.argv.begin() + 1, launch.argv.end());
  const auto launcher = launcherArgv(args);
  argv.insert(argv.end(), launcher.begin(), launcher.end());
  return argv;
}

// The agent's own environment, the job's (env_file, store, plan: in the
// launch message), then the rendezvous and run_varuna's entries.
std::vector<std::string> workerEnv(const proto::LaunchWorkers& launch, const LaunchArgs& args) {
  std::map<std::string, std::string> env = currentEnvironment();
  env.erase(contract::kAgentBeatFdEnv);  // never an inherited one: that descriptor is not ours
  // The job's variables, but never a control-plane one (a credential, the
  // plaintext switch): the agent's own decision on TLS holds for its workers.
  for (const auto& [k, v] : launch.env) {
    if (!isControlPlaneVariable(k)) env[k] = v;
  }
  // No credential in a worker's environment: not the agent's own (a test or a
  // hand start passes it so).
  env.erase(contract::kJobTokenEnv);
  env.erase(contract::kJobTokenFdEnv);
  for (const auto& [k, v] : rendezvousEnvironment(args)) env[k] = v;
  env[contract::kLocalWorldSizeEnv] = std::to_string(launch.workers.size());
  for (const auto& [k, v] : managerEnvironment(args)) env[k] = v;
  std::vector<std::string> out;
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

static_assert(contract::kJobTokenFd == kAgentBeatFd + 1, "the credential's descriptor follows the beat socket's");

// A pipe holding `secret`, its read end at a descriptor >= 10 (clear of the
// numbers a child moves its descriptors to) and close-on-exec; the write end
// is closed, so the reader meets the end of the data. -1 if it cannot be made.
int pipeHolding(const std::string& secret) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return -1;
  const bool written = ::write(fds[1], secret.data(), secret.size()) == static_cast<ssize_t>(secret.size());
  ::close(fds[1]);
  const int high = written ? ::fcntl(fds[0], F_DUPFD_CLOEXEC, 10) : -1;
  ::close(fds[0]);
  return high;
}

std::vector<char*> cStrings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace

std::string defaultAgentRunDir(const std::string& job, const std::string& host) {
  return (fs::temp_directory_path() / "varuna" / job / host).string();
}

void writeConnectionFile(const std::string& runDir, const std::string& managerAddress, const AgentOptions& options) {
  const nlohmann::json connection = {
      {"manager", managerAddress}, {"token", credentials::notifier(options.credential)}, {"host", options.host},
      {"job", options.job}, {"insecure_plaintext_control", tls::plaintextRequested()}};
  const auto old = ::umask(077);  // the token is a secret: owner only
  ckpt::writeFileAtomic(runDir, "connection.json", connection.dump(2) + "\n");
  ::umask(old);
  ::chmod((fs::path(runDir) / "connection.json").c_str(), 0600);
}

void replacePreviousAgent(const std::string& runDir) {
  const fs::path pidFile = fs::path(runDir) / "agent.pid";
  std::ifstream in(pidFile);
  pid_t old = 0;
  if (in >> old && old != ::getpid() && processAlive(old) &&
      readCmdline(old).find("varuna_agent") != std::string::npos) {
    log::warn("an agent of this job from an earlier manager is still running (pid ", old, "); stopping it");
    ::kill(old, SIGTERM);  // it kills its workers on the way out
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (processAlive(old) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (processAlive(old)) ::kill(old, SIGKILL);
  }
  ckpt::writeFileAtomic(runDir, "agent.pid", std::to_string(::getpid()) + "\n");
}

std::string resolveProgram(const std::string& program, const std::string& codeDir) {
  if (program.empty()) throw ConfigError("no training program given (put it after `--`)");
  auto runnable = [](const fs::path& p) { return ::access(p.c_str(), X_OK) == 0 && !fs::is_directory(p); };
  if (program.find('/') != std::string::npos) {
    const fs::path path = fs::path(program).is_absolute() ? fs::path(program) : fs::path(codeDir) / program;
    if (!runnable(path)) {
      throw ConfigError(strCat("training program ", path.lexically_normal().string(),
                               fs::exists(path) ? " is not executable (chmod +x it)"
                                                : " does not exist (check --code_dir and the program after --)"));
    }
    return path.lexically_normal().string();
  }
  const char* pathEnv = std::getenv("PATH");
  std::string dirs = pathEnv ? pathEnv : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const auto end = std::min(dirs.find(':', start), dirs.size());
    const fs::path candidate = fs::path(dirs.substr(start, end - start)) / program;
    if (runnable(candidate)) return candidate.string();
    start = end + 1;
  }
  throw ConfigError(strCat("training program '", program, "' is not on PATH (", dirs,
                           "); give a path such as ./", program, " relative to --code_dir"));
}

std::string tailOfFile(const std::string& path, int maxLines) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line.size() > 400 ? line.substr(0, 400) + "..." : line);
    if (static_cast<int>(lines.size()) > maxLines) lines.pop_front();
  }
  std::string out;
  for (const auto& line : lines) out += (out.empty() ? "" : "\n") + line;
  return out;
}

Agent::Agent(asio::io_context& io, AgentOptions options, std::unique_ptr<ByteStream> manager,
             std::string managerAddress)
    : io_(io),
      options_(std::move(options)),
      manager_(std::make_shared<FramedConnection>(std::move(manager))),
      managerAddress_(std::move(managerAddress)),
      signals_(io, SIGCHLD, SIGTERM, SIGINT),
      heartbeatTimer_(io),
      logCapTimer_(io),
      logCapper_(io, "varuna-logcap"),
      graceTimer_(io),
      readDeadlineTimer_(io),
      killTimer_(io),
      beatSocket_(io),
      beatForwardTimer_(io),
      schedulerNotice_(io, options_.sigtermNotice) {}

void Agent::start() {
  signals_.add(SIGHUP);  // the SSH session that started us may go; we stay
  waitSignals();
  manager_->start([this](const proto::Message& m) { onMessage(m); },
                  [this](const std::string& reason) { onManagerLost(reason); });
  manager_->send(tls::wireHello(proto::Hello{proto::kVersion, options_.credential, "agent", options_.host, -1, -1}));
  scheduleHeartbeat();
  scheduleLogCap();
  scheduleBeatForward(proto::firstRelayDelay(options_.beatForwardInterval, randomFraction()));
  lastFrame_ = std::chrono::steady_clock::now();
  scheduleReadDeadline();
}

void Agent::waitSignals() {
  signals_.async_wait([this](const boost::system::error_code& ec, int signal) {
    if (ec) return;
    if (signal == SIGCHLD) {
      reapChildren();
    } else if (signal == SIGTERM && options_.sigtermNotice.count() > 0 && !schedulerNotice_.started() && !exiting_) {
      onSchedulerNotice();
    } else if (signal != SIGHUP) {
      finish(0, strCat("signal ", ::strsignal(signal)));
    }
    if (!exiting_ || !workers_.empty()) waitSignals();
  });
}

void Agent::scheduleHeartbeat() {
  heartbeatTimer_.expires_after(options_.heartbeatInterval);
  heartbeatTimer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || exiting_ || !manager_->open()) return;
    // A relay this recent told the manager this agent is there (at most 1.6 s
    // without a frame: under the 2 s after which the manager takes its
    // workers' silence for the agent's).
    if (std::chrono::steady_clock::now() - lastRelay_ >= proto::relayStandsForHeartbeat(options_.beatForwardInterval)) {
      manager_->send(proto::Heartbeat{-1, 0});
    }
    scheduleHeartbeat();
  });
}

void Agent::scheduleLogCap() {
  // Every kLogCapInterval, connected to the manager or not: no log of the run
  // folder grows past kMaxLogBytes. The copy (up to 64 MiB) runs on the
  // background thread, never on the loop that relays heartbeats; a round
  // still running when the next is due is not doubled.
  logCapTimer_.expires_after(kLogCapInterval);
  logCapTimer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || exiting_) return;
    if (logCapper_.pending() == 0) {
      auto cap = [runDir = options_.runDir, stop = stopLogCap_] { return capLogs(runDir, kMaxLogBytes, stop.get()); };
      logCapper_.run(std::move(cap), [](const LogCapResult& r) { reportLogCap(r); });
    }
    scheduleLogCap();
  });
}

void Agent::reportLogCap(const LogCapResult& result) {
  const auto cap = kMaxLogBytes >> 20;
  if (result.cut > 0) log::info("cut ", result.cut, " log(s) past ", cap, " MiB (their tails kept in <log>.1)");
  if (result.dropped > 0) {
    log::warn("cut ", result.dropped, " log(s) past ", cap,
              " MiB without keeping their tails: the copy failed (a full disk?)");
  }
}

int Agent::openBeatSocket(int generation) {
  // The previous launch's step reports still go out, under its generation;
  // its workers' beats no longer count.
  drainBeats();
  pendingBeats_.clear();
  relayBeats();
  boost::system::error_code ignored;
  beatSocket_.close(ignored);
  ++beatEpoch_;
  beatGeneration_ = generation;
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, fds) != 0) {
    log::warn("no beat socket for generation ", generation, " (", std::strerror(errno),
              "): its workers beat to the manager directly");
    return -1;
  }
  beatSocket_.assign(asio::local::datagram_protocol(), fds[0]);
  beatSocket_.non_blocking(true);
  readBeats();
  return fds[1];
}

void Agent::readBeats() {
  // Waits for the socket to be readable, then reads what it holds: no
  // datagram ever waits in a completed-but-not-yet-run receive, where a
  // worker's exit could overtake its last step reports (drainBeats, run at
  // each reap, sees everything the socket got). A wait that completed
  // before a relaunch closed its socket still runs (closing cancels only
  // what has not completed): it belongs to the old launch, and must not
  // start a second wait on the new socket.
  const uint64_t epoch = beatEpoch_;
  beatSocket_.async_wait(asio::socket_base::wait_read, [this, epoch](const boost::system::error_code& ec) {
    if (ec == asio::error::operation_aborted || exiting_ || epoch != beatEpoch_) return;
    if (ec) {
      log::warn("reading the workers' beats failed: ", ec.message());
      return;
    }
    drainBeats();
    readBeats();
  });
}

void Agent::onBeatRecord(const char* data, size_t bytes) {
  // Only ranks this agent runs in the current launch count.
  auto ours = [&](int rank) {
    return std::any_of(workers_.begin(), workers_.end(), [&](const auto& entry) {
      return entry.second.rank == rank && entry.second.generation == beatGeneration_;
    });
  };
  if (const auto beat = AgentBeatRecord::decode(data, bytes)) {
    if (monotonicNs() - beat->sentNs <= kMaxAgentBeatAgeNs && ours(beat->rank)) {
      pendingBeats_[beat->rank] = proto::WorkerBeat{beat->rank, beat->step, beat->waiting != 0};
    }
  } else if (const auto report = AgentStepRecord::decode(data, bytes)) {
    if (!ours(report->rank)) return;
    // Bounded should the manager stop reading (its connection then closes).
    if (pendingReports_.size() >= kMaxPendingReports) {
      if (droppedReports_++ == 0) log::warn("the manager does not take the step reports: dropping them");
      return;
    }
    pendingReports_.push_back(proto::StepReport{report->rank, report->stage, report->replica, report->step,
                                                report->loss, report->stepSeconds,
                                                report->computeSecondsPerMicrobatch});
  }
}

void Agent::drainBeats() {
  // What exited workers sent last is in the socket before their exit is:
  // read at each reap, while they still count as ours, their last step
  // reports go out before their WorkerExited. The socket is non-blocking.
  if (!beatSocket_.is_open()) return;
  boost::system::error_code ec;
  while (true) {
    const size_t bytes = beatSocket_.receive(asio::buffer(beatBuffer_), 0, ec);
    if (ec) break;  // would_block: empty
    onBeatRecord(beatBuffer_.data(), bytes);
  }
}

void Agent::relayBeats() {
  if ((!pendingBeats_.empty() || !pendingReports_.empty()) && manager_->open()) {
    // The beats in the first frame; the reports, in order, at most
    // kReportsPerRelay a frame (a frame must stay under the protocol's 1 MiB).
    size_t next = 0;
    do {
      const size_t end = std::min(pendingReports_.size(), next + kReportsPerRelay);
      proto::WorkerBeats relay{beatGeneration_, {}, {}};
      relay.reports.assign(std::make_move_iterator(pendingReports_.begin() + static_cast<ptrdiff_t>(next)),
                           std::make_move_iterator(pendingReports_.begin() + static_cast<ptrdiff_t>(end)));
      if (next == 0) {
        for (const auto& [rank, beat] : pendingBeats_) relay.beats.push_back(beat);
      }
      manager_->send(relay);
      next = end;
    } while (next < pendingReports_.size());
    lastRelay_ = std::chrono::steady_clock::now();
  }
  pendingBeats_.clear();
  pendingReports_.clear();
}

void Agent::scheduleBeatForward(std::chrono::milliseconds delay) {
  beatForwardTimer_.expires_after(delay);
  beatForwardTimer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || exiting_) return;
    relayBeats();
    scheduleBeatForward(options_.beatForwardInterval);
  });
}

void Agent::scheduleReadDeadline() {
  readDeadlineTimer_.expires_at(lastFrame_ + options_.lostManager);
  readDeadlineTimer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || exiting_) return;
    if (std::chrono::steady_clock::now() - lastFrame_ < options_.lostManager) {
      scheduleReadDeadline();  // a frame came meanwhile: count from it
      return;
    }
    const std::string why = strCat("no word from the manager for ", options_.lostManager.count(), " ms");
    log::error(why, " (at ", managerAddress_, ": a partition, or a frozen or dead manager): killing ",
               workers_.size(), " worker(s) and exiting");
    finish(1, why);
    // Closed at once, not after sending: across a partition queued frames
    // may never drain, and the agent must still exit.
    manager_->close(why);
  });
}

void Agent::onMessage(const proto::Message& message) {
  // Any frame says the manager is there (heartbeats, orders, acks, pongs).
  lastFrame_ = std::chrono::steady_clock::now();
  if (const auto* launch = std::get_if<proto::LaunchWorkers>(&message)) {
    this->launch(*launch);
  } else if (std::holds_alternative<proto::CheckpointAndExit>(message)) {
    log::info("checkpoint requested: SIGUSR1 to ", workers_.size(), " worker(s)");
    signalWorkers(SIGUSR1, /*wholeGroup=*/false);
  } else if (const auto* kill = std::get_if<proto::KillWorkers>(&message)) {
    killWorkers(kill->reason);
  } else if (const auto* shutdown = std::get_if<proto::Shutdown>(&message)) {
    finish(0, "the manager released this host: " + shutdown->reason);
  } else if (const auto* ack = std::get_if<proto::Ack>(&message); ack && !ack->ok) {
    log::error("the manager refused this agent: ", ack->error);
    finish(2, ack->error);
  }
}

void Agent::onManagerLost(const std::string& reason) {
  if (exiting_) return;
  log::warn("lost the manager at ", managerAddress_, " (", reason, "); killing ", workers_.size(),
            " worker(s) unless it is back within ", options_.grace.count(), " ms");
  heartbeatTimer_.cancel();
  graceTimer_.expires_after(options_.grace);
  graceTimer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec) finish(1, "the manager is gone");
  });
}

void Agent::launch(const proto::LaunchWorkers& launch) {
  if (!workers_.empty()) {
    log::warn("launch of generation ", launch.generation, " while ", workers_.size(),
              " worker(s) of an earlier one still run: killing them first");
    killWorkers("superseded by generation " + std::to_string(launch.generation));
  }
  const fs::path logDir = fs::path(options_.runDir) / "logs";
  // Inside the private run folder (prepareRunDir): owner only as well.
  if (::mkdir(logDir.c_str(), 0700) != 0 && errno != EEXIST) {
    log::warn("cannot create the log folder ", logDir.string(), ": ", std::strerror(errno));
  }
  if (const size_t pruned = pruneWorkerLogs(logDir, launch.generation)) {
    log::info("removed ", pruned, " worker log(s) of generations before the last ", kKeptLogGenerations);
  }
  std::string program;
  try {
    program = resolveProgram(launch.argv.empty() ? "" : launch.argv.front(), launch.codeDir);
  } catch (const std::exception& e) {
    for (const auto& spec : launch.workers) {
      manager_->send(proto::WorkerExited{options_.host, spec.rank, 127, 0, launch.generation, e.what()});
    }
    return;
  }
  const int beatFd = openBeatSocket(launch.generation);
  for (const auto& spec : launch.workers) {
    const std::string logPath =
        (logDir / strCat("g", launch.generation, "_rank", spec.rank, ".log")).string();
    pid_t pid = -1;
    std::string failure;
    try {
      pid = spawn(program, launch, spec, logPath, beatFd);
      if (pid < 0) failure = strCat("fork failed: ", std::strerror(errno));
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (pid < 0) {
      manager_->send(proto::WorkerExited{options_.host, spec.rank, 127, 0, launch.generation, failure});
      continue;
    }
    workers_[pid] = Worker{spec.rank, launch.generation, logPath};
    log::info("generation ", launch.generation, ": rank ", spec.rank, " started (pid ", pid, ", log ", logPath, ")");
  }
  if (beatFd >= 0) ::close(beatFd);  // the workers hold it now
}

pid_t Agent::spawn(const std::string& program, const proto::LaunchWorkers& launch, const proto::WorkerSpec& spec,
                   const std::string& logPath, int beatFd) {
  // Everything the child needs is built before fork: only async-signal-safe
  // calls happen between fork and exec.
  const LaunchArgs args = workerLaunch(launch, spec, options_, managerAddress_, beatFd >= 0);
  auto argvStrings = workerArgv(program, launch, args);
  auto envStrings = workerEnv(launch, args);
  auto argv = cStrings(argvStrings);
  auto envp = cStrings(envStrings);
  // A worker's log may quote its data or environment: owner only, and never
  // written through a link planted in its place.
  const int logFd = ::open(logPath.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600);
  const int tokenFd = pipeHolding(args.jobToken);
  if (tokenFd < 0) {
    const int error = errno;
    if (logFd >= 0) ::close(logFd);
    throw std::runtime_error(strCat("no pipe for the worker's credential: ", std::strerror(error)));
  }
  const bool sigtermNotice = options_.sigtermNotice.count() > 0;
  const pid_t agent = ::getpid();
  const pid_t pid = ::fork();
  if (pid != 0) {
    if (logFd >= 0) ::close(logFd);
    ::close(tokenFd);
    return pid;
  }
  // The worker dies with its agent (an OOM-killed or crashed agent takes its
  // workers along; the signal survives exec). The agent may have died between
  // fork and prctl: then the child has been re-parented already and ends
  // here. (The signal follows the thread that forked; the agent forks from
  // its event loop's thread, which lives as long as the agent; the log
  // capper's thread never forks.)
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != agent) ::_exit(127);
  ::setpgid(0, 0);  // its own group: a kill reaches whatever it spawned
  // SIGUSR1 (checkpoint and exit) stays blocked across exec: one that arrives
  // while the program starts is kept pending instead of killing it (the
  // default action), and installCheckpointSignalHandler() unblocks it once the
  // handler is in place, so the request is honoured after the first step.
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGUSR1);
  ::sigprocmask(SIG_SETMASK, &mask, nullptr);
  for (int sig : {SIGPIPE, SIGUSR1, SIGTERM, SIGINT, SIGHUP, SIGCHLD}) ::signal(sig, SIG_DFL);
  // A scheduler that signals every process of the job (Slurm's step, a pod)
  // must not kill the workers before the manager has moved the job: with
  // --sigterm_notice_s they ignore SIGTERM (the agent stops them with SIGKILL).
  if (sigtermNotice) ::signal(SIGTERM, SIG_IGN);
  const int devNull = ::open("/dev/null", O_RDONLY);
  if (devNull >= 0) ::dup2(devNull, 0);
  if (logFd >= 0) {
    ::dup2(logFd, 1);
    ::dup2(logFd, 2);
  }
  // The beat socket on its agreed descriptor (dup2 clears close-on-exec;
  // one already there keeps it, so it is cleared by hand).
  if (beatFd == kAgentBeatFd) {
    ::fcntl(kAgentBeatFd, F_SETFD, 0);
  } else if (beatFd >= 0) {
    ::dup2(beatFd, kAgentBeatFd);
  } else {
    ::close(kAgentBeatFd);
  }
  // The credential's pipe on its agreed descriptor (tokenFd >= 10: nothing
  // above clobbered it); the worker reads it once and closes it.
  ::dup2(tokenFd, contract::kJobTokenFd);
  ::close_range(contract::kJobTokenFd + 1, ~0U, 0);  // the agent's sockets stay the agent's
  if (::chdir(launch.codeDir.c_str()) != 0) {
    const char msg[] = "varuna_agent: cannot enter code_dir\n";
    (void)!::write(2, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  ::execve(argv[0], argv.data(), envp.data());
  const char msg[] = "varuna_agent: exec of the training program failed\n";
  (void)!::write(2, msg, sizeof(msg) - 1);
  ::_exit(127);
}

void Agent::signalWorkers(int signal, bool wholeGroup) {
  for (const auto& [pid, worker] : workers_) ::kill(wholeGroup ? -pid : pid, signal);
}

void Agent::killWorkers(const std::string& reason) {
  if (workers_.empty()) return;
  log::warn("killing ", workers_.size(), " worker(s): ", reason);
  signalWorkers(SIGKILL, /*wholeGroup=*/true);
}

void Agent::reapChildren() {
  while (true) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) break;
    auto it = workers_.find(pid);
    if (it == workers_.end()) continue;
    drainBeats();
    relayBeats();
    const Worker worker = it->second;
    workers_.erase(it);
    ::kill(-pid, SIGKILL);  // anything it left behind in its group
    proto::WorkerExited exited{options_.host, worker.rank, 0, 0, worker.generation, ""};
    if (WIFEXITED(status)) {
      exited.exitCode = WEXITSTATUS(status);
    } else {
      exited.exitCode = -1;
      exited.signal = WTERMSIG(status);
    }
    const WorkerExit exit{exited.exitCode, exited.signal};
    if (!exit.asOrdered()) exited.logTail = tailOfFile(worker.logPath, 8);
    log::info("rank ", worker.rank, " (generation ", worker.generation, ") exited: ", exit.describe());
    if (manager_->open()) manager_->send(exited);
  }
  maybeExit();
  leaveIfPreemptedAndIdle();
}

void Agent::onSchedulerNotice() {
  schedulerNotice_.start(
      {managerAddress_, credentials::notifier(options_.credential), options_.host},
      [this](bool acknowledged) {
        noticeAcknowledged_ = acknowledged;
        leaveIfPreemptedAndIdle();
      },
      [this] { finish(0, "the scheduler's grace time is over"); });
}

void Agent::leaveIfPreemptedAndIdle() {
  // The manager has moved the job off this host and stopped its workers:
  // nothing is left for the scheduler to kill.
  if (noticeAcknowledged_ && workers_.empty()) finish(0, "preempted: the manager moved the job off this host");
}

void Agent::finish(int exitCode, const std::string& reason) {
  if (exiting_) return;
  exiting_ = true;
  exitCode_ = exitCode;
  log::info("agent exiting: ", reason);
  killWorkers(reason);
  heartbeatTimer_.cancel();
  logCapTimer_.cancel();
  stopLogCap_->store(true);  // a round still copying stops at its next file: the exit must not wait for it
  graceTimer_.cancel();
  schedulerNotice_.cancel();
  readDeadlineTimer_.cancel();
  beatForwardTimer_.cancel();
  boost::system::error_code ignored;
  beatSocket_.close(ignored);
  // Workers die at once on SIGKILL; the timer only guards against a child
  // that cannot be reaped (e.g. stuck in the kernel).
  killTimer_.expires_after(options_.killWait);
  killTimer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;
    workers_.clear();
    maybeExit();
  });
  maybeExit();
}

void Agent::maybeExit() {
  if (!exiting_ || !workers_.empty()) return;
  killTimer_.cancel();
  signals_.cancel();
  manager_->closeAfterSending("agent exiting");
}

}  // namespace varuna
