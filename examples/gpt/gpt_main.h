// main() of the example programs (train_gpt, profile_gpt): both run as a
// worker under a launcher and end the same way after an expected failure.
#pragma once

#include <exception>

#include "varuna/worker/varuna.h"

namespace gpt {

// Returns run(argc, argv); an exception that escapes it ends the process as a
// worker must end (varuna::exitAfterFailure: logged, the exit code its kind
// means, no destructors that could wait on peers already gone).
inline int runMain(int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    varuna::exitAfterFailure(e);
  }
}

}  // namespace gpt
