#include "sim_peer.h"

#include "loop/tls_stream.h"

namespace varuna::sim {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

void SimPeer::connect(const tcp::endpoint& endpoint, const proto::Hello& hello, OnMessage onMessage, OnClose onClose,
                      std::function<void()> onConnected) {
  onMessage_ = std::move(onMessage);
  onClose_ = std::move(onClose);
  auto done = [self = shared_from_this(), hello, onConnected = std::move(onConnected)](
                  const boost::system::error_code& ec) { self->onConnect(ec, hello, onConnected); };
  if (!network_) {
    socket_.async_connect(endpoint, std::move(done));
    return;
  }
  const std::string rank = hello.rank >= 0 ? " rank " + std::to_string(hello.rank) : "";
  stream_ = network_->dial(hello.role + " " + hello.host + rank);
  // Completed as a handler, as a connect is: the caller's state is set up first.
  const boost::system::error_code ec = stream_ ? boost::system::error_code() : asio::error::connection_refused;
  asio::post(io_, [done = std::move(done), ec] { done(ec); });
}

void SimPeer::onConnect(const boost::system::error_code& ec, const proto::Hello& hello,
                        const std::function<void()>& onConnected) {
  if (closed_) return;  // closed by the simulation meanwhile
  if (ec) {
    fail("connect: " + ec.message());
    return;
  }
  if (!stream_ && !tls::plaintextRequested()) {
    // One client context for every simulated peer of the process.
    static const auto context = makeControlTlsContext(false);
    stream_ = TlsStream::client(std::move(socket_), *context,
                                tls::clientCredential(hello));
  } else if (!stream_) {
    boost::system::error_code ignored;
    socket_.set_option(tcp::no_delay(true), ignored);
    socket_.non_blocking(true, ignored);
  }
  open_ = true;
  send(proto::encode(tls::wireHello(hello)));
  doRead();
  if (onConnected) onConnected();
}

bool SimPeer::send(std::string_view frame) {
  if (!open_ || paused_ || closing_) return false;
  ++framesSent_;
  if (stream_) {
    outbox_.append(frame);
    if (inFlight_.empty()) writeToStream();
    return true;
  }
  if (!outbox_.empty()) {
    outbox_.append(frame);
    return true;
  }
  boost::system::error_code ec;
  size_t n = socket_.write_some(asio::buffer(frame.data(), frame.size()), ec);
  if (ec == asio::error::would_block || ec == asio::error::try_again) {
    n = 0;
  } else if (ec) {
    fail("write: " + ec.message());
    return false;
  }
  if (n < frame.size()) {
    outbox_.append(frame.substr(n));
    waitWritable();
  }
  return true;
}

void SimPeer::close() {
  closed_ = true;
  onClose_ = nullptr;
  onMessage_ = nullptr;
  shutdown();
}

void SimPeer::closeAfterSending() {
  onClose_ = nullptr;
  onMessage_ = nullptr;
  if ((outbox_.empty() && inFlight_.empty()) || !open_) return close();
  closing_ = true;
}

void SimPeer::pause() { paused_ = true; }

void SimPeer::resume() {
  if (!paused_) return;
  paused_ = false;
  if (!open_) return;
  deliver();
  if (!open_ || paused_) return;
  if (!closedWhilePaused_.empty()) return fail(closedWhilePaused_);
  if (!outbox_.empty()) flush();
  if (!reading_) doRead();
}

void SimPeer::doRead() {
  reading_ = true;
  auto done = [self = shared_from_this()](const boost::system::error_code& ec, size_t bytes) {
    self->reading_ = false;
    self->onRead(ec, bytes);
  };
  if (stream_) {
    stream_->asyncReadSome(readBuffer_.data(), readBuffer_.size(), std::move(done));
  } else {
    socket_.async_read_some(asio::buffer(readBuffer_), std::move(done));
  }
}

void SimPeer::onRead(const boost::system::error_code& ec, size_t bytes) {
  if (!open_) return;
  if (ec) {
    const std::string reason = ec == asio::error::eof ? "closed by the manager" : ec.message();
    if (paused_) {
      closedWhilePaused_ = reason;  // a frozen process learns of it when it runs again
      return;
    }
    fail(reason);
    return;
  }
  decoder_.feed(std::string_view(readBuffer_.data(), bytes));
  // Kept; no further read: the kernel's buffer (the stream's capacity) fills
  // as for a stopped process.
  if (paused_) return;
  deliver();
  if (open_ && !paused_) doRead();
}

void SimPeer::deliver() {
  try {
    while (open_ && !paused_) {
      auto message = decoder_.next();
      if (!message) break;
      if (onMessage_) onMessage_(*message);
    }
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void SimPeer::flush() {
  if (!stream_) return waitWritable();
  if (inFlight_.empty()) writeToStream();
}

void SimPeer::writeToStream() {
  inFlight_ = std::move(outbox_);
  outbox_.clear();
  stream_->asyncWrite(inFlight_.data(), inFlight_.size(), [self = shared_from_this()](
                                                              const boost::system::error_code& ec, size_t) {
    self->inFlight_.clear();
    if (!self->open_) return;
    if (ec) {
      self->fail("write: " + ec.message());
      return;
    }
    if (self->paused_) return;  // resume() goes on
    if (!self->outbox_.empty()) return self->writeToStream();
    if (self->closing_) self->close();
  });
}

void SimPeer::waitWritable() {
  socket_.async_wait(tcp::socket::wait_write, [self = shared_from_this()](const boost::system::error_code& ec) {
    if (!self->open_ || self->paused_ || self->outbox_.empty()) return;  // resume() re-arms
    if (ec) {
      self->fail("write: " + ec.message());
      return;
    }
    boost::system::error_code writeError;
    const size_t n = self->socket_.write_some(asio::buffer(self->outbox_), writeError);
    if (writeError && writeError != asio::error::would_block && writeError != asio::error::try_again) {
      self->fail("write: " + writeError.message());
      return;
    }
    self->outbox_.erase(0, writeError ? 0 : n);
    if (!self->outbox_.empty()) return self->waitWritable();
    if (self->closing_) self->close();
  });
}

void SimPeer::fail(const std::string& reason) {
  shutdown();
  if (onClose_) {
    auto callback = std::move(onClose_);
    onClose_ = nullptr;
    onMessage_ = nullptr;
    callback(reason);
  }
}

void SimPeer::shutdown() {
  open_ = false;
  outbox_.clear();
  if (stream_) stream_->close();  // the manager reads what was written, then EOF
  boost::system::error_code ignored;
  socket_.close(ignored);
}

}  // namespace varuna::sim
