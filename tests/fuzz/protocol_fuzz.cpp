// libFuzzer target: the control-protocol decoder must never crash, hang or
// allocate without bound on any byte stream; whatever it accepts must survive
// a re-encode unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
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
      // Compared as encoded text: a relayed report's null figure decodes to
      // NaN, which never equals itself as a double.
      const std::string frame = encode(*message);
      FrameDecoder again;
      again.feed(frame);
      const auto back = again.next();
      if (!back || encode(*back) != frame) std::abort();  // round trip broke
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
