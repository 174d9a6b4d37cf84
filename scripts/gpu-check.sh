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
# Files in OUT_DIR: machine.txt, tests.txt, tiny-run.txt, quick-run.txt, generate-DEV.json,
# broker-DEV.json, broker-cuda-2048.json.
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
# Self-play wholly on the GPU (generation, scoring and the train step), then
# its replay: every adapter checksum must come out the same. First the tiny
# scenario, then the quickstart at SmolLM2's shape with random weights (the
# GPU machine cannot fetch the model): 2 steps, its step times against the
# CPU's with CPU=1.
sed 's/^source = "tiny".*/source = "tiny"\ndevice = "cuda"/' scenarios/tiny.toml >/tmp/tiny-gpu.toml
smollm2_shape() {  # $1: the device
    python3 - "$1" <<'PY'
import re, sys
text = open("scenarios/quickstart.toml").read()
text = re.sub(r"^steps = \d+", "steps = 2", text, flags=re.M)
# The tiny tokenizer spells prompts byte by byte: longer than SmolLM2's.
text = re.sub(r"^max_prompt_tokens = \d+", "max_prompt_tokens = 2048", text, flags=re.M)
model = (f'[model]\nsource = "tiny"\ndevice = "{sys.argv[1]}"\n\n[model.tiny]\n'
         'layers = 30\nhidden = 576\nheads = 9\nkv_heads = 3\nffn = 1536\n'
         'vocab = 49152\nmax_positions = 8192\n')
print(re.sub(r"^\[model\]\n[^\[]*", model + "\n", text, flags=re.M), end="")
PY
}
smollm2_shape cuda >/tmp/quick-gpu.toml
smollm2_shape cpu >/tmp/quick-cpu.toml
rm -rf /tmp/tiny-gpu /tmp/quick-gpu /tmp/quick-cpu
{
    step "$bin"/populora run /tmp/tiny-gpu.toml --out /tmp/tiny-gpu
    step "$bin"/populora replay /tmp/tiny-gpu
} 2>&1 | tail -40 | tee "$out/tiny-run.txt"
{
    step "$bin"/populora run /tmp/quick-gpu.toml --out /tmp/quick-gpu
    step "$bin"/populora replay /tmp/quick-gpu
    [ -n "${CPU:-}" ] && step "$bin"/populora run /tmp/quick-cpu.toml --out /tmp/quick-cpu
} 2>&1 | tail -40 | tee "$out/quick-run.txt"

devices=(cuda)
[ -n "${CPU:-}" ] && devices+=(cpu)
for dev in "${devices[@]}"; do
    step "$bin"/populora bench generate --device "$dev" "${model_args[@]}" --json | tee "$out/generate-$dev.json"
    step "$bin"/populora bench broker --device "$dev" "${model_args[@]}" --json | tee "$out/broker-$dev.json"
done
# The train step where launches no longer dominate: a random model of width
# 2048 (train_over_matmul against the GPU's f32 GEMM, goal ≥ 0.4).
step "$bin"/populora bench broker --device cuda --random-weights --skip-grouped \
    --random-shape hidden=2048,heads=32,kv_heads=8,ffn=5632,layers=8 --json | tee "$out/broker-cuda-2048.json"


