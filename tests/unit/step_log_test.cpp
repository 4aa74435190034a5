// StepLog: steps.jsonl at most a line a second, every generation's first and
// last step, each with its own time and the throughput since the line before;
// fed past its size limit (also by a restarted manager), it stays bounded,
// thinned to an even spacing, and scripts/varuna_report.py still reads it
// (rollbacks exact).
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>
#include <vector>

#include "test_env.h"
#include "daemon/step_log.h"

using namespace varuna;
using namespace std::chrono_literals;

namespace {

std::vector<nlohmann::json> lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// What scripts/varuna_report.py makes of a state folder: its rollbacks as
// [generation, resume_step, last_step, steps] and the number of step points.
std::string reportOf(const std::filesystem::path& stateDir) {
  const auto source = test::sourceDir();
  // The project's Python (VARUNA_PYTHON, set by CTest), else the one on PATH:
  // a checkout without its own .venv still runs this.
  const char* python = std::getenv("VARUNA_PYTHON");
  const std::string command =
      std::string(python != nullptr && *python != '\0' ? python : "python3") + " -c '" +
      "import json, sys; sys.path.insert(0, sys.argv[1]); import varuna_report as r; d = sys.argv[2]; "
      "t = r.build_timeline(r.read_jsonl(d + \"/events.jsonl\"), r.read_jsonl(d + \"/steps.jsonl\")); "
      "print(json.dumps([[x[k] for k in (\"generation\", \"resume_step\", \"last_step\", \"steps\")] "
      "for x in t[\"rollbacks\"]]), len(t[\"steps\"][\"step\"]))' " +
      (source / "scripts").string() + " " + stateDir.string() + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof(buffer), pipe)) out.append(buffer, n);
  CHECK(::pclose(pipe) == 0);
  return out;
}

// Lines of one generation a step every 500 ms (32 samples/s at 16 a step),
// from `first` to `last` steps, starting `at` seconds after t0; the file is
// never over `maxBytes` after a line.
void feed(StepLog& log, int generation, int64_t first, int64_t last, std::chrono::milliseconds at, uint64_t maxBytes) {
  const auto t0 = std::chrono::steady_clock::time_point{} + 1h;
  const int64_t ms0 = 1'700'000'000'000;
  for (int64_t step = first; step <= last; ++step) {
    const auto since = at + (step - first) * 500ms;
    log.add(generation, step, 2.0, 0.5, t0 + since, ms0 + since.count());
    REQUIRE(std::filesystem::file_size(log.path()) <= maxBytes);
  }
  log.flush();  // the next launch, or the stop
}

// The first and last step of each generation, in file order.
std::vector<std::vector<int64_t>> generationEnds(const std::vector<nlohmann::json>& got) {
  std::vector<std::vector<int64_t>> ends;
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t step = got[i]["step"];
    if (i == 0 || got[i - 1]["generation"] != got[i]["generation"]) ends.push_back({got[i]["generation"], step, step});
    ends.back()[2] = step;
  }
  return ends;
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

TEST_CASE("step log: past its limit it is thinned evenly, stays bounded and the report still reads it") {
  const auto dir = test::scratchDir("step-log-bounded");
  const std::string path = (dir / "steps.jsonl").string();
  constexpr uint64_t kMax = 16 * 1024;  // about 100 lines
  std::chrono::milliseconds spacing{};
  {
    StepLog log(path, 16, kMax);
    // 1500 s at a step every 500 ms: 1500 lines at a line a second, 15 times the limit.
    feed(log, 1, 1, 3000, 0ms, kMax);
    // A relaunch from the checkpoint of step 1000: 2000 steps rolled back.
    feed(log, 2, 1001, 4000, 1600s, kMax);
    spacing = log.interval();
  }
  CHECK(spacing >= 16s);
  auto got = lines(path);
  CHECK(got.size() >= 40);  // thinned to half the limit at most, not to nothing
  CHECK(generationEnds(got) == std::vector<std::vector<int64_t>>{{1, 1, 3000}, {2, 1001, 4000}});
  for (size_t i = 1; i < got.size(); ++i) {
    CHECK(got[i]["samples_per_s"].get<double>() == Approx(32));  // recomputed over the lines dropped
    const bool lastOfGeneration = i + 1 == got.size() || got[i + 1]["generation"] != got[i]["generation"];
    if (got[i]["generation"] != got[i - 1]["generation"] || lastOfGeneration) continue;
    // Even: old lines thinned to the spacing new ones are written at.
    const int64_t gapMs = got[i]["unix_ms"].get<int64_t>() - got[i - 1]["unix_ms"].get<int64_t>();
    CHECK(gapMs >= spacing.count());
    CHECK(gapMs <= 2 * spacing.count());
  }
  {
    // A restarted manager appends a line a second again: still bounded, the
    // old history kept.
    StepLog log(path, 16, kMax);
    feed(log, 3, 4001, 5000, 3200s, kMax);
  }
  got = lines(path);
  CHECK(generationEnds(got) ==
        std::vector<std::vector<int64_t>>{{1, 1, 3000}, {2, 1001, 4000}, {3, 4001, 5000}});
  CHECK(std::filesystem::file_size(path) <= kMax);

  std::ofstream events(dir / "events.jsonl");
  const int64_t ms0 = 1'700'000'000'000;
  const std::vector<std::tuple<int64_t, int, int64_t>> launches = {{-1, 1, -1}, {1599, 2, 1000}, {3199, 3, 4000}};
  for (const auto& [seconds, generation, resume] : launches) {
    events << nlohmann::json{{"unix_ms", ms0 + seconds * 1000}, {"event", "launch"}, {"generation", generation},
                             {"resume_step", resume}}
           << "\n";
  }
  events.close();
  CHECK(reportOf(dir) == "[[2, 1000, 3000, 2000]] " + std::to_string(got.size()) + "\n");
}
