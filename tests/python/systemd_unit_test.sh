#!/usr/bin/env bash
# The systemd units in config/ pass `systemd-analyze verify`, keep the
# properties deployment relies on, and the example job files parse.
#
#     tests/python/systemd_unit_test.sh [source dir]
#
# Exit 0 pass, 1 fail, 77 skipped (no systemd-analyze). verify needs a unit's
# binaries to exist, so ExecStart's program is replaced by /bin/true in a temp
# copy; template units are verified through an instance (varuna-manager@demo).
# In a container without systemd as PID 1, verify may print warnings about
# other units: only lines naming our units count.
set -u

SRC="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
CONFIG="$SRC/config"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# --- example configs (need only python3) ------------------------------------------
if ! python3 -m json.tool "$CONFIG/examples/gpt-2x2.json" >/dev/null; then
  fail "config/examples/gpt-2x2.json is not valid JSON"
fi
# Every key must be one run_varuna knows (its table in manager/src/job/job_config.cpp).
python3 - "$CONFIG/examples/gpt-2x2.json" "$SRC/manager/src/job/job_config.cpp" <<'EOF' || fail "gpt-2x2.json keys or types"
import json, os, re, sys
config = json.load(open(sys.argv[1]))
assert isinstance(config.get("program"), list) and all(isinstance(a, str) for a in config["program"]), "program"
for key in ("machine_list", "nstages", "chunk_size", "batch_size", "global_store", "code_dir"):
    assert key in config, f"missing {key}"
if os.path.exists(sys.argv[2]):
    known = set(re.findall(r'\{"([a-z_]+)", &JobConfig::', open(sys.argv[2]).read()))
    if known:
        unknown = sorted(set(config) - known)
        assert not unknown, f"keys run_varuna does not know: {unknown}"
EOF
while IFS= read -r line; do
  line="${line%%#*}"
  [[ -z "${line// /}" ]] && continue
  [[ "$line" =~ ^[[:space:]]*[A-Za-z0-9.:_-]+([[:space:]]+slots=[1-9][0-9]*)?[[:space:]]*$ ]] ||
    fail "config/examples/machines.txt: bad line '$line'"
done <"$CONFIG/examples/machines.txt"
while IFS= read -r line; do
  [[ -z "${line// /}" || "$line" =~ ^[[:space:]]*# ]] && continue
  [[ "$line" =~ ^(export[[:space:]]+)?[A-Za-z_][A-Za-z0-9_]*= ]] || fail "config/examples/env_file: bad line '$line'"
done <"$CONFIG/examples/env_file"

# --- properties deployment relies on ---------------------------------------------
manager="$CONFIG/varuna-manager@.service"
poller="$CONFIG/varuna-preempt-poller@.service"
for want in "ExecStart=/usr/local/bin/run_varuna --config /etc/varuna/%i.json --state_dir /var/lib/varuna/%i" \
  "Restart=on-failure" "RestartPreventExitStatus=2" "KillMode=mixed" "TimeoutStopSec=180" \
  "WantedBy=multi-user.target"; do
  grep -qxF "$want" "$manager" || fail "varuna-manager@.service lacks '$want'"
done
grep -q "^StateDirectory=varuna" "$manager" || fail "varuna-manager@.service lacks StateDirectory=varuna..."
# Connections (agents, workers, connections before their hello) each hold a descriptor.
grep -Eq "^LimitNOFILE=[0-9]{4,}$" "$manager" || fail "varuna-manager@.service lacks LimitNOFILE= (at least 1000)"
grep -q "^ExecStart=/usr/local/lib/varuna/pollers/%i" "$poller" || fail "poller unit ExecStart"
grep -qx "AmbientCapabilities=CAP_DAC_READ_SEARCH" "$poller" || fail "the poller lacks its one capability"
for unit in "$manager" "$poller"; do
  # Least privilege: a dedicated user, never root; 69 (port in use) is retried.
  grep -qx "User=varuna" "$unit" || fail "$(basename "$unit") does not run as User=varuna"
  grep -Eq "^User=(root|0)?$" "$unit" && fail "$(basename "$unit") runs as root"
  grep -Eq "^RestartPreventExitStatus=.*\b69\b" "$unit" && fail "$(basename "$unit") does not retry exit code 69"
  # SSH and the control connections need the host's network; the poller needs the real /tmp.
  grep -Eq "^(PrivateNetwork|PrivateTmp)=(yes|true|1)" "$unit" && fail "$(basename "$unit") sets PrivateNetwork/PrivateTmp"
  grep -q "^After=.*network-online.target" "$unit" || fail "$(basename "$unit") not after network-online.target"
done

# --- systemd-analyze verify --------------------------------------------------------
if ! command -v systemd-analyze >/dev/null 2>&1; then
  if ((failures)); then echo "systemd_unit_test: $failures failure(s)"; exit 1; fi
  echo "skipped: systemd-analyze not found (the example configs were checked)"
  exit 77
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
sed 's#^ExecStart=/usr/local/bin/run_varuna #ExecStart=/bin/true #' "$manager" >"$tmp/varuna-manager@.service"
sed 's#^ExecStart=/usr/local/lib/varuna/pollers/%i #ExecStart=/bin/true #' "$poller" >"$tmp/varuna-preempt-poller@.service"
grep -q "^ExecStart=/bin/true " "$tmp/varuna-manager@.service" || fail "manager ExecStart not substituted"
grep -q "^ExecStart=/bin/true " "$tmp/varuna-preempt-poller@.service" || fail "poller ExecStart not substituted"

for instance in varuna-manager@demo.service varuna-preempt-poller@aws.service; do
  # The trailing ':' keeps the default search path (network-online.target, multi-user.target).
  output="$(SYSTEMD_UNIT_PATH="$tmp:" SYSTEMD_LOG_COLOR=0 systemd-analyze verify --man=no "$instance" 2>&1)"
  rc=$?
  if grep -q "unrecognized option" <<<"$output"; then  # systemd older than 235: no --man
    output="$(SYSTEMD_UNIT_PATH="$tmp:" SYSTEMD_LOG_COLOR=0 systemd-analyze verify "$instance" 2>&1)"
    rc=$?
  fi
  ours="$(grep -E "varuna-manager@|varuna-preempt-poller@" <<<"$output")"
  if [[ -n "$ours" ]]; then
    fail "systemd-analyze verify $instance:"
    echo "$ours"
  elif ((rc != 0)); then
    echo "note: systemd-analyze verify $instance exited $rc with warnings about other units only:"
    echo "$output"
  else
    echo "ok: systemd-analyze verify $instance"
  fi
done

if ((failures)); then
  echo "systemd_unit_test: $failures failure(s)"
  exit 1
fi
echo "systemd_unit_test: passed"
