#!/bin/sh
# Every benchmark in BENCHMARKS.md's table, each with --json, into one folder:
#   scripts/bench-all.sh [DIR]        (default DIR: bench-<UTC date and time>)
# One JSON file per command, the A/B pairs of the process-wide settings
# alternated, and machine.txt (CPU, memory, the build, the load before each
# command). Run it in a quiet window: the figures are only as good as the
# machine is idle. Build first: cargo build --release --features peer (bench
# generate's peers are only in a build with that feature).
# POPULORA=path picks the binary; NICE="nice -n -10" (as root) gives the
# benchmarks the CPU first on a shared machine; SKIP_FULL_SVD=1 leaves out
# bench evolve's full-SVD path (about 10 minutes on 2 cores).
set -eu
dir=${1:-bench-$(date -u +%Y%m%d-%H%M)}
bin=${POPULORA:-target/release/populora}
nice=${NICE:-}
mkdir -p "$dir"
{
    date -u
    grep -m1 'model name' /proc/cpuinfo
    echo "cores: $(nproc)"
    grep MemTotal /proc/meminfo
    uname -r
    git rev-parse --short HEAD 2>/dev/null || true
} > "$dir/machine.txt"

# run NAME [VAR=VALUE ...] ARGS...: `populora ARGS --json` into DIR/NAME.json.
run() {
    name=$1
    shift
    echo "$name: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$dir/machine.txt" >&2
    # shellcheck disable=SC2086 # $nice is a command prefix, split on purpose
    $nice env "$@" --json > "$dir/$name.json"
}

# The A/B pairs switch a setting off through the environment; `X=1` stands
# for "nothing switched off".
run generate X=1 "$bin" bench generate
run broker X=1 "$bin" bench broker
run broker-no-mallopt POPULORA_NO_MALLOPT=1 "$bin" bench broker
if [ "${SKIP_FULL_SVD:-0}" = 1 ]; then
    run evolve X=1 "$bin" bench evolve --skip-full-svd
else
    run evolve X=1 "$bin" bench evolve
fi
run verifier X=1 "$bin" bench verifier
for i in 1 2 3 4; do
    run "verifier-sandbox-$i" X=1 "$bin" bench verifier --sandbox-only --programs 4000
    run "verifier-sandbox-no-pool-fill-$i" POPULORA_NO_POOL_FILL=1 "$bin" bench verifier --sandbox-only --programs 4000
done
echo "done: $dir" >&2
