#include "varuna/manager/autoconfig.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <map>
#include <sstream>
#include <tuple>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

std::string sizesText(const std::vector<int64_t>& sizes) {
  std::string out;
  for (int64_t s : sizes) out += (out.empty() ? "" : ", ") + std::to_string(s);
  return out.empty() ? "none" : out;
}

// Step times compared at nanosecond resolution, so that float noise between
// equivalent plans is a tie and the tie-breaks decide (a strict weak order).
int64_t stepNanos(const Candidate& c) { return std::llround(c.simulation.stepSeconds * 1e9); }

class Ranking {
 public:
  explicit Ranking(const std::vector<ScheduleKind>& schedules) : schedules_(schedules) {}

  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.feasible != b.feasible) return a.feasible;
    if (a.feasible) {
      if (stepNanos(a) != stepNanos(b)) return stepNanos(a) < stepNanos(b);
    } else if (a.simulation.maxStageMemoryBytes() != b.simulation.maxStageMemoryBytes()) {
      return a.simulation.maxStageMemoryBytes() < b.simulation.maxStageMemoryBytes();
    }
    return key(a) < key(b);
  }

 private:
  std::tuple<int, int, int64_t, size_t> key(const Candidate& c) const {
    const size_t order = std::find(schedules_.begin(), schedules_.end(), c.schedule) - schedules_.begin();
    return {c.plan.worldSize(), c.plan.stages, -c.plan.chunkSize, order};
  }
  std::vector<ScheduleKind> schedules_;
};

std::string seconds(double s) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(s < 0.01 ? 5 : s < 10 ? 3 : 1) << s << " s";
  return out.str();
}

std::string number(double v, int precision) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(precision) << v;
  return out.str();
}

}  // namespace

std::string Candidate::shortName() const {
  return strCat(plan.stages, "x", plan.replicas, " m=", plan.chunkSize, " ", toString(schedule));
}

AutoConfigResult autoConfigure(const profile::Profile& profile, const AutoConfigRequest& request) {
  if (profile.pieces.empty()) throw ConfigError("the profile has no pieces: profile the model first");
  if (request.globalBatch < 1) throw ConfigError(strCat("--batch_size must be >= 1, got ", request.globalBatch));
  if (request.schedules.empty()) throw ConfigError("AutoConfig needs at least one schedule to consider");
  std::vector<ScheduleKind> kinds;  // as listed, each once
  for (ScheduleKind kind : request.schedules) {
    if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) kinds.push_back(kind);
  }
  const int pieces = static_cast<int>(profile.pieces.size());
  AutoConfigResult result;
  for (const auto& m : request.machines) {
    if (!request.excludedHosts.count(m.host)) result.slots += m.slots;
  }
  const int slots = result.slots;
  if (slots < 1) {
    throw ConfigError(strCat("no worker slots to plan on: ", request.machines.size(), " machine(s), ",
                             request.excludedHosts.size(), " excluded; add machines to the machine list"));
  }

  // Micro-batch sizes: pinned, asked for, or every profiled one.
  const auto profiled = profile.microBatchSizes();
  std::vector<int64_t> sizes = request.fixedChunk > 0 ? std::vector<int64_t>{request.fixedChunk}
                               : request.microBatchSizes.empty() ? profiled
                                                                 : request.microBatchSizes;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (int64_t m : sizes) {
    if (std::find(profiled.begin(), profiled.end(), m) == profiled.end()) {
      throw ConfigError(strCat("micro-batch size ", m, " was not profiled (profiled for every piece: ",
                               sizesText(profiled), "); profile it, or let AutoConfig choose among those"));
    }
  }
  if (sizes.empty()) throw ConfigError("the profile has no micro-batch size measured for every piece: profile again");

  // Stages.
  int minP = 1, maxP = std::min(pieces, slots);
  if (request.fixedStages > 0) {
    if (request.fixedStages > pieces) {
      throw ConfigError(strCat("--nstages ", request.fixedStages, " exceeds the model's ", pieces,
                               " pieces: add CutPoints or use fewer stages"));
    }
    if (request.fixedStages > slots) {
      throw ConfigError(strCat("--nstages ", request.fixedStages, " needs ", request.fixedStages,
                               " worker slots, ", slots, " are available: add machines or use fewer stages"));
    }
    minP = maxP = request.fixedStages;
  }

  std::map<std::tuple<ScheduleKind, int, int>, Schedule> schedules;  // (kind, P, micro-batches)
  std::map<std::pair<int64_t, ScheduleKind>, std::vector<double>> costs;
  for (int P = minP; P <= maxP; ++P) {
    for (int D = 1; P * D <= slots; ++D) {
      if (request.globalBatch % D != 0) continue;
      const int64_t perReplica = request.globalBatch / D;
      for (int64_t m : sizes) {
        if (m > perReplica) continue;
        const int M = static_cast<int>((perReplica + m - 1) / m);
        for (ScheduleKind kind : kinds) {
          PlanRequest planRequest;
          planRequest.machines = request.machines;
          planRequest.stages = P;
          planRequest.globalBatch = request.globalBatch;
          planRequest.chunkSize = m;
          planRequest.excludedHosts = request.excludedHosts;
          planRequest.replicas = D;
          Candidate c;
          c.plan = makePlan(planRequest);
          c.schedule = kind;
          c.plan.schedule = kind;
          auto cost = costs.find({m, kind});
          if (cost == costs.end()) cost = costs.emplace(std::pair{m, kind}, pieceCosts(profile, m, kind)).first;
          c.plan.pieceCosts = cost->second;

          SimulationInput input;
          input.stages = P;
          input.replicas = D;
          input.microBatch = m;
          input.globalBatch = request.globalBatch;
          input.schedule = kind;
          input.bucketBytes = request.bucketBytes;
          input.firstPiece = partitionPieces(c.plan.pieceCosts, P).firstPiece;  // what the workers will compute
          for (const auto& p : c.plan.placement) input.hostOfRank.push_back(p.host);
          auto schedule = schedules.find({kind, P, M});
          if (schedule == schedules.end()) {
            schedule = schedules.emplace(std::tuple{kind, P, M}, generateSchedule(kind, P, M)).first;
          }
          c.simulation = simulate(profile, input, &schedule->second);
          c.samplesPerSecond = static_cast<double>(request.globalBatch) / c.simulation.stepSeconds;
          c.feasible = true;
          if (request.memoryPerDeviceBytes > 0) {
            const auto& memory = c.simulation.stageMemoryBytes;
            const auto fullest = std::max_element(memory.begin(), memory.end()) - memory.begin();
            if (memory[fullest] > request.memoryPerDeviceBytes) {
              c.feasible = false;
              c.infeasibleBecause = strCat("stage ", fullest, " needs ", formatBytes(memory[fullest]),
                                           ", devices have ", formatBytes(request.memoryPerDeviceBytes));
            }
          }
          result.ranked.push_back(std::move(c));
        }
      }
    }
  }
  std::stable_sort(result.ranked.begin(), result.ranked.end(), Ranking(kinds));

  if (result.ranked.empty()) {
    // Only the batch can leave nothing to simulate: every size is too large for every replica count.
    throw ConfigError(strCat("no plan: the smallest micro-batch size considered (", sizes.front(),
                             ") exceeds the per-replica batch of every replica count that fits (global batch ",
                             request.globalBatch, ", ", slots, " slots); profile smaller micro-batch sizes or raise "
                             "--batch_size"));
  }
  if (!result.ranked.front().feasible) {
    const Candidate& closest = result.ranked.front();
    throw ConfigError(strCat("no plan fits in ", formatBytes(request.memoryPerDeviceBytes), " per device: all ",
                             result.ranked.size(), " plans considered (", slots, " slots, P ", minP, "..", maxP,
                             ", micro-batch ", sizesText(sizes), ") need more; the smallest is ",
                             closest.shortName(), " (", closest.infeasibleBecause,
                             "); add machines, profile smaller micro-batch sizes or give the devices more memory"));
  }
  result.best = result.ranked.front();
  return result;
}

std::string AutoConfigResult::explain() const {
  const Simulation& s = best.simulation;
  const Plan& p = best.plan;
  std::ostringstream out;
  out << "AutoConfig chose " << p.stages << " stage(s) x " << p.replicas << " replica(s), micro-batch size "
      << p.chunkSize << " (" << s.microbatches << " micro-batch(es) per replica of " << p.perReplicaBatch << " samples), "
      << toString(best.schedule) << " schedule, on " << p.worldSize() << " of " << slots
      << " slots: predicted " << seconds(s.stepSeconds) << " per step, " << number(best.samplesPerSecond, 1)
      << " samples/s (pipeline " << seconds(s.pipelineSeconds) << " with a " << number(100 * s.bubbleFraction, 1)
      << "% bubble, exposed all-reduce " << seconds(s.allreduceSeconds) << ", optimizer "
      << seconds(s.optimizerSeconds) << "; the fullest stage needs " << formatBytes(s.maxStageMemoryBytes()) << ").";
  int feasible = 0;
  for (const auto& c : ranked) feasible += c.feasible;
  const Candidate* next = nullptr;
  for (size_t i = 1; i < ranked.size() && !next; ++i) {
    if (ranked[i].feasible) next = &ranked[i];
  }
  if (next) {
    const double gain = next->samplesPerSecond > 0 ? best.samplesPerSecond / next->samplesPerSecond - 1.0 : 0.0;
    out << " The next best, " << next->shortName() << " (" << number(next->samplesPerSecond, 1) << " samples/s), is "
        << number(100 * gain, 1) << "% slower";
    if (gain <= 0) out << " (a tie, broken by fewer workers, then fewer stages, then the larger micro-batch)";
    out << ".";
  }
  out << " " << ranked.size() << " plan(s) considered, " << feasible << " fit in memory";
  if (feasible < static_cast<int>(ranked.size())) out << ", " << ranked.size() - feasible << " do not";
  out << ".";
  if (p.unusedSlots > 0) {
    out << " " << p.unusedSlots << " slot(s) stay idle: no faster plan uses them with this global batch.";
  }
  return out.str();
}

std::string AutoConfigResult::table(int maxRows) const {
  std::ostringstream out;
  out << std::left << std::setw(4) << "#" << std::setw(8) << "stages" << std::setw(10) << "replicas"
      << std::setw(7) << "micro" << std::setw(8) << "sched" << std::right << std::setw(11) << "step (s)"
      << std::setw(11) << "samples/s" << std::setw(8) << "bubble" << std::setw(13) << "max memory" << "  note\n";
  const int rows = std::min<int>(maxRows, static_cast<int>(ranked.size()));
  for (int i = 0; i < rows; ++i) {
    const Candidate& c = ranked[i];
    out << std::left << std::setw(4) << i + 1 << std::setw(8) << c.plan.stages << std::setw(10) << c.plan.replicas
        << std::setw(7) << c.plan.chunkSize << std::setw(8) << toString(c.schedule) << std::right << std::setw(11)
        << number(c.simulation.stepSeconds, 4) << std::setw(11) << number(c.samplesPerSecond, 1) << std::setw(8)
        << (number(100 * c.simulation.bubbleFraction, 1) + "%") << std::setw(13)
        << formatBytes(c.simulation.maxStageMemoryBytes()) << "  "
        << (c.feasible ? (i == 0 ? "chosen" : "") : "does not fit: " + c.infeasibleBecause) << "\n";
  }
  if (rows < static_cast<int>(ranked.size())) {
    int infeasible = 0;
    for (size_t i = rows; i < ranked.size(); ++i) infeasible += !ranked[i].feasible;
    out << "... " << ranked.size() - rows << " more";
    if (infeasible > 0) out << " (" << infeasible << " do not fit in memory)";
    out << "\n";
  }
  return out.str();
}

std::function<Plan(const PlanRequest&)> autoConfigPlanner(profile::Profile profile, AutoConfigRequest settings,
                                                          std::function<void(const AutoConfigResult&)> onChoice) {
  return [profile = std::move(profile), settings = std::move(settings),
          onChoice = std::move(onChoice)](const PlanRequest& request) {
    AutoConfigRequest ask = settings;
    ask.machines = request.machines;
    ask.excludedHosts = request.excludedHosts;
    ask.globalBatch = request.globalBatch;
    if (request.stages > 0) ask.fixedStages = request.stages;
    if (request.chunkSize > 0) ask.fixedChunk = request.chunkSize;
    const AutoConfigResult result = autoConfigure(profile, ask);
    if (onChoice) onChoice(result);
    return result.best.plan;
  };
}

}  // namespace varuna
