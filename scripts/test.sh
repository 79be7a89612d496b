#!/usr/bin/env bash
# Set up on a fresh machine and run the whole test suite, the linter, the type checker, the
# compiled part's strict build and sanitizer run, and the strict docs build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m ruff check shmstore tests bench examples fuzz
.venv/bin/python -m mypy
scripts/check-native.sh -m "not slow"  # the C part: -Wall -Wextra -Werror, ASan and UBSan
scripts/docs.sh build
# the engine-neutral core, with vLLM unimportable (as where it is not installed)
SHMSTORE_TEST_WITHOUT_VLLM=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/serving
scripts/check-vllm-next.sh  # vLLM 0.33 (CUDA build only): the door and the item tests against it
.venv/bin/python -m pytest --durations=25 "$@"  # the 25 slowest tests, listed at the end
