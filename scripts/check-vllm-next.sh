#!/usr/bin/env bash
# The vLLM release served beside the CPU build's (0.33, the CUDA build only, whose compiled ops
# do not load without CUDA): pip's resolver asked whether the `vllm` extra installs beside it;
# its wheel installed without its dependencies into a side folder
# put first on the path of .venv's Python, then the door's checks and the image, record, item
# and request tests run against it. The wheel comes from pip's cache after the first run.
#   scripts/check-vllm-next.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${VLLM_NEXT_VERSION:-0.33.0}
SIDE=.vllm-side/$VERSION
if [ ! -f "$SIDE/.installed" ]; then
  start=$SECONDS
  rm -rf "$SIDE" .vllm-side/wheels
  .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary :all: -d .vllm-side/wheels "vllm==$VERSION"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$SIDE" .vllm-side/wheels/vllm-"$VERSION"-*.whl
  rm -rf .vllm-side/wheels
  touch "$SIDE/.installed"
  echo "vLLM $VERSION's wheel put in $SIDE in $((SECONDS - start)) s" >&2
fi
# the vllm extra beside this release: pip's resolver, a dry run (metadata only, nothing installed)
REPORT=$(mktemp -t vllm-next-resolve.XXXXXX.json)
LOG=$(mktemp -t vllm-next-resolve.XXXXXX.log)  # pip's notes, shown only if it fails
if ! .venv/bin/python -m pip install --dry-run --ignore-installed --quiet \
    --disable-pip-version-check --report "$REPORT" ".[vllm]" "vllm==$VERSION" >"$LOG" 2>&1; then
  cat "$LOG" >&2
  rm -f "$REPORT" "$LOG"
  echo "check-vllm-next: shmstore[vllm] does not install beside vllm==$VERSION" >&2
  exit 1
fi
rm -f "$LOG"
.venv/bin/python - "$REPORT" "$VERSION" <<'PY'
import json, sys
found = {i["metadata"]["name"].lower(): i["metadata"]["version"]
         for i in json.load(open(sys.argv[1]))["install"]}
assert found.get("vllm") == sys.argv[2] and "shmstore" in found, found
print(f"the vllm extra resolves beside vllm {sys.argv[2]} (torch {found.get('torch')}, "
      f"{len(found)} packages)", file=sys.stderr)
PY
rm -f "$REPORT"
export PYTHONPATH=$SIDE SHMSTORE_TEST_VLLM_VERSION=$VERSION
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 -m "not serving and not slow" \
  tests/vllm/test_vllm_door.py tests/vllm/test_vllm_images.py tests/vllm/test_vllm_records.py \
  tests/vllm/test_vllm_plugin.py tests/vllm/test_vllm_requests.py "$@"
