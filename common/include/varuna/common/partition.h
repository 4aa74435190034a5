// Partitioner: chooses which CutPoints become stage boundaries.
//
// A model is a sequence of n pieces (the segments between CutPoints). A
// partition into P stages activates P-1 of the n-1 cutpoints. Any P from 1 to n
// works (there is no divisibility rule); the partition minimises the cost of the
// slowest stage. Costs are profiled compute times when known, parameter counts
// otherwise. Pure function, no I/O.
#pragma once

#include <string>
#include <vector>

namespace varuna {

struct Partition {
  // Stage s owns pieces [firstPiece[s], firstPiece[s+1]); size P+1.
  std::vector<int> firstPiece;
  std::vector<double> stageCost;

  int numStages() const { return static_cast<int>(stageCost.size()); }
  int begin(int stage) const { return firstPiece[stage]; }
  int end(int stage) const { return firstPiece[stage + 1]; }
  int stageOfPiece(int piece) const;
  double maxStageCost() const;
  // "stage 0: pieces 0-2 (cost 3.0); stage 1: ..." for logs and reports.
  std::string describe(const std::vector<std::string>& pieceNames = {}) const;
};

// Throws ConfigError if stages < 1, stages > pieces, or a cost is negative/NaN.
Partition partitionPieces(const std::vector<double>& pieceCosts, int stages);

}  // namespace varuna
