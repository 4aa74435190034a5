#include "comm/comm.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef VARUNA_HAVE_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "comm/blocked_on_peers.h"
#include "varuna/common/log.h"

namespace varuna {
namespace {

constexpr const char* kFailureCountKey = "varuna/failure_count";
constexpr const char* kFailureKey = "varuna/failure";
constexpr const char* kLeftKey = "varuna/left";

std::string heartbeatKey(int rank) { return "varuna/hb/" + std::to_string(rank); }

std::string toString(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

c10::intrusive_ptr<c10d::TCPStore> connectStore(const std::string& addr, int port, bool isServer, int worldSize,
                                                std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = isServer;
  opts.numWorkers = worldSize;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(addr, opts);
}

// The future a collective completes; none for Gloo's point-to-point work,
// which has no future (waitAbortable waits on it instead).
c10::intrusive_ptr<c10::ivalue::Future> futureOf(const c10::intrusive_ptr<c10d::Work>& work) {
  if (dynamic_cast<c10d::ProcessGroupGloo::SendWork*>(work.get()) ||
      dynamic_cast<c10d::ProcessGroupGloo::RecvWork*>(work.get())) {
    return {};
  }
  try {
    return work->getFuture();
  } catch (const std::exception&) {
    return {};  // a backend without futures: waited on as before
  }
}

bool isLoopback(const std::string& addr) {
  return addr.rfind("127.", 0) == 0 || addr == "localhost" || addr == "::1";
}

}  // namespace

PeerMonitor::PeerMonitor(c10::intrusive_ptr<c10d::Store> store, int rank, int worldSize,
                         std::chrono::milliseconds interval, std::function<std::string(int)> describeRank)
    : store_(std::move(store)), rank_(rank), worldSize_(worldSize), interval_(interval),
      describeRank_(std::move(describeRank)) {
  thread_ = std::thread([this] { run(); });
}

PeerMonitor::~PeerMonitor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void PeerMonitor::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  int failuresInARow = 0;
  while (!stop_) {
    lock.unlock();
    try {
      store_->add(heartbeatKey(rank_), 1);
      failuresInARow = 0;
    } catch (const std::exception&) {
      // The store host is gone, or the store timed out under load. Whoever
      // waits on a peer diagnoses a lost store host; but a rank that stopped
      // beating for good after one slow answer would later be named as the
      // lost peer itself. So it keeps beating, backing off (up to 32
      // intervals) so as not to repeat libtorch's warning every interval.
      ++failuresInARow;
    }
    lock.lock();
    wake_.wait_for(lock, interval_ * (1 << std::min(failuresInARow, 5)), [this] { return stop_; });
  }
}

void PeerMonitor::recordFailure(const std::string& message) {
  try {
    if (store_->add(kFailureCountKey, 1) == 1) {
      store_->set(kFailureKey, std::vector<uint8_t>(message.begin(), message.end()));
    }
  } catch (const std::exception&) {
    // Nobody can read it either; peers fall back to heartbeats.
  }
}

std::vector<int64_t> PeerMonitor::readHeartbeats() {
  std::vector<int64_t> beats(worldSize_);
  for (int r = 0; r < worldSize_; ++r) beats[r] = store_->add(heartbeatKey(r), 0);
  return beats;
}

void PeerMonitor::interrupt() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    interrupted_ = true;
  }
  wake_.notify_all();
}

bool PeerMonitor::failureRecorded() { return store_->add(kFailureCountKey, 0) > 0; }

PeerLostError PeerMonitor::diagnose(const std::string& during, const std::string& cause) {
  const std::string noticed = strCat("; rank ", rank_, " noticed while ", during, ": ", cause);
  try {
    // A failure someone already diagnosed (or a rank's own error) wins, so every
    // rank names the same culprit.
    // Recorded failures read "<rank>|<message>".
    auto recorded = [&]() -> std::optional<PeerLostError> {
      if (store_->add(kFailureCountKey, 0) == 0) return std::nullopt;
      store_->wait({kFailureKey}, interval_ * 10);
      const std::string value = toString(store_->get(kFailureKey));
      const auto bar = value.find('|');
      return PeerLostError(value.substr(bar + 1) + noticed, std::stoi(value.substr(0, bar)));
    };
    if (auto known = recorded()) return *known;
    const auto before = readHeartbeats();
    {
      // Long enough for every live rank to beat. An interruption ends it: the
      // caller reports the interruption instead (Communicator::lostPeer), and
      // a salvage must not wait on a diagnosis nobody reads.
      std::unique_lock<std::mutex> lock(mutex_);
      if (wake_.wait_for(lock, interval_ * 4, [this] { return stop_ || interrupted_; })) {
        return PeerLostError(strCat("diagnosis interrupted", noticed), -1);
      }
    }
    if (auto known = recorded()) return *known;
    const auto after = readHeartbeats();
    for (int r = 0; r < worldSize_; ++r) {
      if (r != rank_ && after[r] == before[r]) {
        const std::string what = strCat("rank ", r, " (", describeRank_(r), ") was lost: it stopped sending heartbeats");
        recordFailure(strCat(r, "|", what));
        return PeerLostError(what + noticed, r);
      }
    }
    return PeerLostError(strCat("a peer connection of rank ", rank_, " failed but every rank still heartbeats", noticed), -1);
  } catch (const std::exception& e) {
    return PeerLostError(strCat("the rendezvous store is unreachable (", e.what(),
                                "): rank 0 (", describeRank_(0), "), which hosts it, was probably lost", noticed),
                         0);
  }
}

Communicator::Communicator(const CommOptions& options, const StageToRankMap& map)
    : options_(options), map_(map) {
  options_.backend = resolveCommBackend(options.backend, options.device);
  store_ = connectStore(options.masterAddr, options.masterPort, options.hostStore, options.worldSize, options.timeout);
  // The monitor gets its own connection: it beats from another thread.
  const int port = options.hostStore ? static_cast<c10d::TCPStore&>(*store_).getPort() : options.masterPort;
  auto monitorStore = connectStore(options.masterAddr, port, false, options.worldSize, options.timeout);
  monitor_ = std::make_unique<PeerMonitor>(monitorStore, options.rank, options.worldSize, options.heartbeatInterval,
                                           [this](int r) { return describeRank(r); });
  world_ = makeBackend("world", options.rank, options.worldSize);
  if (options_.backend == CommBackend::kNccl && options_.worldSize > 1) refuseSharedGpus();
  const char* byOrder = std::getenv("VARUNA_P2P_MATCH_BY_ORDER");
  matchByOrder_ = byOrder != nullptr && std::string(byOrder) == "1";
}

// NCCL fails two ranks on one GPU only at their first collective, with a
// message that names neither: find them at start-up and say what to do.
void Communicator::refuseSharedGpus() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const std::string mine = strCat(host, " cuda:", static_cast<int>(options_.device.index()));
  const std::string prefix = "varuna/gpu/";
  store_->set(prefix + std::to_string(options_.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  BlockedOnPeers blocked(options_.waitingOnPeers);
  for (int r = 0; r < options_.worldSize; ++r) {
    if (r == options_.rank) continue;
    const std::string key = prefix + std::to_string(r);
    try {
      store_->wait({key}, options_.timeout);
    } catch (const std::exception& e) {
      throw lostPeer(strCat("waiting for rank ", r, " to start (GPUs)"), e.what());
    }
    if (toString(store_->get(key)) == mine) {
      throw ConfigError(strCat("ranks ", std::min(r, options_.rank), " and ", std::max(r, options_.rank),
                               " both use ", mine, ", and NCCL refuses two ranks on one GPU: give each rank its "
                               "own GPU, or use --comm_backend gloo to share one"));
    }
  }
}

Communicator::~Communicator() {
  monitor_.reset();  // this rank stops beating: it is leaving
  if (finishedCleanly_ && !abandoned_) leave();
}

// The store lives in rank 0's process: a rank that finishes first and exits
// would cut off peers still running their last lines (writing results), whose
// heartbeats then fail with libtorch's warnings. So every rank that finished
// cleanly says it left, and rank 0 waits for the others to leave, or to stop
// beating (lost, or exited without a destructor), or for a failure to be
// recorded, for at most a minute. A rank ending on a failure does not wait:
// its peers may be blocked on it.
void Communicator::leave() noexcept {
  try {
    store_->add(kLeftKey, 1);
    if (!options_.hostStore || options_.worldSize == 1) return;
    const auto deadline = std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(
                                                                 options_.timeout, std::chrono::seconds(60));
    auto beatsOfOthers = [this] {
      int64_t sum = 0;
      for (int r = 1; r < options_.worldSize; ++r) sum += store_->add(heartbeatKey(r), 0);
      return sum;
    };
    int64_t beats = beatsOfOthers();
    int quiet = 0;
    while (store_->add(kLeftKey, 0) < options_.worldSize && store_->add(kFailureCountKey, 0) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(options_.heartbeatInterval);
      const int64_t now = beatsOfOthers();
      quiet = now == beats ? quiet + 1 : 0;
      if (quiet >= 4) return;  // nobody still running beats
      beats = now;
    }
  } catch (const std::exception&) {
    // Leaving is best effort: the store's own failures say nothing new.
  }
}

std::string Communicator::describeRank(int rank) const {
  if (rank < 0 || rank >= map_.worldSize()) return "unknown";
  return strCat("stage ", map_.stageOf(rank), ", replica ", map_.replicaOf(rank));
}

c10::intrusive_ptr<c10d::Backend> Communicator::makeBackend(const std::string& prefix, int groupRank, int groupSize) {
  auto store = c10::make_intrusive<c10d::PrefixStore>("varuna/pg/" + prefix, store_);
  if (options_.backend == CommBackend::kNccl) {
#ifdef VARUNA_HAVE_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = options_.timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, groupRank, groupSize, opts);
#else
    throw ConfigError("the device is CUDA but this build has no NCCL path: rebuild with a CUDA libtorch");
#endif
  }
  // One transport device per process, shared by every group. On loopback jobs
  // bind loopback; elsewhere the address this host's name resolves to.
  static const auto device = !options_.bindAddr.empty()
                                 ? c10d::ProcessGroupGloo::createDeviceForHostname(options_.bindAddr)
                             : isLoopback(options_.masterAddr)
                                 ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                 : c10d::ProcessGroupGloo::createDefaultDevice();
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->timeout = options_.timeout;
  opts->devices = {device};
  opts->threads = 2;
  BlockedOnPeers blocked(options_.waitingOnPeers);  // Gloo's rendezvous waits for every member
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, groupRank, groupSize, opts);
  } catch (const std::exception& e) {
    throw lostPeer(strCat("joining process group '", prefix, "'"), e.what());
  }
}

const c10::intrusive_ptr<c10d::Backend>& Communicator::group(const std::string& name, const std::vector<int>& ranks) {
  auto it = groups_.find(name);
  if (it != groups_.end()) return it->second;
  const auto pos = std::find(ranks.begin(), ranks.end(), options_.rank);
  VARUNA_CHECK(pos != ranks.end(), "rank ", options_.rank, " is not in group ", name);
  auto backend = makeBackend(name, static_cast<int>(pos - ranks.begin()), static_cast<int>(ranks.size()));
  return groups_.emplace(name, std::move(backend)).first->second;
}

bool Communicator::staged(const torch::Tensor& tensor) const {
  return options_.backend == CommBackend::kGloo && (tensor.is_cuda() || options_.stageThroughHost);
}

torch::Tensor Communicator::hostBufferFor(const torch::Tensor& tensor) {
  // Pinned: device copies to and from it run at full speed (and a copy back
  // to the device can be asynchronous: the caching host allocator keeps the
  // block until the copy is done).
  return torch::empty(tensor.sizes(), tensor.options().device(torch::kCPU).pinned_memory(tensor.is_cuda()));
}

std::optional<Communicator::StagedReceive> Communicator::takeStagedReceive(const c10::intrusive_ptr<c10d::Work>& work) {
  auto it = stagedReceives_.find(work.get());
  if (it == stagedReceives_.end()) return std::nullopt;
  auto receive = std::move(it->second);
  stagedReceives_.erase(it);
  return receive;
}

c10::intrusive_ptr<c10d::Work> Communicator::send(torch::Tensor& tensor, int dstRank, int tag) {
  // Staged: copied to the host now (a synchronous copy: the data is there
  // before Gloo reads it); Gloo's send work holds the buffer until done.
  std::vector<at::Tensor> tensors{staged(tensor) ? hostBufferFor(tensor).copy_(tensor) : tensor};
  try {
    return world_->send(tensors, dstRank, matchByOrder_ ? 0 : tag);
  } catch (const std::exception& e) {
    throw lostPeer(strCat("sending to rank ", dstRank), e.what());
  }
}

c10::intrusive_ptr<c10d::Work> Communicator::recv(torch::Tensor& tensor, int srcRank, int tag) {
  const bool viaHost = staged(tensor);
  std::vector<at::Tensor> tensors{viaHost ? hostBufferFor(tensor) : tensor};
  try {
    auto work = world_->recv(tensors, srcRank, matchByOrder_ ? 0 : tag);
    if (viaHost) stagedReceives_[work.get()] = StagedReceive{work, tensors[0], tensor};
    return work;
  } catch (const std::exception& e) {
    throw lostPeer(strCat("receiving from rank ", srcRank), e.what());
  }
}

void Communicator::waitFor(const c10::intrusive_ptr<c10d::Work>& work, const char* during) {
  BlockedOnPeers blocked(options_.waitingOnPeers);
  // A staged receive's copy to its device tensor, owed once it completed
  // (dropped however else the wait ends).
  const auto stagedReceive = takeStagedReceive(work);
  if (interrupted_) throw interruption(during);
  bool completed = false;
  try {
    if (auto future = futureOf(work)) {
      completed = waitOnFuture(work, future);
    } else {
      waitAbortable(work);
      // An aborted receive "completes" without data: once interrupted, the
      // data of a point-to-point wait cannot be trusted.
      completed = !interrupted_;
    }
  } catch (const PeerLostError&) {
    throw;
  } catch (const std::exception& e) {
    std::string cause = e.what();
    if (auto nl = cause.find('\n'); nl != std::string::npos) cause.resize(nl);  // drop c10 backtraces
    throw lostPeer(during, cause);
  }
  // A collective that completed counts even if an interruption came meanwhile
  // (a rank that finished a step's exchange holds that step: salvage.md).
  if (!completed) throw interruption(during);
  if (stagedReceive) stagedReceive->target.copy_(stagedReceive->host, /*non_blocking=*/true);
}

void Communicator::waitAbortable(const c10::intrusive_ptr<c10d::Work>& work) {
  {
    std::lock_guard<std::mutex> lock(interruptMutex_);
    abortable_ = work;
  }
  struct Clear {
    Communicator& comm;
    ~Clear() {
      std::lock_guard<std::mutex> lock(comm.interruptMutex_);
      comm.abortable_.reset();
    }
  } clear{*this};
  if (interrupted_) return;  // interrupt() may have run before abortable_ was set
  if (!work->wait(options_.timeout)) throw std::runtime_error("timed out");
}

bool Communicator::waitOnFuture(const c10::intrusive_ptr<c10d::Work>& work,
                                const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  auto wakeup = wakeup_;
  future->addCallback([wakeup](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(wakeup->mutex);
    wakeup->cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> lock(wakeup->mutex);
    const bool ready = wakeup->cv.wait_for(lock, options_.timeout,
                                           [&] { return future->completed() || interrupted_.load(); });
    if (!ready) throw std::runtime_error("timed out");
    if (!future->completed()) return false;  // interrupted: waitFor throws
  }
  work->wait();  // completed: returns at once, or rethrows the work's error
  return true;
}

void Communicator::interrupt(const std::string& reason) {
  c10::intrusive_ptr<c10d::Work> abortable;
  {
    std::lock_guard<std::mutex> lock(interruptMutex_);
    if (interrupted_) return;
    interruptReason_ = reason;
    abortable = abortable_;
    std::lock_guard<std::mutex> wake(wakeup_->mutex);
    interrupted_ = true;
  }
  wakeup_->cv.notify_all();
  if (monitor_) monitor_->interrupt();  // a diagnosis under way in the training thread ends
  if (abortable) {
    try {
      abortable->abort();  // Gloo: wakes the receive or send waiting on its buffer
    } catch (const std::exception&) {
      // Not abortable: the wait ends at its timeout or when the peer's connection drops.
    }
  }
}

PeerLostError Communicator::lostPeer(const std::string& during, const std::string& cause) {
  if (interrupted_) return interruption(during);
  auto lost = monitor_->diagnose(during, cause);
  return interrupted_ ? interruption(during) : lost;
}

PeerLostError Communicator::interruption(const std::string& during) const {
  std::lock_guard<std::mutex> lock(interruptMutex_);
  return PeerLostError(strCat("interrupted while ", during, ": ", interruptReason_), -1);
}

void Communicator::agreeOnStartup(const std::string& key, const std::string& myError) {
  const std::string prefix = "varuna/startup/" + key + "/";
  store_->set(prefix + std::to_string(options_.rank), std::vector<uint8_t>(myError.begin(), myError.end()));
  if (!myError.empty()) throw ConfigError(myError);
  BlockedOnPeers blocked(options_.waitingOnPeers);
  for (int r = 0; r < options_.worldSize; ++r) {
    const std::string k = prefix + std::to_string(r);
    try {
      store_->wait({k}, options_.timeout);
    } catch (const std::exception& e) {
      throw lostPeer(strCat("waiting for rank ", r, " to start (", key, ")"), e.what());
    }
    const std::string theirs = toString(store_->get(k));
    if (!theirs.empty()) throw ConfigError(strCat("rank ", r, " (", describeRank(r), ") failed to start: ", theirs));
  }
}

void Communicator::recordFailure(const std::string& message) {
  monitor_->recordFailure(strCat(options_.rank, "|rank ", options_.rank, " (", describeRank(options_.rank),
                                 ") failed: ", message));
}

}  // namespace varuna
