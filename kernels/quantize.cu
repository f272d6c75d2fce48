// Value codecs for the kept entries of a whole tensor list, one launch per pass: fp16/bf16 casts (clamped to the
// target's finite range), int8 blockwise absmax, and ternary (STC: kept value -> +-mu, mu = mean |kept value|).
//
// Entries of all tensors are concatenated: tensor t owns outputs [ent_start[t], ent_start[t + 1]). Inputs are
// read through tables of device addresses: val_ptrs[t] (fp32, or fp64 where vdt[t] == DT_F64), idx_ptrs[t]
// (the flat index of each kept entry: idx_w[t] = 4 for u32, 8 for u64, 0 for a dense tensor whose entry l is
// element l). Where res_ptrs[t] is non-zero it is the tensor's error-feedback residual (fp32, fp64 for fp64
// tensors), and every pass that fixes a decoded value also writes residual[index] = value - decoded there.
// NumPy twins: cpu_fallback/quantize.py (same bytes).
#include "common.cuh"

#define FP16_MAX 65504.0f
#define BF16_MAX_BITS 0x7F7F0000u
#define TERNARY_CHUNK CHUNK

__device__ __forceinline__ float value_f32(const u64* val_ptrs, const int* vdt, int t, u64 l) {
    if (vdt[t] == DT_F64) return (float)((const double*)val_ptrs[t])[l];
    return ((const float*)val_ptrs[t])[l];
}

__device__ __forceinline__ u64 entry_index(const u64* idx_ptrs, const int* idx_w, int t, u64 l) {
    if (idx_w[t] == 4) return (u64)((const u32*)idx_ptrs[t])[l];
    if (idx_w[t] == 8) return ((const u64*)idx_ptrs[t])[l];
    return l;
}

// residual[index of entry l] = value - decoded, in the residual's precision.
__device__ __forceinline__ void fix_residual(const u64* val_ptrs, const int* vdt, const u64* idx_ptrs,
                                             const int* idx_w, const u64* res_ptrs, int t, u64 l, float dec) {
    void* rs = (void*)res_ptrs[t];
    if (!rs) return;
    const u64 i = entry_index(idx_ptrs, idx_w, t, l);
    if (vdt[t] == DT_F64) {
        ((double*)rs)[i] = ((const double*)val_ptrs[t])[l] - (double)dec;
    } else {
        ((float*)rs)[i] = ((const float*)val_ptrs[t])[l] - dec;
    }
}

// Round to nearest integer, ties to even, for |x| < 2^22 (adding 1.5 * 2^23 leaves an ulp of 1).
__device__ __forceinline__ float round_even_small(float x) {
    const float magic = 12582912.0f;
    return (x + magic) - magic;
}

// out[j] = fp16 (mode Q_F16) or bf16 (mode Q_BF16) bits of entry j, clamped to the target's largest finite value.
extern "C" __global__ void quantize_cast(
    int nt, u64 total, const u64* ent_start, const int* vdt, const u64* val_ptrs, const int* idx_w,
    const u64* idx_ptrs, const u64* res_ptrs, int mode, u16* out)
{
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= total) return;
    const int t = tensor_of_entry(ent_start, nt, j);
    const u64 l = j - ent_start[t];
    float v = value_f32(val_ptrs, vdt, t, l);
    float dec;
    if (mode == Q_F16) {
        v = v > FP16_MAX ? FP16_MAX : (v < -FP16_MAX ? -FP16_MAX : v);
        const u16 h = float_to_f16_bits(v);
        out[j] = h;
        dec = f16_bits_to_float(h);
    } else {
        const float m = __uint_as_float(BF16_MAX_BITS);
        v = v > m ? m : (v < -m ? -m : v);
        const u16 h = float_to_bf16_bits(v);
        out[j] = h;
        dec = bf16_bits_to_float(h);
    }
    fix_residual(val_ptrs, vdt, idx_ptrs, idx_w, res_ptrs, t, l, dec);
}

// One thread block per quantization block of `block` entries (blocks never straddle a tensor; tensor t owns
// blocks [blk_start[t], blk_start[t + 1])). scale = absmax / 127; q = round(v / scale), 0 where scale is 0.
extern "C" __global__ void quantize_int8(
    int nt, const u64* blk_start, const u64* ent_start, int block, const int* vdt, const u64* val_ptrs,
    const int* idx_w, const u64* idx_ptrs, const u64* res_ptrs, signed char* out, float* scales)
{
    __shared__ u32 amax;
    const u64 b = blockIdx.x;
    const int t = tensor_of_entry(blk_start, nt, b);
    const u64 n = ent_start[t + 1] - ent_start[t];
    const u64 l0 = (b - blk_start[t]) * (u64)block;
    const u64 l1 = l0 + (u64)block < n ? l0 + (u64)block : n;
    if (threadIdx.x == 0) amax = 0u;
    __syncthreads();
    u32 m = 0u;
    for (u64 l = l0 + threadIdx.x; l < l1; l += BLOCK) {
        const u32 a = __float_as_uint(value_f32(val_ptrs, vdt, t, l)) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    atomicMax(&amax, m);  // non-negative floats order like their bit patterns
    __syncthreads();
    const float scale = __uint_as_float(amax) / 127.0f;
    if (threadIdx.x == 0) scales[b] = scale;
    for (u64 l = l0 + threadIdx.x; l < l1; l += BLOCK) {
        float q = 0.0f;
        if (scale > 0.0f) {
            q = round_even_small(value_f32(val_ptrs, vdt, t, l) / scale);
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        }
        out[ent_start[t] + l] = (signed char)(int)q;
        // __fmul_rn: never fused with the residual subtract, so the bytes match the NumPy twin
        fix_residual(val_ptrs, vdt, idx_ptrs, idx_w, res_ptrs, t, l, __fmul_rn(q, scale));
    }
}

// Ternary pass 1, one block per chunk of TERNARY_CHUNK entries of a tensor (tensor t owns chunks
// [chunk_start[t], chunk_start[t + 1])): partial[c] = sum of |v| over the chunk in fp64 as a pairwise tree over
// adjacent entries, and the sign bits (1 = negative) of the chunk packed 32 to a word at sign_words[word_off[t]].
// Chunks start at multiples of TERNARY_CHUNK, so chunk sums are the nodes of one pairwise tree over the tensor.
extern "C" __global__ void ternary_partial(
    int nt, const i64* chunk_start, const u64* ent_start, const int* vdt, const u64* val_ptrs,
    const u64* word_off, double* partial, u32* sign_words)
{
    __shared__ double sh[TERNARY_CHUNK];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const u64 n = ent_start[t + 1] - ent_start[t];
    const u64 e0 = (u64)(c - chunk_start[t]) * (u64)TERNARY_CHUNK;
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < ITEMS; ++r) {
        const u64 l = e0 + (u64)r * BLOCK + threadIdx.x;
        const bool valid = l < n;
        double a = 0.0;
        bool neg = false;
        if (valid) {
            if (vdt[t] == DT_F64) {
                const double v = ((const double*)val_ptrs[t])[l];
                a = fabs(v);
                neg = v < 0.0;
            } else {
                const float v = ((const float*)val_ptrs[t])[l];
                a = (double)fabsf(v);
                neg = v < 0.0f;
            }
        }
        sh[r * BLOCK + threadIdx.x] = a;
        const u32 word = __ballot_sync(0xFFFFFFFFu, neg);
        if (lane == 0 && e0 + (u64)r * BLOCK + (threadIdx.x & ~31u) < n)
            sign_words[word_off[t] + ((e0 + (u64)r * BLOCK + threadIdx.x) >> 5)] = word;
    }
    __syncthreads();
    for (int s = 1; s < TERNARY_CHUNK; s <<= 1) {
        for (int i = threadIdx.x; i < TERNARY_CHUNK / (2 * s); i += BLOCK) sh[2 * s * i] += sh[2 * s * i + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[c] = sh[0];
}

// Ternary pass 2, one block per tensor: finish the pairwise tree over the tensor's chunk sums in parallel, level by
// level in place (node j of level L sits at index j * 2^L; a node without a partner passes up unchanged, as if
// paired with zeros: the tree of cpu_fallback/quantize.pairwise_sum), then mu[t] = (float)(sum / n), 0 for an
// empty tensor.
extern "C" __global__ void ternary_mu(int nt, const i64* chunk_start, const u64* ent_start, double* partial,
                                      float* mu)
{
    const int t = blockIdx.x;
    if (t >= nt) return;  // uniform across the block
    double* p = partial + chunk_start[t];
    const i64 m = chunk_start[t + 1] - chunk_start[t];
    const u64 n = ent_start[t + 1] - ent_start[t];
    for (i64 s = 1; s < m; s <<= 1) {
        for (i64 i = threadIdx.x; 2 * s * i + s < m; i += blockDim.x) p[2 * s * i] += p[2 * s * i + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) mu[t] = m == 0 ? 0.0f : (float)(p[0] / (double)n);
}

// Ternary pass 3 (error feedback only): residual[index] = v - (v < 0 ? -mu : mu).
extern "C" __global__ void ternary_fixup(
    int nt, u64 total, const u64* ent_start, const int* vdt, const u64* val_ptrs, const int* idx_w,
    const u64* idx_ptrs, const u64* res_ptrs, const float* mu)
{
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= total) return;
    const int t = tensor_of_entry(ent_start, nt, j);
    const u64 l = j - ent_start[t];
    bool neg;
    if (vdt[t] == DT_F64) neg = ((const double*)val_ptrs[t])[l] < 0.0;
    else neg = ((const float*)val_ptrs[t])[l] < 0.0f;
    fix_residual(val_ptrs, vdt, idx_ptrs, idx_w, res_ptrs, t, l, neg ? -mu[t] : mu[t]);
}
