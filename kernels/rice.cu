// Rice (Golomb power-of-two) coding of the ascending flat indices of every tensor of a list, in parallel.
//
// Tensor t has n = ent_start[t + 1] - ent_start[t] kept indices idx[0..n) (strictly increasing) and a Rice
// parameter k = ks[t]. Gap l is g = idx[l] - idx[l - 1] - 1 (idx[-1] = -1), q = g >> k, low = g & (2^k - 1).
// The tensor's bit stream (bit b of the stream is bit b % 32 of word b / 32, i.e. LSB first in little-endian
// bytes) holds two sections:
//   low section    bits [l * k, l * k + k)  = low of gap l                      (fixed width: no scan needed)
//   unary section  starts at n * k; gap l is q zero bits then a one bit, so the one of gap l sits at
//                  n * k + sum_{m < l} (q_m + 1) + q_l                          (an exclusive scan of q + 1)
// Total bits: n * k + sum (q + 1). Work is split into chunks of CHUNK entries that never straddle a tensor
// (chunk_start[t] = first chunk of t). Passes: rice_count -> rice_scan -> rice_write (on a zeroed stream).
// NumPy twin: cpu_fallback/rice.py (same bytes).
#include "common.cuh"

template <typename IDX>
__device__ __forceinline__ u64 rice_gap(const IDX* idx, u64 l) {
    return l == 0 ? (u64)idx[0] : (u64)idx[l] - (u64)idx[l - 1] - 1ull;
}

// chunk_q[c] = sum of q over chunk c.
template <typename IDX>
__device__ __forceinline__ void rice_count_impl(int nt, const i64* chunk_start, const u64* ent_start,
                                                const int* ks, const u64* idx_ptrs, u64* chunk_q) {
    __shared__ u64 sh[BLOCK];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const u64 n = ent_start[t + 1] - ent_start[t];
    const u64 e0 = (u64)(c - chunk_start[t]) * (u64)CHUNK;
    const IDX* idx = (const IDX*)idx_ptrs[t];
    const int k = ks[t];
    u64 s = 0;
    for (int r = 0; r < ITEMS; ++r) {
        const u64 l = e0 + (u64)r * BLOCK + threadIdx.x;
        if (l < n) s += rice_gap<IDX>(idx, l) >> k;
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int o = BLOCK / 2; o > 0; o >>= 1) {
        if (threadIdx.x < (unsigned)o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) chunk_q[c] = sh[0];
}

extern "C" __global__ void rice_count_u32(int nt, const i64* chunk_start, const u64* ent_start, const int* ks,
                                          const u64* idx_ptrs, u64* chunk_q)
{
    rice_count_impl<u32>(nt, chunk_start, ent_start, ks, idx_ptrs, chunk_q);
}

extern "C" __global__ void rice_count_u64(int nt, const i64* chunk_start, const u64* ent_start, const int* ks,
                                          const u64* idx_ptrs, u64* chunk_q)
{
    rice_count_impl<u64>(nt, chunk_start, ent_start, ks, idx_ptrs, chunk_q);
}

// One block of RICE_SCAN_THREADS threads. chunk_base[c]: unary bits of c's tensor in earlier chunks;
// tensor_bits[t]: the total bit count of tensor t's stream.
extern "C" __global__ void rice_scan(int nt, i64 nchunks, const i64* chunk_start, const u64* ent_start,
                                     const int* ks, const u64* chunk_q, u64* chunk_base, u64* tensor_bits)
{
    __shared__ u64 sh[RICE_SCAN_THREADS];
    const i64 per = (nchunks + RICE_SCAN_THREADS - 1) / RICE_SCAN_THREADS;
    const i64 lo = (i64)threadIdx.x * per;
    const i64 hi = lo + per < nchunks ? lo + per : nchunks;
    u64 sum = 0;
    for (i64 c = lo; c < hi; ++c) {
        const int t = tensor_of_chunk(chunk_start, nt, c);
        const u64 n = ent_start[t + 1] - ent_start[t];
        const u64 e0 = (u64)(c - chunk_start[t]) * (u64)CHUNK;
        sum += chunk_q[c] + (n - e0 < (u64)CHUNK ? n - e0 : (u64)CHUNK);
    }
    u64 run = block_exclusive_scan(sum, sh, RICE_SCAN_THREADS);
    for (i64 c = lo; c < hi; ++c) {
        const int t = tensor_of_chunk(chunk_start, nt, c);
        const u64 n = ent_start[t + 1] - ent_start[t];
        const u64 e0 = (u64)(c - chunk_start[t]) * (u64)CHUNK;
        chunk_base[c] = run;
        run += chunk_q[c] + (n - e0 < (u64)CHUNK ? n - e0 : (u64)CHUNK);
    }
    __syncthreads();
    // rebase onto each tensor's first chunk; a tensor's total is the base of the next tensor's first chunk
    for (int t = threadIdx.x; t < nt; t += RICE_SCAN_THREADS) {
        const i64 a = chunk_start[t], b = chunk_start[t + 1];
        const u64 n = ent_start[t + 1] - ent_start[t];
        u64 unary = 0;
        if (b > a) {
            const i64 last = b - 1;
            const u64 e_last = (u64)(last - a) * (u64)CHUNK;
            unary = chunk_base[last] + chunk_q[last] + (n - e_last) - chunk_base[a];
        }
        tensor_bits[t] = n * (u64)ks[t] + unary;
    }
    __syncthreads();
    for (i64 c = lo; c < hi; ++c) {
        const int t = tensor_of_chunk(chunk_start, nt, c);
        if (c != chunk_start[t]) chunk_base[c] -= chunk_base[chunk_start[t]];
    }
    __syncthreads();
    for (int t = threadIdx.x; t < nt; t += RICE_SCAN_THREADS)
        if (chunk_start[t + 1] > chunk_start[t]) chunk_base[chunk_start[t]] = 0;
}

// OR `bits` into words[word] for every lane with `has`, with one atomicOr per run of lanes that target the same
// word (a segmented OR scan over the warp; the last lane of a run writes). Every lane of the warp must call it.
// Correct whatever the words (OR is idempotent and commutative); fewest atomics when they rise with the lane.
__device__ __forceinline__ void warp_or(u32* words, u64 word, u32 bits, bool has) {
    const int lane = threadIdx.x & 31;
    if (!has) { word = ~0ull; bits = 0u; }
    for (int d = 1; d < 32; d <<= 1) {
        const u64 w_up = __shfl_up_sync(0xFFFFFFFFu, word, d);
        const u32 b_up = __shfl_up_sync(0xFFFFFFFFu, bits, d);
        if (lane >= d && w_up == word) bits |= b_up;
    }
    const u64 w_next = __shfl_down_sync(0xFFFFFFFFu, word, 1);
    if (has && bits && (lane == 31 || w_next != word)) atomicOr(&words[word], bits);
}

// Set `nbits` (< 64) bits of `v` at stream bit position `pos` for every lane with `valid` (the stream is zeroed
// by the caller): at most three word pieces per lane, each OR-ed in warp-aggregated. Every lane must call it.
__device__ __forceinline__ void rice_put_warp(u32* words, u64 pos, u64 v, int nbits, bool valid) {
    for (int j = 0; j < 3; ++j) {
        const bool has = valid && nbits > 0;
        u32 piece = 0u;
        int off = 0;
        const u64 word = pos >> 5;
        if (has) {
            off = (int)(pos & 31ull);
            const int take = 32 - off < nbits ? 32 - off : nbits;
            piece = (u32)(v & (take == 32 ? 0xFFFFFFFFull : ((1ull << take) - 1ull)));
            v >>= take;
            pos += (u64)take;
            nbits -= take;
        }
        warp_or(words, word, piece << off, has);
    }
}

template <typename IDX>
__device__ __forceinline__ void rice_write_impl(int nt, const i64* chunk_start, const u64* ent_start,
                                                const int* ks, const u64* idx_ptrs, const u64* chunk_base,
                                                const u64* word_off, u32* words) {
    __shared__ u64 sh[BLOCK];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const u64 n = ent_start[t + 1] - ent_start[t];
    const u64 e0 = (u64)(c - chunk_start[t]) * (u64)CHUNK;
    const IDX* idx = (const IDX*)idx_ptrs[t];
    const int k = ks[t];
    u32* w = words + word_off[t];
    const u64 ubase = n * (u64)k;
    u64 run = chunk_base[c];
    for (int r = 0; r < ITEMS; ++r) {
        const u64 r0 = e0 + (u64)r * BLOCK;
        if (r0 >= n) break;  // uniform across the block
        const u64 l = r0 + threadIdx.x;
        const bool valid = l < n;
        const u64 g = valid ? rice_gap<IDX>(idx, l) : 0ull;
        const u64 q = g >> k;
        const u64 len = valid ? q + 1ull : 0ull;
        const u64 before = block_exclusive_scan(len, sh, BLOCK);
        if (k > 0) rice_put_warp(w, l * (u64)k, g, k, valid);  // k is uniform: one tensor per block
        const u64 one = ubase + run + before + q;
        warp_or(w, one >> 5, 1u << (u32)(one & 31ull), valid);
        if (threadIdx.x == BLOCK - 1) sh[0] = before + len;
        __syncthreads();
        run += sh[0];
        __syncthreads();
    }
}

extern "C" __global__ void rice_write_u32(int nt, const i64* chunk_start, const u64* ent_start, const int* ks,
                                          const u64* idx_ptrs, const u64* chunk_base, const u64* word_off,
                                          u32* words)
{
    rice_write_impl<u32>(nt, chunk_start, ent_start, ks, idx_ptrs, chunk_base, word_off, words);
}

extern "C" __global__ void rice_write_u64(int nt, const i64* chunk_start, const u64* ent_start, const int* ks,
                                          const u64* idx_ptrs, const u64* chunk_base, const u64* word_off,
                                          u32* words)
{
    rice_write_impl<u64>(nt, chunk_start, ent_start, ks, idx_ptrs, chunk_base, word_off, words);
}
