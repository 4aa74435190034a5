// The launch contract (common/launch_contract.h): what every writer encodes,
// the worker decodes to the same LaunchArgs.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include "varuna/common/errors.h"
#include "varuna/common/launch_contract.h"

using namespace varuna;

namespace {

LaunchArgs decode(const std::vector<std::string>& argv, const EnvEntries& entries) {
  std::vector<const char*> raw{"train"};
  for (const auto& a : argv) raw.push_back(a.c_str());
  std::map<std::string, std::string> env(entries.begin(), entries.end());
  return parseLaunchArgs(static_cast<int>(raw.size()), raw.data(), env);
}

EnvEntries all(const LaunchArgs& args) {
  EnvEntries env;
  for (const auto& part : {rendezvousEnvironment(args), managerEnvironment(args), storeEnvironment(args),
                           planEnvironment(args)}) {
    env.insert(env.end(), part.begin(), part.end());
  }
  return env;
}

}  // namespace

TEST_CASE("launch contract: everything a launcher encodes decodes to the same values") {
  LaunchArgs sent;
  sent.rank = 3;
  sent.localRank = 1;
  sent.worldSize = 4;
  sent.stageToRankMap = "0,2;1,3;";
  sent.chunkSize = 2;
  sent.replicaBatchSize = 8;
  sent.resumeStep = 120;
  sent.masterAddr = "10.0.0.7";
  sent.masterPort = 24650;
  sent.managerAddr = "10.0.0.1:40000";
  sent.jobToken = "secret";
  sent.job = "gpt";
  sent.hostAddr = "10.0.0.8";
  sent.generation = 5;
  sent.agentBeatFd = 3;
  sent.globalStore = "/store";
  sent.keepCheckpoints = 0;
  sent.schedule = "1f1b";
  sent.pieceCosts = {0.1, 1.0 / 3.0, 2.5e-7};
  sent.profiledPieces = {{"embed", 1024}, {"block.0", 4096}};
  auto argv = launcherArgv(sent);
  argv.push_back("--lr");  // the program's own
  argv.push_back("0.1");
  const LaunchArgs got = decode(argv, all(sent));
  CHECK(got.rank == 3);
  CHECK(got.localRank == 1);
  CHECK(got.worldSize == 4);
  CHECK(got.stageToRankMap == sent.stageToRankMap);
  CHECK(got.chunkSize == 2);
  CHECK(got.replicaBatchSize == 8);
  CHECK(got.globalBatchSize() == 16);
  CHECK(got.resumeStep == 120);
  CHECK(got.masterAddr == "10.0.0.7");
  CHECK(got.masterPort == 24650);
  CHECK(got.managerAddr == sent.managerAddr);
  CHECK(got.jobToken == "secret");
  CHECK(got.job == "gpt");
  CHECK(got.hostAddr == "10.0.0.8");
  CHECK(got.generation == 5);
  CHECK(got.agentBeatFd == 3);
  CHECK(got.globalStore == "/store");
  CHECK(got.keepCheckpoints == 0);
  CHECK(got.schedule == "1f1b");
  CHECK(got.pieceCosts == sent.pieceCosts);  // exactly: the same partition on both sides
  CHECK(got.profiledPieces == sent.profiledPieces);
  CHECK(got.userArgs == std::vector<std::string>{"--lr", "0.1"});
}

TEST_CASE("launch contract: what is not set is not written, and decodes to the defaults") {
  LaunchArgs sent;
  sent.rank = 1;
  sent.worldSize = 2;
  sent.localRank = 1;
  const auto argv = launcherArgv(sent);
  CHECK(argv == std::vector<std::string>{contract::kRankArg, "1", contract::kLocalRankArg, "1"});
  CHECK(planEnvironment(sent).empty());
  CHECK(storeEnvironment(sent).size() == 1);  // the store (empty: none); no retention
  const LaunchArgs got = decode(argv, rendezvousEnvironment(sent));
  CHECK(got.resumeStep == -1);
  CHECK(got.agentBeatFd == -1);
  CHECK(got.keepCheckpoints == -1);
  CHECK(got.generation == -1);
  CHECK(got.pieceCosts.empty());
}

TEST_CASE("launch contract: bad values are refused naming the variable") {
  const std::vector<std::string> none;
  CHECK_THROWS_WITH(decode(none, {{contract::kPieceCostsEnv, "1,x"}}), Catch::Contains("VARUNA_PIECE_COSTS"));
  CHECK_THROWS_WITH(decode(none, {{contract::kProfilePiecesEnv, "{"}}), Catch::Contains("VARUNA_PROFILE_PIECES"));
  CHECK_THROWS_WITH(decode(none, {{contract::kKeepCheckpointsEnv, "-2"}}), Catch::Contains("VARUNA_KEEP_CHECKPOINTS"));
  CHECK_THROWS_WITH(decode(none, {{contract::kGenerationEnv, "two"}}), Catch::Contains("VARUNA_GENERATION"));
  CHECK_THROWS_WITH(decode(none, {{contract::kScheduleEnv, "zigzag"}}), Catch::Contains("zigzag"));
  CHECK_THROWS_WITH(decode(none, {{contract::kScheduleEnv, "interleaved:12"}}), Catch::Contains("2 to 8 chunks"));
  CHECK(decode(none, {{contract::kScheduleEnv, "interleaved:4"}}).schedule == "interleaved:4");
  CHECK_THROWS_AS(decode({"--rank", "2"}, {{contract::kWorldSizeEnv, "2"}}), ConfigError);
}

TEST_CASE("launch contract: the agent's credential comes on a descriptor, read once and closed") {
  LaunchArgs args;
  args.jobToken = "c0ffee";
  args.jobTokenFd = contract::kJobTokenFd;
  const EnvEntries entries = managerEnvironment(args);
  const std::map<std::string, std::string> env(entries.begin(), entries.end());
  CHECK(env.count(contract::kJobTokenFdEnv));
  CHECK(env.at(contract::kJobTokenFdEnv) == std::to_string(contract::kJobTokenFd));
  CHECK_FALSE(env.count(contract::kJobTokenEnv));  // never the value itself
  for (const auto& [k, v] : entries) CHECK(v.find("c0ffee") == std::string::npos);

  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  REQUIRE(::write(fds[1], "c0ffee", 6) == 6);
  ::close(fds[1]);
  const std::vector<std::string> none;
  CHECK(decode(none, {{contract::kJobTokenFdEnv, std::to_string(fds[0])}}).jobToken == "c0ffee");
  CHECK(::fcntl(fds[0], F_GETFD) == -1);  // closed once read
  // A second parse in the same process (a profiler, then the runtime) gets the same credential.
  CHECK(decode(none, {{contract::kJobTokenFdEnv, std::to_string(fds[0])}}).jobToken == "c0ffee");
  CHECK_THROWS_WITH(decode(none, {{contract::kJobTokenFdEnv, "four"}}), Catch::Contains("VARUNA_JOB_TOKEN_FD"));
  CHECK_THROWS_WITH(decode(none, {{contract::kJobTokenFdEnv, "987"}}), Catch::Contains("cannot read the credential"));
}
