#include "varuna/manager/ssh_command.h"

#include <libssh/callbacks.h>
#include <libssh/libssh.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>

#include "varuna/common/errors.h"

namespace varuna {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr std::size_t kMaxOutput = 64 * 1024;
constexpr milliseconds kPollSlice{100};
// Closing the channel and sending the disconnect must not hang on a dead peer.
constexpr milliseconds kTeardownTimeout{1000};

struct SessionDeleter {
  void operator()(ssh_session session) const {
    ssh_disconnect(session);
    ssh_free(session);
  }
};
struct ChannelDeleter {
  void operator()(ssh_channel channel) const { ssh_channel_free(channel); }
};
struct KeyDeleter {
  void operator()(ssh_key key) const { ssh_key_free(key); }
};
struct CharDeleter {
  void operator()(char* text) const { ssh_string_free_char(text); }
};
using SessionPtr = std::unique_ptr<ssh_session_struct, SessionDeleter>;
using ChannelPtr = std::unique_ptr<ssh_channel_struct, ChannelDeleter>;
using KeyPtr = std::unique_ptr<ssh_key_struct, KeyDeleter>;
using CharPtr = std::unique_ptr<char, CharDeleter>;

class Deadline {
 public:
  explicit Deadline(milliseconds budget) : end_(Clock::now() + budget) {}
  milliseconds remaining() const {
    return std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(end_ - Clock::now()));
  }
  bool expired() const { return Clock::now() >= end_; }

 private:
  Clock::time_point end_;
};

// Every blocking libssh call on the session waits at most this long. Zero
// would mean "no timeout" to libssh, hence the 1 ms floor.
void setSessionTimeout(ssh_session session, milliseconds timeout) {
  const long ms = std::max<long>(1, static_cast<long>(timeout.count()));
  const long seconds = ms / 1000;
  const long micros = (ms % 1000) * 1000;
  ssh_options_set(session, SSH_OPTIONS_TIMEOUT, &seconds);
  ssh_options_set(session, SSH_OPTIONS_TIMEOUT_USEC, &micros);
}

std::string hostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? strCat("[", host, "]:", port) : strCat(host, ":", port);
}

// How known_hosts and ssh-keygen -R name a host.
std::string knownHostsName(const std::string& host, int port) {
  return port == 22 ? host : strCat("[", host, "]:", port);
}

std::string sessionError(ssh_session session) {
  const char* error = ssh_get_error(session);
  return error && *error ? std::string(error) : std::string("unknown libssh error");
}

std::string stringOption(ssh_session session, ssh_options_e option, const std::string& fallback) {
  char* value = nullptr;
  if (ssh_options_get(session, option, &value) != SSH_OK || value == nullptr) return fallback;
  CharPtr owned(value);
  return std::string(value);
}

// "ssh-ed25519 SHA256:..." for the server's key, so the user can compare it
// with the real host's before trusting it.
std::string describeServerKey(ssh_session session) {
  ssh_key raw = nullptr;
  if (ssh_get_server_publickey(session, &raw) != SSH_OK) return "an unreadable key";
  KeyPtr key(raw);
  unsigned char* hash = nullptr;
  std::size_t hashLen = 0;
  const char* typeName = ssh_key_type_to_char(ssh_key_type(key.get()));
  const std::string type = typeName ? typeName : "unknown-type";
  if (ssh_get_publickey_hash(key.get(), SSH_PUBLICKEY_HASH_SHA256, &hash, &hashLen) != SSH_OK) return type;
  CharPtr fingerprint(ssh_get_fingerprint_hash(SSH_PUBLICKEY_HASH_SHA256, hash, hashLen));
  ssh_clean_pubkey_hash(&hash);
  return fingerprint ? strCat(type, " ", fingerprint.get()) : type;
}

// Keeps the last kMaxOutput bytes: a failing command explains itself at the end.
class OutputTail {
 public:
  void append(const char* data, std::size_t size) {
    text_.append(data, size);
    if (text_.size() > 2 * kMaxOutput) trim();
  }
  std::string take() {
    trim();
    if (!dropped_) return std::move(text_);
    const std::string marker = "[... earlier output dropped ...]\n";
    return marker + text_.substr(marker.size());
  }

 private:
  void trim() {
    if (text_.size() <= kMaxOutput) return;
    text_.erase(0, text_.size() - kMaxOutput);
    dropped_ = true;
  }
  std::string text_;
  bool dropped_ = false;
};

// The last few lines of `output`, joined with " | ", for a failure message.
std::string lastLines(const std::string& output) {
  constexpr int kLines = 5;
  constexpr std::size_t kChars = 600;
  std::size_t end = output.find_last_not_of("\r\n");
  if (end == std::string::npos) return "(no output)";
  std::size_t start = end + 1;
  for (int i = 0; i < kLines && start > 0; ++i) {
    const std::size_t newline = output.rfind('\n', start - 1);
    start = newline == std::string::npos ? 0 : newline;
  }
  std::string tail = output.substr(start, end + 1 - start);
  if (!tail.empty() && tail.front() == '\n') tail.erase(0, 1);
  if (tail.size() > kChars) tail = "..." + tail.substr(tail.size() - kChars);
  std::string joined;
  for (char c : tail) {
    if (c == '\n')
      joined += " | ";
    else if (c != '\r')
      joined += c;
  }
  return "\"" + joined + "\"";
}

// Filled by libssh while the channel runs; only the signal needs a callback
// (libssh 0.10 has no getter for it), the exit status comes from
// ssh_channel_get_exit_status.
struct ChannelEvents {
  std::optional<std::string> exitSignal;
};

void onExitSignal(ssh_session, ssh_channel, const char* signal, int core, const char*, const char*, void* userdata) {
  static_cast<ChannelEvents*>(userdata)->exitSignal =
      strCat("SIG", signal ? signal : "?", core ? " (core dumped)" : "");
}

class SshRun {
 public:
  SshRun(const std::string& host, const std::string& command, const std::string& input, const SshOptions& options)
      : host_(host), command_(command), input_(input), options_(options), where_(hostPort(host, options.port)) {}

  SshResult run() {
    if (host_.empty())
      return fail(SshFailure::kUnreachable,
                  "no host given to run an SSH command on; name the machine in the machine list");
    if (options_.port <= 0 || options_.port > 65535)
      return fail(SshFailure::kUnreachable,
                  strCat("SSH port ", options_.port, " for ", host_, " is out of range; use 1-65535"));
    session_.reset(ssh_new());
    if (!session_)
      return fail(SshFailure::kUnreachable, strCat("cannot create an SSH session for ", where_, " (out of memory)"));
    if (!configure())
      return fail(SshFailure::kUnreachable,
                  strCat("cannot set SSH options for ", where_, ": ", sessionError(session_.get())));
    if (!connect()) return std::move(result_);
    if (!checkHostKey()) return std::move(result_);
    if (!authenticate()) return std::move(result_);
    execute();
    return std::move(result_);
  }

  ~SshRun() {
    // The channel is freed before the session; bound the goodbye packets.
    if (session_) setSessionTimeout(session_.get(), kTeardownTimeout);
    if (channel_) {
      if (ssh_channel_is_open(channel_.get())) ssh_channel_close(channel_.get());
      channel_.reset();
    }
  }

 private:
  SshResult& fail(SshFailure failure, std::string message) {
    result_.failure = failure;
    result_.message = std::move(message);
    return result_;
  }

  bool configure() {
    ssh_session s = session_.get();
    const bool processConfig = false;
    const int port = options_.port;
    if (ssh_options_set(s, SSH_OPTIONS_PROCESS_CONFIG, &processConfig) != SSH_OK) return false;
    if (ssh_options_set(s, SSH_OPTIONS_HOST, host_.c_str()) != SSH_OK) return false;
    if (ssh_options_set(s, SSH_OPTIONS_PORT, &port) != SSH_OK) return false;
    if (!options_.user.empty() && ssh_options_set(s, SSH_OPTIONS_USER, options_.user.c_str()) != SSH_OK) return false;
    if (!options_.knownHostsFile.empty() &&
        ssh_options_set(s, SSH_OPTIONS_KNOWNHOSTS, options_.knownHostsFile.c_str()) != SSH_OK)
      return false;
    // Only knownHostsFile decides (see the header); an empty file stands in for the global one.
    if (ssh_options_set(s, SSH_OPTIONS_GLOBAL_KNOWNHOSTS, "/dev/null") != SSH_OK) return false;
    return true;
  }

  bool connect() {
    ssh_session s = session_.get();
    setSessionTimeout(s, options_.connectTimeout);
    if (ssh_connect(s) != SSH_OK) {
      fail(SshFailure::kUnreachable,
           strCat("cannot connect to ", where_, ": ", sessionError(s), " (connectTimeout ",
                  options_.connectTimeout.count(), " ms); check that the host is up, that sshd listens on port ",
                  options_.port, " and that no firewall blocks it"));
      return false;
    }
    // Known only once libssh has applied its defaults during ssh_connect.
    knownHosts_ = stringOption(s, SSH_OPTIONS_KNOWNHOSTS,
                               options_.knownHostsFile.empty() ? "~/.ssh/known_hosts" : options_.knownHostsFile);
    user_ = stringOption(s, SSH_OPTIONS_USER, options_.user.empty() ? "(current user)" : options_.user);
    return true;
  }

  bool checkHostKey() {
    ssh_session s = session_.get();
    const std::string name = knownHostsName(host_, options_.port);
    const std::string keyscan = strCat("ssh-keyscan -p ", options_.port, " ", host_, " >> ", knownHosts_);
    const std::string removeOld = strCat("ssh-keygen -R '", name, "' -f ", knownHosts_);
    // Never ssh_session_update_known_hosts: trusting a key is the user's decision.
    switch (ssh_session_is_known_server(s)) {
      case SSH_KNOWN_HOSTS_OK:
        return true;
      case SSH_KNOWN_HOSTS_UNKNOWN:
        // libssh reports a missing user file as UNKNOWN when the (empty)
        // global file exists, so look for it here.
        if (::access(knownHosts_.c_str(), F_OK) != 0) {
          fail(SshFailure::kUnknownHostKey, strCat("host key of ", where_, " cannot be checked because ", knownHosts_,
                                                   " does not exist (the server offers ", describeServerKey(s),
                                                   "); verify the key and add it with: ", keyscan));
          return false;
        }
        fail(SshFailure::kUnknownHostKey,
             strCat("host key of ", where_, " is not in ", knownHosts_, " (the server offers ", describeServerKey(s),
                    "); verify it and add it with: ", keyscan));
        return false;
      case SSH_KNOWN_HOSTS_NOT_FOUND:
        fail(SshFailure::kUnknownHostKey, strCat("host key of ", where_, " cannot be checked because ", knownHosts_,
                                                 " does not exist (the server offers ", describeServerKey(s),
                                                 "); verify the key and add it with: ", keyscan));
        return false;
      case SSH_KNOWN_HOSTS_CHANGED:
        fail(SshFailure::kHostKeyChanged,
             strCat("WARNING: host key of ", where_, " has CHANGED from the one in ", knownHosts_,
                    " (the server now offers ", describeServerKey(s),
                    "), which may be a man-in-the-middle attack, so the connection was refused; "
                    "only if the host was legitimately re-keyed, remove the old key with: ",
                    removeOld, " and add the new one with: ", keyscan));
        return false;
      case SSH_KNOWN_HOSTS_OTHER:
        fail(SshFailure::kHostKeyChanged,
             strCat("WARNING: host key of ", where_, " (", describeServerKey(s), ") is of a type that ", knownHosts_,
                    " does not record, although it holds a key of another type for this host: the key has CHANGED, "
                    "which may be a man-in-the-middle attack, so the connection was refused; only if the host was "
                    "legitimately re-keyed, remove the old key with: ",
                    removeOld, " and add the new one with: ", keyscan));
        return false;
      case SSH_KNOWN_HOSTS_ERROR:
      default:
        fail(SshFailure::kUnknownHostKey,
             strCat("cannot check the host key of ", where_, " against ", knownHosts_, ": ", sessionError(s),
                    "; make the file readable and well-formed, or add the key with: ", keyscan));
        return false;
    }
  }

  bool authenticate() {
    ssh_session s = session_.get();
    setSessionTimeout(s, options_.connectTimeout);
    const Deadline deadline(options_.connectTimeout);
    std::string identity;
    int rc = SSH_AUTH_ERROR;
    if (!options_.identityFile.empty()) {
      identity = options_.identityFile;
      ssh_key raw = nullptr;
      if (ssh_pki_import_privkey_file(identity.c_str(), nullptr, nullptr, nullptr, &raw) != SSH_OK) {
        fail(SshFailure::kAuthFailed,
             strCat("cannot load the SSH identity file ", identity, " to log in to ", where_,
                    ": it is missing, unreadable, not a private key or passphrase-protected; point identityFile at "
                    "an unencrypted private key"));
        return false;
      }
      KeyPtr key(raw);
      rc = ssh_userauth_publickey(s, nullptr, key.get());
    } else {
      identity = "the default identities (~/.ssh/id_ed25519, ~/.ssh/id_ecdsa, ~/.ssh/id_rsa) and ssh-agent";
      rc = ssh_userauth_publickey_auto(s, nullptr, nullptr);
    }
    const std::string pub =
        options_.identityFile.empty() ? std::string("~/.ssh/id_ed25519.pub") : options_.identityFile + ".pub";
    const std::string fix = strCat("append the public key to ~", user_, "/.ssh/authorized_keys on ", host_,
                                   " (e.g. ssh-copy-id -i ", pub, " -p ", options_.port, " ", user_, "@", host_, ")");
    switch (rc) {
      case SSH_AUTH_SUCCESS:
        return true;
      case SSH_AUTH_DENIED:
        fail(SshFailure::kAuthFailed, strCat("public-key authentication as user '", user_, "' to ", where_,
                                             " was refused for ", identity, "; ", fix));
        return false;
      case SSH_AUTH_PARTIAL:
        fail(SshFailure::kAuthFailed,
             strCat("user '", user_, "' on ", where_, " accepted ", identity,
                    " but requires further authentication methods, which varuna does not use; allow public-key-only "
                    "logins for this user in the server's sshd_config (AuthenticationMethods publickey)"));
        return false;
      case SSH_AUTH_AGAIN:
        fail(SshFailure::kTimeout,
             strCat("authentication as user '", user_, "' to ", where_, " did not finish within ",
                    options_.connectTimeout.count(), " ms (connectTimeout); check the host's load and network, or raise "
                    "connectTimeout"));
        return false;
      case SSH_AUTH_ERROR:
      default:
        if (deadline.expired()) {
          fail(SshFailure::kTimeout,
               strCat("authentication as user '", user_, "' to ", where_, " did not finish within ",
                      options_.connectTimeout.count(), " ms (connectTimeout): ", sessionError(s),
                      "; check the host's load and network, or raise connectTimeout"));
        } else {
          fail(SshFailure::kAuthFailed, strCat("public-key authentication as user '", user_, "' to ", where_,
                                               " failed with ", identity, ": ", sessionError(s), "; ", fix));
        }
        return false;
    }
  }

  void execute() {
    ssh_session s = session_.get();
    const Deadline deadline(options_.commandTimeout);
    setSessionTimeout(s, deadline.remaining());
    channel_.reset(ssh_channel_new(s));
    if (!channel_ || ssh_channel_open_session(channel_.get()) != SSH_OK) {
      startFailed(deadline, "open a session channel");
      return;
    }
    ssh_channel ch = channel_.get();
    ssh_callbacks_init(&callbacks_);
    callbacks_.userdata = &events_;
    callbacks_.channel_exit_signal_function = onExitSignal;
    ssh_set_channel_callbacks(ch, &callbacks_);

    setSessionTimeout(s, deadline.remaining());
    if (ssh_channel_request_exec(ch, command_.c_str()) != SSH_OK) {
      startFailed(deadline, "start the command");
      return;
    }
    // The input (small: a secret, a line) then EOF, so a command that reads
    // stdin to its end finishes instead of waiting for us.
    if (!input_.empty() && ssh_channel_write(ch, input_.data(), static_cast<uint32_t>(input_.size())) == SSH_ERROR) {
      startFailed(deadline, "send the command's input");
      return;
    }
    ssh_channel_send_eof(ch);

    OutputTail output;
    std::array<char, 16 * 1024> buffer;
    const auto drain = [&](int isStderr) {
      int n = 0;
      while ((n = ssh_channel_read_nonblocking(ch, buffer.data(), buffer.size(), isStderr)) > 0)
        output.append(buffer.data(), static_cast<std::size_t>(n));
    };
    // stdout and stderr arrive on one connection in order, so once EOF is
    // seen every byte of both has been buffered.
    while (true) {
      drain(0);
      drain(1);
      if (ssh_channel_is_eof(ch) || ssh_channel_is_closed(ch)) break;
      if (deadline.expired()) {
        result_.output = output.take();
        timedOut();
        return;
      }
      const int rc =
          ssh_channel_poll_timeout(ch, static_cast<int>(std::min(deadline.remaining(), kPollSlice).count()), 0);
      if (rc == SSH_ERROR) {
        result_.output = output.take();
        fail(SshFailure::kUnreachable, strCat("lost the connection to ", where_, " while the command ran: ",
                                              sessionError(s), "; check the host and the network, then retry"));
        return;
      }
    }
    result_.output = output.take();

    // The exit status may trail the EOF by a packet.
    setSessionTimeout(s, deadline.remaining());
    const int status = ssh_channel_get_exit_status(ch);
    if (status >= 0) {
      result_.exitStatus = status;
      if (status == 0) return;
      fail(SshFailure::kCommandFailed, strCat("command on ", where_, " exited with status ", status, "; last output: ",
                                              lastLines(result_.output), "; fix the cause on ", host_, " and retry"));
      return;
    }
    if (events_.exitSignal) {
      fail(SshFailure::kCommandFailed, strCat("command on ", where_, " was killed by ", *events_.exitSignal,
                                              "; last output: ", lastLines(result_.output), "; check ", host_,
                                              " (out of memory? killed by an operator?)"));
      return;
    }
    if (deadline.expired() && !ssh_channel_is_closed(ch)) {
      timedOut();
      return;
    }
    fail(SshFailure::kCommandFailed,
         strCat("command on ", where_, " ended without reporting an exit status (", sessionError(s),
                "); last output: ", lastLines(result_.output), "; check the host's sshd and retry"));
  }

  void startFailed(const Deadline& deadline, const char* step) {
    if (deadline.expired()) {
      timedOut();
      return;
    }
    fail(SshFailure::kCommandFailed, strCat("could not ", step, " on ", where_, ": ", sessionError(session_.get()),
                                            "; check the server's sshd_config (MaxSessions, ForceCommand) and logs"));
  }

  void timedOut() {
    // sshd delivers the signal only to non-root logins (it needs privilege
    // separation); a root login's command is left to die of SIGPIPE when it
    // next writes, once the session closes.
    if (channel_ && ssh_channel_is_open(channel_.get())) {
      setSessionTimeout(session_.get(), kTeardownTimeout);
      ssh_channel_request_send_signal(channel_.get(), "KILL");
    }
    fail(SshFailure::kTimeout,
         strCat("command on ", where_, " did not finish within ", options_.commandTimeout.count(),
                " ms (commandTimeout), so it was sent SIGKILL and the session closed; last output: ",
                lastLines(result_.output), "; raise commandTimeout or check why it hangs on ", host_));
  }

  const std::string& host_;
  const std::string& command_;
  const std::string& input_;
  const SshOptions& options_;
  const std::string where_;
  std::string knownHosts_;
  std::string user_;
  SshResult result_;
  ChannelEvents events_;
  ssh_channel_callbacks_struct callbacks_{};  // must outlive channel_ (declared before it)
  SessionPtr session_;
  ChannelPtr channel_;
};

}  // namespace

const char* toString(SshFailure failure) {
  switch (failure) {
    case SshFailure::kNone:
      return "none";
    case SshFailure::kUnreachable:
      return "unreachable";
    case SshFailure::kUnknownHostKey:
      return "unknown host key";
    case SshFailure::kHostKeyChanged:
      return "host key changed";
    case SshFailure::kAuthFailed:
      return "authentication failed";
    case SshFailure::kCommandFailed:
      return "command failed";
    case SshFailure::kTimeout:
      return "timeout";
  }
  return "?";
}

SshResult runOverSsh(const std::string& host, const std::string& command, const SshOptions& options,
                     const std::string& input) {
  static std::once_flag initOnce;
  static int initResult = SSH_OK;
  const std::string where = hostPort(host, options.port);
  try {
    std::call_once(initOnce, [] { initResult = ssh_init(); });
    if (initResult != SSH_OK) {
      SshResult result;
      result.failure = SshFailure::kUnreachable;
      result.message =
          strCat("cannot initialise libssh to reach ", where, "; check the libssh and OpenSSL installation");
      return result;
    }
    SshRun run(host, command, input, options);
    return run.run();
  } catch (const std::exception& e) {
    SshResult result;
    result.failure = SshFailure::kUnreachable;
    result.message = strCat("running a command on ", where, " over SSH failed: ", e.what());
    return result;
  } catch (...) {
    SshResult result;
    result.failure = SshFailure::kUnreachable;
    result.message = strCat("running a command on ", where, " over SSH failed with an unknown error");
    return result;
  }
}

}  // namespace varuna
