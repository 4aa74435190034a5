// libFuzzer target: the control-protocol decoder must never crash, hang or
// allocate without bound on any byte stream; whatever it accepts must survive
// a re-encode unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "varuna/common/protocol.h"

using namespace varuna::proto;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  FrameDecoder decoder(4096);
  // Feed in two uneven pieces: frame boundaries must not matter.
  decoder.feed(bytes.substr(0, size / 3));
  decoder.feed(bytes.substr(size / 3));
  try {
    while (auto message = decoder.next()) {
      FrameDecoder again;
      again.feed(encode(*message));
      if (!(again.next() == message)) std::abort();  // round trip broke
    }
  } catch (const ProtocolError&) {
    // Refusing bad input is the expected outcome.
  }
  try {
    (void)decodeBody(bytes);
  } catch (const ProtocolError&) {
  }
  return 0;
}
