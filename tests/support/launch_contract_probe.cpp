// launch_contract_probe: the C++ side of tests/python/launch_contract_test.py.
//   encode RANK LOCAL_RANK WORLD MAP CHUNK BATCH RESUME ADDR PORT
//       prints {"argv": launcherArgv, "env": rendezvousEnvironment} as JSON;
//   decode OUT_DIR [launcher arguments...]   (as a launched worker)
//       writes OUT_DIR/rank<R>.json: the LaunchArgs it decoded from its
//       arguments and environment.
#include <fstream>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "varuna/common/launch_contract.h"

using namespace varuna;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "encode" && argc == 11) {
    LaunchArgs args;
    args.rank = std::stoi(argv[2]);
    args.localRank = std::stoi(argv[3]);
    args.worldSize = std::stoi(argv[4]);
    args.stageToRankMap = argv[5];
    args.chunkSize = std::stoll(argv[6]);
    args.replicaBatchSize = std::stoll(argv[7]);
    args.resumeStep = std::stoll(argv[8]);
    args.masterAddr = argv[9];
    args.masterPort = std::stoi(argv[10]);
    nlohmann::json env = nlohmann::json::object();
    for (const auto& [k, v] : rendezvousEnvironment(args)) env[k] = v;
    std::cout << nlohmann::json{{"argv", launcherArgv(args)}, {"env", env}}.dump() << "\n";
    return 0;
  }
  if (mode == "decode" && argc >= 3) {
    const std::string out = argv[2];
    const LaunchArgs args = parseLaunchArgs(argc - 2, argv + 2, currentEnvironment());
    const nlohmann::json decoded = {
        {"rank", args.rank},         {"local_rank", args.localRank},  {"world_size", args.worldSize},
        {"stage_to_rank_map", args.stageToRankMap}, {"chunk_size", args.chunkSize},
        {"replica_batch_size", args.replicaBatchSize}, {"resume_step", args.resumeStep},
        {"master_addr", args.masterAddr}, {"master_port", args.masterPort}, {"stage", args.stage()},
        {"replica", args.replica()}, {"global_batch", args.globalBatchSize()}, {"user_args", args.userArgs}};
    std::ofstream(out + "/rank" + std::to_string(args.rank) + ".json") << decoded.dump() << "\n";
    return 0;
  }
  std::cerr << "usage: launch_contract_probe encode RANK LOCAL_RANK WORLD MAP CHUNK BATCH RESUME ADDR PORT\n"
               "       launch_contract_probe decode OUT_DIR [launcher arguments...]\n";
  return 2;
}
