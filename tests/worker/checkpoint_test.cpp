// Checkpoints through real multi-process jobs: exact resume under other
// layouts, fp16 resume, crash safety under kill -9, corruption, SIGUSR1; and
// in one process, a damaged checkpoint leaving the live model untouched.

#include <signal.h>
#include <torch/optim/sgd.h>

#include <fstream>
#include <random>

#include "char_dataset.h"
#include "gpt_model.h"
#include "test_env.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/common/errors.h"
#include "varuna/worker/varuna.h"
#include "worker_job.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

#include <algorithm>

using namespace varuna;
using namespace varuna::test;
namespace fs = std::filesystem;

namespace {

constexpr double kRtol = 1e-5;  // fp32, different reduction orders
constexpr double kAtol = 1e-6;  // for values near zero

std::vector<std::string> modelArgs(const fs::path& store, int64_t steps) {
  return {"--d_model", "32", "--heads", "2", "--layers", "4", "--seq_len", "16", "--optimizer", "sgd", "--lr", "0.1",
          "--momentum", "0.9", "--clip", "0.5", "--steps", std::to_string(steps), "--checkpoint_dir", store.string(),
          "--peer_timeout_s", "60"};
}

WorkerJobSpec layout(int stages, int replicas, std::vector<std::string> args) {
  WorkerJobSpec spec;
  spec.stages = stages;
  spec.replicas = replicas;
  spec.perReplicaBatch = 8 / replicas;  // global batch 8 in every layout
  spec.chunkSize = 2;
  spec.trainArgs = std::move(args);
  return spec;
}

std::map<std::string, torch::Tensor> replicaParams(const WorkerJob& job, int stages, int replica) {
  std::map<std::string, torch::Tensor> all;
  for (int s = 0; s < stages; ++s) {
    for (auto& [name, t] : job.params(replica * stages + s)) all[name] = t;
  }
  return all;
}

void checkClose(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (const auto& [name, expected] : want) {
    INFO("parameter " << name);
    REQUIRE(got.count(name));
    CHECK(((got.at(name) - expected).abs() - kRtol * expected.abs()).max().item<double>() <= kAtol);
  }
}

}  // namespace

TEST_CASE("a checkpoint written as 2x2 resumes exactly as 3x1 and as 1x2, under other schedules",
          "[integration][checkpoint]") {
  const auto root = scratchDir("exact-resume");
  WorkerJob uninterrupted(layout(2, 2, modelArgs(root / "full", 6)), root / "full-dump");
  requireAllSucceeded(uninterrupted);
  const auto reference = uninterrupted.steps(0);
  REQUIRE(reference.size() == 6);

  // Write: 3 steps as 2 stages x 2 replicas, checkpoint at step 3 (the final
  // one), sharded: each stage's pieces are spread over both replicas.
  // Under the zero-bubble schedule; resumed under 1F1B and Varuna's (the
  // uninterrupted run's): a checkpoint does not record the schedule.
  auto firstArgs = modelArgs(root / "store", 3);
  firstArgs.insert(firstArgs.end(), {"--ckpt_shard", "--schedule", "zb-h1"});
  WorkerJob first(layout(2, 2, firstArgs), root / "first-dump");
  requireAllSucceeded(first);
  REQUIRE(ckpt::latestComplete(root / "store") == 3);

  for (auto [stages, replicas] : {std::pair{3, 1}, std::pair{1, 2}}) {
    DYNAMIC_SECTION("resume as " << stages << "x" << replicas) {
      auto args = modelArgs(root / "store", 6);
      args.insert(args.end(), {"--resume_step", "3"});
      if (stages == 3) args.insert(args.end(), {"--schedule", "1f1b"});
      const auto dumpDir = root / ("resume-" + std::to_string(stages) + "x" + std::to_string(replicas));
      WorkerJob resumed(layout(stages, replicas, args), dumpDir);
      requireAllSucceeded(resumed);
      const auto steps = resumed.steps(0);
      REQUIRE(steps.size() == 3);
      for (size_t i = 0; i < steps.size(); ++i) {
        INFO("step " << steps[i].step);
        CHECK(steps[i].step == static_cast<int64_t>(i + 3));
        CHECK(steps[i].loss == Approx(reference[i + 3].loss).epsilon(kRtol));
        CHECK(steps[i].gradNorm == Approx(reference[i + 3].gradNorm).epsilon(kRtol));
      }
      for (int replica = 0; replica < replicas; ++replica) {
        checkClose(replicaParams(resumed, stages, replica), replicaParams(uninterrupted, 2, 0));
      }
    }
  }
}

TEST_CASE("a checkpoint written under zbv as 2x2 resumes under 1F1B as 3x1, and the reverse, exactly",
          "[integration][checkpoint]") {
  // Pieces stay the unit of a checkpoint whatever chunks a stage held: zbv's
  // stage 0 wrote the first and the last pieces, 1F1B's stages contiguous ones.
  const auto root = scratchDir("chunked-resume");
  WorkerJob uninterrupted(layout(2, 2, modelArgs(root / "full", 6)), root / "full-dump");
  requireAllSucceeded(uninterrupted);
  const auto reference = uninterrupted.steps(0);
  REQUIRE(reference.size() == 6);
  struct Way {
    std::string name;
    int writeStages, writeReplicas;
    std::string writeSchedule;
    int readStages, readReplicas;
    std::string readSchedule;
  };
  for (const Way& way : {Way{"zbv 2x2 to 1f1b 3x1", 2, 2, "zbv", 3, 1, "1f1b"},
                         Way{"1f1b 3x1 to zbv 2x2", 3, 1, "1f1b", 2, 2, "zbv"},
                         Way{"interleaved 2x1 to zbv 2x2", 2, 1, "interleaved", 2, 2, "zbv"}}) {
    DYNAMIC_SECTION(way.name) {
      const auto store = root / ("store-" + way.writeSchedule + "-" + std::to_string(way.writeStages));
      auto writeArgs = modelArgs(store, 3);
      writeArgs.insert(writeArgs.end(), {"--schedule", way.writeSchedule});
      WorkerJob first(layout(way.writeStages, way.writeReplicas, writeArgs), store.string() + "-first");
      requireAllSucceeded(first);
      REQUIRE(ckpt::latestComplete(store) == 3);

      auto readArgs = modelArgs(store, 6);
      readArgs.insert(readArgs.end(), {"--resume_step", "3", "--schedule", way.readSchedule});
      WorkerJob resumed(layout(way.readStages, way.readReplicas, readArgs), store.string() + "-resumed");
      requireAllSucceeded(resumed);
      const auto steps = resumed.steps(0);
      REQUIRE(steps.size() == 3);
      for (size_t i = 0; i < steps.size(); ++i) {
        INFO("step " << steps[i].step);
        CHECK(steps[i].loss == Approx(reference[i + 3].loss).epsilon(kRtol));
        CHECK(steps[i].gradNorm == Approx(reference[i + 3].gradNorm).epsilon(kRtol));
      }
      for (int replica = 0; replica < way.readReplicas; ++replica) {
        checkClose(replicaParams(resumed, way.readStages, replica), replicaParams(uninterrupted, 2, 0));
      }
    }
  }
}

TEST_CASE("resuming under the same layout is bit-exact, fp16 loss scale included", "[integration][checkpoint]") {
  const auto root = scratchDir("fp16-resume");
  auto args = [&](const std::string& store, int64_t steps) {
    return std::vector<std::string>{"--d_model", "32", "--heads", "2", "--layers", "4", "--seq_len", "16",
                                    "--optimizer", "adamw", "--lr", "0.01", "--precision", "fp16",
                                    "--init_loss_scale", "1e9", "--loss_scale_growth_interval", "3",
                                    "--steps", std::to_string(steps), "--checkpoint_dir", (root / store).string()};
  };
  WorkerJob full(layout(2, 1, args("full", 16)), root / "full-dump");
  requireAllSucceeded(full);
  const auto reference = full.steps(0);
  WorkerJob first(layout(2, 1, args("store", 8)), root / "first-dump");
  requireAllSucceeded(first);
  auto resumeArgs = args("store", 16);
  resumeArgs.insert(resumeArgs.end(), {"--resume_step", "8"});
  WorkerJob resumed(layout(2, 1, resumeArgs), root / "resumed-dump");
  requireAllSucceeded(resumed);
  const auto steps = resumed.steps(0);
  REQUIRE(steps.size() == 8);
  // The scale moved during the first half (overflows, then growth).
  CHECK(reference[8].lossScale != 1e9);
  for (size_t i = 0; i < steps.size(); ++i) {
    INFO("step " << i + 8);
    CHECK(steps[i].lossScale == reference[i + 8].lossScale);
    CHECK(steps[i].overflow == reference[i + 8].overflow);
    CHECK(steps[i].loss == reference[i + 8].loss);
  }
  for (auto& [name, t] : replicaParams(resumed, 2, 0)) CHECK(torch::equal(t, replicaParams(full, 2, 0).at(name)));
}

TEST_CASE("kill -9 during checkpoints never yields an accepted partial checkpoint", "[integration][checkpoint][fault]") {
  const auto root = scratchDir("crash");
  std::mt19937 random(20261122);
  int interruptedSeen = 0;
  for (int trial = 0; trial < 20; ++trial) {
    const auto store = root / ("store" + std::to_string(trial));
    auto args = std::vector<std::string>{"--d_model", "192", "--heads", "4", "--layers", "4", "--seq_len", "16",
                                         "--steps", "1000000", "--checkpoint_dir", store.string(),
                                         "--checkpoint_every", "1", "--ckpt_shard", "--peer_timeout_s", "10"};
    WorkerJob job(layout(2, 1, args), root / ("dump" + std::to_string(trial)));
    // Ready once a first checkpoint is complete; then kill a writer at a random moment.
    REQUIRE(waitUntil([&] { return fs::exists(store / ckpt::kLatest); }, std::chrono::seconds(60)));
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 400)(random)));
    job.worker(trial % 2).kill(SIGKILL);
    // Every process gone before the store is read (the survivor exits as its
    // peer is lost, within --peer_timeout_s): nothing changes it under us.
    const auto codes = job.waitAll(std::chrono::seconds(90));
    INFO("trial " << trial << ": exit codes " << codes[0] << ", " << codes[1]);
    REQUIRE(std::count(codes.begin(), codes.end(), -1) == 0);

    const auto latest = ckpt::latestComplete(store);
    REQUIRE(latest.has_value());
    for (int64_t step : ckpt::listCheckpoints(store)) {
      const auto dir = ckpt::checkpointDir(store, step);
      INFO("trial " << trial << " checkpoint " << step);
      if (ckpt::isComplete(dir)) {
        CHECK(step <= *latest);
        CHECK_NOTHROW(ckpt::verify(dir));  // every file, full checksums
      } else {
        ++interruptedSeen;
        CHECK(step > *latest);
        CHECK_THROWS_AS(ckpt::verify(dir), ckpt::CheckpointError);
      }
    }
    // An interrupted checkpoint stays in its run's partial folder
    // (varuna_ckpt_<step>.<run>.partial), which no loader reads: its step
    // never appears as a checkpoint of its own.
    for (const auto& entry : fs::directory_iterator(store)) {
      const std::string name = entry.path().filename().string();
      constexpr std::string_view prefix = "varuna_ckpt_", suffix = ".partial";
      if (name.rfind(prefix, 0) != 0 || !name.ends_with(suffix)) continue;
      const int64_t step = std::stoll(name.substr(prefix.size()));
      INFO("trial " << trial << " partial folder " << name);
      ++interruptedSeen;
      CHECK(step > *latest);
      CHECK_FALSE(fs::exists(ckpt::checkpointDir(store, step)));
    }
    fs::remove_all(store);  // keep the disk footprint of 20 trials small
  }
  // The random kills did land inside checkpoints (else the test proves nothing).
  CHECK(interruptedSeen > 0);
  WARN(interruptedSeen << " of 20 kills interrupted a checkpoint");
}

TEST_CASE("the loader refuses damaged checkpoints, naming the file", "[integration][checkpoint]") {
  const auto root = scratchDir("damaged");
  const auto store = root / "store";
  WorkerJob writer(layout(2, 1, modelArgs(store, 2)), root / "dump");
  requireAllSucceeded(writer);
  const auto dir = ckpt::checkpointDir(store, 2);
  REQUIRE(ckpt::isComplete(dir));

  auto resumeFails = [&](const std::string& expect) {
    auto args = modelArgs(store, 4);
    args.insert(args.end(), {"--resume_step", "2"});
    WorkerJob job(layout(2, 1, args), root / "resume");
    const auto codes = job.waitAll(std::chrono::seconds(60));
    bool named = false;
    for (int r = 0; r < job.worldSize(); ++r) {
      CHECK(codes[r] != 0);
      named = named || job.worker(r).stderrText().find(expect) != std::string::npos;
    }
    INFO("rank 0 stderr:\n" << job.worker(0).stderrText() << "\nrank 1 stderr:\n" << job.worker(1).stderrText());
    CHECK(named);
  };
  SECTION("truncated") {
    fs::resize_file(dir / "piece_0_embed.params.pt", 100);
    resumeFails("'piece_0_embed.params.pt' has 100 bytes");
  }
  SECTION("a flipped byte") {
    const auto path = dir / "piece_5_head.optim.pt";
    std::string bytes = ckpt::readFile(path);
    bytes[bytes.size() / 2] ^= 0x01;
    std::ofstream(path, std::ios::binary) << bytes;
    resumeFails("'piece_5_head.optim.pt' fails its checksum");
  }
  SECTION("marker deleted") {
    fs::remove(dir / ckpt::kMarker);
    resumeFails("COMPLETE marker is missing");
  }
}

TEST_CASE("SIGUSR1 makes every rank checkpoint the finished step and exit", "[integration][checkpoint]") {
  const auto root = scratchDir("sigusr1");
  for (const bool background : {false, true}) {
    DYNAMIC_SECTION((background ? "during background copies" : "in the middle of a step")) {
      const auto store = root / (background ? "bg" : "step");
      auto args = std::vector<std::string>{"--d_model", "128", "--heads", "4", "--layers", "4", "--seq_len", "32",
                                           "--steps", "1000000", "--checkpoint_dir", store.string()};
      if (background) {
        args.insert(args.end(), {"--checkpoint_every", "1", "--ckpt_tempdir", (root / "local").string()});
      }
      WorkerJob job(layout(2, 2, args), root / (background ? "bg-dump" : "step-dump"));
      REQUIRE(waitUntil([&] { return job.steps(3).size() >= 3; }, std::chrono::seconds(60)));
      // One rank only: the notice reaches agents at different times; the
      // step's job-wide exchange makes every rank agree.
      job.worker(2).kill(SIGUSR1);
      const auto codes = job.waitAll(std::chrono::seconds(60));
      for (int r = 0; r < job.worldSize(); ++r) {
        INFO("rank " << r << " stderr:\n" << job.worker(r).stderrText());
        CHECK(codes[r] == kExitCheckpointed);
      }
      const auto latest = ckpt::latestComplete(store);
      REQUIRE(latest.has_value());
      const auto lastStep = job.steps(0).back().step;
      CHECK(*latest == lastStep + 1);  // the finished step
      CHECK_NOTHROW(ckpt::verify(ckpt::checkpointDir(store, *latest)));
      CHECK_THAT(job.worker(0).stdoutText(), Catch::Contains("on demand"));
      for (int64_t step : ckpt::listCheckpoints(store)) CHECK_NOTHROW(ckpt::verify(ckpt::checkpointDir(store, step)));
    }
  }
}

namespace {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Deep copies: the live tensors keep changing.
std::map<std::string, torch::Tensor> snapshot(const NamedTensors& named) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : named) out[name] = t.detach().clone();
  return out;
}

void checkUnchanged(const NamedTensors& live, const std::map<std::string, torch::Tensor>& before) {
  REQUIRE(live.size() == before.size());
  for (const auto& [name, t] : live) {
    INFO(name);
    CHECK(torch::equal(t, before.at(name)));
  }
}

}  // namespace

// In-process (world size 1, the store on a kernel-chosen port) so the test
// can look at the model's own tensors after the failed load.
TEST_CASE("a flipped byte in the last piece's file leaves the model untouched; the latest falls back",
          "[integration][checkpoint][fault]") {
  const auto root = scratchDir("untouched");
  const auto store = (root / "store").string();
  const auto data = gpt::CharDataset::fromPath("/usr/share/common-licenses");
  gpt::GptConfig config;
  config.vocabSize = data.vocabSize();
  config.dModel = 16;
  config.heads = 2;
  config.layers = 2;
  config.seqLen = 8;
  config.batchNorm = true;  // buffers too must stay untouched
  VarunaOptions options;
  options.model = gpt::makeGptModel(config);
  options.stageToRankMap = "0;";
  options.rendezvous.masterPort = 0;  // rank 0 hosts the store on a free port
  options.batchSize = 4;
  options.chunkSize = 2;
  options.getBatch = [&](int64_t n, torch::Device) { return data.samples(0, n, config.seqLen, 7); };
  options.checkpointing.keepCheckpoints = 0;  // both checkpoints stay
  Varuna model(options);
  model.setOptimizer(std::make_shared<torch::optim::SGD>(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)));
  REQUIRE_FALSE(model.namedBuffers().empty());
  auto train = [&](int64_t step) { model.step(data.samples(step * 4, 4, config.seqLen, 7), 1.0); };

  train(0);
  train(1);
  model.checkpoint(store, 2);
  const auto paramsAt2 = snapshot(model.namedParameters());
  const auto buffersAt2 = snapshot(model.namedBuffers());
  train(2);
  model.checkpoint(store, 3);
  REQUIRE(ckpt::latestComplete(store) == 3);

  // The last piece's file is the last the loader would read.
  const auto lastPiece = static_cast<int>(options.model.pieces.size()) - 1;
  const std::string file = "piece_" + std::to_string(lastPiece) + "_head.params.pt";
  const auto dir = ckpt::checkpointDir(store, 3);
  const auto size = fs::file_size(dir / file);
  std::string bytes = ckpt::readFile(dir / file);
  bytes[bytes.size() / 2] ^= 0x01;
  std::ofstream(dir / file, std::ios::binary | std::ios::trunc) << bytes;
  REQUIRE(fs::file_size(dir / file) == size);

  // Move every tensor away from both checkpoints, so a load that changed
  // anything would show.
  {
    torch::NoGradGuard noGrad;
    for (auto& [name, t] : model.namedParameters()) t.add_(0.5);
    for (auto& [name, t] : model.namedBuffers()) t.add_(1);
  }
  const auto paramsBefore = snapshot(model.namedParameters());
  const auto buffersBefore = snapshot(model.namedBuffers());
  const auto stepsBefore = model.stepsDone();

  CHECK_THROWS_WITH(model.loadCheckpoint(store, 3), Catch::Contains(file) && Catch::Contains("checksum"));
  checkUnchanged(model.namedParameters(), paramsBefore);
  checkUnchanged(model.namedBuffers(), buffersBefore);
  CHECK(model.stepsDone() == stepsBefore);

  // The newest loadable one is step 2: the damaged step 3 is passed over and
  // marked, so no later choice (the manager's included) picks it again.
  REQUIRE(model.loadLatestCheckpoint(store) == std::optional<int64_t>(2));
  CHECK(fs::exists(dir / ckpt::kDamaged));
  CHECK(ckpt::latestComplete(store) == 2);
  CHECK(model.stepsDone() == 2);
  checkUnchanged(model.namedParameters(), paramsAt2);
  checkUnchanged(model.namedBuffers(), buffersAt2);
}
