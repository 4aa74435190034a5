// What splitting a piece's backward costs: one transformer block of the
// example GPT (gpt_model.h), its backward whole (what 1F1B and interleaved
// run) against the two halves the zero-bubble schedules run (SplitBackward:
// B, the input's gradient, then W, the weights'). The "peer" is the whole
// backward: B + W should cost what it does, since the halves compute the same
// products. Rounds alternate the two, one thread, gradients accumulating
// into kept .grad tensors as the runtime's buckets do; medians, the page
// faults (minor faults of this process) each part took, and what the split
// holds from B to W (heap bytes in use after B over those before the
// forward: activations W reads, kept gradients, the input's gradient).
//
//   bench_split_backward [--d_model 256 --heads 4 --seq_len 128 --micro_batch 2 --rounds 40]
//                        [--retain_freed_memory]
//
// --retain_freed_memory: glibc keeps what is freed (no trimming, no
// mappings for large blocks), so a part's temporaries land on pages already
// touched; what is left over whole is then the split's own cost.
// Last line: one JSON object.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>

#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sys/resource.h>

#include "gpt_model.h"
#include "pipeline/split_backward.h"

namespace {

using Clock = std::chrono::steady_clock;

// Bytes the C library's heap has handed out (glibc; 0 elsewhere).
double heapInUse() {
#if defined(__GLIBC__)
  const struct mallinfo2 info = mallinfo2();
  return static_cast<double>(info.uordblks + info.hblkhd);
#else
  return 0;
#endif
}

long minorFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Time and page faults of one call.
struct Cost {
  double ms = 0;
  long faults = 0;
};

template <typename F>
Cost measure(F&& f) {
  const long faults = minorFaults();
  const auto start = Clock::now();
  f();
  return {std::chrono::duration<double, std::milli>(Clock::now() - start).count(), minorFaults() - faults};
}

struct Series {
  std::vector<double> ms;
  std::vector<double> faults;
  void add(const Cost& c) {
    ms.push_back(c.ms);
    faults.push_back(static_cast<double>(c.faults));
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

bool retainFreedMemory() {
#if defined(__GLIBC__)
  return mallopt(M_MMAP_THRESHOLD, 256 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_split_backward: a transformer block's backward whole against its B and W halves"};
  int64_t dModel = 256, heads = 4, seqLen = 128, microBatch = 2;
  int rounds = 40;
  bool smoke = false, retain = false;
  app.add_option("--d_model", dModel, "model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--seq_len", seqLen, "tokens per sample")->check(CLI::PositiveNumber);
  app.add_option("--micro_batch", microBatch, "samples per micro-batch")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "timed rounds of each (after 5 untimed)")->check(CLI::PositiveNumber);
  app.add_flag("--retain_freed_memory", retain, "glibc keeps freed memory (no trimming, no large mappings)");
  app.add_flag("--smoke", smoke, "a tiny block, 3 rounds: does the bench still run?");
  CLI11_PARSE(app, argc, argv);
  if (dModel % heads != 0) {
    std::cerr << "bench_split_backward: --d_model " << dModel << " is not a multiple of --heads " << heads << "\n";
    return 2;
  }
  if (smoke) {
    dModel = 32, heads = 2, seqLen = 16, microBatch = 1, rounds = 3;
  }
  if (retain && !retainFreedMemory()) {
    std::cerr << "bench_split_backward: this C library refused the thresholds of --retain_freed_memory\n";
    return 2;
  }
  at::set_num_threads(1);

  gpt::GptConfig config;
  config.dModel = dModel, config.heads = heads, config.seqLen = seqLen;
  auto spec = gpt::makeGptModel(config);
  auto block = spec.pieces.at(1).make();  // block0
  const std::vector<torch::Tensor> params = block->parameters();
  for (auto p : params) p.mutable_grad() = torch::zeros_like(p);  // accumulated into, as bucket views are
  const auto sample = torch::randn({microBatch, seqLen, dModel});
  const varuna::Batch noInputs;

  Series forward, whole, halfB, halfW, split;
  std::vector<double> heldForW;
  const int warmup = 5;
  bool splitExact = true;
  for (int round = 0; round < warmup + rounds; ++round) {
    const bool timed = round >= warmup;
    for (const bool halves : {false, true}) {
      auto input = sample.clone().requires_grad_(true);
      const double heapBefore = heapInUse();
      torch::Tensor out;
      const Cost f = measure([&] { out = block->forward(input, noInputs); });
      const auto grad = torch::ones_like(out);
      if (!halves) {
        const Cost w = measure([&] { torch::autograd::backward({out}, {grad}); });
        if (timed) forward.add(f), whole.add(w);
        continue;
      }
      varuna::SplitBackward backward(out, grad, input, params);
      splitExact = splitExact && backward.mode() == varuna::SplitBackward::Mode::kSplit;
      const Cost b = measure([&] { backward.inputGradient(); });
      if (timed) heldForW.push_back(heapInUse() - heapBefore);
      const Cost w = measure([&] { backward.weightGradient(); });
      if (timed) halfB.add(b), halfW.add(w), split.add({b.ms + w.ms, b.faults + w.faults});
    }
  }
  if (!splitExact) {
    std::cerr << "bench_split_backward: the block's backward did not split into B and W (SplitBackward::mode)\n";
    return 1;
  }

  const double wholeMs = median(whole.ms), splitMs = median(split.ms);
  std::cout << "block of d_model " << dModel << ", " << heads << " heads, " << microBatch << " x " << seqLen
            << " tokens, one thread, " << rounds << " rounds, freed memory "
            << (retain ? "retained" : "the C library's default") << "\n"
            << "  forward          " << median(forward.ms) << " ms\n"
            << "  backward, whole  " << wholeMs << " ms, " << median(whole.faults) << " page faults\n"
            << "  B + W            " << splitMs << " ms (B " << median(halfB.ms) << " + W " << median(halfW.ms) << "), "
            << median(split.faults) << " page faults (B " << median(halfB.faults) << ", W " << median(halfW.faults)
            << ")\n"
            << "  split over whole " << splitMs / wholeMs << "\n"
            << "  held from B to W " << median(heldForW) / 1e6 << " MB\n";
  nlohmann::json out = {{"forward_ms", median(forward.ms)},
                        {"whole_backward_ms", wholeMs},
                        {"split_backward_ms", splitMs},
                        {"b_ms", median(halfB.ms)},
                        {"w_ms", median(halfW.ms)},
                        {"split_over_whole", splitMs / wholeMs},
                        {"faults_whole", median(whole.faults)},
                        {"faults_split", median(split.faults)},
                        {"held_b_to_w_mb", median(heldForW) / 1e6},
                        {"retain_freed_memory", retain},
                        {"config",
                         {{"d_model", dModel}, {"heads", heads}, {"seq_len", seqLen}, {"micro_batch", microBatch}}},
                        {"rounds", rounds},
                        {"smoke", smoke}};
  std::cout << out.dump() << std::endl;
  return 0;
}
