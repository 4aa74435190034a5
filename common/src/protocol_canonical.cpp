#include "protocol_canonical.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>

namespace varuna::proto::canonical {
namespace {

bool consume(std::string_view& s, std::string_view literal) {
  if (s.substr(0, literal.size()) != literal) return false;
  s.remove_prefix(literal.size());
  return true;
}

bool consumeInteger(std::string_view& s, int64_t& out) {
  size_t i = s.size() > 0 && s[0] == '-' ? 1 : 0;
  const size_t first = i;
  int64_t value = 0;
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i) {
    if (i - first == 18) return false;  // 19+ digits may not fit: the parser decides
    value = value * 10 + (s[i] - '0');
  }
  const size_t digits = i - first;
  if (digits == 0 || (s[first] == '0' && (digits > 1 || first == 1))) return false;
  out = first == 1 ? -value : value;
  s.remove_prefix(i);
  return true;
}

bool consumeInt(std::string_view& s, int& out) {
  int64_t value = 0;
  if (!consumeInteger(s, value)) return false;
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) return false;
  out = static_cast<int>(value);
  return true;
}

bool consumeBool(std::string_view& s, bool& out) {
  if (consume(s, "true")) {
    out = true;
    return true;
  }
  out = false;
  return consume(s, "false");
}

size_t digitsAt(std::string_view s, size_t i) {
  size_t n = 0;
  while (i + n < s.size() && s[i + n] >= '0' && s[i + n] <= '9') ++n;
  return n;
}

// Length of the JSON number at the start of `s` (RFC 8259's grammar), 0 if
// there is none: from_chars alone would also take "inf", "1." or "01".
size_t jsonNumberLength(std::string_view s) {
  size_t i = s.size() > 0 && s[0] == '-' ? 1 : 0;
  const size_t integer = digitsAt(s, i);
  if (integer == 0 || (s[i] == '0' && integer > 1)) return 0;
  i += integer;
  if (i < s.size() && s[i] == '.') {
    const size_t fraction = digitsAt(s, i + 1);
    if (fraction == 0) return 0;
    i += 1 + fraction;
  }
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    const size_t exponent = digitsAt(s, i);
    if (exponent == 0) return 0;
    i += exponent;
  }
  return i;
}

// A figure of a relayed step report: a JSON number, or null for a
// non-finite one (protocol_wire.h, finiteOrNull). Both parsers round
// correctly, so the double is the same bit for bit.
bool consumeFigure(std::string_view& s, double& out) {
  if (consume(s, "null")) {
    out = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  const size_t n = jsonNumberLength(s);
  if (n == 0 || s.substr(0, n) == "-0") return false;  // the parser reads "-0" as the integer 0, not -0.0
  const auto [end, ec] = std::from_chars(s.data(), s.data() + n, out);
  if (ec != std::errc() || end != s.data() + n || !std::isfinite(out)) return false;
  s.remove_prefix(n);
  return true;
}

// "[...,...]" of items, each read by `item`; "[]" too.
template <typename Item>
bool consumeArray(std::string_view& s, Item item) {
  if (!consume(s, "[")) return false;
  if (consume(s, "]")) return true;
  do {
    if (!item(s)) return false;
  } while (consume(s, ","));
  return consume(s, "]");
}

bool consumeBeat(std::string_view& s, WorkerBeat& b) {
  return consume(s, "[") && consumeInt(s, b.rank) && consume(s, ",") && consumeInteger(s, b.step) &&
         consume(s, ",") && consumeBool(s, b.waiting) && consume(s, "]");
}

bool consumeReport(std::string_view& s, StepReport& r) {
  return consume(s, "[") && consumeInt(s, r.rank) && consume(s, ",") && consumeInt(s, r.stage) && consume(s, ",") &&
         consumeInt(s, r.replica) && consume(s, ",") && consumeInteger(s, r.step) && consume(s, ",") &&
         consumeFigure(s, r.loss) && consume(s, ",") && consumeFigure(s, r.stepSeconds) && consume(s, ",") &&
         consumeFigure(s, r.computeSecondsPerMicrobatch) && consume(s, "]");
}

}  // namespace

std::optional<Heartbeat> heartbeat(std::string_view body) {
  int64_t step = 0;
  int rank = 0;
  if (!consume(body, "{\"rank\":") || !consumeInt(body, rank) || !consume(body, ",\"step\":") ||
      !consumeInteger(body, step) || !consume(body, ",\"type\":\"heartbeat\",\"waiting\":")) {
    return std::nullopt;
  }
  bool waiting = false;
  if (!consumeBool(body, waiting) || body != "}") return std::nullopt;
  return Heartbeat{rank, step, waiting};
}

std::optional<WorkerBeats> workerBeats(std::string_view body) {
  WorkerBeats beats;
  const auto beat = [&](std::string_view& s) { return consumeBeat(s, beats.beats.emplace_back()); };
  const auto report = [&](std::string_view& s) { return consumeReport(s, beats.reports.emplace_back()); };
  if (!consume(body, "{\"beats\":") || !consumeArray(body, beat) || !consume(body, ",\"generation\":") ||
      !consumeInt(body, beats.generation)) {
    return std::nullopt;
  }
  if (consume(body, ",\"reports\":") && !consumeArray(body, report)) return std::nullopt;
  if (body != ",\"type\":\"worker_beats\"}") return std::nullopt;
  return beats;
}

}  // namespace varuna::proto::canonical
