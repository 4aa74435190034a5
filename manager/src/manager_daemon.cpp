#include "varuna/manager/manager_daemon.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/machine_list.h"

namespace varuna {
namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr auto kTickInterval = std::chrono::milliseconds(100);
constexpr auto kListPollInterval = std::chrono::milliseconds(500);
constexpr auto kCheckpointPollInterval = std::chrono::milliseconds(1000);
constexpr auto kHelloDeadline = std::chrono::seconds(10);
// At the stop, how long the manager waits for its last look at the store.
constexpr auto kFinalScanWait = std::chrono::seconds(10);
// The manager's heartbeat to its agents (as often as theirs to it).
constexpr auto kAgentHeartbeatInterval = std::chrono::seconds(1);
// A preempted host whose notice gave no deadline is not expected back before this.
constexpr auto kPreemptedWithoutDeadline = std::chrono::seconds(120);

// A failed worker's last lines as its agent sent them: printed, but not
// megabytes of one runaway line.
constexpr size_t kMaxLoggedLogTailBytes = 4096;

double secondsBetween(TimePoint a, TimePoint b) { return std::chrono::duration<double>(b - a).count(); }

// The end of `text` (of a log, the end matters), at most about maxBytes, valid UTF-8.
std::string endOfText(const std::string& text, size_t maxBytes) {
  if (text.size() <= maxBytes) return proto::boundedText(text, maxBytes);
  size_t start = text.size() - maxBytes;
  // Forward to a character's start.
  while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xc0) == 0x80) ++start;
  return "..." + proto::boundedText(std::string_view(text).substr(start), maxBytes);
}

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// Which file is at `path` and when it was last written: any write (even of
// the same text, or a `touch`) or a replace (an editor's rename) changes it.
// Empty if there is no file.
std::string fileIdentity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  return strCat(st.st_dev, ":", st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
}

// The per-job secret every connection must present. Kept in the state folder
// (mode 0600) so a restarted manager and the notifiers keep using it.
std::string loadOrCreateToken(const fs::path& stateDir) {
  const fs::path path = stateDir / "token";
  if (std::ifstream in(path); in) {
    std::string token;
    std::getline(in, token);
    if (token.size() >= 32) return token;
  }
  std::random_device random;
  std::string token;
  const char* hex = "0123456789abcdef";
  for (int i = 0; i < 48; ++i) token += hex[random() % 16];
  const auto old = ::umask(077);
  ckpt::writeFileAtomic(stateDir, "token", token + "\n");
  ::umask(old);
  ::chmod(path.c_str(), 0600);
  return token;
}

json readJsonFile(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return json();
  try {
    return json::parse(in);
  } catch (const std::exception&) {
    return json();
  }
}

// A checkpoint folder belongs to one job: a new job pointed at another job's
// store would silently resume that job's weights. The first manager to use a
// store writes its job name there; later managers of the same job continue,
// others are refused. (A store without the file, e.g. filled by
// scripts/varuna_launch.py, is adopted.)
void claimGlobalStore(const fs::path& store, const std::string& job) {
  const json owner = readJsonFile(store / ckpt::kJobFile);
  if (owner.is_object() && owner.contains("job") && owner["job"].is_string()) {
    const std::string holder = owner["job"].get<std::string>();
    if (holder == job) return;
    throw ConfigError(strCat("--global_store ", store.string(), " holds the checkpoints of job '", holder,
                             "', not of job '", job, "': give this job its own --global_store, or run it as --job ",
                             holder, " to continue that job"));
  }
  json claimed = owner.is_object() ? owner : json::object();  // keeps a generation record already there
  claimed["job"] = job;
  ckpt::writeFileAtomic(store, ckpt::kJobFile, claimed.dump() + "\n");
}

// On the store's thread: a scanner that throws (an injected one) is a scan
// that failed, so a result always comes back (a launch or the next scan
// waits for it).
StoreScan scanStoreSafely(const StoreScanner& scanner, const StoreScanRequest& request) {
  try {
    return scanner(request);
  } catch (const std::exception& e) {
    StoreScan failed;
    failed.error = *e.what() ? e.what() : "the store scan failed";
    return failed;
  }
}

json planJson(const Plan& plan) {
  json placement = json::array();
  for (const auto& p : plan.placement) placement.push_back({{"rank", p.rank}, {"host", p.host}, {"local_rank", p.localRank}});
  return {{"stages", plan.stages},       {"replicas", plan.replicas},     {"chunk_size", plan.chunkSize},
          {"global_batch", plan.globalBatch}, {"per_replica_batch", plan.perReplicaBatch},
          {"stage_to_rank_map", plan.stageToRankMap}, {"hosts", plan.hosts}, {"placement", placement}};
}

}  // namespace

AutoConfigRequest autoConfigSettings(const JobConfig& config) {
  AutoConfigRequest settings;
  settings.globalBatch = config.batchSize;
  settings.memoryPerDeviceBytes = static_cast<int64_t>(config.memoryPerDeviceGb * (1LL << 30));
  settings.schedules = parseScheduleList(config.schedules);
  settings.fixedStages = config.nstages;
  settings.fixedChunk = config.chunkSize;
  return settings;
}

std::string dryRunReport(const JobConfig& config) {
  const auto machines = readMachineList(config.machineList, config.gpusPerNode);
  if (config.profile.empty()) {
    const Plan plan = makePlan({machines, config.nstages, config.batchSize, config.chunkSize, {}});
    return strCat("dry run: ", machines.size(), " machine(s) in ", config.machineList, "\nplan: ", plan.describe(),
                  "\n(no --profile: P and the micro-batch are as given; give a profile to let AutoConfig choose)\n");
  }
  AutoConfigRequest request = autoConfigSettings(config);
  request.machines = machines;
  const auto result = autoConfigure(profile::readProfile(config.profile), request);
  return strCat("dry run: ", machines.size(), " machine(s) in ", config.machineList, ", profile ", config.profile,
                "\n", result.explain(), "\nplan: ", result.best.plan.describe(), "\n\n", result.table(), "\n");
}

ManagerDaemon::ManagerDaemon(asio::io_context& io, JobConfig config, std::unique_ptr<HostLauncher> launcher,
                             PendingLimits pendingLimits)
    : io_(io),
      config_(std::move(config)),
      launcher_(std::move(launcher)),
      acceptor_(io),
      tickTimer_(io),
      acceptRetryTimer_(io),
      slowDetector_(config_.slowThreshold, config_.slowWindow),
      pending_(pendingLimits) {
  storeWorker_ = std::make_unique<BackgroundWorker>(io_, "varuna-store");
}

ManagerDaemon::~ManagerDaemon() {
  // Start-ups still under way (the loop stopped first): their results are
  // never read, but the threads use this object's launcher.
  for (auto& [id, t] : launchThreads_) {
    if (t.joinable()) t.join();
  }
}

void ManagerDaemon::start() {
  startedAt_ = Clock::now();
  const fs::path stateDir = config_.stateDir;
  std::error_code ec;
  fs::create_directories(stateDir, ec);
  if (ec) throw ConfigError(strCat("cannot create --state_dir ", stateDir.string(), ": ", ec.message()));
  const json previous = readJsonFile(stateDir / "state.json");
  if (previous.is_object() && previous.contains("job") && previous["job"] != config_.job) {
    throw ConfigError(strCat("--state_dir ", stateDir.string(), " holds the state of job ", previous["job"].dump(),
                             ", not of job '", config_.job, "': give each job its own --state_dir (the default, ",
                             "/var/lib/varuna/JOB or .varuna/JOB, is one per job)"));
  }
  token_ = loadOrCreateToken(stateDir);
  events_ = std::make_unique<EventLog>((stateDir / "events.jsonl").string());
  if (!config_.envFile.empty()) env_ = parseEnvFile(ckpt::readFile(config_.envFile), config_.envFile);
  env_ = jobEnvironment(config_, std::move(env_));
  fs::create_directories(config_.globalStore, ec);
  if (ec) throw ConfigError(strCat("cannot create --global_store ", config_.globalStore, ": ", ec.message()));

  listedIdentity_ = fileIdentity(config_.machineList);  // first: a write after the read shows as one
  listedText_ = ckpt::readFile(config_.machineList);
  listed_ = parseMachineList(listedText_, config_.machineList, config_.gpusPerNode);

  claimGlobalStore(config_.globalStore, config_.job);

  // A state file from an earlier manager of this job: continue its numbering.
  int firstGeneration = 1;
  if (previous.is_object() && previous.value("job", "") == config_.job) {
    firstGeneration = previous.value("generation", 0) + 1;
    const std::string phase = previous.value("phase", "");
    log::warn("state of an earlier manager of job '", config_.job, "' found (phase ", phase, ", generation ",
              firstGeneration - 1, "): continuing from the last complete checkpoint");
    events_->write("manager_restarted", {{"previous_phase", phase}, {"previous_generation", firstGeneration - 1}});
  }
  // The store's generation record (fencing) is the other memory of earlier
  // launches: without state.json (a new --state_dir) the numbering must still
  // go past it, or this manager's workers would count as superseded.
  std::optional<int64_t> recorded;
  try {
    recorded = ckpt::recordedGeneration(config_.globalStore);
  } catch (const std::exception& e) {
    log::warn("cannot read the generation record in ", config_.globalStore, ": ", e.what());
  }
  if (recorded && *recorded >= firstGeneration) {
    log::warn("the store records generation ", *recorded, " of job '", config_.job, "': continuing with generation ",
              *recorded + 1);
    firstGeneration = static_cast<int>(*recorded + 1);
  }

  // Listen.
  const std::string bindIp = config_.managerIp.empty() ? "0.0.0.0" : config_.managerIp;
  asio::ip::tcp::endpoint endpoint;
  try {
    endpoint = asio::ip::tcp::endpoint(asio::ip::make_address(bindIp), static_cast<uint16_t>(config_.port));
  } catch (const std::exception&) {
    throw ConfigError(strCat("--manager_ip '", config_.managerIp, "' is not an IP address of this machine"));
  }
  boost::system::error_code bindError;
  acceptor_.open(endpoint.protocol());
  acceptor_.set_option(asio::ip::tcp::acceptor::reuse_address(true));
  acceptor_.bind(endpoint, bindError);
  if (bindError) {
    throw ConfigError(strCat("cannot listen on ", bindIp, ":", config_.port, ": ", bindError.message(),
                             " (another run_varuna? pick another --port)"));
  }
  acceptor_.listen(1024);
  ::fcntl(acceptor_.native_handle(), F_SETFD, FD_CLOEXEC);
  port_ = acceptor_.local_endpoint().port();
  bool allLocal = true;
  for (const auto& m : listed_) allLocal &= isLocalHost(m.host);
  std::string dialIp = config_.managerIp;
  if (dialIp.empty() || dialIp == "0.0.0.0") {
    if (!allLocal) {
      throw ConfigError("--manager_ip is required when the machine list has other machines: the address of this "
                        "head node the hosts can reach");
    }
    dialIp = "127.0.0.1";
  }
  advertisedAddress_ = dialIp.find(':') != std::string::npos ? strCat("[", dialIp, "]:", port_) : strCat(dialIp, ":", port_);

  ControllerOptions options;
  options.stages = config_.nstages;
  options.globalBatch = config_.batchSize;
  options.chunkSize = config_.chunkSize;
  options.morphing = !config_.noMorphing;
  options.checkpointTimeout = millis(config_.checkpointTimeoutS);
  options.maxFailures = config_.maxFailures;
  options.failureWindow = millis(config_.failureWindowS);
  options.restartBackoff = millis(config_.restartBackoffS);
  options.firstGeneration = firstGeneration;
  if (!config_.profile.empty()) {
    // AutoConfig plans every launch: P and/or the micro-batch as given, the rest chosen.
    auto profile = profile::readProfile(config_.profile);
    // What the profile describes, for every worker to check against the model
    // it builds: a stale profile (model changed) must not plan silently.
    json pieces = json::array();
    for (const auto& piece : profile.pieces) pieces.push_back({piece.name, piece.paramCount});
    profiledPieces_ = pieces.dump();
    log::info("AutoConfig: planning with the profile ", config_.profile, " (", profile.pieces.size(), " pieces, ",
              profile.device, ", micro-batch sizes ", json(profile.microBatchSizes()).dump(), ")");
    options.stages = config_.nstages;
    options.chunkSize = config_.chunkSize;
    // AutoConfig runs on its own thread (planWorker_), never on the loop:
    // the controller is told PlanPending and waits in Phase::kPlanning (or,
    // running, keeps its plan) until planReady (AsyncPlanner).
    planWorker_ = std::make_unique<BackgroundWorker>(io_, "varuna-plan");
    auto shared = std::make_shared<const profile::Profile>(std::move(profile));
    planner_ = std::make_unique<AsyncPlanner>(
        *planWorker_,
        [shared, settings = autoConfigSettings(config_)](const PlanRequest& request) {
          return autoConfigure(*shared, autoConfigRequestFor(settings, request));
        },
        guard_->wrap("AutoConfig's result", [this](const AutoConfigResult& result) {
          const std::string why = result.explain();
          log::info("AutoConfig: ", why);
          events_->write("autoconfig", {{"chosen", result.best.shortName()},
                                        {"explain", why},
                                        {"table", result.table()},
                                        {"considered", result.ranked.size()},
                                        {"simulated", result.simulatedCount},
                                        {"planning_s", result.planningSeconds}});
        }),
        guard_->wrap("a plan's arrival", [this] {
          if (controller_ && jobStarted_ && !finished_) apply(controller_->planReady(Clock::now()));
        }));
    options.planner = planner_->planner();
  }
  // The controller's resume step is the last checkpoint seen; a launch
  // replaces it with what its own (thorough) scan finds (finishLaunch).
  controller_ = std::make_unique<MorphController>(options, std::vector<Machine>{},
                                                  [this] { return lastCheckpoint_; });
  // Before the loop runs (nothing is waiting on it yet), so synchronously.
  lastCheckpoint_ = readStoreScan(storeScanner_(storeScanRequest(/*thorough=*/true)));

  log::info("job '", config_.job, "': manager listening on ", advertisedAddress_, "; state in ", config_.stateDir);
  log::info("starting agents on ", listed_.size(), " host(s) from ", config_.machineList);
  events_->write("manager_started", {{"address", advertisedAddress_}, {"pid", ::getpid()},
                                      {"hosts", listed_.size()}, {"config", toJson(config_)}});
  doAccept();
  for (const auto& m : listed_) startAgent(m.host);
  scheduleTick();
  writeState();
}

// --- connections ------------------------------------------------------------

void ManagerDaemon::doAccept() {
  acceptor_.async_accept(guard_->wrap("accepting a connection", [this](const boost::system::error_code& ec,
                                                                      asio::ip::tcp::socket socket) {
    onAccept(ec, std::move(socket));
  }));
}

void ManagerDaemon::onAccept(const boost::system::error_code& ec, asio::ip::tcp::socket socket) {
  if (ec == asio::error::operation_aborted || finished_) return;
  if (ec) return onAcceptFailed(ec);
  acceptBackoff_ = std::chrono::milliseconds(0);
  // Whatever goes wrong with this one connection, the next accept is armed.
  guard_->run("admitting a connection", [&] {
    ::fcntl(socket.native_handle(), F_SETFD, FD_CLOEXEC);
    auto connection = std::make_shared<FramedConnection>(std::move(socket));
    connection->setGuard(guard_);
    // At the cap, the peers this manager is waiting for raise it (a launch's
    // burst of workers); counted only then: it walks every worker.
    const size_t expected = pending_.size() >= pending_.limits().maxPending ? expectedHellos() : 0;
    pending_.add(connection, Clock::now(), expected);  // may close the oldest pending one
    std::weak_ptr<FramedConnection> weak = connection;
    connection->start(
        [this, weak](const proto::Message& m) {
          if (auto c = weak.lock()) onFirstMessage(c, m);
        },
        [this, weak](const std::string&) {
          // Closed before a hello: by the peer, or for a bad or oversized
          // first frame (the deadline and the cap are counted by pending_).
          auto c = weak.lock();
          if (!c) return;
          const size_t before = pending_.size();
          pending_.erase(c);
          if (pending_.size() < before) ++closedBeforeHello_;
        });
  });
  doAccept();
}

size_t ManagerDaemon::expectedHellos() const {
  size_t expected = 0;
  for (const auto& [host, agent] : agents_) expected += agent.status == AgentStatus::kStarting ? 1 : 0;
  for (const auto& [rank, worker] : workers_) expected += worker.connected ? 0 : 1;
  return expected;
}

void ManagerDaemon::onAcceptFailed(const boost::system::error_code& ec) {
  ++acceptFailures_;
  const int code = ec.value();
  // Errors of the one connection being accepted (Linux hands pending network
  // errors to accept, see accept(2)): the next accept can work at once.
  const bool thatConnection = ec == asio::error::connection_aborted || code == EPROTO || code == ENETDOWN ||
                              code == ENOPROTOOPT || code == EHOSTDOWN || code == ENONET || code == EHOSTUNREACH ||
                              code == EOPNOTSUPP || code == ENETUNREACH || code == EPERM;
  if (thatConnection) {
    doAccept();
    return;
  }
  // Out of descriptors (EMFILE, ENFILE) or memory (ENOBUFS, ENOMEM), or
  // anything else that would fail again at once: re-arming now would spin.
  // Back off, and free a descriptor from the oldest connection that has not
  // said hello, so that the next peer (perhaps a notice) gets one.
  acceptBackoff_ = acceptBackoff_.count() == 0 ? kAcceptBackoffMin : std::min(2 * acceptBackoff_, kAcceptBackoffMax);
  const bool shed = (code == EMFILE || code == ENFILE) && pending_.shedOldest("out of file descriptors");
  uint64_t suppressed = 0;
  if (acceptFailureLog_.allow(Clock::now(), &suppressed)) {
    log::error("accepting a connection failed: ", ec.message(),
               shed ? " (closed the oldest connection without a hello)" : "", "; retrying in ", acceptBackoff_.count(),
               " ms", suppressed ? strCat(" (", suppressed + 1, " failures since the last line)") : std::string(),
               code == EMFILE ? strCat("; the open-file limit is too low for the ", pending_.size(),
                                       " pending and the job's connections (docs/run_varuna.md)")
                              : std::string());
  }
  acceptRetryTimer_.expires_after(acceptBackoff_);
  acceptRetryTimer_.async_wait(guard_->wrap("retrying accept", [this](const boost::system::error_code& timerError) {
    if (timerError || finished_) return;
    doAccept();
  }));
}

void ManagerDaemon::reportDroppedConnections(TimePoint now) {
  const DropCounts totals{closedBeforeHello_, pending_.expired(), pending_.evicted()};
  const auto limits = pending_.limits();
  if (totals != dropsLogged_ && now - dropsLoggedAt_ >= std::chrono::seconds(10)) {
    log::warn("connections closed before their hello since the last report: ", totals.expired - dropsLogged_.expired,
              " sent none within ", limits.helloDeadline.count(), " ms, ", totals.evicted - dropsLogged_.evicted,
              " were the oldest of more than ", limits.maxPending, " waiting, ", totals.closed - dropsLogged_.closed,
              " closed by the peer or for a bad first frame (", pending_.size(), " waiting now)");
    dropsLogged_ = totals;
    dropsLoggedAt_ = now;
  }
  // The event log gets one line a minute at most: a flood must not fill it.
  if (totals != dropsRecorded_ && now - dropsRecordedAt_ >= std::chrono::seconds(60)) {
    events_->write("connections_dropped", {{"no_hello_in_time", totals.expired - dropsRecorded_.expired},
                                           {"over_the_cap", totals.evicted - dropsRecorded_.evicted},
                                           {"closed_before_hello", totals.closed - dropsRecorded_.closed}});
    dropsRecorded_ = totals;
    dropsRecordedAt_ = now;
  }
}

void ManagerDaemon::onFirstMessage(const std::shared_ptr<FramedConnection>& connection, const proto::Message& message) {
  pending_.erase(connection);
  try {
    const proto::Hello& hello = proto::checkHello(message, token_);
    if (hello.role == "agent") return onAgentHello(connection, hello);
    if (hello.role == "worker") return onWorkerHello(connection, hello);
    if (hello.role == "notifier") return onNotifierHello(connection, hello);
    throw proto::ProtocolError(strCat("unknown role '", hello.role, "'"));
  } catch (const proto::ProtocolError& e) {
    // What a refused peer sent is its own: bounded and valid UTF-8 before it
    // reaches the log and the event log (checkHello bounds the host it quotes).
    const std::string reason = proto::boundedText(e.what(), 2 * proto::kMaxLoggedPeerTextBytes);
    log::warn("refused a connection from ", connection->peer(), ": ", reason);
    events_->write("connection_refused", {{"peer", connection->peer()}, {"reason", reason}});
    connection->send(proto::Ack{false, reason});
    connection->closeAfterSending("refused");
  }
}

void ManagerDaemon::onAgentHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
  auto it = agents_.find(hello.host);
  if (it == agents_.end() || it->second.status == AgentStatus::kUp) {
    const std::string why = it == agents_.end() ? "is not in the machine list" : "already has an agent";
    const std::string host = proto::boundedText(hello.host, proto::kMaxLoggedPeerTextBytes);
    log::warn("agent from ", connection->peer(), " for host ", host, " refused: the host ", why);
    connection->send(proto::Ack{false, strCat("host ", host, " ", why)});
    connection->closeAfterSending("refused");
    return;
  }
  AgentState& agent = it->second;
  agent.status = AgentStatus::kUp;
  agent.connection = connection;
  agent.lastSeen = Clock::now();
  agent.released = false;
  const std::string host = hello.host;
  std::weak_ptr<FramedConnection> weak = connection;
  connection->start(
      [this, host](const proto::Message& m) { onAgentMessage(host, m); },
      [this, host, weak](const std::string& reason) {
        auto a = agents_.find(host);
        if (a != agents_.end() && a->second.connection == weak.lock()) onAgentLost(host, reason);
      });
  log::info("agent up on ", host, " (", connection->peer(), ")");
  events_->write("agent_up", {{"host", host}});
  if (auto a = absent_.find(host); a != absent_.end() && mayComeBack(a->second, Clock::now())) {
    hostBack(host, "its agent is up again");
  }
  if (jobStarted_) {
    usableMachinesChanged();
  } else {
    maybeStartJob();
  }
}

void ManagerDaemon::onWorkerHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
  if (hello.generation != controller_->generation() || !workers_.count(hello.rank)) {
    // A worker of a generation that is over or that this manager never
    // launched (one an earlier manager left, or one written off as hung or
    // lost): ordered out, not merely refused, so it stops training into the
    // store at once.
    const std::string reason = strCat("generation ", hello.generation, " is over: this manager expects no rank ",
                                      hello.rank, " of it (current generation ", controller_->generation(), ")");
    const std::string host = proto::boundedText(hello.host, proto::kMaxLoggedPeerTextBytes);
    log::warn("ordering rank ", hello.rank, " of generation ", hello.generation, " on ", host, " (",
              connection->peer(), ") to exit: ", reason);
    events_->write("stale_worker", {{"generation", hello.generation}, {"rank", hello.rank}, {"host", host},
                                    {"peer", connection->peer()}});
    connection->send(proto::ExitNow{hello.generation, reason});
    connection->closeAfterSending("stale worker");
    return;
  }
  WorkerState& worker = workers_[hello.rank];
  worker.connection = connection;
  worker.lastSeen = Clock::now();
  worker.connected = true;
  const int rank = hello.rank;
  connection->start([this, rank](const proto::Message& m) { onWorkerMessage(rank, m); },
                    [rank](const std::string& reason) {
                      // Exits are reported by the agents. A worker that exits
                      // (_Exit) with a pong it has not read yet resets the
                      // connection instead of closing it: that is an exit too.
                      const bool exited = reason == "closed by peer" || reason == "Connection reset by peer";
                      if (!exited) log::warn("connection of rank ", rank, " closed: ", reason);
                    });
  // How long it may go without hearing from us before it exits on its own:
  // as long as its agent would wait (a silent agent is lost after the
  // heartbeat timeout, its workers killed after the agents' grace).
  connection->send(proto::Welcome{hello.generation, millis(config_.heartbeatTimeoutS + config_.agentGraceS).count()});
  for (const auto& [r, w] : workers_) {
    if (!w.connected) return;
  }
  const auto now = Clock::now();
  morph_.connected(now);
  log::info("all ", workers_.size(), " workers of generation ", controller_->generation(), " connected (",
            secondsBetween(launchedAt_, now), " s after launch)");
}

void ManagerDaemon::onNotifierHello(const std::shared_ptr<FramedConnection>& connection, const proto::Hello&) {
  std::weak_ptr<FramedConnection> weak = connection;
  connection->start(
      [this, weak](const proto::Message& m) {
        auto c = weak.lock();
        const auto* notice = std::get_if<proto::PreemptNotice>(&m);
        if (!c) return;
        if (!notice) {
          c->send(proto::Ack{false, "expected a preempt notice"});
          c->closeAfterSending("bad notifier");
          return;
        }
        if (!agents_.count(notice->host)) {
          c->send(proto::Ack{false, strCat("host '", notice->host, "' is not in the machine list")});
          c->closeAfterSending("unknown host");
          return;
        }
        const double inSeconds =
            notice->deadlineUnixMs > 0 ? static_cast<double>(notice->deadlineUnixMs - unixMillisNow()) / 1000 : -1;
        log::warn("preemption notice for ", notice->host,
                  inSeconds >= 0 ? strCat(" (taken in ", inSeconds, " s)") : std::string(" (no deadline given)"));
        events_->write("preempt_notice", {{"host", notice->host}, {"deadline_unix_ms", notice->deadlineUnixMs}});
        preempted_.insert(notice->host);
        // Out until the deadline at least (the cloud takes it then); after it
        // the host is tried like a lost one, unless the list is written first.
        HostAbsence& absence = markAbsent(notice->host, "preempted", Clock::now());
        absence.preemptedUntil =
            notice->deadlineUnixMs > 0
                ? Clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, notice->deadlineUnixMs - unixMillisNow()))
                : Clock::now() + kPreemptedWithoutDeadline;
        if (config_.hostRetryS > 0) absence.retryAt = std::max(absence.retryAt.value_or(TimePoint{}), *absence.preemptedUntil);
        c->send(proto::Ack{true, ""});
        c->closeAfterSending("done");
        morph_.start("preemption of " + notice->host, Clock::now());
        std::optional<Clock::time_point> takenAt;
        if (notice->deadlineUnixMs > 0) {
          takenAt = Clock::now() + std::chrono::milliseconds(notice->deadlineUnixMs - unixMillisNow());
        }
        apply(controller_->preemptNotice(notice->host, Clock::now(), takenAt));
      },
      [](const std::string&) {});
}

void ManagerDaemon::onAgentMessage(const std::string& host, const proto::Message& message) {
  auto& agent = agents_.at(host);
  agent.lastSeen = Clock::now();
  if (const auto* ping = std::get_if<proto::Ping>(&message)) {
    if (agent.connection) agent.connection->send(proto::Pong{ping->sequence, ping->sentNs});
    return;
  }
  if (const auto* exited = std::get_if<proto::WorkerExited>(&message)) {
    if (exited->generation != controller_->generation()) return;  // a straggler of an earlier launch
    const std::string how = exited->exitCode >= 0 ? strCat("code ", exited->exitCode)
                                                  : strCat("signal ", exited->signal);
    const bool expected = exited->exitCode == 0 || exited->exitCode == kExitCheckpointed;
    if (expected) {
      log::info("rank ", exited->rank, " on ", host, " exited with ", how);
    } else {
      log::error("rank ", exited->rank, " on ", host, " exited with ", how,
                 exited->logTail.empty() ? std::string() : ":\n" + endOfText(exited->logTail, kMaxLoggedLogTailBytes));
    }
    events_->write("worker_exited", {{"host", host}, {"rank", exited->rank}, {"exit_code", exited->exitCode},
                                     {"signal", exited->signal}, {"generation", exited->generation}});
    workers_.erase(exited->rank);
    if (!expected) morph_.start(strCat("rank ", exited->rank, " failed"), Clock::now());
    apply(controller_->workerExited(exited->rank, exited->exitCode, Clock::now()));
  }
}

void ManagerDaemon::onWorkerMessage(int rank, const proto::Message& message) {
  auto it = workers_.find(rank);
  if (it == workers_.end()) return;
  const auto now = Clock::now();
  it->second.lastSeen = now;
  if (const auto* heartbeat = std::get_if<proto::Heartbeat>(&message)) {
    it->second.waiting = heartbeat->waiting;
    noteWorkerStep(it->second, heartbeat->step, now);
  } else if (const auto* report = std::get_if<proto::StepReport>(&message)) {
    if (!progressAt_) progressAt_ = now;  // the generation's first step: the hang timeout applies from here
    noteWorkerStep(it->second, report->step, now);
    onStepReport(*report);
  } else if (const auto* failed = std::get_if<proto::CheckpointFailed>(&message)) {
    onCheckpointFailed(rank, *failed);
  } else if (const auto* ping = std::get_if<proto::Ping>(&message)) {
    if (it->second.connection) it->second.connection->send(proto::Pong{ping->sequence, ping->sentNs});
  }
}

void ManagerDaemon::onAgentLost(const std::string& host, const std::string& reason) {
  AgentState& agent = agents_.at(host);
  const bool expected = agent.released || finished_;
  agent.status = AgentStatus::kGone;
  agent.connection.reset();
  if (expected) {
    // Released because it was preempted (it waits for the notice's deadline)
    // or removed from the list; if it is listed again by now, it comes back.
    if (!finished_ && isListed(host) && !preempted_.count(host)) {
      markAbsent(host, "released", Clock::now()).retryAt = Clock::now();
    }
    return;
  }
  log::error("lost the agent on ", host, " (", reason, ")");
  events_->write("host_lost", {{"host", host}, {"reason", reason}});
  markAbsent(host, "lost", Clock::now());
  scheduleRetry(host, Clock::now());
  // Its workers count as gone from here on; those still connected (a frozen
  // or partitioned agent, not a dead host) are told so.
  for (auto it = workers_.begin(); it != workers_.end();) {
    const auto& placement = controller_->plan().placement;
    const bool onHost = it->first < static_cast<int>(placement.size()) && placement[it->first].host == host;
    if (!onHost) {
      ++it;
      continue;
    }
    orderWorkerToExit(it->second.connection, controller_->generation(),
                      strCat("the agent of host ", host, " was lost"));
    it = workers_.erase(it);
  }
  morph_.start("loss of host " + host, Clock::now());
  if (!jobStarted_) {
    agent.status = AgentStatus::kFailed;
    maybeStartJob();
    return;
  }
  apply(controller_->hostLost(host, Clock::now()));
  usableMachinesChanged();
}

void ManagerDaemon::orderWorkersToExit(const std::string& reason) {
  size_t ordered = 0;
  for (const auto& [rank, worker] : workers_) {
    if (!worker.connection || !worker.connection->open() || exitOrdered_.count(worker.connection)) continue;
    orderWorkerToExit(worker.connection, controller_->generation(), reason);
    ++ordered;
  }
  // The generation is over: a worker of it that says hello again is ordered out too.
  workers_.clear();
  if (ordered > 0) log::info("ordered ", ordered, " worker(s) of generation ", controller_->generation(), " to exit");
}

void ManagerDaemon::orderWorkerToExit(const std::shared_ptr<FramedConnection>& connection, int generation,
                                      const std::string& reason) {
  if (!connection || !connection->open() || exitOrdered_.count(connection)) return;
  connection->send(proto::ExitNow{generation, reason});
  exitOrdered_.insert(connection);
  std::weak_ptr<FramedConnection> weak = connection;
  connection->start([](const proto::Message&) {},
                    [this, weak](const std::string&) {
                      if (auto c = weak.lock()) exitOrdered_.erase(c);  // `c` keeps it alive through the erase
                    });
}

// --- agents -------------------------------------------------------------------

std::string ManagerDaemon::agentCommand(const std::string& host) const {
  // The token travels on the command's stdin (startAgent), never in the
  // command (the remote shell's command line is visible to `ps`). The
  // env_file's variables reach the agent as well as (through LaunchWorkers)
  // every worker.
  std::string environment;
  for (const auto& [key, value] : env_) environment += key + "=" + shellQuote(value) + " ";
  return strCat(environment, "exec ", shellQuote(config_.agentPath), " --daemonize --token_stdin --manager ", shellQuote(advertisedAddress_), " --host ", shellQuote(host), " --job ",
                shellQuote(config_.job), " --code_dir ", shellQuote(config_.codeDir), " --program ",
                shellQuote(config_.program.front()), " --grace_s ", config_.agentGraceS,
                // Not hearing from the manager (its heartbeats, sendAgentHeartbeats) this long, the agent
                // takes it as gone: as long as the manager waits for a silent agent, plus the grace.
                " --lost_manager_ms ", millis(config_.heartbeatTimeoutS + config_.agentGraceS).count(), " --log_level ",
                shellQuote(config_.logLevel));
}

void ManagerDaemon::startAgent(const std::string& host) {
  auto [entry, fresh] = agents_.try_emplace(host);
  AgentState& agent = entry->second;
  // One start-up per host at a time: a retry or a list write while one is
  // under way leaves it to that one.
  if (!fresh && (agent.status == AgentStatus::kStarting || agent.launching)) return;
  const uint64_t attempt = agent.attempt + 1;
  agent = AgentState{};
  agent.status = AgentStatus::kStarting;
  agent.attempt = attempt;
  agent.launching = true;
  if (auto a = absent_.find(host); a != absent_.end()) ++a->second.attempts;
  const std::string command = agentCommand(host);
  log::debug("starting the agent on ", host, ": ", config_.agentPath);
  HostLauncher* launcher = launcher_.get();
  const uint64_t id = nextLaunchThread_++;
  launchThreads_.emplace(id, std::thread([this, launcher, host, command, id, input = token_ + "\n"] {
    HostCommandResult result;
    try {
      result = launcher->run(host, command, input);
    } catch (const std::exception& e) {  // out of a thread it would end the process
      result.ok = false;
      result.message = strCat("starting the agent failed: ", e.what());
    }
    asio::post(io_, guard_->wrap("an agent start-up's result", [this, id, host, result] {
      reapLaunchThread(id);
      if (auto a = agents_.find(host); a != agents_.end()) a->second.launching = false;
      onAgentCommandDone(host, result);
    }));
  }));
}

void ManagerDaemon::reapLaunchThread(uint64_t id) {
  auto it = launchThreads_.find(id);
  if (it == launchThreads_.end()) return;
  if (it->second.joinable()) it->second.join();  // it posted its result and is returning: no wait to speak of
  launchThreads_.erase(it);
}

void ManagerDaemon::onAgentCommandDone(const std::string& host, const HostCommandResult& result) {
  if (finished_) return;
  auto it = agents_.find(host);
  if (it == agents_.end() || it->second.status != AgentStatus::kStarting) return;  // up already (or gone)
  if (!result.ok) {
    if (result.exitStatus == kExitConfigError && !absent_.count(host)) {
      // The same program and code_dir are used everywhere: no host will do
      // better. (A host coming back that says so is only that host's
      // trouble, e.g. a re-imaged machine: it stays out, retried.)
      const std::string reason = strCat("host ", host, ": ", result.output.empty() ? result.message : result.output);
      events_->write("agent_failed", {{"host", host}, {"reason", reason}, {"config_error", true}});
      doStop(action::Stop{reason, kExitConfigError});
      return;
    }
    agentFailed(host, result.message);
    return;
  }
  // The agent reported success after saying hello; the hello may still be in
  // flight on its socket. Give it a moment.
  auto timer = std::make_shared<asio::steady_timer>(io_, kHelloDeadline);
  const uint64_t attempt = it->second.attempt;  // a later start-up of the host is not this one's to fail
  timer->async_wait(guard_->wrap("waiting for an agent's hello", [this, timer, host,
                                                                  attempt](const boost::system::error_code& ec) {
    auto a = agents_.find(host);
    if (!ec && a != agents_.end() && a->second.status == AgentStatus::kStarting && a->second.attempt == attempt) {
      agentFailed(host, "the agent started but never reached the manager at " + advertisedAddress_);
    }
  }));
}

void ManagerDaemon::agentFailed(const std::string& host, const std::string& message) {
  const auto now = Clock::now();
  HostAbsence& absence = markAbsent(host, "agent_failed", now);
  scheduleRetry(host, now);
  const std::string retry =
      absence.retryAt && isListed(host)
          ? strCat("; retrying in ", std::chrono::duration<double>(*absence.retryAt - now).count(), " s")
          : std::string();
  log::error("cannot start the agent on ", host, ": ", message, retry);
  events_->write("agent_failed", {{"host", host}, {"reason", message}, {"attempts", absence.attempts}});
  agents_.at(host).status = AgentStatus::kFailed;
  if (!jobStarted_) {
    maybeStartJob();
  } else {
    usableMachinesChanged();
  }
}

std::vector<Machine> ManagerDaemon::usableMachines() const {
  std::vector<Machine> usable;
  for (const auto& m : listed_) {
    auto it = agents_.find(m.host);
    // A released agent (told to shut down) is on its way out.
    if (it != agents_.end() && it->second.status == AgentStatus::kUp && !it->second.released) usable.push_back(m);
  }
  return usable;
}

void ManagerDaemon::usableMachinesChanged() {
  if (!jobStarted_ || finished_) return;
  apply(controller_->machinesChanged(usableMachines(), Clock::now()));
}

void ManagerDaemon::maybeStartJob() {
  if (jobStarted_ || finished_) return;
  for (const auto& [host, agent] : agents_) {
    if (agent.status == AgentStatus::kStarting) return;  // still waiting for some
  }
  jobStarted_ = true;
  const auto usable = usableMachines();
  log::info(usable.size(), " of ", listed_.size(), " host(s) ready");
  if (usable.size() < listed_.size()) {
    log::error(listed_.size() - usable.size(), " host(s) could not start an agent (see the errors above); they are ",
               config_.hostRetryS > 0 ? "retried with backoff and " : "", "retried when the machine list is written");
  }
  const auto now = Clock::now();
  apply(controller_->machinesChanged(usable, now));
  apply(controller_->start(now));
}

// --- hosts that come back -------------------------------------------------------
// docs/run_varuna.md, "When lost, preempted and slow hosts come back".

bool ManagerDaemon::isListed(const std::string& host) const {
  return std::any_of(listed_.begin(), listed_.end(), [&](const Machine& m) { return m.host == host; });
}

ManagerDaemon::HostAbsence& ManagerDaemon::markAbsent(const std::string& host, const std::string& why, TimePoint now) {
  auto [it, fresh] = absent_.try_emplace(host);
  if (fresh) {
    it->second.why = why;
    it->second.since = now;
    // Back only a short while ago: a flapping host, whose backoff goes on
    // from where it was rather than from the first wait.
    if (auto r = returned_.find(host); r != returned_.end() && now - r->second.first < millis(config_.hostRetryMaxS)) {
      it->second.backoff = r->second.second;
    }
  }
  return it->second;
}

void ManagerDaemon::scheduleRetry(const std::string& host, TimePoint now) {
  HostAbsence& absence = absent_.at(host);
  if (config_.hostRetryS <= 0) return;  // --host_retry_s 0: back only when the list is written
  const auto first = millis(config_.hostRetryS);
  const auto most = std::max(first, millis(config_.hostRetryMaxS));
  absence.backoff = absence.backoff.count() == 0 ? first : std::min(2 * absence.backoff, most);
  absence.retryAt = now + absence.backoff;
}

bool ManagerDaemon::mayComeBack(const HostAbsence& absence, TimePoint now) const {
  return !absence.slow && (!absence.preemptedUntil || now >= *absence.preemptedUntil);
}

void ManagerDaemon::retryAbsentHosts(TimePoint now) {
  if (!jobStarted_ || finished_ || stopping_ || absent_.empty()) return;  // stopping: no host is needed again
  std::vector<std::string> answered, due;
  for (const auto& [host, absence] : absent_) {
    auto a = agents_.find(host);
    // A host no longer listed keeps its record (a slow host re-listed is
    // still readmitted by that write) but is not tried.
    if (a == agents_.end() || !isListed(host) || !mayComeBack(absence, now)) continue;
    const AgentState& agent = a->second;
    if (agent.status == AgentStatus::kUp) {
      // Preempted, yet its agent still answers after the notice's deadline:
      // the host was not taken. (A released agent is on its way out.)
      if (!agent.released && (!absence.preemptedUntil || agent.lastSeen >= *absence.preemptedUntil)) {
        answered.push_back(host);
      }
      continue;
    }
    if (agent.status == AgentStatus::kStarting || agent.launching) continue;  // one start-up at a time
    if (absence.retryAt && now >= *absence.retryAt) due.push_back(host);
  }
  for (const auto& host : answered) hostBack(host, "its agent still answers after the preemption notice's deadline");
  if (!answered.empty()) usableMachinesChanged();
  for (const auto& host : due) {
    if (finished_) return;
    HostAbsence& absence = absent_.at(host);
    absence.retryAt.reset();  // a failure of this start-up schedules the next
    log::info("starting the agent on ", host, " again (out for ", static_cast<int>(secondsBetween(absence.since, now)),
              " s: ", absence.why, "; attempt ", absence.attempts + 1, ")");
    startAgent(host);
  }
}

void ManagerDaemon::hostBack(const std::string& host, const std::string& how) {
  auto it = absent_.find(host);
  if (it == absent_.end()) return;
  const HostAbsence absence = it->second;
  absent_.erase(it);
  returned_[host] = {Clock::now(), absence.backoff};
  preempted_.erase(host);
  if (controller_) controller_->readmitHost(host);
  const double out = secondsBetween(absence.since, Clock::now());
  log::info("host ", host, " is back after ", static_cast<int>(out), " s out (", absence.why, "): ", how);
  events_->write("host_back",
                 {{"host", host}, {"why", absence.why}, {"out_s", out}, {"attempts", absence.attempts}, {"how", how}});
}

bool ManagerDaemon::readmitListedHosts(TimePoint now) {
  json retried = json::array();
  bool back = false;
  for (const auto& m : listed_) {
    auto it = absent_.find(m.host);
    if (it == absent_.end()) continue;
    HostAbsence& absence = it->second;
    retried.push_back({{"host", m.host}, {"why", absence.why}});
    if (absence.slow) {
      // Flagged again later, it is excluded again (a verdict equal to the
      // last one is otherwise not acted on).
      slowHosts_.erase(std::remove(slowHosts_.begin(), slowHosts_.end(), m.host), slowHosts_.end());
    }
    absence.slow = false;
    absence.preemptedUntil.reset();
    absence.backoff = std::chrono::milliseconds(0);
    absence.retryAt = now;  // at the next tick (retryAbsentHosts), if its agent is not up
    preempted_.erase(m.host);
    auto a = agents_.find(m.host);
    if (a != agents_.end() && a->second.status == AgentStatus::kUp && !a->second.released) {
      hostBack(m.host, "the machine list was written");
      back = true;
    }
  }
  if (!retried.empty()) {
    log::info("the machine list was written: ", retried.size(), " host(s) that were out get another chance now");
    events_->write("hosts_readmitted", {{"hosts", retried}});
  }
  return back;
}

void ManagerDaemon::sendAgentHeartbeats(TimePoint now) {
  if (now - lastAgentHeartbeat_ < kAgentHeartbeatInterval) return;
  lastAgentHeartbeat_ = now;
  for (auto& [host, agent] : agents_) {
    if (agent.status == AgentStatus::kUp && agent.connection && agent.connection->open()) {
      agent.connection->send(proto::Heartbeat{-1, 0});
    }
  }
}

// --- actions --------------------------------------------------------------------

void ManagerDaemon::apply(const std::vector<Action>& actions) {
  if (actions.empty()) return;  // the tick writes the state once a second anyway
  for (const auto& a : actions) {
    if (finished_) return;
    if (const auto* launch = std::get_if<action::Launch>(&a)) {
      doLaunch(*launch);
    } else if (std::holds_alternative<action::Checkpoint>(a)) {
      morph_.start("the machines changed", Clock::now());
      log::info("ordering an on-demand checkpoint from every worker");
      events_->write("checkpoint_ordered", {{"generation", controller_->generation()}});
      sendToAgentsOfPlan(proto::CheckpointAndExit{});
    } else if (const auto* kill = std::get_if<action::KillAll>(&a)) {
      morph_.start(kill->reason, Clock::now());
      log::warn("stopping every worker: ", kill->reason);
      events_->write("kill_all", {{"reason", kill->reason}});
      sendToAgentsOfPlan(proto::KillWorkers{kill->reason});
      orderWorkersToExit(kill->reason);  // also those whose agent cannot act
    } else if (const auto* stop = std::get_if<action::Stop>(&a)) {
      doStop(*stop);
    }
  }
  writeState();
}

void ManagerDaemon::sendToAgentsOfPlan(const proto::Message& message) {
  for (const auto& host : controller_->plan().hosts) {
    auto it = agents_.find(host);
    if (it != agents_.end() && it->second.connection && it->second.connection->open()) it->second.connection->send(message);
  }
}

void ManagerDaemon::doLaunch(const action::Launch& launch) {
  // Fencing: the store records the generation before any of its workers
  // exists, so the workers of every earlier generation that are still alive
  // are refused when they try to complete a checkpoint. And the checkpoint to
  // resume from is looked up again, thoroughly (the one a morph's workers
  // just wrote). Both are store I/O: done on storeWorker_, never on the loop.
  workers_.clear();  // the last generation's, if any: no hello of theirs counts
  launchPreparing_ = true;
  const std::string store = config_.globalStore;
  const int generation = launch.generation;
  storeWorker_->run(
      [store, generation, scanner = storeScanner_, request = storeScanRequest(/*thorough=*/true)] {
        LaunchPrep prep;
        try {
          ckpt::recordGeneration(store, generation);
        } catch (const std::exception& e) {
          prep.recordError = e.what();
          if (prep.recordError.empty()) prep.recordError = "unknown error";
          return prep;  // no launch: no need for its checkpoint
        }
        prep.scan = scanStoreSafely(scanner, request);
        return prep;
      },
      guard_->wrap("a launch's store work", [this, launch](const LaunchPrep& prep) { finishLaunch(launch, prep); }));
}

void ManagerDaemon::abandonLaunch(const action::Launch& launch) {
  // No worker of it was started; the controller counts its ranks as running
  // and ended the generation meanwhile (KillAll or Checkpoint): they are
  // gone, as if they had exited the way the controller asked them to.
  const Phase phase = controller_->phase();
  log::info("generation ", launch.generation, " was not launched: the job is ", toString(phase), " meanwhile");
  const int code = phase == Phase::kCheckpointing ? kExitCheckpointed : -1;
  const std::set<int> ranks = controller_->runningRanks();
  for (const int rank : ranks) {
    if (finished_) return;
    apply(controller_->workerExited(rank, code, Clock::now()));
  }
}

void ManagerDaemon::finishLaunch(action::Launch launch, const LaunchPrep& prep) {
  if (finished_ || launch.generation != controller_->generation()) return;  // a later launch supersedes it
  launchPreparing_ = false;
  if (controller_->phase() != Phase::kRunning) return abandonLaunch(launch);
  const Plan& plan = launch.plan;
  const auto now = Clock::now();
  std::string failed;
  if (!prep.recordError.empty()) {
    failed = strCat("cannot record generation ", launch.generation, " in ",
                    (fs::path(config_.globalStore) / ckpt::kJobFile).string(), ": ", prep.recordError);
  }
  for (const auto& host : plan.hosts) {
    auto a = agents_.find(host);
    if (failed.empty() && (a == agents_.end() || !a->second.connection || !a->second.connection->open())) {
      failed = strCat("the agent on ", host, " went away before the launch");
    }
  }
  if (!failed.empty()) {
    // Without the record the launch does not happen (a full or failing
    // store): it is a failure, retried after the backoff like any other.
    // Valid UTF-8 (a path may not be): the reason goes into the event log's JSON.
    const std::string reason = proto::boundedText(failed, 2 * proto::kMaxErrorTextBytes);
    log::error(reason, "; the launch is retried after the backoff");
    events_->write("launch_failed", {{"generation", launch.generation}, {"reason", reason}});
    workers_.clear();
    apply(controller_->launchFailed(reason, now));
    return;
  }
  // The freshest checkpoint (the controller's is the last periodic scan's);
  // if the store could not be read, the last one seen.
  const auto latest = readStoreScan(prep.scan);
  noteLatestCheckpoint(latest, now);
  launch.resumeStep = latest.value_or(-1);
  launchedAt_ = now;
  progressAt_.reset();  // the startup timeout until its first step
  workers_.clear();
  steps_.clear();
  firstStepOfGeneration_ = -1;
  for (const auto& p : plan.placement) workers_[p.rank] = WorkerState{};
  slowDetector_.reset(plan);
  morph_.launched(now);
  log::info("generation ", launch.generation, ": ", plan.describe(),
            launch.resumeStep >= 0 ? strCat("; resuming from step ", launch.resumeStep) : std::string("; fresh start"));
  events_->write("launch", {{"generation", launch.generation}, {"resume_step", launch.resumeStep},
                            {"plan", planJson(plan)}});
  proto::LaunchWorkers message;
  message.argv = config_.program;
  message.codeDir = config_.codeDir;
  message.env = env_;
  if (!config_.profile.empty()) {
    // The workers must run the schedule and partition AutoConfig simulated.
    message.env.emplace_back("VARUNA_SCHEDULE", toString(plan.schedule));
    std::string costs;
    for (double c : plan.pieceCosts) {
      char text[32];
      std::snprintf(text, sizeof(text), "%.17g", c);  // exact: the same partition on both sides
      costs += (costs.empty() ? "" : ",") + std::string(text);
    }
    if (!costs.empty()) message.env.emplace_back("VARUNA_PIECE_COSTS", costs);
    message.env.emplace_back("VARUNA_PROFILE_PIECES", profiledPieces_);
  }
  message.stageToRankMap = plan.stageToRankMap;
  message.chunkSize = plan.chunkSize;
  message.batchSize = plan.perReplicaBatch;
  message.resumeStep = launch.resumeStep;
  message.masterAddr = plan.placement.front().host;
  // A fresh port per generation: the previous store may linger in TIME_WAIT.
  message.masterPort = config_.masterPort + (launch.generation - 1) % 100;
  message.worldSize = plan.worldSize();
  message.generation = launch.generation;
  for (const auto& host : plan.hosts) {
    message.workers.clear();
    for (const auto& p : plan.ranksOn(host)) message.workers.push_back({p.rank, p.localRank});
    agents_.at(host).connection->send(message);
  }
  // Hosts that left the job (preempted or removed from the list) are released.
  std::set<std::string> listedHosts;
  for (const auto& m : listed_) listedHosts.insert(m.host);
  for (auto& [host, agent] : agents_) {
    const bool gone = preempted_.count(host) || !listedHosts.count(host);
    if (gone && agent.connection && agent.connection->open() && !agent.released) {
      agent.released = true;
      agent.connection->send(proto::Shutdown{preempted_.count(host) ? "preempted" : "removed from the machine list"});
      events_->write("host_released", {{"host", host}});
    }
  }
}

void ManagerDaemon::doStop(const action::Stop& stop) {
  if (finished_) return;
  finished_ = true;
  exitCode_ = stop.exitCode;
  stopReason_ = stop.reason;
  if (stop.exitCode == 0) {
    log::info("job '", config_.job, "' done: ", stop.reason);
  } else {
    log::error("job '", config_.job, "' stopped: ", stop.reason);
  }
  watchCheckpoints(/*final=*/true);  // the one the workers just wrote, if any (finishShutdown waits for it)
  events_->write("stop", {{"reason", stop.reason}, {"exit_code", stop.exitCode}});
  orderWorkersToExit("the job stopped: " + stop.reason);  // any still running (a job that finished has none)
  for (auto& [host, agent] : agents_) {
    if (agent.connection && agent.connection->open()) {
      agent.released = true;
      agent.connection->send(proto::Shutdown{stop.reason});
    }
  }
  writeState();
  // Let the shutdowns go out, then leave the event loop.
  auto timer = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(300));
  timer->async_wait(
      guard_->wrap("shutting down", [this, timer](const boost::system::error_code&) { finishShutdown(); }));
}

void ManagerDaemon::finishShutdown() {
  // The final store scan first (state.json and the summary name the last
  // checkpoint), for a bounded time: a stalled store must not keep the
  // manager from exiting.
  const auto now = Clock::now();
  if (!finalScanDone_) {
    if (shutdownWaitSince_ == TimePoint{}) shutdownWaitSince_ = now;
    if (now - shutdownWaitSince_ < kFinalScanWait) {
      auto timer = std::make_shared<asio::steady_timer>(io_, kTickInterval);
      timer->async_wait(
          guard_->wrap("shutting down", [this, timer](const boost::system::error_code&) { finishShutdown(); }));
      return;
    }
    log::warn("the checkpoint store did not answer within ", std::chrono::duration<double>(kFinalScanWait).count(),
              " s: the last checkpoint may be missing from state.json");
  }
  printSummary();
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  tickTimer_.cancel();
  acceptRetryTimer_.cancel();
  for (auto& [host, agent] : agents_) {
    if (agent.connection) agent.connection->closeAfterSending("manager exiting");
  }
  for (auto& [rank, worker] : workers_) {
    if (worker.connection) worker.connection->close("manager exiting");
  }
  // Their exit orders go out first (a worker that misses one exits after its grace).
  for (const auto& c : std::set<std::shared_ptr<FramedConnection>>(exitOrdered_)) {
    c->closeAfterSending("manager exiting");
  }
  pending_.closeAll("manager exiting");
  io_.stop();  // pending timers and the signal set would keep the loop alive
}

void ManagerDaemon::requestStop(const std::string& reason) {
  if (finished_) return;
  if (!jobStarted_) {
    doStop(action::Stop{reason, 0});
    return;
  }
  if (stopping_) log::warn("second stop request: killing the workers now");
  stopping_ = true;
  events_->write("stop_requested", {{"reason", reason}});
  apply(controller_->stop(reason, Clock::now()));
}

// --- periodic work -------------------------------------------------------------

void ManagerDaemon::scheduleTick() {
  tickTimer_.expires_after(kTickInterval);
  tickTimer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || finished_) return;
    guard_->run("the manager's tick", [this] { onTick(); });
    if (!finished_) scheduleTick();
  });
}

void ManagerDaemon::onTick() {
  const auto now = Clock::now();
  pending_.expire(now);
  reportDroppedConnections(now);
  checkHeartbeats(now);
  if (finished_) return;
  checkProgress(now);
  if (finished_) return;
  sendAgentHeartbeats(now);
  if (jobStarted_) apply(controller_->tick(now));
  if (now - lastListPoll_ >= kListPollInterval) {
    lastListPoll_ = now;
    watchMachineList();
  }
  retryAbsentHosts(now);
  if (finished_) return;
  if (now - lastCheckpointPoll_ >= kCheckpointPollInterval) {
    lastCheckpointPoll_ = now;
    watchCheckpoints();
  }
  if (stateWriteFailing_ || now - lastStateWrite_ >= std::chrono::seconds(1)) writeState();
}

void ManagerDaemon::checkHeartbeats(TimePoint now) {
  const auto agentTimeout = millis(std::max(config_.heartbeatTimeoutS, 3.0));
  for (auto& [host, agent] : agents_) {
    if (agent.status == AgentStatus::kUp && agent.connection && now - agent.lastSeen > agentTimeout) {
      agent.connection->close("no heartbeat for " + std::to_string(config_.heartbeatTimeoutS) + " s");
    }
  }
  const Phase phase = controller_ ? controller_->phase() : Phase::kIdle;
  if (phase != Phase::kRunning && phase != Phase::kCheckpointing) return;
  const auto heartbeatTimeout = millis(config_.heartbeatTimeoutS);
  const auto startupTimeout = millis(config_.startupTimeoutS);
  std::vector<int> hungRanks;  // collected first: reporting one changes the running set
  for (const int rank : controller_->runningRanks()) {
    auto it = workers_.find(rank);
    if (it == workers_.end()) continue;
    const WorkerState& w = it->second;
    if (w.connected ? now - w.lastSeen > heartbeatTimeout : now - launchedAt_ > startupTimeout) hungRanks.push_back(rank);
  }
  for (const int rank : hungRanks) {
    auto it = workers_.find(rank);
    if (it == workers_.end() || !controller_->runningRanks().count(rank)) continue;
    const WorkerState& w = it->second;
    const std::string host = controller_->plan().placement.at(static_cast<size_t>(rank)).host;
    const std::string why = w.connected ? strCat("no heartbeat for ", config_.heartbeatTimeoutS, " s")
                                        : strCat("never connected within ", config_.startupTimeoutS, " s of the launch");
    log::error("rank ", rank, " on ", host, " is hung: ", why);
    events_->write("worker_hung", {{"rank", rank}, {"host", host}, {"reason", why}});
    // Read when it runs again (a stopped process): it must not train on.
    orderWorkerToExit(it->second.connection, controller_->generation(), strCat("rank ", rank, " is hung: ", why));
    workers_.erase(it);
    morph_.start(strCat("rank ", rank, " hung"), now);
    apply(controller_->workerHung(rank, now));
    if (finished_) return;
  }
}

void ManagerDaemon::noteWorkerStep(WorkerState& worker, int64_t step, TimePoint now) {
  if (step <= worker.step) return;
  worker.step = step;
  if (progressAt_) progressAt_ = now;  // before the generation's first step, a step is only the resume point
}

void ManagerDaemon::checkProgress(TimePoint now) {
  if (config_.hangTimeoutS <= 0 || !controller_ || launchPreparing_ || controller_->phase() != Phase::kRunning) return;
  // Only a generation whose workers all said hello: one that did not is
  // checkHeartbeats' to time out (the same startup timeout).
  std::vector<int> ranks;
  for (const int rank : controller_->runningRanks()) {
    auto it = workers_.find(rank);
    if (it == workers_.end() || !it->second.connected) return;
    ranks.push_back(rank);
  }
  if (ranks.empty()) return;
  // Before the first step (rendezvous, loading a checkpoint, the first step
  // itself, all slow on a big model) the larger of the startup and hang
  // timeouts counts from the launch; from the first step on, the hang
  // timeout from the last step.
  const bool started = progressAt_.has_value();
  const TimePoint since = started ? *progressAt_ : launchedAt_;
  const double timeoutS = started ? config_.hangTimeoutS : std::max(config_.startupTimeoutS, config_.hangTimeoutS);
  if (now - since <= millis(timeoutS)) return;
  // The culprit computes (or is stuck in its own code) while its peers wait
  // for it; if none or all wait, every rank is named.
  std::vector<int> computing, waiting;
  for (const int rank : ranks) (workers_.at(rank).waiting ? waiting : computing).push_back(rank);
  const std::vector<int> hung = !waiting.empty() && !computing.empty() ? computing : ranks;
  const double stalledS = secondsBetween(since, now);
  const auto& placement = controller_->plan().placement;
  json named = json::array();
  std::string list;
  int64_t lastStep = -1;
  for (const int rank : ranks) lastStep = std::max(lastStep, workers_.at(rank).step);
  for (const int rank : hung) {
    const WorkerState& w = workers_.at(rank);
    const std::string host = rank < static_cast<int>(placement.size()) ? placement[rank].host : "?";
    named.push_back({{"rank", rank}, {"host", host}, {"step", w.step}, {"waiting", w.waiting}});
    list += strCat(list.empty() ? "" : ", ", rank, " on ", host, " (step ", w.step, ")");
  }
  const std::string what =
      started ? strCat("no rank finished a step for ", static_cast<int>(stalledS), " s (--hang_timeout_s ", timeoutS, ")")
              : strCat("no step finished within ", static_cast<int>(stalledS), " s of the launch (the larger of "
                       "--startup_timeout_s and --hang_timeout_s: ", timeoutS, ")");
  const std::string whose = hung.size() == ranks.size()
                                ? std::string(waiting.empty() ? "none of the ranks waits on a peer"
                                                              : "every rank waits on a peer")
                                : strCat(waiting.size(), " rank(s) wait on it");
  const std::string reason = strCat("rank(s) ", list, " hung: ", what, "; ", whose);
  log::error(reason);
  events_->write("hang", {{"ranks", named},
                          {"stalled_s", stalledS},
                          {"timeout_s", timeoutS},
                          {"before_first_step", !started},
                          {"last_step", lastStep},
                          {"waiting_ranks", waiting},
                          {"reason", reason}});
  // As for a hung worker: the named ones are ordered out over their own
  // connections (a stopped process reads it when it runs again), then the
  // controller kills the rest and relaunches from the latest checkpoint.
  for (const int rank : hung) {
    auto it = workers_.find(rank);
    orderWorkerToExit(it->second.connection, controller_->generation(), reason);
    workers_.erase(it);
  }
  morph_.start(strCat("rank(s) ", list, " hung: no progress"), now);
  apply(controller_->workerHung(hung.front(), now, reason));
}

void ManagerDaemon::watchMachineList() {
  const std::string identity = fileIdentity(config_.machineList);  // before the read: a later write shows next time
  std::string text;
  try {
    text = ckpt::readFile(config_.machineList);
  } catch (const std::exception&) {
    return;  // mid-replace by an editor: look again next time
  }
  const bool written = identity != listedIdentity_;
  listedIdentity_ = identity;
  if (text == listedText_) {
    // Written again with the same text (or touched): the operator says the
    // hosts it lists are there; those out get another chance now.
    if (written && readmitListedHosts(Clock::now())) usableMachinesChanged();
    return;
  }
  std::vector<Machine> machines;
  try {
    machines = parseMachineList(text, config_.machineList, config_.gpusPerNode);
  } catch (const ConfigError& e) {
    log::error("ignoring the edited machine list until it is fixed: ", e.what());
    listedText_ = text;  // report once per version
    return;
  }
  listedText_ = text;
  std::set<std::string> before, after;
  for (const auto& m : listed_) before.insert(m.host);
  for (const auto& m : machines) after.insert(m.host);
  listed_ = machines;
  json added = json::array(), removed = json::array();
  for (const auto& h : after) {
    if (before.count(h)) continue;
    added.push_back(h);
    preempted_.erase(h);
    auto it = agents_.find(h);
    if (it == agents_.end() || it->second.status != AgentStatus::kUp) startAgent(h);
  }
  for (const auto& h : before) {
    if (!after.count(h)) removed.push_back(h);
  }
  log::info("machine list changed: ", added.size(), " added ", added.dump(), ", ", removed.size(), " removed ",
            removed.dump());
  events_->write("machine_list_changed", {{"added", added}, {"removed", removed}});
  if (!removed.empty()) morph_.start("machine list shrank", Clock::now());
  readmitListedHosts(Clock::now());  // every host it lists that was out, too
  usableMachinesChanged();
}

void ManagerDaemon::watchCheckpoints(bool final) {
  if (final) {
    finalScanDone_ = false;
  } else if (scanInFlight_) {
    return;  // a slow store gets one scan at a time, not a queue of them
  } else {
    scanInFlight_ = true;
  }
  storeWorker_->run([scanner = storeScanner_, request = storeScanRequest(/*thorough=*/final)] {
                      return scanStoreSafely(scanner, request);
                    },
                    guard_->wrap("a checkpoint store scan", [this, final](const StoreScan& scan) {
                      onStoreScanned(scan, final);
                    }));
}

void ManagerDaemon::onStoreScanned(const StoreScan& scan, bool final) {
  if (final) {
    finalScanDone_ = true;
  } else {
    scanInFlight_ = false;
  }
  noteLatestCheckpoint(readStoreScan(scan), Clock::now());
  if (final) writeState();
}

StoreScanRequest ManagerDaemon::storeScanRequest(bool thorough) const {
  return StoreScanRequest{config_.globalStore, thorough, lastCheckpoint_};
}

void ManagerDaemon::noteLatestCheckpoint(std::optional<int64_t> latest, TimePoint now) {
  if (!latest || latest == lastCheckpoint_) return;
  if (lastCheckpoint_ && *latest < *lastCheckpoint_) {
    // The newer one was found damaged (checkpoint_skipped says which): not a new checkpoint.
    lastCheckpoint_ = latest;
    return;
  }
  lastCheckpoint_ = latest;
  lastCheckpointSeen_ = now;
  events_->write("checkpoint_complete", {{"step", *latest}});
}

std::optional<int64_t> ManagerDaemon::readStoreScan(const StoreScan& scan) {
  if (!scan.error.empty()) {
    // Never a fresh start either (that would throw the job's progress away):
    // keep resuming from the last known.
    if (storeReadError_ != scan.error) {
      storeReadError_ = scan.error;
      log::error("cannot look for checkpoints in ", config_.globalStore, ": ", scan.error,
                 lastCheckpoint_ ? strCat("; using the last one seen, step ", *lastCheckpoint_) : std::string());
      events_->write("store_error", {{"error", proto::boundedText(scan.error)}});
    }
    return lastCheckpoint_;
  }
  storeReadError_.clear();
  for (const auto& skip : scan.skipped) {
    if (!skippedCheckpoints_.insert(skip.step).second) continue;  // reported already
    log::warn("skipping the checkpoint of step ", skip.step, ": ", skip.reason,
              scan.latest ? strCat("; the latest usable one is step ", *scan.latest) : std::string("; no usable one is left"));
    events_->write("checkpoint_skipped", {{"step", skip.step}, {"reason", proto::boundedText(skip.reason)}});
  }
  return scan.latest;
}

// --- reporting ---------------------------------------------------------------------

void ManagerDaemon::onStepReport(const proto::StepReport& report) {
  if (auto verdict = slowDetector_.add(report)) onSlowVerdict(*verdict);
  StepAggregate& step = steps_[report.step];
  ++step.reports;
  step.maxStepSeconds = std::max(step.maxStepSeconds, report.stepSeconds);
  step.loss = report.loss;
  if (step.reports < controller_->plan().worldSize()) return;
  const StepAggregate done = step;
  steps_.erase(steps_.begin(), steps_.upper_bound(report.step));
  const auto now = Clock::now();
  lastStep_ = report.step;
  lastLoss_ = done.loss;
  lastSamplesPerSecond_ = done.maxStepSeconds > 0 ? static_cast<double>(config_.batchSize) / done.maxStepSeconds : 0;
  if (firstStepOfGeneration_ < 0) {
    firstStepOfGeneration_ = report.step;
    progressMarkStep_ = -1;  // throughput restarts with the new plan
    if (const auto phases = morph_.finish(now)) {
      json fields = phases->toJson();
      fields["generation"] = controller_->generation();
      fields["plan"] = controller_->plan().describe();
      ++morphs_;
      log::info("morph done in ", phases->totalS, " s (", phases->cause, "): first step ", report.step, " on ",
                controller_->plan().stages, "x", controller_->plan().replicas);
      events_->write("morph_complete", fields);
    }
  }
  if (now - lastProgressPrint_ >= std::chrono::seconds(1)) {
    // Throughput over the steps since the last line, not one noisy step.
    if (progressMarkStep_ >= 0 && report.step > progressMarkStep_ && lastProgressPrint_ != TimePoint{}) {
      lastSamplesPerSecond_ = static_cast<double>((report.step - progressMarkStep_) * config_.batchSize) /
                              secondsBetween(lastProgressPrint_, now);
    }
    progressMarkStep_ = report.step;
    lastProgressPrint_ = now;
    const std::string ckptText =
        lastCheckpoint_ ? strCat("last checkpoint step ", *lastCheckpoint_,
                                 lastCheckpointSeen_ != TimePoint{} ? strCat(" (", static_cast<int>(secondsBetween(lastCheckpointSeen_, now)), " s ago)") : std::string())
                        : std::string("no checkpoint yet");
    char figures[128];
    std::snprintf(figures, sizeof(figures), "loss %.4f | %.1f samples/s | step %.3f s", done.loss,
                  lastSamplesPerSecond_, done.maxStepSeconds);
    log::info("step ", report.step, " | ", figures, " | ", controller_->plan().stages, "x",
              controller_->plan().replicas, " on ", controller_->plan().hosts.size(), " host(s) | ", ckptText);
  }
}

void ManagerDaemon::onCheckpointFailed(int rank, const proto::CheckpointFailed& failure) {
  const auto& placement = controller_->plan().placement;
  const std::string host = rank >= 0 && rank < static_cast<int>(placement.size()) ? placement[rank].host : "?";
  const std::string error = proto::boundedText(failure.error);
  ++checkpointFailures_;
  log::warn("rank ", rank, " on ", host, ": the checkpoint of step ", failure.step, " failed (", error,
            "); training goes on, the next checkpoint tries again");
  lastCheckpointFailure_ = {{"host", host}, {"rank", rank}, {"step", failure.step}, {"error", error}};
  events_->write("checkpoint_failed", lastCheckpointFailure_);
}

void ManagerDaemon::onSlowVerdict(const std::vector<SlowMachine>& slow) {
  std::vector<std::string> hosts;
  for (const auto& s : slow) hosts.push_back(s.host);
  if (hosts == slowHosts_) return;
  try {
    ckpt::writeFileAtomic(config_.stateDir, "slow_machines.out", formatSlowMachines(slow));
    slowHosts_ = hosts;
  } catch (const std::exception& e) {  // a full disk: the next verdict (a window later) tries again
    log::error("cannot write ", config_.stateDir, "/slow_machines.out: ", proto::boundedText(e.what()));
    return;
  }
  json list = json::array();
  for (const auto& s : slow) {
    log::warn("slow machine: ", s.host, " (rank ", s.rank, ", stage ", s.stage, ") takes ", s.ratio(),
              "x the stage median per micro-batch", config_.excludeSlow ? "; it leaves at the next morph" : "");
    list.push_back({{"host", s.host}, {"rank", s.rank}, {"stage", s.stage}, {"ratio", s.ratio()}});
    if (config_.excludeSlow) {
      controller_->excludeHost(s.host);
      markAbsent(s.host, "slow", Clock::now()).slow = true;  // until the machine list is written
    }
  }
  events_->write("slow_machines", {{"machines", list}});
}

const json& ManagerDaemon::cachedPlanJson() {
  // 1000 ranks make a large object: build it once per generation.
  if (planJsonGeneration_ != controller_->generation()) {
    planJson_ = controller_->phase() == Phase::kIdle ? json() : planJson(controller_->plan());
    planJsonGeneration_ = controller_->generation();
  }
  return planJson_;
}

void ManagerDaemon::writeState() {
  if (!controller_ || !events_) return;
  // Called from every handler that changes the job: a failure (full disk)
  // must not end the handler, let alone the manager. The tick tries again
  // until it works; the state is rebuilt from scratch each time.
  try {
    writeStateFile();
    lastStateWrite_ = Clock::now();
    if (stateWriteFailing_) log::info("state.json written again");
    stateWriteFailing_ = false;
  } catch (const std::exception& e) {
    stateWriteFailing_ = true;
    uint64_t suppressed = 0;
    if (stateWriteLog_.allow(Clock::now(), &suppressed)) {
      log::error("cannot write ", config_.stateDir, "/state.json: ", proto::boundedText(e.what()),
                 "; retrying at every tick", suppressed ? strCat(" (", suppressed, " more failures)") : std::string());
    }
  }
}

void ManagerDaemon::writeStateFile() {
  json hosts = json::object();
  for (const auto& m : listed_) {
    auto it = agents_.find(m.host);
    const char* status = "unknown";
    if (it != agents_.end()) {
      switch (it->second.status) {
        case AgentStatus::kStarting: status = "starting"; break;
        case AgentStatus::kUp: status = "up"; break;
        case AgentStatus::kFailed: status = "failed"; break;
        case AgentStatus::kGone: status = "gone"; break;
      }
    }
    hosts[m.host] = {{"slots", m.slots}, {"agent", status}, {"preempted", preempted_.count(m.host) > 0}};
    // Out of the job: why, since when, and what brings it back.
    json out;
    if (auto a = absent_.find(m.host); a != absent_.end()) {
      const HostAbsence& absence = a->second;
      const auto now = Clock::now();
      const char* backWhen =
          absence.slow                                               ? "the machine list is written"
          : absence.preemptedUntil && now < *absence.preemptedUntil ? "the preemption deadline has passed"
          : absence.retryAt || (it != agents_.end() && it->second.status == AgentStatus::kStarting)
              ? "its agent is up"
              : "the machine list is written";
      out = {{"why", absence.why},
             {"for_s", secondsBetween(absence.since, now)},
             {"attempts", absence.attempts},
             {"back_when", backWhen},
             {"retry_in_s", absence.retryAt ? json(std::max(0.0, secondsBetween(now, *absence.retryAt))) : json()}};
    }
    hosts[m.host]["out"] = out;
  }
  json state = {
      {"job", config_.job},
      {"pid", ::getpid()},
      {"address", advertisedAddress_},
      {"phase", finished_ ? (exitCode_ == 0 ? "finished" : "failed") : toString(controller_->phase())},
      {"generation", controller_->generation()},
      {"plan", cachedPlanJson()},
      {"hosts", hosts},
      {"last_checkpoint_step", lastCheckpoint_ ? json(*lastCheckpoint_) : json()},
      {"checkpoint_failures", checkpointFailures_},
      {"last_checkpoint_failure", lastCheckpointFailure_},
      {"skipped_checkpoints", skippedCheckpoints_},
      {"progress", {{"step", lastStep_}, {"loss", lastLoss_}, {"samples_per_s", lastSamplesPerSecond_}}},
      {"morphs", morphs_},
      {"slow_machines", slowHosts_},
      {"uptime_s", secondsBetween(startedAt_, Clock::now())},
      {"updated", isoTimeNow()},
      {"stop_reason", stopReason_},
      {"connections", {{"pending", pending_.size()},
                       {"closed_before_hello", closedBeforeHello_},
                       {"no_hello_in_time", pending_.expired()},
                       {"over_the_cap", pending_.evicted()},
                       {"accept_failures", acceptFailures_},
                       {"handler_failures", guard_->failures()}}},
      {"global_store", config_.globalStore},
      {"events", events_->path()}};
  ckpt::writeFileAtomic(config_.stateDir, "state.json",
                        state.dump(2, ' ', false, json::error_handler_t::replace) + "\n");
}

void ManagerDaemon::printSummary() {
  log::info("summary: job '", config_.job, "', last step ", lastStep_, ", loss ", lastLoss_, ", ", morphs_,
            " morph(s), last checkpoint ", lastCheckpoint_ ? std::to_string(*lastCheckpoint_) : "none",
            ", ran ", static_cast<int>(secondsBetween(startedAt_, Clock::now())), " s; events in ", events_->path());
}

}  // namespace varuna
