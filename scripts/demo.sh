#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job on this machine under
# run_varuna: the example character-level GPT as 2 pipeline stages x 2
# data-parallel replicas on two local "hosts" (127.0.0.1 and 127.0.0.2, agents
# started without SSH). Midway, a preemption notice for 127.0.0.2 arrives (what
# a cloud poller would send); the manager checkpoints, morphs the job to 2 x 1
# on the remaining host and it finishes; the job's timeline is drawn into
# $WORK/timeline.png (its path printed last). Extra arguments go to train_gpt.
# VARUNA_DEMO_FRONTEND=python runs the same job with the Python front end
# (examples/python/train_gpt.py, the same model, data and options).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"

BIN="$ROOT/build/bin"
WORK="${VARUNA_DEMO_DIR:-$ROOT/build/demo}"
PREEMPT_AT_STEP="${VARUNA_DEMO_PREEMPT_AT:-120}"
rm -rf "$WORK" && mkdir -p "$WORK"
printf '# the demo'"'"'s two local hosts\n127.0.0.1 slots=2\n127.0.0.2 slots=2\n' > "$WORK/machines.txt"

echo "=== run_varuna: 2 stages x 2 replicas on $(grep -vc '^#' "$WORK/machines.txt") local hosts (work folder $WORK) ==="
case "${VARUNA_DEMO_FRONTEND:-cpp}" in
  cpp) CODE_DIR="$ROOT/build/examples/gpt"; PROGRAM=(./train_gpt) ;;
  python) CODE_DIR="$ROOT/examples/python"; PROGRAM=("$ROOT/.venv/bin/python" train_gpt.py) ;;
  *) echo "VARUNA_DEMO_FRONTEND must be cpp or python" >&2; exit 2 ;;
esac
"$BIN/run_varuna" --job demo --machine_list "$WORK/machines.txt" --nstages 2 --batch_size 16 --chunk_size 4 \
  --global_store "$WORK/checkpoints" --state_dir "$WORK/state" --code_dir "$CODE_DIR" \
  -- "${PROGRAM[@]}" --steps 300 --d_model 128 --layers 4 --seq_len 64 --checkpoint_every 100 "$@" &
MANAGER=$!
trap 'kill -TERM "$MANAGER" 2>/dev/null || true; wait "$MANAGER" || true' INT TERM

# Wait (with a deadline) until the job has trained PREEMPT_AT_STEP steps.
python3 - "$WORK/state/state.json" "$PREEMPT_AT_STEP" "$MANAGER" <<'PY'
import json, os, sys, time
path, target, manager = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        if json.load(open(path))["progress"]["step"] >= target:
            sys.exit(0)
    except (OSError, ValueError, KeyError):
        pass
    try:
        os.kill(manager, 0)
    except OSError:
        sys.exit("run_varuna exited before step %d" % target)
    time.sleep(0.2)
sys.exit("the job did not reach step %d within 10 minutes" % target)
PY

echo "=== demo: preemption notice for 127.0.0.2 (as scripts/pollers/* would send it) ==="
"$BIN/notify_manager_preempt" --connection_file "/tmp/varuna/demo/127.0.0.2/connection.json" --in_seconds 30

code=0
wait "$MANAGER" || code=$?
echo "=== run_varuna status ==="
"$BIN/run_varuna" status --state_dir "$WORK/state"
# The job's timeline (docs/run_varuna.md, "The timeline"): loss, samples/s and
# steps over time, each generation's plan, every event. Prints its path.
echo "=== the job's timeline (scripts/varuna_report.py) ==="
"$ROOT/.venv/bin/python" "$ROOT/scripts/varuna_report.py" --state_dir "$WORK/state" --out "$WORK/timeline.png" \
  || code=$((code == 0 ? 1 : code))
exit "$code"
