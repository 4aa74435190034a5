// The ManagerDaemon's JobMetrics wiring, in-process against a simulated
// cluster (tests/support/sim_cluster.h), as daemon_sequences_test drives it:
// a preemption counts one morph by its cause and no failure, the plan and the
// hosts' states follow; a crashed worker counts one failure (not the exits of
// the kill-all that follows) and its rolled-back samples; the stop is no
// morph. Every wait is on a condition with a deadline.
#include <catch2/catch.hpp>

#include "daemon/job_metrics.h"
#include "sim_daemon_harness.h"
#include "varuna/manager/manager_daemon.h"

using namespace varuna;
using namespace std::chrono_literals;
using sim::PeerKind;

namespace {

// run_varuna in-process on two hosts of 2 slots: 2 stages x 2 replicas.
struct MetricsDaemon : test::SimDaemonHarness {
  explicit MetricsDaemon(const std::string& name) : SimDaemonHarness(name, 15s) {
    test::writeMachineList(dir / "machines.txt", {"node-a", "node-b"}, 2);
    JobConfig config = test::daemonTestConfig(dir, "metrics", /*batchSize=*/4, /*nstages=*/2);
    test::fastFaultTimings(config);
    auto options = sim::fastSimOptions(50ms, 200ms);
    options.globalStore = config.globalStore;  // checkpoint orders write real (tiny) checkpoints
    useFakeClock();  // and in-memory streams to the daemon: no socket
    simulate(options);
    startSimulated(config);
  }
  ~MetricsDaemon() { CHECK(noSockets() == ""); }  // the whole test ran without a socket

  bool waitTraining(int generation, int64_t steps = 3) {
    return runUntil([&] {
      const int world = cluster->worldSize(generation);
      return cluster->generation() == generation && world > 0 && cluster->liveWorkers(generation) == world &&
             cluster->minStep(generation) >= steps && value("varuna_generation") == generation &&
             value("varuna_step") >= 1;
    });
  }

  // The value of a gauge or counter series (its labels include `labels`); NaN if none.
  double value(const std::string& name, const prometheus::Labels& labels = {}) const {
    for (const auto& family : daemon->metrics().collect()) {
      if (family.name != name) continue;
      for (const auto& metric : family.metric) {
        size_t matched = 0;
        for (const auto& l : metric.label) matched += labels.count(l.name) && labels.at(l.name) == l.value;
        if (matched != labels.size()) continue;
        return family.type == prometheus::MetricType::Counter ? metric.counter.value
               : family.type == prometheus::MetricType::Histogram
                   ? static_cast<double>(metric.histogram.sample_count)
                   : metric.gauge.value;
      }
    }
    return std::nan("");
  }
  double sum(const std::string& name) const {
    double total = 0;
    for (const auto& family : daemon->metrics().collect()) {
      if (family.name != name) continue;
      for (const auto& metric : family.metric) total += metric.counter.value;
    }
    return total;
  }
};

}  // namespace

TEST_CASE("daemon metrics: a preemption is one morph and no failure; plan and hosts follow", "[metrics]") {
  MetricsDaemon f("metrics_preemption");
  REQUIRE(f.waitTraining(1));
  CHECK(f.value("varuna_plan_stages") == 2);
  CHECK(f.value("varuna_plan_replicas") == 2);
  CHECK(f.value("varuna_hosts", {{"state", "up"}}) == 2);
  CHECK(f.value("varuna_morph_in_progress") == 0);
  const double stepBefore = f.value("varuna_step");

  f.cluster->sendPreemptNotice("node-b");
  REQUIRE(f.runUntil([&] { return f.value("varuna_morph_in_progress") == 1; }));
  CHECK(f.value("varuna_hosts", {{"state", "preempted"}}) == 1);
  REQUIRE(f.waitTraining(2));
  REQUIRE(f.runUntil([&] { return f.value("varuna_morphs_total", {{"cause", "preemption"}}) == 1; }));
  CHECK(f.sum("varuna_morphs_total") == 1);
  CHECK(f.value("varuna_morph_in_progress") == 0);
  CHECK(f.sum("varuna_failures_total") == 0);
  CHECK(f.value("varuna_generation") == 2);
  CHECK(f.value("varuna_plan_replicas") == 1);
  CHECK(f.value("varuna_plan_hosts") == 1);
  CHECK(f.value("varuna_hosts", {{"state", "up"}}) == 1);
  CHECK(f.value("varuna_hosts", {{"state", "preempted"}}) == 1);
  CHECK(f.value("varuna_step") >= stepBefore);
  CHECK(f.value("varuna_recomputed_samples_total") == 0);  // it resumed where it stopped
  CHECK(f.value("varuna_last_morph_recovery_seconds") > 0);
  CHECK(f.value("varuna_morph_recovery_seconds") == 1);  // the histogram's count
  // The on-demand checkpoint the simulated workers wrote, timed from its order.
  CHECK(f.value("varuna_checkpoint_duration_seconds", {{"kind", "on_demand"}}) == 1);
  CHECK(f.value("varuna_last_checkpoint_step") >= 1);
  CHECK(f.value("varuna_launches_total") == 2);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("daemon metrics: a crashed worker is one failure; the steps since the last checkpoint are recomputed",
          "[metrics]") {
  MetricsDaemon f("metrics_crash");
  REQUIRE(f.waitTraining(1, 5));
  f.cluster->exitWorker(1, -1, 9);  // kill -9: the kill-all's SIGKILLs follow for the other three
  REQUIRE(f.waitTraining(2));
  REQUIRE(f.runUntil([&] { return f.value("varuna_morphs_total", {{"cause", "worker_failed"}}) == 1; }));
  CHECK(f.value("varuna_failures_total", {{"cause", "worker_crashed"}}) == 1);
  CHECK(f.sum("varuna_failures_total") == 1);
  CHECK(f.sum("varuna_morphs_total") == 1);
  // No checkpoint before the crash: generation 2 starts over, every step of generation 1 is recomputed.
  CHECK(f.events("launch").at(1)["resume_step"] == -1);
  CHECK(f.value("varuna_recomputed_samples_total") >= 5 * 4);
  CHECK(f.value("varuna_plan_replicas") == 2);
  CHECK(f.daemon->handlerFailures() == 0);
}

TEST_CASE("daemon metrics: the stop checkpoints but is no morph", "[metrics]") {
  MetricsDaemon f("metrics_stop");
  REQUIRE(f.waitTraining(1));
  f.daemon->requestStop("the test is over");
  REQUIRE(f.runUntil([&] { return !f.events("stop").empty(); }));
  CHECK(f.value("varuna_morph_in_progress") == 0);
  CHECK(f.sum("varuna_morphs_total") == 0);
  CHECK(f.sum("varuna_failures_total") == 0);
  f.runUntil([&] { return f.value("varuna_checkpoint_duration_seconds", {{"kind", "on_demand"}}) == 1; }, 5s);
  CHECK(f.value("varuna_checkpoint_duration_seconds", {{"kind", "on_demand"}}) == 1);
}
