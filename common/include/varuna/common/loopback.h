// Whether a peer is on this machine: the one check behind every plaintext
// exception of the control plane (control_tls.h). No OpenSSL, no protocol:
// run_varuna's configuration check (and its fuzz target) needs it alone.
#pragma once

#include <sys/socket.h>

#include <string>

namespace varuna::tls {

// Whether `address` is this machine's: 127.0.0.0/8, ::1 or an IPv4-mapped
// 127.x. Plaintext goes to no other peer.
bool isLoopback(const sockaddr& address);
// The same for a numeric address's text ("127.0.0.1", "::1"); a name, even
// one that starts "127.", is not one.
bool isLoopbackAddress(const std::string& text);

}  // namespace varuna::tls
