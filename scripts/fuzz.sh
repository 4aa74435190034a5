#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, with ASan+UBSan) and runs each for a
# bounded time with memory limits: no crash, no hang, no unbounded allocation.
#   scripts/fuzz.sh [seconds per target (default 20)] [work dir (default build/fuzz)]
# VARUNA_FUZZ_OPT (default -O1, libFuzzer's advice for long runs) sets the
# optimisation; fuzz_test in CTest uses -O0, which halves the compile time
# (the larger part of a short run) at the cost of executions per second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_PER_TARGET="${1:-20}"
OUT="${2:-$ROOT/build/fuzz}"
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is missing (scripts/setup.sh installs it)" >&2; exit 1; }
mkdir -p "$OUT"
FLAGS=(-std=c++20 "${VARUNA_FUZZ_OPT:--O1}" -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -I"$ROOT/common/include" -I"$ROOT/manager/include")
declare -A SOURCES=(
  [protocol_fuzz]="$ROOT/common/src/protocol.cpp $ROOT/common/src/protocol_canonical.cpp $ROOT/common/src/secrets.cpp $ROOT/common/src/errors.cpp"
  [machine_list_fuzz]="$ROOT/common/src/machine_list.cpp $ROOT/common/src/errors.cpp"
  [job_config_fuzz]="$ROOT/manager/src/job/job_config.cpp $ROOT/common/src/loopback.cpp $ROOT/common/src/launch_contract.cpp $ROOT/common/src/stage_map.cpp $ROOT/common/src/schedule.cpp $ROOT/common/src/schedule_chunked.cpp $ROOT/common/src/errors.cpp"
)
declare -A CORPUS=([protocol_fuzz]=protocol [machine_list_fuzz]=machine_list [job_config_fuzz]=job_config)
for target in protocol_fuzz machine_list_fuzz job_config_fuzz; do
  echo "[fuzz] building $target"
  # shellcheck disable=SC2086
  clang++ "${FLAGS[@]}" "$ROOT/tests/fuzz/$target.cpp" ${SOURCES[$target]} -o "$OUT/$target"
  corpus="$OUT/corpus-$target"
  mkdir -p "$corpus"
  cp -n "$ROOT/tests/fuzz/corpus/${CORPUS[$target]}"/* "$corpus/" 2>/dev/null || true
  echo "[fuzz] running $target for ${SECONDS_PER_TARGET}s"
  log="$OUT/$target.log"
  if ! "$OUT/$target" "$corpus" -max_total_time="$SECONDS_PER_TARGET" -timeout=5 -rss_limit_mb=1024 \
      -malloc_limit_mb=256 -max_len=8192 -print_final_stats=1 -artifact_prefix="$OUT/$target-" >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "[fuzz] $target FAILED; the input is in $OUT/$target-*" >&2
    exit 1
  fi
  grep -E "^Done|stat::number_of_executed_units" "$log" || true
done
echo "[fuzz] no crash, hang or unbounded allocation"
