// The control protocol between run_varuna (the manager), the per-host agents,
// the workers and notify_manager_preempt. Every message is one of the plain
// structs below; a connection carries frames of
//     [4-byte big-endian length N][N bytes of JSON {"type": ..., fields...}]
// The first frame on every connection must be a Hello with the protocol
// version and the job's secret token; anything else closes the connection.
// The codec is pure (bytes in, message or error out): no sockets here.
// docs/protocol.md describes every message.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "varuna/common/errors.h"

namespace varuna::proto {

// 2: salvage (SalvageStop/Ready/Write, Welcome.salvage_timeout_ms) and
// workers' heartbeats relayed by their agent (WorkerBeats).
inline constexpr uint32_t kVersion = 2;
inline constexpr uint32_t kMaxFrameBytes = 1u << 20;  // 1 MiB: control messages are small
// Free-form error texts a worker reports (CheckpointFailed::error) are cut to
// this many bytes by the codec, on both sides: they end up in the manager's
// log and event log.
inline constexpr size_t kMaxErrorTextBytes = 500;
// What the manager logs of a refused peer's own text (the host field of its
// hello): at most this many bytes of valid UTF-8.
inline constexpr size_t kMaxLoggedPeerTextBytes = 200;

// --- to the manager -----------------------------------------------------------
struct Hello {  // first frame of every connection
  uint32_t version = kVersion;
  std::string token;
  std::string role;  // "worker", "agent", "notifier" or "join"
  std::string host;
  int rank = -1;        // workers
  int generation = -1;  // workers and agents: the launch they belong to
  int slots = 0;        // "join": the workers the host can run (its GPUs)
  bool operator==(const Hello&) const = default;
};
// From a worker (every 0.5 s; one started by an agent beats through it,
// WorkerBeats) and an agent (rank -1) to the manager; from the
// manager to every agent (rank -1), so an agent across a silent partition
// knows the manager is gone (docs/protocol.md).
struct Heartbeat {
  int rank = -1;  // -1 from an agent or the manager
  int64_t step = 0;  // a worker's last finished step (-1 before the first)
  // A worker's training thread is blocked on a peer (a receive, an
  // all-reduce, a barrier) rather than computing: a rank whose step stalls
  // while it computes and its peers wait is hung (the manager's liveness rule).
  bool waiting = false;
  bool operator==(const Heartbeat&) const = default;
};
// From an agent: the latest heartbeat of each of its workers that beat since
// its previous WorkerBeats (a worker started by an agent beats to it over a
// local socket, agent_beat.h; the agent relays them a few times a second).
// The manager reads each entry as that worker's Heartbeat: one frame per
// host instead of one per worker and beat (docs/protocol.md).
struct WorkerBeat {
  int rank = 0;
  int64_t step = -1;
  bool waiting = false;
  bool operator==(const WorkerBeat&) const = default;
};
struct StepReport {
  int rank = 0, stage = 0, replica = 0;
  int64_t step = 0;
  double loss = 0, stepSeconds = 0, computeSecondsPerMicrobatch = 0;
  bool operator==(const StepReport&) const = default;
};
// A relay of its workers' beats is a frame from the agent, so it stands for
// the agent's own heartbeat this long after it (the relay interval, at most
// 500 ms, plus 100 ms of timer slack): a relaying agent is heard from at least
// every heartbeat interval plus this (1.6 s), relays or not.
inline std::chrono::milliseconds relayStandsForHeartbeat(std::chrono::milliseconds relayInterval) {
  return std::min(relayInterval, std::chrono::milliseconds(500)) + std::chrono::milliseconds(100);
}
// When an agent relays first: `phase` (in [0, 1): random in varuna_agent,
// spread evenly in SimCluster) of one interval after it starts, then every
// interval. Agents that start together (srun, a job array, run_varuna's
// launch of every host at once) would otherwise relay in lockstep, and the
// manager would take every host's frame in one burst per interval, with
// every other message (a ping, a notice) queued behind it.
inline std::chrono::milliseconds firstRelayDelay(std::chrono::milliseconds relayInterval, double phase) {
  const double clamped = std::clamp(phase, 0.0, 1.0);
  return std::chrono::milliseconds(static_cast<int64_t>(static_cast<double>(relayInterval.count()) * clamped));
}
struct WorkerBeats {
  int generation = 0;  // of the launch whose workers beat
  std::vector<WorkerBeat> beats;
  // The step reports its workers sent since the last relay, in order (each
  // [rank, stage, replica, step, loss, step_seconds, compute_seconds_per_microbatch]).
  std::vector<StepReport> reports;
  bool operator==(const WorkerBeats&) const = default;
};
struct WorkerExited {  // from the agent, the moment it reaps a worker
  std::string host;
  int rank = 0;
  int exitCode = 0;  // -1 if killed by a signal
  int signal = 0;
  int generation = 0;
  std::string logTail;  // the last lines the worker printed, for the manager's message
  bool operator==(const WorkerExited&) const = default;
};
struct CheckpointFailed {  // from a worker: a periodic checkpoint failed (ENOSPC, EIO); training goes on
  int rank = 0;
  int64_t step = 0;    // the step the checkpoint was for
  std::string error;   // what failed, at most kMaxErrorTextBytes (longer texts are cut by the codec)
  bool operator==(const CheckpointFailed&) const = default;
};
struct PreemptNotice {  // from notify_manager_preempt
  std::string host;
  int64_t deadlineUnixMs = 0;  // 0: unknown
  bool operator==(const PreemptNotice&) const = default;
};

// --- from the manager ---------------------------------------------------------
struct WorkerSpec {
  int rank = 0, localRank = 0;
  bool operator==(const WorkerSpec&) const = default;
};
struct LaunchWorkers {  // to an agent: start these workers of the job
  std::vector<WorkerSpec> workers;
  std::vector<std::string> argv;  // program and its own arguments
  std::string codeDir;
  std::vector<std::pair<std::string, std::string>> env;
  std::string stageToRankMap;
  int64_t chunkSize = 0, batchSize = 0, resumeStep = -1;
  std::string masterAddr;
  int masterPort = 0;
  int worldSize = 0;
  int generation = 0;
  bool operator==(const LaunchWorkers&) const = default;
};
struct CheckpointAndExit {  // to an agent: SIGUSR1 to its workers
  bool operator==(const CheckpointAndExit&) const = default;
};
struct KillWorkers {  // to an agent: SIGKILL its workers
  std::string reason;
  bool operator==(const KillWorkers&) const = default;
};
struct Shutdown {  // to an agent: kill its workers (if any) and exit; the host leaves the job
  std::string reason;
  bool operator==(const Shutdown&) const = default;
};
struct Ping {  // any peer, after its hello: the manager answers with Pong at once
  int64_t sequence = 0;
  int64_t sentNs = 0;  // sender's clock, echoed back (round-trip measurement)
  bool operator==(const Ping&) const = default;
};
struct Pong {
  int64_t sequence = 0;
  int64_t sentNs = 0;
  bool operator==(const Pong&) const = default;
};
// To a worker, right after its hello was accepted: how long it may go without
// hearing from the manager (no connection, refused, no answer to its pings)
// before it takes its generation as over and exits on its own.
struct Welcome {
  int generation = 0;
  int64_t lostManagerGraceMs = 0;  // <= 0: keep the worker's default
  // > 0: salvage is on (docs/salvage.md): a worker that loses a peer reports
  // its last finished step (SalvageReady) and waits this long at most for
  // the manager's order. 0: it exits with kExitPeerLost as before.
  int64_t salvageTimeoutMs = 0;
  bool operator==(const Welcome&) const = default;
};
// To a worker, over its own connection: the manager ended this worker's
// generation (kill-all, a lost agent or host, a hang, the job's end, or a
// generation the manager does not know). The worker exits at once with
// kExitSuperseded, whatever its agent's state. `reason` is cut to
// kMaxErrorTextBytes by the codec.
struct ExitNow {
  int generation = 0;
  std::string reason;
  bool operator==(const ExitNow&) const = default;
};
// Salvage (docs/salvage.md). To a worker: the generation is over because a
// peer was lost; stop (interrupting any wait on a peer) and report.
struct SalvageStop {
  int generation = 0;
  std::string reason;  // cut to kMaxErrorTextBytes
  bool operator==(const SalvageStop&) const = default;
};
// The result of a step's job-wide exchange, as every rank that finished the
// all-reduce holds it: {sum of the micro-batch losses, squared gradient norm
// summed over the ranks, checkpoint flag}. A non-finite value (an fp16
// overflow) travels as JSON null and comes back as +infinity: only its
// finiteness decides anything. Empty: none.
inline constexpr size_t kExchangeValues = 3;
// From a worker in salvage mode: the step its memory holds, whole (-1: none
// it can vouch for, e.g. its buffers missed the step's synchronisation).
// `finishableStep` (or -1): the next step, when the rank's part of it is done
// up to the job-wide exchange that failed under it; given that exchange's
// result from a rank that finished it, the rank can apply the step itself.
// `exchange`: the result of the newest exchange the rank finished, that of
// step `exchangeStep` (-1: `step`'s). They differ for a rank that applied a
// step but missed its buffer broadcast: its `step` is -1 and `exchangeStep`
// the step it applied.
struct SalvageReady {
  int rank = 0, stage = 0, replica = 0;
  int64_t step = -1;
  int generation = 0;
  int64_t finishableStep = -1;
  std::vector<double> exchange;
  int64_t exchangeStep = -1;
  bool operator==(const SalvageReady&) const = default;
};
// To a worker chosen to write its stage's share of the salvaged checkpoint:
// writer `writerIndex` of `writers` (one per stage) writes `step` and exits
// with kExitSalvaged. `exchange`: the step's exchange result, for a writer
// that must first finish the step (its finishableStep).
struct SalvageWrite {
  int generation = 0;
  int64_t step = 0;
  int writerIndex = 0, writers = 0;
  std::vector<double> exchange;
  bool operator==(const SalvageWrite&) const = default;
};
// To an agent whose join was admitted (role "join", docs/protocol.md): its
// host's agent credential, with which it dials again as that host's agent,
// and the job's env_file variables for it and its workers. The connection
// closes after it.
struct Joined {
  std::string credential;
  std::vector<std::pair<std::string, std::string>> env;
  // The job's agent timing (run_varuna's --agent_grace_s and heartbeat
  // timeout): how long the agent keeps its workers without the manager, and
  // how often it relays their heartbeats; 0: its own.
  int64_t graceMs = 0, lostManagerMs = 0, beatRelayMs = 0;
  bool operator==(const Joined&) const = default;
};
// In the refusal of a join whose host name has an agent already: the joiner
// may try again (that agent may be on its way out).
inline constexpr std::string_view kJoinHostPresent = "a host of that name is present already";
struct Ack {
  bool ok = true;
  std::string error;
  bool operator==(const Ack&) const = default;
};

using Message = std::variant<Hello, Heartbeat, StepReport, WorkerExited, PreemptNotice, LaunchWorkers,
                             CheckpointAndExit, KillWorkers, Shutdown, Ping, Pong, Ack, CheckpointFailed, Welcome,
                             ExitNow, SalvageStop, SalvageReady, SalvageWrite, WorkerBeats, Joined>;

// A malformed frame or message; the connection that sent it must be closed.
class ProtocolError : public Error {
 public:
  explicit ProtocolError(const std::string& what) : Error(what, kExitConfigError) {}
};

std::string typeName(const Message& message);
// `text` as valid UTF-8 (each invalid byte becomes '?': the JSON encoder
// refuses invalid UTF-8) of at most `maxBytes` bytes, cut at a character
// boundary and ending in "..." when it was longer.
std::string boundedText(std::string_view text, size_t maxBytes = kMaxErrorTextBytes);
// The frame: length prefix + JSON body.
std::string encode(const Message& message);
// Parses one frame body (without the length prefix).
Message decodeBody(std::string_view body);

// Splits a byte stream into messages. Throws ProtocolError on an oversized
// frame (before buffering it) or a malformed body.
class FrameDecoder {
 public:
  explicit FrameDecoder(uint32_t maxFrameBytes = kMaxFrameBytes) : max_(maxFrameBytes) {}
  void feed(std::string_view bytes);
  std::optional<Message> next();
  size_t buffered() const { return buffer_.size(); }

 private:
  uint32_t max_;
  std::string buffer_;
};

// Checks the first message of a connection: a Hello with our version and the
// job's token. Throws ProtocolError saying which check failed (never echoing
// the token; the peer's host at most kMaxLoggedPeerTextBytes, valid UTF-8).
const Hello& checkHello(const Message& first, const std::string& expectedToken);

}  // namespace varuna::proto
