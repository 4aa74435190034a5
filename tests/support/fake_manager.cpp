#include "fake_manager.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "varuna/common/certificate_credential.h"

namespace varuna::test {

using Clock = std::chrono::steady_clock;

bool FakePeer::send(const proto::Message& message) {
  try {
    client_.send(message);
    return true;
  } catch (const proto::ConnectionError&) {
    return false;
  }
}

std::optional<proto::Message> FakePeer::receive(std::chrono::milliseconds timeout) {
  try {
    return client_.receive(timeout);
  } catch (const proto::ConnectionError&) {
    return std::nullopt;  // the peer closed (the client is closed now)
  }
}

bool FakePeer::sendHeartbeatsFor(std::chrono::milliseconds duration, std::chrono::milliseconds interval) {
  const auto end = Clock::now() + duration;
  while (Clock::now() < end) {
    if (!send(proto::Heartbeat{-1, 0})) return false;
    const auto next = std::min(Clock::now() + interval, end);
    while (Clock::now() < next) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now());
      receive(std::max(left, std::chrono::milliseconds(0)) + std::chrono::milliseconds(1));
      if (closed()) return false;
    }
  }
  return true;
}

FakeManager::FakeManager(tls::KeyForIdentity keyFor) : FakeManager() {
  keyFor_ = std::move(keyFor);
  ::unsetenv(tls::kPlaintextEnv);
}

FakeManager::FakeManager(std::shared_ptr<const tls::CertificateCredential> ca) : FakeManager() {
  managerCertificate_ =
      std::make_shared<const tls::CertificateCredential>(ca->issue({"manager", "", -1, -1, ""}, false));
  ca_ = std::move(ca);
  ::unsetenv(tls::kPlaintextEnv);
}

FakeManager::FakeManager() {
  ::setenv(tls::kPlaintextEnv, "1", 1);
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

FakeManager::~FakeManager() {
  close();
  ::unsetenv(tls::kPlaintextEnv);
}

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
  if (!keyFor_ && !ca_) return FakePeer(proto::ControlClient::adopt(fd, "the fake manager's peer"));
  try {
    if (ca_) {
      tls::ServerAuth server;
      server.ca = ca_;
      server.acceptHostCa = [](const tls::PskIdentity& hostCa, const tls::PskIdentity&, std::string& why) {
        why = "a joined host's CA";
        return hostCa.hint.empty() ? tls::HostCaStanding::kValid : tls::HostCaStanding::kRefused;
      };
      return FakePeer(
          proto::ControlClient::acceptTls(fd, "the fake manager's peer", std::move(server), managerCertificate_, timeout));
    }
    return FakePeer(proto::ControlClient::acceptTls(fd, "the fake manager's peer", keyFor_, timeout));
  } catch (const proto::ConnectionError& e) {
    lastRefusal_ = e.what();
    return std::nullopt;
  }
}

bool FakeManager::acceptAndDrop(std::chrono::milliseconds timeout) {
  if (fd_ < 0) return false;
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return false;
  const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

}  // namespace varuna::test
