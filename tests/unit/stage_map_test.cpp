#include <catch2/catch.hpp>

#include "varuna/common/errors.h"
#include "varuna/common/stage_map.h"

using varuna::ConfigError;
using varuna::StageToRankMap;

TEST_CASE("stage_to_rank_map parses the original format", "[stage_map]") {
  auto map = StageToRankMap::parse("0,2;1,3;");
  CHECK(map.numStages() == 2);
  CHECK(map.numReplicas() == 2);
  CHECK(map.worldSize() == 4);
  CHECK(map.stageOf(2) == 0);
  CHECK(map.replicaOf(2) == 1);
  CHECK(map.stageOf(3) == 1);
  CHECK(map.replicaOf(3) == 1);
  CHECK(map.rankOf(1, 0) == 1);
  CHECK(map.toString() == "0,2;1,3;");
}

TEST_CASE("stage_to_rank_map accepts a missing final ';' and round-trips", "[stage_map]") {
  auto map = StageToRankMap::parse("0,2,4,6;1,3,5,7");
  CHECK(map.toString() == "0,2,4,6;1,3,5,7;");
  CHECK(StageToRankMap::parse(map.toString()).toString() == map.toString());
  CHECK(StageToRankMap::parse("0;").worldSize() == 1);
}

TEST_CASE("clustered placement puts a replica's stages on consecutive ranks", "[stage_map]") {
  auto map = StageToRankMap::clustered(2, 4);
  CHECK(map.toString() == "0,2,4,6;1,3,5,7;");
  auto deep = StageToRankMap::clustered(3, 1);
  CHECK(deep.toString() == "0;1;2;");
}

TEST_CASE("bad stage_to_rank_map texts are refused with the offending text", "[stage_map]") {
  struct Case {
    const char* text;
    const char* mentions;
  };
  const Case cases[] = {
      {"", "empty"},
      {"0,1;2;", "stage 1 has 1 ranks but stage 0 has 2"},
      {"0,1;1,2;", "rank 1 appears twice"},
      {"0,5;1,2;", "rank 5 is out of range"},
      {"0,a;1,2;", "'a' is not a rank"},
      {"0,-1;", "'-1' is not a rank"},
      {"0;;1;", "stage 1 has no ranks"},
      {"0,,1;", "'' is not a rank"},
  };
  for (const auto& c : cases) {
    INFO("text: '" << c.text << "'");
    try {
      StageToRankMap::parse(c.text);
      FAIL("accepted an invalid map");
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      CHECK_THAT(what, Catch::Contains(c.mentions));
      CHECK_THAT(what, Catch::Contains(std::string("'") + c.text + "'"));
    }
  }
}

TEST_CASE("asking for a rank outside the map is a ConfigError", "[stage_map]") {
  auto map = StageToRankMap::parse("0;1;");
  CHECK_THROWS_AS(map.stageOf(2), ConfigError);
  CHECK_THROWS_AS(map.replicaOf(-1), ConfigError);
}
