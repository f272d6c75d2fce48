// Float steps of the aggregator (gpu_codec/aggregate.py) and of decoding, in our kernels rather than CuPy's
// elementwise ones: CuPy compiles those with -ftz=true, which flushes single-precision subnormals (in a cast from
// or to fp32, in an fp32 multiply) where the NumPy twins keep them. One thread per element, grid-stride loops,
// 64-bit indexing. NumPy twins: cpu_fallback/limbs.py (limb_split, mean_span) and cpu_fallback/quantize.py
// (int8_decode, widen_f32); the same bytes.
#include "common.cuh"

#define LIMB_COUNT 3

// qs[j * n + i], j = 0 .. 2: the limbs of (double)v[i] * w on the grids 2^e_j (e_0 the coarsest):
// rem = v * w; q_j = rint(rem * inv[j]); rem = rem - q_j * step[j] (but after the last limb). inv[j] = 2^-e_j and
// step[j] = 2^e_j are exact powers of two, so every product is exact and rint rounds half to even, as NumPy's.
template <typename T>
__device__ __forceinline__ void limb_split_one(u64 n, const T* v, double w, const double* inv, const double* step,
                                               int* qs) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        double rem = __dmul_rn((double)v[i], w);
        for (int j = 0; j < LIMB_COUNT; ++j) {
            const double q = rint(__dmul_rn(rem, inv[j]));
            if (j < LIMB_COUNT - 1) rem = __dsub_rn(rem, __dmul_rn(q, step[j]));
            qs[(u64)j * n + i] = (int)q;
        }
    }
}

extern "C" __global__ void limb_split_f32(u64 n, const float* v, double w, const double* grid, int* qs) {
    limb_split_one<float>(n, v, w, grid, grid + LIMB_COUNT, qs);
}

extern "C" __global__ void limb_split_f64(u64 n, const double* v, double w, const double* grid, int* qs) {
    limb_split_one<double>(n, v, w, grid, grid + LIMB_COUNT, qs);
}

// out[i] = ((double)limbs[0][i] * scales[0] + (double)limbs[1][i] * scales[1] + ...) / total, each step in fp64
// in limb order, rounded once to out's precision (round to nearest even, subnormals kept).
template <typename T>
__device__ __forceinline__ void limb_mean_one(int nlimbs, u64 n, const int* limbs, const double* scales,
                                              double total, T* out) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        double s = __dmul_rn((double)limbs[i], scales[0]);
        for (int j = 1; j < nlimbs; ++j) s = __dadd_rn(s, __dmul_rn((double)limbs[(u64)j * n + i], scales[j]));
        out[i] = (T)__ddiv_rn(s, total);
    }
}

extern "C" __global__ void limb_mean_f32(int nlimbs, u64 n, const int* limbs, const double* scales, double total,
                                         float* out) {
    limb_mean_one<float>(nlimbs, n, limbs, scales, total, out);
}

extern "C" __global__ void limb_mean_f64(int nlimbs, u64 n, const int* limbs, const double* scales, double total,
                                         double* out) {
    limb_mean_one<double>(nlimbs, n, limbs, scales, total, out);
}

// out[i] = (float)q[i] * scales[i / block]: the int8 blockwise decode.
extern "C" __global__ void int8_dequant(u64 n, int block, const signed char* q, const float* scales, float* out) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = __fmul_rn((float)q[i], scales[i / (u64)block]);
    }
}

// out[i] = (double)x[i], exactly (an fp32 subnormal is a normal fp64).
extern "C" __global__ void widen_f32(u64 n, const float* x, double* out) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = (double)x[i];
    }
}
