// The control plane's TLS (control_tls.h): PSK identities, the blocking
// client against run_varuna's real listener over loopback, and every
// refusal it claims: no credential, a wrong one, plaintext, an identity that
// says one thing and a hello another; and what a tap on the wire sees.
#include <catch2/catch.hpp>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <mutex>
#include <thread>

#include "test_env.h"
#include "varuna/common/control_client.h"
#include "varuna/manager/clock.h"
#include "varuna/manager/credentials.h"
#include "daemon/control_listener.h"
#include "loop/event_log.h"
#include "loop/handler_guard.h"

using namespace varuna;
namespace asio = boost::asio;
using namespace std::chrono_literals;

namespace {

constexpr const char* kSecret = "the-jobs-secret";

// run_varuna's listener on 127.0.0.1:0 with TLS, its loop on a thread of its own.
struct TlsListener {
  asio::io_context io;
  std::unique_ptr<EventLog> events;
  ControlListener listener{io, std::make_shared<HandlerGuard>(), PendingLimits{}, realClock()};
  std::mutex mutex;
  std::vector<proto::Hello> hellos;
  std::vector<std::optional<tls::PskIdentity>> identities;
  std::vector<std::shared_ptr<FramedConnection>> admitted;
  std::thread loop;

  explicit TlsListener(const std::string& name) {
    events = std::make_unique<EventLog>((test::scratchDir(name) / "events.jsonl").string());
    REQUIRE_FALSE(listener.listen(asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)));
    listener.start(
        kSecret, *events,
        [this](const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
          std::lock_guard<std::mutex> lock(mutex);
          hellos.push_back(hello);
          identities.push_back(connection->stream().authenticatedIdentity());
          admitted.push_back(connection);  // as the daemon's router would: taken over, read on
          connection->start([](const proto::Message&) {}, [](const std::string&) {});
          connection->send(proto::Ack{true, ""});
        },
        [] { return size_t{0}; });
    loop = std::thread([this] {
      auto work = asio::make_work_guard(io);
      io.run();
    });
  }
  ~TlsListener() {
    asio::post(io, [this] {
      listener.close();
      for (auto& c : admitted) c->close("test over");
    });
    io.stop();
    loop.join();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(listener.port()); }
  // stats() on the listener's own thread.
  nlohmann::json stats() {
    std::promise<nlohmann::json> result;
    asio::post(io, [&] { result.set_value(listener.stats()); });
    return result.get_future().get();
  }
  size_t helloCount() {
    std::lock_guard<std::mutex> lock(mutex);
    return hellos.size();
  }
};

proto::Hello workerHello(const std::string& host, int rank, int generation) {
  return {proto::kVersion, credentials::worker(credentials::agent(kSecret, host), rank, generation), "worker", host,
          rank, generation};
}

// A TCP relay from a port of its own to `target` that keeps a copy of every
// byte either way: the tap on the wire.
class RecordingRelay {
 public:
  explicit RecordingRelay(int targetPort) : target_(targetPort) {
    listenFd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    REQUIRE(::bind(listenFd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    REQUIRE(::listen(listenFd_, 4) == 0);
    REQUIRE(::getsockname(listenFd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { relayOne(); });
  }
  ~RecordingRelay() {
    ::shutdown(listenFd_, SHUT_RDWR);
    thread_.join();
    ::close(listenFd_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  std::string captured() {
    std::lock_guard<std::mutex> lock(mutex_);
    return captured_;
  }

 private:
  void relayOne() {
    const int client = ::accept(listenFd_, nullptr, nullptr);
    if (client < 0) return;
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(target_));
    if (::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return;
    std::thread back([&] { pump(server, client); });
    pump(client, server);
    back.join();
    ::close(client);
    ::close(server);
  }
  void pump(int from, int to) {
    char buffer[4096];
    while (true) {
      const ssize_t n = ::read(from, buffer, sizeof(buffer));
      if (n <= 0) break;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        captured_.append(buffer, static_cast<size_t>(n));
      }
      if (::write(to, buffer, static_cast<size_t>(n)) != n) break;
    }
    ::shutdown(to, SHUT_WR);
  }

  int target_;
  int listenFd_ = -1;
  int port_ = 0;
  std::thread thread_;
  std::mutex mutex_;
  std::string captured_;
};

}  // namespace

TEST_CASE("control tls: identities round-trip; malformed ones are refused", "[tls]") {
  const tls::PskIdentity identity{"worker", "10.0.0.2", 3, 7, ""};
  const auto parsed = tls::parseIdentity(tls::formatIdentity(identity));
  REQUIRE(parsed);
  CHECK(parsed->role == "worker");
  CHECK(parsed->host == "10.0.0.2");
  CHECK(parsed->rank == 3);
  CHECK(parsed->generation == 7);
  CHECK_FALSE(tls::parseIdentity("worker\n10.0.0.2\n3\n7\n"));                 // no version
  CHECK_FALSE(tls::parseIdentity("varuna-control-1\nworker\nh\nthree\n7\n"));  // not a number
  CHECK_FALSE(tls::parseIdentity(""));
  CHECK(tls::matches(identity, proto::Hello{proto::kVersion, "x", "worker", "10.0.0.2", 3, 7}));
  CHECK_FALSE(tls::matches(identity, proto::Hello{proto::kVersion, "x", "worker", "10.0.0.2", 0, 7}));
  // The key is not the credential the hello carries.
  CHECK(tls::pskKey("abc") != "abc");
  CHECK(tls::pskKey("abc").size() == 32);
}

TEST_CASE("control tls: a worker with its credential is admitted, its identity known", "[tls]") {
  TlsListener server("tls-admitted");
  auto client = proto::ControlClient::connectAs(server.address(), 10s, workerHello("h1", 2, 5));
  const auto ack = client.receive(10s);
  REQUIRE(ack);
  CHECK(std::get<proto::Ack>(*ack).ok);
  REQUIRE(server.helloCount() == 1);
  REQUIRE(server.identities[0]);
  CHECK(server.identities[0]->role == "worker");
  CHECK(server.identities[0]->rank == 2);
  CHECK(server.identities[0]->generation == 5);
  // Frames both ways after the handshake, many of them.
  for (int i = 0; i < 200; ++i) client.send(proto::Heartbeat{2, i}, 5s);
  CHECK(server.stats().at("unauthenticated") == 0);
}

TEST_CASE("control tls: without the credential, the handshake fails before one frame is read", "[tls][security]") {
  TlsListener server("tls-refused");
  // A wrong credential (another job's secret) for a well-formed identity.
  auto wrong = workerHello("h1", 0, 1);
  wrong.token = credentials::worker(credentials::agent("another-secret", "h1"), 0, 1);
  CHECK_THROWS_AS(proto::ControlClient::connectAs(server.address(), 10s, wrong), proto::AuthenticationError);
  // An identity the manager has no credential for (an unknown role).
  CHECK_THROWS_AS(proto::ControlClient::connectTls(server.address(), 10s,
                                                   {tls::formatIdentity({"root", "h1", -1, -1, ""}), "key"}),
                  proto::AuthenticationError);
  // An earlier generation's credential under the current generation's
  // identity (a replay into the new launch): the key does not match.
  auto stale = workerHello("h1", 0, 2);
  stale.token = workerHello("h1", 0, 1).token;
  CHECK_THROWS_AS(proto::ControlClient::connectAs(server.address(), 10s, stale), proto::AuthenticationError);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (server.stats().at("unauthenticated") < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  CHECK(server.stats().at("unauthenticated") == 3);
  CHECK(server.helloCount() == 0);
}

TEST_CASE("control tls: a plaintext hello gets no answer and no admission", "[tls][security]") {
  TlsListener server("tls-plaintext");
  auto client = proto::ControlClient::connect(server.address(), 10s);
  client.send(workerHello("h1", 0, 1), 5s);
  bool answered = false;
  try {
    answered = client.receive(5s).has_value();  // a TLS alert is no frame
  } catch (const std::exception&) {
  }
  CHECK_FALSE(answered);
  CHECK(server.helloCount() == 0);
}

TEST_CASE("control tls: a hello that claims another rank than its TLS identity is refused", "[tls][security]") {
  TlsListener server("tls-mismatch");
  // Rank 1's handshake, then a hello as rank 0 with rank 0's credential (as
  // if that had leaked): the connection speaks only for rank 1.
  const auto rank1 = workerHello("h1", 1, 1);
  auto client = proto::ControlClient::connectTls(
      server.address(), 10s, {tls::formatIdentity(tls::identityOf(rank1)), tls::pskKey(rank1.token)});
  client.send(workerHello("h1", 0, 1), 5s);
  const auto reply = client.receive(10s);
  REQUIRE(reply);
  const auto& ack = std::get<proto::Ack>(*reply);
  CHECK_FALSE(ack.ok);
  CHECK_THAT(ack.error, Catch::Contains("authenticated as worker of 'h1' rank 1"));
  CHECK(server.helloCount() == 0);
  CHECK(server.stats().at("refused") == 1);
}

TEST_CASE("control tls: a tap on the wire sees neither the credential nor the messages", "[tls][security]") {
  TlsListener server("tls-capture");
  RecordingRelay tap(server.listener.port());
  const auto hello = workerHello("h1", 0, 1);
  {
    auto client = proto::ControlClient::connectAs(tap.address(), 10s, hello);
    REQUIRE(client.receive(10s));
    client.send(proto::StepReport{0, 0, 0, 1, 0.25, 1.5, 0.1}, 5s);
  }
  std::this_thread::sleep_for(200ms);  // the relay copies what is in flight
  const std::string wire = tap.captured();
  CHECK(wire.size() > 200);  // a handshake and records went through
  CHECK(wire.find(hello.token) == std::string::npos);
  CHECK(wire.find(tls::pskKey(hello.token)) == std::string::npos);
  CHECK(wire.find("\"hello\"") == std::string::npos);
  CHECK(wire.find("step_report") == std::string::npos);
  CHECK(wire.find("\"ok\"") == std::string::npos);
}
