#!/usr/bin/env bash
# The compiled part (shmstore/_native/_atomic.c) checked as CI checks it: built with every common
# warning as an error, then built with AddressSanitizer and UndefinedBehaviorSanitizer and run
# under the shm and queue tests (a copy of the package in a temporary folder, so the in-place
# build is left alone). Needs .venv (scripts/setup.sh) and gcc; exits non-zero on a warning, a
# sanitizer report or a failed test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$PWD/.venv/bin/python
INC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
SUFFIX=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
WORK=$(mktemp -d -t shmstore-native.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
echo "check-native: gcc -Wall -Wextra -Werror" >&2
gcc -O2 -Wall -Wextra -Werror -shared -fPIC -I"$INC" shmstore/_native/_atomic.c -lz \
  -o "$WORK/strict$SUFFIX"
echo "check-native: the shm and queue tests under AddressSanitizer and UBSan" >&2
cp -r shmstore tests pyproject.toml "$WORK/"
find "$WORK/shmstore" -name "_atomic*.so" -delete
gcc -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
  -shared -fPIC -I"$INC" shmstore/_native/_atomic.c -lz -o "$WORK/shmstore/_native/_atomic$SUFFIX"
cd "$WORK"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1  # CPython's own allocations are not ours
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PYTHONPATH="$WORK"
"$PY" -c "import shmstore._native._atomic as a, sys; assert a.__file__.startswith(sys.argv[1]), a.__file__" "$WORK"
"$PY" -m pytest -q -p no:cacheprovider tests/shm tests/queue "$@"
