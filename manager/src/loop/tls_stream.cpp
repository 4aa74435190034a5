#include "loop/tls_stream.h"

#include <openssl/ssl.h>

namespace varuna {

namespace asio = boost::asio;

std::unique_ptr<asio::ssl::context> makeControlTlsContext(bool server) {
  auto context = std::make_unique<asio::ssl::context>(server ? asio::ssl::context::tls_server
                                                             : asio::ssl::context::tls_client);
  tls::configureContext(context->native_handle(), server);
  // Idle connections (thousands of workers between reports) give their
  // record buffers back to the allocator.
  SSL_CTX_set_mode(context->native_handle(), SSL_MODE_RELEASE_BUFFERS);
  return context;
}

TlsStream::TlsStream(asio::ip::tcp::socket socket, asio::ssl::context& context, bool server)
    : stream_(std::move(socket), context), server_(server) {
  boost::system::error_code ec;
  const auto endpoint = stream_.lowest_layer().remote_endpoint(ec);
  peer_ = ec ? "?" : endpoint.address().to_string() + ":" + std::to_string(endpoint.port());
  stream_.lowest_layer().set_option(asio::ip::tcp::no_delay(true), ec);
}

std::unique_ptr<TlsStream> TlsStream::server(asio::ip::tcp::socket socket, asio::ssl::context& context,
                                             tls::KeyForIdentity keyFor) {
  std::unique_ptr<TlsStream> stream(new TlsStream(std::move(socket), context, true));
  stream->serverPsk_.keyFor = std::move(keyFor);
  tls::attachServer(stream->stream_.native_handle(), &stream->serverPsk_);
  return stream;
}

std::unique_ptr<TlsStream> TlsStream::client(asio::ip::tcp::socket socket, asio::ssl::context& context,
                                             tls::ClientPsk psk) {
  std::unique_ptr<TlsStream> stream(new TlsStream(std::move(socket), context, false));
  stream->clientPsk_ = std::move(psk);
  tls::attachClient(stream->stream_.native_handle(), &stream->clientPsk_);
  return stream;
}

void TlsStream::asyncHandshake(std::function<void(const boost::system::error_code&)> done) {
  afterHandshake(std::move(done));
}

void TlsStream::afterHandshake(Ready then) {
  switch (state_) {
    case State::kDone:
      then({});
      return;
    case State::kFailed:
      asio::post(stream_.get_executor(), [then = std::move(then), ec = handshakeError_] { then(ec); });
      return;
    case State::kRunning:
      waiting_.push_back(std::move(then));
      return;
    case State::kNotStarted:
      state_ = State::kRunning;
      waiting_.push_back(std::move(then));
      stream_.async_handshake(server_ ? asio::ssl::stream_base::server : asio::ssl::stream_base::client,
                              [this](const boost::system::error_code& ec) { onHandshake(ec); });
      return;
  }
}

void TlsStream::onHandshake(const boost::system::error_code& ec) {
  state_ = ec ? State::kFailed : State::kDone;
  handshakeError_ = ec;
  if (ec) {
    failure_ = serverPsk_.refusal.empty() ? ec.message() : serverPsk_.refusal;
    serverPsk_.presented.reset();  // what it presented, it did not prove
  }
  auto waiting = std::move(waiting_);
  waiting_.clear();
  for (auto& then : waiting) then(ec);
}

void TlsStream::asyncReadSome(char* data, size_t size, Handler handler) {
  afterHandshake([this, data, size, handler = std::move(handler)](const boost::system::error_code& ec) mutable {
    if (ec) return handler(ec, 0);
    stream_.async_read_some(asio::buffer(data, size), std::move(handler));
  });
}

void TlsStream::asyncWrite(const char* data, size_t size, Handler handler) {
  afterHandshake([this, data, size, handler = std::move(handler)](const boost::system::error_code& ec) mutable {
    if (ec) return handler(ec, 0);
    asio::async_write(stream_, asio::buffer(data, size), std::move(handler));
  });
}

std::optional<tls::PskIdentity> TlsStream::authenticatedIdentity() const {
  return state_ == State::kDone && server_ ? serverPsk_.presented : std::nullopt;
}

void TlsStream::close() {
  auto& socket = stream_.lowest_layer();
  if (!socket.is_open()) return;
  // No close_notify: the connection is done either way, and a peer that
  // stopped reading must not hold this close up.
  boost::system::error_code ignored;
  socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  socket.close(ignored);
}

}  // namespace varuna
