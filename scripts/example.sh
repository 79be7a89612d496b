#!/usr/bin/env bash
# Set up on a fresh machine and run the example: one writer, two reader processes, tensors.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --no-vllm
OMP_NUM_THREADS=1 .venv/bin/python examples/tensor_exchange.py "$@"
