#!/usr/bin/env bash
# The GPU check, offline, in two commands (README.md, "On a GPU node"):
#
#   scripts/gpu_check.sh pack [--pack-dir DIR]
#       On a machine with Debian's registry (this project's dev machines):
#       downloads the Debian packages a worker-only build needs and a GPU node
#       lacks (headers of spdlog, fmt, nlohmann-json, CLI11, Catch2, Gloo, zlib;
#       never the manager's) into DIR (default .gpu-pack/, ignored by git).
#       Last line: {"pack_dir": ..., "pack_mb": ...}.
#
#   scripts/gpu_check.sh run [--pack-dir DIR] [--out DIR] [--python PY] [--jobs N] [--no-bench]
#       On the GPU node (no registry needed): unpacks the pack under
#       /tmp/varuna-gpu-prefix (never over /), configures a worker-only build
#       (-DVARUNA_BUILD_MANAGER=OFF) in build-gpu/ against the torch of PY
#       (default: the python3 on PATH), builds with every core, runs the GPU
#       tests (label gpu) and the worker's unit tests, then bench/gpu/bench_gpu.py,
#       and writes summary.json and the logs into --out (default $OUT, else
#       build-gpu/out). Without a GPU it builds, says so, and exits 0.
#       Last line: the summary. Exit 1 when a test failed or a step broke.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACK_DIR="$ROOT/.gpu-pack"
PREFIX=/tmp/varuna-gpu-prefix
BUILD_DIR="$ROOT/build-gpu"
# Worker-only build dependencies, with the run-time libraries spdlog links.
PACKAGES=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev catch2 libgloo-dev
          zlib1g-dev)

say() { echo "[gpu_check] $*" >&2; }
die() { say "error: $*"; exit 1; }

pack() {
  command -v apt-get >/dev/null || die "pack needs apt-get (a Debian machine with its registry)"
  mkdir -p "$PACK_DIR"
  rm -f "$PACK_DIR"/*.deb
  say "downloading ${PACKAGES[*]} into $PACK_DIR"
  (cd "$PACK_DIR" && apt-get download -q "${PACKAGES[@]}" >&2) ||
    die "apt-get download failed (run apt-get update first?)"
  local names=()
  for deb in "$PACK_DIR"/*.deb; do names+=("$(dpkg-deb -f "$deb" Package)=$(dpkg-deb -f "$deb" Version)"); done
  printf '%s\n' "${names[@]}" > "$PACK_DIR/MANIFEST"
  local bytes
  bytes=$(du -sb "$PACK_DIR" | cut -f1)
  python3 -c 'import json, sys; print(json.dumps({"pack_dir": sys.argv[1], "pack_mb": round(int(sys.argv[2]) / 2**20, 2)}))' \
    "$PACK_DIR" "$bytes"
}

# dpkg -x of every .deb under $PREFIX; links to libraries the node has under
# another minor version (libz.so -> libz.so.1.2.13) are pointed at the node's.
unpack() {
  ls "$PACK_DIR"/*.deb >/dev/null 2>&1 || die "no pack in $PACK_DIR: run 'scripts/gpu_check.sh pack' first"
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX"
  for deb in "$PACK_DIR"/*.deb; do dpkg-deb -x "$deb" "$PREFIX"; done
  local link target
  while IFS= read -r link; do
    target=$(ldconfig -p | awk -v n="$(basename "$link").1" '$1 == n {print $NF; exit}')
    if [[ -n "$target" ]]; then ln -sf "$target" "$link"; else rm -f "$link"; fi
  done < <(find "$PREFIX" -xtype l -name '*.so')
  say "unpacked $(wc -l < "$PACK_DIR/MANIFEST") packages under $PREFIX"
}

# Summary helpers: JUnit XML of ctest to counts and names.
junit_summary() {
  "$PY" - "$@" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
passed, failed, skipped, failures = 0, 0, 0, []
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        continue
    for case in root.iter("testcase"):
        status = case.get("status", "")
        if case.find("failure") is not None or status == "fail":
            failed += 1
            failures.append(case.get("name"))
        elif case.find("skipped") is not None or status in ("notrun", "disabled"):
            skipped += 1
        else:
            passed += 1
print(json.dumps({"passed": passed, "failed": failed, "skipped": skipped, "failures": failures}))
EOF
}

# The small text files (logs, workers' output, step records; no tensors or
# checkpoints) of the benchmarks' work folder and the tests' scratch folders
# (test-tmp/) into the archive $1.
keep_logs() {
  (cd "$BUILD_DIR" && find gpu-check-work test-tmp -type f -size -2M ! -name '*.pt' ! -name '*.bin' \
    ! -path '*/step_*' -print0 2>/dev/null | tar czf "$1" --null -T -) || say "warning: could not archive the logs"
}

# summary.json ($1) from the tests' counts ($2) and the benchmarks' JSON
# lines ($3: bench_gpu.py's, $4: bench_checkpoint's; null when not run), with
# the caller's device, versions and timings; printed too.
write_summary() {
  "$PY" - "$device" "$torch_version" "$cuda_version" "$build_s" "$((SECONDS - started))" "$2" "$3" "$4" \
    <<'EOF' | tee "$1"
import json, sys
device, torch_version, cuda, build_s, total_s, tests, bench, checkpoint = sys.argv[1:]
summary = {"device": device, "torch": torch_version, "cuda": cuda, "build_s": int(build_s),
           "total_s": int(total_s), "tests": json.loads(tests)}
summary.update({k: v for k, v in (json.loads(bench) or {}).items() if k not in ("device", "torch", "cuda")})
summary["checkpoint"] = json.loads(checkpoint)
print(json.dumps(summary))
EOF
}

run() {
  # $OUT gets 8 files (the device tool brings back 8 at most): summary.json,
  # configure.log, build.log, tests.log, tests.xml, bench.log, checkpoint.log,
  # and logs.tar.gz: every small text file the tests and benchmarks left in
  # $work (the workers' output, step records), for a failure's post-mortem.
  local out="${OUT_DIR:-${OUT:-$BUILD_DIR/out}}" work="$BUILD_DIR/gpu-check-work"
  rm -rf "$work" "$BUILD_DIR/test-tmp"
  mkdir -p "$out" "$work"
  local started=$SECONDS status=0
  PY="${PYTHON:-$(command -v python3)}"
  "$PY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch: give --python a Python with torch"
  local torch_prefix torch_version cuda_version device
  torch_prefix=$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
  cuda_version=$("$PY" -c 'import torch; print(torch.version.cuda or "")')
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
  say "python $PY, torch $torch_version (CUDA ${cuda_version:-none}), device: ${device:-none}"
  [[ -d /usr/share/common-licenses ]] ||
    say "warning: /usr/share/common-licenses (the example's text, from base-files) is missing: the GPU tests will fail"
  unpack

  # The Python extension needs Python's headers; a node without them still
  # checks the C++ side.
  local with_python=ON
  if ! "$PY" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    with_python=OFF
    say "no Python.h for $PY: the Python extension and its tests are left out"
  fi
  say "configuring a worker-only build in $BUILD_DIR"
  # RelWithDebInfo (-O2 -g1), as CI builds; warnings stay warnings with the
  # node's own compiler.
  cmake -G Ninja -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVARUNA_BUILD_MANAGER=OFF -DVARUNA_WERROR=OFF \
    -DVARUNA_BUILD_PYTHON=$with_python -DVARUNA_PYTHON="$PY" -DPython3_EXECUTABLE="$PY" \
    -DCMAKE_PREFIX_PATH="$PREFIX/usr;$torch_prefix" -DCMAKE_INCLUDE_PATH="$PREFIX/usr/include" \
    -DCMAKE_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu" -DTORCH_CUDA_ARCH_LIST="9.0" \
    > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log" >&2; die "configure failed ($out/configure.log)"; }
  local targets=(train_gpt profile_gpt plain_gpt_loop bench_checkpoint gpu_training_test worker_unit_test)
  [[ $with_python == ON ]] && targets+=(varuna_python)
  say "building ${targets[*]} with ${JOBS:-$(nproc)} jobs"
  cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target "${targets[@]}" > "$out/build.log" 2>&1 ||
    { tail -40 "$out/build.log" >&2; die "build failed ($out/build.log)"; }
  local build_s=$((SECONDS - started))
  say "built in ${build_s} s"

  if [[ -z "$device" ]] || ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    say "no GPU here: the build is checked; tests and benchmarks need a GPU node"
    "$PY" -c 'import json, sys; print(json.dumps({"device": None, "torch": sys.argv[1], "build_s": int(sys.argv[2]), "tests": None}))' \
      "$torch_version" "$build_s" | tee "$out/summary.json"
    return 0
  fi

  say "GPU tests"
  local tests_regex='^(gpu_training_test|worker_unit_test|python_gpu_frontend_test)$'
  [[ $with_python == ON ]] || tests_regex='^(gpu_training_test|worker_unit_test)$'
  (cd "$BUILD_DIR" && ctest -R "$tests_regex" \
    --output-on-failure --timeout 400 --output-junit "$out/tests.xml") > "$out/tests.log" 2>&1 || status=1
  tail -15 "$out/tests.log" >&2
  local tests
  tests=$(junit_summary "$out/tests.xml")
  # A first summary now: a run cut short in the benchmarks still leaves one.
  write_summary "$out/summary.json" "$tests" null null >/dev/null

  local bench='null' checkpoint='null'
  if [[ -z "${NO_BENCH:-}" ]]; then
    say "benchmarks: engine overhead, MFU, Python front end, start-up"
    if "$PY" "$ROOT/bench/gpu/bench_gpu.py" --build "$BUILD_DIR" --python "$PY" --out_dir "$work/bench" \
        > "$work/bench.json" 2> "$out/bench.log"; then
      bench=$(tail -1 "$work/bench.json")
    else
      status=1
      tail -20 "$out/bench.log" >&2
      # The rows it finished before failing, if it printed them.
      [[ -s "$work/bench.json" ]] && bench=$(tail -1 "$work/bench.json")
    fi
    say "benchmarks: checkpoints from GPU memory against dd"
    if "$BUILD_DIR/bench/bench_checkpoint" --device cuda "${TMPDIR:-/tmp}/varuna-gpu-ckpt" \
        > "$work/checkpoint.json" 2> "$out/checkpoint.log"; then
      checkpoint=$(tail -1 "$work/checkpoint.json")
    else
      status=1
      tail -20 "$out/checkpoint.log" >&2
    fi
  fi
  keep_logs "$out/logs.tar.gz"
  write_summary "$out/summary.json" "$tests" "$bench" "$checkpoint"
  return $status
}

command="${1:-}"
shift || true
while [[ $# -gt 0 ]]; do
  case "$1" in
    --pack-dir) PACK_DIR="$(realpath -m "$2")"; shift 2 ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --no-bench) NO_BENCH=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$command" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: scripts/gpu_check.sh pack|run [options] (see --help)" >&2; exit 2 ;;
esac
