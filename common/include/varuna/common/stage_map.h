// StageToRankMap: where every pipeline stage of every data-parallel replica runs.
//
// Text form (the original Varuna launcher's): for each stage, its ranks joined by
// ',', each stage ended by ';'. "0,2;1,3;" is 2 stages x 2 replicas: stage 0 on
// ranks 0 and 2, stage 1 on ranks 1 and 3. A rank's position in its stage's list
// is its data-parallel index (replica). An immutable value type.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace varuna {

class StageToRankMap {
 public:
  // Parses and validates; throws ConfigError quoting the offending text.
  static StageToRankMap parse(std::string_view text);
  // The "clustered" placement: replica r is ranks r*P .. r*P+P-1, so
  // neighbouring stages of a replica share a machine.
  static StageToRankMap clustered(int stages, int replicas);
  // Builds from explicit lists (validated like parse).
  static StageToRankMap fromRanks(std::vector<std::vector<int>> ranksPerStage);

  int numStages() const { return static_cast<int>(ranks_.size()); }
  int numReplicas() const { return ranks_.empty() ? 0 : static_cast<int>(ranks_[0].size()); }
  int worldSize() const { return numStages() * numReplicas(); }

  int stageOf(int rank) const;
  int replicaOf(int rank) const;
  int rankOf(int stage, int replica) const;
  const std::vector<int>& ranksOfStage(int stage) const;

  // The canonical text form, e.g. "0,2;1,3;".
  std::string toString() const;

 private:
  explicit StageToRankMap(std::vector<std::vector<int>> ranks);
  void checkRank(int rank) const;

  std::vector<std::vector<int>> ranks_;  // [stage][replica] -> rank
  std::vector<int> stageOfRank_;
  std::vector<int> replicaOfRank_;
};

}  // namespace varuna
