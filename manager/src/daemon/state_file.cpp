#include "daemon/state_file.h"

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/log.h"
#include "varuna/common/protocol.h"

namespace varuna {

void StateFile::write(const std::function<nlohmann::json()>& build, TimePoint now) {
  try {
    const nlohmann::json state = build();
    ckpt::writeFileAtomic(stateDir_, "state.json",
                          state.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
    lastWrite_ = now;
    if (failing_) log::info("state.json written again");
    failing_ = false;
  } catch (const std::exception& e) {
    failing_ = true;
    uint64_t suppressed = 0;
    if (log_.allow(now, &suppressed)) {
      log::error("cannot write ", stateDir_, "/state.json: ", proto::boundedText(e.what()), "; retrying at every tick",
                 suppressed ? strCat(" (", suppressed, " more failures)") : std::string());
    }
  }
}

}  // namespace varuna
