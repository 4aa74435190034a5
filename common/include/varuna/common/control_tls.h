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
// Agents, workers and notifiers prove who they are with certificates of the
// job's own CA instead (certificate_credential.h): the client presents its
// chain, run_varuna its own certificate, each checks the other against the
// job's root, and the identity the listener matches the hello against is the
// one in the client's certificate. Pre-shared keys remain for the two
// credentials that bootstrap: a join credential (a scheduler's task holds
// nothing else yet) and the operator's job secret (notify_manager_preempt
// --token_file on the head node). The client picks the kind from its
// credential's text (clientCredential).
//
// A plaintext control plane exists for loopback development only, behind
// run_varuna's --insecure_plaintext_control, which reaches agents, workers and
// notifiers through kPlaintextEnv.
#pragma once

#include <functional>
#include <memory>
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
  // Proved by a certificate of the job's CA, not a pre-shared key (never
  // part of the text form).
  bool certified = false;
  // A worker's certificate of the job, but through a host CA the job has
  // revoked (an earlier start of its host's agent, a join that is over, a
  // host no longer in the job): its hello is only ordered out (ExitNow).
  bool revoked = false;
  // Certificates: the nonce its host CA names (the start or join of the
  // host's agent it belongs to), to check again after the handshake.
  std::string hostCaNonce;
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

class CertificateCredential;
// The manager's side, for a certificate chain that leads to the job's root:
// what the job makes of `hostCa` (the CA of the host the peer is on) for
// `peer` (the leaf's identity). kRefused (with `why`) fails the handshake;
// kRevoked lets it through marked `revoked` (the daemon orders such a
// worker out, so that a straggler of an earlier start stops at once).
enum class HostCaStanding { kValid, kRevoked, kRefused };
using AcceptHostCa =
    std::function<HostCaStanding(const PskIdentity& hostCa, const PskIdentity& peer, std::string& why)>;

// How each end of a connection authenticates, per connection, reached from
// OpenSSL's callbacks through the SSL's ex_data. A client holds a
// pre-shared key (identity, key) or a certificate credential; the server
// finds a key by identity and checks certificate chains against the job's
// CA, and records who the peer proved to be.
struct ClientAuth {
  std::string identity, key;
  std::shared_ptr<const CertificateCredential> certificate;
  bool managerVerified = false;  // the server proved it is the job's manager (certificate mode)
  std::string refusal;           // why the server's certificate was not accepted
};
struct ServerAuth {
  KeyForIdentity keyFor;
  // Certificate mode: the job's CA (its root certificate) and who may use it.
  std::shared_ptr<const CertificateCredential> ca;
  AcceptHostCa acceptHostCa;
  std::optional<PskIdentity> presented;  // set once the peer's identity was accepted
  std::string refusal;                   // why it was not, for the log
};

// What a client holding `credential` presents to say `hello` (`hint` as
// identityOf's): its certificate for a certificate credential, else a
// pre-shared key. Throws ConfigError for a malformed certificate credential.
ClientAuth clientCredential(const proto::Hello& hello, const std::string& hint = {});
// `hello` as it goes on the wire: a certificate credential's text (its
// private key) never does; the certificate proved it.
proto::Hello wireHello(proto::Hello hello);

// TLS 1.3 only, the one cipher suite external PSKs of the callback kind use,
// no session tickets. A server takes pre-shared keys only until
// useServerCertificate gives it the manager's certificate.
void configureContext(ssl_ctx_st* context, bool server);
// The server presents `manager` (the manager's credential, issued by the
// job's root) and requires a client certificate unless a pre-shared key
// authenticated the client.
void useServerCertificate(ssl_ctx_st* context, const CertificateCredential& manager);
// The same for one connection of a context configureContext made.
void useServerCertificate(ssl_st* ssl, const CertificateCredential& manager);
// Makes `ssl` read and write the socket `fd` (which it does not close), its
// writes never raising SIGPIPE (a worker is the user's program, which may not
// ignore it). False if OpenSSL could not.
bool attachSocket(ssl_st* ssl, int fd);
// After a completed client handshake: whether the server proved what the
// client's credential expects: the pre-shared key (a resumed-style PSK
// handshake, no certificate), or the job's manager certificate.
bool provedKey(const ssl_st* ssl);
// Attach the per-connection data (which must outlive the SSL) to `ssl`.
void attachClient(ssl_st* ssl, ClientAuth* auth);
void attachServer(ssl_st* ssl, ServerAuth* auth);
// OpenSSL's error queue as text (and emptied), for errors.
std::string lastError();

}  // namespace varuna::tls
