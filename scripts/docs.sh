#!/usr/bin/env bash
# Build the docs strictly (a broken link, anchor or API reference fails) and serve them on
# http://127.0.0.1:8000 with live reload; `scripts/docs.sh build` only builds (into build/site).
# Creates .venv if needed and installs only what the docs need: shmstore (its API reference is
# read from the code) and its docs extra (mkdocs, mkdocs-material, mkdocstrings).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
venv_install "import shmstore, mkdocs, mkdocstrings, material" '.[docs]' \
  "shmstore with mkdocs, mkdocs-material and mkdocstrings (about 245 MB; about 30 s with a warm pip cache)"
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = "build" ]; then
  exec .venv/bin/mkdocs build --strict
fi
exec .venv/bin/mkdocs serve --strict --dev-addr 127.0.0.1:8000
