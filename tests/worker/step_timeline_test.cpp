// StepTimeline (worker/src/pipeline/step_timeline.h): one rank's trace file,
// off without a folder, a step's events written only once the step ends
// (its span last), a folder that cannot be made refused naming trace_dir.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "pipeline/step_timeline.h"
#include "varuna/common/errors.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;

namespace {

std::filesystem::path freshDir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("varuna-step-timeline-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

// The file's events (its array is left open; each line one event and a comma).
std::vector<nlohmann::json> eventsOf(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  REQUIRE(line == "[");
  std::vector<nlohmann::json> events;
  while (std::getline(in, line)) {
    REQUIRE(line.back() == ',');
    events.push_back(nlohmann::json::parse(line.substr(0, line.size() - 1)));
  }
  return events;
}

StepTimeline::Identity stageOneOfZbv(int64_t generation) {
  return {.rank = 1, .stage = 1, .replica = 0, .generation = generation,
          .layout = ChunkLayout::of(ScheduleKind::kZeroBubbleV, 2, 2)};
}

}  // namespace

TEST_CASE("step timeline: off without a folder", "[step_timeline]") {
  StepTimeline off("", stageOneOfZbv(0));
  CHECK_FALSE(off.enabled());
  const auto t = StepTimeline::Clock::now();
  off.beginStep(1, t);
  off.task(Task{TaskType::kForward, 0, true, 0}, t, t);
  off.endStep(t);  // nothing to write to, nothing thrown
}

TEST_CASE("step timeline: a step's events, its span last, and nothing of an unfinished step", "[step_timeline]") {
  const auto dir = freshDir("steps");
  {
    StepTimeline timeline(dir.string(), stageOneOfZbv(0));
    REQUIRE(timeline.enabled());
    CHECK(timeline.path() == (dir / "rank1_trace.json").string());
    const auto t0 = StepTimeline::Clock::now();
    timeline.beginStep(7, t0);
    timeline.span("wait", "wait activation", t0, t0 + std::chrono::microseconds(500));
    timeline.task(Task{TaskType::kBackwardInput, 3, true, 1}, t0 + std::chrono::milliseconds(1),
                  t0 + std::chrono::milliseconds(4));
    timeline.endStep(t0 + std::chrono::milliseconds(5));
    timeline.beginStep(8, t0 + std::chrono::milliseconds(6));  // a rank that dies in step 8
    timeline.task(Task{TaskType::kForward, 0, true, 0}, t0 + std::chrono::milliseconds(6),
                  t0 + std::chrono::milliseconds(7));
  }
  const auto events = eventsOf(dir / "rank1_trace.json");
  REQUIRE(events.size() == 5);  // two metadata events, step 7's wait, task and span
  CHECK(events[0]["ph"] == "M");
  CHECK(events[0]["args"]["name"] == "rank 1: stage 1, replica 0");
  CHECK(events[2]["cat"] == "wait");
  CHECK(events[2]["dur"] == 500);
  const auto& task = events[3];
  CHECK(task["name"] == "BI1 mb3");
  CHECK(task["dur"] == 3000);
  CHECK(task["args"]["virtual_stage"] == 2);  // zbv: stage 1's second chunk is virtual stage 2 of 4
  CHECK(task["args"]["virtual_stages"] == 4);
  CHECK(task["args"]["step"] == 7);
  const auto& step = events[4];
  CHECK(step["cat"] == "step");
  CHECK(step["args"]["step"] == 7);
  CHECK(step["dur"] == 5000);
  CHECK(task["ts"].get<int64_t>() - step["ts"].get<int64_t>() == 1000);
  std::filesystem::remove_all(dir);
}

TEST_CASE("step timeline: a generation's files stay apart, each its own process", "[step_timeline]") {
  const auto dir = freshDir("generations");
  { StepTimeline first(dir.string(), stageOneOfZbv(2)); }
  { StepTimeline second(dir.string(), stageOneOfZbv(3)); }
  CHECK(std::filesystem::exists(dir / "gen2_rank1_trace.json"));
  const auto events = eventsOf(dir / "gen3_rank1_trace.json");
  REQUIRE_FALSE(events.empty());
  CHECK(events[0]["pid"] == 3001);
  CHECK(events[0]["args"]["name"] == "rank 1: stage 1, replica 0, generation 3");
  std::filesystem::remove_all(dir);
}

TEST_CASE("step timeline: a folder that cannot be made is refused naming trace_dir", "[step_timeline]") {
  const auto dir = freshDir("blocked");
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "a_file") << "not a folder";
  try {
    StepTimeline timeline((dir / "a_file" / "trace").string(), stageOneOfZbv(0));
    FAIL("a folder under a file was accepted");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Catch::Contains("trace_dir: cannot write"));
  }
  std::filesystem::remove_all(dir);
}
