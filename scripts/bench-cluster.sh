#!/usr/bin/env bash
# Messaging overhead of worker nodes: the same scenario with every member in
# the `run` process, and with every member on one `populora node` over
# loopback (the same placement: one broker batching every member). Alternates
# the two REPEATS times and prints each run's summed step time (metrics.jsonl
# wall_ms) and wire bytes per step.
#   scripts/bench-cluster.sh SCENARIO [REPEATS] [OUTDIR]
set -euo pipefail
scenario=$1
repeats=${2:-3}
out=${3:-$(mktemp -d)}
bin=${POPULORA:-target/release/populora}
mkdir -p "$out"
cookie="$out/cookie"
head -c 24 /dev/urandom | base64 > "$cookie"
chmod 600 "$cookie"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$bin" node --listen "127.0.0.1:$port" --cookie-file "$cookie" > "$out/node.out" 2> "$out/node.err" &
node=$!
trap 'kill $node' EXIT
sleep 1
summary() {
  python3 - "$1" "$2" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[2] + "/metrics.jsonl")]
wall = sum(l["wall_ms"] for l in lines) / 1e3
wire = [l.get("wire_bytes") for l in lines if l.get("wire_bytes")]
per = sum(w["sent"] + w["received"] for w in wire) / max(len(wire), 1)
print(json.dumps({"layout": sys.argv[1], "steps": len(lines), "step_time_s": round(wall, 3),
                  "wire_bytes_per_step": round(per)}))
PY
}
for i in $(seq 1 "$repeats"); do
  "$bin" run "$scenario" --out "$out/local-$i" > /dev/null 2>&1
  summary in_process "$out/local-$i"
  "$bin" run "$scenario" --out "$out/node-$i" --nodes "127.0.0.1:$port" --cookie-file "$cookie" > /dev/null 2>&1
  summary one_node "$out/node-$i"
done
