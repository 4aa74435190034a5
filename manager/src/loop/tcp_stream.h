// TcpStream: the ByteStream of a connected TCP socket, what FramedConnection
// has always spoken over (run_varuna's peers, the agent's link): Nagle off,
// the socket's own error codes and EOF, a close that shuts both directions
// down first. Owned by its connection; used on the socket's io_context thread.
#pragma once

#include <utility>  // before Asio: its headers miss it with this GCC
#include <boost/asio.hpp>
#include <string>

#include "varuna/manager/byte_stream.h"

namespace varuna {

class TcpStream final : public ByteStream {
 public:
  explicit TcpStream(boost::asio::ip::tcp::socket socket);
  ~TcpStream() override { close(); }

  void asyncReadSome(char* data, size_t size, Handler handler) override {
    socket_.async_read_some(boost::asio::buffer(data, size), std::move(handler));
  }
  void asyncWrite(const char* data, size_t size, Handler handler) override {
    boost::asio::async_write(socket_, boost::asio::buffer(data, size), std::move(handler));
  }
  void close() override;
  const std::string& peer() const override { return peer_; }

 private:
  boost::asio::ip::tcp::socket socket_;
  std::string peer_;
};

}  // namespace varuna
