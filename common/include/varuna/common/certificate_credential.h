// CertificateCredential: a credential of the control plane that is a private
// key and its certificate, issued under the job's own certificate authority
// (docs/deployment.md, "Security"). Three levels, each signing the next:
//
//   the job's root CA          run_varuna's <state_dir>/ca (never leaves it)
//   ├─ the manager             run_varuna's server certificate, role "manager"
//   └─ host H's CA             the agent of H (role "agent", host H, hint: a
//      │                       random nonce of that start or join of its agent)
//      ├─ the notifier of H    role "notifier", host H
//      └─ worker R, gen. G     role "worker", host H, rank R, generation G
//
// run_varuna issues each agent its host's CA (key and certificate) on the SSH
// command's stdin, or in `joined`; the agent issues its notifier's and each
// worker's own certificates with it, as it derived their keys before. A peer
// presents its chain in the TLS handshake; run_varuna accepts it only when
// every signature leads to the job's root, a leaf's host is its CA's host,
// and the host CA's nonce is of a start or join of the host's agent the job
// holds valid (AgentPool::acceptsHostCa, AgentLaunches). What a certificate speaks for (PskIdentity: role, host, rank,
// generation, hint) is in an extension of its own (kIdentityOid): host names
// longer than a common name's 64 characters fit. Peers check that the
// server's certificate is the manager's, signed by the root itself, so
// neither a host's CA nor anything it signed can stand in for run_varuna.
//
// Keys are EC P-256, signatures ECDSA with SHA-256. The text form (what
// travels where the older hex credentials did: stdin, connection.json, a
// worker's pipe) is "vc1." and one line of base64 of the PEM blocks: the
// private key (a "VARUNA P-256 KEY" block: its scalar and public point, which
// parse in 30 us where OpenSSL 3.0's PKCS#8 decoder takes a millisecond),
// the certificate, then each issuer up to the root. Immutable once made;
// safe to share between threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "varuna/common/control_tls.h"

struct evp_pkey_st;
struct x509_st;
struct stack_st_X509;

namespace varuna::tls {

inline constexpr const char* kCertificateCredentialPrefix = "vc1.";
// Whether `credential` is of the certificate kind (else an older hex one).
bool isCertificateCredential(const std::string& credential);

class CertificateCredential {
 public:
  // A new root CA for a job. `name` goes into its common name (for people).
  static CertificateCredential makeRoot(const std::string& name);
  // Throws ConfigError (naming `what`) for text that is not a whole credential.
  static CertificateCredential parse(const std::string& text, const std::string& what = "credential");
  std::string encode() const;

  // What this credential speaks for (its certificate's identity).
  const PskIdentity& identity() const { return identity_; }
  // A fresh key and certificate for `subject`, signed by this credential,
  // which must be a CA (the root, or a host's). `isCa`: the subject may sign
  // one more level (a host's CA). Valid from an hour ago (clocks differ)
  // for `validDays`.
  CertificateCredential issue(const PskIdentity& subject, bool isCa, int validDays = 3650) const;
  bool isCa() const;

  evp_pkey_st* key() const { return key_.get(); }
  x509_st* certificate() const { return chain_.front().get(); }
  // The issuers' certificates, nearest first (empty for the root).
  std::vector<x509_st*> issuers() const;
  // The job's root certificate (this one's own for the root).
  x509_st* root() const { return chain_.back().get(); }

 private:
  using Certificate = std::shared_ptr<x509_st>;
  CertificateCredential(std::shared_ptr<evp_pkey_st> key, std::vector<Certificate> chain);
  std::shared_ptr<evp_pkey_st> key_;
  std::vector<Certificate> chain_;  // own first, root last
  PskIdentity identity_;
};

// The identity a certificate carries, nullopt if it carries none.
std::optional<PskIdentity> identityOf(x509_st* certificate);

// A client's chain as TLS delivers it (`leaf` first; `sent`: everything the
// peer sent, the leaf included) checked against the job's `root`. On success,
// the leaf's identity and its host's CA's (the leaf itself for an agent);
// else nullopt and `why`.
struct CheckedChain {
  PskIdentity peer, hostCa;
};
std::optional<CheckedChain> checkPeerChain(x509_st* root, x509_st* leaf, stack_st_X509* sent, std::string& why);
// Whether `certificate` is the manager's: signed by `root` itself, role
// "manager", within its validity. False with `why` otherwise.
bool checkManagerCertificate(x509_st* root, x509_st* certificate, std::string& why);

}  // namespace varuna::tls
