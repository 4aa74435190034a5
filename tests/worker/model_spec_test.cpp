
#include "gpt_model.h"
#include "varuna/common/errors.h"
#include "varuna/worker/model.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;

TEST_CASE("model specs are validated before anything is built", "[model]") {
  auto spec = gpt::makeGptModel({});
  CHECK_NOTHROW(validateModelSpec(spec));

  auto dup = spec;
  dup.pieces[2].name = dup.pieces[1].name;
  CHECK_THROWS_WITH(validateModelSpec(dup), Catch::Contains("two pieces are named 'block0'"));

  auto badTie = spec;
  badTie.sharedWeights = {{"embed.wte.weight", "nothead.lm_head.weight"}};
  CHECK_THROWS_WITH(validateModelSpec(badTie), Catch::Contains("'nothead.lm_head.weight' does not name a parameter"));

  auto selfTie = spec;
  selfTie.sharedWeights = {{"embed.wte.weight", "embed.wte.weight"}};
  CHECK_THROWS_AS(validateModelSpec(selfTie), ConfigError);

  auto costs = spec;
  costs.pieceCosts = {1.0, 2.0};
  CHECK_THROWS_WITH(validateModelSpec(costs), Catch::Contains("pieceCosts has 2 entries"));

  CHECK_THROWS_AS(validateModelSpec(ModelSpec{}), ConfigError);
}

TEST_CASE("parameters map to their piece by name prefix", "[model]") {
  auto spec = gpt::makeGptModel({.layers = 12});
  CHECK(pieceOfParameter(spec, "embed.wte.weight") == 0);
  CHECK(pieceOfParameter(spec, "block1.qkv.weight") == 2);
  CHECK(pieceOfParameter(spec, "block11.qkv.weight") == 12);  // longest prefix wins over "block1"
  CHECK(pieceOfParameter(spec, "head.lm_head.weight") == 13);
  CHECK(pieceOfParameter(spec, "missing.weight") == -1);
}

TEST_CASE("pieces build deterministically from the seed, independent of order", "[model]") {
  auto spec = gpt::makeGptModel({.layers = 3});
  auto later = buildPiece(spec, 2);
  auto a = buildPiece(spec, 1);
  auto b = buildPiece(spec, 1);
  auto pa = a->parameters(), pb = b->parameters();
  REQUIRE(pa.size() == pb.size());
  for (size_t i = 0; i < pa.size(); ++i) CHECK(torch::equal(pa[i], pb[i]));
  // The declared parameter counts match what the factories build.
  for (int i = 0; i < static_cast<int>(spec.pieces.size()); ++i) {
    int64_t count = 0;
    for (const auto& p : buildPiece(spec, i)->parameters()) count += p.numel();
    CHECK(count == spec.pieces[i].paramCount);
  }
}
