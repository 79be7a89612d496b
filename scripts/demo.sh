#!/usr/bin/env bash
# Run the demo on a fresh machine: a frontend and 2 workers sharing preprocessed image tensors
# through a cache. Creates .venv if needed and installs only what the demo needs: shmstore and
# its demo extra (numpy, msgpack, posix_ipc, blake3, Pillow, tqdm). Arguments go to
# `shmstore demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import shmstore, PIL, tqdm" 2>/dev/null; then
  echo "installing shmstore with numpy, msgpack, posix_ipc, blake3, Pillow and tqdm into .venv" \
       "(about 125 MB; under 30 s with a warm pip cache) ..." >&2
  start=$SECONDS
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[demo]'
  echo "installed in $((SECONDS - start)) s" >&2
fi
OMP_NUM_THREADS=1 exec .venv/bin/python -m shmstore demo "$@"
