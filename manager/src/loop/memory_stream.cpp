// memoryStreamPair (varuna/manager/byte_stream.h): two ByteStream ends sharing
// one Channel. Everything runs on the io_context's thread; every completion
// is posted, never called inline, so a caller's state is consistent when its
// handler runs (as with a socket).
#include <algorithm>
#include <cstring>
#include <optional>

#include <boost/asio/error.hpp>
#include <boost/asio/post.hpp>

#include "varuna/manager/byte_stream.h"

namespace varuna {
namespace {

namespace asio = boost::asio;
using boost::system::error_code;

// The state both ends share: per direction (by the writer's side, 0 or 1)
// its unread bytes, the reader's pending read and the writer's pending write.
struct Channel : std::enable_shared_from_this<Channel> {
  struct PendingRead {
    char* data;
    size_t size;
    ByteStream::Handler handler;
  };
  struct PendingWrite {
    const char* data;
    size_t size;
    size_t taken;  // bytes already in the peer's inbox
    ByteStream::Handler handler;
  };

  Channel(asio::io_context& io, size_t capacity) : io(io), capacity(capacity) {}

  asio::io_context& io;
  const size_t capacity;
  std::string unread[2];   // written by side i, not yet read by side 1 - i
  bool closed[2] = {false, false};
  std::optional<PendingRead> reads[2];    // of side i
  std::optional<PendingWrite> writes[2];  // of side i

  void complete(ByteStream::Handler handler, error_code ec, size_t bytes) {
    asio::post(io, [self = shared_from_this(), handler = std::move(handler), ec, bytes] { handler(ec, bytes); });
  }

  // Moves what it can from side `w`'s pending write into its unread bytes and
  // from there into side 1 - w's pending read, until neither can move more.
  void pump(int w) {
    const int r = 1 - w;
    for (bool moved = true; moved;) {
      moved = false;
      if (auto& write = writes[w]; write && !closed[r]) {
        const size_t n = std::min(write->size - write->taken, capacity - std::min(capacity, unread[w].size()));
        if (n > 0) {
          unread[w].append(write->data + write->taken, n);
          write->taken += n;
          moved = true;
        }
        if (write->taken == write->size) {
          complete(std::move(write->handler), {}, write->size);
          write.reset();
        }
      }
      if (auto& read = reads[r]; read && !unread[w].empty()) {
        const size_t n = std::min(read->size, unread[w].size());
        std::memcpy(read->data, unread[w].data(), n);
        unread[w].erase(0, n);
        complete(std::move(read->handler), {}, n);
        read.reset();
        moved = true;
      }
    }
    // Every byte the closed writer sent has been read: the reader's EOF.
    if (auto& read = reads[r]; read && closed[w] && unread[w].empty()) {
      complete(std::move(read->handler), asio::error::eof, 0);
      read.reset();
    }
  }
};

class MemoryStream final : public ByteStream {
 public:
  MemoryStream(std::shared_ptr<Channel> channel, int side, std::string peer)
      : channel_(std::move(channel)), side_(side), peer_(std::move(peer)) {}
  ~MemoryStream() override { close(); }

  void asyncReadSome(char* data, size_t size, Handler handler) override {
    Channel& c = *channel_;
    if (c.closed[side_]) return c.complete(std::move(handler), asio::error::operation_aborted, 0);
    c.reads[side_] = Channel::PendingRead{data, size, std::move(handler)};
    c.pump(1 - side_);
  }

  void asyncWrite(const char* data, size_t size, Handler handler) override {
    Channel& c = *channel_;
    if (c.closed[side_]) return c.complete(std::move(handler), asio::error::operation_aborted, 0);
    // As a socket whose peer is gone: the write fails (EPIPE).
    if (c.closed[1 - side_]) return c.complete(std::move(handler), asio::error::broken_pipe, 0);
    c.writes[side_] = Channel::PendingWrite{data, size, 0, std::move(handler)};
    c.pump(side_);
  }

  void close() override {
    Channel& c = *channel_;
    if (c.closed[side_]) return;
    c.closed[side_] = true;
    const int other = 1 - side_;
    if (auto& read = c.reads[side_]) c.complete(std::move(read->handler), asio::error::operation_aborted, 0);
    if (auto& write = c.writes[side_]) c.complete(std::move(write->handler), asio::error::operation_aborted, 0);
    c.reads[side_].reset();
    c.writes[side_].reset();
    // Nobody reads this end any more: what the other end wrote, or is
    // writing, is lost, as with a closed socket (its write fails).
    c.unread[other].clear();
    if (auto& write = c.writes[other]) {
      c.complete(std::move(write->handler), asio::error::connection_reset, write->taken);
      write.reset();
    }
    c.pump(side_);  // the other end's read: what is left, then EOF
  }

  const std::string& peer() const override { return peer_; }

 private:
  std::shared_ptr<Channel> channel_;
  int side_;
  std::string peer_;
};

}  // namespace

MemoryStreamPair memoryStreamPair(asio::io_context& io, const std::string& nameA, const std::string& nameB,
                                  size_t capacity) {
  auto channel = std::make_shared<Channel>(io, std::max<size_t>(capacity, 1));
  return {std::make_unique<MemoryStream>(channel, 0, nameB), std::make_unique<MemoryStream>(channel, 1, nameA)};
}

}  // namespace varuna
