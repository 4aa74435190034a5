// runOverSsh against a real OpenSSH server: each test case starts /usr/sbin/sshd
// on 127.0.0.1 at a free port with throwaway keys in its scratch directory, and
// kills it when done (ChildProcess is RAII). Commands run through the user's
// login shell, whose rc files may print to stderr (seen: pyenv rehash races),
// and stderr may arrive before or after stdout, so output checks look for the
// command's lines rather than compare whole outputs.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>
#include <vector>

#include "process.h"
#include "test_env.h"
#include "varuna/manager/ssh_command.h"

using namespace varuna;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

const char* const kSshd = "/usr/sbin/sshd";
const char* const kSshKeygen = "/usr/bin/ssh-keygen";

// A TCP socket on 127.0.0.1 at a port the kernel picks. Bound but not
// listening, connects to it are refused and nobody else can take the port;
// listening but never accepting, connects succeed and then nothing answers.
class LoopbackSocket {
 public:
  explicit LoopbackSocket(bool listening) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    if (listening) REQUIRE(::listen(fd_, 16) == 0);
    socklen_t len = sizeof addr;
    REQUIRE(::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port_ = ntohs(addr.sin_port);
  }
  ~LoopbackSocket() { ::close(fd_); }
  LoopbackSocket(const LoopbackSocket&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

bool canConnect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

void writeText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  REQUIRE(out.good());
}

// Runs a helper program to completion; its exit code.
int runTool(const std::vector<std::string>& argv, const fs::path& logPrefix) {
  test::ChildProcess child(argv, {}, logPrefix);
  const auto code = child.wait(30s);
  INFO(argv[0] << " stderr: " << child.stderrText());
  REQUIRE(code.has_value());
  return *code;
}

// Generates an unencrypted key pair at dir/name; returns "type base64" of the public key.
std::string generateKey(const fs::path& dir, const std::string& name, const std::string& type = "ed25519") {
  const fs::path key = dir / name;
  REQUIRE(runTool({kSshKeygen, "-q", "-t", type, "-N", "", "-C", "varuna-test", "-f", key.string()},
                  dir / ("keygen-" + name)) == 0);
  std::string pub = test::readText(key.string() + ".pub");
  const auto firstSpace = pub.find(' ');
  REQUIRE(firstSpace != std::string::npos);
  return pub.substr(0, pub.find(' ', firstSpace + 1));  // drop the comment and newline
}

std::string currentUser() {
  const passwd* pw = getpwuid(geteuid());
  return pw ? pw->pw_name : "";
}

// Any running process whose command line contains `needle` (read from /proc).
bool processRunning(const std::string& needle) {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.empty() ||
        !std::all_of(name.begin(), name.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
      continue;
    std::string cmdline = test::readText(entry.path() / "cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.find(needle) != std::string::npos) return true;
  }
  return false;
}

class TestSshd {
 public:
  explicit TestSshd(const std::string& name) : dir_(test::scratchDir(name)) {
    REQUIRE(fs::exists(kSshd));
    REQUIRE(fs::exists(kSshKeygen));
    // sshd's privilege-separation directory; Debian creates it only at boot.
    if (geteuid() == 0) fs::create_directories("/run/sshd");
    hostKey_ = generateKey(dir_, "host_ed25519");
    writeText(dir_ / "authorized_keys", generateKey(dir_, "client") + " varuna-test\n");
    // Newer OpenSSH (>= 9.8) penalises sources whose connections fail auth;
    // the failure scenarios would then lock the next ones out.
    const bool penaltiesOption =
        runTool({kSshd, "-t", "-f", writeConfig(0, "PerSourcePenalties no\n").string()}, dir_ / "sshd-probe") == 0;
    // The kernel's free port may be taken before sshd binds it: retry.
    for (int attempt = 0; attempt < 5 && !sshd_; ++attempt) start(penaltiesOption ? "PerSourcePenalties no\n" : "");
    REQUIRE(sshd_);
    writeText(knownHosts(), knownHostsLine(hostKey_));
  }

  int port() const { return port_; }
  const fs::path& dir() const { return dir_; }
  fs::path knownHosts() const { return dir_ / "known_hosts"; }
  fs::path clientKey() const { return dir_ / "client"; }
  std::string knownHostsLine(const std::string& key) const {
    return "[127.0.0.1]:" + std::to_string(port_) + " " + key + "\n";
  }

  SshOptions options() const {
    SshOptions o;
    o.port = port_;
    o.identityFile = clientKey().string();
    o.knownHostsFile = knownHosts().string();
    o.connectTimeout = 10s;
    o.commandTimeout = 30s;
    return o;
  }
  std::string log() const { return sshd_ ? sshd_->stderrText() : std::string(); }

 private:
  fs::path writeConfig(int port, const std::string& extra) const {
    const fs::path config = dir_ / "sshd_config";
    std::ostringstream text;
    text << "ListenAddress 127.0.0.1\n"
         << "Port " << (port == 0 ? 22 : port) << "\n"
         << "HostKey " << (dir_ / "host_ed25519").string() << "\n"
         << "PidFile " << (dir_ / "sshd.pid").string() << "\n"
         << "AuthorizedKeysFile " << (dir_ / "authorized_keys").string() << "\n"
         << "PermitRootLogin prohibit-password\n"
         << "PubkeyAuthentication yes\n"
         << "PasswordAuthentication no\n"
         << "KbdInteractiveAuthentication no\n"
         << "StrictModes no\n"
         << "UsePAM no\n"
         << "MaxStartups 64\n"
         << "LogLevel INFO\n"
         << extra;
    writeText(config, text.str());
    return config;
  }

  void start(const std::string& extra) {
    const int port = LoopbackSocket(false).port();  // closed again before sshd binds it
    const fs::path config = writeConfig(port, extra);
    auto sshd = std::make_unique<test::ChildProcess>(std::vector<std::string>{kSshd, "-D", "-e", "-f", config.string()},
                                                     std::map<std::string, std::string>{},
                                                     dir_ / ("sshd-" + std::to_string(port)));
    // Ready when it says it listens (so the port is its own, not a squatter's)
    // and a connect succeeds; a bind failure makes it exit instead.
    const std::string listening = "Server listening on 127.0.0.1 port " + std::to_string(port);
    const bool ready = test::waitUntil(
        [&] { return sshd->wait(0ms).has_value() || sshd->stderrText().find(listening) != std::string::npos; }, 15s);
    if (ready && !sshd->wait(0ms) && test::waitUntil([&] { return canConnect(port); }, 10s)) {
      port_ = port;
      sshd_ = std::move(sshd);
      return;
    }
    WARN("sshd on port " << port << " did not start: " << sshd->stderrText());
  }

  fs::path dir_;
  std::string hostKey_;
  int port_ = 0;
  std::unique_ptr<test::ChildProcess> sshd_;
};

std::string describe(const SshResult& r) {
  return std::string(toString(r.failure)) + " exit=" + std::to_string(r.exitStatus) + " message=[" + r.message +
         "] output=[" + r.output + "]";
}

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("runOverSsh runs a command and returns its output and exit status", "[ssh]") {
  TestSshd sshd("success");
  const SshResult r = runOverSsh("127.0.0.1", "echo hello; echo err >&2; exit 0", sshd.options());
  INFO(describe(r) << "\nsshd log:\n" << sshd.log());
  CHECK(r.failure == SshFailure::kNone);
  CHECK(r.ok());
  CHECK(r.exitStatus == 0);
  CHECK(r.output.find("hello\n") != std::string::npos);
  CHECK(r.output.find("err\n") != std::string::npos);
  CHECK(r.message.empty());

  // stdin is closed, so a command reading it ends.
  const SshResult cat = runOverSsh("127.0.0.1", "cat; echo after-cat", sshd.options());
  INFO(describe(cat));
  CHECK(cat.ok());
  CHECK_THAT(cat.output, Catch::Contains("after-cat\n"));

  // Input (how the job token travels) reaches stdin, then EOF.
  const SshResult fed = runOverSsh("127.0.0.1", "read -r secret; echo \"got<$secret>\"; cat", sshd.options(),
                                   "t0ken\nrest\n");
  INFO(describe(fed));
  CHECK(fed.ok());
  CHECK(fed.output == "got<t0ken>\nrest\n");
}

TEST_CASE("runOverSsh reports a non-zero exit as kCommandFailed with the status and the last output", "[ssh]") {
  TestSshd sshd("exit");
  const SshResult r = runOverSsh("127.0.0.1", "echo line1; echo 'boom: disk full' >&2; exit 7", sshd.options());
  INFO(describe(r));
  CHECK(r.failure == SshFailure::kCommandFailed);
  CHECK(r.exitStatus == 7);
  CHECK_THAT(r.message, Catch::Contains("127.0.0.1:" + std::to_string(sshd.port())) && Catch::Contains("status 7") &&
                            Catch::Contains("boom: disk full"));

  const SshResult killed = runOverSsh("127.0.0.1", "kill -TERM $$", sshd.options());
  INFO(describe(killed));
  CHECK(killed.failure == SshFailure::kCommandFailed);
  CHECK_THAT(killed.message, Catch::Contains("SIGTERM"));
}

TEST_CASE("runOverSsh keeps the last 64 KiB of a long output", "[ssh]") {
  TestSshd sshd("long_output");
  const SshResult r = runOverSsh("127.0.0.1", "head -c 300000 /dev/zero | tr '\\0' x; echo; echo END", sshd.options());
  INFO(toString(r.failure) << " " << r.message);
  CHECK(r.ok());
  CHECK(r.output.size() == 64 * 1024);
  CHECK_THAT(r.output, Catch::StartsWith("[... earlier output dropped ...]") && Catch::EndsWith("xx\nEND\n"));
}

TEST_CASE("runOverSsh refuses a host whose key is not in known_hosts", "[ssh]") {
  TestSshd sshd("unknown_key");
  SshOptions options = sshd.options();
  const std::string where = "127.0.0.1:" + std::to_string(sshd.port());

  options.knownHostsFile = (sshd.dir() / "empty_known_hosts").string();
  writeText(options.knownHostsFile, "");
  const SshResult r = runOverSsh("127.0.0.1", "touch should-not-run", options);
  INFO(describe(r));
  CHECK(r.failure == SshFailure::kUnknownHostKey);
  CHECK_THAT(r.message, Catch::Contains(where) && Catch::Contains(options.knownHostsFile) &&
                            Catch::Contains("ssh-keyscan -p " + std::to_string(sshd.port()) + " 127.0.0.1 >> " +
                                            options.knownHostsFile) &&
                            Catch::Contains("ssh-ed25519 SHA256:"));
  CHECK(test::readText(options.knownHostsFile).empty());  // never accepted automatically

  options.knownHostsFile = (sshd.dir() / "no_such_known_hosts").string();
  const SshResult missing = runOverSsh("127.0.0.1", "true", options);
  INFO(describe(missing));
  CHECK(missing.failure == SshFailure::kUnknownHostKey);
  CHECK_THAT(missing.message, Catch::Contains("does not exist") && Catch::Contains("ssh-keyscan"));
  CHECK_FALSE(fs::exists(options.knownHostsFile));
}

TEST_CASE("runOverSsh refuses a host whose key changed", "[ssh]") {
  TestSshd sshd("changed_key");
  SshOptions options = sshd.options();

  options.knownHostsFile = (sshd.dir() / "changed_known_hosts").string();
  writeText(options.knownHostsFile, sshd.knownHostsLine(generateKey(sshd.dir(), "impostor")));
  const SshResult r = runOverSsh("127.0.0.1", "true", options);
  INFO(describe(r));
  CHECK(r.failure == SshFailure::kHostKeyChanged);
  CHECK_THAT(r.message, Catch::Contains("CHANGED") && Catch::Contains("man-in-the-middle") &&
                            Catch::Contains(options.knownHostsFile) &&
                            Catch::Contains("ssh-keygen -R '[127.0.0.1]:" + std::to_string(sshd.port()) + "'"));

  // Only a key of another type recorded: just as suspicious.
  options.knownHostsFile = (sshd.dir() / "other_type_known_hosts").string();
  writeText(options.knownHostsFile, sshd.knownHostsLine(generateKey(sshd.dir(), "ecdsa_host", "ecdsa")));
  const SshResult other = runOverSsh("127.0.0.1", "true", options);
  INFO(describe(other));
  CHECK(other.failure == SshFailure::kHostKeyChanged);
  CHECK_THAT(other.message, Catch::Contains("CHANGED") && Catch::Contains("ssh-keygen -R"));
}

TEST_CASE("runOverSsh reports a refused identity as kAuthFailed naming user, host and key", "[ssh]") {
  TestSshd sshd("auth");
  SshOptions options = sshd.options();
  const std::string where = "127.0.0.1:" + std::to_string(sshd.port());

  generateKey(sshd.dir(), "stranger");
  options.identityFile = (sshd.dir() / "stranger").string();
  const SshResult r = runOverSsh("127.0.0.1", "true", options);
  INFO(describe(r) << "\nsshd log:\n" << sshd.log());
  CHECK(r.failure == SshFailure::kAuthFailed);
  CHECK_THAT(r.message, Catch::Contains("'" + currentUser() + "'") && Catch::Contains(where) &&
                            Catch::Contains(options.identityFile) && Catch::Contains("authorized_keys"));

  options.identityFile = (sshd.dir() / "no_such_key").string();
  const SshResult missing = runOverSsh("127.0.0.1", "true", options);
  INFO(describe(missing));
  CHECK(missing.failure == SshFailure::kAuthFailed);
  CHECK_THAT(missing.message, Catch::Contains(options.identityFile) && Catch::Contains(where));
}

TEST_CASE("runOverSsh reports an unreachable host within the connect timeout", "[ssh]") {
  SshOptions options;
  options.knownHostsFile = "/dev/null";
  options.connectTimeout = 3s;

  SECTION("connection refused") {
    LoopbackSocket closedPort(false);  // bound, not listening: connects are refused
    options.port = closedPort.port();
    const auto start = std::chrono::steady_clock::now();
    const SshResult r = runOverSsh("127.0.0.1", "true", options);
    INFO(describe(r));
    CHECK(r.failure == SshFailure::kUnreachable);
    CHECK(secondsSince(start) < 3.0);
    CHECK_THAT(r.message, Catch::Contains("127.0.0.1:" + std::to_string(options.port)) &&
                              Catch::Contains("refused", Catch::CaseSensitive::No));
  }
  SECTION("nothing answers") {
    LoopbackSocket silent(true);  // the kernel completes the handshake, no SSH banner ever comes
    options.port = silent.port();
    options.connectTimeout = 500ms;
    const auto start = std::chrono::steady_clock::now();
    const SshResult r = runOverSsh("127.0.0.1", "true", options);
    const double elapsed = secondsSince(start);
    INFO(describe(r) << " after " << elapsed << " s");
    CHECK(r.failure == SshFailure::kUnreachable);
    CHECK(elapsed >= 0.4);
    CHECK(elapsed < 3.0);
    CHECK_THAT(r.message, Catch::Contains("127.0.0.1:" + std::to_string(options.port)) &&
                              Catch::Contains("timeout", Catch::CaseSensitive::No));
  }
}

TEST_CASE("runOverSsh stops a command that outlives commandTimeout", "[ssh]") {
  TestSshd sshd("timeout");
  SshOptions options = sshd.options();
  // 3 s: on a loaded CI machine bash's start and the first tick once took
  // most of a 1 s limit, and the output had no tick to show.
  options.commandTimeout = 3s;
  // The marker ($0 of the loop) finds the remote process afterwards. It keeps
  // writing, so it ends even for a root login, which sshd cannot signal.
  const std::string marker = "varuna-timeout-marker-" + std::to_string(getpid());
  const auto start = std::chrono::steady_clock::now();
  const SshResult r =
      runOverSsh("127.0.0.1", "echo started; exec bash -c 'while :; do sleep 0.1; echo tick; done' " + marker, options);
  const double elapsed = secondsSince(start);
  INFO(describe(r) << " after " << elapsed << " s\nsshd log:\n" << sshd.log());
  CHECK(r.failure == SshFailure::kTimeout);
  CHECK(elapsed >= 2.9);
  CHECK(elapsed < 10.0);
  CHECK_THAT(r.output, Catch::Contains("started\ntick\n"));
  CHECK_THAT(r.message,
             Catch::Contains("127.0.0.1:" + std::to_string(sshd.port())) && Catch::Contains("commandTimeout"));
  CHECK(test::waitUntil([&] { return !processRunning(marker); }, 10s));
}

TEST_CASE("runOverSsh serves concurrent calls from several threads", "[ssh]") {
  TestSshd sshd("concurrent");
  constexpr int kThreads = 8;
  std::vector<SshResult> results(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back(
        [&, i] { results[i] = runOverSsh("127.0.0.1", "echo task-" + std::to_string(i), sshd.options()); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    INFO("thread " << i << ": " << describe(results[i]) << "\nsshd log:\n" << sshd.log());
    CHECK(results[i].ok());
    CHECK(results[i].exitStatus == 0);
    CHECK_THAT(results[i].output, Catch::Contains("task-" + std::to_string(i) + "\n"));
  }
}
