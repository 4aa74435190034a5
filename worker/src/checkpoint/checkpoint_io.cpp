#include "checkpoint/checkpoint_io.h"

#include "varuna/worker/tensor_file.h"

#include <filesystem>

#include <ATen/Context.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>

#include "varuna/common/checkpoint_files.h"

namespace varuna {

void writeTensorArchive(const NamedTensors& tensors, const std::function<void(const void*, size_t)>& sink) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, t] : tensors) dict.insert(name, t.detach().cpu().contiguous());
  // As torch::pickle_save, but streaming and with tag_aggregates=false: a
  // plain dict that torch.load accepts with weights_only=True.
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&pickle](const char* buf, size_t size) { pickle.insert(pickle.end(), buf, buf + size); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(dict);
  pickler.stop();
  // The zip's own CRC32 is left out (as torch.serialization.config.save.
  // compute_crc32 = False does; PyTorch's reader does not check it): the
  // manifest already holds a checksum of every file.
  //
  // The sink's failure (a full disk) must not unwind through the zip writer:
  // its destructor would write the end of the archive and throw a second time,
  // which terminates the process. The first failure is kept, later writes are
  // dropped, and it is rethrown once the writer is done.
  std::exception_ptr failure;
  {
    caffe2::serialize::PyTorchStreamWriter writer(
        [&sink, &failure](const void* data, size_t size) {
          if (failure) return size;
          try {
            sink(data, size);
          } catch (...) {
            failure = std::current_exception();
          }
          return size;
        },
        /*compute_crc32=*/false);
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();
  }
  if (failure) std::rethrow_exception(failure);
}

std::map<std::string, torch::Tensor> unpickleTensors(const std::string& bytes, const std::string& source) {
  std::map<std::string, torch::Tensor> out;
  try {
    const auto value = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
    for (const auto& entry : value.toGenericDict()) out[entry.key().toStringRef()] = entry.value().toTensor();
  } catch (const std::exception& e) {
    throw ckpt::DamagedError(strCat("'", source, "' is not a tensor dictionary: ", e.what()));
  }
  return out;
}

namespace {

template <typename State>
State* stateOf(torch::optim::Optimizer& optimizer, const torch::Tensor& p) {
  auto it = optimizer.state().find(p.unsafeGetTensorImpl());
  return it == optimizer.state().end() ? nullptr : static_cast<State*>(it->second.get());
}

enum class Kind { kSgd, kAdam, kAdamW };

Kind kindOf(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return Kind::kAdamW;
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return Kind::kAdam;
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return Kind::kSgd;
  throw ConfigError("checkpoints support the SGD, Adam and AdamW optimizers; this optimizer's state cannot be saved");
}

torch::Tensor stepTensor(int64_t step) { return torch::tensor({step}, torch::kLong); }

template <typename AdamState>
void saveAdam(AdamState* s, const std::string& name, NamedTensors& out) {
  out.push_back({name + "/step", stepTensor(s->step())});
  out.push_back({name + "/exp_avg", s->exp_avg()});
  out.push_back({name + "/exp_avg_sq", s->exp_avg_sq()});
  if (s->max_exp_avg_sq().defined()) out.push_back({name + "/max_exp_avg_sq", s->max_exp_avg_sq()});
}

template <typename AdamState>
std::unique_ptr<torch::optim::OptimizerParamState> loadAdam(const std::string& name, const torch::Tensor& p,
                                                            const std::map<std::string, torch::Tensor>& saved) {
  auto s = std::make_unique<AdamState>();
  s->step(saved.at(name + "/step").item<int64_t>());
  s->exp_avg(saved.at(name + "/exp_avg").to(p.device()));
  s->exp_avg_sq(saved.at(name + "/exp_avg_sq").to(p.device()));
  if (auto it = saved.find(name + "/max_exp_avg_sq"); it != saved.end()) s->max_exp_avg_sq(it->second.to(p.device()));
  return s;
}

}  // namespace

NamedTensors optimizerState(torch::optim::Optimizer& optimizer, const NamedTensors& params) {
  const Kind kind = kindOf(optimizer);
  NamedTensors out;
  for (const auto& [name, p] : params) {
    switch (kind) {
      case Kind::kAdamW:
        if (auto* s = stateOf<torch::optim::AdamWParamState>(optimizer, p)) saveAdam(s, name, out);
        break;
      case Kind::kAdam:
        if (auto* s = stateOf<torch::optim::AdamParamState>(optimizer, p)) saveAdam(s, name, out);
        break;
      case Kind::kSgd:
        if (auto* s = stateOf<torch::optim::SGDParamState>(optimizer, p); s && s->momentum_buffer().defined()) {
          out.push_back({name + "/momentum_buffer", s->momentum_buffer()});
        }
        break;
    }
  }
  return out;
}

DecodedOptimizerState decodeOptimizerState(torch::optim::Optimizer& optimizer, const NamedTensors& params,
                                           const std::map<std::string, torch::Tensor>& saved,
                                           const std::string& source) {
  const Kind kind = kindOf(optimizer);
  DecodedOptimizerState decoded;
  for (const auto& [name, p] : params) {
    const std::string probe = kind == Kind::kSgd ? name + "/momentum_buffer" : name + "/step";
    if (!saved.count(probe)) {  // the parameter had no state yet
      decoded.withoutState.push_back(p);
      continue;
    }
    try {
      std::unique_ptr<torch::optim::OptimizerParamState> state;
      if (kind == Kind::kAdamW) state = loadAdam<torch::optim::AdamWParamState>(name, p, saved);
      if (kind == Kind::kAdam) state = loadAdam<torch::optim::AdamParamState>(name, p, saved);
      if (kind == Kind::kSgd) {
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(saved.at(probe).to(p.device()));
        state = std::move(s);
      }
      decoded.states.emplace_back(p, std::move(state));
    } catch (const std::out_of_range&) {
      throw ConfigError(strCat("'", source, "' lacks part of the optimizer state of '", name,
                               "' (was it written with another optimizer?)"));
    }
  }
  return decoded;
}

void applyOptimizerState(torch::optim::Optimizer& optimizer, DecodedOptimizerState decoded) {
  for (const auto& p : decoded.withoutState) optimizer.state().erase(p.unsafeGetTensorImpl());
  for (auto& [p, state] : decoded.states) optimizer.state()[p.unsafeGetTensorImpl()] = std::move(state);
}

nlohmann::json optimizerSettings(torch::optim::Optimizer& optimizer) {
  auto& options = optimizer.param_groups().at(0).options();
  nlohmann::json j;
  switch (kindOf(optimizer)) {
    case Kind::kAdamW: {
      auto& o = static_cast<torch::optim::AdamWOptions&>(options);
      j = {{"type", "adamw"}, {"lr", o.lr()}, {"beta1", std::get<0>(o.betas())}, {"beta2", std::get<1>(o.betas())},
           {"eps", o.eps()}, {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad()}};
      break;
    }
    case Kind::kAdam: {
      auto& o = static_cast<torch::optim::AdamOptions&>(options);
      j = {{"type", "adam"}, {"lr", o.lr()}, {"beta1", std::get<0>(o.betas())}, {"beta2", std::get<1>(o.betas())},
           {"eps", o.eps()}, {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad()}};
      break;
    }
    case Kind::kSgd: {
      auto& o = static_cast<torch::optim::SGDOptions&>(options);
      j = {{"type", "sgd"}, {"lr", o.lr()}, {"momentum", o.momentum()}, {"dampening", o.dampening()},
           {"weight_decay", o.weight_decay()}, {"nesterov", o.nesterov()}};
      break;
    }
  }
  return j;
}

void checkOptimizerSettings(torch::optim::Optimizer& optimizer, const nlohmann::json& j) {
  checkSameOptimizerType(optimizerSettings(optimizer), j);
}

void checkSameOptimizerType(const nlohmann::json& current, const nlohmann::json& saved) {
  const std::string type = saved.is_object() ? saved.value("type", "") : "";
  const std::string expected = current.value("type", "");
  if (type != expected) {
    throw ConfigError(strCat("the checkpoint was written with optimizer '", type, "' but this job uses '", expected,
                             "'"));
  }
  if (!saved.contains("lr") || !saved["lr"].is_number()) {
    throw ConfigError("the checkpoint's optimizer settings have no lr");
  }
}

namespace {

// libtorch's optimizers through the functions above.
class TorchStageOptimizer : public StageOptimizer {
 public:
  explicit TorchStageOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer) : optimizer_(std::move(optimizer)) {}
  void step() override { optimizer_->step(); }
  NamedTensors state(const NamedTensors& params) override { return optimizerState(*optimizer_, params); }
  std::function<void()> decodeState(const NamedTensors& params, const std::map<std::string, torch::Tensor>& saved,
                                    const std::string& source) override {
    auto decoded = std::make_shared<DecodedOptimizerState>(decodeOptimizerState(*optimizer_, params, saved, source));
    return [optimizer = optimizer_, decoded] { applyOptimizerState(*optimizer, std::move(*decoded)); };
  }
  nlohmann::json settings() override { return optimizerSettings(*optimizer_); }
  void checkSettings(const nlohmann::json& saved) override { checkOptimizerSettings(*optimizer_, saved); }
  void applySettings(const nlohmann::json& saved) override { applyOptimizerSettings(*optimizer_, saved); }

 private:
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
};

}  // namespace

std::shared_ptr<StageOptimizer> wrapTorchOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer) {
  if (!optimizer) throw ConfigError("setOptimizer: the optimizer is null");
  return std::make_shared<TorchStageOptimizer>(std::move(optimizer));
}

void applyOptimizerSettings(torch::optim::Optimizer& optimizer, const nlohmann::json& j) {
  // The learning rate may have been scheduled: it is the one value to carry over.
  for (auto& group : optimizer.param_groups()) group.options().set_lr(j.at("lr").get<double>());
}

NamedTensors generatorStates(torch::Device device) {
  NamedTensors out;
  auto save = [&out](const char* key, at::Generator gen) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.push_back({key, gen.get_state()});
  };
  save("cpu", at::globalContext().defaultGenerator(torch::kCPU));
  if (device.is_cuda()) save("cuda", at::globalContext().defaultGenerator(device));
  return out;
}

void restoreGeneratorStates(torch::Device device, const std::map<std::string, torch::Tensor>& states) {
  auto restore = [&states](const char* key, at::Generator gen) {
    auto it = states.find(key);
    if (it == states.end()) return;
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(it->second);
  };
  restore("cpu", at::globalContext().defaultGenerator(torch::kCPU));
  if (device.is_cuda()) restore("cuda", at::globalContext().defaultGenerator(device));
}

}  // namespace varuna

namespace varuna {

void saveTensorFile(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  const std::filesystem::path p(path);
  ckpt::writeFileStreaming(p.parent_path().empty() ? "." : p.parent_path(), p.filename().string(),
                           [&tensors](const ckpt::Sink& sink) { writeTensorArchive(tensors, sink); });
}

std::map<std::string, torch::Tensor> loadTensorFile(const std::string& path) {
  return unpickleTensors(ckpt::readFile(path), path);
}

}  // namespace varuna
