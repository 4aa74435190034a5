// ControlTls: what makes every control connection (agent, worker, notifier,
// join -> run_varuna) mutually authenticated and encrypted: TLS 1.3 with an
// external pre-shared key per peer (RFC 8446 2.2, psk_dhe_ke: a fresh
// ephemeral key exchange each connection, so a key learnt later does not
// decrypt a recorded one).
//
// The key is the peer's own credential (credentials.h: A(H), N(H), W(H,R,G),
// a join credential, or the operator's job secret) and the PSK identity names
// what the peer speaks for: role, host, rank, generation. run_varuna derives
// the key from the identity alone (it holds the job's secret), so a peer
// without the credential of what it claims fails the handshake before a byte
// of the control protocol is read, and a manager without the job's secret
// (an impostor on the manager's port) cannot complete it either: the peer
// sends nothing. After the handshake the listener checks that the hello
// claims exactly what the identity named (docs/deployment.md, "Security").
//
// No certificates: each credential already is a per-role, per-host,
// per-launch secret both ends hold, and a certificate authority would add a
// second set of secrets to make, ship and revoke with the same lifetimes.
//
// A plaintext control plane exists for loopback development only, behind
// run_varuna's --insecure_plaintext_control, which reaches agents, workers and
// notifiers through kPlaintextEnv.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "varuna/common/loopback.h"
#include "varuna/common/protocol.h"

struct sockaddr;
struct ssl_ctx_st;
struct ssl_st;

namespace varuna::tls {

// "1" in a process's environment: its control connections are plaintext.
inline constexpr const char* kPlaintextEnv = "VARUNA_INSECURE_PLAINTEXT_CONTROL";
bool plaintextRequested();
// isLoopback(sockaddr), where plaintext may go: loopback.h.

// What a peer's PSK identity says. `hint` tells the manager which key to
// derive where the role alone does not: "secret" for a notifier holding the
// job's secret (the operator's), "vj1.<expiry>" for a join (its credential's
// public part).
struct PskIdentity {
  std::string role, host;
  int rank = -1, generation = -1;
  std::string hint;
};
// Throws ConfigError for a host name over kMaxHostBytes (OpenSSL's PSK
// identities end at 256 bytes; DNS names at 253).
inline constexpr size_t kMaxHostBytes = 200;
std::string formatIdentity(const PskIdentity& identity);
std::optional<PskIdentity> parseIdentity(const std::string& text);
// The identity a connection that starts with `hello` must present (a join's
// hint derived from its credential).
PskIdentity identityOf(const proto::Hello& hello, std::string hint = {});
// Whether `hello` claims exactly what `identity` named (the hint aside).
bool matches(const PskIdentity& identity, const proto::Hello& hello);

// The key a peer holding `credential` presents.
std::string pskKey(const std::string& credential);

// The manager's side: the key for an identity, or nullopt to refuse it.
using KeyForIdentity = std::function<std::optional<std::string>(const PskIdentity&)>;

// Per connection, reached from OpenSSL's callbacks through the SSL's ex_data.
struct ClientPsk {
  std::string identity, key;
};
struct ServerPsk {
  KeyForIdentity keyFor;
  std::optional<PskIdentity> presented;  // set once the peer's identity was accepted
  std::string refusal;                   // why it was not, for the log
};

// TLS 1.3 only, the one cipher suite external PSKs of the callback kind use,
// no certificates, no session tickets.
void configureContext(ssl_ctx_st* context, bool server);
// Makes `ssl` read and write the socket `fd` (which it does not close), its
// writes never raising SIGPIPE (a worker is the user's program, which may not
// ignore it). False if OpenSSL could not.
bool attachSocket(ssl_st* ssl, int fd);
// After a completed handshake: whether it was the pre-shared key that
// authenticated the other end (a resumed-style PSK handshake, no certificate).
bool provedKey(const ssl_st* ssl);
// Attach the per-connection data (which must outlive the SSL) to `ssl`.
void attachClient(ssl_st* ssl, ClientPsk* psk);
void attachServer(ssl_st* ssl, ServerPsk* psk);
// OpenSSL's error queue as text (and emptied), for errors.
std::string lastError();

}  // namespace varuna::tls
