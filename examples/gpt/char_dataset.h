// Character-level language-modelling data from real English text files.
//
// Sample k of the run is a window of seq_len+1 characters whose position is a
// function of (seed, k) only. A step's global batch is samples
// [step*B, (step+1)*B), and replica r of D takes the r-th contiguous slice, so
// the data a job sees does not depend on how many replicas it has: a job
// resumed at another width continues with exactly the same global batches.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "varuna/worker/model.h"

namespace gpt {

class CharDataset {
 public:
  // Reads `path`: a file, or every regular file of a directory (sorted, links
  // skipped). Throws varuna::ConfigError if nothing readable is found.
  static CharDataset fromPath(const std::string& path);
  explicit CharDataset(std::string text);

  int64_t vocabSize() const { return static_cast<int64_t>(vocab_.size()); }
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }

  // "tokens" and "targets" (int64, count x seqLen) for global samples
  // [first, first + count).
  varuna::Batch samples(int64_t first, int64_t count, int64_t seqLen, uint64_t seed) const;
  // This replica's share of the global batch of `step`.
  varuna::Batch replicaBatch(int64_t step, int64_t globalBatch, int replica, int replicas, int64_t seqLen,
                             uint64_t seed) const;

 private:
  std::vector<char> vocab_;
  std::vector<int64_t> tokens_;
};

}  // namespace gpt
