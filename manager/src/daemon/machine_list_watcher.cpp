#include "daemon/machine_list_watcher.h"

#include <sys/stat.h>

#include <set>

#include "varuna/common/checkpoint_files.h"
#include "varuna/common/errors.h"
#include "varuna/common/log.h"

namespace varuna {

std::string fileIdentity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  return strCat(st.st_dev, ":", st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
}

std::vector<Machine> MachineListWatcher::read() {
  identity_ = fileIdentity(path_);  // first: a write after the read shows as one
  text_ = ckpt::readFile(path_);
  machines_ = parseMachineList(text_, path_, gpusPerNode_);
  return machines_;
}

MachineListWatcher::Change MachineListWatcher::poll() {
  Change change;
  const std::string identity = fileIdentity(path_);  // before the read: a later write shows next time
  std::string text;
  try {
    text = ckpt::readFile(path_);
  } catch (const std::exception&) {
    return change;  // mid-replace by an editor: look again next time
  }
  change.written = identity != identity_;
  identity_ = identity;
  if (text == text_) return change;
  std::vector<Machine> machines;
  try {
    machines = parseMachineList(text, path_, gpusPerNode_);
  } catch (const ConfigError& e) {
    log::error("ignoring the edited machine list until it is fixed: ", e.what());
    text_ = text;  // report once per version
    change.written = false;
    return change;
  }
  text_ = text;
  std::set<std::string> before, after;
  for (const auto& m : machines_) before.insert(m.host);
  for (const auto& m : machines) after.insert(m.host);
  for (const auto& h : after) {
    if (!before.count(h)) change.added.push_back(h);
  }
  for (const auto& h : before) {
    if (!after.count(h)) change.removed.push_back(h);
  }
  machines_ = machines;
  change.machines = std::move(machines);
  change.edited = true;
  return change;
}

}  // namespace varuna
