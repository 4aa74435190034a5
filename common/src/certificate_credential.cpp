#include "varuna/common/certificate_credential.h"

#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/ec.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/param_build.h>
#include <openssl/params.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <cstring>
#include <functional>

#include "varuna/common/errors.h"

namespace varuna::tls {
namespace {

// A UUID-based object identifier (ITU-T X.667, no registration needed): the
// extension that holds what a certificate speaks for, formatIdentity's text.
constexpr const char* kIdentityOid = "2.25.21507992678140462662788436320161827788";
constexpr int kSerialBytes = 16;

[[noreturn]] void fail(const std::string& what) { throw Error(strCat(what, ": ", lastError()), 1); }

ASN1_OBJECT* identityObject() {
  static ASN1_OBJECT* const object = OBJ_txt2obj(kIdentityOid, 1);
  return object;
}

std::shared_ptr<EVP_PKEY> newKey() {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  if (!key) fail("cannot make an EC P-256 key");
  return {key, EVP_PKEY_free};
}

// The private key as its P-256 scalar and public point, in a PEM block of
// this project's own type: OpenSSL 3.0's PrivateKeyInfo decoder takes about
// a millisecond per key (its decoder search), this about 30 us, and a worker
// launch or a simulated cluster of 10 000 parses thousands.
constexpr const char* kKeyBlock = "VARUNA P-256 KEY";
constexpr size_t kScalarBytes = 32, kPointBytes = 65;

std::string keyBytes(EVP_PKEY* key) {
  BIGNUM* scalar = nullptr;
  unsigned char bytes[kScalarBytes + kPointBytes];
  size_t pointBytes = 0;
  const bool ok = EVP_PKEY_get_bn_param(key, OSSL_PKEY_PARAM_PRIV_KEY, &scalar) == 1 &&
                  BN_bn2binpad(scalar, bytes, kScalarBytes) == static_cast<int>(kScalarBytes) &&
                  EVP_PKEY_get_octet_string_param(key, OSSL_PKEY_PARAM_PUB_KEY, bytes + kScalarBytes, kPointBytes,
                                                  &pointBytes) == 1 &&
                  pointBytes == kPointBytes;
  BN_clear_free(scalar);
  if (!ok) fail("cannot write a P-256 key");
  std::string out(reinterpret_cast<const char*>(bytes), sizeof(bytes));
  OPENSSL_cleanse(bytes, sizeof(bytes));
  return out;
}

std::shared_ptr<EVP_PKEY> keyFromBytes(const unsigned char* bytes, size_t size) {
  if (size != kScalarBytes + kPointBytes) return nullptr;
  // OSSL_PARAM's big numbers are in native byte order.
  unsigned char scalar[kScalarBytes];
  for (size_t i = 0; i < kScalarBytes; ++i) scalar[i] = bytes[kScalarBytes - 1 - i];
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the scalar is reversed for a little-endian machine");
  char group[] = "prime256v1";
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_PKEY_PARAM_GROUP_NAME, group, 0),
      OSSL_PARAM_construct_BN(OSSL_PKEY_PARAM_PRIV_KEY, scalar, kScalarBytes),
      OSSL_PARAM_construct_octet_string(OSSL_PKEY_PARAM_PUB_KEY, const_cast<unsigned char*>(bytes + kScalarBytes),
                                        kPointBytes),
      OSSL_PARAM_construct_end()};
  EVP_PKEY_CTX* context = EVP_PKEY_CTX_new_from_name(nullptr, "EC", nullptr);
  EVP_PKEY* key = nullptr;
  const bool ok = context && EVP_PKEY_fromdata_init(context) == 1 &&
                  EVP_PKEY_fromdata(context, &key, EVP_PKEY_KEYPAIR, params) == 1;
  EVP_PKEY_CTX_free(context);
  OPENSSL_cleanse(scalar, sizeof(scalar));
  if (!ok) {
    EVP_PKEY_free(key);
    return nullptr;
  }
  return {key, EVP_PKEY_free};
}

// The uncompressed public point a certificate holds (its key's bit string).
std::string publicPoint(X509* certificate) {
  const ASN1_BIT_STRING* bits = X509_get0_pubkey_bitstr(certificate);
  if (!bits) return {};
  return std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(bits)),
                     static_cast<size_t>(ASN1_STRING_length(bits)));
}

void addExtension(X509* certificate, X509* issuer, int nid, const char* value) {
  X509V3_CTX context;
  X509V3_set_ctx(&context, issuer, certificate, nullptr, nullptr, 0);
  X509_EXTENSION* extension = X509V3_EXT_conf_nid(nullptr, &context, nid, value);
  if (!extension || X509_add_ext(certificate, extension, -1) != 1) {
    X509_EXTENSION_free(extension);
    fail(strCat("cannot add the certificate extension ", OBJ_nid2sn(nid)));
  }
  X509_EXTENSION_free(extension);
}

void addIdentity(X509* certificate, const PskIdentity& identity) {
  const std::string text = formatIdentity(identity);
  ASN1_OCTET_STRING* data = ASN1_OCTET_STRING_new();
  if (!data || ASN1_OCTET_STRING_set(data, reinterpret_cast<const unsigned char*>(text.data()),
                                     static_cast<int>(text.size())) != 1) {
    ASN1_OCTET_STRING_free(data);
    fail("cannot encode a certificate's identity");
  }
  X509_EXTENSION* extension = X509_EXTENSION_create_by_OBJ(nullptr, identityObject(), /*critical=*/1, data);
  ASN1_OCTET_STRING_free(data);
  if (!extension || X509_add_ext(certificate, extension, -1) != 1) {
    X509_EXTENSION_free(extension);
    fail("cannot add a certificate's identity");
  }
  X509_EXTENSION_free(extension);
}

// For people reading the certificate (openssl x509 -text): the role and host.
void setSubject(X509* certificate, const PskIdentity& identity) {
  std::string name = strCat("varuna ", identity.role, identity.host.empty() ? "" : " ", identity.host);
  if (name.size() > 64) name.resize(64);  // a common name's limit; the identity extension has the whole host
  X509_NAME* subject = X509_get_subject_name(certificate);
  if (X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_UTF8, reinterpret_cast<const unsigned char*>(name.c_str()),
                                 -1, -1, 0) != 1) {
    fail("cannot name a certificate");
  }
}

void setSerialAndValidity(X509* certificate, int validDays) {
  unsigned char serial[kSerialBytes];
  if (RAND_bytes(serial, sizeof(serial)) != 1) fail("no random serial number");
  serial[0] &= 0x7f;  // positive
  BIGNUM* number = BN_bin2bn(serial, sizeof(serial), nullptr);
  const bool set = number && BN_to_ASN1_INTEGER(number, X509_get_serialNumber(certificate));
  BN_free(number);
  if (!set) fail("cannot set a certificate's serial number");
  X509_set_version(certificate, X509_VERSION_3);
  X509_gmtime_adj(X509_getm_notBefore(certificate), -3600);  // another machine's clock may be behind
  X509_time_adj_ex(X509_getm_notAfter(certificate), validDays, 0, nullptr);
}

// A signed certificate for `subjectKey`; `issuer` null: self-signed.
std::shared_ptr<X509> makeCertificate(const PskIdentity& identity, EVP_PKEY* subjectKey, bool isCa, int pathLength,
                                      X509* issuer, EVP_PKEY* issuerKey, int validDays) {
  std::shared_ptr<X509> certificate(X509_new(), X509_free);
  if (!certificate) fail("cannot make a certificate");
  X509* c = certificate.get();
  setSerialAndValidity(c, validDays);
  setSubject(c, identity);
  X509_set_issuer_name(c, X509_get_subject_name(issuer ? issuer : c));
  if (X509_set_pubkey(c, subjectKey) != 1) fail("cannot put the key in a certificate");
  X509* signer = issuer ? issuer : c;
  if (isCa) {
    addExtension(c, signer, NID_basic_constraints, strCat("critical,CA:TRUE,pathlen:", pathLength).c_str());
    // An agent also presents its host's CA as its own TLS certificate.
    addExtension(c, signer, NID_key_usage, "critical,keyCertSign,digitalSignature");
  } else {
    addExtension(c, signer, NID_basic_constraints, "critical,CA:FALSE");
    addExtension(c, signer, NID_key_usage, "critical,digitalSignature");
  }
  addExtension(c, signer, NID_subject_key_identifier, "hash");
  if (issuer) addExtension(c, signer, NID_authority_key_identifier, "keyid:always");
  addIdentity(c, identity);
  if (X509_sign(c, issuerKey, EVP_sha256()) <= 0) fail("cannot sign a certificate");
  return certificate;
}

std::string pemOf(const std::function<int(BIO*)>& write) {
  BIO* bio = BIO_new(BIO_s_mem());
  if (!bio || write(bio) != 1) {
    BIO_free(bio);
    fail("cannot write PEM");
  }
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio, &data);
  std::string text(data, static_cast<size_t>(size));
  BIO_free(bio);
  return text;
}

std::string base64(const std::string& bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

std::optional<std::string> unbase64(const std::string& text) {
  if (text.empty() || text.size() % 4 != 0) return std::nullopt;
  std::string out(3 * text.size() / 4, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  if (n < 0) return std::nullopt;
  // EVP_DecodeBlock counts the padding as zero bytes (and takes '=' anywhere):
  // at most two, at the end only.
  size_t padding = 0;
  for (size_t i = text.size(); i > 0 && text[i - 1] == '='; --i) ++padding;
  const size_t firstPad = text.find('=');
  const bool padAtEnd = firstPad == std::string::npos || firstPad == text.size() - padding;
  if (padding > 2 || !padAtEnd || padding > static_cast<size_t>(n)) return std::nullopt;
  out.resize(static_cast<size_t>(n) - padding);
  return out;
}

bool withinValidity(X509* certificate) {
  return X509_cmp_current_time(X509_get0_notBefore(certificate)) < 0 &&
         X509_cmp_current_time(X509_get0_notAfter(certificate)) > 0;
}

bool isCaCertificate(X509* certificate) { return X509_check_ca(certificate) == 1; }

// Whether `issuer`'s key signed `certificate`.
bool signedBy(X509* certificate, X509* issuer) {
  // A mismatch is an answer, not an error: nothing stays on OpenSSL's error
  // queue for a later SSL call of the same handshake to trip over.
  ERR_set_mark();
  EVP_PKEY* key = X509_get0_pubkey(issuer);
  const bool signedIt = key && X509_verify(certificate, key) == 1;
  ERR_pop_to_mark();
  return signedIt;
}

std::string describe(const PskIdentity& identity) {
  return strCat(identity.role, " of '", proto::boundedText(identity.host, proto::kMaxLoggedPeerTextBytes), "'");
}

}  // namespace

bool isCertificateCredential(const std::string& credential) {
  return credential.rfind(kCertificateCredentialPrefix, 0) == 0;
}


CertificateCredential::CertificateCredential(std::shared_ptr<EVP_PKEY> key, std::vector<Certificate> chain)
    : key_(std::move(key)), chain_(std::move(chain)) {
  auto identity = tls::identityOf(chain_.front().get());
  if (!identity) throw ConfigError("a certificate without a varuna identity");
  identity_ = std::move(*identity);
}

CertificateCredential CertificateCredential::makeRoot(const std::string& name) {
  auto key = newKey();
  // pathlen 1: the root signs hosts' CAs, which sign leaves and nothing more.
  auto certificate = makeCertificate({"root", name, -1, -1, ""}, key.get(), true, 1, nullptr, key.get(), 36500);
  return CertificateCredential(std::move(key), {std::move(certificate)});
}

CertificateCredential CertificateCredential::issue(const PskIdentity& subject, bool subjectIsCa, int validDays) const {
  if (!isCa()) throw ConfigError(strCat("the credential of ", describe(identity_), " cannot issue certificates"));
  auto key = newKey();
  std::vector<Certificate> chain{
      makeCertificate(subject, key.get(), subjectIsCa, 0, certificate(), key_.get(), validDays)};
  chain.insert(chain.end(), chain_.begin(), chain_.end());
  return CertificateCredential(std::move(key), std::move(chain));
}

bool CertificateCredential::isCa() const { return isCaCertificate(certificate()); }

std::vector<X509*> CertificateCredential::issuers() const {
  std::vector<X509*> out;
  for (size_t i = 1; i < chain_.size(); ++i) out.push_back(chain_[i].get());
  return out;
}

std::string CertificateCredential::encode() const {
  const std::string key = keyBytes(key_.get());
  std::string pem = pemOf([&](BIO* bio) {
    return PEM_write_bio(bio, kKeyBlock, "", reinterpret_cast<const unsigned char*>(key.data()),
                         static_cast<long>(key.size())) > 0 ? 1 : 0;
  });
  for (const auto& certificate : chain_) pem += pemOf([&](BIO* bio) { return PEM_write_bio_X509(bio, certificate.get()); });
  return kCertificateCredentialPrefix + base64(pem);
}

CertificateCredential CertificateCredential::parse(const std::string& text, const std::string& what) {
  const auto bad = [&](const std::string& why) {
    return ConfigError(strCat("the ", what, " is not a varuna certificate credential (", why,
                              "): use the one run_varuna issued, whole and on one line"));
  };
  if (!isCertificateCredential(text)) throw bad(strCat("it does not start with ", kCertificateCredentialPrefix));
  const auto pem = unbase64(text.substr(std::strlen(kCertificateCredentialPrefix)));
  if (!pem) throw bad("not base64");
  BIO* bio = BIO_new_mem_buf(pem->data(), static_cast<int>(pem->size()));
  if (!bio) fail("cannot read a credential");
  std::shared_ptr<EVP_PKEY> key;
  char* name = nullptr;
  char* header = nullptr;
  unsigned char* data = nullptr;
  long size = 0;
  if (PEM_read_bio(bio, &name, &header, &data, &size) == 1 && std::strcmp(name, kKeyBlock) == 0) {
    key = keyFromBytes(data, static_cast<size_t>(size));
  }
  if (data) OPENSSL_cleanse(data, static_cast<size_t>(size));
  OPENSSL_free(name);
  OPENSSL_free(header);
  OPENSSL_free(data);
  std::vector<Certificate> chain;
  while (X509* certificate = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) chain.emplace_back(certificate, X509_free);
  BIO_free(bio);
  ERR_clear_error();  // the end of the PEM blocks reads as an error
  if (!key) throw bad("no private key");
  if (chain.empty()) throw bad("no certificate");
  // The key's public point must be the certificate's (compared as bytes:
  // decoding the certificate's key through OpenSSL 3.0's decoders costs a
  // quarter of a millisecond). The signatures are the verifier's business:
  // the manager checks every chain it is shown, and a client checks the
  // manager's certificate against the root.
  if (publicPoint(chain.front().get()) != keyBytes(key.get()).substr(kScalarBytes)) {
    throw bad("the key is not the certificate's");
  }
  try {
    return CertificateCredential(std::move(key), std::move(chain));
  } catch (const ConfigError& e) {
    throw bad(e.what());
  }
}

std::optional<PskIdentity> identityOf(X509* certificate) {
  const int index = X509_get_ext_by_OBJ(certificate, identityObject(), -1);
  if (index < 0) return std::nullopt;
  const ASN1_OCTET_STRING* data = X509_EXTENSION_get_data(X509_get_ext(certificate, index));
  if (!data) return std::nullopt;
  return parseIdentity(std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(data)),
                                   static_cast<size_t>(ASN1_STRING_length(data))));
}

std::optional<CheckedChain> checkPeerChain(X509* root, X509* leaf, stack_st_X509* sent, std::string& why) {
  const auto refuse = [&](std::string reason) -> std::optional<CheckedChain> {
    why = std::move(reason);
    return std::nullopt;
  };
  const auto peer = identityOf(leaf);
  if (!peer) return refuse("a certificate without a varuna identity");
  if (!withinValidity(leaf)) return refuse(strCat("the certificate of ", describe(*peer), " is expired or not yet valid"));
  if (peer->role == "agent") {
    // An agent presents its host's CA itself.
    if (!isCaCertificate(leaf) || !signedBy(leaf, root)) {
      return refuse(strCat("the certificate of ", describe(*peer), " is not signed by this job's CA"));
    }
    return CheckedChain{*peer, *peer};
  }
  if (peer->role != "worker" && peer->role != "notifier") {
    return refuse(strCat("a certificate of role '", proto::boundedText(peer->role, 64), "' may not connect"));
  }
  // The leaf's issuer among what the peer sent: a host's CA the root signed.
  for (int i = 0; sent && i < sk_X509_num(sent); ++i) {
    X509* issuer = sk_X509_value(sent, i);
    if (issuer == leaf || !signedBy(leaf, issuer)) continue;
    const auto hostCa = identityOf(issuer);
    if (!hostCa || hostCa->role != "agent" || !isCaCertificate(issuer) || !signedBy(issuer, root) ||
        !withinValidity(issuer)) {
      return refuse(strCat("the certificate of ", describe(*peer), " is not issued by a host's CA of this job"));
    }
    if (hostCa->host != peer->host) {
      return refuse(strCat("the certificate of ", describe(*peer), " is issued by the CA of another host ('",
                           proto::boundedText(hostCa->host, proto::kMaxLoggedPeerTextBytes), "')"));
    }
    if (isCaCertificate(leaf)) return refuse(strCat("the certificate of ", describe(*peer), " is a CA's"));
    return CheckedChain{*peer, *hostCa};
  }
  return refuse(strCat("the certificate of ", describe(*peer), " came without the CA that issued it, or was not "
                       "issued in this job"));
}

bool checkManagerCertificate(X509* root, X509* certificate, std::string& why) {
  const auto identity = identityOf(certificate);
  if (!identity || identity->role != "manager") {
    why = "the server's certificate is not a varuna manager's";
    return false;
  }
  if (!signedBy(certificate, root)) {
    why = "the server's certificate is not signed by this job's CA: it is not this job's run_varuna";
    return false;
  }
  if (!withinValidity(certificate)) {
    why = "the manager's certificate is expired or not yet valid (check the clocks)";
    return false;
  }
  return true;
}

}  // namespace varuna::tls
