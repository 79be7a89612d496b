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
# the tests that start no server, on two processes (most wait on processes they start); then
# those that start vLLM, a server or a relay (each server wants the machine) and those that
# look at all of /dev/shm (marked alone), one at a time.
# A selection (arguments) that leaves one of the two runs empty is not a failure (status 5).
pytest_run() {
  local status=0
  .venv/bin/python -m pytest "$@" || status=$?
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
}
pytest_run -n 2 -m "not serving and not alone" --durations=15 "$@"
pytest_run -m "serving or alone" --durations=10 "$@"
