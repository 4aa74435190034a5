#include <catch2/catch.hpp>

#include "varuna/common/errors.h"
#include "varuna/common/machine_list.h"

using namespace varuna;

TEST_CASE("machine lists with comments, blanks and slots", "[machine_list]") {
  const auto machines = parseMachineList(
      "# spot VMs\n10.0.0.4 slots=4\n\n  10.0.0.5   # default slots\nworker-7.cluster.local slots=1\nfe80::1\n", "m.txt", 2);
  REQUIRE(machines.size() == 4);
  CHECK(machines[0] == Machine{"10.0.0.4", 4});
  CHECK(machines[1] == Machine{"10.0.0.5", 2});
  CHECK(machines[1].line == 4);
  CHECK(machines[2] == Machine{"worker-7.cluster.local", 1});
  CHECK(machines[3].host == "fe80::1");
  CHECK(parseMachineList("", "empty", 1).empty());
}

TEST_CASE("bad machine lists are refused, naming file and line", "[machine_list]") {
  struct Case {
    const char* text;
    const char* error;
  };
  const Case cases[] = {
      {"10.0.0.4\n10.0.0.4 slots=2\n", "line 2: host '10.0.0.4' is listed twice"},
      {"10.0.0.256\n", "line 1: '10.0.0.256' is not an IP address or host name"},
      {"bad_host!\n", "'bad_host!' is not an IP address or host name"},
      {"-leading\n", "is not an IP address or host name"},
      {"10.0.0.4 gpus=2\n", "line 1: unknown setting 'gpus=2'"},
      {"10.0.0.4 slots\n", "unknown setting 'slots'"},
      {"a\n10.0.0.4 slots=0\n", "line 2: slots must be a whole number from 1 to 1024, got '0'"},
      {"10.0.0.4 slots=two\n", "got 'two'"},
      {"10.0.0.4 slots=4x\n", "got '4x'"},
      {"10.0.0.4 slots=5000\n", "got '5000'"},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    CHECK_THROWS_WITH(parseMachineList(c.text, "hosts.txt", 1),
                      Catch::Contains("machine list 'hosts.txt'") && Catch::Contains(c.error));
  }
  CHECK_THROWS_WITH(readMachineList("/nonexistent/hosts", 1), Catch::Contains("--machine_list"));
}
