#include "worker_job.h"

#include <nlohmann/json.hpp>
#include <torch/serialize.h>

#include <fstream>
#include <limits>
#include <sstream>

#include "test_env.h"
#include "varuna/common/stage_map.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

namespace varuna::test {

std::filesystem::path trainGptBinary() { return buildDir() / "examples" / "gpt" / "train_gpt"; }

WorkerJob::WorkerJob(const WorkerJobSpec& spec, const std::filesystem::path& dir) : dir_(dir) {
  std::filesystem::create_directories(dir);
  const int world = spec.stages * spec.replicas;
  c10d::TCPStoreOptions opts;
  opts.port = 0;
  opts.isServer = true;
  opts.numWorkers = world;
  opts.waitWorkers = false;
  store_ = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  const std::string map = StageToRankMap::clustered(spec.stages, spec.replicas).toString();
  for (int rank = 0; rank < world; ++rank) {
    std::vector<std::string> argv = {trainGptBinary().string(), "--rank", std::to_string(rank),
                                     "--local_rank", std::to_string(rank), "--stage_to_rank_map", map,
                                     "--chunk_size", std::to_string(spec.chunkSize),
                                     "--batch-size", std::to_string(spec.perReplicaBatch),
                                     "--master_addr", "127.0.0.1", "--master_port", std::to_string(store_->getPort()),
                                     "--external_store", "--dump_dir", dir.string()};
    argv.insert(argv.end(), spec.trainArgs.begin(), spec.trainArgs.end());
    auto env = spec.env;
    env["WORLD_SIZE"] = std::to_string(world);
    workers_.emplace_back(argv, env, dir / ("worker" + std::to_string(rank)));
  }
}

std::vector<int> WorkerJob::waitAll(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<int> codes;
  for (auto& w : workers_) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    auto code = w.wait(std::max(left, std::chrono::milliseconds(0)));
    codes.push_back(code ? *code : -1);
  }
  return codes;
}

std::vector<StepRecord> WorkerJob::steps(int rank) const {
  std::vector<StepRecord> records;
  std::ifstream in(dir_ / ("rank" + std::to_string(rank) + "_steps.jsonl"));
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    // JSON has no inf/NaN: the trainer writes them as null.
    auto number = [&j](const char* key) {
      return j[key].is_null() ? std::numeric_limits<double>::quiet_NaN() : j[key].get<double>();
    };
    records.push_back({j["step"], number("loss"), j["overflow"], number("grad_norm"), number("loss_scale")});
  }
  return records;
}

double WorkerJob::evalLoss(int rank) const {
  std::ifstream in(dir_ / ("rank" + std::to_string(rank) + "_eval.json"));
  return nlohmann::json::parse(in).at("eval_loss").get<double>();
}

std::map<std::string, torch::Tensor> WorkerJob::params(int rank) const { return readTensors(rank, "params"); }

std::map<std::string, torch::Tensor> WorkerJob::initialParams(int rank) const {
  return readTensors(rank, "initial");
}

std::map<std::string, torch::Tensor> WorkerJob::readTensors(int rank, const std::string& kind) const {
  std::ifstream in(dir_ / ("rank" + std::to_string(rank) + "_" + kind + ".pt"), std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, torch::Tensor> out;
  if (bytes.empty()) return out;
  for (const auto& entry : torch::pickle_load(bytes).toGenericDict()) {
    out[entry.key().toStringRef()] = entry.value().toTensor();
  }
  return out;
}

}  // namespace varuna::test

namespace varuna::test {

void requireAllSucceeded(WorkerJob& job, std::chrono::seconds timeout) {
  const auto codes = job.waitAll(timeout);
  for (int r = 0; r < job.worldSize(); ++r) {
    INFO("rank " << r << " exit code " << codes[r] << ", stderr:\n" << job.worker(r).stderrText());
    REQUIRE(codes[r] == 0);
  }
}

}  // namespace varuna::test
