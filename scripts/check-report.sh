#!/usr/bin/env bash
# Renders a run's report page in headless Chromium and saves a screenshot.
#
#   scripts/check-report.sh RUN_DIR          regenerate RUN_DIR/report, screenshot it
#   scripts/check-report.sh --demo RUN_DIR   first write the tests' synthetic 20-step run into RUN_DIR
#
# Needs Debian's chromium (apt-get install -y chromium). Prints the screenshot's
# path: look at it (and at a few RUN_DIR/report/*.png) before trusting a change.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--demo" ]]; then
    shift
    run_dir="${1:?usage: $0 --demo RUN_DIR}"
    POPULORA_REPORT_DEMO="$run_dir" cargo test --workspace --release --quiet --test engine report::full_run_writes_every_plot_and_the_page >/dev/null
fi
run_dir="$(realpath "${1:?usage: $0 [--demo] RUN_DIR}")"

cargo run --quiet -- report "$run_dir" >/dev/null
index="$run_dir/report/index.html"
shot="$run_dir/report/screenshot.png"
browser="$(command -v chromium || command -v chromium-browser || true)"
[[ -n "$browser" ]] || { echo "chromium not found: apt-get install -y chromium" >&2; exit 1; }
rm -f "$shot"
timeout 120 "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size=1280,2400 --screenshot="$shot" "file://$index" 2>/dev/null
[[ -s "$shot" ]] || { echo "no screenshot written" >&2; exit 1; }
echo "$shot"
