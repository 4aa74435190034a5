#include "agent/join.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "varuna/common/control_client.h"
#include "varuna/common/log.h"
#include "varuna/common/secrets.h"
#include "varuna/common/time_util.h"

namespace varuna {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kAnswerWait{10000};
constexpr std::chrono::milliseconds kFirstRetry{500};
constexpr std::chrono::milliseconds kMostRetry{5000};

// One try: the answer, or nullopt for what another try may mend (stored in `why`).
std::optional<proto::Joined> tryJoin(const JoinRequest& request, std::chrono::milliseconds timeout, std::string& why) {
  try {
    auto client = proto::ControlClient::connectAs(
        request.manager, timeout,
        proto::Hello{proto::kVersion, request.credential, "join", request.host, -1, -1, request.slots});
    const auto answer = client.receive(kAnswerWait);
    if (!answer) {
      why = "the manager did not answer the join";
      return std::nullopt;
    }
    if (const auto* joined = std::get_if<proto::Joined>(&*answer)) return *joined;
    const auto* ack = std::get_if<proto::Ack>(&*answer);
    const std::string reason = ack ? ack->error : "an unexpected " + proto::typeName(*answer);
    if (reason.find(proto::kJoinHostPresent) == std::string::npos) throw ConfigError(reason);
    why = reason;  // an earlier agent of this host may be on its way out
  } catch (const ConfigError&) {
    throw;
  } catch (const proto::AuthenticationError& e) {
    // The manager derived another key for this credential: waiting will not mend it.
    throw ConfigError(strCat("a wrong join credential (not this job's; read the current one from run_varuna's "
                             "state_dir/join_token): ", e.what()));
  } catch (const std::exception& e) {
    why = e.what();
  }
  return std::nullopt;
}

}  // namespace

proto::Joined joinManager(const JoinRequest& request) {
  const auto deadline = Clock::now() + request.wait;
  DoublingBackoff backoff(kFirstRetry, kMostRetry);
  std::string why;
  for (int attempt = 1;; ++attempt) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (auto joined = tryJoin(request, std::clamp(left, std::chrono::milliseconds(1000), kAnswerWait), why)) {
      return *joined;
    }
    const auto pause = backoff.next();
    if (Clock::now() + pause >= deadline) {
      throw Error(strCat("could not join the manager at ", request.manager, " within ",
                         std::chrono::duration<double>(request.wait).count(), " s (", attempt, " tries; the last: ",
                         why, ")"),
                  1);
    }
    log::info("join attempt ", attempt, " failed (", why, "); trying again in ", pause.count(), " ms");
    std::this_thread::sleep_for(pause);
  }
}

std::string readJoinCredential(const std::string& path) {
  std::string credential;
  if (!path.empty()) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) throw ConfigError(strCat("--join_token_file ", path, " cannot be read"));
    if ((st.st_mode & 077) != 0) {
      throw ConfigError(strCat("--join_token_file ", path,
                               " may be read or written by other users (its group or others have access): chmod 600 it"));
    }
    std::ifstream in(path);
    std::getline(in, credential);
    if (credential.empty()) throw ConfigError(strCat("--join_token_file ", path, " holds no credential"));
    return credential;
  }
  const char* value = std::getenv("VARUNA_JOIN_TOKEN");
  if (!value || !*value) {
    throw ConfigError("no join credential: give --join_token_file (run_varuna's <state_dir>/join_token, or a copy "
                      "only you can read) or set VARUNA_JOIN_TOKEN");
  }
  credential = value;
  scrubEnvironmentVariable("VARUNA_JOIN_TOKEN");
  return credential;
}

}  // namespace varuna
