// A GPT-style decoder split into pieces for Varuna: "embed" (token and position
// embeddings), "block0".."blockN-1" (pre-norm transformer blocks) and "head"
// (final norm, LM head tied to the token embedding, cross-entropy loss).
// Inputs: "tokens" and "targets", both int64 (b, seq_len).
//
// With batchNorm, each block first normalises its input with a BatchNorm1d
// over the (b * seq_len, d_model) view ("block<i>.bn"): a piece with running
// statistics (running_mean, running_var, num_batches_tracked buffers), for
// testing that buffers are model state. In training mode it normalises with
// the micro-batch's own statistics, so results depend on the micro-batch size.
#pragma once

#include <cstdint>

#include "varuna/worker/model.h"

namespace gpt {

struct GptConfig {
  int64_t vocabSize = 96;
  int64_t dModel = 128;
  int64_t heads = 4;
  int64_t layers = 8;
  int64_t seqLen = 64;
  double dropout = 0.0;
  uint64_t seed = 1234;
  bool tieEmbeddings = true;
  bool tieHeadFirst = false;  // declare the tied pair as (head, embedding): the order must not matter
  bool batchNorm = false;  // a BatchNorm1d at the start of every block
};

// Pieces, parameter counts and (if tieEmbeddings) the shared-weight pair
// {"embed.wte.weight", "head.lm_head.weight"}.
varuna::ModelSpec makeGptModel(const GptConfig& config);

}  // namespace gpt
