#include "fake_manager.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace varuna::test {
namespace {

using Clock = std::chrono::steady_clock;

int remainingMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

}  // namespace

FakePeer::FakePeer(FakePeer&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), closed_(other.closed_), decoder_(std::move(other.decoder_)) {}

FakePeer& FakePeer::operator=(FakePeer&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    closed_ = other.closed_;
    decoder_ = std::move(other.decoder_);
  }
  return *this;
}

FakePeer::~FakePeer() { close(); }

void FakePeer::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  closed_ = true;
}

bool FakePeer::send(const proto::Message& message) {
  if (fd_ < 0) return false;
  const std::string frame = proto::encode(message);
  size_t sent = 0;
  while (sent < frame.size()) {
    const ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

std::optional<proto::Message> FakePeer::receive(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    if (auto message = decoder_.next()) return message;
    if (fd_ < 0) return std::nullopt;
    pollfd p{fd_, POLLIN, 0};
    const int rc = ::poll(&p, 1, remainingMs(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) return std::nullopt;
    char buffer[4096];
    const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close();
      return std::nullopt;
    }
    decoder_.feed(std::string_view(buffer, static_cast<size_t>(n)));
  }
}

bool FakePeer::sendHeartbeatsFor(std::chrono::milliseconds duration, std::chrono::milliseconds interval) {
  const auto end = Clock::now() + duration;
  while (Clock::now() < end) {
    if (!send(proto::Heartbeat{-1, 0})) return false;
    const auto next = std::min(Clock::now() + interval, end);
    while (Clock::now() < next) {
      receive(std::chrono::milliseconds(remainingMs(next) + 1));
      if (closed_) return false;
    }
  }
  return true;
}

FakeManager::FakeManager() {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd_, 16) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error(std::string("fake manager: cannot listen: ") + std::strerror(errno));
  }
  port_ = ntohs(addr.sin_port);
}

FakeManager::~FakeManager() { close(); }

void FakeManager::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string FakeManager::address() const { return "127.0.0.1:" + std::to_string(port_); }

std::optional<FakePeer> FakeManager::accept(std::chrono::milliseconds timeout) {
  if (fd_ < 0) return std::nullopt;
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return std::nullopt;
  const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return std::nullopt;
  return FakePeer(fd);
}

}  // namespace varuna::test
