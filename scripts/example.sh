#!/usr/bin/env bash
# Run the example on a fresh machine: one writer, two reader processes, arrays in shared memory.
# Creates .venv if needed and installs only what the example needs: shmstore and its core
# dependencies (numpy, msgpack, posix_ipc, blake3). Arguments go to examples/tensor_exchange.py.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
venv_install "import shmstore" . \
  "shmstore with numpy, msgpack, posix_ipc and blake3 (about 100 MB; about 10 s with a warm pip cache)"
OMP_NUM_THREADS=1 exec .venv/bin/python examples/tensor_exchange.py "$@"
