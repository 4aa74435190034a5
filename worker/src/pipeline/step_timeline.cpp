#include "pipeline/step_timeline.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "varuna/common/errors.h"

namespace varuna {

namespace {

nlohmann::json event(const std::string& name, const char* category, int pid, int64_t ts, int64_t dur) {
  return {{"name", name}, {"cat", category}, {"ph", "X"}, {"pid", pid}, {"tid", 0}, {"ts", ts}, {"dur", dur}};
}

}  // namespace

StepTimeline::StepTimeline(const std::string& dir, Identity who) : who_(std::move(who)) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  // A morph's new generation starts new files: the old ones stay, to compare.
  const std::string name = strCat(who_.generation > 0 ? strCat("gen", who_.generation, "_") : std::string(), "rank",
                                  who_.rank, "_trace.json");
  path_ = (std::filesystem::path(dir) / name).string();
  file_.open(path_, std::ios::out | std::ios::trunc);
  if (!file_) {
    throw ConfigError(strCat("trace_dir: cannot write ", path_, ec ? strCat(" (", ec.message(), ")") : std::string(),
                             "; give a folder this rank can write, or leave trace_dir empty"));
  }
  // The wall clock read between two steady readings, their midpoint its
  // steady time: a rank descheduled between the reads is off by half the gap.
  const auto before = Clock::now();
  wallOriginMicros_ = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  steadyOrigin_ = before + (Clock::now() - before) / 2;
  const std::string label = strCat("rank ", who_.rank, ": stage ", who_.stage, ", replica ", who_.replica,
                                   who_.generation > 0 ? strCat(", generation ", who_.generation) : std::string());
  file_ << "[\n";
  write(nlohmann::json{{"name", "process_name"}, {"ph", "M"}, {"pid", pid()}, {"args", {{"name", label}}}}.dump());
  write(nlohmann::json{{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid()},
                       {"args", {{"sort_index", pid()}}}}
            .dump());
  file_.flush();
}

const char* StepTimeline::taskLetters(TaskType type) {
  switch (type) {
    case TaskType::kForward: return "F";
    case TaskType::kRecompute: return "R";
    case TaskType::kBackward: return "B";
    case TaskType::kBackwardInput: return "BI";
    case TaskType::kBackwardWeight: return "W";
  }
  return "?";
}

int64_t StepTimeline::micros(Clock::time_point t) const {
  return wallOriginMicros_ + std::chrono::duration_cast<std::chrono::microseconds>(t - steadyOrigin_).count();
}

void StepTimeline::write(const std::string& event) { file_ << event << ",\n"; }

void StepTimeline::beginStep(int64_t step, Clock::time_point start) {
  if (!enabled()) return;
  step_ = step;
  stepStart_ = start;
  events_.clear();
}

void StepTimeline::task(const Task& t, Clock::time_point start, Clock::time_point end) {
  if (!enabled()) return;
  const char* letters = taskLetters(t.type);
  auto e = event(strCat(letters, t.chunk, " mb", t.microbatch), "task", pid(), micros(start),
                 micros(end) - micros(start));
  e["args"] = {{"step", step_},
               {"type", letters},
               {"chunk", t.chunk},
               {"virtual_stage", who_.layout.virtualStage(who_.stage, t.chunk)},
               {"virtual_stages", who_.layout.virtualStages()},
               {"microbatch", t.microbatch},
               {"stage", who_.stage},
               {"replica", who_.replica},
               {"generation", who_.generation}};
  events_.push_back(e.dump());
}

void StepTimeline::span(const char* category, const char* name, Clock::time_point start, Clock::time_point end) {
  if (!enabled()) return;
  auto e = event(name, category, pid(), micros(start), micros(end) - micros(start));
  e["args"] = {{"step", step_}};
  events_.push_back(e.dump());
}

void StepTimeline::endStep(Clock::time_point end) {
  if (!enabled()) return;
  // The step's own span last: a step whose span is in the file is complete
  // (a rank dying meanwhile leaves its events without it). Viewers nest by
  // time, not by order.
  for (const auto& ev : events_) write(ev);
  auto e = event(strCat("step ", step_), "step", pid(), micros(stepStart_), micros(end) - micros(stepStart_));
  e["args"] = {{"step", step_}, {"rank", who_.rank}, {"stage", who_.stage}, {"replica", who_.replica},
               {"generation", who_.generation}};
  write(e.dump());
  events_.clear();
  file_.flush();
}

}  // namespace varuna
