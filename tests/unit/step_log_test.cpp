// StepLog: steps.jsonl at most a line a second, every generation's first and
// last step, each with its own time and the throughput since the line before.
#include <catch2/catch.hpp>

#include <fstream>
#include <nlohmann/json.hpp>

#include "test_env.h"
#include "varuna/manager/daemon/step_log.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

std::vector<nlohmann::json> lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace

TEST_CASE("step log: a line a second, each generation's first and last step") {
  const auto dir = test::scratchDir("step-log");
  const std::string path = (dir / "steps.jsonl").string();
  const auto t0 = std::chrono::steady_clock::time_point{} + 1h;
  const int64_t ms0 = 1'700'000'000'000;
  {
    StepLog log(path, 16);
    // Generation 1: a step every 100 ms, steps 1..25.
    for (int64_t step = 1; step <= 25; ++step) {
      log.add(1, step, 3.0 - 0.01 * step, 0.1, t0 + step * 100ms, ms0 + step * 100);
    }
    log.flush();  // the launch of generation 2: step 25 was not written yet
    log.add(2, 26, 2.7, 0.2, t0 + 4s, ms0 + 4000);
    log.add(2, 27, 2.6, 0.2, t0 + 4200ms, ms0 + 4200);
    log.flush();  // the stop
    log.flush();  // nothing pending
  }
  const auto got = lines(path);
  std::vector<int64_t> steps;
  for (const auto& line : got) steps.push_back(line["step"].get<int64_t>());
  // 1 (first), 11 and 21 (a second apart), 25 (the last of generation 1), 26 (first of 2), 27 (last).
  CHECK(steps == std::vector<int64_t>{1, 11, 21, 25, 26, 27});
  CHECK(got[0]["event"] == "step");
  CHECK(got[0]["generation"] == 1);
  CHECK(got[0]["samples_per_s"].get<double>() == Approx(160));  // its own step: 16 samples in 0.1 s
  CHECK(got[1]["samples_per_s"].get<double>() == Approx(160));  // 10 steps of 16 in 1 s
  CHECK(got[3]["unix_ms"] == ms0 + 2500);  // written at the flush, stamped with its step's time
  CHECK(got[3]["time"].get<std::string>().size() == 24);
  CHECK(got[4]["generation"] == 2);
  CHECK(got[4]["samples_per_s"].get<double>() == Approx(80));  // the first of a generation: its own step
  CHECK(got[5]["loss"].get<double>() == Approx(2.6));
  CHECK(got[5]["step_s"].get<double>() == Approx(0.2));
}
