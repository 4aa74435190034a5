#include "varuna/common/simulator.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

// The job-wide exchange of a step: loss, squared gradient norm, checkpoint flag (doubles).
constexpr int64_t kStepStatsBytes = 3 * 8;

std::string sizesText(const std::vector<int64_t>& sizes) {
  std::string out;
  for (int64_t s : sizes) out += (out.empty() ? "" : ", ") + std::to_string(s);
  return out.empty() ? "none" : out;
}

void requireSize(const profile::Profile& profile, int64_t microBatch) {
  if (profile.pieces.empty()) throw ConfigError("the profile has no pieces: profile the model first");
  const auto sizes = profile.microBatchSizes();
  if (std::find(sizes.begin(), sizes.end(), microBatch) == sizes.end()) {
    throw ConfigError(strCat("the profile has no figures for micro-batch size ", microBatch, " (profiled for every piece: ",
                             sizesText(sizes), "); profile that size or choose one of those"));
  }
}

// One piece's figures at micro-batch size b: the profiled ones when b was
// profiled, else linear between the neighbouring profiled sizes (proportional
// below the smallest). Used for the smaller last micro-batch only.
struct Figures {
  double forward = 0, backward = 0, recompute = 0;
  int64_t outputBytes = 0, savedBytes = 0, peakBytes = 0;
  double backwardInput = 0, backwardWeight = 0;  // a split backward's halves
  int64_t splitKeptBytes = 0;                    // held from B to W
};

Figures figuresAt(const profile::PieceProfile& piece, int64_t b) {
  auto exact = piece.bySize.find(b);
  auto from = [](const profile::PieceAtSize& s) {
    // Without a measured split, half each: the usual figure for a stage of matrix products.
    const bool measured = s.backwardInput.samples > 0 && s.backwardWeight.samples > 0;
    return Figures{s.forward.median,
                   s.backward.median,
                   s.recompute.median,
                   s.outputBytes,
                   s.savedActivationBytes,
                   s.peakBytes,
                   measured ? s.backwardInput.median : s.backward.median / 2,
                   measured ? s.backwardWeight.median : s.backward.median / 2,
                   s.splitKeptBytes};
  };
  if (exact != piece.bySize.end()) return from(exact->second);
  VARUNA_CHECK(!piece.bySize.empty(), "piece ", piece.name, " has no profiled sizes");
  auto hi = piece.bySize.lower_bound(b);
  auto scaled = [](const Figures& a, const Figures& c, double w) {  // a + w (c - a)
    auto mix = [w](double x, double y) { return x + w * (y - x); };
    auto mixBytes = [w](int64_t x, int64_t y) {
      return static_cast<int64_t>(std::llround(static_cast<double>(x) + w * static_cast<double>(y - x)));
    };
    return Figures{mix(a.forward, c.forward),         mix(a.backward, c.backward),
                   mix(a.recompute, c.recompute),     mixBytes(a.outputBytes, c.outputBytes),
                   mixBytes(a.savedBytes, c.savedBytes), mixBytes(a.peakBytes, c.peakBytes),
                   mix(a.backwardInput, c.backwardInput), mix(a.backwardWeight, c.backwardWeight),
                   mixBytes(a.splitKeptBytes, c.splitKeptBytes)};
  };
  if (hi == piece.bySize.begin()) {  // below the smallest profiled size: proportional
    const Figures zero{};
    return scaled(zero, from(hi->second), static_cast<double>(b) / static_cast<double>(hi->first));
  }
  auto lo = std::prev(hi);
  if (hi == piece.bySize.end()) {  // above the largest: proportional to it
    const Figures zero{};
    return scaled(zero, from(lo->second), static_cast<double>(b) / static_cast<double>(lo->first));
  }
  const double w = static_cast<double>(b - lo->first) / static_cast<double>(hi->first - lo->first);
  return scaled(from(lo->second), from(hi->second), w);
}

// A stage's figures at one micro-batch size.
struct StageFigures {
  double forward = 0, backward = 0, recompute = 0;
  double backwardInput = 0, backwardWeight = 0;  // a split backward's halves
  int64_t inBytes = 0;   // the activation arriving from the previous stage (0 on stage 0)
  int64_t outBytes = 0;  // the activation leaving for the next stage (0 on the last)
  int64_t savedBytes = 0;
  int64_t splitKeptBytes = 0;  // what B keeps for W, held from B to W
  int64_t transientBytes = 0;  // CUDA peak above the saved activations, the largest piece's
  std::vector<double> pieceBackward;  // by piece, in piece order
  std::vector<double> pieceWeight;    // by piece, the weight-gradient half
};

double taskSeconds(const StageFigures& f, TaskType type) {
  switch (type) {
    case TaskType::kForward: return f.forward;
    case TaskType::kRecompute: return f.recompute;
    case TaskType::kBackward: return f.backward;
    case TaskType::kBackwardInput: return f.backwardInput;
    case TaskType::kBackwardWeight: return f.backwardWeight;
  }
  return 0.0;
}

// The task after which a stage's gradients are final.
bool finalisesGradients(TaskType type) { return type == TaskType::kBackward || type == TaskType::kBackwardWeight; }

std::vector<StageFigures> stageFigures(const profile::Profile& profile, const std::vector<int>& firstPiece, int64_t b) {
  const int P = static_cast<int>(firstPiece.size()) - 1;
  std::vector<StageFigures> out(P);
  for (int s = 0; s < P; ++s) {
    StageFigures& f = out[s];
    for (int k = firstPiece[s]; k < firstPiece[s + 1]; ++k) {
      const Figures piece = figuresAt(profile.pieces[k], b);
      f.forward += piece.forward;
      f.backward += piece.backward;
      f.recompute += piece.recompute;
      f.savedBytes += piece.savedBytes;
      f.splitKeptBytes += piece.splitKeptBytes;
      f.transientBytes = std::max(f.transientBytes, piece.peakBytes - piece.savedBytes);
      f.pieceBackward.push_back(piece.backward);
      f.backwardInput += piece.backwardInput;
      f.backwardWeight += piece.backwardWeight;
      f.pieceWeight.push_back(piece.backwardWeight);
      if (k == firstPiece[s + 1] - 1 && s + 1 < P) f.outBytes = piece.outputBytes;
    }
    if (s > 0) f.inBytes = out[s - 1].outBytes;
  }
  return out;
}

void checkPartition(const std::vector<int>& firstPiece, int P, int n) {
  bool ok = static_cast<int>(firstPiece.size()) == P + 1 && firstPiece.front() == 0 && firstPiece.back() == n;
  for (size_t s = 0; ok && s + 1 < firstPiece.size(); ++s) ok = firstPiece[s] < firstPiece[s + 1];
  if (!ok) {
    std::string text;
    for (int v : firstPiece) text += (text.empty() ? "" : ",") + std::to_string(v);
    throw ConfigError(strCat("partition [", text, "] is not a split of ", n, " pieces into ", P,
                             " stages: it needs ", P + 1, " increasing entries from 0 to ", n));
  }
}

// What one replica's replay yields for each stage.
struct StageTimes {
  double lastTaskEnd = 0;
  double lastSendArrival = 0;          // its last outgoing message has arrived
  std::vector<double> pieceFinal;      // by global piece (the stage's own): its gradients are final
};

}  // namespace

std::vector<double> pieceCosts(const profile::Profile& profile, int64_t microBatch, ScheduleKind schedule) {
  requireSize(profile, microBatch);
  std::vector<double> costs;
  for (const auto& piece : profile.pieces) {
    const auto& s = piece.bySize.at(microBatch);
    double cost = s.forward.median + s.backward.median;
    if (schedule == ScheduleKind::kVaruna) cost += s.recompute.median;
    costs.push_back(cost);
  }
  return costs;
}

namespace {

ChunkLayout layoutOf(const SimulationInput& in) {
  const int chunks = in.chunks > 0 ? in.chunks : defaultChunks(in.schedule);
  checkChunks(in.schedule, chunks);
  return ChunkLayout::of(in.schedule, in.stages, chunks);
}

// Throws ConfigError for an input no plan could have; returns the per-replica batch.
int64_t validate(const profile::Profile& profile, const SimulationInput& in) {
  const int P = in.stages, D = in.replicas;
  const int n = static_cast<int>(profile.pieces.size());
  if (P < 1) throw ConfigError(strCat("number of stages must be >= 1, got ", P));
  if (D < 1) throw ConfigError(strCat("number of replicas must be >= 1, got ", D));
  if (in.globalBatch < 1) throw ConfigError(strCat("global batch size must be >= 1, got ", in.globalBatch));
  if (in.microBatch < 1) throw ConfigError(strCat("micro-batch size must be >= 1, got ", in.microBatch));
  requireSize(profile, in.microBatch);
  const ChunkLayout layout = layoutOf(in);
  if (layout.virtualStages() > n) {
    throw ConfigError(strCat("cannot simulate ", P, " stages", layout.chunks > 1 ? strCat(" x ", layout.chunks, " chunks") : "",
                             ": the profiled model has ", n, " pieces (add CutPoints or use at most ", n,
                             " stages x chunks)"));
  }
  if (in.globalBatch % D != 0) {
    throw ConfigError(strCat("global batch ", in.globalBatch, " does not split evenly into ", D, " replicas"));
  }
  const int64_t perReplica = in.globalBatch / D;
  if (in.microBatch > perReplica) {
    throw ConfigError(strCat("micro-batch ", in.microBatch, " exceeds the per-replica batch ", perReplica,
                             " (global ", in.globalBatch, " / ", D, " replicas)"));
  }
  if (!in.hostOfRank.empty() && static_cast<int>(in.hostOfRank.size()) != P * D) {
    throw ConfigError(strCat("placement names ", in.hostOfRank.size(), " ranks; ", P, " stages x ", D,
                             " replicas need ", P * D));
  }
  if (in.bucketBytes < 1) throw ConfigError(strCat("gradient bucket size must be >= 1 byte, got ", in.bucketBytes));
  return perReplica;
}

// The partition: given, or the one the runtime computes from pieceCosts().
Partition resolvePartition(const profile::Profile& profile, const SimulationInput& in) {
  const auto costs = pieceCosts(profile, in.microBatch, in.schedule);
  const int V = layoutOf(in).virtualStages();
  if (in.firstPiece.empty()) return partitionPieces(costs, V);
  checkPartition(in.firstPiece, V, static_cast<int>(profile.pieces.size()));
  Partition partition;
  partition.firstPiece = in.firstPiece;
  for (int s = 0; s < V; ++s) {
    double c = 0;
    for (int k = in.firstPiece[s]; k < in.firstPiece[s + 1]; ++k) c += costs[k];
    partition.stageCost.push_back(c);
  }
  return partition;
}

// The job-wide exchange closing every step (a barrier), and the slowest stage's optimizer.
double stepStatsSeconds(const profile::Profile& profile, const SimulationInput& in) {
  if (in.stages * in.replicas <= 1) return 0.0;
  const std::set<std::string> hosts(in.hostOfRank.begin(), in.hostOfRank.end());
  return profile.allreduceSeconds(kStepStatsBytes, in.stages * in.replicas, hosts.size() > 1);
}

// The global pieces of stage s, in local order (its chunks in turn).
std::vector<int> piecesOfStage(const ChunkLayout& layout, const std::vector<int>& first, int s) {
  std::vector<int> pieces;
  for (int c = 0; c < layout.chunks; ++c) {
    const int vs = layout.virtualStage(s, c);
    for (int k = first[vs]; k < first[vs + 1]; ++k) pieces.push_back(k);
  }
  return pieces;
}

double optimizerSeconds(const profile::Profile& profile, const ChunkLayout& layout, const std::vector<int>& first) {
  double slowest = 0;
  for (int s = 0; s < layout.stages; ++s) {
    int64_t params = 0;
    for (int k : piecesOfStage(layout, first, s)) params += profile.pieces[k].paramCount;
    slowest = std::max(slowest, profile.optimizerSecondsPerParam * static_cast<double>(params));
  }
  return slowest;
}

}  // namespace

double stepLowerBound(const profile::Profile& profile, const SimulationInput& in) {
  const int64_t perReplica = validate(profile, in);
  const Partition partition = resolvePartition(profile, in);
  const int M = static_cast<int>((perReplica + in.microBatch - 1) / in.microBatch);
  const int64_t lastSize = perReplica - static_cast<int64_t>(M - 1) * in.microBatch;
  const auto full = stageFigures(profile, partition.firstPiece, in.microBatch);
  const auto tail = lastSize == in.microBatch ? full : stageFigures(profile, partition.firstPiece, lastSize);
  const ChunkLayout layout = layoutOf(in);
  // Every stage runs each micro-batch's forward and backward (of each of its
  // chunks) one after the other (recomputes come on top for some schedules:
  // left out, a bound).
  double busiest = 0;
  for (int s = 0; s < in.stages; ++s) {
    // A split backward may measure below the whole one: the smaller of the two.
    auto backward = [&](const StageFigures& f) {
      return splitsBackward(in.schedule) ? std::min(f.backward, f.backwardInput + f.backwardWeight) : f.backward;
    };
    double busy = 0;
    for (int c = 0; c < layout.chunks; ++c) {
      const int vs = layout.virtualStage(s, c);
      busy += (M - 1) * (full[vs].forward + backward(full[vs])) + tail[vs].forward + backward(tail[vs]);
    }
    busiest = std::max(busiest, busy);
  }
  return busiest + stepStatsSeconds(profile, in) + optimizerSeconds(profile, layout, partition.firstPiece);
}

namespace {

// The figures of every virtual stage at a full and at the last micro-batch.
struct MicrobatchFigures {
  int M = 0;
  std::vector<StageFigures> full, tail;
  const std::vector<StageFigures>& at(int microbatch) const { return microbatch == M - 1 ? tail : full; }
};

// Where the gradients of each piece of stage s become final: when its part of
// the stage's last backward (or W) of that piece's chunk ends.
void recordPieceFinal(const Schedule& schedule, const ScheduleTiming& timing, const ChunkLayout& layout,
                      const std::vector<int>& first, const MicrobatchFigures& figures, int s, StageTimes& w) {
  const auto& tasks = schedule[s];
  std::vector<int> finalBackward(layout.chunks, -1);
  for (size_t k = 0; k < tasks.size(); ++k) {
    if (finalisesGradients(tasks[k].type)) finalBackward[tasks[k].chunk] = static_cast<int>(k);
  }
  for (int c = 0; c < layout.chunks; ++c) {
    const Task& lastBackward = tasks[finalBackward[c]];
    const int vs = layout.virtualStage(s, c);
    const StageFigures& f = figures.at(lastBackward.microbatch)[vs];
    const auto& pieceBackward = lastBackward.type == TaskType::kBackwardWeight ? f.pieceWeight : f.pieceBackward;
    double t = timing.start[s][finalBackward[c]];
    for (int j = static_cast<int>(pieceBackward.size()) - 1; j >= 0; --j) {
      t += pieceBackward[j];
      w.pieceFinal[first[vs] + j] = std::max(w.pieceFinal[first[vs] + j], t);
    }
  }
}

// Stage s's data-parallel all-reduce of its gradient buckets, in bucket
// order on its group, each starting once its pieces are final everywhere.
// Returns when the last one ends.
double allReduceEnd(const profile::Profile& profile, const SimulationInput& in, const std::vector<int>& pieces,
                    const StageTimes& w, bool crossHost) {
  double channelFree = 0, pending = 0;
  int64_t filled = 0;
  std::map<int64_t, double> seconds;  // by bucket size: nearly all buckets are full ones
  auto launch = [&](int64_t bytes, double ready) {
    const double start = std::max(ready, channelFree);
    auto known = seconds.find(bytes);
    if (known == seconds.end()) {
      known = seconds.emplace(bytes, profile.allreduceSeconds(bytes, in.replicas, crossHost)).first;
    }
    channelFree = start + known->second;
  };
  // Buckets fill with the pieces' gradients last piece first (GradBuckets::add).
  for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
    int64_t bytes = profile.pieces[*it].paramCount * profile.gradientBytesPerParam;
    const double ready = w.pieceFinal[*it];
    while (bytes > 0) {
      const int64_t take = std::min(bytes, in.bucketBytes - filled);
      filled += take;
      bytes -= take;
      pending = ready;
      if (filled == in.bucketBytes) {
        launch(filled, ready);
        filled = 0;
      }
    }
  }
  if (filled > 0) launch(filled, pending);
  return channelFree;
}

// Stage s's peak activation and boundary memory over the schedule, and the
// most micro-batches (chunk micro-batches under chunks) it keeps
// activations of at once. Live activations: from a forward that keeps them
// (or a recompute) to the end of that micro-batch's backward (its W when
// split). Boundary tensors: the runtime posts every activation receive at
// the start of the step, allocates the gradient receive and holds the sent
// activation at each forward, holds the sent gradient at each backward, and
// frees all of them only when the step's sends are done. A tensor handed
// between two chunks of the stage is held once.
std::pair<int64_t, int> activationPeak(const Schedule& schedule, const ChunkLayout& layout,
                                       const MicrobatchFigures& figures, int s) {
  const int V = layout.virtualStages();
  auto remote = [&](int from, int to) { return layout.stageOf(from) != layout.stageOf(to); };
  int64_t boundary = 0, live = 0, peak = 0;
  int liveCount = 0, peakCount = 0;
  for (int c = 0; c < layout.chunks; ++c) {
    const int vs = layout.virtualStage(s, c);
    if (vs == 0 || !remote(vs - 1, vs)) continue;
    for (int i = 0; i < figures.M; ++i) boundary += figures.at(i)[vs].inBytes;
  }
  for (const Task& t : schedule[s]) {
    const int vs = layout.virtualStage(s, t.chunk);
    const StageFigures& f = figures.at(t.microbatch)[vs];
    switch (t.type) {
      case TaskType::kForward:
        if (t.keepActivations) {
          live += f.savedBytes;
          ++liveCount;
        }
        if (vs + 1 < V) boundary += (remote(vs, vs + 1) ? 2 : 1) * f.outBytes;
        peak = std::max(peak, boundary + live);
        break;
      case TaskType::kRecompute:
        live += f.savedBytes;
        ++liveCount;
        peak = std::max(peak, boundary + live);
        break;
      case TaskType::kBackward:
      case TaskType::kBackwardInput:
        boundary += f.inBytes;
        if (t.type == TaskType::kBackwardInput) {  // held until the W, with what W needs
          live += f.splitKeptBytes;
          peak = std::max(peak, boundary + live);
          break;
        }
        peak = std::max(peak, boundary + live);
        live -= f.savedBytes;
        --liveCount;
        break;
      case TaskType::kBackwardWeight:
        live -= f.savedBytes + f.splitKeptBytes;
        --liveCount;
        break;
    }
    peakCount = std::max(peakCount, liveCount);
  }
  return {peak, peakCount};
}

}  // namespace

Simulation simulate(const profile::Profile& profile, const SimulationInput& in, const Schedule* givenSchedule) {
  const int P = in.stages, D = in.replicas;
  const int64_t perReplica = validate(profile, in);
  Simulation sim;
  sim.layout = layoutOf(in);
  const ChunkLayout& layout = sim.layout;
  const int V = layout.virtualStages();
  sim.partition = resolvePartition(profile, in);
  const std::vector<int>& first = sim.partition.firstPiece;

  // Micro-batches as the runtime splits the replica's batch: all of size m but
  // possibly a smaller last one.
  const int M = static_cast<int>((perReplica + in.microBatch - 1) / in.microBatch);
  sim.microbatches = M;
  const int64_t lastSize = perReplica - static_cast<int64_t>(M - 1) * in.microBatch;
  MicrobatchFigures figures;
  figures.M = M;
  figures.full = stageFigures(profile, first, in.microBatch);
  figures.tail = lastSize == in.microBatch ? figures.full : stageFigures(profile, first, lastSize);

  Schedule generated;
  if (!givenSchedule) generated = generateSchedule(in.schedule, P, M, layout.chunks);
  const Schedule& schedule = givenSchedule ? *givenSchedule : generated;
  VARUNA_CHECK(static_cast<int>(schedule.size()) == P, "schedule for ", schedule.size(), " stages, plan has ", P);
  // The last stage never recomputes: F and a whole backward, or F, B and W, per chunk.
  const bool split = std::any_of(schedule.back().begin(), schedule.back().end(),
                                 [](const Task& t) { return t.type == TaskType::kBackwardWeight; });
  const int tasksPerMicrobatch = (split ? 3 : 2) * layout.chunks;
  VARUNA_CHECK(static_cast<int>(schedule.back().size()) == tasksPerMicrobatch * M, "schedule of the last stage has ",
               schedule.back().size(), " tasks, ", M, " micro-batches need ", tasksPerMicrobatch * M);

  auto host = [&](int rank) -> const std::string& {
    static const std::string kOneHost;
    return in.hostOfRank.empty() ? kOneHost : in.hostOfRank[rank];
  };
  auto rankOf = [&](int replica, int vs) { return replica * P + layout.stageOf(vs); };

  // Replicas differ only in which cuts cross hosts: replay each distinct pattern once.
  std::map<std::vector<bool>, int> patterns;  // which cuts stay on one host -> a replica with that pattern
  for (int r = 0; r < D; ++r) {
    std::vector<bool> sameHost(std::max(V - 1, 0));
    for (int b = 0; b + 1 < V; ++b) sameHost[b] = host(rankOf(r, b)) == host(rankOf(r, b + 1));
    patterns.emplace(sameHost, r);
  }
  const int n = static_cast<int>(profile.pieces.size());
  std::vector<StageTimes> worst(P);
  for (int s = 0; s < P; ++s) worst[s].pieceFinal.assign(n, 0.0);
  double worstMakespan = -1;
  ScheduleTiming worstTiming;
  for (const auto& [sameHost, replica] : patterns) {
    // Per cut, the message time of a full and of the last micro-batch.
    std::vector<double> fullTransfer(V), tailTransfer(V);
    for (int b = 0; b + 1 < V; ++b) {
      fullTransfer[b] = profile.p2pSeconds(figures.full[b].outBytes, sameHost[b]);
      tailTransfer[b] = profile.p2pSeconds(figures.tail[b].outBytes, sameHost[b]);
    }
    ReplayCosts costs;
    costs.taskSeconds = [&](int s, const Task& t) {
      return taskSeconds(figures.at(t.microbatch)[layout.virtualStage(s, t.chunk)], t.type);
    };
    costs.transferSeconds = [&](int from, int to, int i) {
      return (i == M - 1 ? tailTransfer : fullTransfer)[std::min(from, to)];
    };
    const ScheduleTiming timing = replaySchedule(schedule, costs, layout);
    for (int s = 0; s < P; ++s) {
      StageTimes& w = worst[s];
      const auto& tasks = schedule[s];
      w.lastTaskEnd = std::max(w.lastTaskEnd, timing.end[s].back());
      for (size_t k = 0; k < tasks.size(); ++k) {
        const Task& t = tasks[k];
        const int vs = layout.virtualStage(s, t.chunk);
        const bool sendsGradient = t.type == TaskType::kBackward || t.type == TaskType::kBackwardInput;
        int to = -1;
        if (t.type == TaskType::kForward && vs + 1 < V) to = vs + 1;
        if (sendsGradient && vs > 0) to = vs - 1;
        if (to >= 0 && layout.stageOf(to) != s) {
          w.lastSendArrival = std::max(w.lastSendArrival, timing.end[s][k] + costs.transferSeconds(vs, to, t.microbatch));
        }
      }
      recordPieceFinal(schedule, timing, layout, first, figures, s, w);
    }
    if (timing.makespan > worstMakespan) {
      worstMakespan = timing.makespan;
      worstTiming = timing;
    }
  }
  sim.pipelineSeconds = worstTiming.makespan;
  sim.stageComputeSeconds = worstTiming.busy;
  double busy = 0;
  for (double b : worstTiming.busy) busy += b;
  sim.bubbleFraction = sim.pipelineSeconds > 0 ? 1.0 - busy / (P * sim.pipelineSeconds) : 0.0;

  double barrier = 0;
  for (int s = 0; s < P; ++s) {
    const StageTimes& w = worst[s];
    const double computeDone = std::max(w.lastTaskEnd, w.lastSendArrival);
    double reduced = 0;
    if (D > 1) {
      bool crossHost = false;
      for (int r = 1; r < D; ++r) crossHost = crossHost || host(r * P + s) != host(s);
      reduced = allReduceEnd(profile, in, piecesOfStage(layout, first, s), w, crossHost);
    }
    sim.stageExposedAllreduceSeconds.push_back(std::max(0.0, reduced - computeDone));
    barrier = std::max(barrier, std::max(computeDone, reduced));
  }
  const double stepStats = stepStatsSeconds(profile, in);
  sim.allreduceSeconds = barrier - sim.pipelineSeconds + stepStats;

  // Optimizer, and memory.
  sim.optimizerSeconds = optimizerSeconds(profile, layout, first);
  for (int s = 0; s < P; ++s) {
    int64_t params = 0, paramBytes = 0, transient = 0;
    for (int k : piecesOfStage(layout, first, s)) {
      params += profile.pieces[k].paramCount;
      paramBytes += profile.pieces[k].paramBytes;
    }
    for (int c = 0; c < layout.chunks; ++c) {
      transient = std::max(transient, figures.full[layout.virtualStage(s, c)].transientBytes);
    }
    const auto [peak, peakCount] = activationPeak(schedule, layout, figures, s);
    const int64_t state = paramBytes + params * (profile.gradientBytesPerParam + profile.optimizerBytesPerParam);
    sim.stageMemoryBytes.push_back(state + peak + std::max<int64_t>(transient, 0));
    sim.stagePeakLiveMicrobatches.push_back(peakCount);
  }
  sim.stepSeconds = barrier + stepStats + sim.optimizerSeconds;
  return sim;
}

int64_t Simulation::maxStageMemoryBytes() const {
  return stageMemoryBytes.empty() ? 0 : *std::max_element(stageMemoryBytes.begin(), stageMemoryBytes.end());
}

std::string Simulation::describe() const {
  std::ostringstream out;
  out << std::fixed << std::setprecision(4) << "step " << stepSeconds << " s = pipeline " << pipelineSeconds
      << " + exposed all-reduce " << allreduceSeconds << " + optimizer " << optimizerSeconds << "; bubble "
      << std::setprecision(1) << 100.0 * bubbleFraction << "%; " << microbatches << " micro-batches per replica";
  for (int s = 0; s < static_cast<int>(stageComputeSeconds.size()); ++s) {
    out << "\n  stage " << s << ": pieces ";
    for (int c = 0; c < layout.chunks; ++c) {
      const int vs = layout.virtualStage(s, c);
      out << (c ? " and " : "") << partition.begin(vs) << "-" << partition.end(vs) - 1;
    }
    out << ", compute "
        << std::setprecision(4) << stageComputeSeconds[s] << " s, memory " << formatBytes(stageMemoryBytes[s])
        << " (" << stagePeakLiveMicrobatches[s] << " micro-batch(es) of activations live)";
    if (stageExposedAllreduceSeconds[s] > 0) out << ", all-reduce exposed " << stageExposedAllreduceSeconds[s] << " s";
  }
  return out.str();
}

std::string formatBytes(int64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::abs(value) >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  std::ostringstream out;
  if (unit == 0) {
    out << bytes << " B";
  } else {
    out << std::fixed << std::setprecision(value < 10 ? 2 : 1) << value << " " << kUnits[unit];
  }
  return out.str();
}

}  // namespace varuna
