// The machine list run_varuna reads (and watches): one host per line,
// optionally with its number of worker slots, e.g.
//     # spot VMs of the job
//     10.0.0.4 slots=4
//     10.0.0.5            (gpus_per_node slots)
// Comments (#) and blank lines are allowed. Duplicate hosts, malformed
// addresses, unknown keys and bad slot counts are ConfigErrors naming the file
// and line. Pure functions.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace varuna {

struct Machine {
  std::string host;
  int slots = 1;
  int line = 0;  // where it was declared, for messages
  bool operator==(const Machine& o) const { return host == o.host && slots == o.slots; }
};

// `source` names the input in errors (usually the file path).
std::vector<Machine> parseMachineList(std::string_view text, const std::string& source, int defaultSlots);
std::vector<Machine> readMachineList(const std::string& path, int defaultSlots);

// An IPv4 or IPv6 address, or a DNS host name.
bool isValidHostAddress(std::string_view host);

}  // namespace varuna
