#!/usr/bin/env bash
# The installed runtime as a user gets it, from outside the source tree:
#   cmake --install of the build into a fresh prefix, then
#   cpp:    this folder's CMakeLists.txt and train_tiny.cpp, copied out of the
#           tree, configured and built as a project of their own with
#           find_package(varuna) against the prefix, and run;
#   python: pip install of python/ (scikit-build-core) into a fresh --target
#           against the prefix, and train_tiny.py run with only that target on
#           PYTHONPATH.
#
#   install_test.sh cpp|python
# Environment (CTest sets it): VARUNA_BUILD_DIR, VARUNA_SOURCE_DIR,
# VARUNA_PYTHON (the Python with the pinned torch), VARUNA_TEST_TMPDIR
# (emptied first; after a pass only the steps' logs stay).
set -euo pipefail

MODE="${1:-}"
if [[ "$MODE" != cpp && "$MODE" != python ]]; then
  echo "usage: install_test.sh cpp|python" >&2
  exit 2
fi
: "${VARUNA_BUILD_DIR:?}" "${VARUNA_SOURCE_DIR:?}" "${VARUNA_PYTHON:?}" "${VARUNA_TEST_TMPDIR:?}"
BUILD="$VARUNA_BUILD_DIR"
SRC="$VARUNA_SOURCE_DIR"
PY="$VARUNA_PYTHON"
TMP="$VARUNA_TEST_TMPDIR"
rm -rf "$TMP"
mkdir -p "$TMP/tmp"
export TMPDIR="$TMP/tmp"  # pip's and scikit-build-core's scratch too
# Only what this test passes: a launcher's variables would change the job.
unset RANK LOCAL_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT PYTHONPATH CMAKE_PREFIX_PATH

fail() {
  echo "FAIL: $*" >&2
  exit 1
}
# Runs a step with its output in $TMP/<name>.log, shown when it fails.
logged() {
  local name="$1"
  shift
  echo "== $name: $*"
  local start=$SECONDS
  if ! "$@" > "$TMP/$name.log" 2>&1; then
    tail -n 150 "$TMP/$name.log" >&2
    fail "$name failed (log: $TMP/$name.log)"
  fi
  echo "   $name: $((SECONDS - start)) s"
}

TORCH_PREFIX="$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
PREFIX="$TMP/prefix"
logged install cmake --install "$BUILD" --prefix "$PREFIX"
for f in lib/cmake/varuna/varunaConfig.cmake lib/cmake/varuna/varunaConfigVersion.cmake \
         lib/cmake/varuna/varunaTargets.cmake lib/libvaruna_worker.a lib/libvaruna_common.a \
         include/varuna/worker/varuna.h include/varuna/common/stage_map.h; do
  [[ -f "$PREFIX/$f" ]] || fail "cmake --install did not install $f"
done
# The package must not lead back to the source or build tree (relocatable
# prefix, and no accidental use of the build's headers).
if grep -rlF -e "$SRC" -e "$BUILD" "$PREFIX/lib/cmake/varuna"; then
  fail "the installed CMake package names the source or build tree (files above)"
fi

if [[ "$MODE" == cpp ]]; then
  APP="$TMP/app"
  mkdir -p "$APP"
  cp "$SRC/tests/install/CMakeLists.txt" "$SRC/tests/install/train_tiny.cpp" "$APP/"
  logged configure cmake -S "$APP" -B "$APP/build" -G Ninja "-DCMAKE_PREFIX_PATH=$PREFIX;$TORCH_PREFIX"
  grep -q "^varuna_DIR:PATH=$PREFIX/lib/cmake/varuna$" "$APP/build/CMakeCache.txt" \
    || fail "find_package(varuna) did not take the install prefix: $(grep '^varuna_DIR' "$APP/build/CMakeCache.txt")"
  logged build cmake --build "$APP/build"
  echo "== run: train_tiny"
  (cd "$TMP" && "$APP/build/train_tiny" "$TMP/checkpoints") || fail "train_tiny failed"
else
  SITE="$TMP/site"
  # Offline and against the environment's own torch and scikit-build-core
  # (--no-build-isolation), as docs/python.md says; torch is not reinstalled
  # into the target (--no-deps).
  logged pip env CMAKE_PREFIX_PATH="$PREFIX" "$PY" -m pip install -v --no-build-isolation --no-deps --no-index \
    --target "$SITE" "$SRC/python"
  ls "$SITE"/varuna/_C*.so > /dev/null 2>&1 || fail "pip did not install the extension into $SITE/varuna"
  [[ -f "$SITE/varuna/runtime.py" ]] || fail "pip did not install the package's .py files into $SITE/varuna"
  echo "== run: train_tiny.py"
  (cd "$TMP" && env PYTHONPATH="$SITE" RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=0 \
    "$PY" "$SRC/tests/install/train_tiny.py" "$SITE") || fail "train_tiny.py failed"
fi
# Passed: only the logs stay.
rm -rf "$PREFIX" "$TMP/app" "$TMP/site" "$TMP/checkpoints" "$TMP/tmp"
echo "install_test $MODE: ok"
