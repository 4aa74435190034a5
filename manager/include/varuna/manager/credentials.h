// Credentials per role, derived from the job's secret (run_varuna's
// <state_dir>/token) so that each peer holds only what lets it speak for
// itself (docs/deployment.md, "Credentials"):
//
//   agent of host H          A(H)      = HMAC-SHA256(secret, "agent\n" H)
//   notifier of host H       N(H)      = HMAC-SHA256(A(H), "notifier")
//   worker rank R of gen. G  W(H,R,G)  = HMAC-SHA256(A(H), "worker\n" R "\n" G)
//
// run_varuna sends an agent only A(H) (on the SSH command's stdin); the agent
// derives its notifier's credential (connection.json) and each of its
// workers' (their environment) from it. So a worker's credential cannot say
// hello as another rank, another generation, an agent or a notifier; a
// notifier's cannot announce another host; an agent's cannot speak for
// another host. The manager recomputes what a hello must carry from the
// secret and the hello's own role, host, rank and generation. The secret
// itself also passes as a notifier of any host (the operator's
// `notify_manager_preempt --token_file`). Hex strings, 64 characters.
//
// A host that joins by itself (`varuna_agent --join`, under a scheduler)
// holds no A(H) yet: it proves it may join with the join credential
//
//   J(E) = "vj1." E "." HMAC-SHA256(secret, "join\n" E)
//
// where E is the Unix time (s) after which it is refused; run_varuna writes
// a fresh one to <state_dir>/join_token (0600) and renews it at half its
// life. A join admitted, the manager answers with the host's agent
// credential, bound to that join by a random nonce N the manager keeps while
// the host is in the job:
//
//   joined agent of host H   A(H, N)   = HMAC-SHA256(secret, "agent\n" H "\n" N)
//
// (its notifier's and workers' credentials derive from it as above). So the
// credential bootstraps the agent's own, as `kubeadm join` does, and whoever
// once joined as H holds nothing once that join is over: not what a later
// join of H gets, nor A(H) of a listed H.
//
// Over TLS (the default) the agent credential is a certificate credential
// instead (certificate_credential.h): a CA for host H (naming N for a joined
// host) that the job's root signed; notifier() and worker() then issue the
// leaf certificates, as they derive the keys above. The derived keys remain
// for --insecure_plaintext_control and the in-process test network.
#pragma once

#include <cstdint>
#include <string>

namespace varuna::credentials {

std::string agent(const std::string& jobSecret, const std::string& host);
std::string joinedAgent(const std::string& jobSecret, const std::string& host, const std::string& joinNonce);
// A fresh nonce (a join's, an agent start's): 32 hex digits from OpenSSL's RAND_bytes.
std::string newNonce();
std::string notifier(const std::string& agentCredential);
std::string worker(const std::string& agentCredential, int rank, int generation);
// Names a job secret without revealing it (what <state_dir>/ca is tied to).
std::string caTag(const std::string& jobSecret);

std::string join(const std::string& jobSecret, int64_t expiresUnixS);
enum class JoinCheck { kValid, kMalformed, kWrong, kExpired };
// Checks a join credential against the secret (in constant time) and the clock.
JoinCheck checkJoin(const std::string& jobSecret, const std::string& credential, int64_t nowUnixS);
// When a well-formed join credential expires (Unix s), -1 if malformed.
int64_t joinExpiry(const std::string& credential);
const char* toString(JoinCheck check);

// What a hello of `role` (rank and generation for a worker) must carry, from
// the agent credential of the host it claims (agent() for a listed host,
// joinedAgent() for one in the job by a join); empty for a role that has none.
std::string expected(const std::string& agentCredential, const std::string& role, int rank, int generation);

}  // namespace varuna::credentials
