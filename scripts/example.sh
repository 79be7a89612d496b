#!/usr/bin/env bash
# Run the example on a fresh machine: one writer, two reader processes, arrays in shared memory.
# Creates .venv if needed and installs only what the example needs: shmstore and its core
# dependencies (numpy, msgpack, posix_ipc, blake3). Arguments go to examples/tensor_exchange.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import shmstore" 2>/dev/null; then
  echo "installing shmstore with numpy, msgpack, posix_ipc and blake3 into .venv" \
       "(about 100 MB; about 10 s with a warm pip cache) ..." >&2
  start=$SECONDS
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e .
  echo "installed in $((SECONDS - start)) s" >&2
fi
OMP_NUM_THREADS=1 exec .venv/bin/python examples/tensor_exchange.py "$@"
