#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite with CTest.
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT/build"
# Integration tests start up to 4 workers each: two at a time fill 2 cores.
ctest --output-on-failure --timeout 1200 -j 2 "$@"
