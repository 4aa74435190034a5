// ControlClient: a blocking TCP connection to the manager speaking the control
// protocol (protocol.h). Used where an event loop would be overkill: the
// worker's reporter thread and notify_manager_preempt. One thread uses a
// client at a time; it is movable, not copyable, and closes on destruction.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <utility>

#include "varuna/common/protocol.h"

namespace varuna::proto {

// The manager cannot be reached, or the connection broke.
class ConnectionError : public Error {
 public:
  explicit ConnectionError(const std::string& what) : Error(what, 1) {}
};

// "host:port" or "[v6addr]:port" -> (host, port). Throws ConfigError naming `what`.
std::pair<std::string, int> splitHostPort(const std::string& address, const std::string& what);

class ControlClient {
 public:
  // Connects within `timeout`. Throws Error saying which address failed and why.
  static ControlClient connect(const std::string& address, std::chrono::milliseconds timeout);
  // Takes over a connected socket (the inverse of release()), e.g. one a
  // listener accepted; `address` names the peer in errors.
  static ControlClient adopt(int fd, std::string address) { return ControlClient(fd, std::move(address)); }

  ControlClient(ControlClient&& other) noexcept;
  ControlClient& operator=(ControlClient&& other) noexcept;
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;
  ~ControlClient();

  // Throws Error when the connection is gone.
  void send(const Message& message);
  // The same, but gives up after `timeout` without the frame fully handed to
  // the kernel (the peer stopped reading, or a partition filled the send
  // buffer): the connection is closed (a frame may be half sent) and
  // ConnectionError thrown. A thread that must stay responsive never blocks
  // longer than that.
  void send(const Message& message, std::chrono::milliseconds timeout);
  // The next message, or nullopt if none arrived within `timeout`. Throws
  // Error when the manager closed the connection.
  std::optional<Message> receive(std::chrono::milliseconds timeout);
  bool connected() const { return fd_ >= 0; }
  void close();
  // Gives up ownership of the socket (e.g. to an Asio socket); the client is closed after.
  int release() { return std::exchange(fd_, -1); }

 private:
  ControlClient(int fd, std::string address) : fd_(fd), address_(std::move(address)) {}
  void sendFrame(const std::string& frame, std::optional<std::chrono::steady_clock::time_point> deadline);
  int fd_ = -1;
  std::string address_;
  FrameDecoder decoder_;
};

// Tells the manager at `address` that `host` will be taken at
// `deadlineUnixMs` (0: unknown), as a notifier holding `credential` (the
// host's notifier credential, or the job's secret), and waits for the
// acknowledgement. Throws ConnectionError when the manager cannot be reached
// within `timeout`, does not answer, or refuses the notice (its reason).
// notify_manager_preempt, and an agent told by its scheduler (SIGTERM).
void notifyPreemption(const std::string& address, const std::string& credential, const std::string& host,
                      int64_t deadlineUnixMs, std::chrono::milliseconds timeout);

}  // namespace varuna::proto
