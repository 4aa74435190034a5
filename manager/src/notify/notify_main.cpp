// notify_manager_preempt: tells run_varuna that a host will be taken away, so
// the job checkpoints and morphs onto the other machines before it goes. Called
// by the cloud pollers in scripts/pollers/ (or by hand). Authenticated with the
// job token from the agent's connection file (or --token_file).
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "varuna/common/control_client.h"

namespace {

using namespace varuna;

struct Options {
  std::string connectionFile;
  std::string manager;
  std::string tokenFile;
  std::string host;
  int64_t deadlineUnixMs = 0;
  double inSeconds = -1;
  double timeoutS = 10;
};

std::string readFirstLine(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) throw ConfigError(strCat(what, " ", path, " cannot be read"));
  return line;
}

int64_t nowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"notify_manager_preempt: tell run_varuna that a host will be preempted"};
  app.add_option("--connection_file", o.connectionFile,
                 "the agent's connection.json on this host (manager address, token, host name)");
  app.add_option("--manager", o.manager, "manager address host:port (instead of a connection file)");
  app.add_option("--token_file", o.tokenFile, "file holding the job token (the manager's <state_dir>/token)");
  app.add_option("--host", o.host, "the host being taken, as named in the machine list");
  auto* deadline = app.add_option("--deadline_unix_ms", o.deadlineUnixMs, "when the host goes (Unix time, ms)");
  app.add_option("--in_seconds", o.inSeconds, "when the host goes, from now")->excludes(deadline);
  app.add_option("--timeout_s", o.timeoutS, "give up reaching the manager after this long")->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitConfigError;
  }
  try {
    std::string token;
    if (!o.connectionFile.empty()) {
      nlohmann::json connection;
      try {
        std::ifstream in(o.connectionFile);
        if (!in) throw ConfigError("cannot be read");
        connection = nlohmann::json::parse(in);
        if (o.manager.empty()) o.manager = connection.at("manager").get<std::string>();
        token = connection.at("token").get<std::string>();
        if (o.host.empty()) o.host = connection.at("host").get<std::string>();
        // The agent's job runs a plaintext control plane (loopback development).
        if (connection.value("insecure_plaintext_control", false)) ::setenv(tls::kPlaintextEnv, "1", 1);
      } catch (const std::exception& e) {
        throw ConfigError(strCat("--connection_file ", o.connectionFile, ": ", e.what(),
                                 " (it is written by the job's agent on this host)"));
      }
    } else {
      if (o.manager.empty() || o.tokenFile.empty() || o.host.empty()) {
        throw ConfigError("give --connection_file, or all of --manager, --token_file and --host");
      }
      token = readFirstLine(o.tokenFile, "--token_file");
    }
    if (o.host.empty()) throw ConfigError("--host is required (the host's name in the machine list)");
    if (o.inSeconds >= 0) o.deadlineUnixMs = nowUnixMs() + static_cast<int64_t>(o.inSeconds * 1000);
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeoutS * 1000));
    proto::notifyPreemption(o.manager, token, o.host, o.deadlineUnixMs, timeout, o.connectionFile.empty());
    std::cout << "manager at " << o.manager << " acknowledged: " << o.host << " will be preempted" << std::endl;
    return 0;
  } catch (const Error& e) {
    std::cerr << "notify_manager_preempt: " << e.what() << std::endl;
    return e.exitCode();
  } catch (const std::exception& e) {
    std::cerr << "notify_manager_preempt: " << e.what() << std::endl;
    return 1;
  }
}
