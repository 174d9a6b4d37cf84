#!/usr/bin/env bash
# Build the `cuda` feature's binary and CUDA unit tests into .gpu/ (xz), for
# scripts/gpu-check.sh on a GPU machine. Needs CUDA's nvcc for candle's
# kernels (CUDA_ROOT, default /usr/local/cuda) and CUDA_COMPUTE_CAP (default
# 90, Hopper); linking needs libcuda.so, a stub is enough (lib/stubs).
set -euo pipefail
cuda=${CUDA_ROOT:-/usr/local/cuda}
export CUDA_ROOT=$cuda CUDA_PATH=$cuda PATH="$cuda/bin:$PATH" CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export LIBRARY_PATH="$cuda/lib:$cuda/lib64:$cuda/lib/stubs:$cuda/lib64/stubs:${LIBRARY_PATH:-}"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
cargo build --release --features cuda -p populora-actors
tests=$(cargo test --release --features cuda -p populora --lib --no-run --message-format=json \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])')
mkdir -p .gpu
strip -o .gpu/populora "$CARGO_TARGET_DIR/release/populora"
strip -o .gpu/lib-tests "$tests"
xz -T0 -6 -f .gpu/populora .gpu/lib-tests
ls -la .gpu
