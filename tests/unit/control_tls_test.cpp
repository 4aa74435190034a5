// The control plane's TLS (control_tls.h): PSK identities, the blocking
// client against run_varuna's real listener over loopback, and every
// refusal it claims: no credential, a wrong one, plaintext, an identity that
// says one thing and a hello another; and what a tap on the wire sees.
#include <catch2/catch.hpp>
#include <openssl/evp.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <mutex>
#include <thread>

#include "test_env.h"
#include "varuna/common/certificate_credential.h"
#include "varuna/common/control_client.h"
#include "varuna/common/time_util.h"
#include "varuna/manager/clock.h"
#include "varuna/manager/credentials.h"
#include "daemon/control_listener.h"
#include "loop/event_log.h"
#include "loop/handler_guard.h"
#include "loop/tls_stream.h"

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
  std::atomic<int> framesAfterHello{0};
  std::thread loop;

  // `acksPerHello`: how many Acks an admitted peer gets at once (a burst).
  // `ca`: the job's CA (certificates for agents, workers and notifiers),
  // whose host CAs `acceptHostCa` vouches for (by default: listed hosts').
  explicit TlsListener(const std::string& name, int acksPerHello = 1,
                       std::shared_ptr<const tls::CertificateCredential> ca = nullptr,
                       tls::AcceptHostCa acceptHostCa = nullptr) {
    events = std::make_unique<EventLog>((test::scratchDir(name) / "events.jsonl").string());
    REQUIRE_FALSE(listener.listen(asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)));
    if (ca && !acceptHostCa) {
      acceptHostCa = [](const tls::PskIdentity& hostCa, const tls::PskIdentity&, std::string& why) {
        why = "a joined host's CA";
        return hostCa.hint.empty() ? tls::HostCaStanding::kValid : tls::HostCaStanding::kRefused;
      };
    }
    if (ca) listener.setCertificateAuthority(std::move(ca), std::move(acceptHostCa));
    listener.start(
        kSecret, *events,
        [this, acksPerHello](const std::shared_ptr<FramedConnection>& connection, const proto::Hello& hello) {
          std::lock_guard<std::mutex> lock(mutex);
          hellos.push_back(hello);
          identities.push_back(connection->stream().authenticatedIdentity());
          admitted.push_back(connection);  // as the daemon's router would: taken over, read on
          connection->start([this](const proto::Message&) { ++framesAfterHello; }, [](const std::string&) {});
          for (int i = 0; i < acksPerHello; ++i) connection->send(proto::Ack{true, std::to_string(i)});
        },
        [] { return size_t{0}; });
    loop = std::thread([this] {
      auto work = asio::make_work_guard(io);
      io.run();
    });
  }
  ~TlsListener() {
    std::promise<void> closed;
    asio::post(io, [this, &closed] {
      listener.close();
      for (auto& c : admitted) c->close("test over");
      closed.set_value();
    });
    closed.get_future().wait();
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
  std::optional<tls::PskIdentity> identity(size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    return identities.at(i);
  }
};

proto::Hello workerHello(const std::string& host, int rank, int generation) {
  return {proto::kVersion, credentials::worker(credentials::agent(kSecret, host), rank, generation), "worker", host,
          rank, generation};
}

// A listening socket on 127.0.0.1, a free port (set in `port`).
int listenOnLoopback(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  port = ntohs(addr.sin_port);
  return fd;
}

// An impostor on the manager's address: TLS 1.3 with a self-signed
// certificate and no pre-shared key at all. Accepts one connection and
// records whatever application data it gets.
class CertificateImpostor {
 public:
  // Presenting `credential`'s certificate (and its issuers but the root).
  explicit CertificateImpostor(const tls::CertificateCredential& credential) {
    context_ = SSL_CTX_new(TLS_server_method());
    SSL_CTX_set_min_proto_version(context_, TLS1_3_VERSION);
    REQUIRE(SSL_CTX_use_certificate(context_, credential.certificate()) == 1);
    REQUIRE(SSL_CTX_use_PrivateKey(context_, credential.key()) == 1);
    const auto issuers = credential.issuers();
    for (size_t i = 0; i + 1 < issuers.size(); ++i) REQUIRE(SSL_CTX_add1_chain_cert(context_, issuers[i]) == 1);
    listenFd_ = listenOnLoopback(port_);
    thread_ = std::thread([this] { serveOne(); });
  }
  CertificateImpostor() {
    EVP_PKEY* key = EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256");
    X509* cert = X509_new();
    ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
    X509_gmtime_adj(X509_getm_notBefore(cert), 0);
    X509_gmtime_adj(X509_getm_notAfter(cert), 3600);
    X509_set_pubkey(cert, key);
    X509_NAME* name = X509_get_subject_name(cert);
    X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>("run_varuna"), -1, -1, 0);
    X509_set_issuer_name(cert, name);
    X509_sign(cert, key, EVP_sha256());
    context_ = SSL_CTX_new(TLS_server_method());
    SSL_CTX_set_min_proto_version(context_, TLS1_3_VERSION);
    REQUIRE(SSL_CTX_use_certificate(context_, cert) == 1);
    REQUIRE(SSL_CTX_use_PrivateKey(context_, key) == 1);
    X509_free(cert);
    EVP_PKEY_free(key);
    listenFd_ = listenOnLoopback(port_);
    thread_ = std::thread([this] { serveOne(); });
  }
  ~CertificateImpostor() {
    ::shutdown(listenFd_, SHUT_RDWR);
    thread_.join();
    ::close(listenFd_);
    SSL_CTX_free(context_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // Waits for the connection to end; what the impostor read in it.
  std::string received() {
    thread_.join();
    thread_ = std::thread([] {});
    return received_;
  }

 private:
  void serveOne() {
    const int fd = ::accept(listenFd_, nullptr, nullptr);
    if (fd < 0) return;
    timeval timeout{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    SSL* ssl = SSL_new(context_);
    SSL_set_fd(ssl, fd);
    if (SSL_accept(ssl) == 1) {
      char buffer[4096];
      int n = 0;
      while ((n = SSL_read(ssl, buffer, sizeof(buffer))) > 0) received_.append(buffer, static_cast<size_t>(n));
    }
    SSL_free(ssl);
    ::close(fd);
  }

  SSL_CTX* context_ = nullptr;
  int listenFd_ = -1;
  int port_ = 0;
  std::thread thread_;
  std::string received_;
};

// A TCP relay from a port of its own to `target` that keeps a copy of every
// byte either way: the tap on the wire.
class RecordingRelay {
 public:
  explicit RecordingRelay(int targetPort) : target_(targetPort) {
    listenFd_ = listenOnLoopback(port_);
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
  const auto identity = server.identity(0);
  REQUIRE(identity);
  CHECK(identity->role == "worker");
  CHECK(identity->rank == 2);
  CHECK(identity->generation == 5);
  // Many frames after the handshake, all of them read.
  for (int i = 0; i < 200; ++i) client.send(proto::Heartbeat{2, i}, 5s);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (server.framesAfterHello < 200 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  CHECK(server.framesAfterHello == 200);
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
    // The relay copies before it forwards: once the listener read the
    // report, the tap holds it.
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (server.framesAfterHello < 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
    REQUIRE(server.framesAfterHello == 1);
  }
  const std::string wire = tap.captured();
  CHECK(wire.size() > 200);  // a handshake and records went through
  CHECK(wire.find(hello.token) == std::string::npos);
  CHECK(wire.find(tls::pskKey(hello.token)) == std::string::npos);
  CHECK(wire.find("\"hello\"") == std::string::npos);
  CHECK(wire.find("step_report") == std::string::npos);
  CHECK(wire.find("\"ok\"") == std::string::npos);
}

TEST_CASE("control tls: a burst of frames reaches the agent's side whole, none waiting for more bytes",
          "[tls]") {
  // TlsStream reads ahead (one recv takes every record the socket holds):
  // records already inside OpenSSL must be read without waiting for the
  // socket, which has nothing more to say once the burst is sent.
  constexpr int kBurst = 300;
  TlsListener server("tls-burst", kBurst);
  asio::io_context io;
  asio::ip::tcp::socket socket(io);
  socket.connect(asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), server.listener.port()));
  auto context = makeControlTlsContext(false);
  const auto hello = workerHello("h1", 1, 2);
  auto connection = std::make_shared<FramedConnection>(TlsStream::client(
      std::move(socket), *context, {tls::formatIdentity(tls::identityOf(hello)), tls::pskKey(hello.token)}));
  int acks = 0;
  bool inOrder = true;
  connection->start(
      [&](const proto::Message& message) {
        const auto* ack = std::get_if<proto::Ack>(&message);
        inOrder = inOrder && ack && ack->ok && ack->error == std::to_string(acks);
        if (++acks == kBurst) io.stop();
      },
      [&](const std::string&) { io.stop(); });
  connection->send(hello);
  io.run_for(20s);
  CHECK(acks == kBurst);
  CHECK(inOrder);
  connection->close("test over");
}

TEST_CASE("control tls: a server with a certificate instead of the key gets nothing", "[tls][security]") {
  // TLS 1.3 lets a server ignore the client's PSK and authenticate with a
  // certificate; whoever holds any certificate must not get the hello (the
  // credential in it, or the operator's secret).
  const auto hello = workerHello("h1", 0, 1);
  {
    CertificateImpostor impostor;
    CHECK_THROWS_AS(proto::ControlClient::connectAs(impostor.address(), 10s, hello), proto::AuthenticationError);
    CHECK(impostor.received().empty());
  }
  // The agent's side (Asio, TlsStream) the same.
  CertificateImpostor impostor;
  asio::io_context io;
  asio::ip::tcp::socket socket(io);
  const auto port = static_cast<uint16_t>(std::stoi(impostor.address().substr(impostor.address().rfind(':') + 1)));
  socket.connect(asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  auto context = makeControlTlsContext(false);
  auto stream = TlsStream::client(std::move(socket), *context,
                                  {tls::formatIdentity(tls::identityOf(hello)), tls::pskKey(hello.token)});
  std::optional<boost::system::error_code> result;
  stream->asyncHandshake([&](const boost::system::error_code& ec) { result = ec; });
  io.run_for(10s);
  REQUIRE(result);
  CHECK(*result);
  bool wrote = false;
  stream->asyncWrite("x", 1, [&](const boost::system::error_code& ec, size_t) { wrote = !ec; });
  io.restart();
  io.run_for(1s);
  CHECK_FALSE(wrote);
  stream->close();
  CHECK(impostor.received().empty());
}

TEST_CASE("control tls: plaintext peers are this machine's addresses only", "[tls][security]") {
  const auto v4 = [](const char* text) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    REQUIRE(::inet_pton(AF_INET, text, &address.sin_addr) == 1);
    return tls::isLoopback(reinterpret_cast<const sockaddr&>(address));
  };
  const auto v6 = [](const char* text) {
    sockaddr_in6 address{};
    address.sin6_family = AF_INET6;
    REQUIRE(::inet_pton(AF_INET6, text, &address.sin6_addr) == 1);
    return tls::isLoopback(reinterpret_cast<const sockaddr&>(address));
  };
  CHECK(v4("127.0.0.1"));
  CHECK(v4("127.0.0.3"));
  CHECK_FALSE(v4("10.0.0.1"));
  CHECK_FALSE(v4("128.0.0.1"));
  CHECK(v6("::1"));
  CHECK(v6("::ffff:127.0.0.2"));
  CHECK_FALSE(v6("::ffff:10.0.0.1"));
  CHECK_FALSE(v6("fe80::1"));
}

// --- certificates of the job's CA (certificate_credential.h) -------------------------

namespace {

std::shared_ptr<const tls::CertificateCredential> newJobCa(const std::string& name = "test-job") {
  return std::make_shared<const tls::CertificateCredential>(tls::CertificateCredential::makeRoot(name));
}

// What run_varuna gives host's agent: its host's CA.
std::string hostCaOf(const tls::CertificateCredential& root, const std::string& host, const std::string& nonce = "") {
  return root.issue({"agent", host, -1, -1, nonce}, /*isCa=*/true).encode();
}

proto::Hello helloWith(const std::string& credential, const std::string& role, const std::string& host, int rank = -1,
                       int generation = -1) {
  return {proto::kVersion, credential, role, host, rank, generation};
}

void waitForStat(TlsListener& server, const char* name, int count) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (server.stats().at(name) < count && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(20ms);
}

std::string derOf(x509_st* certificate) {
  unsigned char* der = nullptr;
  const int size = i2d_X509(certificate, &der);
  std::string bytes(reinterpret_cast<const char*>(der), static_cast<size_t>(size));
  OPENSSL_free(der);
  return bytes;
}

}  // namespace

TEST_CASE("certificates: a credential round-trips as one line; each level signs the next; bad text is refused",
          "[tls][certificates]") {
  const auto root = newJobCa();
  CHECK(root->isCa());
  CHECK(root->issuers().empty());
  const std::string longHost(tls::kMaxHostBytes, 'h');  // past a common name's 64 characters
  const auto hostCa = tls::CertificateCredential::parse(hostCaOf(*root, longHost, "nonce1"));
  CHECK(hostCa.identity().role == "agent");
  CHECK(hostCa.identity().host == longHost);
  CHECK(hostCa.identity().hint == "nonce1");
  CHECK(hostCa.isCa());
  const std::string text = credentials::worker(hostCa.encode(), 3, 7);  // the agent's issuance
  CHECK(tls::isCertificateCredential(text));
  CHECK(text.find('\n') == std::string::npos);
  const auto worker = tls::CertificateCredential::parse(text);
  CHECK(worker.identity().role == "worker");
  CHECK(worker.identity().host == longHost);
  CHECK(worker.identity().rank == 3);
  CHECK(worker.identity().generation == 7);
  CHECK_FALSE(worker.isCa());
  CHECK(worker.encode() == text);
  REQUIRE(worker.issuers().size() == 2);
  CHECK(X509_cmp(worker.root(), root->certificate()) == 0);
  std::string why;
  CHECK(tls::checkManagerCertificate(root->root(), root->issue({"manager", "", -1, -1, ""}, false).certificate(), why));
  CHECK_FALSE(tls::checkManagerCertificate(root->root(), worker.certificate(), why));
  CHECK_THROWS_AS(worker.issue({"worker", longHost, 0, 1, ""}, false), ConfigError);  // a leaf signs nothing
  for (const std::string& bad : {std::string("0123abcd"), std::string("vc1."), std::string("vc1.!!!!"), std::string("vc1.===="), std::string("vc1.AA=A"),
                                text.substr(0, text.size() / 2), "vc1." + std::string(400, 'A')}) {
    CHECK_THROWS_AS(tls::CertificateCredential::parse(bad), ConfigError);
  }
  // The key of one credential under another's certificates.
  CHECK_THROWS_AS(tls::CertificateCredential::parse(text.substr(0, 4) + text.substr(4).replace(10, 4, "AAAA")), ConfigError);
}

TEST_CASE("certificates: an agent, its notifier and its workers are admitted by certificate; no secret on the wire",
          "[tls][certificates][security]") {
  const auto root = newJobCa();
  TlsListener server("tls-certificates", 1, root);
  RecordingRelay tap(server.listener.port());
  const std::string agent = hostCaOf(*root, "h1");
  const std::string worker = credentials::worker(agent, 2, 5);
  {
    auto client = proto::ControlClient::connectAs(tap.address(), 10s, helloWith(worker, "worker", "h1", 2, 5));
    REQUIRE(client.receive(10s));
  }
  auto agentClient = proto::ControlClient::connectAs(server.address(), 10s, helloWith(agent, "agent", "h1"));
  REQUIRE(agentClient.receive(10s));
  auto notifierClient =
      proto::ControlClient::connectAs(server.address(), 10s, helloWith(credentials::notifier(agent), "notifier", "h1"));
  REQUIRE(notifierClient.receive(10s));
  REQUIRE(server.helloCount() == 3);
  for (size_t i = 0; i < 3; ++i) {
    const auto identity = server.identity(i);
    REQUIRE(identity);
    CHECK(identity->certified);
    CHECK(identity->host == "h1");
    CHECK(server.hellos.at(i).token.empty());  // the certificate was the credential
  }
  CHECK(server.identity(0)->role == "worker");
  CHECK(server.identity(0)->rank == 2);
  CHECK(server.identity(1)->role == "agent");
  CHECK(server.identity(2)->role == "notifier");
  const std::string wire = tap.captured();
  CHECK(wire.size() > 500);
  CHECK(wire.find(worker.substr(4, 64)) == std::string::npos);
  const auto parsed = tls::CertificateCredential::parse(worker);
  CHECK(wire.find(derOf(parsed.certificate())) == std::string::npos);  // TLS 1.3 encrypts certificates too
  CHECK(wire.find("\"hello\"") == std::string::npos);
  CHECK(server.stats().at("unauthenticated") == 0);
}

TEST_CASE("certificates: forged, foreign and stale certificates and derived keys fail the handshake, nothing read",
          "[tls][certificates][security]") {
  const auto root = newJobCa();
  TlsListener server("tls-certificates-refused", 1, root);
  // In TLS 1.3 a client's handshake is over before the server has checked
  // its certificate: the client learns of the refusal at its first read (or
  // at once, where its own check of the server failed).
  const auto expectRefused = [&](const proto::Hello& hello) {
    try {
      auto client = proto::ControlClient::connectAs(server.address(), 10s, hello);
      CHECK_THROWS_AS(client.receive(10s), proto::ConnectionError);
    } catch (const proto::AuthenticationError&) {
    }
  };
  // Another job's CA (or a manager restarted with a rotated secret).
  const auto other = newJobCa("another-job");
  expectRefused(helloWith(hostCaOf(*other, "h1"), "agent", "h1"));
  expectRefused(helloWith(credentials::worker(hostCaOf(*other, "h1"), 0, 1), "worker", "h1", 0, 1));
  // Host A's CA issuing a notifier certificate that names host B.
  const auto hostA = tls::CertificateCredential::parse(hostCaOf(*root, "hA"));
  expectRefused(helloWith(hostA.issue({"notifier", "hB", -1, -1, ""}, false).encode(), "notifier", "hB"));
  // A host's CA minting another host's CA, or an agent certificate.
  expectRefused(helloWith(hostA.issue({"agent", "hB", -1, -1, ""}, true).encode(), "agent", "hB"));
  // A CA of a join that is over (its nonce is not the job's for the host).
  expectRefused(helloWith(hostCaOf(*root, "h1", "old-join"), "agent", "h1"));
  expectRefused(helloWith(credentials::worker(hostCaOf(*root, "h1", "old-join"), 0, 1), "worker", "h1", 0, 1));
  // A key derived from the job's secret where the job has a CA.
  expectRefused(workerHello("h1", 0, 1));
  // The root's own certificate, and the manager's, presented by a client.
  expectRefused(helloWith(root->encode(), "agent", "h1"));
  expectRefused(helloWith(root->issue({"manager", "", -1, -1, ""}, false).encode(), "agent", "h1"));
  waitForStat(server, "unauthenticated", 9);
  CHECK(server.stats().at("unauthenticated") == 9);
  CHECK(server.helloCount() == 0);
}

TEST_CASE("certificates: a revoked host CA lets only its workers through, marked revoked (to be ordered out)",
          "[tls][certificates][security]") {
  const auto root = newJobCa();
  // As run_varuna's agent pool: "old" names a start of the host's agent that
  // was replaced; the peer's role decides between revoked and refused.
  TlsListener server("tls-certificates-revoked", 1, root,
                     [](const tls::PskIdentity& hostCa, const tls::PskIdentity& peer, std::string& why) {
                       if (hostCa.hint == "current") return tls::HostCaStanding::kValid;
                       why = "an earlier start";
                       return peer.role == "worker" ? tls::HostCaStanding::kRevoked : tls::HostCaStanding::kRefused;
                     });
  const std::string old = hostCaOf(*root, "h1", "old");
  auto worker = proto::ControlClient::connectAs(server.address(), 10s,
                                                helloWith(credentials::worker(old, 2, 7), "worker", "h1", 2, 7));
  REQUIRE(worker.receive(10s));
  // Refused after the client's side of the handshake: the client reads the
  // manager's alert and names it an authentication failure.
  for (const auto& hello : {helloWith(old, "agent", "h1"), helloWith(credentials::notifier(old), "notifier", "h1")}) {
    auto client = proto::ControlClient::connectAs(server.address(), 10s, hello);
    CHECK_THROWS_AS(client.receive(10s), proto::AuthenticationError);
  }
  auto current = proto::ControlClient::connectAs(
      server.address(), 10s, helloWith(credentials::worker(hostCaOf(*root, "h1", "current"), 2, 7), "worker", "h1", 2, 7));
  REQUIRE(current.receive(10s));
  waitForStat(server, "unauthenticated", 2);
  REQUIRE(server.helloCount() == 2);
  CHECK(server.identity(0)->revoked);
  CHECK(server.identity(0)->rank == 2);
  CHECK_FALSE(server.identity(1)->revoked);
  CHECK(server.identity(1)->certified);
}

TEST_CASE("certificates: a hello that claims another rank, generation or role than its certificate is refused",
          "[tls][certificates][security]") {
  const auto root = newJobCa();
  TlsListener server("tls-certificates-claims", 1, root);
  const std::string agent = hostCaOf(*root, "h1");
  const std::string rank1 = credentials::worker(agent, 1, 4);
  for (const auto& hello : {helloWith(rank1, "worker", "h1", 0, 4), helloWith(rank1, "worker", "h1", 1, 5),
                            helloWith(rank1, "agent", "h1"), helloWith(credentials::notifier(agent), "notifier", "h2")}) {
    auto client = proto::ControlClient::connectAs(server.address(), 10s, hello);
    const auto answer = client.receive(10s);
    REQUIRE(answer);
    CHECK_FALSE(std::get<proto::Ack>(*answer).ok);
  }
  CHECK(server.helloCount() == 0);
  CHECK(server.stats().at("refused") == 4);
}

TEST_CASE("certificates: joins and the operator's secret keep their pre-shared keys beside certificates",
          "[tls][certificates]") {
  TlsListener server("tls-certificates-psk", 1, newJobCa());
  const auto join = credentials::join(kSecret, unixSecondsNow() + 600);
  auto joining = proto::ControlClient::connectAs(server.address(), 10s,
                                                 {proto::kVersion, join, "join", "h9", -1, -1, 8});
  REQUIRE(joining.receive(10s));
  auto operatorNotice = proto::ControlClient::connectAs(server.address(), 10s, helloWith(kSecret, "notifier", "h3"),
                                                        "secret");
  REQUIRE(operatorNotice.receive(10s));
  REQUIRE(server.helloCount() == 2);
  CHECK_FALSE(server.identity(0)->certified);
  CHECK(server.identity(1)->hint == "secret");
}

TEST_CASE("certificates: a client sends nothing to a server that is not the job's manager", "[tls][certificates][security]") {
  const auto root = newJobCa();
  const std::string agent = hostCaOf(*root, "h1");
  const auto worker = helloWith(credentials::worker(agent, 0, 1), "worker", "h1", 0, 1);
  const auto hostCa = tls::CertificateCredential::parse(agent);
  // Another job's manager; this job's host CA (a compromised agent); a
  // "manager" certificate that host CA issued; and a self-signed one.
  const std::vector<tls::CertificateCredential> impostors{
      newJobCa("another-job")->issue({"manager", "", -1, -1, ""}, false), hostCa,
      hostCa.issue({"manager", "", -1, -1, ""}, false)};
  for (const auto& credential : impostors) {
    CertificateImpostor impostor(credential);
    CHECK_THROWS_AS(proto::ControlClient::connectAs(impostor.address(), 10s, worker), proto::AuthenticationError);
    CHECK(impostor.received().empty());
  }
  CertificateImpostor selfSigned;
  CHECK_THROWS_AS(proto::ControlClient::connectAs(selfSigned.address(), 10s, worker), proto::AuthenticationError);
  CHECK(selfSigned.received().empty());
}
