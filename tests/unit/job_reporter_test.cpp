// JobReporter alone, on a fake clock: what the daemon's reporting role makes
// of step reports, checkpoint failures and slow machines, and state.json as
// it reads the daemon through a DaemonStatus of the test's making. Its wiring
// into the real daemon is daemon_sequences_test's and daemon_metrics_test's.
#include <unistd.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <thread>
#include <nlohmann/json.hpp>

#include "fake_clock.h"
#include "test_env.h"
#include "daemon/job_reporter.h"
#include "daemon/launch_message.h"
#include "varuna/manager/checkpoint_scan.h"

using namespace varuna;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

// One stage of three replicas on hosts a, b, c (a slow machine needs a stage
// median to be slower than).
Plan threeReplicas() {
  PlanRequest request;
  request.machines = {{"a", 1, 1}, {"b", 1, 2}, {"c", 1, 3}};
  request.globalBatch = 3;
  request.chunkSize = 1;
  return makePlan(request);
}

proto::StepReport report(int rank, int64_t step, double computeS, double loss = 2.5) {
  return proto::StepReport{rank, 0, rank, step, loss, computeS * 3, computeS};
}

std::vector<json> readLines(const std::filesystem::path& file, const std::string& event) {
  std::vector<json> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    auto j = json::parse(line, nullptr, false);
    if (j.is_object() && j.value("event", "") == event) out.push_back(std::move(j));
  }
  return out;
}

struct ReporterFixture {
  boost::asio::io_context io;
  test::FakeClock clock;
  std::filesystem::path dir;
  EventLog events;
  JobMetrics metrics{3};
  MorphTracker morph{metrics};
  CheckpointWatcher checkpoints;
  HostAbsences absences{{2s, 10s}};
  Plan plan = threeReplicas();
  // The daemon as the test makes it look.
  std::string phase = "running";
  int generation = 1;
  bool planned = true;
  std::vector<std::string> excluded;  // hosts the reporter asked to exclude
  std::unique_ptr<JobReporter> reporter;

  explicit ReporterFixture(const std::string& name)
      : dir(test::scratchDir(name)),
        events((dir / "events.jsonl").string()),
        checkpoints(io, std::make_shared<HandlerGuard>(), events, (dir / "store").string(), scanCheckpointStore, clock) {
    std::filesystem::create_directories(dir / "state");
    JobReporter::Options options;
    options.job = "reporter-test";
    options.stateDir = (dir / "state").string();
    options.globalStore = (dir / "store").string();
    options.address = "127.0.0.1:4242";
    options.globalBatch = 3;
    options.slowThreshold = 0.15;
    options.slowWindow = 2;
    options.excludeSlow = true;
    options.startedAt = clock.now();
    JobReporter::Hooks hooks;
    hooks.status = [this] { return status(); };
    hooks.excludeSlowHost = [this](const std::string& host) { excluded.push_back(host); };
    reporter = std::make_unique<JobReporter>(
        options, JobReporter::Parts{events, metrics, morph, checkpoints, clock}, std::move(hooks),
        std::make_unique<StepLog>((dir / "state" / "steps.jsonl").string(), 3));
    reporter->onLaunch(plan);
  }

  JobReporter::DaemonStatus status() {
    JobReporter::DaemonStatus s;
    s.phase = phase;
    s.generation = generation;
    s.plan = planned ? &plan : nullptr;
    s.hosts = {{"a", {{"agent", "up"}}}, {"b", {{"agent", "up"}}}, {"c", {{"agent", "up"}}}};
    s.absences = &absences;
    s.connections = {{"accepted", 7}};
    s.stopReason = "";
    return s;
  }
  // Every rank's report of `step`; rank 2 (host c) takes `slowC` x as long.
  void step(int64_t step, double slowC = 1.0) {
    for (int rank = 0; rank < 3; ++rank) {
      reporter->onStepReport(report(rank, step, rank == 2 ? 0.1 * slowC : 0.1), plan, generation);
    }
  }
  json state() {
    reporter->writeState();
    std::ifstream in(dir / "state" / "state.json");
    return json::parse(in);
  }
  std::vector<json> eventsOf(const std::string& type) { return readLines(dir / "events.jsonl", type); }
};

}  // namespace

TEST_CASE("reporter: a step every rank reported is progress, a steps.jsonl line and state.json's") {
  ReporterFixture f("reporter_steps");
  f.reporter->onStepReport(report(0, 0, 0.1, 3.0), f.plan, f.generation);
  f.reporter->onStepReport(report(1, 0, 0.1, 3.0), f.plan, f.generation);
  CHECK(f.state()["progress"]["step"] == -1);  // not every rank yet
  f.reporter->onStepReport(report(2, 0, 0.1, 3.0), f.plan, f.generation);
  const json state = f.state();
  CHECK(state["progress"]["step"] == 0);
  CHECK(state["progress"]["loss"] == 3.0);
  const auto lines = readLines(f.dir / "state" / "steps.jsonl", "step");
  REQUIRE(lines.size() == 1);  // a generation's first step is written at once
  CHECK(lines[0]["generation"] == 1);
  CHECK(lines[0]["step"] == 0);
  // The daemon's own fields come from its status, the rest from the reporter.
  CHECK(state["job"] == "reporter-test");
  CHECK(state["pid"] == ::getpid());
  CHECK(state["address"] == "127.0.0.1:4242");
  CHECK(state["phase"] == "running");
  CHECK(state["generation"] == 1);
  CHECK(state["plan"] == planJson(f.plan));
  CHECK(state["hosts"].size() == 3);
  CHECK(state["connections"]["accepted"] == 7);
  CHECK(state["last_checkpoint_step"].is_null());
  CHECK(state["checkpoint_failures"] == 0);
  CHECK(state["slow_machines"] == json::array());
  CHECK(state["metrics_address"].is_null());
  CHECK(state["steps"] == (f.dir / "state" / "steps.jsonl").string());
  CHECK(state["events"] == (f.dir / "events.jsonl").string());
}

TEST_CASE("reporter: state.json's plan is built once per generation, none while idle") {
  ReporterFixture f("reporter_plan");
  CHECK(f.state()["plan"]["stages"] == 1);
  f.generation = 2;
  f.planned = false;  // the controller idles (no machine left)
  CHECK(f.state()["plan"].is_null());
  f.planned = true;   // the same generation: the cached answer
  CHECK(f.state()["plan"].is_null());
  f.generation = 3;
  CHECK(f.state()["plan"] == planJson(f.plan));
}

TEST_CASE("reporter: a failed checkpoint is counted, logged as an event and kept for state.json") {
  ReporterFixture f("reporter_checkpoint_failed");
  f.reporter->onCheckpointFailed(2, proto::CheckpointFailed{2, 5, "No space left on device"}, f.plan);
  f.reporter->onCheckpointFailed(9, proto::CheckpointFailed{9, 6, "EIO"}, f.plan);  // no such rank
  const json state = f.state();
  CHECK(state["checkpoint_failures"] == 2);
  CHECK(state["last_checkpoint_failure"] == json{{"host", "?"}, {"rank", 9}, {"step", 6}, {"error", "EIO"}});
  const auto failed = f.eventsOf("checkpoint_failed");
  REQUIRE(failed.size() == 2);
  CHECK(failed[0]["host"] == "c");
  CHECK(failed[0]["step"] == 5);
  CHECK(failed[0]["error"] == "No space left on device");
}

TEST_CASE("reporter: a slow machine is written out, reported once and excluded through the hook") {
  ReporterFixture f("reporter_slow");
  for (int64_t s = 0; s < 4; ++s) f.step(s, 2.0);  // two windows of two steps, c twice as slow
  REQUIRE(f.excluded == std::vector<std::string>{"c"});
  std::ifstream out(f.dir / "state" / "slow_machines.out");
  const std::string text((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  CHECK(text.find("\nc 2 0 ") != std::string::npos);
  auto reported = f.eventsOf("slow_machines");
  REQUIRE(reported.size() == 1);
  CHECK(reported[0]["machines"][0]["host"] == "c");
  CHECK(f.state()["slow_machines"] == json{"c"});
  // The same verdict again is not news.
  for (int64_t s = 4; s < 6; ++s) f.step(s, 2.0);
  CHECK(f.eventsOf("slow_machines").size() == 1);
  CHECK(f.excluded.size() == 1);
  // Readmitted through the machine list and still slow: reported and excluded again.
  f.reporter->slowHostReadmitted("c");
  CHECK(f.state()["slow_machines"] == json::array());
  for (int64_t s = 6; s < 8; ++s) f.step(s, 2.0);
  CHECK(f.eventsOf("slow_machines").size() == 2);
  CHECK(f.excluded == std::vector<std::string>{"c", "c"});
}

TEST_CASE("reporter: a state.json that cannot be written is retried at the tick") {
  ReporterFixture f("reporter_state_write");
  // Its temporary file's name is taken by a folder.
  const auto blocker = f.dir / "state" / ("state.json.tmp." + std::to_string(::getpid()));
  std::filesystem::create_directories(blocker);
  f.reporter->writeState();
  CHECK(f.reporter->stateWriteFailing());
  f.reporter->tick(f.clock.now());  // due at once while failing
  CHECK(f.reporter->stateWriteFailing());
  std::filesystem::remove(blocker);
  f.reporter->tick(f.clock.now());
  CHECK_FALSE(f.reporter->stateWriteFailing());
  CHECK(std::filesystem::exists(f.dir / "state" / "state.json"));
}

TEST_CASE("reporter: the tick's state.json is written off the loop, the plan with it") {
  ReporterFixture f("reporter_state_background");
  f.step(0);
  f.clock.advance(std::chrono::seconds(2));
  f.reporter->tick(f.clock.now());  // due: queued for the writer thread
  while (f.reporter->stateWriting()) std::this_thread::yield();
  std::ifstream in(f.dir / "state" / "state.json");
  const json state = json::parse(in);
  CHECK(state["plan"] == planJson(f.plan));  // shared with the writer, set there
  CHECK(state["progress"]["step"] == 0);
  CHECK(state["hosts"].size() == 3);
}

TEST_CASE("state file: writes land in order; a queued background state gives way to a newer one") {
  const auto dir = test::scratchDir("state_file_order");
  StateFile file(dir.string());
  const auto now = std::chrono::steady_clock::now();
  auto snapshot = [](int n) {
    return [n] {
      return StateFile::Snapshot{json{{"n", n}}, {{"big", std::make_shared<const json>(json::array({n, n}))}}};
    };
  };
  auto read = [&] { return json::parse(std::ifstream(dir / "state.json")); };
  for (int n = 1; n <= 50; ++n) file.writeInBackground(snapshot(n), now);
  file.write(snapshot(51), now);  // waits for its own file: nothing older lands after it
  CHECK_FALSE(file.writing());
  CHECK(read() == json{{"n", 51}, {"big", {51, 51}}});
  CHECK_FALSE(file.due(now));
  CHECK(file.due(now + std::chrono::seconds(1)));
  file.writeInBackground(snapshot(52), now);
  while (file.writing()) std::this_thread::yield();
  CHECK(read()["n"] == 52);
  CHECK_FALSE(file.failing());
}
