#include "loop/tcp_stream.h"

namespace varuna {

namespace asio = boost::asio;

TcpStream::TcpStream(asio::ip::tcp::socket socket) : socket_(std::move(socket)) {
  boost::system::error_code ec;
  const auto endpoint = socket_.remote_endpoint(ec);
  peer_ = ec ? "?" : endpoint.address().to_string() + ":" + std::to_string(endpoint.port());
  socket_.set_option(asio::ip::tcp::no_delay(true), ec);
}

void TcpStream::close() {
  if (!socket_.is_open()) return;
  boost::system::error_code ignored;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
}

}  // namespace varuna
