#!/usr/bin/env bash
# Run the demo on a fresh machine: a frontend and 2 workers sharing preprocessed image tensors
# through a cache. Creates .venv if needed and installs only what the demo needs: shmstore and
# its demo extra (numpy, msgpack, posix_ipc, blake3, Pillow, tqdm). Arguments go to
# `shmstore demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
venv_install "import shmstore, PIL, tqdm" '.[demo]' \
  "shmstore with numpy, msgpack, posix_ipc, blake3, Pillow and tqdm (about 125 MB; under 30 s with a warm pip cache)"
OMP_NUM_THREADS=1 exec .venv/bin/python -m shmstore demo "$@"
