#!/usr/bin/env bash
# Create .venv (if needed) and install shmstore with its torch, test, demo and bench extras, torch pinned to
# the CPU build by constraints.txt. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[torch,test,demo,bench]'
