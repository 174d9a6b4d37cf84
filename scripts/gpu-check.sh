#!/usr/bin/env bash
# The GPU checks, run on a machine with an NVIDIA GPU from binaries built
# elsewhere with `--features cuda` (scripts/build-cuda.sh puts them in .gpu/):
# the CUDA unit tests (kernels against the CPU reference and finite
# differences, bit-for-bit reruns, model logits against the CPU), then the
# decode and broker benchmarks on the GPU and, side by side, on this machine's
# CPU (with CPU=1). Random weights in the default model's shape unless MODEL
# names a GGUF.
#
#   [CPU=1] [MODEL=file.gguf] scripts/gpu-check.sh [OUT_DIR]   (default: gpu-check/)
# Files in OUT_DIR: machine.txt, tests.txt, generate-DEV.json, broker-DEV.json, tiny-run.txt.
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
bin=.gpu
for f in "$bin"/*.xz; do [ -e "$f" ] && xz -dkf "$f"; done
chmod +x "$bin"/populora "$bin"/lib-tests

# CUDA's libraries (cuBLAS, cuRAND, NVRTC, the runtime): the toolkit's, else
# Python's nvidia-* wheels.
libs=$(for l in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libcudart.so.13; do
    find /usr/local/nvidia /usr/local/cuda*/ /usr/lib /opt -name "$l" 2>/dev/null | head -1 | xargs -r dirname
done | sort -u | paste -sd:)
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nproc; } | tee "$out/machine.txt"

model_args=(--random-weights)
[ -n "${MODEL:-}" ] && model_args=(--model "$MODEL")

step() { echo "== $*"; local t0=$SECONDS; "$@"; local rc=$?; echo "== rc=$rc in $((SECONDS - t0)) s"; return $rc; }

step "$bin"/lib-tests cuda_ --test-threads=1 2>&1 | tee "$out/tests.txt"
# A self-play run that generates on the GPU (the tiny scenario, trained on the
# CPU), then its replay: every adapter checksum must come out the same.
sed 's/^source = "tiny".*/source = "tiny"\ndevice = "cuda"/' scenarios/tiny.toml >/tmp/tiny-gpu.toml
rm -rf /tmp/tiny-gpu
{
    step "$bin"/populora run /tmp/tiny-gpu.toml --out /tmp/tiny-gpu
    step "$bin"/populora replay /tmp/tiny-gpu
} 2>&1 | tail -40 | tee "$out/tiny-run.txt"

devices=(cuda)
[ -n "${CPU:-}" ] && devices+=(cpu)
for dev in "${devices[@]}"; do
    step "$bin"/populora bench generate --device "$dev" "${model_args[@]}" --json | tee "$out/generate-$dev.json"
    step "$bin"/populora bench broker --device "$dev" "${model_args[@]}" --json | tee "$out/broker-$dev.json"
done

