#!/usr/bin/env bash
# Build the docs strictly (a broken link, anchor or API reference fails) and serve them on
# http://127.0.0.1:8000 with live reload; `scripts/docs.sh build` only builds (into build/site).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import mkdocs, mkdocstrings, material" 2>/dev/null; then
  scripts/setup.sh --no-vllm
fi
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = "build" ]; then
  exec .venv/bin/mkdocs build --strict
fi
exec .venv/bin/mkdocs serve --strict --dev-addr 127.0.0.1:8000
