#!/usr/bin/env bash
# Set up on a fresh machine and run the whole test suite, the linter, the type checker, the
# compiled part's strict build and sanitizer run, and the strict docs build.
#   scripts/test.sh [PYTEST ARGS...]   (the arguments select tests in each pytest run)
# Each step says how long it took. Steps that leave a core idle run beside each other: the
# tests that start vLLM, a server or a relay (one at a time: each server wants the machine, and
# spends much of its start waiting) from the moment the environment is set up, beside every
# other step: the linters, the sanitizer run (one process), the docs build, vLLM 0.33's checks,
# then the tests that start no server (two processes). The tests that look at all of /dev/shm
# (marked alone) run last, by themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
LOGS=$(mktemp -d -t shmstore-test.XXXXXX)
BESIDE=()  # pids of steps running in the background
stop_beside() {
  for pid in "${BESIDE[@]}"; do  # SIGINT to the step's commands (a background subshell
    # ignores it): pytest tears its fixtures, and the servers they started, down
    [ -n "$pid" ] || continue
    pkill -INT -P "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  rm -rf "$LOGS"
}
trap stop_beside EXIT

step() {  # step NAME COMMAND...: run it, say how long it took; a failure stops the run
  local name=$1 start=$SECONDS
  shift
  "$@"
  echo "test.sh: $name took $((SECONDS - start)) s" >&2
}

beside() {  # beside NAME COMMAND...: start it in the background, its output kept in a log
  local name=$1
  shift
  ( start=$SECONDS; status=0; "$@" || status=$?
    echo "test.sh: $name took $((SECONDS - start)) s (status $status)" >>"$LOGS/$name.log"
    exit "$status" ) >"$LOGS/$name.log" 2>&1 &
  BESIDE+=("$!")
  eval "PID_$name=$!"
}

joined() {  # joined NAME [OK_STATUS...]: wait for a background step, print its log, fail on it
  local name=$1 pid status=0
  shift
  pid=$(eval "echo \$PID_$name")
  wait "$pid" || status=$?
  BESIDE=("${BESIDE[@]/$pid}")
  cat "$LOGS/$name.log"
  if [ "$status" -ne 0 ] && [[ " $* " != *" $status "* ]]; then
    echo "test.sh: $name failed (status $status)" >&2
    exit "$status"
  fi
}

pytest_run() {  # a selection (arguments) that leaves a run empty is not a failure (status 5)
  local status=0
  .venv/bin/python -m pytest "$@" || status=$?
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then return "$status"; fi
}

step setup scripts/setup.sh
# every session until the last runs beside another: each counts only its own segments as leaks;
# the last (the alone tests, by itself) counts every dead writer's segment made since now
export SHMSTORE_TEST_BESIDE=1 SHMSTORE_TEST_SINCE_NS
SHMSTORE_TEST_SINCE_NS=$(date +%s%N)
beside serving pytest_run -m "serving and not alone" --durations=10 "$@"
step ruff .venv/bin/python -m ruff check shmstore tests bench examples fuzz
step mypy .venv/bin/python -m mypy
# the C part: -Wall -Wextra -Werror, ASan and UBSan
beside native scripts/check-native.sh -m "not slow"
step docs scripts/docs.sh build
# the engine-neutral core, with vLLM unimportable (as where it is not installed)
step core_without_vllm env SHMSTORE_TEST_WITHOUT_VLLM=1 \
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/serving
# vLLM 0.33 (CUDA build only): the door and the item tests against it
step vllm_next scripts/check-vllm-next.sh
joined native
step no_server pytest_run -n 2 -m "not serving and not alone" --durations=15 "$@"
joined serving
export SHMSTORE_TEST_BESIDE=0  # by itself now
step alone pytest_run -m alone --durations=10 "$@"
