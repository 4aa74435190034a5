#include <catch2/catch.hpp>

#include <numeric>

#include "varuna/common/errors.h"
#include "varuna/common/partition.h"

using varuna::ConfigError;
using varuna::partitionPieces;

namespace {

// Exhaustive reference: the best max-stage cost over every set of cuts.
double bruteForceBest(const std::vector<double>& costs, int stages, size_t start = 0) {
  if (stages == 1) return std::accumulate(costs.begin() + start, costs.end(), 0.0);
  double best = 1e300;
  double first = 0;
  for (size_t end = start + 1; end + (stages - 1) <= costs.size(); ++end) {
    first += costs[end - 1];
    best = std::min(best, std::max(first, bruteForceBest(costs, stages - 1, end)));
  }
  return best;
}

}  // namespace

TEST_CASE("equal pieces split evenly, no divisibility rule", "[partition]") {
  auto p = partitionPieces(std::vector<double>(10, 1.0), 4);
  REQUIRE(p.numStages() == 4);
  CHECK(p.begin(0) == 0);
  CHECK(p.end(3) == 10);
  CHECK(p.maxStageCost() == 3.0);
  for (int s = 0; s < 4; ++s) CHECK(p.end(s) > p.begin(s));
}

TEST_CASE("unequal costs are balanced by cost, not by piece count", "[partition]") {
  // One heavy piece: it gets a stage of its own.
  auto p = partitionPieces({1, 1, 1, 6, 1, 1, 1}, 3);
  CHECK(p.maxStageCost() == 6.0);
  CHECK(p.stageOfPiece(3) != p.stageOfPiece(2));
  CHECK(p.stageOfPiece(3) != p.stageOfPiece(4));
  CHECK(p.stageCost[p.stageOfPiece(3)] == 6.0);
}

TEST_CASE("the partition is optimal on many random cost vectors", "[partition]") {
  uint32_t seed = 12345;
  auto next = [&seed]() {
    seed = seed * 1664525u + 1013904223u;
    return (seed >> 8) % 100 + 1;
  };
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + trial % 9;
    std::vector<double> costs;
    for (int i = 0; i < n; ++i) costs.push_back(static_cast<double>(next()));
    for (int P = 1; P <= n; ++P) {
      auto p = partitionPieces(costs, P);
      INFO("trial " << trial << " P=" << P << " " << p.describe());
      CHECK(p.maxStageCost() == Approx(bruteForceBest(costs, P)));
      double total = 0;
      for (double c : p.stageCost) total += c;
      CHECK(total == Approx(std::accumulate(costs.begin(), costs.end(), 0.0)));
    }
  }
}

TEST_CASE("as many stages as pieces is allowed, more is a clear error", "[partition]") {
  auto p = partitionPieces({1, 2, 3}, 3);
  CHECK(p.firstPiece == std::vector<int>{0, 1, 2, 3});
  try {
    partitionPieces({1, 2, 3}, 4);
    FAIL("accepted more stages than pieces");
  } catch (const ConfigError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("cannot split 3 pieces into 4"));
  }
  CHECK_THROWS_AS(partitionPieces({1, 2}, 0), ConfigError);
  CHECK_THROWS_AS(partitionPieces({1, -2}, 1), ConfigError);
}

TEST_CASE("describe names the pieces of each stage", "[partition]") {
  auto p = partitionPieces({1, 1, 1, 1}, 2);
  CHECK(p.describe({"embed", "block0", "block1", "head"}) ==
        "stage 0: pieces 0-1 (embed..block0) cost 2; stage 1: pieces 2-3 (block1..head) cost 2");
}
