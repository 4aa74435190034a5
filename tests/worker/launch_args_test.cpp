
#include "varuna/common/errors.h"
#include "varuna/worker/launch_args.h"
// Catch last: c10's logging defines its own CHECK, which must not shadow Catch's.
#include <catch2/catch.hpp>

using namespace varuna;

namespace {

LaunchArgs parse(std::vector<const char*> argv, const std::map<std::string, std::string>& env = {}) {
  argv.insert(argv.begin(), "train");
  return parseLaunchArgs(static_cast<int>(argv.size()), argv.data(), env);
}

}  // namespace

TEST_CASE("the launcher's arguments are parsed and the rest is left to the program", "[launch_args]") {
  auto a = parse({"--rank", "3", "--local_rank", "1", "--stage_to_rank_map", "0,2;1,3;", "--chunk_size", "4",
                  "--batch-size", "16", "--resume_step", "200", "--steps", "10", "--lr=0.1"},
                 {{"WORLD_SIZE", "4"}});
  CHECK(a.rank == 3);
  CHECK(a.localRank == 1);
  CHECK(a.worldSize == 4);
  CHECK(a.stageToRankMap == "0,2;1,3;");
  CHECK(a.chunkSize == 4);
  CHECK(a.replicaBatchSize == 16);
  CHECK(a.globalBatchSize() == 32);  // 2 replicas
  CHECK(a.stages() == 2);
  CHECK(a.stage() == 1);
  CHECK(a.replica() == 1);
  CHECK(a.resumeStep == 200);
  CHECK(a.userArgs == std::vector<std::string>{"--steps", "10", "--lr=0.1"});
}

TEST_CASE("torchrun's environment fills what the command line does not give", "[launch_args]") {
  auto a = parse({"--chunk_size", "2"}, {{"RANK", "5"}, {"LOCAL_RANK", "1"}, {"WORLD_SIZE", "8"},
                                         {"MASTER_ADDR", "10.0.0.4"}, {"MASTER_PORT", "29555"}});
  CHECK(a.rank == 5);
  CHECK(a.localRank == 1);
  CHECK(a.worldSize == 8);
  CHECK(a.masterAddr == "10.0.0.4");
  CHECK(a.masterPort == 29555);
  CHECK(a.resumeStep == -1);
  CHECK_FALSE(a.externalStore);
  // The command line wins over the environment.
  CHECK(parse({"--rank", "2"}, {{"RANK", "5"}, {"WORLD_SIZE", "8"}}).rank == 2);
  // torchrun's agent hosts the store itself.
  CHECK(parse({}, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}}).externalStore);
  // Without LOCAL_RANK, the local rank defaults to the rank.
  CHECK(parse({"--rank", "2"}, {{"WORLD_SIZE", "4"}}).localRank == 2);
}

TEST_CASE("bad launcher arguments are clear errors", "[launch_args]") {
  CHECK_THROWS_AS(parse({"--chunk_size", "0"}), ConfigError);
  CHECK_THROWS_AS(parse({"--rank", "x"}), ConfigError);
  CHECK_THROWS_AS(parse({"--master_port", "70000"}), ConfigError);
  CHECK_THROWS_AS(parse({}, {{"RANK", "abc"}}), ConfigError);
  CHECK_THROWS_AS(parse({"--rank", "4"}, {{"WORLD_SIZE", "4"}}), ConfigError);
  try {
    parse({}, {{"MASTER_PORT", "12x"}});
    FAIL();
  } catch (const ConfigError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("MASTER_PORT='12x'"));
  }
}

TEST_CASE("AutoConfig's settings reach the runtime through the environment", "[launch_args]") {
  auto a = parse({}, {{"VARUNA_SCHEDULE", "1f1b"},
                      {"VARUNA_PIECE_COSTS", "1,2.5,0"},
                      {"VARUNA_PROFILE_PIECES", R"([["embed", 4096], ["block0", 12672]])"}});
  CHECK(a.schedule == "1f1b");
  CHECK(a.pieceCosts == std::vector<double>{1, 2.5, 0});
  CHECK(a.profiledPieces == std::vector<std::pair<std::string, int64_t>>{{"embed", 4096}, {"block0", 12672}});
  CHECK_THROWS_WITH(parse({}, {{"VARUNA_SCHEDULE", "pipedream"}}), Catch::Contains("pipedream"));
  CHECK_THROWS_WITH(parse({}, {{"VARUNA_PIECE_COSTS", "1,-2"}}), Catch::Contains("VARUNA_PIECE_COSTS"));
  CHECK_THROWS_WITH(parse({}, {{"VARUNA_PROFILE_PIECES", "[[\"embed\"]]"}}), Catch::Contains("VARUNA_PROFILE_PIECES"));
  CHECK_THROWS_WITH(parse({}, {{"VARUNA_PROFILE_PIECES", "{"}}), Catch::Contains("VARUNA_PROFILE_PIECES"));
}
