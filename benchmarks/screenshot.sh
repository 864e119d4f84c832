#!/usr/bin/env bash
# Screenshot a `memtrace report` in headless Chromium with the network off, and check that the chart was drawn.
#
# usage: benchmarks/screenshot.sh [SNAPSHOT_OR_LOG_DIR] [OUT_DIR]
#   SNAPSHOT_OR_LOG_DIR  default: ../shared/fixtures/snapshots/kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle
#   OUT_DIR              default: build/screenshot (report.html, report.png, dom.html are written there)
# Needs Debian's chromium (apt-get install -y chromium). Exit status 0 when the plot is in the rendered DOM.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
SNAP="${1:-$ROOT/../shared/fixtures/snapshots/kkaitlyn111_memory_files_memory_ctx128_fullstep.pickle}"
OUT="$(mkdir -p "${2:-$ROOT/build/screenshot}" && cd "${2:-$ROOT/build/screenshot}" && pwd)"

CHROME="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
if [ -z "$CHROME" ]; then
  echo "screenshot: chromium not found (apt-get install -y chromium)" >&2
  exit 2
fi

"$PY" -c "from lightning_memtrace.cli import main; raise SystemExit(main())" report "$SNAP" -o "$OUT/report.html"

PROFILE="$(mktemp -d)"
trap 'rm -rf "$PROFILE"' EXIT

# Network off: a fresh network namespace when the kernel allows it, and in any case a proxy that goes nowhere.
NETOFF=()
if unshare -rn true 2>/dev/null; then
  NETOFF=(unshare -rn)
  echo "screenshot: network namespace without interfaces (unshare -rn)"
else
  echo "screenshot: unshare not permitted; relying on --proxy-server to a closed port"
fi
FLAGS=(
  --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update
  --disable-sync --no-first-run --user-data-dir="$PROFILE"
  --proxy-server=127.0.0.1:9 --proxy-bypass-list='<-loopback>'
  --hide-scrollbars --window-size=1400,1700 --virtual-time-budget=10000
)
"${NETOFF[@]}" "$CHROME" "${FLAGS[@]}" --screenshot="$OUT/report.png" "file://$OUT/report.html" 2>"$OUT/chromium.log" || true
"${NETOFF[@]}" "$CHROME" "${FLAGS[@]}" --dump-dom "file://$OUT/report.html" >"$OUT/dom.html" 2>>"$OUT/chromium.log" || true

if [ ! -s "$OUT/report.png" ]; then
  echo "screenshot: no PNG written (see $OUT/chromium.log)" >&2
  exit 1
fi
# plotly draws into <svg class="main-svg">, one <g class="trace scatter"> per series: present only if the JS ran.
TRACES="$(grep -o 'class="trace scatter' "$OUT/dom.html" | wc -l || true)"
if ! grep -q 'class="main-svg"' "$OUT/dom.html" || [ "$TRACES" -lt 2 ]; then
  echo "screenshot: the chart was not drawn (no plotly SVG in the rendered DOM; see $OUT/chromium.log)" >&2
  exit 1
fi
echo "screenshot: chart drawn ($TRACES series) -> $OUT/report.png"
