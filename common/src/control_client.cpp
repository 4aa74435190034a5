#include "varuna/common/control_client.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace varuna::proto {
namespace {

using Clock = std::chrono::steady_clock;

int remainingMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

// Non-blocking connect bounded by the deadline; returns the fd or -1 with errno set.
int connectOne(const addrinfo& ai, Clock::time_point deadline) {
  const int fd = ::socket(ai.ai_family, ai.ai_socktype | SOCK_CLOEXEC, ai.ai_protocol);
  if (fd < 0) return -1;
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, ai.ai_addr, ai.ai_addrlen);
  if (rc < 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    do {
      rc = ::poll(&p, 1, remainingMs(deadline));
    } while (rc < 0 && errno == EINTR);  // a signal meanwhile is no failure to connect
    if (rc == 0) {
      errno = ETIMEDOUT;
      rc = -1;
    } else if (rc > 0) {
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      errno = err;
      rc = err == 0 ? 0 : -1;
    }
  }
  if (rc < 0) {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  }
  ::fcntl(fd, F_SETFL, flags);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

}  // namespace

std::pair<std::string, int> splitHostPort(const std::string& address, const std::string& what) {
  std::string host;
  std::string port;
  if (!address.empty() && address.front() == '[') {
    const auto close = address.find(']');
    if (close != std::string::npos && close + 1 < address.size() && address[close + 1] == ':') {
      host = address.substr(1, close - 1);
      port = address.substr(close + 2);
    }
  } else if (const auto colon = address.rfind(':'); colon != std::string::npos) {
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  char* end = nullptr;
  const long value = port.empty() ? -1 : std::strtol(port.c_str(), &end, 10);
  if (host.empty() || value < 1 || value > 65535 || *end != '\0') {
    throw ConfigError(strCat(what, " '", address, "' is not host:port (e.g. 10.0.0.1:29400 or [::1]:29400)"));
  }
  return {host, static_cast<int>(value)};
}

ControlClient ControlClient::connect(const std::string& address, std::chrono::milliseconds timeout) {
  const auto [host, port] = splitHostPort(address, "manager address");
  const auto deadline = Clock::now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  const std::string portText = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), portText.c_str(), &hints, &list); rc != 0) {
    throw ConnectionError(strCat("cannot resolve manager address ", address, ": ", ::gai_strerror(rc)));
  }
  int fd = -1;
  int lastErrno = 0;
  for (addrinfo* ai = list; ai && fd < 0; ai = ai->ai_next) {
    fd = connectOne(*ai, deadline);
    if (fd < 0) lastErrno = errno;
  }
  ::freeaddrinfo(list);
  if (fd < 0) throw ConnectionError(strCat("cannot connect to the manager at ", address, ": ", std::strerror(lastErrno)));
  return ControlClient(fd, address);
}

ControlClient::ControlClient(ControlClient&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), address_(std::move(other.address_)), decoder_(std::move(other.decoder_)) {}

ControlClient& ControlClient::operator=(ControlClient&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    address_ = std::move(other.address_);
    decoder_ = std::move(other.decoder_);
  }
  return *this;
}

ControlClient::~ControlClient() { close(); }

void ControlClient::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void ControlClient::send(const Message& message) { sendFrame(encode(message), std::nullopt); }

void ControlClient::send(const Message& message, std::chrono::milliseconds timeout) {
  sendFrame(encode(message), Clock::now() + timeout);
}

void ControlClient::sendFrame(const std::string& frame, std::optional<Clock::time_point> deadline) {
  if (fd_ < 0) throw ConnectionError(strCat("the connection to the manager at ", address_, " is closed"));
  size_t sent = 0;
  while (sent < frame.size()) {
    const int flags = MSG_NOSIGNAL | (deadline ? MSG_DONTWAIT : 0);
    const ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent, flags);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && deadline && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_, POLLOUT, 0};
      const int rc = ::poll(&p, 1, remainingMs(*deadline));
      if (rc < 0 && errno == EINTR) continue;
      if (rc == 0) {
        close();
        throw ConnectionError(strCat("the manager at ", address_, " took no data for ",
                                     "longer than the send timeout (not reading, or unreachable)"));
      }
      continue;  // writable, or an error the next send reports
    }
    if (n <= 0) {
      const int err = errno;
      close();
      throw ConnectionError(strCat("lost the connection to the manager at ", address_, ": ", std::strerror(err)));
    }
    sent += static_cast<size_t>(n);
  }
}

std::optional<Message> ControlClient::receive(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    if (auto message = decoder_.next()) return message;
    if (fd_ < 0) throw ConnectionError(strCat("the connection to the manager at ", address_, " is closed"));
    pollfd p{fd_, POLLIN, 0};
    const int rc = ::poll(&p, 1, remainingMs(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) return std::nullopt;
    char buffer[4096];
    const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close();
      throw ConnectionError(strCat("the manager at ", address_, " closed the connection"));
    }
    decoder_.feed(std::string_view(buffer, static_cast<size_t>(n)));
  }
}

void notifyPreemption(const std::string& address, const std::string& credential, const std::string& host,
                      int64_t deadlineUnixMs, std::chrono::milliseconds timeout) {
  auto client = ControlClient::connect(address, timeout);
  client.send(Hello{kVersion, credential, "notifier", host, -1, -1}, timeout);
  client.send(PreemptNotice{host, deadlineUnixMs}, timeout);
  const auto reply = client.receive(timeout);
  const auto* ack = reply ? std::get_if<Ack>(&*reply) : nullptr;
  if (!ack) {
    throw ConnectionError(strCat("the manager at ", address, " did not acknowledge within ",
                                 std::chrono::duration<double>(timeout).count(), " s"));
  }
  if (!ack->ok) throw ConnectionError(strCat("the manager refused the notice: ", ack->error));
}

}  // namespace varuna::proto
