#include "varuna/common/protocol.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "protocol_canonical.h"
#include "protocol_wire.h"
#include "varuna/common/secrets.h"

namespace varuna::proto {
namespace {

using nlohmann::json;

}  // namespace

// The messages' wire forms (protocol_wire.h): a type tag and its fields.
namespace wire {
#define VARUNA_WIRE(T, TAG, ...)                                       \
  template <>                                                           \
  struct Form<T> {                                                   \
    static constexpr const char* type = TAG;                            \
    static auto fields() { return std::make_tuple(__VA_ARGS__); }       \
  };
// A message without fields.
#define VARUNA_WIRE_EMPTY(T, TAG)                                       \
  template <>                                                           \
  struct Form<T> {                                                   \
    static constexpr const char* type = TAG;                            \
    static auto fields() { return std::tuple<>(); }                     \
  };

VARUNA_WIRE(Hello, "hello", required("version", &Hello::version), required("token", &Hello::token),
            required("role", &Hello::role), required("host", &Hello::host), required("rank", &Hello::rank),
            required("generation", &Hello::generation), optional("slots", &Hello::slots, 0))
VARUNA_WIRE(Heartbeat, "heartbeat", required("rank", &Heartbeat::rank), required("step", &Heartbeat::step),
            optional("waiting", &Heartbeat::waiting, false))
VARUNA_WIRE(WorkerBeats, "worker_beats", required("generation", &WorkerBeats::generation),
            required("beats", &WorkerBeats::beats), optional("reports", &WorkerBeats::reports, {}))
VARUNA_WIRE(StepReport, "step_report", required("rank", &StepReport::rank), required("stage", &StepReport::stage),
            required("replica", &StepReport::replica), required("step", &StepReport::step),
            required("loss", &StepReport::loss), required("step_seconds", &StepReport::stepSeconds),
            required("compute_seconds_per_microbatch", &StepReport::computeSecondsPerMicrobatch))
VARUNA_WIRE(WorkerExited, "worker_exited", required("host", &WorkerExited::host), required("rank", &WorkerExited::rank),
            required("exit_code", &WorkerExited::exitCode), required("signal", &WorkerExited::signal),
            required("generation", &WorkerExited::generation), required("log_tail", &WorkerExited::logTail))
VARUNA_WIRE(CheckpointFailed, "checkpoint_failed", required("rank", &CheckpointFailed::rank),
            required("step", &CheckpointFailed::step), bounded("error", &CheckpointFailed::error))
VARUNA_WIRE(PreemptNotice, "preempt", required("host", &PreemptNotice::host),
            required("deadline_unix_ms", &PreemptNotice::deadlineUnixMs))
VARUNA_WIRE(LaunchWorkers, "launch_workers", required("workers", &LaunchWorkers::workers),
            required("argv", &LaunchWorkers::argv), required("code_dir", &LaunchWorkers::codeDir),
            required("env", &LaunchWorkers::env), required("stage_to_rank_map", &LaunchWorkers::stageToRankMap),
            required("chunk_size", &LaunchWorkers::chunkSize), required("batch_size", &LaunchWorkers::batchSize),
            required("resume_step", &LaunchWorkers::resumeStep), required("master_addr", &LaunchWorkers::masterAddr),
            required("master_port", &LaunchWorkers::masterPort), required("world_size", &LaunchWorkers::worldSize),
            required("generation", &LaunchWorkers::generation))
VARUNA_WIRE_EMPTY(CheckpointAndExit, "checkpoint_and_exit")
VARUNA_WIRE(KillWorkers, "kill_workers", required("reason", &KillWorkers::reason))
VARUNA_WIRE(Shutdown, "shutdown", required("reason", &Shutdown::reason))
VARUNA_WIRE(Ping, "ping", required("sequence", &Ping::sequence), required("sent_ns", &Ping::sentNs))
VARUNA_WIRE(Pong, "pong", required("sequence", &Pong::sequence), required("sent_ns", &Pong::sentNs))
VARUNA_WIRE(Joined, "joined", required("credential", &Joined::credential), required("env", &Joined::env),
            optional("grace_ms", &Joined::graceMs, int64_t{0}),
            optional("lost_manager_ms", &Joined::lostManagerMs, int64_t{0}),
            optional("beat_relay_ms", &Joined::beatRelayMs, int64_t{0}))
VARUNA_WIRE(Ack, "ack", required("ok", &Ack::ok), required("error", &Ack::error))
VARUNA_WIRE(Welcome, "welcome", required("generation", &Welcome::generation),
            required("lost_manager_grace_ms", &Welcome::lostManagerGraceMs),
            optional("salvage_timeout_ms", &Welcome::salvageTimeoutMs, int64_t{0}))
VARUNA_WIRE(SalvageStop, "salvage_stop", required("generation", &SalvageStop::generation),
            bounded("reason", &SalvageStop::reason))
// An exchange of another step than `step` names it (-1: the exchange is step's).
VARUNA_WIRE(SalvageReady, "salvage_ready", required("rank", &SalvageReady::rank), required("stage", &SalvageReady::stage),
            required("replica", &SalvageReady::replica), required("step", &SalvageReady::step),
            required("generation", &SalvageReady::generation),
            optional("finishable_step", &SalvageReady::finishableStep, int64_t{-1}),
            exchange("exchange", &SalvageReady::exchange),
            optional("exchange_step", &SalvageReady::exchangeStep, int64_t{-1}))
VARUNA_WIRE(SalvageWrite, "salvage_write", required("generation", &SalvageWrite::generation),
            required("step", &SalvageWrite::step), required("writer_index", &SalvageWrite::writerIndex),
            required("writers", &SalvageWrite::writers), exchange("exchange", &SalvageWrite::exchange))
VARUNA_WIRE(ExitNow, "exit_now", required("generation", &ExitNow::generation), bounded("reason", &ExitNow::reason))
#undef VARUNA_WIRE
#undef VARUNA_WIRE_EMPTY
}  // namespace wire

namespace {

// The message whose type tag is `type`: tried against every alternative of Message.
template <size_t I = 0>
Message decodeByType(const std::string& type, const json& j) {
  if constexpr (I < std::variant_size_v<Message>) {
    using T = std::variant_alternative_t<I, Message>;
    if (type == wire::Form<T>::type) return wire::decodeMessage<T>(j);
    return decodeByType<I + 1>(type, j);
  } else {
    throw ProtocolError("unknown message type '" + type + "'");
  }
}

Message fromJson(const json& j) {
  if (!j.is_object()) throw ProtocolError("malformed message: not a JSON object");
  return decodeByType(j.at("type").get<std::string>(), j);
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
  return std::visit([](const auto& m) { return std::string(wire::Form<std::decay_t<decltype(m)>>::type); }, message);
}

std::string encode(const Message& message) {
  const std::string body = std::visit([](const auto& m) { return wire::encodeMessage(m).dump(); }, message);
  if (body.size() > kMaxFrameBytes) throw ProtocolError(strCat("message of ", body.size(), " bytes exceeds the frame limit"));
  const uint32_t n = static_cast<uint32_t>(body.size());
  std::string frame;
  frame.reserve(4 + body.size());
  for (int shift = 24; shift >= 0; shift -= 8) frame.push_back(static_cast<char>((n >> shift) & 0xff));
  return frame + body;
}

Message decodeBody(std::string_view body) {
  if (auto heartbeat = canonical::heartbeat(body)) return *heartbeat;
  if (auto beats = canonical::workerBeats(body)) return *std::move(beats);
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
  if (!constantTimeEquals(hello->token, expectedToken)) {
    throw ProtocolError(strCat("wrong job token from '", boundedText(hello->host, kMaxLoggedPeerTextBytes), "'"));
  }
  return *hello;
}

}  // namespace varuna::proto
