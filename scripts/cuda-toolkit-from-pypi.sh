#!/usr/bin/env bash
# A CUDA 13.0 toolkit for *building* the `cuda` feature on a machine without
# one (and without a GPU): nvcc, cicc, the headers, cuBLAS, cuRAND, NVRTC and
# the runtime from PyPI's nvidia-* wheels, merged into PREFIX, plus a stub
# libcuda.so (every driver symbol cudarc links, as empty functions) so that
# the binary links. The stub is for linking only: at run time the GPU
# machine's own driver library is used.
#
#   scripts/cuda-toolkit-from-pypi.sh [PREFIX]     (default /opt/cuda13)
set -euo pipefail
prefix=${1:-/opt/cuda13}
wheels=$(mktemp -d)
python3 -m pip download --no-deps -q -d "$wheels" \
    "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" \
    "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-cccl==13.0.*" \
    "nvidia-cublas==13.0.*" "nvidia-curand==10.4.0.*"
mkdir -p "$prefix"
for w in "$wheels"/*.whl; do
    unzip -q -o "$w" 'nvidia/cu13/*' -d "$wheels/x"
done
cp -a "$wheels/x/nvidia/cu13/." "$prefix/"
chmod +x "$prefix"/bin/* "$prefix"/nvvm/bin/*
cd "$prefix/lib"
for l in cublas cublasLt cudart nvrtc; do ln -sf "lib$l.so.13" "lib$l.so"; done
ln -sf libcurand.so.10 libcurand.so
ln -sfn lib "$prefix/lib64"
# The driver stub: one empty function per `cu*` symbol of cudarc's bindings.
bindings=$(find ~/.cargo/registry/src -path '*cudarc-0.19.*/src/driver/sys/mod.rs' | head -1)
[ -n "$bindings" ] || { echo "cudarc's sources are not in ~/.cargo/registry: run 'cargo fetch' first" >&2; exit 1; }
mkdir -p stubs
grep -o 'fn cu[A-Za-z0-9_]*(' "$bindings" | sed 's/fn \(.*\)(/\1/' | sort -u \
    | awk '{print "void " $1 "(void){}"}' >"$wheels/cuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o stubs/libcuda.so "$wheels/cuda_stub.c"
rm -rf "$wheels"
"$prefix/bin/nvcc" --version | tail -1
