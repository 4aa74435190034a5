#include "loop/tls_stream.h"

#include <openssl/err.h>
#include <openssl/ssl.h>

#include <cerrno>

namespace varuna {

namespace asio = boost::asio;

std::unique_ptr<asio::ssl::context> makeControlTlsContext(bool server) {
  auto context = std::make_unique<asio::ssl::context>(server ? asio::ssl::context::tls_server
                                                             : asio::ssl::context::tls_client);
  tls::configureContext(context->native_handle(), server);
  return context;
}

TlsStream::TlsStream(asio::ip::tcp::socket socket, asio::ssl::context& context, bool server)
    : socket_(std::move(socket)), ssl_(SSL_new(context.native_handle())), server_(server) {
  boost::system::error_code ec;
  const auto endpoint = socket_.remote_endpoint(ec);
  peer_ = ec ? "?" : endpoint.address().to_string() + ":" + std::to_string(endpoint.port());
  socket_.set_option(asio::ip::tcp::no_delay(true), ec);
  socket_.non_blocking(true, ec);
  if (ssl_ && !tls::attachSocket(ssl_, socket_.native_handle())) {
    SSL_free(ssl_);
    ssl_ = nullptr;
  }
  if (!ssl_) {
    // Out of memory in OpenSSL: the first operation fails, the connection closes.
    state_ = State::kFailed;
    handshakeError_ = make_error_code(boost::system::errc::not_enough_memory);
    failure_ = "cannot set up TLS: " + tls::lastError();
    return;
  }
  server ? SSL_set_accept_state(ssl_) : SSL_set_connect_state(ssl_);
  // One recv() takes whatever the socket holds rather than a record's 5-byte
  // header and then its body: a read that finds a message costs one system
  // call, not two. What it takes beyond the record waits inside OpenSSL
  // (SSL_has_pending), which asyncReadSome looks at before it waits.
  SSL_set_read_ahead(ssl_, 1);
}

TlsStream::~TlsStream() {
  close();
  if (ssl_) SSL_free(ssl_);
}

std::unique_ptr<TlsStream> TlsStream::server(asio::ip::tcp::socket socket, asio::ssl::context& context,
                                             tls::KeyForIdentity keyFor,
                                             std::shared_ptr<const tls::CertificateCredential> ca,
                                             tls::AcceptHostCa acceptHostCa) {
  std::unique_ptr<TlsStream> stream(new TlsStream(std::move(socket), context, true));
  stream->serverAuth_.keyFor = std::move(keyFor);
  stream->serverAuth_.ca = std::move(ca);
  stream->serverAuth_.acceptHostCa = std::move(acceptHostCa);
  if (stream->ssl_) tls::attachServer(stream->ssl_, &stream->serverAuth_);
  return stream;
}

std::unique_ptr<TlsStream> TlsStream::client(asio::ip::tcp::socket socket, asio::ssl::context& context,
                                             tls::ClientAuth auth) {
  std::unique_ptr<TlsStream> stream(new TlsStream(std::move(socket), context, false));
  stream->clientAuth_ = std::move(auth);
  if (stream->ssl_) tls::attachClient(stream->ssl_, &stream->clientAuth_);
  return stream;
}

void TlsStream::drive(std::function<int()> call, Done done, bool waited) {
  if (!socket_.is_open()) return done(-1, asio::error::operation_aborted, waited);
  ERR_clear_error();
  errno = 0;  // what SSL_ERROR_SYSCALL reports is this call's
  const int result = call();
  if (result > 0) return done(result, {}, waited);
  const int error = SSL_get_error(ssl_, result);
  if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) {
    waitThen(error == SSL_ERROR_WANT_READ ? asio::socket_base::wait_read : asio::socket_base::wait_write,
             std::move(call), std::move(done));
    return;
  }
  if (error == SSL_ERROR_ZERO_RETURN) return done(-1, asio::error::eof, waited);
  if (error == SSL_ERROR_SYSCALL && errno != 0) {
    return done(-1, boost::system::error_code(errno, boost::system::system_category()), waited);
  }
  if (error == SSL_ERROR_SYSCALL) return done(-1, asio::error::eof, waited);
  // What the other end refused in TLS; only a handshake's failure is why
  // the connection was not let in (handshakeFailure()).
  const std::string detail = tls::lastError();
  if (state_ == State::kRunning && failure_.empty()) failure_ = detail;
  done(-1, make_error_code(boost::system::errc::protocol_error), waited);
}

void TlsStream::waitThen(asio::socket_base::wait_type wait, std::function<int()> call, Done done) {
  socket_.async_wait(wait, [this, call = std::move(call), done = std::move(done)](
                               const boost::system::error_code& ec) mutable {
    if (ec) return done(-1, ec, true);
    drive(std::move(call), std::move(done), true);
  });
}

void TlsStream::complete(Handler handler, const boost::system::error_code& ec, size_t bytes, bool waited) {
  if (waited) return handler(ec, bytes);  // already a handler of the loop: no second trip through it
  asio::post(socket_.get_executor(), [handler = std::move(handler), ec, bytes] { handler(ec, bytes); });
}

void TlsStream::asyncHandshake(std::function<void(const boost::system::error_code&)> done) {
  afterHandshake([this, done = std::move(done)](const boost::system::error_code& ec) {
    asio::post(socket_.get_executor(), [done, ec] { done(ec); });  // never inline
  });
}

void TlsStream::afterHandshake(Ready then) {
  switch (state_) {
    case State::kDone:
      then({});
      return;
    case State::kFailed:
      asio::post(socket_.get_executor(), [then = std::move(then), ec = handshakeError_] { then(ec); });
      return;
    case State::kRunning:
      waiting_.push_back(std::move(then));
      return;
    case State::kNotStarted:
      state_ = State::kRunning;
      waiting_.push_back(std::move(then));
      // Through the loop: a handshake that completes at once still reports as a handler.
      asio::post(socket_.get_executor(), [this] {
        drive([this] { return SSL_do_handshake(ssl_); },
              [this](int, const boost::system::error_code& ec, bool) { onHandshake(ec); }, false);
      });
      return;
  }
}

void TlsStream::onHandshake(boost::system::error_code ec) {
  if (!ec && !server_ && !tls::provedKey(ssl_)) {
    // TLS 1.3 lets a server answer with a certificate instead of the key
    // (the client refuses every certificate then; this is the belt to those
    // braces), or with neither where the client holds a certificate.
    failure_ = clientAuth_.certificate ? "the manager did not prove it is this job's manager"
                                      : "the manager answered with a certificate, not the job's key";
    ec = make_error_code(boost::system::errc::protocol_error);
  }
  state_ = ec ? State::kFailed : State::kDone;
  handshakeError_ = ec;
  if (ec) {
    if (!serverAuth_.refusal.empty()) failure_ = serverAuth_.refusal;
    if (!clientAuth_.refusal.empty()) failure_ = clientAuth_.refusal;
    if (failure_.empty()) failure_ = ec.message();
    serverAuth_.presented.reset();  // what it presented, it did not prove
  }
  auto waiting = std::move(waiting_);
  waiting_.clear();
  for (auto& then : waiting) then(ec);
}

void TlsStream::asyncReadSome(char* data, size_t size, Handler handler) {
  afterHandshake([this, data, size, handler = std::move(handler)](const boost::system::error_code& ec) mutable {
    if (ec) return complete(std::move(handler), ec, 0, false);
    auto read = [this, data, size] { return SSL_read(ssl_, data, static_cast<int>(size)); };
    auto done = [this, handler = std::move(handler)](int result, const boost::system::error_code& readError,
                                                     bool waited) mutable {
      complete(std::move(handler), readError, readError ? 0 : static_cast<size_t>(result), waited);
    };
    // Nothing inside OpenSSL: the next byte can only come from the socket,
    // so wait for it rather than try a read that finds nothing (a system
    // call, and a record buffer taken and given back, per message).
    if (SSL_has_pending(ssl_) == 0 && socket_.is_open()) {
      return waitThen(asio::socket_base::wait_read, std::move(read), std::move(done));
    }
    drive(std::move(read), std::move(done), false);
  });
}

void TlsStream::asyncWrite(const char* data, size_t size, Handler handler) {
  afterHandshake([this, data, size, handler = std::move(handler)](const boost::system::error_code& ec) mutable {
    if (ec) return complete(std::move(handler), ec, 0, false);
    writeRest(data, size, 0, std::move(handler), false);
  });
}

void TlsStream::writeRest(const char* data, size_t size, size_t written, Handler handler, bool waited) {
  if (written == size) return complete(std::move(handler), {}, size, waited);
  drive([this, data, size, written] { return SSL_write(ssl_, data + written, static_cast<int>(size - written)); },
        [this, data, size, written, handler = std::move(handler)](int result, const boost::system::error_code& ec,
                                                                  bool waitedNow) mutable {
          if (ec) return complete(std::move(handler), ec, written, waitedNow);
          writeRest(data, size, written + static_cast<size_t>(result), std::move(handler), waitedNow);
        },
        waited);
}

std::optional<tls::PskIdentity> TlsStream::authenticatedIdentity() const {
  return state_ == State::kDone && server_ ? serverAuth_.presented : std::nullopt;
}

void TlsStream::close() {
  if (!socket_.is_open()) return;
  // No close_notify: the connection is done either way, and a peer that
  // stopped reading must not hold this close up.
  boost::system::error_code ignored;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
}

}  // namespace varuna
