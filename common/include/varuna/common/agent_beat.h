// The heartbeat a worker sends its agent (docs/protocol.md, "Heartbeats
// through the agent"). An agent starts every worker of a launch with one end
// of a Unix datagram socket pair on file descriptor kAgentBeatFd (named in
// the environment as kAgentBeatFdEnv); the worker's ManagerLink sends one
// fixed-size datagram per heartbeat there instead of a frame to the
// manager, and the agent relays the newest beat of each worker in one
// WorkerBeats frame a few times a second. A thousand workers then cost the
// manager a frame per host, not one per worker and beat. Step reports take
// the same way (AgentStepRecord, told apart by its size): the agent relays
// every one, in the same frame, so the manager reads one frame per host and
// interval instead of one per rank and step. Both ends come from the same
// build; a record of another size is ignored.
// A beat older than kMaxAgentBeatAgeNs when the agent reads it is dropped;
// a step report is a fact and is relayed however old.
#pragma once

#include <time.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>

namespace varuna {

inline constexpr int kAgentBeatFd = 3;
inline constexpr const char* kAgentBeatFdEnv = "VARUNA_AGENT_BEAT_FD";
inline constexpr int64_t kMaxAgentBeatAgeNs = 1000000000;  // 1 s: a few relays

// CLOCK_MONOTONIC in nanoseconds: one clock for every process of a host.
inline int64_t monotonicNs() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

struct AgentBeatRecord {
  int32_t rank = 0;
  int32_t waiting = 0;  // 1: the training thread is blocked on a peer
  int64_t step = -1;    // the last finished step
  // When it was sent (monotonicNs): a beat that waited in the queue of a
  // stopped agent says nothing about the worker now, and is dropped.
  int64_t sentNs = 0;

  static constexpr size_t kBytes = 24;

  std::array<char, kBytes> encode() const {
    std::array<char, kBytes> out{};
    std::memcpy(out.data(), &rank, 4);
    std::memcpy(out.data() + 4, &waiting, 4);
    std::memcpy(out.data() + 8, &step, 8);
    std::memcpy(out.data() + 16, &sentNs, 8);
    return out;
  }
  static std::optional<AgentBeatRecord> decode(const char* data, size_t bytes) {
    if (bytes != kBytes) return std::nullopt;
    AgentBeatRecord r;
    std::memcpy(&r.rank, data, 4);
    std::memcpy(&r.waiting, data + 4, 4);
    std::memcpy(&r.step, data + 8, 8);
    std::memcpy(&r.sentNs, data + 16, 8);
    return r;
  }
};

// One step report (proto::StepReport) as a datagram to the agent.
struct AgentStepRecord {
  int32_t rank = 0, stage = 0, replica = 0;
  int64_t step = 0;
  double loss = 0, stepSeconds = 0, computeSecondsPerMicrobatch = 0;

  static constexpr size_t kBytes = 48;

  std::array<char, kBytes> encode() const {
    std::array<char, kBytes> out{};
    std::memcpy(out.data(), &rank, 4);
    std::memcpy(out.data() + 4, &stage, 4);
    std::memcpy(out.data() + 8, &replica, 4);
    std::memcpy(out.data() + 16, &step, 8);
    std::memcpy(out.data() + 24, &loss, 8);
    std::memcpy(out.data() + 32, &stepSeconds, 8);
    std::memcpy(out.data() + 40, &computeSecondsPerMicrobatch, 8);
    return out;
  }
  static std::optional<AgentStepRecord> decode(const char* data, size_t bytes) {
    if (bytes != kBytes) return std::nullopt;
    AgentStepRecord r;
    std::memcpy(&r.rank, data, 4);
    std::memcpy(&r.stage, data + 4, 4);
    std::memcpy(&r.replica, data + 8, 4);
    std::memcpy(&r.step, data + 16, 8);
    std::memcpy(&r.loss, data + 24, 8);
    std::memcpy(&r.stepSeconds, data + 32, 8);
    std::memcpy(&r.computeSecondsPerMicrobatch, data + 40, 8);
    return r;
  }
};
static_assert(AgentStepRecord::kBytes != AgentBeatRecord::kBytes, "the agent tells records apart by their size");

}  // namespace varuna
