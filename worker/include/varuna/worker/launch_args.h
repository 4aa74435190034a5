// The arguments a launcher (run_varuna, scripts/varuna_launch.py, torchrun or a
// person) passes to every worker: LaunchArgs and parseLaunchArgs, the launch
// contract's decoding side (varuna/common/launch_contract.h). Read in main();
// nothing else reads the environment.
#pragma once

#include "varuna/common/launch_contract.h"
