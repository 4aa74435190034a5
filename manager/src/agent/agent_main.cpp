// varuna_agent: the per-host process run_varuna starts (see agent.h). Usually
// started with --daemonize: the launching command (local shell or SSH) returns
// as soon as the agent has reached the manager, with a clear error otherwise.
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>

#include "varuna/common/certificate_credential.h"
#include "varuna/common/control_client.h"
#include "varuna/common/log.h"
#include "varuna/common/time_util.h"
#include "agent/agent.h"
#include "loop/tcp_stream.h"
#include "loop/tls_stream.h"
#include "agent/join.h"
#include "agent/scheduler_grace.h"
#include "agent/run_dir.h"
#include "varuna/manager/job_config.h"

namespace {

namespace fs = std::filesystem;
using namespace varuna;

struct MainOptions {
  AgentOptions agent;
  std::string manager;
  std::string codeDir = ".";
  std::string program;
  double graceS = 5;
  int64_t lostManagerMs = 15000;
  int64_t beatRelayMs = 250;
  bool daemonize = false;
  std::string logLevel = "info";
  // Given on the command line: a join does not override them.
  bool graceSet = false, lostManagerSet = false, beatRelaySet = false;
  // --join: the host came by itself (join.h); empty: run_varuna started it.
  std::string join;
  std::string joinTokenFile;
  int slots = 1;
  double joinWaitS = 600;
};

// The agent's credential (its host's, credentials.h): from stdin's first line
// (run_varuna's way: neither a command line nor an environment that `ps`
// shows) or from VARUNA_JOB_TOKEN (starting an agent by hand). Workers get
// their own credentials, derived from it, never it, each on a pipe
// (VARUNA_JOB_TOKEN_FD).
std::string readJobToken(bool fromStdin) {
  std::string token;
  if (fromStdin) {
    std::getline(std::cin, token);
    if (token.empty()) throw ConfigError("--token_stdin was given but stdin held no token line");
  } else {
    const char* value = std::getenv("VARUNA_JOB_TOKEN");
    if (!value || !*value)
      throw ConfigError("no job token: pass it on stdin with --token_stdin or set VARUNA_JOB_TOKEN "
                        "(varuna_agent is started by run_varuna)");
    token = value;
  }
  ::unsetenv("VARUNA_JOB_TOKEN");
  return token;
}

// --sigterm_notice_s: seconds, or "auto" (the Slurm partition's GraceTime).
std::chrono::milliseconds parseSigtermNotice(const std::string& value) {
  if (value == "auto") {
    const auto grace = slurmGraceTime();
    if (grace.count() == 0) log::warn("the partition's GraceTime is 0: a SIGTERM stops the agent at once");
    return grace;
  }
  char* end = nullptr;
  const double seconds = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || !(seconds >= 0) || seconds > 86400 * 7) {
    throw ConfigError(strCat("--sigterm_notice_s must be seconds (0 to a week) or auto, got '", value, "'"));
  }
  return millis(seconds);
}

std::string thisHostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || !*name) {
    throw ConfigError("cannot read this machine's host name: give --host");
  }
  return name;
}

// Daemon mode: the parent waits on a pipe for the child's verdict ("ok" or an
// error line) and turns it into its own output and exit code.
int waitForChild(int readFd, const std::string& logPath) {
  std::string verdict;
  char buffer[512];
  ssize_t n;
  while ((n = ::read(readFd, buffer, sizeof(buffer))) > 0) verdict.append(buffer, static_cast<size_t>(n));
  if (verdict.rfind("ok ", 0) == 0) {
    std::cout << "varuna_agent started (pid " << verdict.substr(3, verdict.find('\n') - 3) << ", log " << logPath
              << ")" << std::endl;
    return 0;
  }
  std::cerr << (verdict.empty() ? "varuna_agent: the agent died while starting; see " + logPath : verdict)
            << std::endl;
  return verdict.rfind("config", 0) == 0 ? kExitConfigError : 1;
}

// The start-up's verdict: to the waiting parent (daemon mode), else stderr.
void report(int fd, const std::string& line) {
  if (fd < 0) {
    if (line.rfind("ok ", 0) != 0) std::cerr << line << std::flush;
    return;
  }
  (void)!::write(fd, line.data(), line.size());
  ::close(fd);
}

// --join: the host's agent credential and the job's env_file variables,
// from the manager. The exit code when that failed (the verdict reported), else 0.
int joinFirst(MainOptions& options, const std::string& joinCredential, int verdictFd) {
  try {
    JoinRequest request{options.manager, joinCredential, options.agent.host, options.slots,
                        millis(options.joinWaitS)};
    const proto::Joined joined = joinManager(request);
    options.agent.credential = joined.credential;
    // The job's timing, as run_varuna gives the agents it starts (unless set here).
    const char* graceFrom = options.graceSet ? "set here" : "the default";
    const char* lostFrom = options.lostManagerSet ? "set here" : "the default";
    if (joined.graceMs > 0 && !options.graceSet) {
      options.agent.grace = std::chrono::milliseconds(joined.graceMs);
      graceFrom = "the job's";
    }
    if (joined.lostManagerMs > 0 && !options.lostManagerSet) {
      options.agent.lostManager = std::chrono::milliseconds(joined.lostManagerMs);
      lostFrom = "the job's";
    }
    if (joined.beatRelayMs > 0 && !options.beatRelaySet) {  // as --beat_relay_ms allows
      options.agent.beatForwardInterval = std::chrono::milliseconds(std::clamp<int64_t>(joined.beatRelayMs, 10, 1000));
    }
    for (const auto& [name, value] : joined.env) {
      // The plaintext switch and credentials are this agent's own business.
      if (isControlPlaneVariable(name)) {
        log::warn("the manager's environment names ", name, ": ignored (varuna sets it itself)");
        continue;
      }
      ::setenv(name.c_str(), value.c_str(), 1);
    }
    // The timing in force and whose it is (tests/e2e/join_test.py reads this line).
    log::info("joined the job at ", options.manager, " as host ", options.agent.host, " (", options.slots,
              " slots); grace ", options.agent.grace.count(), " ms (", graceFrom, "), manager lost after ",
              options.agent.lostManager.count(), " ms without a word (", lostFrom, "), heartbeats relayed every ",
              options.agent.beatForwardInterval.count(), " ms");
    return 0;
  } catch (const ConfigError& e) {
    log::error("join refused: ", e.what());
    report(verdictFd, strCat("config error: varuna_agent on ", options.agent.host, ": ", e.what(), "\n"));
    return kExitConfigError;
  } catch (const std::exception& e) {
    log::error(e.what());
    report(verdictFd, strCat("varuna_agent on ", options.agent.host, ": ", e.what(), "\n"));
    return 1;
  }
}

std::string rereadJoinCredential(const MainOptions& options, const std::string& previous) {
  try {
    return readJoinCredential(options.joinTokenFile);
  } catch (const std::exception& e) {
    log::warn("cannot read --join_token_file again (", e.what(), "); trying the credential read before");
    return previous;
  }
}

// The connection to the manager, secured: a stream, or why not and whether
// the manager refused this agent (a lasting error) or the connection failed.
struct SecuredConnection {
  std::unique_ptr<ByteStream> stream;
  bool refused = false;
  std::string why;
};

// TLS with the agent's credential, its handshake done (within 10 s), unless
// the job's control plane is plaintext (to this machine only).
SecuredConnection secure(boost::asio::io_context& io, boost::asio::ip::tcp::socket socket,
                         boost::asio::ssl::context& context, const MainOptions& options) {
  if (tls::plaintextRequested()) {
    boost::system::error_code ec;
    const auto peer = socket.remote_endpoint(ec);
    if (ec || !tls::isLoopback(*peer.data())) {
      return {nullptr, true, strCat("refusing to speak in plaintext to ", options.manager,
                                    ", not on this machine (--insecure_plaintext_control is for loopback only)")};
    }
    return {std::make_unique<TcpStream>(std::move(socket)), false, ""};
  }
  const proto::Hello hello{proto::kVersion, options.agent.credential, "agent", options.agent.host, -1, -1};
  auto stream = TlsStream::client(std::move(socket), context,
                                  tls::clientCredential(hello));
  std::optional<boost::system::error_code> result;
  boost::asio::steady_timer timer(io, std::chrono::seconds(10));
  timer.async_wait([&](const boost::system::error_code& ec) {
    if (!ec && !result) stream->close();  // no answer in time: the handshake ends with an error
  });
  stream->asyncHandshake([&](const boost::system::error_code& ec) {
    result = ec;
    timer.cancel();
  });
  while (!result && io.run_one() > 0) {
  }
  io.run();  // the cancelled timer's handler
  io.restart();
  if (result && !*result) return {std::move(stream), false, ""};
  // An error of the TLS protocol is the manager's refusal (or no key of its
  // own); a timeout, a reset or an end of file is the connection's.
  const bool refused = result && *result == boost::system::errc::protocol_error;
  std::string why = !stream->handshakeFailure().empty() ? stream->handshakeFailure()
                    : result                            ? result->message()
                                                        : std::string("no answer");
  if (!result || *result == boost::asio::error::operation_aborted) why = "no answer within 10 s";
  return {nullptr, refused, why};
}

// How far one round of an agent's life got.
enum class Reached { kNothing, kJoined, kServed };

// A start-up failure: the verdict for run_varuna (or stderr); for a joined
// agent, which will join again, a warning in its log only (the verdict is
// still owed, by the round that gets through or fails for good).
void failStart(const MainOptions& options, int& verdictFd, const std::string& line) {
  if (!options.join.empty()) {
    log::warn(line.substr(0, line.size() - 1));
    return;
  }
  report(verdictFd, line);
  verdictFd = -1;
}

// One agent's life: (join,) connect, serve until it exits; its exit code.
// `reached`: how far it got. `verdictFd` is -1 once the verdict is given.
int runOnce(MainOptions options, const std::string& joinCredential, int& verdictFd, Reached& reached) {
  reached = Reached::kNothing;
  boost::asio::io_context io;
  // Joined first: a refused join must leave an agent already running alone.
  if (!options.join.empty()) {
    if (const int failed = joinFirst(options, joinCredential, verdictFd); failed != 0) {
      verdictFd = -1;
      log::flush();
      return failed;
    }
    reached = Reached::kJoined;
  }
  replacePreviousAgent(options.agent.runDir);
  int fd = -1;
  try {
    auto client = proto::ControlClient::connect(options.manager, std::chrono::seconds(10));
    fd = client.release();
  } catch (const std::exception& e) {
    failStart(options, verdictFd,
              strCat("varuna_agent on ", options.agent.host, ": ", e.what(),
                     " (is run_varuna reachable from this host? check --manager_ip and firewalls)\n"));
    return 1;
  }
  boost::asio::ip::tcp::socket socket(io);
  boost::system::error_code ec;
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  socket.assign(addr.ss_family == AF_INET6 ? boost::asio::ip::tcp::v6() : boost::asio::ip::tcp::v4(), fd, ec);
  const auto tlsContext = makeControlTlsContext(false);
  auto secured = secure(io, std::move(socket), *tlsContext, options);
  if (secured.refused) {
    report(verdictFd, strCat("varuna_agent on ", options.agent.host, ": the manager at ", options.manager,
                             " did not accept this agent's credential in the TLS handshake (", secured.why,
                             "): a stale credential, the manager of another job, or a plaintext one "
                             "(--insecure_plaintext_control); nothing was sent\n"));
    verdictFd = -1;
    return kExitConfigError;
  }
  if (!secured.stream) {
    failStart(options, verdictFd,
              strCat("varuna_agent on ", options.agent.host, ": the TLS handshake with the manager at ",
                     options.manager, " did not complete: ", secured.why, "\n"));
    return 1;
  }
  writeConnectionFile(options.agent.runDir, options.manager, options.agent);
  Agent agent(io, options.agent, std::move(secured.stream), options.manager);
  agent.start();
  reached = Reached::kServed;
  report(verdictFd, strCat("ok ", ::getpid(), "\n"));
  verdictFd = -1;
  io.run();
  log::flush();
  return agent.exitCode();
}

// A joined host outlives its manager: when the manager is lost (exit 1: a
// restart, a requeued manager job, a partition) the agent, its workers
// killed, joins again (waiting up to --join_wait_s for the manager), as a
// scheduler's task should rather than end; so too when it was let in but its
// connection then failed (a reset, a handshake cut short), up to
// kMaxUnservedJoins times in a row with a growing pause. Released (0),
// refused (2), stopped by a signal, or not let in again within the wait, it
// exits.
int run(const MainOptions& options, const std::string& joinCredential, int verdictFd) {
  constexpr int kMaxUnservedJoins = 5;
  int unservedJoins = 0;
  // The end: logged, and the verdict if it is still owed (daemon mode).
  const auto end = [&](int code, const std::string& why) {
    log::error("varuna_agent on ", options.agent.host, ": ", why);
    log::flush();
    if (verdictFd >= 0) report(verdictFd, strCat("varuna_agent on ", options.agent.host, ": ", why, "\n"));
    return code;
  };
  for (int round = 0;; ++round) {
    Reached reached = Reached::kNothing;
    int code = 1;
    try {
      // The file again each round: run_varuna (or the scheduler's secret
      // store) renews it, and the one read at start may have expired since.
      const std::string credential = round > 0 && !options.joinTokenFile.empty()
                                         ? rereadJoinCredential(options, joinCredential)
                                         : joinCredential;
      code = runOnce(options, credential, verdictFd, reached);
    } catch (const std::exception& e) {  // a thread or a file that could not be made: an end, not an abort
      return end(1, strCat("stopped: ", e.what()));
    }
    if (options.join.empty() || reached == Reached::kNothing || code != 1) {
      if (verdictFd >= 0) return end(code, strCat("exited with code ", code, " before serving the manager"));
      return code;
    }
    if (reached == Reached::kServed) {
      unservedJoins = 0;
      log::warn("the manager was lost: joining again (for up to ", options.joinWaitS, " s)");
      continue;
    }
    if (++unservedJoins > kMaxUnservedJoins) {
      return end(code, strCat("let in ", kMaxUnservedJoins + 1,
                              " times, but the connection to the manager failed each time; giving up"));
    }
    const auto pause = std::chrono::seconds(1 << std::min(unservedJoins, 4));
    log::warn("joined, but the connection to the manager failed: joining again in ", pause.count(), " s (",
              unservedJoins, " of ", kMaxUnservedJoins, ")");
    std::this_thread::sleep_for(pause);
  }
}

// run_varuna's env_file variables, on stdin's line after the token (never on
// the command line, which `ps` shows): set for the agent and what it starts.
void setEnvironmentFromStdin() {
  std::string line;
  std::getline(std::cin, line);
  const auto pairs = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!pairs.is_array()) throw ConfigError("--env_stdin: stdin's second line is not a JSON list of [name, value] pairs");
  for (const auto& pair : pairs) {
    if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string() || !pair[1].is_string()) {
      throw ConfigError("--env_stdin: every entry must be a [name, value] pair of strings");
    }
    // A credential or the plaintext switch is never the env file's (run_varuna
    // refuses such a line; an older or a forged one is ignored here).
    if (isControlPlaneVariable(pair[0].get<std::string>())) continue;
    ::setenv(pair[0].get<std::string>().c_str(), pair[1].get<std::string>().c_str(), 1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MainOptions options;
  CLI::App app{"varuna_agent: starts and watches the workers of one host for run_varuna"};
  app.add_option("--manager", options.manager, "run_varuna's control address host:port (it started this agent)");
  app.add_option("--join", options.join,
                 "join the job of the run_varuna at this host:port by itself (under a scheduler: Slurm, Kubernetes) "
                 "with the join credential of --join_token_file or VARUNA_JOIN_TOKEN");
  app.add_option("--join_token_file", options.joinTokenFile,
                 "with --join: a file only you can read holding the join credential (run_varuna's "
                 "<state_dir>/join_token or a copy)");
  app.add_option("--slots", options.slots, "with --join: the workers this host runs (its GPUs; default 1)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--join_wait_s", options.joinWaitS,
                 "with --join: keep trying this long while the manager cannot be reached yet, and again each time it "
                 "is lost (a requeued manager job waits out its scheduler's delay; default 600)")
      ->check(CLI::PositiveNumber);
  app.add_option("--host", options.agent.host,
                 "this host's name in the machine list; with --join, the name (an address the other hosts reach) "
                 "it joins as (default: this machine's host name)");
  app.add_option("--job", options.agent.job, "job name")->required();
  app.add_option("--run_dir", options.agent.runDir, "logs, pid file and connection.json (default /tmp/varuna/JOB/HOST)");
  app.add_option("--code_dir", options.codeDir, "folder the workers start in");
  app.add_option("--program", options.program, "training program, checked before starting");
  app.add_option("--grace_s", options.graceS, "kill the workers when the manager is gone this long")->check(CLI::PositiveNumber);
  app.add_option("--lost_manager_ms", options.lostManagerMs,
                 "kill the workers and exit when no frame at all (the manager heartbeats every second) came "
                 "from the manager this long, even if the connection is up (a silent partition; default 15000)")
      ->check(CLI::PositiveNumber);
  app.add_option("--beat_relay_ms", options.beatRelayMs,
                 "relay the workers' heartbeats and step reports to the manager this often (run_varuna passes a "
                 "twentieth of its heartbeat_timeout_s, within 100..500; default 250; at most 1000)")
      ->check(CLI::Range(int64_t{10}, int64_t{1000}));
  std::string sigtermNotice = "0";
  app.add_option("--sigterm_notice_s", sigtermNotice,
                 "take a SIGTERM as the scheduler's preemption notice (Slurm's GraceTime, Kubernetes' "
                 "terminationGracePeriodSeconds): tell the manager this host goes that many seconds later, and exit "
                 "once the manager has stopped the workers or just before then; auto: the Slurm partition's "
                 "GraceTime (scontrol); 0 (default): a SIGTERM stops the agent and its workers at once");
  bool plaintext = false;
  app.add_flag("--insecure_plaintext_control", plaintext,
               "talk to the manager without TLS (its --insecure_plaintext_control: loopback development only)");
  app.add_flag("--daemonize", options.daemonize, "detach, and return once connected to the manager");
  app.add_option("--log_level", options.logLevel, "debug, info, warn or error");
  bool tokenFromStdin = false, envFromStdin = false;
  app.add_flag("--token_stdin", tokenFromStdin,
               "read the job token from the first line of stdin (how run_varuna passes it) instead of "
               "VARUNA_JOB_TOKEN");
  app.add_flag("--env_stdin", envFromStdin,
               "after the token, read the job's env_file variables from stdin's next line (a JSON list of "
               "[name, value] pairs: how run_varuna passes them, off any command line) and set them");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitConfigError;
  }
  std::string joinCredential;
  try {
    if (options.join.empty() == options.manager.empty()) {
      throw ConfigError("give --manager (run_varuna starts this agent) or --join (the host joins by itself), one of them");
    }
    if (!options.join.empty()) {
      options.manager = options.join;
      joinCredential = readJoinCredential(options.joinTokenFile);
      if (options.agent.host.empty()) options.agent.host = thisHostName();
    } else {
      if (options.agent.host.empty()) throw ConfigError("--host is required with --manager");
      options.agent.credential = readJobToken(tokenFromStdin);
      // A malformed certificate credential is a configuration error now, not
      // a failed connection later (which run_varuna would retry).
      if (tls::isCertificateCredential(options.agent.credential)) {
        tls::CertificateCredential::parse(options.agent.credential, "agent's credential (stdin)");
      }
    }
    if (envFromStdin) setEnvironmentFromStdin();
    // This agent decides for its workers and its host's notifier too (after
    // the env file: a line there must not turn TLS off).
    plaintext ? ::setenv(tls::kPlaintextEnv, "1", 1) : ::unsetenv(tls::kPlaintextEnv);
    options.agent.grace = std::chrono::milliseconds(static_cast<int64_t>(options.graceS * 1000));
    options.graceSet = app.count("--grace_s") > 0;
    options.lostManagerSet = app.count("--lost_manager_ms") > 0;
    options.agent.lostManager = std::chrono::milliseconds(options.lostManagerMs);
    options.beatRelaySet = app.count("--beat_relay_ms") > 0;
    options.agent.beatForwardInterval = std::chrono::milliseconds(options.beatRelayMs);
    options.agent.sigtermNotice = parseSigtermNotice(sigtermNotice);
    const bool defaultRunDir = options.agent.runDir.empty();
    if (defaultRunDir) options.agent.runDir = defaultAgentRunDir(options.agent.job, options.agent.host);
    log::configure({"agent", options.agent.job, options.agent.host}, log::parseLevel(options.logLevel));
    if (!fs::is_directory(options.codeDir)) {
      throw ConfigError(strCat("code_dir ", options.codeDir, " does not exist on ", options.agent.host));
    }
    if (!options.program.empty()) resolveProgram(options.program, options.codeDir);
    // Before the token or a log is written there; the default root is every user's.
    prepareRunDir(options.agent.runDir, /*sharedRoot=*/defaultRunDir);
  } catch (const ConfigError& e) {
    std::cerr << "config error: varuna_agent on " << options.agent.host << ": " << e.what() << std::endl;
    return kExitConfigError;
  } catch (const std::exception& e) {
    std::cerr << "varuna_agent on " << options.agent.host << ": " << e.what() << std::endl;
    return 1;
  }
  if (!options.daemonize) return run(options, joinCredential, -1);

  const std::string logPath = (fs::path(options.agent.runDir) / "agent.log").string();
  int pipeFds[2];
  if (::pipe2(pipeFds, O_CLOEXEC) != 0) return 1;
  const pid_t child = ::fork();
  if (child < 0) return 1;
  if (child > 0) {
    ::close(pipeFds[1]);
    return waitForChild(pipeFds[0], logPath);
  }
  ::close(pipeFds[0]);
  ::setsid();  // survives the SSH session (and its SIGHUP)
  // Owner only, and never through a link planted in its place.
  const int logFd = ::open(logPath.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW, 0600);
  const int devNull = ::open("/dev/null", O_RDONLY);
  ::dup2(devNull, 0);
  ::dup2(logFd, 1);
  ::dup2(logFd, 2);
  return run(options, joinCredential, pipeFds[1]);
}
