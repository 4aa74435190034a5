// Trains the example GPT with Varuna. Started by a launcher (run_varuna,
// scripts/varuna_launch.py or torchrun) once per worker; the launcher's
// arguments (--rank --local_rank --stage_to_rank_map --chunk_size --batch-size
// --resume_step) and the torchrun environment are read by parseLaunchArgs, the
// rest of the command line by this program.
#include <malloc.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>

#include "char_dataset.h"
#include "gpt_main.h"
#include "gpt_model.h"
#include "gpt_options.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/schedule.h"
#include "varuna/worker/tensor_file.h"
#include "varuna/worker/varuna.h"

namespace {

struct TrainOptions {
  int64_t steps = 50;
  std::string data = "/usr/share/common-licenses";
  std::string optimizer = "adamw";
  double lr = 3e-3;
  double momentum = 0.9;
  double clip = 1.0;  // <= 0: no clipping
  std::string precision = "fp32";
  std::string schedule = "varuna";
  std::string nonFinite = "skip";
  std::string hostMemory = "fast";
  int64_t bucketBytes = 4 << 20;
  double initLossScale = 65536;
  int64_t growthInterval = 1000;
  uint64_t dataSeed = 7;
  int64_t logEvery = 1;
  std::string dumpDir;
  std::string traceDir;
  int64_t probeMemorySteps = 0;  // the first N steps of this process log their peak host memory
  std::string device = "cpu";  // "cuda": cuda:<local_rank> (with Gloo: modulo the host's GPUs)
  std::string commBackend = "auto";
  bool deterministic = false;
  std::string checkpointDir;     // the global store; empty: no checkpoints
  int64_t checkpointEvery = 0;   // 0: only on demand (SIGUSR1) and at the end
  std::string checkpointTempdir;
  bool checkpointShard = false;
  int keepCheckpoints = -1;      // -1: run_varuna's value, or the runtime's default
  std::string pieceCosts;  // comma-separated; empty: balance by parameter count
  int threads = 1;
  double peerTimeoutSeconds = 60;
  std::string logLevel = "info";
  // Test hooks (off by default; named --test_*): fault injection for the
  // end-to-end tests of run_varuna's liveness rules.
  int64_t testBusyLoopAtStep = -1;  // >= 0: at this step (0-based) ...
  int testBusyLoopRank = 0;         // ... this rank spins forever
  std::string testLoseExchange;     // STAGE@STEP[/REPLICA]: see loseExchangeHook
  int64_t testNonFiniteAtStep = -1;  // >= 0: rank 0's gradients of this step (0-based) become non-finite
  gpt::GptConfig model;
};

std::vector<double> parseCosts(const std::string& text) {
  std::vector<double> costs;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) costs.push_back(std::stod(item));
  return costs;
}

// --test_lose_exchange STAGE@STEP[/REPLICA] (tests/e2e/salvage_test.py): the
// ranks of that stage (of that replica only, if given) act as if the
// job-wide exchange completing STEP had failed under them right after it
// completed everywhere else: the split a peer dying during the exchange can
// leave, made deterministic. In run_varuna's first generation only: a
// fallback to an earlier checkpoint must not meet it again.
std::function<bool(const varuna::ExchangePoint&)> loseExchangeHook(const std::string& text) {
  int stage = 0, replica = -1, end = 0;
  long long step = 0;
  const char* value = text.c_str();
  const bool whole = (std::sscanf(value, "%d@%lld%n", &stage, &step, &end) == 2 && value[end] == '\0') ||
                     (std::sscanf(value, "%d@%lld/%d%n", &stage, &step, &replica, &end) == 3 && value[end] == '\0');
  if (!whole) {
    throw varuna::ConfigError("--test_lose_exchange '" + text + "' is not STAGE@STEP or STAGE@STEP/REPLICA (e.g. 1@60)");
  }
  return [=](const varuna::ExchangePoint& at) {
    return at.generation <= 1 && at.stage == stage && at.step == step && (replica < 0 || at.replica == replica);
  };
}

void parseTrainOptions(const std::vector<std::string>& args, TrainOptions& o) {
  CLI::App app{"train_gpt: the Varuna example character-level GPT"};
  // The last occurrence wins, so wrappers (scripts/demo.sh) can set defaults.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--steps", o.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--data", o.data, "text file or directory of text files");
  app.add_option("--optimizer", o.optimizer, "adamw or sgd")->check(CLI::IsMember({"adamw", "sgd"}));
  app.add_option("--lr", o.lr, "learning rate");
  app.add_option("--momentum", o.momentum, "SGD momentum");
  app.add_option("--clip", o.clip, "clip the global gradient norm to this (<= 0: off)");
  app.add_option("--precision", o.precision, "fp32, bf16 or fp16")->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--schedule", o.schedule,
                 "varuna, 1f1b, gpipe, zb-h1, interleaved[:chunks] or zbv (docs/worker-api.md: which pays when)")
      ->check([](const std::string& text) {
        try {
          varuna::parseScheduleChoice(text);
          return std::string();
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      });
  app.add_option("--nonfinite", o.nonFinite,
                 "fp32/bf16 step with non-finite gradients: skip (read the step's exchange before the optimizer) "
                 "or stop (queue the optimizer first, faster on GPUs; exit 1 on a non-finite step)")
      ->check(CLI::IsMember({"skip", "stop"}));
  app.add_option("--bucket_bytes", o.bucketBytes, "data-parallel gradient bucket size (VarunaOptions::bucketBytes)")
      ->check(CLI::PositiveNumber);
  app.add_option("--host_memory", o.hostMemory,
                 "fast (the C library's allocator as it is) or compact (host blocks of 4 MiB and more returned "
                 "when freed: lower peak memory on the CPU, slower CPU steps)")
      ->check(CLI::IsMember({"fast", "compact"}));
  app.add_option("--init_loss_scale", o.initLossScale, "fp16 initial loss scale");
  app.add_option("--loss_scale_growth_interval", o.growthInterval, "fp16 clean steps before the scale grows");
  app.add_option("--data_seed", o.dataSeed, "seed of the data order");
  app.add_option("--log_every", o.logEvery, "print every N steps");
  app.add_option("--dump_dir", o.dumpDir,
                 "write per-step results (rank<r>_steps.jsonl), the initial and final parameters "
                 "(rank<r>_initial.pt, rank<r>_params.pt) and final buffers (rank<r>_buffers.pt), "
                 "loadable with torch.load, here");
  app.add_option("--trace_dir", o.traceDir,
                 "each rank writes its steps' timeline here (rank<r>_trace.json: Chrome trace events; "
                 "scripts/pipeline_trace.py merges them and splits the step)");
  app.add_option("--probe_memory_steps", o.probeMemorySteps,
                 "with --dump_dir: the first N steps also log step_peak_rss_over_start_bytes (the step's peak "
                 "resident memory over its start, after handing the heap's free memory back: slows those steps)");
  app.add_option("--checkpoint_dir", o.checkpointDir, "global store for checkpoints (varuna_ckpt_<step>/)");
  app.add_option("--checkpoint_every", o.checkpointEvery, "checkpoint every N steps (0: on SIGUSR1 and at the end)");
  app.add_option("--ckpt_tempdir", o.checkpointTempdir, "write checkpoints here first, copy in the background");
  app.add_flag("--ckpt_shard", o.checkpointShard, "spread checkpoint writes over the data-parallel replicas");
  app.add_option("--keep_checkpoints", o.keepCheckpoints,
                 "keep the newest N complete checkpoints (0: all; default: run_varuna's, else the runtime's)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device", o.device, "cpu, or cuda (one GPU per worker: cuda:<local_rank>; with --comm_backend "
                 "gloo, workers share the host's GPUs)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--comm_backend", o.commBackend,
                 "auto (NCCL on CUDA, Gloo on the CPU), gloo (also on CUDA: several ranks per GPU), or nccl")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_flag("--deterministic", o.deterministic,
               "deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG): for "
               "equivalence runs");
  app.add_option("--piece_costs", o.pieceCosts, "comma-separated per-piece costs for partitioning");
  app.add_option("--threads", o.threads, "intra-op threads per worker")->check(CLI::PositiveNumber);
  app.add_option("--peer_timeout_s", o.peerTimeoutSeconds, "declare a silent peer lost after this long");
  app.add_option("--log_level", o.logLevel, "debug, info, warn, error");
  app.add_option("--test_busy_loop_at_step", o.testBusyLoopAtStep,
                 "test hook: before step N (0-based; -1: off) rank --test_busy_loop_rank spins in a busy loop "
                 "forever, outside c10d: its heartbeats go on with its step stalled while its peers wait");
  app.add_option("--test_busy_loop_rank", o.testBusyLoopRank, "test hook: the rank of --test_busy_loop_at_step");
  app.add_option("--test_nonfinite_at_step", o.testNonFiniteAtStep,
                 "test hook: rank 0's gradients of step N (0-based; -1: off) become non-finite before the exchange");
  app.add_option("--test_lose_exchange", o.testLoseExchange,
                 "test hook: STAGE@STEP[/REPLICA]: that stage's ranks act as if the exchange completing STEP failed "
                 "under them (run_varuna's first generation only)");
  gpt::addModelOptions(app, o.model);
  gpt::parseCommandLine(app, args, "train_gpt");
}

// A step's memory on the host: the peak resident size during the step over
// the size at its start (Linux: VmHWM, reset through /proc/self/clear_refs,
// against VmRSS), with the heap's free memory handed back first (malloc_trim)
// so that what the step allocates shows. Activations, their gradients and
// every other temporary of the step; -1 where the kernel does not offer it.
// The trim costs the step page faults: only for steps that are not timed
// (--probe_memory_steps, the bench's warm-up).
class StepMemoryProbe {
 public:
  void start() {
    ::malloc_trim(0);
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";  // resets VmHWM to VmRSS
    reset.flush();
    startBytes_ = reset ? statusBytes("VmRSS:") : -1;  // no reset: the peak would be the process's
  }
  int64_t peakOverStart() const {
    const int64_t peak = statusBytes("VmHWM:");
    return peak < 0 || startBytes_ < 0 ? -1 : std::max<int64_t>(0, peak - startBytes_);
  }

 private:
  static int64_t statusBytes(const std::string& field) {
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind(field, 0) == 0) return std::stoll(line.substr(field.size())) * 1024;  // "  1234 kB"
    }
    return -1;
  }
  int64_t startBytes_ = -1;
};

// Writes named tensors of this rank (torch.load-able) and a plain-JSON summary
// of each (shape, sum, first values) that other tools can check them against.
void writeTensors(const std::vector<std::pair<std::string, torch::Tensor>>& named,
                  const std::filesystem::path& path) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  nlohmann::json summary = nlohmann::json::object();
  for (const auto& [name, tensor] : named) {
    auto t = tensor.detach().cpu().contiguous();
    tensors.push_back({name, t});
    auto flat = t.flatten().to(torch::kDouble);
    std::vector<double> first;
    for (int64_t i = 0; i < std::min<int64_t>(4, flat.numel()); ++i) first.push_back(flat[i].item<double>());
    summary[name] = {{"shape", t.sizes().vec()}, {"sum", flat.sum().item<double>()}, {"first", first}};
  }
  varuna::saveTensorFile(path.string(), tensors);
  std::ofstream(path.string() + ".summary.json") << summary.dump(1);
}

// Why nothing at or below `atMost` loads, for the error message: what the
// newest checkpoint directory there fails (the runtime logged every one it
// passed over).
std::string explainUnloadable(const std::string& store, int64_t atMost) {
  for (const int64_t step : varuna::ckpt::listCheckpoints(store)) {
    if (step > atMost) continue;
    try {
      varuna::ckpt::verify(varuna::ckpt::checkpointDir(store, step));
    } catch (const std::exception& e) {
      return varuna::strCat(": the newest, step ", step, ", is unusable: ", e.what());
    }
    return "";
  }
  return ": there is none";
}

// The --test_busy_loop_at_step hook: a rank that is alive (its threads run,
// so its heartbeats go on) but makes no progress and waits on no peer, the
// hang that only run_varuna's "step stalls while its peers wait" rule catches.
[[noreturn]] void spinForever(int64_t step, int rank) {
  varuna::log::warn("test hook --test_busy_loop_at_step: rank ", rank, " spins forever before step ", step);
  varuna::log::flush();
  volatile uint64_t spins = 0;  // volatile: the loop is not optimised away
  while (true) spins = spins + 1;
}

int run(int argc, char** argv) {
  // First: a checkpoint request (SIGUSR1) during start-up is then remembered
  // and honoured after the first step (varuna_agent starts workers with it
  // blocked until here), never the default action's death.
  varuna::installCheckpointSignalHandler();
  const auto launch = varuna::parseLaunchArgs(argc, argv, varuna::currentEnvironment());
  varuna::log::configure({.component = "train_gpt", .rank = launch.rank});
  TrainOptions o;
  parseTrainOptions(launch.userArgs, o);
  // Under run_varuna the job's global store is the default checkpoint folder.
  if (o.checkpointDir.empty()) o.checkpointDir = launch.globalStore;
  varuna::log::setLevel(varuna::log::parseLevel(o.logLevel));
  torch::set_num_threads(o.threads);
  if (o.deterministic) varuna::useDeterministicAlgorithms();  // before any CUDA work

  const auto data = gpt::CharDataset::fromPath(o.data);
  o.model.vocabSize = data.vocabSize();

  varuna::VarunaOptions options;
  options.applyLaunchArgs(launch);
  options.model = gpt::makeGptModel(o.model);
  if (!o.pieceCosts.empty()) options.model.pieceCosts = parseCosts(o.pieceCosts);
  if (!o.testLoseExchange.empty()) options.faults.loseExchange = loseExchangeHook(o.testLoseExchange);
  if (o.testNonFiniteAtStep >= 0) {
    options.faults.poisonGradients = [rank = launch.rank, step = o.testNonFiniteAtStep](const varuna::ExchangePoint& at) {
      return rank == 0 && at.step == step + 1;  // at.step counts steps done once this one is applied
    };
  }
  const auto map = varuna::StageToRankMap::parse(options.stageToRankMap);
  const int64_t perReplica = launch.replicaBatchSize > 0 ? launch.replicaBatchSize : 8;
  options.batchSize = perReplica * map.numReplicas();
  options.chunkSize = launch.chunkSize > 0 ? launch.chunkSize : std::min<int64_t>(perReplica, 4);
  options.precision = varuna::parsePrecision(o.precision);
  const varuna::ScheduleChoice schedule = varuna::parseScheduleChoice(o.schedule);
  options.schedule = schedule.kind;
  options.scheduleChunks = schedule.chunks;
  options.onNonFiniteGradients =
      o.nonFinite == "stop" ? varuna::NonFiniteGradients::kStopTraining : varuna::NonFiniteGradients::kSkipStep;
  options.hostMemory = o.hostMemory == "compact" ? varuna::HostMemory::kCompact : varuna::HostMemory::kFast;
  options.bucketBytes = o.bucketBytes;
  options.traceDir = o.traceDir;
  options.commBackend = varuna::parseCommBackend(o.commBackend);
  options.device = o.device == "cuda" ? varuna::cudaDeviceForLocalRank(launch.localRank, options.commBackend)
                                      : torch::Device(torch::kCPU);
  options.peerTimeout = std::chrono::milliseconds(static_cast<int64_t>(o.peerTimeoutSeconds * 1000));
  // The runtime writes the on-demand checkpoint (exitIfCheckpointRequested) and
  // applies retention with these; periodic ones go through checkpoint(step).
  options.checkpointing.globalStore = o.checkpointDir;
  options.checkpointing.tempdir = o.checkpointTempdir;
  options.checkpointing.shard = o.checkpointShard;
  if (o.keepCheckpoints >= 0) options.checkpointing.keepCheckpoints = o.keepCheckpoints;
  const uint64_t dataSeed = o.dataSeed;
  const int64_t seqLen = o.model.seqLen;
  options.getBatch = [&data, seqLen, dataSeed](int64_t size, torch::Device device) {
    auto batch = data.samples(0, size, seqLen, dataSeed);
    for (auto& [key, t] : batch) t = t.to(device);
    return batch;
  };

  varuna::Varuna model(std::move(options));
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  if (o.optimizer == "sgd") {
    optimizer = std::make_shared<torch::optim::SGD>(model.parameters(), torch::optim::SGDOptions(o.lr).momentum(o.momentum));
  } else {
    optimizer = std::make_shared<torch::optim::AdamW>(model.parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(0.0));
  }
  varuna::LossScaleOptions lossScale;
  lossScale.initialScale = o.initLossScale;
  lossScale.growthInterval = o.growthInterval;
  model.setOptimizer(optimizer, lossScale);
  if (launch.resumeStep >= 0) {
    if (o.checkpointDir.empty()) throw varuna::ConfigError("--resume_step needs --checkpoint_dir");
    // The newest checkpoint at or below the requested step that every rank
    // verifies: a damaged one (checksum, size) is passed over, not fatal.
    const auto loaded = model.loadLatestCheckpoint(o.checkpointDir, launch.resumeStep);
    if (!loaded) {
      throw varuna::ckpt::CheckpointError(varuna::strCat("no checkpoint at or below step ", launch.resumeStep, " in '",
                                                         o.checkpointDir, "' could be loaded",
                                                         explainUnloadable(o.checkpointDir, launch.resumeStep)));
    }
    if (*loaded < launch.resumeStep && launch.rank == 0) {
      varuna::log::warn("the checkpoint of step ", launch.resumeStep, " could not be loaded; fell back to step ",
                        *loaded);
    }
  }

  std::ofstream stepLog;
  if (!o.dumpDir.empty()) {
    std::filesystem::create_directories(o.dumpDir);
    writeTensors(model.namedParameters(),
                 std::filesystem::path(o.dumpDir) / ("rank" + std::to_string(launch.rank) + "_initial.pt"));
    // A resumed run (e.g. after a morph) continues the log of the run before.
    stepLog.open(std::filesystem::path(o.dumpDir) / ("rank" + std::to_string(launch.rank) + "_steps.jsonl"),
                 launch.resumeStep >= 0 ? std::ios::app : std::ios::trunc);
  }
  const int64_t globalBatch = perReplica * map.numReplicas();
  const bool reporter = launch.rank == 0;
  if (reporter) {
    varuna::log::info("training ", o.steps, " steps: global batch ", globalBatch, " x ", seqLen, " characters, vocab ",
                      data.vocabSize(), ", text of ", data.size(), " characters");
  }
  // --steps counts the steps of the whole run, so a resumed job stops where an
  // uninterrupted one would.
  const int64_t firstStep = model.stepsDone();
  for (int64_t step = firstStep; step < o.steps; ++step) {
    if (step == o.testBusyLoopAtStep && launch.rank == o.testBusyLoopRank) spinForever(step, launch.rank);
    const auto batch = data.replicaBatch(step, globalBatch, model.replica(), model.numReplicas(), seqLen, dataSeed);
    StepMemoryProbe memory;
    const bool probeMemory = stepLog.is_open() && step - firstStep < o.probeMemorySteps;
    if (probeMemory) memory.start();
    const auto start = std::chrono::steady_clock::now();
    const auto result = model.step(batch, o.clip > 0 ? std::optional<double>(o.clip) : std::nullopt);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (stepLog.is_open()) {
      nlohmann::json row{{"step", step},        {"loss", result.loss},       {"overflow", result.overflow},
                         {"grad_norm", result.gradNorm}, {"loss_scale", result.lossScale}, {"time_s", seconds},
                         {"compute_s_per_microbatch", result.computeSecondsPerMicrobatch},
                         {"optimizer_s", result.optimizerSeconds}, {"wait_s", result.waitSeconds}};
      if (probeMemory) row["step_peak_rss_over_start_bytes"] = memory.peakOverStart();
      stepLog << row.dump() << "\n";
      stepLog.flush();
    }
    if (result.checkpointRequested && reporter) {
      std::cout << "checkpoint requested: writing step " << step + 1 << " on demand, then exiting" << std::endl;
    }
    // SIGUSR1 (a preemption notice) on any rank: the runtime checkpoints this
    // step and exits with kExitCheckpointed; otherwise it returns at once.
    model.exitIfCheckpointRequested(result);
    if (!o.checkpointDir.empty() && o.checkpointEvery > 0 && (step + 1) % o.checkpointEvery == 0 &&
        step + 1 < o.steps) {
      // A storage failure is logged and reported by the runtime; training goes on.
      model.checkpoint(step + 1);
    }
    if (reporter && (step % o.logEvery == 0 || step + 1 == o.steps)) {
      std::cout << "step " << step << " loss " << result.loss << " grad_norm " << result.gradNorm
                << (result.overflow ? " overflow(skipped)" : "") << " time " << seconds << "s tokens/s "
                << static_cast<int64_t>(globalBatch * seqLen / seconds) << std::endl;
    }
  }
  if (!o.checkpointDir.empty()) {
    model.checkpoint(varuna::CheckpointRequest{o.checkpointDir, o.steps, "", o.checkpointShard});
    model.waitForCheckpoints();
  }
  // Held-out evaluation: the global batch right after the last training step.
  const double evalLoss =
      model.evaluate(data.replicaBatch(o.steps, globalBatch, model.replica(), model.numReplicas(), seqLen, dataSeed));
  if (reporter) std::cout << "eval loss " << evalLoss << std::endl;
  if (!o.dumpDir.empty()) {
    const std::filesystem::path dump(o.dumpDir);
    writeTensors(model.namedParameters(), dump / ("rank" + std::to_string(launch.rank) + "_params.pt"));
    // Buffers (BatchNorm running statistics); an empty dict when the stage has none.
    writeTensors(model.namedBuffers(), dump / ("rank" + std::to_string(launch.rank) + "_buffers.pt"));
    std::ofstream(std::filesystem::path(o.dumpDir) / ("rank" + std::to_string(launch.rank) + "_eval.json"))
        << nlohmann::json{{"eval_loss", evalLoss}}.dump();
  }
  if (reporter) std::cout << "done" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return gpt::runMain(run, argc, argv); }
