#include "salvage_manager.h"

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>

#include "test_env.h"
#include "varuna/common/errors.h"
#include "varuna/common/launch_contract.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

namespace varuna::test {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

SalvageManager::SalvageManager(int worldSize, int stages, std::chrono::milliseconds salvageTimeout)
    : worldSize_(worldSize), stages_(stages), salvageTimeout_(salvageTimeout), thread_([this] { serve(); }) {}

SalvageManager::~SalvageManager() {
  quit_ = true;
  thread_.join();
}

std::map<std::string, std::string> SalvageManager::workerEnvironment() const {
  return {{contract::kManagerAddrEnv, listener_.address()},
          {contract::kJobTokenEnv, "salvage-test-token"},
          {contract::kJobEnv, "salvage-test"},
          {contract::kHostEnv, "127.0.0.1"},
          {contract::kGenerationEnv, std::to_string(kGeneration)}};
}

std::optional<SalvageChoice> SalvageManager::waitForChoice(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  decided_.wait_for(lock, timeout, [this] { return choice_.has_value() || !failure_.empty(); });
  return choice_;
}

std::vector<SalvageReport> SalvageManager::reports() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reports_;
}

std::string SalvageManager::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

void SalvageManager::serve() {
  try {
    serveUntilQuit();
  } catch (const std::exception& e) {  // e.g. a malformed frame: the test reads it, the thread ends cleanly
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = std::string("the fake manager failed: ") + e.what();
    decided_.notify_all();
  }
}

void SalvageManager::serveUntilQuit() {
  while (!quit_) {
    if (static_cast<int>(workers_.size()) < worldSize_) {
      if (auto peer = listener_.accept(5ms)) workers_.push_back(Worker{std::move(*peer)});
    }
    for (auto& worker : workers_) serveOne(worker);
    bool decided;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      decided = choice_.has_value() || !failure_.empty();
    }
    if (!stopped_ || decided) continue;
    const auto survivors = std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return !w.lost; });
    // Every survivor reported, or the manager's first round is over.
    if (static_cast<long>(reports().size()) >= survivors || Clock::now() - stoppedAt_ > salvageTimeout_) orderWrites();
  }
}

void SalvageManager::serveOne(Worker& worker) {
  if (worker.lost) return;
  while (auto message = worker.peer.receive(1ms)) handle(worker, *message);
  if (!worker.peer.closed()) return;
  worker.lost = true;
  bool salvaging;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    salvaging = choice_.has_value();
  }
  // A writer leaving after its write is no loss.
  if (!salvaging) stopSurvivors("rank " + std::to_string(worker.rank) + "'s connection dropped");
}

void SalvageManager::handle(Worker& worker, const proto::Message& message) {
  if (const auto* hello = std::get_if<proto::Hello>(&message)) {
    worker.rank = hello->rank;
    worker.peer.send(proto::Welcome{kGeneration, /*lostManagerGraceMs=*/0, salvageTimeout_.count()});
  } else if (const auto* ping = std::get_if<proto::Ping>(&message)) {
    worker.peer.send(proto::Pong{ping->sequence, ping->sentNs});
  } else if (const auto* ready = std::get_if<proto::SalvageReady>(&message)) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      reports_.push_back(SalvageReport{ready->rank, ready->stage, ready->step, "127.0.0.1", ready->finishableStep,
                                       ready->exchange, ready->exchangeStep});
    }
    // A survivor may notice the loss before the manager does.
    stopSurvivors("rank " + std::to_string(ready->rank) + " lost a peer");
  }
  // Heartbeats, step reports: nothing to do.
}

void SalvageManager::stopSurvivors(const std::string& reason) {
  if (stopped_) return;
  stopped_ = true;
  stoppedAt_ = Clock::now();
  for (auto& worker : workers_) {
    if (!worker.lost) worker.peer.send(proto::SalvageStop{kGeneration, reason});
  }
}

void SalvageManager::orderWrites() {
  const auto reports = this->reports();
  const auto choice = chooseSalvage(reports, stages_, {});
  if (!choice) {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = whyNoSalvage(reports, stages_);
    decided_.notify_all();
    return;
  }
  const std::set<int> writers(choice->writers.begin(), choice->writers.end());
  const int count = static_cast<int>(choice->writers.size());
  for (auto& worker : workers_) {
    if (worker.lost) continue;
    const auto at = std::find(choice->writers.begin(), choice->writers.end(), worker.rank);
    if (at == choice->writers.end()) {
      worker.peer.send(proto::ExitNow{kGeneration, "not a salvage writer"});
    } else {
      const int index = static_cast<int>(at - choice->writers.begin());
      worker.peer.send(proto::SalvageWrite{kGeneration, choice->step, index, count, choice->exchange});
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  choice_ = choice;
  decided_.notify_all();
}

namespace {

WorkerJobSpec twoByTwo(std::vector<std::string> trainArgs) {
  WorkerJobSpec spec;
  spec.stages = 2;
  spec.replicas = 2;
  spec.perReplicaBatch = 4;
  spec.chunkSize = 2;
  spec.trainArgs = std::move(trainArgs);
  return spec;
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

bool close(double a, double b, double rtol) { return rtol == 0 ? a == b : std::abs(a - b) <= rtol * std::abs(b); }

}  // namespace

void requireKillSalvagedWithNoStepLost(const std::vector<std::string>& trainArgs, const std::filesystem::path& dir,
                                       double rtol) {
  const auto store = (dir / "store").string();
  constexpr int kVictim = 3;  // stage 1, replica 1: rank 1 is its stage's only survivor
  int64_t salvaged = 0;
  {
    SalvageManager manager(4, 2, 20s);
    auto spec = twoByTwo(with(trainArgs, {"--steps", "1000000", "--checkpoint_dir", store, "--peer_timeout_s", "20"}));
    spec.env = manager.workerEnvironment();
    WorkerJob job(spec, dir / "killed");
    REQUIRE(waitUntil([&] { return job.steps(kVictim).size() >= 3; }, 120s));
    job.worker(kVictim).kill(SIGKILL);
    const auto choice = manager.waitForChoice(90s);
    INFO("no salvage: " << manager.failure());
    REQUIRE(choice);
    const auto codes = job.waitAll(90s);
    size_t newest = 0;  // steps finished by the rank that got furthest, the victim included
    for (int r = 0; r < job.worldSize(); ++r) newest = std::max(newest, job.steps(r).size());
    salvaged = choice->step;
    CHECK(salvaged >= static_cast<int64_t>(newest));  // no step lost
    CHECK(codes[kVictim] == 128 + SIGKILL);
    for (int r = 0; r < job.worldSize(); ++r) {
      if (r == kVictim) continue;
      INFO("rank " << r << " stderr:\n" << job.worker(r).stderrText());
      const bool writer = std::count(choice->writers.begin(), choice->writers.end(), r) > 0;
      CHECK(codes[r] == (writer ? kExitSalvaged : kExitSuperseded));
    }
  }
  // The salvaged step resumes as if nothing had happened.
  const auto end = std::to_string(salvaged + 3);
  WorkerJob resumed(twoByTwo(with(trainArgs, {"--steps", end, "--checkpoint_dir", store, "--resume_step",
                                              std::to_string(salvaged)})),
                    dir / "resumed");
  WorkerJob reference(twoByTwo(with(trainArgs, {"--steps", end})), dir / "reference");
  requireAllSucceeded(resumed);
  requireAllSucceeded(reference);
  for (int r = 0; r < resumed.worldSize(); ++r) {
    const auto ours = resumed.steps(r);
    const auto theirs = reference.steps(r);
    REQUIRE(ours.size() == 3);
    REQUIRE(theirs.size() == static_cast<size_t>(salvaged + 3));
    for (size_t i = 0; i < ours.size(); ++i) {
      INFO("rank " << r << " step " << ours[i].step);
      CHECK(ours[i].step == theirs[salvaged + i].step);
      CHECK(close(ours[i].loss, theirs[salvaged + i].loss, rtol));
    }
    const auto params = resumed.params(r);
    const auto expected = reference.params(r);
    REQUIRE(params.size() == expected.size());
    for (const auto& [name, tensor] : expected) {
      INFO("rank " << r << " " << name);
      CHECK((rtol == 0 ? torch::equal(params.at(name), tensor)
                       : torch::allclose(params.at(name), tensor, rtol, /*atol=*/1e-7)));
    }
  }
}

}  // namespace varuna::test
