// A GPT-style decoder split into pieces for Varuna: "embed" (token and position
// embeddings), "block0".."blockN-1" (pre-norm transformer blocks) and "head"
// (final norm, LM head tied to the token embedding, cross-entropy loss).
// Inputs: "tokens" and "targets", both int64 (b, seq_len).
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
};

// Pieces, parameter counts and (if tieEmbeddings) the shared-weight pair
// {"embed.wte.weight", "head.lm_head.weight"}.
varuna::ModelSpec makeGptModel(const GptConfig& config);

}  // namespace gpt
