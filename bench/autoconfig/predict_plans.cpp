// predict_plans: AutoConfig's view of a machine list, as JSON, for
// bench_autoconfig.py: every candidate plan with its predicted step time, the
// partition costs the workers must use, and which one AutoConfig chooses.
//   predict_plans --profile P.json --machines "127.0.0.1:2" --batch 16 [--schedules all] [--skip_hopeless]
// Every plan is simulated unless --skip_hopeless (what run_varuna does:
// plans whose lower bound is slower than the chosen one are skipped).
#include <CLI/CLI.hpp>
#include <iostream>
#include <nlohmann/json.hpp>

#include "varuna/common/profile.h"
#include "varuna/manager/autoconfig.h"
#include "varuna/manager/job_config.h"

int main(int argc, char** argv) {
  std::string profilePath, machinesText = "127.0.0.1:2", schedules = "all";
  int64_t batch = 16;
  bool skipHopeless = false;
  double memoryGb = 0;
  int threads = 0;
  CLI::App app{"predict_plans: AutoConfig's candidates as JSON"};
  app.add_option("--profile", profilePath)->required();
  app.add_option("--machines", machinesText, "host:slots[,host:slots...]");
  app.add_option("--batch", batch, "global batch");
  app.add_option("--schedules", schedules, "varuna,1f1b,gpipe or all");
  app.add_option("--memory_gb", memoryGb, "memory per device (0: unlimited)");
  app.add_flag("--skip_hopeless", skipHopeless, "skip plans whose lower bound is slower (as run_varuna does)");
  app.add_option("--threads", threads, "simulations at once (0: one per core, at most 8)");
  CLI11_PARSE(app, argc, argv);
  try {
    varuna::AutoConfigRequest request;
    request.globalBatch = batch;
    request.schedules = varuna::parseScheduleList(schedules);
    request.simulateAll = !skipHopeless;
    request.memoryPerDeviceBytes = static_cast<int64_t>(memoryGb * (1LL << 30));
    request.threads = threads;
    int line = 0;
    for (size_t start = 0; start < machinesText.size();) {
      const auto end = std::min(machinesText.find(',', start), machinesText.size());
      const std::string item = machinesText.substr(start, end - start);
      const auto colon = item.rfind(':');
      request.machines.push_back({item.substr(0, colon), std::stoi(item.substr(colon + 1)), ++line});
      start = end + 1;
    }
    const auto profile = varuna::profile::readProfile(profilePath);
    const auto result = varuna::autoConfigure(profile, request);
    nlohmann::json plans = nlohmann::json::array();
    for (const auto& c : result.ranked) {
      if (!c.feasible) continue;  // skipped or too large
      plans.push_back({{"name", c.shortName()},
                       {"stages", c.plan.stages},
                       {"replicas", c.plan.replicas},
                       {"chunk_size", c.plan.chunkSize},
                       {"per_replica_batch", c.plan.perReplicaBatch},
                       {"schedule", varuna::toString(c.schedule)},
                       {"stage_to_rank_map", c.plan.stageToRankMap},
                       {"piece_costs", c.plan.pieceCosts},
                       {"predicted_step_s", c.simulation.stepSeconds},
                       {"bubble_fraction", c.simulation.bubbleFraction},
                       {"chosen", c.shortName() == result.best.shortName()}});
    }
    std::cout << nlohmann::json{{"plans", plans},
                                {"explain", result.explain()},
                                {"considered", result.ranked.size()},
                                {"simulated", result.simulatedCount},
                                {"planning_s", result.planningSeconds}}
                     .dump()
              << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "predict_plans: " << e.what() << std::endl;
    return 2;
  }
}
