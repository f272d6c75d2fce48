// Float steps of the aggregator (gpu_codec/aggregate.py) and of decoding, in our kernels rather than CuPy's
// elementwise ones: CuPy compiles those with -ftz=true, which flushes single-precision subnormals (in a cast from
// or to fp32, in an fp32 multiply) where the NumPy twins keep them. One thread per element or entry (grid-stride
// loops where the grid is capped), 64-bit indexing. NumPy twins: cpu_fallback/limbs.py (limb_accumulate,
// limb_shift, segment_abs_max, limb_mean) and cpu_fallback/quantize.py (int8_decode, widen_f32); the same bytes.
#include "common.cuh"

#define LIMB_COUNT 3

// The aggregator's accumulator is one int32 array of LIMB_COUNT rows of n elements (tensors at their element
// offsets). A launch covers a list of tensors (or of a tensor's entries): tensor t owns entries (or elements)
// [ent_start[t], ent_start[t + 1]), found by binary search (tensor_of_entry). Integer steps only, but for the
// split and the mean, whose fp64 steps are written out (__dmul_rn, rint: NumPy's round half to even).

// limbs[j][o0 + e] += q_j for entry i of tensor t, e = idx[i] (dense: i, the tensors' elements end to end): the
// limbs of (double)v[i] * w on the grids of t, grid[6 t + j] = 2^-e_j and grid[6 t + 3 + j] = 2^e_j (e_0 the coarsest):
// rem = v * w; q_j = rint(rem * 2^-e_j); rem = rem - q_j * 2^e_j (but after the last limb). Every product is by a
// power of two, so exact. The entries of one launch own distinct elements: plain adds, no atomics.
template <typename T, typename IDX>
__device__ __forceinline__ void limb_accumulate_one(int nt, u64 total, const u64* ent_start, const double* grid,
                                                    const T* v, const IDX* idx, int dense, double w, u64 o0, u64 n,
                                                    int* limbs) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int t = tensor_of_entry(ent_start, nt, i);
    const double* g = grid + 2 * LIMB_COUNT * t;
    const u64 e = o0 + (dense ? i : (u64)idx[i]);
    double rem = __dmul_rn((double)v[i], w);
    for (int j = 0; j < LIMB_COUNT; ++j) {
        const double q = rint(__dmul_rn(rem, g[j]));
        if (j < LIMB_COUNT - 1) rem = __dsub_rn(rem, __dmul_rn(q, g[LIMB_COUNT + j]));
        limbs[(u64)j * n + e] += (int)q;
    }
}

extern "C" __global__ void limb_accumulate_f32_u32(int nt, u64 total, const u64* ent_start, const double* grid,
                                              const float* v, const u32* idx, int dense, double w, u64 o0, u64 n,
                                              int* limbs) {
    limb_accumulate_one<float, u32>(nt, total, ent_start, grid, v, idx, dense, w, o0, n, limbs);
}

extern "C" __global__ void limb_accumulate_f32_u64(int nt, u64 total, const u64* ent_start, const double* grid,
                                              const float* v, const u64* idx, int dense, double w, u64 o0, u64 n,
                                              int* limbs) {
    limb_accumulate_one<float, u64>(nt, total, ent_start, grid, v, idx, dense, w, o0, n, limbs);
}

extern "C" __global__ void limb_accumulate_f64_u32(int nt, u64 total, const u64* ent_start, const double* grid,
                                              const double* v, const u32* idx, int dense, double w, u64 o0, u64 n,
                                              int* limbs) {
    limb_accumulate_one<double, u32>(nt, total, ent_start, grid, v, idx, dense, w, o0, n, limbs);
}

extern "C" __global__ void limb_accumulate_f64_u64(int nt, u64 total, const u64* ent_start, const double* grid,
                                              const double* v, const u64* idx, int dense, double w, u64 o0, u64 n,
                                              int* limbs) {
    limb_accumulate_one<double, u64>(nt, total, ent_start, grid, v, idx, dense, w, o0, n, limbs);
}

// A coarser grid for tensor t, by shift[t] whole limbs: row j takes row j - shift[t] (0 past the top), the lowest
// falling off; element i of the launch is element elem_off[t] + i - ent_start[t] of the accumulator.
extern "C" __global__ void limb_shift(int nt, u64 total, const u64* ent_start, const u64* elem_off, const int* shift,
                                      u64 n, int* limbs) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int t = tensor_of_entry(ent_start, nt, i);
    const int s = shift[t];
    const u64 e = elem_off[t] + (i - ent_start[t]);
    for (int j = LIMB_COUNT - 1; j >= 0; --j) limbs[(u64)j * n + e] = j >= s ? limbs[(u64)(j - s) * n + e] : 0;
}

// out[t] = the largest |v| of tensor t's entries, as the bits of its magnitude (the sign bit cleared: finite
// magnitudes order like their bits, and inf or NaN lies above every finite one); 0 for no entry. out starts at 0.
template <typename U>
__device__ __forceinline__ void segment_abs_max_one(int nt, u64 total, const u64* ent_start, const U* bits,
                                                    u64* out) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const U mag = bits[i] & (U)(~((U)1 << (8 * sizeof(U) - 1)));
    atomicMax(&out[tensor_of_entry(ent_start, nt, i)], (u64)mag);
}

extern "C" __global__ void segment_abs_max_u32(int nt, u64 total, const u64* ent_start, const u32* bits, u64* out) {
    segment_abs_max_one<u32>(nt, total, ent_start, bits, out);
}

extern "C" __global__ void segment_abs_max_u64(int nt, u64 total, const u64* ent_start, const u64* bits, u64* out) {
    segment_abs_max_one<u64>(nt, total, ent_start, bits, out);
}

// out[i], element i of tensor t (out entries [ent_start[t], ent_start[t + 1]), accumulator elements from
// elem_off[t]) = (limbs[0][e] * scales[3 t] + limbs[1][e] * scales[3 t + 1] + ...) / total, each step in fp64 in
// limb order, rounded once to out's precision (round to nearest even, subnormals kept).
template <typename T>
__device__ __forceinline__ void limb_mean_one(int nt, u64 total_n, const u64* ent_start, const u64* elem_off,
                                              const double* scales, u64 n, const int* limbs, double total, T* out) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total_n; i += (u64)gridDim.x * blockDim.x) {
        const int t = tensor_of_entry(ent_start, nt, i);
        const double* sc = scales + LIMB_COUNT * t;
        const u64 e = elem_off[t] + (i - ent_start[t]);
        double s = __dmul_rn((double)limbs[e], sc[0]);
        for (int j = 1; j < LIMB_COUNT; ++j) s = __dadd_rn(s, __dmul_rn((double)limbs[(u64)j * n + e], sc[j]));
        out[i] = (T)__ddiv_rn(s, total);
    }
}

extern "C" __global__ void limb_mean_f32(int nt, u64 total_n, const u64* ent_start, const u64* elem_off,
                                         const double* scales, u64 n, const int* limbs, double total, float* out) {
    limb_mean_one<float>(nt, total_n, ent_start, elem_off, scales, n, limbs, total, out);
}

extern "C" __global__ void limb_mean_f64(int nt, u64 total_n, const u64* ent_start, const u64* elem_off,
                                         const double* scales, u64 n, const int* limbs, double total, double* out) {
    limb_mean_one<double>(nt, total_n, ent_start, elem_off, scales, n, limbs, total, out);
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
