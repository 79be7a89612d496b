#!/usr/bin/env bash
# Set up on a fresh machine and run the whole test suite, the linter and the type checker.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m ruff check shmstore tests bench examples fuzz
.venv/bin/python -m mypy
.venv/bin/python -m pytest "$@"
