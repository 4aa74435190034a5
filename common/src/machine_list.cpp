#include "varuna/common/machine_list.h"

#include <arpa/inet.h>

#include <cctype>
#include <charconv>
#include <fstream>
#include <set>
#include <sstream>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

bool isHostName(std::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  size_t start = 0;
  while (start <= host.size()) {
    size_t dot = host.find('.', start);
    std::string_view label = host.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') return false;
    for (char c : label) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-')) return false;
    }
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  // All-numeric dotted names must be real IPv4 addresses (caught above).
  return host.find_first_not_of("0123456789.") != std::string_view::npos;
}

std::vector<std::string_view> words(std::string_view line) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
    size_t j = i;
    while (j < line.size() && !std::isspace(static_cast<unsigned char>(line[j]))) ++j;
    if (j > i) out.push_back(line.substr(i, j - i));
    i = j;
  }
  return out;
}

}  // namespace

bool isValidHostAddress(std::string_view host) {
  const std::string h(host);
  unsigned char buf[16];
  if (inet_pton(AF_INET, h.c_str(), buf) == 1 || inet_pton(AF_INET6, h.c_str(), buf) == 1) return true;
  return isHostName(host);
}

std::vector<Machine> parseMachineList(std::string_view text, const std::string& source, int defaultSlots) {
  std::vector<Machine> machines;
  std::set<std::string> seen;
  std::istringstream in{std::string(text)};
  int lineNo = 0;
  for (std::string raw; std::getline(in, raw);) {
    ++lineNo;
    std::string_view line = raw;
    if (auto hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    auto fields = words(line);
    if (fields.empty()) continue;
    auto fail = [&](const std::string& why) -> void {
      throw ConfigError(strCat("machine list '", source, "' line ", lineNo, ": ", why));
    };
    Machine m;
    m.host = std::string(fields[0]);
    m.slots = defaultSlots;
    m.line = lineNo;
    if (!isValidHostAddress(m.host)) fail(strCat("'", m.host, "' is not an IP address or host name"));
    for (size_t k = 1; k < fields.size(); ++k) {
      const auto eq = fields[k].find('=');
      const std::string_view key = fields[k].substr(0, eq);
      if (eq == std::string_view::npos || key != "slots") {
        fail(strCat("unknown setting '", fields[k], "'; the only one is slots=N"));
      }
      const std::string_view value = fields[k].substr(eq + 1);
      int slots = 0;
      auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), slots);
      if (ec != std::errc() || ptr != value.data() + value.size() || slots < 1 || slots > 1024) {
        fail(strCat("slots must be a whole number from 1 to 1024, got '", value, "'"));
      }
      m.slots = slots;
    }
    if (!seen.insert(m.host).second) fail(strCat("host '", m.host, "' is listed twice"));
    machines.push_back(m);
  }
  return machines;
}

std::vector<Machine> readMachineList(const std::string& path, int defaultSlots) {
  std::ifstream in(path);
  if (!in) throw ConfigError(strCat("cannot read the machine list '", path, "': check --machine_list"));
  std::stringstream s;
  s << in.rdbuf();
  return parseMachineList(s.str(), path, defaultSlots);
}

}  // namespace varuna
