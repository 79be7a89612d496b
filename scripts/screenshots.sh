#!/usr/bin/env bash
# Build the docs site and take a screenshot of every page at 1280 px wide, with Debian's
# Chromium (apt-get install chromium), into build/screenshots/. Look at them after a change
# to the docs' layout: wide tables and code must be readable without a wider window.
# HEIGHT=9000 takes more of each page (the default is 2400 px).
set -euo pipefail
cd "$(dirname "$0")/.."
CHROMIUM=${CHROMIUM:-chromium}
command -v "$CHROMIUM" >/dev/null || { echo "needs Chromium: apt-get install chromium" >&2; exit 2; }
scripts/docs.sh build >/dev/null 2>&1
mkdir -p build/screenshots
PORT=$(.venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
.venv/bin/python -m http.server "$PORT" --bind 127.0.0.1 --directory build/site >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER' EXIT
sleep 1
PROFILE=$(mktemp -d)
for page in $(cd build/site && find . -name index.html ! -path "./search/*" | sort); do
  dir=$(dirname "$page" | sed 's|^\./||; s|^\.$|home|; s|/|-|g')
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$PROFILE" --hide-scrollbars --window-size=1280,${HEIGHT:-2400} \
    --screenshot="build/screenshots/$dir.png" "http://127.0.0.1:$PORT/${page#./}" >/dev/null 2>&1
  echo "build/screenshots/$dir.png"
done
rm -rf "$PROFILE"
