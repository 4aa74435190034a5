// Module buffers (BatchNorm running statistics) are model state: under every
// layout and schedule they move exactly as in a plain single-process loop over
// the same micro-batches, data-parallel replicas hold identical ones (replica
// 0's, broadcast after every step), and checkpoints carry them across layouts.
//
// The model is the example GPT with --batchnorm: every block starts with a
// BatchNorm1d over (b * seq_len, d_model). In training mode it normalises with
// the micro-batch's own statistics, so losses and gradients depend only on how
// the batch is cut (chunk size 2 everywhere), never on P, D or the schedule;
// the running statistics depend on which micro-batches a replica sees, in
// which order, and on being updated once per micro-batch.

#include <algorithm>
#include <set>

#include "char_dataset.h"
#include "gpt_model.h"
#include "reference_trainer.h"
#include "test_env.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/common/partition.h"
#include "varuna/common/schedule.h"
#include "varuna/worker/tensor_file.h"
#include "worker_job.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;
using namespace varuna::test;
namespace fs = std::filesystem;

namespace {

constexpr double kRtol = 1e-5;  // fp32, different reduction orders
constexpr double kAtol = 1e-6;  // for values near zero
constexpr int64_t kGlobalBatch = 8;
constexpr int64_t kChunk = 2;
constexpr int64_t kSteps = 3;

using Tensors = std::map<std::string, torch::Tensor>;

gpt::GptConfig tinyGpt(int64_t vocab) {
  gpt::GptConfig c;
  c.vocabSize = vocab;
  c.dModel = 16;
  c.heads = 2;
  c.layers = 4;
  c.seqLen = 8;
  c.seed = 1234;
  c.batchNorm = true;
  return c;
}

ReferenceConfig referenceConfig(int64_t steps) {
  ReferenceConfig rc;
  rc.globalBatch = kGlobalBatch;
  rc.seqLen = 8;
  rc.steps = steps;
  rc.chunkSize = kChunk;
  return rc;
}

std::vector<std::string> trainArgs(const std::string& schedule, const ReferenceConfig& rc) {
  return {"--batchnorm", "--schedule", schedule, "--optimizer", "sgd", "--lr", std::to_string(rc.lr),
          "--momentum", std::to_string(rc.momentum), "--clip", std::to_string(rc.clip),
          "--steps", std::to_string(rc.steps), "--d_model", "16", "--heads", "2", "--layers", "4",
          "--seq_len", "8", "--model_seed", "1234", "--data_seed", std::to_string(rc.dataSeed),
          "--peer_timeout_s", "60"};
}

WorkerJobSpec layout(int stages, int replicas, std::vector<std::string> args) {
  WorkerJobSpec spec;
  spec.stages = stages;
  spec.replicas = replicas;
  spec.perReplicaBatch = kGlobalBatch / replicas;
  spec.chunkSize = kChunk;
  spec.trainArgs = std::move(args);
  return spec;
}

Tensors buffers(const WorkerJob& job, int rank) {
  return loadTensorFile((job.dir() / ("rank" + std::to_string(rank) + "_buffers.pt")).string());
}

// Every buffer of one replica (ranks replica * stages + s, the clustered map).
Tensors replicaBuffers(const WorkerJob& job, int stages, int replica) {
  Tensors all;
  for (int s = 0; s < stages; ++s) {
    for (auto& [name, t] : buffers(job, replica * stages + s)) {
      INFO("buffer " << name << " on two stages");
      CHECK(all.count(name) == 0);
      all[name] = t;
    }
  }
  return all;
}

Tensors replicaParams(const WorkerJob& job, int stages, int replica) {
  Tensors all;
  for (int s = 0; s < stages; ++s) {
    for (auto& [name, t] : job.params(replica * stages + s)) all[name] = t;
  }
  return all;
}

// Within kRtol relative (kAtol absolute near zero); integer counters exactly.
void checkClose(const Tensors& got, const Tensors& want, const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (const auto& [name, expected] : want) {
    INFO(what << " " << name);
    REQUIRE(got.count(name));
    const auto& actual = got.at(name);
    REQUIRE(actual.sizes() == expected.sizes());
    if (!expected.is_floating_point()) {
      CHECK(torch::equal(actual, expected));
      continue;
    }
    CHECK(((actual - expected).abs() - kRtol * expected.abs()).max().item<double>() <= kAtol);
  }
}

void checkEqual(const Tensors& got, const Tensors& want, const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (const auto& [name, expected] : want) {
    INFO(what << " " << name);
    REQUIRE(got.count(name));
    CHECK(torch::equal(got.at(name), expected));
  }
}

// The buffers every piece starts with (BatchNorm: mean 0, var 1, count 0).
Tensors initialBuffers(const ModelSpec& spec) {
  Tensors all;
  for (int i = 0; i < static_cast<int>(spec.pieces.size()); ++i) {
    for (const auto& b : buildPiece(spec, i)->named_buffers()) all[spec.pieces[i].name + "." + b.key()] = b.value().clone();
  }
  return all;
}

// The partition the runtime chooses (by parameter count, as Varuna::Impl does
// without piece costs) and the piece names, for the plan line it logs.
Partition runtimePartition(const ModelSpec& spec, int stages) {
  std::vector<double> costs;
  for (const auto& piece : spec.pieces) costs.push_back(static_cast<double>(piece.paramCount));
  return partitionPieces(costs, stages);
}

std::vector<std::string> pieceNames(const ModelSpec& spec) {
  std::vector<std::string> names;
  for (const auto& piece : spec.pieces) names.push_back(piece.name);
  return names;
}

}  // namespace

TEST_CASE("buffers move as in single-process training under every layout and schedule", "[integration][buffers]") {
  const auto data = gpt::CharDataset::fromPath("/usr/share/common-licenses");
  const auto spec = gpt::makeGptModel(tinyGpt(data.vocabSize()));
  const auto rc = referenceConfig(kSteps);
  const auto reference = trainReference(spec, data, rc);
  const auto initial = initialBuffers(spec);
  REQUIRE(reference.buffers.size() == initial.size());
  REQUIRE(reference.buffers.size() == 4 * 3);  // per block: running_mean, running_var, num_batches_tracked
  REQUIRE(reference.gradNorms.front() > rc.clip);  // the clip bites

  // The case that updated buffers twice before: at P = 4 the middle stages
  // hold BatchNorm blocks and, under Varuna's schedule, recompute their
  // forwards (the last stage never does). Checked on the very partition and
  // schedule the runtime uses (it logs the partition; see below).
  const auto p4 = runtimePartition(spec, 4);
  const auto varunaP4 = generateSchedule(ScheduleKind::kVaruna, 4, static_cast<int>(kGlobalBatch / kChunk));
  bool recomputesBatchNorm = false;
  for (int s = 0; s < 4; ++s) {
    const bool hasRecompute = std::any_of(varunaP4[s].begin(), varunaP4[s].end(),
                                          [](const Task& t) { return t.type == TaskType::kRecompute; });
    bool hasBlock = false;
    for (int piece = p4.begin(s); piece < p4.end(s); ++piece) {
      hasBlock = hasBlock || spec.pieces[piece].name.rfind("block", 0) == 0;
    }
    recomputesBatchNorm = recomputesBatchNorm || (hasRecompute && hasBlock);
  }
  REQUIRE(recomputesBatchNorm);

  struct Layout {
    int stages;
    int replicas;
    std::string schedule;
  };
  std::vector<Layout> layouts = {{1, 1, "varuna"}, {1, 2, "varuna"}};
  for (const std::string schedule : {"varuna", "1f1b", "gpipe", "zb-h1"}) {
    for (int stages : {2, 4}) {
      for (int replicas : {1, 2}) layouts.push_back({stages, replicas, schedule});
    }
  }
  // Two chunks per stage: 2 stages are 4 of the model's 6 pieces' virtual
  // stages (a BatchNorm block in each chunk; zbv's stage 0 holds both ends).
  for (const std::string schedule : {"interleaved", "zbv"}) {
    for (int replicas : {1, 2}) layouts.push_back({2, replicas, schedule});
  }
  for (const auto& l : layouts) {
    DYNAMIC_SECTION(l.schedule << " P=" << l.stages << " D=" << l.replicas) {
      WorkerJob job(layout(l.stages, l.replicas, trainArgs(l.schedule, rc)),
                    scratchDir(l.schedule + "-" + std::to_string(l.stages) + "x" + std::to_string(l.replicas)));
      requireAllSucceeded(job);
      // The runtime split the model as runtimePartition says (into stages x
      // chunks virtual stages).
      const int chunks = defaultChunks(parseScheduleKind(l.schedule));
      CHECK_THAT(job.worker(0).stderrText(),
                 Catch::Contains(runtimePartition(spec, l.stages * chunks).describe(pieceNames(spec))));

      // Losses and gradient norms: every layout, since a micro-batch's batch
      // statistics do not depend on where it runs.
      for (int r = 0; r < job.worldSize(); ++r) {
        const auto steps = job.steps(r);
        REQUIRE(steps.size() == static_cast<size_t>(rc.steps));
        for (size_t s = 0; s < steps.size(); ++s) {
          INFO("rank " << r << " step " << s);
          CHECK(steps[s].loss == Approx(reference.losses[s]).epsilon(kRtol).margin(kAtol));
          CHECK(steps[s].gradNorm == Approx(reference.gradNorms[s]).epsilon(kRtol));
        }
      }
      for (int replica = 0; replica < l.replicas; ++replica) {
        checkClose(replicaParams(job, l.stages, replica), reference.params, "parameter");
      }

      if (l.replicas == 1) {
        // D = 1: one replica sees every micro-batch in order, as the
        // reference: buffers (updated once per micro-batch, recompute or not)
        // and the eval-mode loss (which uses them) equal the reference's.
        checkClose(replicaBuffers(job, l.stages, 0), reference.buffers, "buffer");
        CHECK(job.evalLoss(0) == Approx(reference.evalLoss).epsilon(kRtol));
      } else {
        // D = 2: each replica saw only its half of the batch, so its own
        // statistics differ; after every step replica 0's are broadcast.
        // Both replicas' stages hold bit-identical buffers, and they moved.
        const auto zero = replicaBuffers(job, l.stages, 0);
        REQUIRE(zero.size() == initial.size());
        checkEqual(replicaBuffers(job, l.stages, 1), zero, "replica 1's buffer");
        for (const auto& [name, start] : initial) {
          INFO("buffer " << name);
          CHECK_FALSE(torch::equal(zero.at(name), start));
        }
        // They differ from the D = 1 reference's (replica 1's micro-batches
        // are not in them), or the rule above would be untested.
        bool differs = false;
        for (const auto& [name, want] : reference.buffers) {
          differs = differs || !torch::allclose(zero.at(name).to(torch::kDouble), want.to(torch::kDouble), kRtol, kAtol);
        }
        CHECK(differs);
        for (int r = 1; r < job.worldSize(); ++r) CHECK(job.evalLoss(r) == job.evalLoss(0));
      }
    }
  }
}

TEST_CASE("checkpoints carry buffers across layouts", "[integration][buffers][checkpoint]") {
  const auto data = gpt::CharDataset::fromPath("/usr/share/common-licenses");
  const auto spec = gpt::makeGptModel(tinyGpt(data.vocabSize()));
  const auto root = scratchDir("buffers-checkpoint");
  constexpr int64_t kAt = 2, kEnd = 4;
  auto args = [&](const fs::path& store, int64_t steps) {
    auto a = trainArgs("varuna", referenceConfig(steps));
    a.insert(a.end(), {"--checkpoint_dir", store.string()});
    return a;
  };
  // A private copy of the uninterrupted run's store for each resumed job, so
  // no job sees what another wrote.
  auto storeCopy = [&](const std::string& name) {
    const auto copy = root / name;
    fs::copy(root / "store", copy, fs::copy_options::recursive);
    return copy;
  };
  auto resumeArgs = [&](const fs::path& store, int64_t steps) {
    auto a = args(store, steps);
    a.insert(a.end(), {"--resume_step", std::to_string(kAt)});
    return a;
  };

  // The uninterrupted 2x2 run, checkpointing at step kAt on its way to kEnd.
  auto fullArgs = args(root / "store", kEnd);
  fullArgs.insert(fullArgs.end(), {"--checkpoint_every", std::to_string(kAt)});
  WorkerJob full(layout(2, 2, fullArgs), root / "full");
  requireAllSucceeded(full);
  REQUIRE(ckpt::isComplete(ckpt::checkpointDir(root / "store", kAt)));
  const auto fullBuffers = replicaBuffers(full, 2, 0);
  REQUIRE(fullBuffers.size() == 4 * 3);

  // The same 2x2 job stopped at kAt: its live buffers at the checkpoint step.
  WorkerJob atCheckpoint(layout(2, 2, args(root / "store-at", kAt)), root / "at");
  requireAllSucceeded(atCheckpoint);
  const auto buffersAt = replicaBuffers(atCheckpoint, 2, 0);
  checkEqual(replicaBuffers(atCheckpoint, 2, 1), buffersAt, "replica 1's buffer at the checkpoint");

  // Sections would rerun the two jobs above for each; the three checks run in
  // sequence instead.
  {
    // What the 2x2 run held at kAt is what its checkpoint of kAt holds, in
    // piece_<i>_<name>.params.pt next to the parameters.
    const auto dir = ckpt::checkpointDir(root / "store", kAt);
    Tensors saved;
    for (int i = 0; i < static_cast<int>(spec.pieces.size()); ++i) {
      const auto file = dir / ("piece_" + std::to_string(i) + "_" + spec.pieces[i].name + ".params.pt");
      for (auto& [name, t] : loadTensorFile(file.string())) {
        if (buffersAt.count(name)) saved[name] = t;
      }
    }
    checkEqual(saved, buffersAt, "saved buffer");
  }

  {
    // Resumed as 3x1: resume and train 0 steps: the dump is what loadCheckpoint restored under
    // 3 stages (other pieces per stage than the writer's 2). Bit-equal buffers
    // prove they were restored, not left at their initial values; the eval
    // loss (eval mode uses the running statistics) proves the model evaluates
    // as the writer did at kAt. Training on would diverge from the 2x2 run by
    // the rule itself (D = 1 sees every micro-batch, D = 2 only replica 0's).
    WorkerJob resumed(layout(3, 1, resumeArgs(storeCopy("store-3x1"), kAt)), root / "resume-3x1");
    requireAllSucceeded(resumed);
    CHECK(resumed.steps(0).empty());
    checkEqual(replicaBuffers(resumed, 3, 0), buffersAt, "buffer after loading as 3x1");
    CHECK(resumed.evalLoss(0) == Approx(atCheckpoint.evalLoss(0)).epsilon(kRtol));
  }

  {
    // Resumed as 1x2 and as 2x2, the run ends as the uninterrupted one. Same D, so the same buffer rule (replica 0 sees the same micro-batches
    // whatever P is): a job resumed under another pipeline depth, and under
    // the same layout, ends with the uninterrupted run's buffers and eval
    // loss. Before buffers were checkpointed, both restarted them from their
    // initial values and evaluated differently.
    for (auto [stages, replicas] : {std::pair{1, 2}, std::pair{2, 2}}) {
      const std::string name = std::to_string(stages) + "x" + std::to_string(replicas);
      INFO("resumed as " << name);
      WorkerJob resumed(layout(stages, replicas, resumeArgs(storeCopy("store-" + name), kEnd)), root / ("resume-" + name));
      requireAllSucceeded(resumed);
      REQUIRE(resumed.steps(0).size() == static_cast<size_t>(kEnd - kAt));
      for (int replica = 0; replica < replicas; ++replica) {
        checkClose(replicaBuffers(resumed, stages, replica), fullBuffers, "buffer of replica " + std::to_string(replica));
      }
      for (int r = 0; r < resumed.worldSize(); ++r) {
        CHECK(resumed.evalLoss(r) == Approx(full.evalLoss(0)).epsilon(kRtol));
      }
    }
  }
}
