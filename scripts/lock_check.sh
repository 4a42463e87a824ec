#!/usr/bin/env bash
# Prove requirements.lock on a fresh machine's terms: `scripts/setup.sh` into a new throwaway venv with pip's cache
# off (everything downloaded), timed; then the imports the pipelines need and tests/test_lock.py in that venv.
# The project venv and backend dir are untouched. Usage: scripts/lock_check.sh [scratch-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=${1:-$(mktemp -d)}
rm -rf "$scratch/venv" "$scratch/backends"; rmdir "$scratch" 2>/dev/null || true
export VENV="$scratch/venv" TRITONKIT_BACKEND_DIR="$scratch/backends" PIP_NO_CACHE_DIR=1

start=$(date +%s.%N)
scripts/setup.sh
first=$(echo "$(date +%s.%N) - $start" | bc)
start=$(date +%s.%N)
scripts/setup.sh >/dev/null
again=$(echo "$(date +%s.%N) - $start" | bc)

"$VENV/bin/python" -c "import torch, onnxruntime, tritonclient.grpc, tritonclient.http, sentence_transformers"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_lock.py
printf '[lock_check] %s, %s cores, %s: setup into a new venv %.1f s, second run %.1f s\n' \
  "$(date -u +%F)" "$(nproc)" "$(uname -m)" "$first" "$again"
rm -rf "$scratch/venv" "$scratch/backends"; rmdir "$scratch" 2>/dev/null || true
