#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job on this machine: the example
# character-level GPT trained on English text as 2 pipeline stages x 2
# data-parallel replicas. Extra arguments go to train_gpt (e.g. --steps 200).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/varuna_launch.py" --nstages 2 --replicas 2 \
  --chunk_size 4 --batch_size 16 -- "$ROOT/build/examples/gpt/train_gpt" \
  --steps 150 --log_every 10 --d_model 128 --layers 4 --seq_len 64 "$@"
