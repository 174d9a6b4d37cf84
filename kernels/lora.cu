// Batched multi-adapter LoRA (SGMV style), compiled at run time with NVRTC
// (src/compute/lora_op.rs). Every token row t of a batch uses the factors of
// adapter slot[t], a block of `r` rows in the batch's concatenation of
// adapters, or none when slot[t] == NO_SLOT:
//
//   shrink: s[t, j]       = sum_i x[t, i] * a[slot[t]*r + j, i]       s [T, r]
//   expand: y[t, o]       = sum_j s[t, j] * b[slot[t]*r + j, o]       y [T, out]
//   outer:  g[k*r + j, i] = sum_{t : slot[t] = k} u[t, j] * v[t, i]   g [n*r, width]
//
// The LoRA delta of a projection is expand(shrink(x, A), s*B^T); its backward
// for an output gradient dy is
//   ds = shrink(dy, s*B^T),  dx = expand(ds, A),
//   dA = outer(ds, x),       d(s*B^T) = outer(shrink(x, A), dy).
//
// Determinism: every output element is summed by one thread or one warp in a
// fixed order, never with atomics, so a launch gives the same bits on every
// run on the same GPU (and the same launch configuration).

#define NO_SLOT 0xffffffffu

// One block per token row; each warp sums one rank coordinate at a time over
// `in`, lanes striding the row (coalesced), then a fixed shuffle tree.
template <typename T>
__device__ void shrink(const T* x, const T* a, const unsigned* slot, T* s, int in, int r) {
    const int t = blockIdx.x;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const unsigned k = slot[t];
    const T* xrow = x + (size_t)t * in;
    for (int j = warp; j < r; j += warps) {
        T acc = 0;
        if (k != NO_SLOT) {
            const T* arow = a + ((size_t)k * r + j) * in;
            for (int i = lane; i < in; i += 32) acc += xrow[i] * arow[i];
            for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
        }
        if (lane == 0) s[(size_t)t * r + j] = acc;
    }
}

// Grid (T, ceil(out / blockDim)): one thread per output element.
template <typename T>
__device__ void expand(const T* s, const T* b, const unsigned* slot, T* y, int out, int r) {
    const int t = blockIdx.x;
    const int o = blockIdx.y * blockDim.x + threadIdx.x;
    if (o >= out) return;
    const unsigned k = slot[t];
    T acc = 0;
    if (k != NO_SLOT) {
        const T* srow = s + (size_t)t * r;
        const T* bblock = b + (size_t)k * r * out + o;
        for (int j = 0; j < r; ++j) acc += srow[j] * bblock[(size_t)j * out];
    }
    y[(size_t)t * out + o] = acc;
}

// Grid (ceil(width / blockDim), n*r): one thread per element of g, summing
// over the tokens of its slot in increasing order. `range[2k]..range[2k+1]`
// bounds the tokens of slot k (rows come grouped by adapter, so the range
// holds few others; they are skipped by the slot test).
template <typename T>
__device__ void outer(const T* u, const T* v, const unsigned* slot, const unsigned* range,
                      T* g, int width, int r) {
    const int row = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= width) return;
    const unsigned k = row / r;
    const int j = row % r;
    T acc = 0;
    for (unsigned t = range[2 * k]; t < range[2 * k + 1]; ++t) {
        if (slot[t] == k) acc += u[(size_t)t * r + j] * v[(size_t)t * width + i];
    }
    g[(size_t)row * width + i] = acc;
}

#define LORA_KERNELS(T, SUFFIX)                                                              \
    extern "C" __global__ void lora_shrink_##SUFFIX(const T* x, const T* a,                  \
                                                    const unsigned* slot, T* s, int in,      \
                                                    int r) {                                 \
        shrink<T>(x, a, slot, s, in, r);                                                     \
    }                                                                                        \
    extern "C" __global__ void lora_expand_##SUFFIX(const T* s, const T* b,                  \
                                                    const unsigned* slot, T* y, int out,     \
                                                    int r) {                                 \
        expand<T>(s, b, slot, y, out, r);                                                    \
    }                                                                                        \
    extern "C" __global__ void lora_outer_##SUFFIX(const T* u, const T* v,                   \
                                                   const unsigned* slot,                     \
                                                   const unsigned* range, T* g, int width,   \
                                                   int r) {                                  \
        outer<T>(u, v, slot, range, g, width, r);                                            \
    }

LORA_KERNELS(float, f32)
LORA_KERNELS(double, f64)
