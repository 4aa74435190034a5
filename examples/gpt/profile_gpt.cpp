// Profiles the example GPT for AutoConfig and the simulator (docs/profile.md).
// Started like train_gpt, once per worker, by a launcher (run_varuna,
// scripts/varuna_launch.py, torchrun) or by hand; any number of workers shares
// the pieces. The model flags are train_gpt's, so a profile matches the model
// train_gpt trains with the same flags; rank 0 writes <profile_dir>/profile.json.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/utils.h>

#include <cstdio>
#include <iostream>

#include "char_dataset.h"
#include "gpt_main.h"
#include "gpt_model.h"
#include "gpt_options.h"
#include "varuna/common/log.h"
#include "varuna/worker/profiler.h"

namespace {

struct ProfileGptOptions {
  std::string data = "/usr/share/common-licenses";
  uint64_t dataSeed = 7;
  std::string precision = "fp32";
  std::string device = "cpu";
  std::string commBackend = "auto";
  int threads = 1;
  double peerTimeoutSeconds = 60;
  std::string logLevel = "info";
  gpt::GptConfig model;
  varuna::ProfilerOptions profiler;
};

void parseOptions(const std::vector<std::string>& args, ProfileGptOptions& o) {
  CLI::App app{"profile_gpt: profiles the Varuna example GPT's pieces and this job's links"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto& p = o.profiler;
  p.optimizer = "adamw";  // what train_gpt trains with by default
  // Profiler options; the second names are the original manual's.
  app.add_option("--profile_dir,--out_folder", p.outputDir, "folder of profile.json (required)")->required();
  app.add_option("--micro_batch_sizes,--batch_sizes", p.microBatchSizes, "micro-batch sizes, e.g. 1,2,4,8")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->check(CLI::PositiveNumber);
  app.add_option("--pieces,--pstages_to_profile", p.pieces, "pieces to profile, by name or index (default: all)")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--warmup", p.warmup, "untimed runs before the timed ones")->check(CLI::NonNegativeNumber);
  app.add_option("--repetitions", p.repetitions, "timed runs per measurement")->check(CLI::PositiveNumber);
  app.add_flag("--add,--add_to_existing", p.addToExisting,
               "add to the profile already in --profile_dir (refused if the model changed)");
  app.add_flag("--reuse,--from_cache", p.reuseCached,
               "skip what the existing profile already has (implies --add)");
  app.add_option("--optimizer", p.optimizer, "optimizer whose step is timed: adam, adamw or sgd")
      ->check(CLI::IsMember({"adam", "adamw", "sgd"}));
  bool noComm = false;
  app.add_flag("--no_comm", noComm, "skip the point-to-point and all-reduce measurements");
  app.add_option("--comm_repetitions", p.commRepetitions, "timed runs per communication measurement")
      ->check(CLI::PositiveNumber);
  app.add_option("--max_comm_bytes", p.maxCommBytes, "largest message / all-reduce buffer measured")
      ->check(CLI::PositiveNumber);
  // Model and run options, as train_gpt's.
  app.add_option("--data", o.data, "text file or directory of text files (sets the vocabulary)");
  app.add_option("--data_seed", o.dataSeed, "seed of the sample positions");
  app.add_option("--precision", o.precision, "fp32, bf16 or fp16")->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--device", o.device, "cpu, or cuda (cuda:<local_rank>; with --comm_backend gloo, ranks share "
                 "the host's GPUs)")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--comm_backend", o.commBackend, "auto (NCCL on CUDA, Gloo on the CPU), gloo or nccl")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--threads", o.threads, "intra-op threads per worker")->check(CLI::PositiveNumber);
  app.add_option("--peer_timeout_s", o.peerTimeoutSeconds, "declare a silent peer lost after this long");
  app.add_option("--log_level", o.logLevel, "debug, info, warn, error");
  gpt::addModelOptions(app, o.model);
  gpt::parseCommandLine(app, args, "profile_gpt");
  p.profileCommunication = !noComm;
}

void printSummary(const varuna::profile::Profile& profile) {
  std::printf("%-10s %6s %12s %12s %12s %12s %14s %14s\n", "piece", "micro", "forward_ms", "backward_ms",
              "recompute_ms", "output_B", "saved_B", "peak_B");
  for (const auto& piece : profile.pieces) {
    for (const auto& [size, f] : piece.bySize) {
      std::printf("%-10s %6lld %12.3f %12.3f %12.3f %12lld %14lld %14lld\n", piece.name.c_str(),
                  static_cast<long long>(size), f.forward.median * 1e3, f.backward.median * 1e3,
                  f.recompute.median * 1e3, static_cast<long long>(f.outputBytes),
                  static_cast<long long>(f.savedActivationBytes), static_cast<long long>(f.peakBytes));
    }
  }
  auto ms = [](double seconds) { return seconds < 0 ? std::string("n/a") : varuna::strCat(seconds * 1e3, " ms"); };
  for (const auto& s : profile.p2p) {
    std::printf("p2p %lld B: same host %s, other host %s\n", static_cast<long long>(s.bytes),
                ms(s.sameHostSeconds).c_str(), ms(s.crossHostSeconds).c_str());
  }
  for (const auto& s : profile.allreduce) {
    std::printf("allreduce %lld B over %d%s: %.3f ms\n", static_cast<long long>(s.bytes), s.replicas,
                s.crossHost ? " (across hosts)" : "", s.seconds * 1e3);
  }
  std::printf("optimizer %.3g s per parameter\n", profile.optimizerSecondsPerParam);
  std::fflush(stdout);
}

int run(int argc, char** argv) {
  const auto launch = varuna::parseLaunchArgs(argc, argv, varuna::currentEnvironment());
  varuna::log::configure({.component = "profile_gpt", .rank = launch.rank});
  ProfileGptOptions o;
  parseOptions(launch.userArgs, o);
  varuna::log::setLevel(varuna::log::parseLevel(o.logLevel));
  torch::set_num_threads(o.threads);

  const auto data = gpt::CharDataset::fromPath(o.data);
  o.model.vocabSize = data.vocabSize();
  auto& options = o.profiler;
  options.applyLaunchArgs(launch);
  options.precision = varuna::parsePrecision(o.precision);
  options.commBackend = varuna::parseCommBackend(o.commBackend);
  options.device = o.device == "cuda" ? varuna::cudaDeviceForLocalRank(launch.localRank, options.commBackend)
                                      : torch::Device(torch::kCPU);
  options.peerTimeout = std::chrono::milliseconds(static_cast<int64_t>(o.peerTimeoutSeconds * 1000));
  const int64_t seqLen = o.model.seqLen;
  const uint64_t dataSeed = o.dataSeed;
  auto getBatch = [&data, seqLen, dataSeed](int64_t size, torch::Device device) {
    auto batch = data.samples(0, size, seqLen, dataSeed);
    for (auto& [key, t] : batch) t = t.to(device);
    return batch;
  };

  varuna::Profiler profiler(gpt::makeGptModel(o.model), getBatch, options);
  const auto profile = profiler.run();
  if (launch.rank == 0) {
    printSummary(profile);
    std::cout << "wrote " << varuna::profilePath(options.outputDir) << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return gpt::runMain(run, argc, argv); }
