// JobMetrics fed with the daemon's events on a fake clock, read back as the
// metric families a scrape collects; MetricsServer serving them over HTTP on
// loopback (a port in use is a ConfigError naming --metrics_port); the
// --metrics_port option in the job config.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "test_env.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/common/errors.h"
#include "varuna/manager/checkpoint_scan.h"
#include "daemon/job_metrics.h"
#include "daemon/metrics_server.h"
#include "daemon/morph_tracker.h"
#include "loop/event_log.h"
#include "varuna/manager/job_config.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

using TimePoint = std::chrono::steady_clock::time_point;
const TimePoint t0 = TimePoint{} + 1h;

const prometheus::MetricFamily& family(const std::vector<prometheus::MetricFamily>& families, const std::string& name) {
  for (const auto& f : families) {
    if (f.name == name) return f;
  }
  FAIL("no metric family " << name);
  throw std::logic_error("unreachable");
}

// The series of `name` whose labels include `labels`.
const prometheus::ClientMetric& series(const JobMetrics& metrics, const std::string& name,
                                       const prometheus::Labels& labels = {}) {
  static std::vector<prometheus::MetricFamily> families;  // keeps the returned series alive
  families = metrics.collect();
  const auto& f = family(families, name);
  for (const auto& metric : f.metric) {
    size_t matched = 0;
    for (const auto& label : metric.label) matched += labels.count(label.name) && labels.at(label.name) == label.value;
    if (matched == labels.size()) return metric;
  }
  FAIL("no series of " << name << " with the labels asked for");
  throw std::logic_error("unreachable");
}

double gauge(const JobMetrics& m, const std::string& name, const prometheus::Labels& labels = {}) {
  return series(m, name, labels).gauge.value;
}
double counter(const JobMetrics& m, const std::string& name, const prometheus::Labels& labels = {}) {
  return series(m, name, labels).counter.value;
}
prometheus::ClientMetric::Histogram histogram(const JobMetrics& m, const std::string& name,
                                              const prometheus::Labels& labels = {}) {
  return series(m, name, labels).histogram;
}
// Observations at or below `bound`.
uint64_t countAtMost(const prometheus::ClientMetric::Histogram& h, double bound) {
  for (const auto& bucket : h.bucket) {
    if (bucket.upper_bound == bound) return bucket.cumulative_count;
  }
  FAIL("no bucket " << bound);
  return 0;
}

Plan plan(int stages, int replicas, int64_t chunk = 4) {
  Plan p;
  p.stages = stages;
  p.replicas = replicas;
  p.globalBatch = 16;
  p.chunkSize = chunk;
  for (int r = 0; r < stages * replicas; ++r) p.placement.push_back({r, r < 2 ? "a" : "b", r % 2});
  p.hosts = stages * replicas > 2 ? std::vector<std::string>{"a", "b"} : std::vector<std::string>{"a"};
  return p;
}

proto::StepReport report(int stage, int replica, int64_t step, double computeS) {
  proto::StepReport r;
  r.stage = stage;
  r.replica = replica;
  r.step = step;
  r.computeSecondsPerMicrobatch = computeS;
  return r;
}

}  // namespace

TEST_CASE("metrics: steps, the plan, throughput and goodput") {
  JobMetrics m(16);
  CHECK(gauge(m, "varuna_step") == -1);
  CHECK(std::isnan(gauge(m, "varuna_loss")));
  m.launched(plan(2, 2, 4), 1, -1, t0);
  for (int64_t step = 1; step <= 10; ++step) m.stepCompleted(step, 3.0 - 0.1 * step, 0.5, t0 + step * 1s);
  m.tick(t0 + 10s);
  CHECK(gauge(m, "varuna_step") == 10);
  CHECK(gauge(m, "varuna_loss") == Approx(2.0));
  CHECK(gauge(m, "varuna_step_seconds") == 0.5);
  CHECK(gauge(m, "varuna_samples_per_second") == Approx(32));  // 16 samples in 0.5 s
  CHECK(counter(m, "varuna_trained_samples_total") == 160);
  CHECK(counter(m, "varuna_recomputed_samples_total") == 0);
  CHECK(gauge(m, "varuna_goodput_samples_per_second") == Approx(16));  // 160 kept samples in 10 s
  CHECK(gauge(m, "varuna_generation") == 1);
  CHECK(gauge(m, "varuna_plan_stages") == 2);
  CHECK(gauge(m, "varuna_plan_replicas") == 2);
  CHECK(gauge(m, "varuna_plan_micro_batch_size") == 4);
  CHECK(gauge(m, "varuna_plan_global_batch_size") == 16);
  CHECK(gauge(m, "varuna_plan_hosts") == 2);
  CHECK(counter(m, "varuna_launches_total") == 1);

  // Per stage: the mean over its replicas of the newest step's reports.
  m.stepReport(report(0, 0, 11, 0.010));
  m.stepReport(report(0, 1, 11, 0.030));
  m.stepReport(report(1, 0, 11, 0.005));
  CHECK(gauge(m, "varuna_stage_compute_seconds_per_microbatch", {{"stage", "0"}}) == Approx(0.020));
  CHECK(gauge(m, "varuna_stage_compute_seconds_per_microbatch", {{"stage", "1"}}) == Approx(0.005));
  m.stepReport(report(0, 0, 12, 0.012));  // a newer step starts over
  m.stepReport(report(0, 1, 11, 0.500));  // a late report of the older one is ignored
  CHECK(gauge(m, "varuna_stage_compute_seconds_per_microbatch", {{"stage", "0"}}) == Approx(0.012));

  // A one-stage plan: stage 1's series goes.
  m.launched(plan(1, 2, 2), 2, 10, t0 + 20s);
  const auto families = m.collect();
  const auto& stages = family(families, "varuna_stage_compute_seconds_per_microbatch");
  REQUIRE(stages.metric.size() == 1);
  CHECK(stages.metric[0].label[0].value == "0");
  CHECK(gauge(m, "varuna_plan_stages") == 1);
  CHECK(gauge(m, "varuna_plan_micro_batch_size") == 2);
  CHECK(gauge(m, "varuna_generation") == 2);
}

TEST_CASE("metrics: a relaunch from an older checkpoint counts the rolled-back samples as recomputed") {
  JobMetrics m(16);
  m.launched(plan(2, 2), 1, -1, t0);
  for (int64_t step = 1; step <= 50; ++step) m.stepCompleted(step, 1, 0.1, t0 + step * 100ms);
  m.launched(plan(2, 2), 2, 40, t0 + 10s);  // steps 41..50 are lost
  CHECK(counter(m, "varuna_recomputed_samples_total") == 10 * 16);
  CHECK(gauge(m, "varuna_step") == 40);
  for (int64_t step = 41; step <= 45; ++step) m.stepCompleted(step, 1, 0.1, t0 + 11s);
  m.launched(plan(2, 2), 3, 40, t0 + 15s);  // lost again: 41..45
  CHECK(counter(m, "varuna_recomputed_samples_total") == 15 * 16);
  m.launched(plan(2, 2), 4, 40, t0 + 16s);  // no step in between: nothing more lost
  CHECK(counter(m, "varuna_recomputed_samples_total") == 15 * 16);
  for (int64_t step = 41; step <= 100; ++step) m.stepCompleted(step, 1, 0.1, t0 + 20s);
  m.tick(t0 + 20s);
  // Trained 50 + 5 + 60 steps, 15 of them lost: the 100 kept steps' samples over 20 s.
  CHECK(counter(m, "varuna_trained_samples_total") == 115 * 16);
  CHECK(gauge(m, "varuna_goodput_samples_per_second") == Approx(100 * 16 / 20.0));
  // A morph that resumes where the job was loses nothing.
  m.launched(plan(2, 1), 5, 100, t0 + 21s);
  CHECK(counter(m, "varuna_recomputed_samples_total") == 15 * 16);
}

TEST_CASE("metrics: morphs by their first cause, the last recovery time and their histogram") {
  JobMetrics m(16);
  CHECK(gauge(m, "varuna_morph_in_progress") == 0);
  CHECK(std::isnan(gauge(m, "varuna_last_morph_recovery_seconds")));
  m.morphStarted(JobMetrics::MorphCause::kPreemption);
  m.morphStarted(JobMetrics::MorphCause::kMachinesChanged);  // the checkpoint order of the same morph
  CHECK(gauge(m, "varuna_morph_in_progress") == 1);
  MorphPhases phases;
  phases.cause = "preemption of b";
  phases.checkpointAndTeardownS = 3;
  phases.launchAndConnectS = 1.5;
  phases.rendezvousLoadFirstStepS = 3;
  phases.totalS = 7.5;
  m.morphFinished(phases);
  CHECK(counter(m, "varuna_morphs_total", {{"cause", "preemption"}}) == 1);
  CHECK(counter(m, "varuna_morphs_total", {{"cause", "machines_changed"}}) == 0);
  CHECK(gauge(m, "varuna_morph_in_progress") == 0);
  CHECK(gauge(m, "varuna_last_morph_recovery_seconds") == 7.5);
  CHECK(gauge(m, "varuna_last_morph_phase_seconds", {{"phase", "checkpoint_and_teardown"}}) == 3);
  CHECK(gauge(m, "varuna_last_morph_phase_seconds", {{"phase", "launch_and_connect"}}) == 1.5);
  CHECK(gauge(m, "varuna_last_morph_phase_seconds", {{"phase", "rendezvous_load_first_step"}}) == 3);

  m.morphStarted(JobMetrics::MorphCause::kHostLost);
  phases.totalS = 40;
  m.morphFinished(phases);
  CHECK(counter(m, "varuna_morphs_total", {{"cause", "host_lost"}}) == 1);
  const auto h = histogram(m, "varuna_morph_recovery_seconds");
  CHECK(h.sample_count == 2);
  CHECK(h.sample_sum == Approx(47.5));
  CHECK(countAtMost(h, 5) == 0);
  CHECK(countAtMost(h, 10) == 1);
  CHECK(countAtMost(h, 60) == 2);
  CHECK(gauge(m, "varuna_last_morph_recovery_seconds") == 40);
}

TEST_CASE("morph tracker: one morph from its first cause to the first step, in the metrics, the event and the count") {
  JobMetrics m(16);
  MorphTracker tracker(m);
  const auto dir = test::scratchDir("morph_tracker");
  EventLog events((dir / "events.jsonl").string());
  tracker.setEventLog(&events);
  Plan plan;
  plan.stages = 2;
  plan.replicas = 1;
  // Before any morph, a generation's first step is nothing.
  tracker.firstStep(1, plan, 0, t0);
  CHECK(tracker.completed() == 0);
  tracker.begin("preemption of h2", JobMetrics::MorphCause::kPreemption, t0);
  tracker.begin("the machines changed", JobMetrics::MorphCause::kMachinesChanged, t0 + 1s);  // folds into it
  CHECK(tracker.active());
  CHECK(gauge(m, "varuna_morph_in_progress") == 1);
  tracker.launched(t0 + 2s);
  tracker.connected(t0 + 3s);
  tracker.firstStep(2, plan, 41, t0 + 5s);
  CHECK_FALSE(tracker.active());
  CHECK(tracker.completed() == 1);
  CHECK(gauge(m, "varuna_morph_in_progress") == 0);
  CHECK(counter(m, "varuna_morphs_total", {{"cause", "preemption"}}) == 1);
  CHECK(gauge(m, "varuna_last_morph_recovery_seconds") == 5);
  std::ifstream in(dir / "events.jsonl");
  std::string line;
  REQUIRE(std::getline(in, line));
  const auto event = nlohmann::json::parse(line);
  CHECK(event["event"] == "morph_complete");
  CHECK(event["cause"] == "preemption of h2");
  CHECK(event["generation"] == 2);
  CHECK(event["total_s"] == 5.0);
  CHECK(event["checkpoint_and_teardown_s"] == 2.0);
  // The job's stop: timed, but no morph in the metrics.
  tracker.begin("stopping", JobMetrics::MorphCause::kOther, t0 + 10s, /*counted=*/false);
  CHECK(tracker.active());
  CHECK(gauge(m, "varuna_morph_in_progress") == 0);
}

TEST_CASE("metrics: failures by cause, every cause present from the start") {
  JobMetrics m(16);
  const auto families = m.collect();
  CHECK(family(families, "varuna_failures_total").metric.size() == 10);
  CHECK(family(families, "varuna_morphs_total").metric.size() == 7);
  m.failure(JobMetrics::Failure::kWorkerCrashed);
  m.failure(JobMetrics::Failure::kWorkerCrashed);
  m.failure(JobMetrics::Failure::kHostLost);
  m.failure(JobMetrics::Failure::kCheckpointTimeout);
  CHECK(counter(m, "varuna_failures_total", {{"cause", "worker_crashed"}}) == 2);
  CHECK(counter(m, "varuna_failures_total", {{"cause", "host_lost"}}) == 1);
  CHECK(counter(m, "varuna_failures_total", {{"cause", "checkpoint_timeout"}}) == 1);
  CHECK(counter(m, "varuna_failures_total", {{"cause", "no_progress"}}) == 0);
}

TEST_CASE("metrics: hosts by state, each counted once") {
  HostAbsences absences({2s, 60s});
  absences.markAbsent("lost", "lost", t0);
  absences.markAbsent("failed", "agent_failed", t0);
  absences.markPreempted("preempted", t0 + 120s, t0);
  absences.markSlow("excluded", t0);
  absences.markAbsent("lost-then-excluded", "lost", t0);
  absences.markSlow("lost-then-excluded", t0);
  const nlohmann::json hosts = {
      {"up", {{"agent", "up"}}},
      {"slow", {{"agent", "up"}}},
      {"starting", {{"agent", "starting"}}},
      {"lost", {{"agent", "gone"}}},
      {"failed", {{"agent", "failed"}}},
      {"preempted", {{"agent", "up"}}},  // still answering until the deadline
      {"excluded", {{"agent", "up"}}},
      {"lost-then-excluded", {{"agent", "starting"}}},
      {"gone-unrecorded", {{"agent", "gone"}}},
  };
  const HostCounts counts = countHosts(hosts, absences, {"slow", "excluded"});
  CHECK(counts == HostCounts{/*up=*/1, /*starting=*/1, /*lost=*/3, /*preempted=*/1, /*slow=*/1, /*excluded=*/2});
  JobMetrics m(16);
  m.hosts(counts);
  CHECK(gauge(m, "varuna_hosts", {{"state", "up"}}) == 1);
  CHECK(gauge(m, "varuna_hosts", {{"state", "starting"}}) == 1);
  CHECK(gauge(m, "varuna_hosts", {{"state", "lost"}}) == 3);
  CHECK(gauge(m, "varuna_hosts", {{"state", "preempted"}}) == 1);
  CHECK(gauge(m, "varuna_hosts", {{"state", "slow"}}) == 1);
  CHECK(gauge(m, "varuna_hosts", {{"state", "excluded"}}) == 2);
}

TEST_CASE("metrics: checkpoints, their age and how long they took") {
  JobMetrics m(16);
  CHECK(gauge(m, "varuna_last_checkpoint_step") == -1);
  m.tick(t0);
  CHECK(std::isnan(gauge(m, "varuna_last_checkpoint_age_seconds")));
  // Found in the store at start-up: known, but not counted or timed.
  m.checkpointSeen(10, t0);
  m.launched(plan(2, 2), 1, 10, t0);
  CHECK(gauge(m, "varuna_last_checkpoint_step") == 10);
  CHECK(counter(m, "varuna_checkpoints_total") == 0);
  // Periodic: step 20 done at t0+1s, its checkpoint seen at t0+3s.
  for (int64_t step = 11; step <= 20; ++step) m.stepCompleted(step, 1, 0.1, t0 + 100ms * (step - 10));
  m.checkpointSeen(20, t0 + 3s);
  m.checkpointSeen(20, t0 + 4s);  // the same one, every tick
  m.tick(t0 + 5s);
  CHECK(counter(m, "varuna_checkpoints_total") == 1);
  CHECK(gauge(m, "varuna_last_checkpoint_step") == 20);
  CHECK(gauge(m, "varuna_last_checkpoint_age_seconds") == Approx(2));
  auto periodic = histogram(m, "varuna_checkpoint_duration_seconds", {{"kind", "periodic"}});
  CHECK(periodic.sample_count == 1);
  CHECK(periodic.sample_sum == Approx(2));
  // On demand: ordered at t0+10s after step 25, step 26 checkpointed, seen at t0+14s.
  for (int64_t step = 21; step <= 25; ++step) m.stepCompleted(step, 1, 0.1, t0 + 9s);
  m.checkpointOrdered(t0 + 10s);
  m.checkpointOrdered(t0 + 11s);  // the same order again (a second notice)
  m.checkpointSeen(26, t0 + 14s);
  const auto onDemand = histogram(m, "varuna_checkpoint_duration_seconds", {{"kind", "on_demand"}});
  CHECK(onDemand.sample_count == 1);
  CHECK(onDemand.sample_sum == Approx(4));
  CHECK(histogram(m, "varuna_checkpoint_duration_seconds", {{"kind", "periodic"}}).sample_count == 1);
  CHECK(counter(m, "varuna_checkpoints_total") == 2);
  // An order whose checkpoint never came (the job failed) does not claim the next periodic one.
  m.checkpointOrdered(t0 + 20s);
  m.launched(plan(2, 2), 2, 26, t0 + 30s);
  m.stepCompleted(30, 1, 0.1, t0 + 31s);
  m.checkpointSeen(30, t0 + 32s);
  CHECK(histogram(m, "varuna_checkpoint_duration_seconds", {{"kind", "on_demand"}}).sample_count == 1);
  periodic = histogram(m, "varuna_checkpoint_duration_seconds", {{"kind", "periodic"}});
  CHECK(periodic.sample_count == 2);
  CHECK(periodic.sample_sum == Approx(3));
  m.checkpointFailed();
  CHECK(counter(m, "varuna_checkpoint_failures_total") == 1);
}

TEST_CASE("metrics: a restarted manager reports the age of the checkpoint in the store, not since it started") {
  // The store as a manager restarted with the same --state_dir finds it: a
  // checkpoint completed two hours ago.
  const auto store = test::scratchDir("old-checkpoint");
  const auto dir = ckpt::checkpointDir(store, 40);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / ckpt::kMarker) << "40\n";
  std::filesystem::last_write_time(dir / ckpt::kMarker, std::filesystem::file_time_type::clock::now() - 2h);
  // On the store's thread, at the start-up scan (t0).
  const auto age = checkpointAgeSeconds(store.string(), 40);
  REQUIRE(age);
  CHECK(*age == Approx(7200).margin(60));
  CHECK_FALSE(checkpointAgeSeconds(store.string(), 41));  // none: unknown, not 0

  JobMetrics m(16);  // the new manager's
  const auto completed = t0 - std::chrono::duration_cast<TimePoint::duration>(std::chrono::duration<double>(*age));
  m.checkpointSeen(40, TimePoint{}, completed);  // seen at start-up, before the loop: no seenAt
  m.tick(t0);
  CHECK(gauge(m, "varuna_last_checkpoint_age_seconds") == Approx(*age));
  m.tick(t0 + 10s);
  CHECK(gauge(m, "varuna_last_checkpoint_age_seconds") == Approx(*age + 10));
  // A new checkpoint: its own age, not the old one's.
  m.checkpointSeen(50, t0 + 20s, t0 + 19s);
  m.tick(t0 + 25s);
  CHECK(gauge(m, "varuna_last_checkpoint_age_seconds") == Approx(6));

  // Without the completion time: unknown at start-up (NaN, never 0), then
  // since first seen; known later for the same checkpoint, it wins.
  JobMetrics old(16);
  old.checkpointSeen(40, TimePoint{});
  old.tick(t0);
  CHECK(std::isnan(gauge(old, "varuna_last_checkpoint_age_seconds")));
  old.checkpointSeen(40, TimePoint{}, completed);
  old.tick(t0);
  CHECK(gauge(old, "varuna_last_checkpoint_age_seconds") == Approx(*age));
  // A store clock ahead of ours: 0, not negative.
  old.checkpointSeen(50, t0, t0 + 5s);
  old.tick(t0 + 1s);
  CHECK(gauge(old, "varuna_last_checkpoint_age_seconds") == 0);
}

namespace {

// GET http://127.0.0.1:port/path: the whole response.
std::string httpGet(uint16_t port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  REQUIRE(::send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0;) response.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  return response;
}

}  // namespace

TEST_CASE("metrics server: Prometheus' text format on loopback; a port in use is a clear error") {
  JobMetrics m(16);
  m.launched(plan(2, 2), 3, -1, t0);
  m.stepCompleted(7, 2.5, 0.25, t0 + 1s);
  MetricsServer server("127.0.0.1", 0, m.registry());
  REQUIRE(server.port() > 0);
  CHECK(server.url() == "http://127.0.0.1:" + std::to_string(server.port()) + "/metrics");
  const std::string body = httpGet(server.port(), "/metrics");
  CHECK_THAT(body, Catch::StartsWith("HTTP/1.1 200"));
  CHECK_THAT(body, Catch::Contains("# TYPE varuna_step gauge"));
  CHECK_THAT(body, Catch::Contains("\nvaruna_step 7\n"));
  CHECK_THAT(body, Catch::Contains("\nvaruna_generation 3\n"));
  CHECK_THAT(body, Catch::Contains("varuna_morphs_total{cause=\"preemption\"} 0"));
  CHECK_THAT(body, Catch::Contains("# TYPE varuna_morph_recovery_seconds histogram"));

  CHECK_THROWS_AS(MetricsServer("127.0.0.1", server.port(), m.registry()), ConfigError);
  CHECK_THROWS_WITH(MetricsServer("127.0.0.1", server.port(), m.registry()),
                    Catch::Contains("--metrics_port " + std::to_string(server.port())) &&
                        Catch::Contains("Pick a free --metrics_port, or 0 for any free port"));
}

TEST_CASE("--metrics_port: off by default, 0..65535 from the command line or the job file") {
  const auto dir = test::scratchDir("metrics-config");
  std::ofstream(dir / "machines.txt") << "127.0.0.1 slots=2\n";
  JobConfig c;
  c.machineList = (dir / "machines.txt").string();
  c.nstages = 2;
  c.batchSize = 16;
  c.chunkSize = 4;
  c.globalStore = (dir / "store").string();
  c.stateDir = (dir / "state").string();
  c.program = {"./train_gpt"};
  CHECK(c.metricsPort == -1);
  REQUIRE_NOTHROW(validateJobConfig(c, "/x/run_varuna"));
  for (const int bad : {70000, -2}) {
    JobConfig wrong = c;
    wrong.metricsPort = bad;
    CHECK_THROWS_WITH(validateJobConfig(wrong, "/x/run_varuna"),
                      Catch::Contains("--metrics_port must be 0..65535") && Catch::Contains(std::to_string(bad)));
  }
  CHECK(parseJobConfigText(R"({"metrics_port": 9400})", "job.json").metricsPort == 9400);
  CHECK(toJson(parseJobConfigText(R"({"metrics_port": 0})", "job.json"))["metrics_port"] == 0);
  const char* argv[] = {"run_varuna", "--metrics_port", "9401", "--", "./train_gpt"};
  int exitCode = 0;
  const auto parsed = parseCommandLine(5, argv, exitCode);
  REQUIRE(parsed);
  CHECK(parsed->metricsPort == 9401);
}
