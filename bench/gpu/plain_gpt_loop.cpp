// The yardstick of bench_gpu.py's engine-overhead row: the example GPT trained
// by a plain libtorch loop in one process, with no Varuna in it. The same
// pieces (gpt_model.h), the same data, the same AdamW, autocast as the
// runtime uses it; one forward and backward over the batch, the loss read
// back every step as any training loop logs it. Untied (the runtime's tie
// across pieces costs a gradient sum the plain loop would not pay).
//
//   plain_gpt_loop --device cuda --precision bf16 --d_model 1024 --layers 24 --heads 16 --seq_len 1024
//                  --batch 8 --steps 30 --warmup 5
// Last line: {"tokens_per_s", "step_s_median", "params", ...}.
#include <ATen/autocast_mode.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <iostream>

#include "char_dataset.h"
#include "gpt_model.h"
#include "gpt_options.h"

namespace {

struct Options {
  std::string device = "cuda";
  std::string precision = "bf16";
  std::string data = "/usr/share/common-licenses";
  int64_t batch = 8;
  int64_t steps = 30;
  int64_t warmup = 5;
  double lr = 3e-4;
  gpt::GptConfig model;
};

at::ScalarType autocastType(const std::string& precision) {
  return precision == "fp16" ? at::kHalf : at::kBFloat16;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.model.tieEmbeddings = false;
  CLI::App app{"plain_gpt_loop: the example GPT in a plain libtorch training loop"};
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--precision", o.precision, "fp32, bf16 or fp16 (autocast; no loss scaling)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--data", o.data, "text file or folder");
  app.add_option("--batch", o.batch, "samples per step")->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", o.lr, "AdamW learning rate");
  gpt::addModelOptions(app, o.model);
  CLI11_PARSE(app, argc, argv);

  const torch::Device device = o.device == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  const auto data = gpt::CharDataset::fromPath(o.data);
  o.model.vocabSize = data.vocabSize();
  const auto spec = gpt::makeGptModel(o.model);
  std::vector<std::shared_ptr<varuna::Piece>> pieces;
  std::vector<torch::Tensor> params;
  for (int i = 0; i < static_cast<int>(spec.pieces.size()); ++i) {
    pieces.push_back(varuna::buildPiece(spec, i));
    pieces.back()->to(device);
    for (const auto& p : pieces.back()->parameters()) params.push_back(p);
  }
  int64_t count = 0;
  for (const auto& p : params) count += p.numel();
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(o.lr).weight_decay(0.0));

  const bool autocast = o.precision != "fp32";
  std::vector<double> seconds;
  for (int64_t step = 0; step < o.warmup + o.steps; ++step) {
    auto batch = data.samples(step * o.batch, o.batch, o.model.seqLen, 7);
    for (auto& [key, t] : batch) t = t.to(device);
    const auto start = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    torch::Tensor x;
    {
      at::autocast::set_autocast_enabled(device.type(), autocast);
      at::autocast::set_autocast_dtype(device.type(), autocastType(o.precision));
      for (auto& piece : pieces) x = piece->forward(x, batch);
      at::autocast::set_autocast_enabled(device.type(), false);
      at::autocast::clear_cache();
    }
    x.backward();
    optimizer.step();
    const double loss = x.item<double>();  // as every loop logs it: a synchronisation per step
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (step >= o.warmup) seconds.push_back(s);
    if (step % 10 == 0) std::cerr << "step " << step << " loss " << loss << " " << s << " s" << std::endl;
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  std::cout << nlohmann::json{{"tokens_per_s", static_cast<double>(o.batch * o.model.seqLen) / median},
                              {"step_s_median", median},
                              {"params", count},
                              {"batch", o.batch},
                              {"seq_len", o.model.seqLen},
                              {"precision", o.precision},
                              {"device", o.device}}
                   .dump()
            << std::endl;
  return 0;
}
