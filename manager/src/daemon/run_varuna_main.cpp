// run_varuna: the manager daemon (see manager_daemon.h) and its `status`
// subcommand, which prints the live state of a job from its state folder
// (once, or refreshed with --watch).
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio/signal_set.hpp>
#include <CLI/CLI.hpp>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/time_util.h"
#include "varuna/manager/credentials.h"
#include "daemon/job_setup.h"
#include "loop/handler_guard.h"
#include "varuna/manager/host_launcher.h"
#include "varuna/manager/job_config.h"
#include "varuna/manager/manager_daemon.h"

namespace {

namespace fs = std::filesystem;
using namespace varuna;
using nlohmann::json;

std::string selfExecutable(const char* argv0) {
  std::error_code ec;
  const auto path = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(argv0) : path.string();
}

// state.json of a state folder: 0 and the state, or the exit code and the
// reason in `error` (no file: 2, the folder is wrong; not JSON: 1).
int readState(const fs::path& path, json& state, std::string& error) {
  std::ifstream in(path);
  if (!in) {
    error = "no job state at " + path.string() + " (is --state_dir the one run_varuna uses?)";
    return kExitConfigError;
  }
  try {
    state = json::parse(in);
  } catch (const std::exception& e) {
    error = path.string() + " is not valid JSON: " + e.what();
    return 1;
  }
  return 0;
}

// A copy: a key missing from an older state.json reads as null.
void printState(json state, std::ostream& out) {
  const int pid = state.value("pid", 0);
  const bool alive = pid > 0 && ::kill(pid, 0) == 0;
  std::string phase = state.value("phase", "?");
  if (!alive && phase != "finished" && phase != "failed") phase += " (manager not running)";
  out << "job            " << state.value("job", "?") << "\n"
      << "phase          " << phase << "\n"
      << "manager        pid " << pid << ", " << state.value("address", "?") << ", up "
      << static_cast<int>(state.value("uptime_s", 0.0)) << " s, updated " << state.value("updated", "?") << "\n"
      << "generation     " << state.value("generation", 0) << ", morphs " << state.value("morphs", 0) << "\n";
  if (state.contains("plan") && state["plan"].is_object()) {
    const auto& plan = state["plan"];
    out << "plan           " << plan.value("stages", 0) << " stages x " << plan.value("replicas", 0)
        << " replicas, micro-batch " << plan.value("chunk_size", 0) << ", global batch "
        << plan.value("global_batch", 0) << ", map " << plan.value("stage_to_rank_map", "") << "\n";
  }
  const auto& progress = state["progress"];
  out << "progress       step " << progress.value("step", -1) << ", loss " << progress.value("loss", 0.0) << ", "
      << progress.value("samples_per_s", 0.0) << " samples/s\n";
  out << "checkpoint     "
      << (state["last_checkpoint_step"].is_number() ? "step " + state["last_checkpoint_step"].dump() : "none")
      << " in " << state.value("global_store", "?") << "\n";
  if (state.value("checkpoint_failures", 0) > 0) {
    const auto& last = state["last_checkpoint_failure"];
    out << "ckpt failures  " << state.value("checkpoint_failures", 0);
    if (last.is_object()) {
      out << ", the last: step " << last.value("step", int64_t{-1}) << " on " << last.value("host", "?") << ": "
          << last.value("error", "");
    }
    out << "\n";
  }
  if (state.contains("skipped_checkpoints") && !state["skipped_checkpoints"].empty()) {
    out << "skipped ckpts  " << state["skipped_checkpoints"].dump() << " (damaged or incomplete)\n";
  }
  for (const auto& [host, info] : state["hosts"].items()) {
    out << "host           " << host << ": " << info.value("slots", 0) << " slot(s), agent "
        << info.value("agent", "?") << (info.value("preempted", false) ? ", preempted" : "");
    if (info.contains("out") && info["out"].is_object()) {
      const auto& away = info["out"];
      char text[256];
      std::snprintf(text, sizeof(text), ", out %.0f s (%s), back when %s", away.value("for_s", 0.0),
                    away.value("why", std::string("?")).c_str(), away.value("back_when", std::string("?")).c_str());
      out << text;
      if (away.contains("retry_in_s") && away["retry_in_s"].is_number()) {
        std::snprintf(text, sizeof(text), " (next start-up in %.0f s; %d so far)", away["retry_in_s"].get<double>(),
                      away.value("attempts", 0));
        out << text;
      }
    }
    out << "\n";
  }
  if (!state["slow_machines"].empty()) out << "slow machines  " << state["slow_machines"].dump() << "\n";
  if (!state.value("stop_reason", "").empty()) out << "stopped        " << state.value("stop_reason", "") << "\n";
  if (state.contains("metrics_address") && state["metrics_address"].is_string()) {
    out << "metrics        http://" << state["metrics_address"].get<std::string>() << "/metrics\n";
  }
  out << "events         " << state.value("events", "") << std::endl;
}

std::atomic<bool> watchInterrupted{false};

// --watch: the status every `interval` until Ctrl-C (or `count` times). On a
// terminal each refresh redraws the screen, as watch(1) does; into a pipe or
// a file each is a block after a header line (--json: one line of JSON each).
int watchStatus(const fs::path& path, bool raw, double interval, int count) {
  struct sigaction action{};
  action.sa_handler = [](int) { watchInterrupted = true; };
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  const bool terminal = ::isatty(STDOUT_FILENO) == 1;
  char every[32];
  std::snprintf(every, sizeof(every), "%g", interval);
  const auto period = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(interval));
  auto next = std::chrono::steady_clock::now();
  for (int shown = 0; !watchInterrupted && (count == 0 || shown < count); ++shown) {
    json state;
    std::string error;
    const int code = readState(path, state, error);
    std::ostringstream frame;  // written at once: no half-drawn screen
    if (raw) {
      if (code == 0) frame << state.dump() << "\n";
    } else {
      frame << (terminal ? "\x1b[H\x1b[2J" : "") << "every " << every << " s: run_varuna status --state_dir "
            << path.parent_path().string() << "    " << isoTimeNow() << "\n\n";
      if (code == 0) {
        printState(state, frame);
      } else {
        frame << error << "; trying again\n";  // a job starting: its state.json comes
      }
      if (!terminal) frame << "\n";
    }
    if (raw && code != 0) std::cerr << error << "; trying again" << std::endl;
    std::cout << frame.str() << std::flush;
    if (count != 0 && shown + 1 >= count) break;
    next += period;
    // Short naps, so that Ctrl-C ends the wait at once.
    while (!watchInterrupted && std::chrono::steady_clock::now() < next) {
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
          next - std::chrono::steady_clock::now(), std::chrono::milliseconds(50)));
    }
  }
  return 0;
}

int printStatus(int argc, char** argv) {
  CLI::App app{"run_varuna status: the live state of a job"};
  std::string stateDir;
  bool raw = false;
  bool watch = false;
  double interval = 1;
  int count = 0;
  app.add_option("--state_dir", stateDir, "the job's state folder (run_varuna --state_dir)")->required();
  app.add_flag("--json", raw, "print state.json as it is (with --watch: one line of JSON per refresh)");
  app.add_flag("--watch", watch, "print the status again every --interval seconds, until Ctrl-C");
  app.add_option("--interval", interval, "seconds between refreshes with --watch (default 1)");
  app.add_option("--count", count, "with --watch: stop after this many refreshes (default 0: until Ctrl-C)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitConfigError;
  }
  if (!(interval >= 0.1) || !std::isfinite(interval)) {
    std::cerr << "run_varuna status: --interval must be at least 0.1 (seconds), got " << interval << std::endl;
    return kExitConfigError;
  }
  if (count < 0) {
    std::cerr << "run_varuna status: --count must be >= 0 (0: until Ctrl-C), got " << count << std::endl;
    return kExitConfigError;
  }
  if (!watch && (app.count("--interval") || app.count("--count"))) {
    std::cerr << "run_varuna status: --interval and --count go with --watch" << std::endl;
    return kExitConfigError;
  }
  const fs::path path = fs::path(stateDir) / "state.json";
  if (watch) return watchStatus(path, raw, interval, count);
  json state;
  std::string error;
  if (const int code = readState(path, state, error); code != 0) {
    std::cerr << error << std::endl;
    return code;
  }
  if (raw) {
    std::cout << state.dump(2) << std::endl;
    return 0;
  }
  printState(state, std::cout);
  return 0;
}

// `run_varuna join-token`: a join credential for hosts that join by themselves
// (docs/deployment.md), for a scheduler's secret store (a Kubernetes Secret,
// a Slurm job's private file) before or while the manager runs. It makes the
// job's secret in the state folder when there is none yet, as the manager
// would (the manager then uses the same one).
int printJoinToken(int argc, char** argv) {
  CLI::App app{"run_varuna join-token: a join credential for `varuna_agent --join`"};
  std::string stateDir, out;
  double ttlH = 720;
  app.add_option("--state_dir", stateDir, "the job's state folder (run_varuna --state_dir)")->required();
  app.add_option("--ttl_h", ttlH, "hours the credential stays valid (default 720)")->check(CLI::Range(0.001, 87600.0));
  app.add_option("--out", out, "write it to this file (mode 0600) instead of stdout");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitConfigError;
  }
  try {
    std::error_code ec;
    fs::create_directories(stateDir, ec);
    if (ec) throw ConfigError(strCat("cannot create --state_dir ", stateDir, ": ", ec.message()));
    const std::string credential =
        credentials::join(loadOrCreateToken(stateDir), unixSecondsNow() + static_cast<int64_t>(ttlH * 3600));
    if (out.empty()) {
      std::cout << credential << std::endl;
      return 0;
    }
    ckpt::writePrivateFileAtomic(fs::absolute(out).parent_path(), fs::path(out).filename().string(), credential + "\n");
    std::cerr << "join credential written to " << out << " (valid " << ttlH << " h)" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "run_varuna join-token: " << e.what() << std::endl;
    return kExitConfigError;
  }
}

// Every agent and worker holds a connection, and connections that have not
// said hello yet hold one each until their deadline: the usual soft limit of
// 1024 is low for a large job. The hard limit is what the administrator (or
// systemd's LimitNOFILE=) allows; children inherit the raised limit.
void raiseOpenFileLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    log::warn("cannot read the open-file limit: ", std::strerror(errno));
    return;
  }
  const auto text = [](rlim_t value) {
    return value == RLIM_INFINITY ? std::string("unlimited") : std::to_string(value);
  };
  const rlim_t before = limit.rlim_cur;
  if (limit.rlim_cur != limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      log::warn("cannot raise the open-file limit from ", text(before), " to ", text(limit.rlim_max), ": ",
                std::strerror(errno));
      return;
    }
  }
  log::info("open-file limit: ", text(limit.rlim_cur), " (soft limit was ", text(before), ", hard limit ",
            text(limit.rlim_max), ")");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "status") return printStatus(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "join-token") return printJoinToken(argc - 1, argv + 1);
  JobConfig config;
  try {
    int exitCode = 0;
    auto parsed = parseCommandLine(argc, argv, exitCode);
    if (!parsed) return exitCode;
    config = *parsed;
    validateJobConfig(config, selfExecutable(argv[0]));
    log::configure({"manager", config.job, "head"}, log::parseLevel(config.logLevel));
  } catch (const ConfigError& e) {
    std::cerr << "run_varuna: " << e.what() << std::endl;
    return kExitConfigError;
  }
  if (config.dryRun) {
    try {
      std::cout << dryRunReport(config) << std::flush;
      return 0;
    } catch (const ConfigError& e) {
      std::cerr << "run_varuna: " << e.what() << std::endl;
      return kExitConfigError;
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
  raiseOpenFileLimit();
  boost::asio::io_context io;
  SshOptions ssh;
  ssh.user = config.sshUser;
  ssh.port = config.sshPort;
  ssh.identityFile = config.sshIdentity;
  ssh.knownHostsFile = config.sshKnownHosts;
  ssh.connectTimeout = std::chrono::milliseconds(static_cast<int64_t>(config.sshConnectTimeoutS * 1000));
  ManagerDaemon daemon(io, config, std::make_unique<ShellHostLauncher>(ssh));
  boost::asio::signal_set signals(io, SIGTERM, SIGINT);
  HandlerGuard guard;
  std::function<void()> waitForSignal = [&] {
    signals.async_wait([&](const boost::system::error_code& ec, int signal) {
      if (ec) return;
      guard.run("stopping on a signal", [&] { daemon.requestStop(strCat("stopped by ", ::strsignal(signal))); });
      waitForSignal();
    });
  };
  try {
    daemon.start();
  } catch (const Error& e) {  // a ConfigError (2), or the store failing (74): the code says which
    log::error(e.what());
    log::flush();
    return e.exitCode();
  }
  waitForSignal();
  // Until the daemon stops the loop. Every handler of the daemon runs under
  // its HandlerGuard; this is the last line should one slip through: the
  // loop goes on (run() may be called again after a handler threw).
  for (;;) {
    try {
      io.run();
      break;
    } catch (const std::exception& e) {
      guard.report("an event-loop handler", e.what());
    } catch (...) {
      guard.report("an event-loop handler", "an exception that is not a std::exception");
    }
  }
  log::flush();
  return daemon.exitCode();
}
