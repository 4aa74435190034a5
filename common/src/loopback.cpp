#include "varuna/common/loopback.h"

#include <arpa/inet.h>
#include <netinet/in.h>

namespace varuna::tls {

bool isLoopback(const sockaddr& address) {
  if (address.sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in&>(address).sin_addr.s_addr) >> 24) == 127;
  }
  if (address.sa_family != AF_INET6) return false;
  const in6_addr& v6 = reinterpret_cast<const sockaddr_in6&>(address).sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
}

bool isLoopbackAddress(const std::string& text) {
  sockaddr_in v4{};
  v4.sin_family = AF_INET;
  if (::inet_pton(AF_INET, text.c_str(), &v4.sin_addr) == 1) {
    return isLoopback(reinterpret_cast<const sockaddr&>(v4));
  }
  sockaddr_in6 v6{};
  v6.sin6_family = AF_INET6;
  return ::inet_pton(AF_INET6, text.c_str(), &v6.sin6_addr) == 1 && isLoopback(reinterpret_cast<const sockaddr&>(v6));
}

}  // namespace varuna::tls
