#include "varuna/common/protocol.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

namespace varuna::proto {
namespace {

using nlohmann::json;

template <typename... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};

// An exchange result (see kExchangeValues): non-finite values as null, which
// JSON has no number for.
json exchangeToJson(const std::vector<double>& values) {
  json out = json::array();
  for (double v : values) out.push_back(std::isfinite(v) ? json(v) : json(nullptr));
  return out;
}

std::vector<double> exchangeFromJson(const json& message, const std::string& type) {
  if (!message.contains("exchange")) return {};
  const auto& values = message.at("exchange");
  if (!values.is_array() || !(values.empty() || values.size() == kExchangeValues)) {
    throw ProtocolError(type + ": exchange must be [] or an array of " + std::to_string(kExchangeValues) + " numbers");
  }
  std::vector<double> out;
  for (const auto& v : values) {
    if (!v.is_null() && !v.is_number()) throw ProtocolError(type + ": exchange values must be numbers or null");
    out.push_back(v.is_null() ? std::numeric_limits<double>::infinity() : v.get<double>());
  }
  return out;
}

json toJson(const Hello& m) {
  return {{"type", "hello"}, {"version", m.version}, {"token", m.token}, {"role", m.role}, {"host", m.host}, {"rank", m.rank}, {"generation", m.generation}};
}
json toJson(const Heartbeat& m) {
  return {{"type", "heartbeat"}, {"rank", m.rank}, {"step", m.step}, {"waiting", m.waiting}};
}
json toJson(const WorkerBeats& m) {
  json beats = json::array();
  // [rank, step, waiting] triples: a host's worth of beats in one small frame.
  for (const auto& b : m.beats) beats.push_back({b.rank, b.step, b.waiting});
  return {{"type", "worker_beats"}, {"generation", m.generation}, {"beats", beats}};
}
json toJson(const StepReport& m) {
  return {{"type", "step_report"}, {"rank", m.rank}, {"stage", m.stage}, {"replica", m.replica}, {"step", m.step},
          {"loss", m.loss}, {"step_seconds", m.stepSeconds}, {"compute_seconds_per_microbatch", m.computeSecondsPerMicrobatch}};
}
json toJson(const WorkerExited& m) {
  return {{"type", "worker_exited"}, {"host", m.host}, {"rank", m.rank}, {"exit_code", m.exitCode}, {"signal", m.signal},
          {"generation", m.generation}, {"log_tail", m.logTail}};
}
json toJson(const CheckpointFailed& m) {
  return {{"type", "checkpoint_failed"}, {"rank", m.rank}, {"step", m.step}, {"error", boundedText(m.error)}};
}
json toJson(const PreemptNotice& m) { return {{"type", "preempt"}, {"host", m.host}, {"deadline_unix_ms", m.deadlineUnixMs}}; }
json toJson(const LaunchWorkers& m) {
  json workers = json::array();
  for (const auto& w : m.workers) workers.push_back({{"rank", w.rank}, {"local_rank", w.localRank}});
  json env = json::array();
  for (const auto& [k, v] : m.env) env.push_back({k, v});
  return {{"type", "launch_workers"}, {"workers", workers}, {"argv", m.argv}, {"code_dir", m.codeDir}, {"env", env},
          {"stage_to_rank_map", m.stageToRankMap}, {"chunk_size", m.chunkSize}, {"batch_size", m.batchSize},
          {"resume_step", m.resumeStep}, {"master_addr", m.masterAddr}, {"master_port", m.masterPort},
          {"world_size", m.worldSize}, {"generation", m.generation}};
}
json toJson(const CheckpointAndExit&) { return {{"type", "checkpoint_and_exit"}}; }
json toJson(const KillWorkers& m) { return {{"type", "kill_workers"}, {"reason", m.reason}}; }
json toJson(const Shutdown& m) { return {{"type", "shutdown"}, {"reason", m.reason}}; }
json toJson(const Ping& m) { return {{"type", "ping"}, {"sequence", m.sequence}, {"sent_ns", m.sentNs}}; }
json toJson(const Pong& m) { return {{"type", "pong"}, {"sequence", m.sequence}, {"sent_ns", m.sentNs}}; }
json toJson(const Welcome& m) {
  return {{"type", "welcome"},
          {"generation", m.generation},
          {"lost_manager_grace_ms", m.lostManagerGraceMs},
          {"salvage_timeout_ms", m.salvageTimeoutMs}};
}
json toJson(const SalvageStop& m) {
  return {{"type", "salvage_stop"}, {"generation", m.generation}, {"reason", boundedText(m.reason)}};
}
json toJson(const SalvageReady& m) {
  return {{"type", "salvage_ready"},  {"rank", m.rank},
          {"stage", m.stage},         {"replica", m.replica},
          {"step", m.step},           {"generation", m.generation},
          {"finishable_step", m.finishableStep}, {"exchange", exchangeToJson(m.exchange)},
          {"exchange_step", m.exchangeStep}};
}
json toJson(const SalvageWrite& m) {
  return {{"type", "salvage_write"}, {"generation", m.generation}, {"step", m.step},
          {"writer_index", m.writerIndex}, {"writers", m.writers}, {"exchange", exchangeToJson(m.exchange)}};
}
json toJson(const ExitNow& m) {
  return {{"type", "exit_now"}, {"generation", m.generation}, {"reason", boundedText(m.reason)}};
}
json toJson(const Ack& m) { return {{"type", "ack"}, {"ok", m.ok}, {"error", m.error}}; }

Message fromJson(const json& j) {
  const std::string type = j.at("type").get<std::string>();
  if (type == "hello") {
    return Hello{j.at("version"), j.at("token"), j.at("role"), j.at("host"), j.at("rank"), j.at("generation")};
  }
  if (type == "heartbeat") return Heartbeat{j.at("rank"), j.at("step"), j.value("waiting", false)};
  if (type == "worker_beats") {
    WorkerBeats m{j.at("generation"), {}};
    const auto& beats = j.at("beats");
    if (!beats.is_array()) throw ProtocolError("worker_beats: beats must be an array");
    for (const auto& b : beats) {
      if (!b.is_array() || b.size() != 3) throw ProtocolError("worker_beats: each beat must be [rank, step, waiting]");
      m.beats.push_back({b.at(0), b.at(1), b.at(2)});
    }
    return m;
  }
  if (type == "step_report") {
    return StepReport{j.at("rank"), j.at("stage"), j.at("replica"), j.at("step"), j.at("loss"), j.at("step_seconds"),
                      j.at("compute_seconds_per_microbatch")};
  }
  if (type == "worker_exited") return WorkerExited{j.at("host"), j.at("rank"), j.at("exit_code"), j.at("signal"), j.at("generation"),
                        j.at("log_tail")};
  if (type == "checkpoint_failed") {
    return CheckpointFailed{j.at("rank"), j.at("step"), boundedText(j.at("error").get<std::string>())};
  }
  if (type == "preempt") return PreemptNotice{j.at("host"), j.at("deadline_unix_ms")};
  if (type == "launch_workers") {
    LaunchWorkers m;
    for (const auto& w : j.at("workers")) m.workers.push_back({w.at("rank"), w.at("local_rank")});
    m.argv = j.at("argv").get<std::vector<std::string>>();
    m.codeDir = j.at("code_dir");
    for (const auto& kv : j.at("env")) m.env.emplace_back(kv.at(0).get<std::string>(), kv.at(1).get<std::string>());
    m.stageToRankMap = j.at("stage_to_rank_map");
    m.chunkSize = j.at("chunk_size");
    m.batchSize = j.at("batch_size");
    m.resumeStep = j.at("resume_step");
    m.masterAddr = j.at("master_addr");
    m.masterPort = j.at("master_port");
    m.worldSize = j.at("world_size");
    m.generation = j.at("generation");
    return m;
  }
  if (type == "checkpoint_and_exit") return CheckpointAndExit{};
  if (type == "kill_workers") return KillWorkers{j.at("reason")};
  if (type == "shutdown") return Shutdown{j.at("reason")};
  if (type == "ping") return Ping{j.at("sequence"), j.at("sent_ns")};
  if (type == "pong") return Pong{j.at("sequence"), j.at("sent_ns")};
  if (type == "ack") return Ack{j.at("ok"), j.at("error")};
  if (type == "welcome") {
    return Welcome{j.at("generation"), j.at("lost_manager_grace_ms"), j.value("salvage_timeout_ms", int64_t{0})};
  }
  if (type == "salvage_stop") {
    return SalvageStop{j.at("generation"), boundedText(j.at("reason").get<std::string>())};
  }
  if (type == "salvage_ready") {
    return SalvageReady{j.at("rank"),
                        j.at("stage"),
                        j.at("replica"),
                        j.at("step"),
                        j.at("generation"),
                        j.value("finishable_step", int64_t{-1}),
                        exchangeFromJson(j, type),
                        j.value("exchange_step", int64_t{-1})};  // -1: the exchange is step's
  }
  if (type == "salvage_write") {
    return SalvageWrite{j.at("generation"), j.at("step"), j.at("writer_index"), j.at("writers"),
                        exchangeFromJson(j, type)};
  }
  if (type == "exit_now") return ExitNow{j.at("generation"), boundedText(j.at("reason").get<std::string>())};
  throw ProtocolError("unknown message type '" + type + "'");
}

// Heartbeats are most of what the manager reads (10 Hz from every worker).
// Their canonical encoding (what encode() writes: keys sorted, no spaces) is
// matched here without building a JSON document, which costs several
// allocations per frame. Anything else (spaces, another key order, numbers
// with a fraction, exponent, leading zero, -0 or more than 18 digits, a rank
// outside int) is left to the full parser, so the result never differs.
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

std::optional<Heartbeat> canonicalHeartbeat(std::string_view body) {
  int64_t rank = 0, step = 0;
  if (!consume(body, "{\"rank\":") || !consumeInteger(body, rank) || !consume(body, ",\"step\":") ||
      !consumeInteger(body, step) || !consume(body, ",\"type\":\"heartbeat\",\"waiting\":")) {
    return std::nullopt;
  }
  bool waiting = false;
  if (body == "true}") {
    waiting = true;
  } else if (body != "false}") {
    return std::nullopt;
  }
  if (rank < std::numeric_limits<int>::min() || rank > std::numeric_limits<int>::max()) return std::nullopt;
  return Heartbeat{static_cast<int>(rank), step, waiting};
}

// Length of the valid UTF-8 sequence at the start of `s`, 0 if it is not one.
size_t utf8SequenceLength(std::string_view s) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char lead = byte(0);
  size_t n = 0;
  if (lead < 0x80) return 1;
  if (lead >= 0xc2 && lead <= 0xdf) n = 2;
  else if (lead >= 0xe0 && lead <= 0xef) n = 3;
  else if (lead >= 0xf0 && lead <= 0xf4) n = 4;
  else return 0;
  if (s.size() < n) return 0;
  for (size_t i = 1; i < n; ++i) {
    if ((byte(i) & 0xc0) != 0x80) return 0;
  }
  // Overlong forms, surrogates and code points past U+10FFFF.
  if (lead == 0xe0 && byte(1) < 0xa0) return 0;
  if (lead == 0xed && byte(1) > 0x9f) return 0;
  if (lead == 0xf0 && byte(1) < 0x90) return 0;
  if (lead == 0xf4 && byte(1) > 0x8f) return 0;
  return n;
}

}  // namespace

std::string boundedText(std::string_view text, size_t maxBytes) {
  std::string out;
  size_t i = 0;
  while (i < text.size() && out.size() <= maxBytes) {  // never more of a long text than needed
    const size_t n = utf8SequenceLength(text.substr(i));
    if (n == 0) {
      out.push_back('?');
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  if (i == text.size() && out.size() <= maxBytes) return out;
  constexpr std::string_view kEllipsis = "...";
  size_t keep = maxBytes >= kEllipsis.size() ? maxBytes - kEllipsis.size() : 0;
  while (keep > 0 && (static_cast<unsigned char>(out[keep]) & 0xc0) == 0x80) --keep;  // a character's start
  out.resize(keep);
  out.append(kEllipsis.substr(0, std::min(kEllipsis.size(), maxBytes)));
  return out;
}

std::string typeName(const Message& message) {
  return std::visit([](const auto& m) { return toJson(m).at("type").template get<std::string>(); }, message);
}

std::string encode(const Message& message) {
  const std::string body = std::visit([](const auto& m) { return toJson(m).dump(); }, message);
  if (body.size() > kMaxFrameBytes) throw ProtocolError(strCat("message of ", body.size(), " bytes exceeds the frame limit"));
  const uint32_t n = static_cast<uint32_t>(body.size());
  std::string frame;
  frame.reserve(4 + body.size());
  for (int shift = 24; shift >= 0; shift -= 8) frame.push_back(static_cast<char>((n >> shift) & 0xff));
  return frame + body;
}

Message decodeBody(std::string_view body) {
  if (auto heartbeat = canonicalHeartbeat(body)) return *heartbeat;
  try {
    return fromJson(json::parse(body));
  } catch (const ProtocolError&) {
    throw;
  } catch (const std::exception& e) {
    throw ProtocolError(strCat("malformed message: ", e.what()));
  }
}

void FrameDecoder::feed(std::string_view bytes) { buffer_.append(bytes); }

std::optional<Message> FrameDecoder::next() {
  if (buffer_.size() < 4) return std::nullopt;
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n = (n << 8) | static_cast<unsigned char>(buffer_[i]);
  if (n > max_) throw ProtocolError(strCat("frame of ", n, " bytes exceeds the limit of ", max_));
  if (buffer_.size() < 4 + static_cast<size_t>(n)) return std::nullopt;
  Message m = decodeBody(std::string_view(buffer_).substr(4, n));
  buffer_.erase(0, 4 + static_cast<size_t>(n));
  return m;
}

const Hello& checkHello(const Message& first, const std::string& expectedToken) {
  const auto* hello = std::get_if<Hello>(&first);
  if (!hello) throw ProtocolError(strCat("the first message must be hello, got ", typeName(first)));
  if (hello->version != kVersion) {
    throw ProtocolError(strCat("protocol version ", hello->version, " from ",
                               boundedText(hello->host, kMaxLoggedPeerTextBytes), " is not ", kVersion,
                               ": run the same varuna build everywhere"));
  }
  if (hello->token != expectedToken) {
    throw ProtocolError(strCat("wrong job token from '", boundedText(hello->host, kMaxLoggedPeerTextBytes), "'"));
  }
  return *hello;
}

}  // namespace varuna::proto
