// The real varuna_agent against a fake manager: its workers die with it (the
// parent-death signal: a SIGKILLed or OOM-killed agent takes them along), and
// an agent that loses the manager kills its workers after its grace and exits.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "fake_manager.h"
#include "process.h"
#include "test_env.h"

using namespace varuna;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// Process state letter ('R', 'S', 'Z', ...) and parent of `pid`; nullopt once it is gone.
std::optional<std::pair<char, pid_t>> processStat(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  const auto close = text.rfind(')');
  if (close == std::string::npos || close + 4 >= text.size()) return std::nullopt;
  char state = text[close + 2];
  pid_t parent = static_cast<pid_t>(std::atol(text.c_str() + close + 4));
  return std::make_pair(state, parent);
}

// Gone, or a zombie no one reaped yet (it runs nothing).
bool gone(pid_t pid) {
  const auto stat = processStat(pid);
  return !stat || stat->first == 'Z' || stat->first == 'X';
}

std::set<pid_t> childrenOf(pid_t parent) {
  std::set<pid_t> out;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(name));
    const auto stat = processStat(pid);
    if (stat && stat->second == parent && stat->first != 'Z') out.insert(pid);
  }
  return out;
}

struct AgentUnderTest {
  test::FakeManager manager;
  fs::path dir;
  std::optional<test::ChildProcess> agent;
  std::optional<test::FakePeer> link;

  AgentUnderTest(const std::string& name, const std::string& graceS) : dir(test::scratchDir(name)) {
    agent.emplace(std::vector<std::string>{(test::buildDir() / "bin" / "varuna_agent").string(), "--manager",
                                           manager.address(), "--host", "127.0.0.1", "--job", "agent-test-" + name,
                                           "--run_dir", (dir / "run").string(), "--code_dir", dir.string(),
                                           "--grace_s", graceS},
                  std::map<std::string, std::string>{{"VARUNA_JOB_TOKEN", "t0k"}}, dir / "agent");
    link = manager.accept(20s);
    REQUIRE(link);
    auto hello = link->receive(10s);
    REQUIRE(hello);
    CHECK(std::get<proto::Hello>(*hello).role == "agent");
  }

  // Two workers that only sleep (`exec`: the sleep is the agent's child itself).
  std::set<pid_t> launchSleepers() {
    proto::LaunchWorkers launch;
    launch.workers = {{0, 0}, {1, 1}};
    launch.argv = {"/bin/sh", "-c", "exec sleep 120"};
    launch.codeDir = dir.string();
    launch.stageToRankMap = "0;1;";
    launch.chunkSize = 1;
    launch.batchSize = 1;
    launch.masterAddr = "127.0.0.1";
    launch.masterPort = 29999;
    launch.worldSize = 2;
    launch.generation = 1;
    REQUIRE(link->send(launch));
    std::set<pid_t> workers;
    REQUIRE(test::waitUntil([&] { return (workers = childrenOf(agent->pid())).size() == 2; }, 10s));
    return workers;
  }
};

}  // namespace

TEST_CASE("agent: a SIGKILLed agent takes its workers along", "[agent]") {
  AgentUnderTest t("agent-sigkill", "30");
  const auto workers = t.launchSleepers();
  t.agent->kill(SIGKILL);
  REQUIRE(t.agent->wait(5s));
  for (const pid_t pid : workers) {
    INFO("worker " << pid);
    CHECK(test::waitUntil([&] { return gone(pid); }, 5s));
  }
}

TEST_CASE("agent: losing the manager, it kills its workers after its grace and exits", "[agent]") {
  AgentUnderTest t("agent-grace", "0.5");
  const auto workers = t.launchSleepers();
  const auto lost = std::chrono::steady_clock::now();
  t.link->close();
  const auto code = t.agent->wait(10s);
  REQUIRE(code);
  CHECK(*code == 1);  // "the manager is gone"
  CHECK(std::chrono::steady_clock::now() - lost >= 400ms);
  for (const pid_t pid : workers) {
    INFO("worker " << pid);
    CHECK(test::waitUntil([&] { return gone(pid); }, 5s));
  }
  CHECK_THAT(t.agent->stderrText() + t.agent->stdoutText(), Catch::Contains("lost the manager"));
}
