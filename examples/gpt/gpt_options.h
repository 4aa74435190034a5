// The example model's command-line options and the parsing of the command
// line, shared by train_gpt and profile_gpt so a profile always describes the
// model the same flags train, and both answer a bad flag the same way.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "gpt_model.h"
#include "varuna/common/errors.h"

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
      "--tie_head_first", [&model](int64_t) { model.tieHeadFirst = true; },
      "declare the tied pair head first (tests: the declaration order must not change training)");
  app.add_flag_function(
      "--batchnorm", [&model](int64_t) { model.batchNorm = true; },
      "start every block with a BatchNorm1d over (batch x seq_len, d_model): running-statistics buffers");
}

// Parses `args`, the program's own arguments (LaunchArgs::userArgs: what the
// launcher added removed), with `app`. --help prints the help and exits 0; a
// bad argument is a ConfigError naming `program` and the option.
inline void parseCommandLine(CLI::App& app, const std::vector<std::string>& args, const std::string& program) {
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11's parse(vector) wants them last first
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help() << std::endl;
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    throw varuna::ConfigError(varuna::strCat(program, ": ", e.what(), " (see --help)"));
  }
}

}  // namespace gpt
