// The example model's command-line options, shared by train_gpt and
// profile_gpt so a profile always describes the model the same flags train.
#pragma once

#include <CLI/CLI.hpp>

#include "gpt_model.h"

namespace gpt {

inline void addModelOptions(CLI::App& app, GptConfig& model) {
  app.add_option("--d_model", model.dModel, "model width")->check(CLI::PositiveNumber);
  app.add_option("--layers", model.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--heads", model.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--seq_len", model.seqLen, "characters per sample")->check(CLI::PositiveNumber);
  app.add_option("--dropout", model.dropout, "dropout probability");
  app.add_option("--model_seed", model.seed, "seed of the initial weights");
  app.add_flag_function(
      "--untied", [&model](int64_t) { model.tieEmbeddings = false; },
      "do not tie the LM head to the token embedding");
  app.add_flag_function(
      "--batchnorm", [&model](int64_t) { model.batchNorm = true; },
      "start every block with a BatchNorm1d over (batch x seq_len, d_model): running-statistics buffers");
}

}  // namespace gpt
