#include "loop/framed_connection.h"

#include "varuna/common/log.h"
#include "loop/handler_guard.h"
#include "loop/tcp_stream.h"

namespace varuna {

namespace asio = boost::asio;

FramedConnection::FramedConnection(asio::ip::tcp::socket socket)
    : FramedConnection(std::make_unique<TcpStream>(std::move(socket))) {}

FramedConnection::FramedConnection(std::unique_ptr<ByteStream> stream) : stream_(std::move(stream)) {}

void FramedConnection::start(OnMessage onMessage, OnClose onClose) {
  if (dispatching_) replacedOnMessage_ = std::move(onMessage_);  // it is running: destroy it after
  onMessage_ = std::move(onMessage);
  onClose_ = std::move(onClose);
  doRead();
}

void FramedConnection::doRead() {
  if (reading_ || !open_ || closeWhenDrained_) return;
  reading_ = true;
  stream_->asyncReadSome(readBuffer_.data(), readBuffer_.size(),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t bytes) {
                           self->reading_ = false;
                           self->onRead(ec, bytes);
                         });
}

bool FramedConnection::checkFirstFrame(const char* data, size_t bytes) {
  if (firstFrameLimit_ == 0 || firstHeaderBytes_ >= 4) return true;
  for (size_t i = 0; i < bytes && firstHeaderBytes_ < 4; ++i, ++firstHeaderBytes_) {
    firstHeader_ = (firstHeader_ << 8) | static_cast<unsigned char>(data[i]);
  }
  if (firstHeaderBytes_ < 4 || firstHeader_ <= firstFrameLimit_) return true;
  close(strCat("a first frame of ", firstHeader_, " bytes (at most ", firstFrameLimit_, " before the hello)"));
  return false;
}

void FramedConnection::onRead(const boost::system::error_code& ec, size_t bytes) {
  if (!open_) return;
  if (ec) {
    close(ec == asio::error::eof ? "closed by peer" : ec.message());
    return;
  }
  if (closeWhenDrained_) return;  // closing: what the peer sends now is not read
  if (!checkFirstFrame(readBuffer_.data(), bytes)) return;
  // The bytes are in decoder_ before any callback runs: a read that start()
  // issues from a callback may reuse readBuffer_ at once.
  dispatching_ = true;
  try {
    decoder_.feed(std::string_view(readBuffer_.data(), bytes));
    while (open_ && !closeWhenDrained_) {
      auto message = decoder_.next();  // throws ProtocolError on a bad frame
      if (!message) break;
      deliver(*message);
    }
  } catch (const std::exception& e) {
    close(e.what());
  }
  dispatching_ = false;
  replacedOnMessage_ = nullptr;
  if (open_) {
    doRead();  // a no-op if a callback's start() already did, or once closing
  } else {
    onMessage_ = nullptr;  // not inside it any more: drop what it captured
  }
}

void FramedConnection::deliver(const proto::Message& message) {
  if (!guard_) {
    onMessage_(message);  // an exception closes the connection (onRead)
    return;
  }
  try {
    onMessage_(message);
    return;
  } catch (const std::exception& e) {
    guard_->report(strCat("handling a message from ", peer()), e.what());
  } catch (...) {
    guard_->report(strCat("handling a message from ", peer()), "an exception that is not a std::exception");
  }
  close("its message handler failed");
}

void FramedConnection::send(const proto::Message& message) {
  if (!open_ || closeWhenDrained_) return;
  sendEncoded(proto::encode(message));
}

void FramedConnection::sendEncoded(std::string frame) {
  if (!open_ || closeWhenDrained_) return;
  if (queuedBytes_ + frame.size() > maxQueuedBytes_) {
    close(strCat("the peer does not read: ", queuedBytes_, " bytes wait to be sent (at most ", maxQueuedBytes_, ")"));
    return;
  }
  queuedBytes_ += frame.size();
  writeQueue_.push_back(std::move(frame));
  if (writeQueue_.size() == 1) doWrite();
}

void FramedConnection::doWrite() {
  const std::string& frame = writeQueue_.front();  // a deque's front: stays put until popped
  stream_->asyncWrite(frame.data(), frame.size(),
                      [self = shared_from_this()](const boost::system::error_code& ec, size_t) { self->onWrite(ec); });
}

void FramedConnection::onWrite(const boost::system::error_code& ec) {
  if (!open_) return;
  if (ec) {
    close(ec.message());
    return;
  }
  queuedBytes_ -= writeQueue_.front().size();
  writeQueue_.pop_front();
  if (!writeQueue_.empty()) {
    doWrite();
  } else if (closeWhenDrained_) {
    close(pendingCloseReason_);
  }
}

void FramedConnection::closeAfterSending(const std::string& reason) {
  if (!open_) return;
  if (writeQueue_.empty()) {
    close(reason);
    return;
  }
  closeWhenDrained_ = true;
  pendingCloseReason_ = reason;
}

void FramedConnection::close(const std::string& reason) {
  if (!open_) return;
  open_ = false;
  writeQueue_.clear();  // a stream never touches a closed end's write buffer again
  queuedBytes_ = 0;
  stream_->close();
  if (!onClose_) return;
  auto callback = std::move(onClose_);
  onClose_ = nullptr;
  // A decoder's message may quote the peer's bytes (a JSON parser's "last
  // read" token, an unknown type name): bounded, valid UTF-8.
  const std::string bounded = proto::boundedText(reason);
  if (guard_) {
    guard_->run("closing a connection", [&] { callback(bounded); });
    return;
  }
  try {
    callback(bounded);
  } catch (const std::exception& e) {
    log::error("closing the connection to ", peer(), " failed: ", proto::boundedText(e.what()));
  }
}

}  // namespace varuna
