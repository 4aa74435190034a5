#!/usr/bin/env bash
# Sets up everything on a fresh Debian 12 machine (as root) and builds:
#   1. Debian packages the build and the tests need,
#   2. a project-local Python virtual environment (.venv) with the pinned torch
#      wheel, whose libtorch the C++ code links against,
#   3. configure + build in build/ (Ninja, RelWithDebInfo with -g1), and put the varuna
#      Python package built there on .venv's path.
# Idempotent: each step is skipped when already done, so a second run only
# re-runs the (incremental) build.
#
#   scripts/setup.sh [--build-dir DIR] [--no-build]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="$ROOT/build"
DO_BUILD=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --no-build) DO_BUILD=0; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "[setup] $*"; }

# -- 1. Debian packages ------------------------------------------------------
PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  python3 python3-venv
  libboost-dev libssh-dev nlohmann-json3-dev libcli11-dev catch2 libspdlog-dev
  libssl-dev            # OpenSSL libcrypto: HMAC-SHA256 for the credentials per role
  libgloo-dev           # Gloo's headers: libtorch has Gloo inside but ships no headers
  prometheus-cpp-dev    # run_varuna --metrics_port (prometheus-cpp 1.0: metrics and its civetweb exposer)
  prometheus            # the metrics e2e test scrapes run_varuna with a real Prometheus (its own instance)
  clang libclang-rt-14-dev   # libFuzzer targets (scripts/fuzz.sh)
  openssh-server openssh-client iproute2 procps
  slurmctld slurmd slurm-client munge   # tests/e2e/slurm_test.py: a real Slurm cluster in network namespaces
  base-files            # /usr/share/common-licenses: the example's English text
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup.sh: missing Debian packages: ${missing[*]}; run as root or install them first" >&2
    exit 1
  fi
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  say "Debian packages present"
fi

# -- 2. Python virtual environment with the pinned torch -----------------------
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
fi
STAMP="$VENV/.requirements.sha256"
WANT="$(sha256sum "$ROOT/scripts/requirements.txt" | cut -d' ' -f1)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
  say "installing the pinned Python packages (torch is large: a few minutes the first time)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -r "$ROOT/scripts/requirements.txt"
  echo "$WANT" > "$STAMP"
else
  say "Python environment up to date ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
fi
# The build backend of `pip install --no-build-isolation ./python` (python/pyproject.toml); a no-op when present.
"$PY" -m pip install -q "scikit-build-core>=0.10,<2"

# -- 3. Configure and build ----------------------------------------------------
if [[ $DO_BUILD -eq 1 ]]; then
  TORCH_PREFIX="$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
    say "configuring $BUILD_DIR"
    cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$PY" > "$BUILD_DIR.configure.log" 2>&1 \
      || { cat "$BUILD_DIR.configure.log"; exit 1; }
  fi
  say "building (2 cores: the first build takes a few minutes)"
  cmake --build "$BUILD_DIR" -j "$(nproc)"
  # The varuna Python package (the extension and its .py files in
  # $BUILD_DIR/python) on the project environment's path: `import varuna`
  # works in .venv/bin/python. Other environments: docs/python.md.
  if [[ -d "$BUILD_DIR/python/varuna" ]]; then
    SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$BUILD_DIR/python" > "$SITE/varuna-build.pth"
    say "varuna Python package: $BUILD_DIR/python/varuna (on $VENV's path)"
  fi
fi
say "done"
