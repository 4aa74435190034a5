// MachineListWatcher: the machine list file, looked at twice a second. It
// tells an edit (hosts added or removed) from a write of the same text (or a
// `touch`): the operator saying the hosts it lists are there, which gives
// those that are out another chance (docs/run_varuna.md). A list edited into
// something invalid is reported once and ignored until it is fixed.
#pragma once

#include <string>
#include <vector>

#include "varuna/common/machine_list.h"

namespace varuna {

class MachineListWatcher {
 public:
  struct Change {
    bool written = false;  // any write since the last look, even of the same text
    bool edited = false;   // the hosts changed: `machines`, `added` and `removed` say how
    std::vector<Machine> machines;
    std::vector<std::string> added, removed;
  };

  MachineListWatcher(std::string path, int gpusPerNode) : path_(std::move(path)), gpusPerNode_(gpusPerNode) {}

  // The list at start-up. Throws ConfigError (a missing or invalid list).
  std::vector<Machine> read();
  // What changed since the last look.
  Change poll();
  const std::vector<Machine>& machines() const { return machines_; }

 private:
  std::string path_;
  int gpusPerNode_;
  std::vector<Machine> machines_;  // as last read
  std::string text_;
  std::string identity_;  // its inode, size and mtime then: a write of the same text shows there
};

// Which file is at `path` and when it was last written: any write (even of
// the same text, or a `touch`) or a replace (an editor's rename) changes it.
// Empty if there is no file.
std::string fileIdentity(const std::string& path);

}  // namespace varuna
