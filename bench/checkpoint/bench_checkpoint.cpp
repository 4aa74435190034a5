// bench/checkpoint: how fast Varuna writes a checkpoint, against the disk.
//
// A GPT of ~19M parameters (with AdamW state: ~230 MB) in one process:
//  1. synchronous checkpoint to <dir>: write_mb_s (median of 5), and loading
//     it back into the model: load_mb_s (median of 5);
//  2. the disk's sequential write speed to the same <dir> with
//     dd if=/dev/zero bs=4M conv=fsync, of the same size: dd_mb_s;
//  3. training steps without checkpoints, then with a background checkpoint
//     (tempdir) every K steps: stall_fraction = extra time of a checkpointing
//     step over the median step time.
// Last line: one JSON object. Usage: bench_checkpoint [--smoke] [--device cuda] [dir] [K]
// --device cuda: the model and its optimizer state in GPU memory (writes copy
// it to pinned host memory first; loads copy it back).
// --smoke: does the bench still run? A tiny GPT (~0.4 MB of state), one round
// of 1 and 2, K = 2 and one checkpointing round of 3; figures meaningless (CTest
// runs it, label bench). <dir> is emptied first and removed at the end.
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "char_dataset.h"
#include "gpt_model.h"
#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/worker/varuna.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

uint64_t directoryBytes(const fs::path& dir) {
  uint64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) total += e.file_size();
  }
  return total;
}

double ddMegabytesPerSecond(const fs::path& dir, uint64_t bytes) {
  const auto file = dir / "dd.bin";
  const uint64_t blocks = std::max<uint64_t>(1, bytes / (4 << 20));
  const std::string cmd = "dd if=/dev/zero of='" + file.string() + "' bs=4M count=" + std::to_string(blocks) +
                          " conv=fsync status=none";
  const auto start = Clock::now();
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("dd failed: " + cmd);
  const double s = seconds(start);
  fs::remove(file);
  return static_cast<double>(blocks * (4 << 20)) / 1e6 / s;
}

}  // namespace

int main(int argc, char** argv) {
  bool smoke = false;
  torch::Device device = torch::kCPU;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--smoke") {
      smoke = true;
    } else if (arg == "--device" && i + 1 < argc) {
      const std::string name = argv[++i];
      if (name != "cpu" && name != "cuda") {
        std::cerr << "bench_checkpoint: --device must be cpu or cuda, got '" << name << "'" << std::endl;
        return 2;
      }
      device = name == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
    } else if (arg.rfind("-", 0) == 0) {
      std::cerr << "bench_checkpoint: unknown option " << arg << "; usage: bench_checkpoint [--smoke] [--device cuda] [dir] [K]"
                << std::endl;
      return 2;
    } else {
      positional.push_back(arg);
    }
  }
  const fs::path root =
      positional.size() > 0 ? fs::path(positional[0]) : fs::temp_directory_path() / "varuna_bench_checkpoint";
  const int every = positional.size() > 1 ? std::atoi(positional[1].c_str()) : smoke ? 2 : 4;
  if (every < 1) {
    std::cerr << "bench_checkpoint: K (checkpoint every K steps) must be a positive integer, got " << positional[1]
              << std::endl;
    return 2;
  }
  const int writeRounds = smoke ? 1 : 5;
  const int checkpointRounds = smoke ? 1 : 3;
  fs::remove_all(root);
  fs::create_directories(root);
  varuna::log::configure({.component = "bench_checkpoint"}, varuna::log::Level::kWarn);
  torch::set_num_threads(1);

  const auto data = gpt::CharDataset::fromPath("/usr/share/common-licenses");
  gpt::GptConfig config{.vocabSize = data.vocabSize(), .dModel = 512, .heads = 8, .layers = 6, .seqLen = 64};
  if (smoke) config = {.vocabSize = data.vocabSize(), .dModel = 32, .heads = 2, .layers = 2, .seqLen = 16};
  varuna::VarunaOptions options;
  options.model = gpt::makeGptModel(config);
  options.stageToRankMap = "0;";
  options.rendezvous.masterPort = 0;
  options.batchSize = 4;
  options.chunkSize = 4;
  options.device = device;
  options.getBatch = [&](int64_t n, torch::Device on) {
    auto b = data.samples(0, n, config.seqLen, 1);
    for (auto& [key, t] : b) t = t.to(on);
    return b;
  };
  varuna::Varuna model(options);
  model.setOptimizer(std::make_shared<torch::optim::AdamW>(model.parameters(), torch::optim::AdamWOptions(1e-4)));
  auto batch = [&](int64_t step) { return data.samples(step * 4, 4, config.seqLen, 1); };
  int64_t step = 0;
  auto timedStep = [&] {
    const auto start = Clock::now();
    model.step(batch(step++), 1.0);
    return seconds(start);
  };
  timedStep();  // creates the AdamW state
  timedStep();

  // 1 and 2, interleaved so both see the same disk (its speed drifts here):
  // a synchronous checkpoint, then dd of the same size to the same directory.
  const fs::path store = root / "store";
  std::vector<double> writes, loads, dds;
  uint64_t bytes = 0;
  for (int i = 0; i < writeRounds; ++i) {
    const auto start = Clock::now();
    model.checkpoint(store.string(), 1000 + i);
    writes.push_back(seconds(start));
    bytes = directoryBytes(varuna::ckpt::checkpointDir(store, 1000 + i));
    const auto loadStart = Clock::now();
    model.loadCheckpoint(store.string(), 1000 + i);
    if (device.is_cuda()) torch::cuda::synchronize();
    loads.push_back(seconds(loadStart));
    fs::remove_all(varuna::ckpt::checkpointDir(store, 1000 + i));
    dds.push_back(ddMegabytesPerSecond(root, bytes));
    std::cerr << "round " << i << ": checkpoint " << bytes / 1e6 << " MB in " << writes.back() << " s; dd "
              << dds.back() << " MB/s" << std::endl;
  }
  const double writeMbS = bytes / 1e6 / median(writes);
  const double loadMbS = bytes / 1e6 / median(loads);
  const double ddMbS = median(dds);
  const double ddBestMbS = *std::max_element(dds.begin(), dds.end());
  std::cerr << "dd: " << ddMbS << " MB/s; varuna: " << writeMbS << " MB/s" << std::endl;

  // 3. Training with and without background checkpoints.
  std::vector<double> plain, checkpointing;
  for (int i = 0; i < 2 * every; ++i) plain.push_back(timedStep());
  const double stepTime = median(plain);
  const fs::path tempdir = root / "local";
  for (int round = 0; round < checkpointRounds; ++round) {
    for (int i = 0; i < every; ++i) {
      const auto start = Clock::now();
      model.step(batch(step++), 1.0);
      if (i == every - 1) model.checkpoint(varuna::CheckpointRequest{store.string(), step, tempdir.string()});
      (i == every - 1 ? checkpointing : plain).push_back(seconds(start));
    }
  }
  model.waitForCheckpoints();
  const double checkpointingStep = median(checkpointing);
  const double stall = (checkpointingStep - stepTime) / stepTime;
  const bool landed = varuna::ckpt::latestComplete(store).has_value();
  std::cerr << "step " << stepTime << " s, checkpointing step " << checkpointingStep << " s, background "
            << "checkpoints complete: " << (landed ? "yes" : "NO") << std::endl;
  fs::remove_all(root);

  nlohmann::json out = {{"checkpoint_mb", bytes / 1e6},
                        {"write_mb_s", writeMbS},
                        {"load_mb_s", loadMbS},
                        {"device", device.str()},
                        {"dd_mb_s", ddMbS},
                        {"write_fraction_of_dd", writeMbS / ddMbS},
                        {"dd_best_mb_s", ddBestMbS},
                        {"write_fraction_of_dd_best", writeMbS / ddBestMbS},
                        {"step_time_s", stepTime},
                        {"step_time_with_bg_ckpt_s", checkpointingStep},
                        {"checkpoint_every", every},
                        {"stall_fraction", stall},
                        {"background_checkpoints_complete", landed},
                        {"smoke", smoke}};
  std::cout << out.dump() << std::endl;
  return landed ? 0 : 1;
}
