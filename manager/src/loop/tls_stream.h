// TlsStream: the ByteStream of a control connection inside TLS 1.3
// (control_tls.h). run_varuna's listener makes the server side (its
// certificate, and the job's CA to check a peer's chain, or keys derived
// from a pre-shared key's identity), the agent the client side (its host's
// CA as its certificate, or its credential as the key). The handshake runs before the first read or
// write; a peer that cannot prove an identity fails it, and the read that
// waited completes with the error, so the connection closes before one byte
// of the control protocol was read. Until then the connection is one that has
// not said hello (the listener's deadline and cap apply).
//
// OpenSSL works on the non-blocking socket itself and Asio only waits for the
// socket to be ready (async_wait), rather than Asio's ssl::stream: that one
// keeps four 17 KiB record buffers per connection (its own two and its BIO
// pair's), about 1 GiB for the 10,000 connections of a large job, where
// OpenSSL with SSL_MODE_RELEASE_BUFFERS keeps none while a connection idles.
// Owned by its connection; used on the socket's io_context thread.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <boost/asio/ssl/context.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "varuna/common/control_tls.h"
#include "varuna/manager/byte_stream.h"

namespace varuna {

// An SSL context configured for the control plane's side (the owner of the
// SSL_CTX every connection of that side shares).
std::unique_ptr<boost::asio::ssl::context> makeControlTlsContext(bool server);

class TlsStream final : public ByteStream {
 public:
  // `context` outlives the stream.
  // `keyFor`: pre-shared keys; `ca` and `acceptHostCa` (optional):
  // certificate chains of the job's CA, with the context presenting the
  // manager's certificate (tls::useServerCertificate).
  static std::unique_ptr<TlsStream> server(boost::asio::ip::tcp::socket socket, boost::asio::ssl::context& context,
                                           tls::KeyForIdentity keyFor,
                                           std::shared_ptr<const tls::CertificateCredential> ca = nullptr,
                                           tls::AcceptHostCa acceptHostCa = nullptr);
  static std::unique_ptr<TlsStream> client(boost::asio::ip::tcp::socket socket, boost::asio::ssl::context& context,
                                           tls::ClientAuth auth);
  ~TlsStream() override;

  // Runs the handshake now (reads and writes would start it anyway); `done`
  // gets its result. For a client that must know before it goes on.
  void asyncHandshake(std::function<void(const boost::system::error_code&)> done);
  void asyncReadSome(char* data, size_t size, Handler handler) override;
  void asyncWrite(const char* data, size_t size, Handler handler) override;
  void close() override;
  const std::string& peer() const override { return peer_; }
  std::optional<tls::PskIdentity> authenticatedIdentity() const override;
  std::string handshakeFailure() const override { return failure_; }

 private:
  using Ready = std::function<void(const boost::system::error_code&)>;
  // One OpenSSL call's outcome: its result (> 0 worked) and the error.
  // `waited`: it runs as a handler of the loop (after a wait), not inside
  // the call that started the operation.
  using Done = std::function<void(int result, const boost::system::error_code& ec, bool waited)>;
  TlsStream(boost::asio::ip::tcp::socket socket, boost::asio::ssl::context& context, bool server);
  // Calls `then` once the handshake is done (with its error if it failed),
  // starting it if nobody has.
  void afterHandshake(Ready then);
  void onHandshake(boost::system::error_code ec);
  // Runs `call` (SSL_read, SSL_write, SSL_do_handshake) now and again each
  // time the socket is ready as OpenSSL asked, until it works or fails.
  // `waited` as Done's.
  void drive(std::function<int()> call, Done done, bool waited);
  // Waits until the socket is ready for `wait`, then drives `call`.
  void waitThen(boost::asio::socket_base::wait_type wait, std::function<int()> call, Done done);
  void writeRest(const char* data, size_t size, size_t written, Handler handler, bool waited);
  // `handler` with (ec, bytes) as a handler of the io_context, never inside
  // the call that started the operation: at once when `waited`, else posted.
  void complete(Handler handler, const boost::system::error_code& ec, size_t bytes, bool waited);

  enum class State { kNotStarted, kRunning, kDone, kFailed };
  boost::asio::ip::tcp::socket socket_;
  struct ssl_st* ssl_ = nullptr;
  bool server_;
  std::string peer_;
  State state_ = State::kNotStarted;
  boost::system::error_code handshakeError_;
  std::string failure_;
  std::vector<Ready> waiting_;
  tls::ClientAuth clientAuth_;
  tls::ServerAuth serverAuth_;
};

}  // namespace varuna
