#!/usr/bin/env bash
# Set up on a fresh machine and run the demo: a frontend and worker processes sharing
# preprocessed image tensors through a cache. Arguments go to `shmstore demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --no-vllm
OMP_NUM_THREADS=1 exec .venv/bin/python -m shmstore demo "$@"
