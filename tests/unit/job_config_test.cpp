// run_varuna's job config: JSON file, command line on top, env file, checks.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "test_env.h"
#include "varuna/common/errors.h"
#include "varuna/manager/job_config.h"

using namespace varuna;

namespace {

std::optional<JobConfig> parseArgs(std::vector<std::string> args) {
  args.insert(args.begin(), "run_varuna");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  int code = 0;
  return parseCommandLine(static_cast<int>(argv.size()), argv.data(), code);
}

// A configuration validateJobConfig accepts, over `dir`'s machines.txt.
JobConfig validConfig(const std::filesystem::path& dir) {
  JobConfig c;
  c.machineList = (dir / "machines.txt").string();
  c.nstages = 2;
  c.batchSize = 16;
  c.chunkSize = 4;
  c.globalStore = (dir / "store").string();
  c.stateDir = (dir / "state").string();
  c.program = {"./train_gpt"};
  return c;
}

}  // namespace

TEST_CASE("job config JSON: every key, and the command line overrides the file", "[config]") {
  const auto dir = varuna::test::scratchDir("job_config");
  const auto file = dir / "job.json";
  std::ofstream(file) << R"({"job": "gpt", "machine_list": "m.txt", "nstages": 2, "batch_size": 16,
                            "chunk_size": 4, "no_morphing": true, "slow_threshold": 0.2,
                            "program": ["./train_gpt", "--steps", "10"]})";
  auto config = parseArgs({"--config", file.string(), "--nstages", "3", "--heartbeat_timeout_s", "2.5",
                           "--hang_timeout_s", "1800"});
  REQUIRE(config);
  CHECK(config->job == "gpt");
  CHECK(config->nstages == 3);  // command line wins
  CHECK(config->batchSize == 16);
  CHECK(config->noMorphing);
  CHECK(config->slowThreshold == Approx(0.2));
  CHECK(config->heartbeatTimeoutS == Approx(2.5));
  CHECK(config->hangTimeoutS == Approx(1800));
  CHECK(JobConfig{}.hangTimeoutS == Approx(600));  // big models: minutes per step are not a hang
  CHECK(config->program == std::vector<std::string>{"./train_gpt", "--steps", "10"});

  auto withProgram = parseArgs({"--config", file.string(), "--", "./other", "--lr", "0.1"});
  REQUIRE(withProgram);
  CHECK(withProgram->program == std::vector<std::string>{"./other", "--lr", "0.1"});

  // The JSON form of a config reads back to the same config.
  const auto again = applyJobJson(JobConfig{}, toJson(*config), "round trip");
  CHECK(toJson(again) == toJson(*config));
}

TEST_CASE("job config: bad inputs are named with the fix", "[config]") {
  struct Case {
    std::string json;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {R"({"nstage": 2})", "unknown key 'nstage'"},
      {R"({"nstages": "two"})", "'nstages' must be an integer"},
      {R"({"nstages": 2.5})", "'nstages' must be an integer"},
      {R"({"no_morphing": 1})", "'no_morphing' must be true or false"},
      {R"({"program": "./train"})", "'program' must be a list of strings"},
      {R"({"program": ["./train", 3]})", "'program' must be a list of strings"},
      {R"({"port": 99999999999})", "'port' must be an integer"},
      {R"([1, 2])", "must be a JSON object"},
      {R"({"nstages": 2,)", "not valid JSON"},
      {R"({"nstages": 1e999})", "not valid JSON"},  // a number too large for a double (found by fuzzing)
  };
  for (const auto& c : cases) {
    INFO(c.json);
    CHECK_THROWS_WITH(parseJobConfigText(c.json, "job.json"), Catch::Contains(c.expected) && Catch::Contains("job.json"));
  }
  CHECK_THROWS_WITH(parseArgs({"--nstages", "x"}), Catch::Contains("--nstages must be an integer"));
  CHECK_THROWS_WITH(parseArgs({"--heartbeat_timeout_s", "soon"}), Catch::Contains("--heartbeat_timeout_s must be a number"));
}

TEST_CASE("job config validation names the missing or bad option", "[config]") {
  const auto dir = varuna::test::scratchDir("job_config_validate");
  std::ofstream(dir / "machines.txt") << "127.0.0.1 slots=2\n";
  auto valid = [&] { return validConfig(dir); };
  JobConfig ok = valid();
  REQUIRE_NOTHROW(validateJobConfig(ok, "/opt/varuna/bin/run_varuna"));
  CHECK(ok.agentPath == "/opt/varuna/bin/varuna_agent");
  CHECK(std::filesystem::path(ok.codeDir).is_absolute());
  JobConfig joins = valid();  // no machine list: hosts join by themselves
  joins.machineList.clear();
  joins.machineSource = "join";
  joins.minHosts = 2;
  REQUIRE_NOTHROW(validateJobConfig(joins, "/x/run_varuna"));
  CHECK(joins.machineList.empty());
  JobConfig noHangDetection = valid();
  noHangDetection.hangTimeoutS = 0;  // off
  REQUIRE_NOTHROW(validateJobConfig(noHangDetection, "/opt/varuna/bin/run_varuna"));

  // With a profile, AutoConfig may choose P and the micro-batch.
  std::ofstream(dir / "profile.json") << "{}";
  JobConfig automatic = valid();
  automatic.nstages = 0;
  automatic.chunkSize = 0;
  automatic.profile = (dir / "profile.json").string();
  automatic.schedules = "all";
  REQUIRE_NOTHROW(validateJobConfig(automatic, "/x/run_varuna"));
  CHECK(parseScheduleList("all").size() == 7);  // every kind, interleaved with 2 and with 4 chunks
  CHECK(parseScheduleList("all").back() == ScheduleChoice{ScheduleKind::kInterleaved1F1B, 4});
  CHECK(parseScheduleList("1f1b, gpipe") == std::vector<ScheduleChoice>{ScheduleKind::k1F1B, ScheduleKind::kGPipe});
  CHECK(parseScheduleList("zbv,interleaved:3") ==
        std::vector<ScheduleChoice>{ScheduleKind::kZeroBubbleV, {ScheduleKind::kInterleaved1F1B, 3}});
  CHECK_THROWS_WITH(parseScheduleList("1f1b,interleaved:9"), Catch::Contains("--schedules") && Catch::Contains("2 to 8"));

  struct Case {
    std::function<void(JobConfig&)> edit;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](JobConfig& c) { c.machineList.clear(); }, "--machine_list is required"},
      {[](JobConfig& c) { c.machineList = "/nonexistent/m.txt"; }, "/nonexistent/m.txt does not exist"},
      {[](JobConfig& c) { c.nstages = 0; }, "--nstages"},
      {[](JobConfig& c) { c.batchSize = 0; }, "--batch_size"},
      {[](JobConfig& c) { c.chunkSize = -1; }, "--chunk_size"},
      {[](JobConfig& c) { c.program.clear(); }, "after `--`"},
      {[](JobConfig& c) { c.globalStore.clear(); }, "--global_store is required"},
      {[](JobConfig& c) { c.port = 70000; }, "--port"},
      {[](JobConfig& c) { c.heartbeatTimeoutS = 0; }, "--heartbeat_timeout_s must be > 0"},
      {[](JobConfig& c) { c.hangTimeoutS = -1; }, "--hang_timeout_s must be >= 0 (0 turns hang detection off)"},
      {[](JobConfig& c) { c.slowThreshold = -1; }, "--slow_threshold"},
      {[](JobConfig& c) { c.job = "a/b"; }, "--job"},
      {[](JobConfig& c) { c.envFile = "/nonexistent/env"; }, "--env_file /nonexistent/env does not exist"},
      {[](JobConfig& c) { c.gpusPerNode = 0; }, "--gpus_per_node"},
      {[](JobConfig& c) { c.schedules = "varuna,fast"; }, "--schedules 'varuna,fast': unknown schedule 'fast'"},
      {[](JobConfig& c) { c.nstages = 0; c.profile = "/nonexistent/p.json"; }, "--profile /nonexistent/p.json does not exist"},
      {[](JobConfig& c) { c.chunkSize = 0; }, "or leave it out and give --profile"},
      {[](JobConfig& c) { c.memoryPerDeviceGb = -1; }, "--memory_per_device_gb"},
      {[](JobConfig& c) { c.machineList.clear(); }, "or --machine_source join"},
      {[](JobConfig& c) { c.machineSource = "slurm"; }, "--machine_source must be list or join, got 'slurm'"},
      {[](JobConfig& c) { c.machineSource = "join"; }, "--machine_list and --machine_source join exclude each other"},
      {[](JobConfig& c) { c.machineSource = "join"; c.machineList.clear(); c.dryRun = true; }, "--dry_run"},
      {[](JobConfig& c) { c.minHosts = -1; }, "--min_hosts must be >= 0"},
      {[](JobConfig& c) { c.joinTtlH = 0; }, "--join_ttl_h must be > 0"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    INFO("case " << i);
    JobConfig c = valid();
    cases[i].edit(c);
    CHECK_THROWS_WITH(validateJobConfig(c, "/x/run_varuna"), Catch::Contains(cases[i].expected));
  }
}

TEST_CASE("env file: KEY=VALUE lines, comments, export and quotes; bad lines name file:line", "[config]") {
  const auto env = parseEnvFile("# comment\n\nOMP_NUM_THREADS=1\nexport A_B='x y'\nC=\"q\"\nEMPTY=\n", "env");
  REQUIRE(env.size() == 4);
  CHECK(env[0] == std::pair<std::string, std::string>{"OMP_NUM_THREADS", "1"});
  CHECK(env[1] == std::pair<std::string, std::string>{"A_B", "x y"});
  CHECK(env[2].second == "q");
  CHECK(env[3].second.empty());
  CHECK_THROWS_WITH(parseEnvFile("A=1\nnot a line\n", "my.env"), Catch::Contains("my.env:2"));
  CHECK_THROWS_WITH(parseEnvFile("1A=2\n", "my.env"), Catch::Contains("my.env:1"));
  CHECK_THROWS_WITH(parseEnvFile("A-B=2\n", "my.env"), Catch::Contains("KEY=VALUE"));
}

TEST_CASE("env file: the plaintext switch and credentials are refused, naming the line and the flag", "[config][security]") {
  CHECK_THROWS_WITH(parseEnvFile("A=1\nVARUNA_INSECURE_PLAINTEXT_CONTROL=1\n", "my.env"),
                    Catch::Contains("my.env:2") && Catch::Contains("--insecure_plaintext_control"));
  for (const char* name : {"VARUNA_JOB_TOKEN", "VARUNA_JOB_TOKEN_FD", "VARUNA_AGENT_BEAT_FD"}) {
    INFO(name);
    CHECK_THROWS_AS(parseEnvFile(std::string("export ") + name + "=x\n", "my.env"), ConfigError);
    CHECK(isControlPlaneVariable(name));
  }
  CHECK_FALSE(isControlPlaneVariable("VARUNA_GLOBAL_STORE"));
  CHECK_FALSE(isControlPlaneVariable("OMP_NUM_THREADS"));
}

TEST_CASE("--keep_checkpoints: default 3, CLI and JSON, >= 0, handed to every worker", "[config]") {
  CHECK(JobConfig{}.keepCheckpoints == 3);
  CHECK(toJson(JobConfig{}).at("keep_checkpoints") == 3);
  auto given = parseArgs({"--keep_checkpoints", "5"});
  REQUIRE(given);
  CHECK(given->keepCheckpoints == 5);
  CHECK(parseJobConfigText(R"({"keep_checkpoints": 0})", "job.json").keepCheckpoints == 0);  // 0: keep all

  CHECK_THROWS_WITH(parseArgs({"--keep_checkpoints", "two"}), Catch::Contains("--keep_checkpoints must be an integer"));
  CHECK_THROWS_WITH(parseArgs({"--keep_checkpoints", "2.5"}), Catch::Contains("--keep_checkpoints must be an integer"));
  CHECK_THROWS_WITH(parseJobConfigText(R"({"keep_checkpoints": "all"})", "job.json"),
                    Catch::Contains("'keep_checkpoints' must be an integer") && Catch::Contains("job.json"));

  const auto dir = varuna::test::scratchDir("job_config_keep");
  std::ofstream(dir / "machines.txt") << "127.0.0.1 slots=2\n";
  auto negative = parseArgs({"--machine_list", (dir / "machines.txt").string(), "--nstages", "2", "--batch_size", "8",
                             "--chunk_size", "2", "--global_store", (dir / "store").string(), "--state_dir",
                             (dir / "state").string(), "--keep_checkpoints", "-1", "--", "./train_gpt"});
  REQUIRE(negative);
  CHECK_THROWS_WITH(validateJobConfig(*negative, "/x/run_varuna"),
                    Catch::Contains("--keep_checkpoints must be >= 0") && Catch::Contains("got -1"));

  // The job's own variables come after the env file's, so they win in the
  // agent (which applies LaunchWorkers' env in order).
  JobConfig config;
  config.globalStore = "/mnt/store";
  config.keepCheckpoints = 7;
  const auto env = jobEnvironment(config, {{"OMP_NUM_THREADS", "1"}, {"VARUNA_KEEP_CHECKPOINTS", "99"}});
  REQUIRE(env.size() == 4);
  CHECK(env[0].first == "OMP_NUM_THREADS");
  CHECK(env[2] == std::pair<std::string, std::string>{"VARUNA_GLOBAL_STORE", "/mnt/store"});
  CHECK(env[3] == std::pair<std::string, std::string>{"VARUNA_KEEP_CHECKPOINTS", "7"});
}

TEST_CASE("agents relay their workers' beats every twentieth of the heartbeat timeout, within 100..500 ms", "[config]") {
  const auto relayAt = [](double heartbeatTimeoutS) {
    JobConfig c;
    c.heartbeatTimeoutS = heartbeatTimeoutS;
    return agentBeatRelayInterval(c).count();
  };
  CHECK(relayAt(JobConfig{}.heartbeatTimeoutS) == 500);  // the default 10 s
  CHECK(relayAt(4) == 200);
  CHECK(relayAt(3) == 150);
  CHECK(relayAt(1) == 100);    // never faster than 10 a second
  CHECK(relayAt(0.5) == 100);
  CHECK(relayAt(3600) == 500);  // never slower than 2 a second
}

TEST_CASE("--master_port: 0 (the default) is a random port below the ephemeral range, others 1024..65000",
          "[config][security]") {
  CHECK(JobConfig{}.masterPort == 0);
  std::set<int> seen;
  for (int i = 0; i < 200; ++i) {
    const int port = randomRendezvousPort();
    CHECK(port >= 20000);
    CHECK(port + 99 < 32768);  // with the generation offset, still no ephemeral port
    seen.insert(port);
  }
  CHECK(seen.size() > 150);  // not one predictable value
  const auto dir = varuna::test::scratchDir("job_config_master_port");
  std::ofstream(dir / "machines.txt") << "127.0.0.1 slots=2\n";
  JobConfig c = validConfig(dir);
  CHECK_NOTHROW(validateJobConfig(c, "/x/run_varuna"));
  c.masterPort = 29500;
  CHECK_NOTHROW(validateJobConfig(c, "/x/run_varuna"));
  c.masterPort = 80;
  CHECK_THROWS_WITH(validateJobConfig(c, "/x/run_varuna"), Catch::Contains("--master_port must be 1024..65000"));
}

TEST_CASE("job config: a plaintext control plane only on a loopback address", "[config][security]") {
  const auto dir = varuna::test::scratchDir("job_config_plaintext");
  std::ofstream(dir / "machines.txt") << "127.0.0.1 slots=2\n";
  JobConfig c = validConfig(dir);
  c.insecurePlaintextControl = true;
  for (const char* loopback : {"127.0.0.1", "127.0.0.9", "::1", "::ffff:127.0.0.1"}) {
    c.managerIp = loopback;
    CHECK_NOTHROW(validateJobConfig(c, "/x/run_varuna"));
  }
  // Names are not addresses, even one that starts as a loopback address does.
  for (const char* network : {"10.0.0.1", "0.0.0.0", "", "127.example.org", "127.0.0.1.nip.example", "::ffff:10.0.0.1"}) {
    c.managerIp = network;
    CHECK_THROWS_WITH(validateJobConfig(c, "/x/run_varuna"),
                      Catch::Contains("--insecure_plaintext_control needs a loopback --manager_ip"));
  }
}
