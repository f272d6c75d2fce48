// Exact top-k selection of a model update, for a whole list of tensors in one launch per pass.
//
// Work is split into chunks of CHUNK elements that never straddle a tensor; chunk_start[t] is the first chunk
// of tensor t (nt + 1 entries), so blockIdx.x -> (tensor, offset) is a binary search. Tensors are passed as
// tables of device addresses (u64) with a logical dtype code per tensor (common.cuh). A "segment" is the set of
// tensors that share one threshold: all of them for global scope, one tensor each for per-tensor scope.
//
// Unfused passes: score_keys -> 4 x (radix_hist, radix_pick) -> chunk_count -> the chunk scan (chunk_scan_reduce,
// chunk_scan_eq, chunk_scan_out) -> chunk_write_{u32,u64}.
// Each has a NumPy twin with the same name and arguments in cpu_fallback/kernels.py. They are exact for any input;
// the fused selection at the end of this file reads the inputs once and falls back to them when its bracket misses.
#include "common.cuh"

// The delta of element i (a null base reads as zeros, a null residual as none), in fp32 (fp32/fp16/bf16 tensors) or fp64 (fp64 tensors): (new - base) + residual.
__device__ __forceinline__ double delta_f64(const void* nw, const void* bs, const void* rs, i64 i) {
    double d = ((const double*)nw)[i] - (bs ? ((const double*)bs)[i] : 0.0);
    if (rs) d = d + ((const double*)rs)[i];
    return d;
}
__device__ __forceinline__ float delta_f32(const void* nw, const void* bs, const void* rs, int dt, i64 i) {
    float d = load_f32(nw, dt, i) - (bs ? load_f32(bs, dt, i) : 0.0f);
    if (rs) d = d + ((const float*)rs)[i];
    return d;
}

__device__ __forceinline__ float criterion_f32(int crit, float w, float w0, float d) {
    switch (crit) {
        case CRIT_LARGEST_FINAL: return fabsf(w);
        case CRIT_SMALLEST_FINAL: return -fabsf(w);
        case CRIT_SMALLEST_CHANGE: return -fabsf(d);
        case CRIT_LARGEST_INCREASE: return fabsf(w) - fabsf(w0);
        case CRIT_SMALLEST_INCREASE: return fabsf(w0) - fabsf(w);
        default: return fabsf(d);
    }
}
__device__ __forceinline__ double criterion_f64(int crit, double w, double w0, double d) {
    switch (crit) {
        case CRIT_LARGEST_FINAL: return fabs(w);
        case CRIT_SMALLEST_FINAL: return -fabs(w);
        case CRIT_SMALLEST_CHANGE: return -fabs(d);
        case CRIT_LARGEST_INCREASE: return fabs(w) - fabs(w0);
        case CRIT_SMALLEST_INCREASE: return fabs(w0) - fabs(w);
        default: return fabs(d);
    }
}

// The one per-element front of every selection kernel: the fp32 score of element i (the caller's, or the
// criterion's of the delta and the weights) and its delta (d32, or d64 for an fp64 tensor); bad: the delta is
// not finite.
__device__ __forceinline__ float element_score(const void* nw, const void* bs, const void* rs, const void* sc, int dt,
                                               int sdt, int crit, i64 i, bool& bad, float& d32, double& d64)
{
    if (dt == DT_F64) {
        d64 = delta_f64(nw, bs, rs, i);
        bad = !finite_f64(d64);
        if (crit == CRIT_EXTERNAL) return load_f32(sc, sdt, i);
        const double w = ((const double*)nw)[i], w0 = bs ? ((const double*)bs)[i] : 0.0;
        return (float)criterion_f64(crit, w, w0, d64);
    }
    d32 = delta_f32(nw, bs, rs, dt, i);
    bad = !finite_f32(d32);
    if (crit == CRIT_EXTERNAL) return load_f32(sc, sdt, i);
    return criterion_f32(crit, load_f32(nw, dt, i), bs ? load_f32(bs, dt, i) : 0.0f, d32);
}

// The fp32 score key of element i and whether its delta or score is non-finite; the delta goes to d32 or d64.
__device__ __forceinline__ u32 element_key(const void* nw, const void* bs, const void* rs, const void* sc, int dt,
                                           int sdt, int crit, i64 i, bool& bad, float& d32, double& d64)
{
    const float s = element_score(nw, bs, rs, sc, dt, sdt, crit, i, bad, d32, d64);
    bad |= !finite_f32(s);
    return score_key(s);
}

// keys[elem_off[t] + i] = key(score of element i of tensor t). A non-finite delta or score records the lowest
// offending tensor index in *err (initialised to ~0 by the caller).
extern "C" __global__ void score_keys(
    int nt, const i64* chunk_start, const i64* elem_off, const i64* numel, const int* dtypes,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* score_ptrs, const int* score_dtypes,
    int crit, u32* keys, u64* err)
{
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const i64 n = numel[t];
    const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
    const int dt = dtypes[t];
    const void* nw = (const void*)new_ptrs[t];
    const void* bs = (const void*)base_ptrs[t];
    const void* rs = (const void*)res_ptrs[t];
    const void* sc = (const void*)score_ptrs[t];
    const int sdt = score_dtypes[t];
    u32* out = keys + elem_off[t];
    bool bad = false;
    for (int j = 0; j < ITEMS; ++j) {
        const i64 i = e0 + (i64)j * BLOCK + threadIdx.x;
        if (i >= n) break;
        bool b;
        float d32;
        double d64;
        out[i] = element_key(nw, bs, rs, sc, dt, sdt, crit, i, b, d32, d64);
        bad |= b;
    }
    if (bad) atomicMin(err, (u64)t);
}

// Dense mode (every element kept): the values in one pass, without keys. vals32/vals64[elem_off[t] + i] = delta
// of element i of tensor t; a non-finite delta, or a non-finite score from a caller's score function, records the
// lowest offending tensor in *err (a built-in criterion selects nothing here: its fp32 score of a finite fp64
// delta past the fp32 range is not an error). The caller discards the values if *err was set, and only then
// touches a residual.
extern "C" __global__ void dense_delta(
    int nt, const i64* chunk_start, const i64* elem_off, const i64* numel, const int* dtypes,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* score_ptrs, const int* score_dtypes,
    int crit, float* vals32, double* vals64, u64* err)
{
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const i64 n = numel[t];
    const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
    const int dt = dtypes[t];
    const void* nw = (const void*)new_ptrs[t];
    const void* bs = (const void*)base_ptrs[t];
    const void* rs = (const void*)res_ptrs[t];
    const void* sc = (const void*)score_ptrs[t];
    const int sdt = score_dtypes[t];
    const i64 off = elem_off[t];
    bool bad = false;
    for (int j = 0; j < ITEMS; ++j) {
        const i64 i = e0 + (i64)j * BLOCK + threadIdx.x;
        if (i >= n) break;
        bool b;
        float d32;
        double d64;
        const float s = element_score(nw, bs, rs, sc, dt, sdt, crit, i, b, d32, d64);
        if (dt == DT_F64) vals64[off + i] = d64;
        else vals32[off + i] = d32;
        bad |= b || (crit == CRIT_EXTERNAL && !finite_f32(s));
    }
    if (bad) atomicMin(err, (u64)t);
}

// One radix digit (8 bits at `shift`) of the keys that still match their segment's prefix.
// state holds 2 u64 per segment: [prefix, k_remaining]; hist holds 256 u64 per segment.
extern "C" __global__ void radix_hist(
    int nt, const i64* chunk_start, const i64* elem_off, const i64* numel, const int* seg_of,
    const u32* keys, const u64* state, int shift, u64* hist)
{
    __shared__ u32 local[256];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const int s = seg_of[t];
    for (int b = threadIdx.x; b < 256; b += BLOCK) local[b] = 0;
    __syncthreads();
    const u64 k_rem = state[2 * s + 1];
    if (k_rem != 0) {
        const u32 prefix = (u32)state[2 * s];
        const i64 n = numel[t];
        const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
        const u32* in = keys + elem_off[t];
        for (int j = 0; j < ITEMS; ++j) {
            const i64 i = e0 + (i64)j * BLOCK + threadIdx.x;
            if (i >= n) break;
            const u32 key = in[i];
            if (shift == 24 || (key >> (shift + 8)) == (prefix >> (shift + 8)))
                atomicAdd(&local[(key >> shift) & 255u], 1u);
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += BLOCK)
        if (local[b]) atomicAdd(&hist[256 * (i64)s + b], (u64)local[b]);
}

// Choose the digit that holds the k-th largest key of each segment, then clear that segment's histogram.
extern "C" __global__ void radix_pick(int nseg, int shift, u64* hist, u64* state)
{
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= nseg) return;
    u64 k_rem = state[2 * s + 1];
    u64* h = hist + 256 * (i64)s;
    if (k_rem != 0) {
        u32 prefix = (u32)state[2 * s];
        for (int b = 255; b >= 0; --b) {
            const u64 cnt = h[b];
            if (k_rem <= cnt) { prefix |= ((u32)b) << shift; break; }
            k_rem -= cnt;
        }
        state[2 * s] = prefix;
        state[2 * s + 1] = k_rem;
    }
    for (int b = 0; b < 256; ++b) h[b] = 0;
}

// Per chunk: how many keys are above the segment's threshold, and how many equal it.
// After the radix passes state = [T, take_eq] per segment; a segment with k = 0 has take_eq = 0 and T = ~0.
extern "C" __global__ void chunk_count(
    int nt, const i64* chunk_start, const i64* elem_off, const i64* numel, const int* seg_of,
    const u32* keys, const u64* state, u32* cnt)
{
    __shared__ u32 sg[WARPS], se[WARPS];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const int s = seg_of[t];
    const u32 T = (u32)state[2 * s];
    const i64 n = numel[t];
    const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
    const u32* in = keys + elem_off[t];
    u32 g = 0, e = 0;
    for (int j = 0; j < ITEMS; ++j) {
        const i64 i = e0 + (i64)j * BLOCK + threadIdx.x;
        if (i >= n) break;
        const u32 key = in[i];
        g += key > T;
        e += key == T;
    }
    for (int o = 16; o > 0; o >>= 1) {
        g += __shfl_down_sync(0xFFFFFFFFu, g, o);
        e += __shfl_down_sync(0xFFFFFFFFu, e, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sg[warp] = g; se[warp] = e; }
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 G = 0, E = 0;
        for (int w = 0; w < WARPS; ++w) { G += sg[w]; E += se[w]; }
        cnt[2 * c] = G;
        cnt[2 * c + 1] = E;
    }
}

// The chunk scan: eq_base[c] = equal keys of c's segment in its earlier chunks; out_base[c] = output position of
// chunk c's first kept entry (nchunks + 1 entries, the last is the total); tensor_counts[t] = entries kept in t.
// A reduce-then-scan over blocks of CHUNK_SCAN_THREADS chunks (one a thread) in three launches, chunk_scan_reduce
// -> chunk_scan_eq -> chunk_scan_out, each reading only what the launches before it wrote, so that the blocks of
// a launch are independent. part holds CHUNK_SCAN_PART = 3 u64 per block b: [3b] equal keys from the block's last
// segment start (its first chunk if no segment starts in it) to its end; [3b + 1] entries kept in the block;
// [3b + 2] entries kept in the block by the tensor of its last chunk. Each block folds the partials of the blocks
// before it itself (no single-block pass in between). A segment's chunks are consecutive and seg_first_chunk is
// nondecreasing (an empty segment has the next one's first chunk), so c's segment is the last s with
// seg_first_chunk[s] <= c.
#if CHUNK_SCAN_PART != 3
#error "chunk_scan_* write 3 partials per block"
#endif

// Sum of v over the block, for every thread (sh: CHUNK_SCAN_THREADS entries).
__device__ __forceinline__ u64 block_sum(u64 v, u64* sh) {
    const u64 e = block_exclusive_scan(v, sh, CHUNK_SCAN_THREADS);
    if (threadIdx.x == CHUNK_SCAN_THREADS - 1) sh[0] = e + v;
    __syncthreads();
    const u64 r = sh[0];
    __syncthreads();
    return r;
}

// Entries kept in a chunk with gt keys above its segment's threshold and eq equal to it, eq_before equal keys of
// the segment in earlier chunks, and take equal keys to keep in the segment (lowest index first).
__device__ __forceinline__ u64 chunk_take(u64 gt, u64 eq, u64 eq_before, u64 take) {
    const u64 rest = take > eq_before ? take - eq_before : 0ull;
    return gt + (rest < eq ? rest : eq);
}

// part[3b] of every block b.
extern "C" __global__ void chunk_scan_reduce(
    i64 nchunks, int nseg, const i64* seg_first_chunk, const u32* cnt, u64* part)
{
    __shared__ u64 sh[CHUNK_SCAN_THREADS];
    const i64 b = blockIdx.x, c0 = b * CHUNK_SCAN_THREADS, c = c0 + threadIdx.x;
    const i64 c1 = c0 + CHUNK_SCAN_THREADS < nchunks ? c0 + CHUNK_SCAN_THREADS : nchunks;
    const i64 f = seg_first_chunk[tensor_of_chunk(seg_first_chunk, nseg, c1 - 1)];  // the block's last segment
    const u64 eq = c < c1 && c >= f ? cnt[2 * c + 1] : 0u;
    const u64 tail = block_sum(eq, sh);
    if (threadIdx.x == 0) part[CHUNK_SCAN_PART * b] = tail;
}

// eq_base, part[3b + 1] and part[3b + 2]; out_base[c] = entries kept in chunk c (chunk_scan_out scans them).
extern "C" __global__ void chunk_scan_eq(
    int nt, i64 nchunks, const i64* chunk_start, int nseg, const i64* seg_first_chunk, const u64* state,
    const u32* cnt, u64* part, u64* eq_base, u64* out_base)
{
    __shared__ u64 sh[CHUNK_SCAN_THREADS];
    __shared__ u64 xs[CHUNK_SCAN_THREADS + 1];
    const i64 b = blockIdx.x, c0 = b * CHUNK_SCAN_THREADS, c = c0 + threadIdx.x;
    const i64 c1 = c0 + CHUNK_SCAN_THREADS < nchunks ? c0 + CHUNK_SCAN_THREADS : nchunks;
    const bool valid = c < c1;
    // equal keys of the block's first segment before c0: from its first chunk (in block bf) to the end of bf,
    // then every block in between
    const i64 bf = seg_first_chunk[tensor_of_chunk(seg_first_chunk, nseg, c0)] / CHUNK_SCAN_THREADS;
    u64 acc = 0;
    for (i64 q = bf + threadIdx.x; q < b; q += CHUNK_SCAN_THREADS) acc += part[CHUNK_SCAN_PART * q];
    const u64 carry = block_sum(acc, sh);
    const int s = valid ? tensor_of_chunk(seg_first_chunk, nseg, c) : 0;
    const i64 f = seg_first_chunk[s];
    const u64 gt = valid ? cnt[2 * c] : 0u, eq = valid ? cnt[2 * c + 1] : 0u;
    const u64 ex = block_exclusive_scan(eq, sh, CHUNK_SCAN_THREADS);
    xs[threadIdx.x] = ex;
    __syncthreads();
    const u64 before = f >= c0 ? ex - xs[f - c0] : carry + ex;
    const u64 kept = valid ? chunk_take(gt, eq, before, state[2 * s + 1]) : 0ull;
    if (valid) {
        eq_base[c] = before;
        out_base[c] = kept;
    }
    __syncthreads();
    const u64 kx = block_exclusive_scan(kept, sh, CHUNK_SCAN_THREADS);
    xs[threadIdx.x] = kx;
    if (threadIdx.x == CHUNK_SCAN_THREADS - 1) xs[CHUNK_SCAN_THREADS] = kx + kept;
    __syncthreads();
    if (threadIdx.x == 0) {
        const i64 ft = chunk_start[tensor_of_chunk(chunk_start, nt, c1 - 1)];
        part[CHUNK_SCAN_PART * b + 1] = xs[CHUNK_SCAN_THREADS];
        part[CHUNK_SCAN_PART * b + 2] = xs[CHUNK_SCAN_THREADS] - xs[ft > c0 ? ft - c0 : 0];
    }
}

// out_base (from the per-chunk kept counts chunk_scan_eq left there) and tensor_counts.
extern "C" __global__ void chunk_scan_out(
    int nt, i64 nchunks, const i64* chunk_start, const u64* part, u64* out_base, u64* tensor_counts)
{
    __shared__ u64 sh[CHUNK_SCAN_THREADS];
    __shared__ u64 xs[CHUNK_SCAN_THREADS + 1];
    const i64 b = blockIdx.x, c0 = b * CHUNK_SCAN_THREADS, c = c0 + threadIdx.x;
    const bool valid = c < nchunks;
    // the tensor of the block's first chunk, if it starts in an earlier block bs, kept part[3bs + 2] there and
    // everything in the blocks in between
    const i64 bs = chunk_start[tensor_of_chunk(chunk_start, nt, c0)] / CHUNK_SCAN_THREADS;
    u64 acc = 0, mid = 0;
    for (i64 q = threadIdx.x; q < b; q += CHUNK_SCAN_THREADS) {
        const u64 k = part[CHUNK_SCAN_PART * q + 1];
        acc += k;
        if (q > bs) mid += k;
    }
    const u64 base = block_sum(acc, sh);
    const u64 head = bs < b ? part[CHUNK_SCAN_PART * bs + 2] + block_sum(mid, sh) : 0ull;
    const u64 kept = valid ? out_base[c] : 0ull;
    const u64 kx = block_exclusive_scan(kept, sh, CHUNK_SCAN_THREADS);
    xs[threadIdx.x] = kx;
    if (threadIdx.x == CHUNK_SCAN_THREADS - 1) xs[CHUNK_SCAN_THREADS] = kx + kept;
    __syncthreads();
    if (!valid) return;
    out_base[c] = base + kx;
    // tensor t is counted by its last chunk; empty tensors by the chunk that follows them (the last chunk for
    // those at the end)
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const i64 ft = chunk_start[t];
    const u64 upto = xs[threadIdx.x + 1];  // kept in the block up to and including chunk c
    if (c == nchunks - 1) out_base[nchunks] = base + upto;
    if (c + 1 == chunk_start[t + 1]) tensor_counts[t] = ft >= c0 ? upto - xs[ft - c0] : head + upto;
    if (c == ft)
        for (int e = t - 1; e >= 0 && chunk_start[e] == c; --e) tensor_counts[e] = 0;
    if (c == nchunks - 1)
        for (int e = nt - 1; e > t; --e) tensor_counts[e] = 0;
}

// Round-trip a kept value through what the receiver decodes, for the error-feedback residual.
__device__ __forceinline__ float decoded_f32(float d, int qmode) {
    if (qmode == QMODE_F16) return f16_bits_to_float(float_to_f16_bits(d));
    if (qmode == QMODE_BF16) return bf16_bits_to_float(float_to_bf16_bits(d));
    return d;
}
__device__ __forceinline__ double decoded_f64(double d, int qmode) {
    if (qmode == QMODE_EXACT) return d;
    return (double)decoded_f32((float)d, qmode);
}

// One round of BLOCK entries in index order (chunk_write, cand_write): whether this thread's entry is kept (above
// the threshold, or equal to it and among the first `take` equal entries of the segment, eq_seen of them before
// this round) and how many kept entries of the round come before it. wsel and weq: WARPS entries of shared memory.
__device__ __forceinline__ bool rank_select(
    bool gt, bool eq, u64 eq_seen, u64 take, u32* wsel, u32* weq, u32& sel_before)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 lt_mask = (1u << lane) - 1u;
    const u32 beq = __ballot_sync(0xFFFFFFFFu, eq);
    if (lane == 0) weq[warp] = __popc(beq);
    __syncthreads();
    u32 eq_before = __popc(beq & lt_mask);
    for (int w = 0; w < warp; ++w) eq_before += weq[w];
    const bool sel = gt || (eq && eq_seen + eq_before < take);
    const u32 bsel = __ballot_sync(0xFFFFFFFFu, sel);
    if (lane == 0) wsel[warp] = __popc(bsel);
    __syncthreads();
    sel_before = __popc(bsel & lt_mask);
    for (int w = 0; w < warp; ++w) sel_before += wsel[w];
    return sel;
}

// After a round of rank_select: every thread's pos and eq_seen move past the round's kept and equal entries.
__device__ __forceinline__ void rank_advance(const u32* wsel, const u32* weq, u32* tot, u64& pos, u64& eq_seen) {
    if (threadIdx.x == 0) {
        u32 a = 0, b = 0;
        for (int w = 0; w < WARPS; ++w) { a += wsel[w]; b += weq[w]; }
        tot[0] = a;
        tot[1] = b;
    }
    __syncthreads();
    pos += tot[0];
    eq_seen += tot[1];
    __syncthreads();
}

// Ordered compaction: writes the kept entries of every chunk at out_base[c] onwards, flat index ascending,
// ties at T taken lowest index first. Values go to vals32 (fp32/fp16/bf16 tensors) or vals64 (fp64 tensors)
// at the same slot. If res_out_ptrs[t] is non-zero, the residual of every element of t is rewritten there:
// d - decoded(d) where kept, d elsewhere (it may alias res_ptrs[t]).
template <typename IDX>
__device__ __forceinline__ void chunk_write_impl(
    int nt, const i64* chunk_start, const i64* elem_off, const i64* numel, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* res_out_ptrs, int qmode,
    const u32* keys, const u64* state, const u64* eq_base, const u64* out_base,
    IDX* out_idx, float* vals32, double* vals64)
{
    __shared__ u32 wsel[WARPS], weq[WARPS];
    __shared__ u32 tot[2];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const int s = seg_of[t];
    const u32 T = (u32)state[2 * s];
    const u64 take = state[2 * s + 1];
    const i64 n = numel[t];
    const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
    const int dt = dtypes[t];
    const void* nw = (const void*)new_ptrs[t];
    const void* bs = (const void*)base_ptrs[t];
    const void* rs = (const void*)res_ptrs[t];
    void* ro = (void*)res_out_ptrs[t];
    const u32* in = keys + elem_off[t];
    u64 eq_seen = eq_base[c];
    u64 pos = out_base[c];
    for (int j = 0; j < ITEMS; ++j) {
        const i64 i0 = e0 + (i64)j * BLOCK;
        if (i0 >= n) break;  // uniform across the block
        const i64 i = i0 + threadIdx.x;
        const bool valid = i < n;
        const u32 key = valid ? in[i] : 0u;
        const bool gt = valid && key > T;
        const bool eq = valid && key == T;
        u32 sel_before;
        const bool sel = rank_select(gt, eq, eq_seen, take, wsel, weq, sel_before);
        if (valid && (sel || ro)) {
            const u64 slot = pos + sel_before;
            if (dt == DT_F64) {
                const double d = delta_f64(nw, bs, rs, i);
                if (sel) { out_idx[slot] = (IDX)i; vals64[slot] = d; }
                if (ro) ((double*)ro)[i] = sel ? d - decoded_f64(d, qmode) : d;
            } else {
                const float d = delta_f32(nw, bs, rs, dt, i);
                if (sel) { out_idx[slot] = (IDX)i; vals32[slot] = d; }
                if (ro) ((float*)ro)[i] = sel ? d - decoded_f32(d, qmode) : d;
            }
        }
        rank_advance(wsel, weq, tot, pos, eq_seen);
    }
}

extern "C" __global__ void chunk_write_u32(
    int nt, const i64* chunk_start, const i64* elem_off, const i64* numel, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* res_out_ptrs, int qmode,
    const u32* keys, const u64* state, const u64* eq_base, const u64* out_base,
    u32* out_idx, float* vals32, double* vals64)
{
    chunk_write_impl<u32>(nt, chunk_start, elem_off, numel, dtypes, seg_of, new_ptrs, base_ptrs, res_ptrs,
                          res_out_ptrs, qmode, keys, state, eq_base, out_base, out_idx, vals32, vals64);
}

extern "C" __global__ void chunk_write_u64(
    int nt, const i64* chunk_start, const i64* elem_off, const i64* numel, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* res_out_ptrs, int qmode,
    const u32* keys, const u64* state, const u64* eq_base, const u64* out_base,
    u64* out_idx, float* vals32, double* vals64)
{
    chunk_write_impl<u64>(nt, chunk_start, elem_off, numel, dtypes, seg_of, new_ptrs, base_ptrs, res_ptrs,
                          res_out_ptrs, qmode, keys, state, eq_base, out_base, out_idx, vals32, vals64);
}

// ------------------------------------------------------------------------------------------------------------
// Fused selection: the full tensors are read once.
//
// sample_keys -> (host: a low bracket lo per segment and the size of one candidate pool from the sample, each
// sampled key weighed by the elements it stands for) -> fused_scan, or fused_scan_f32 for fp32 tensors scored by
// the magnitude of their delta (one pass, a block per chunk: delta, key, checks, residual = delta where written
// early, in-order compaction of the chunk's keys above lo in shared memory, the keys equal to lo only counted,
// then one atomicAdd for the chunk's place in the pool; a segment that is one chunk is selected whole there,
// without a sample) -> cand_select (exact radix select on the candidates, one
// block per segment) or, where a segment has many chunks, 4 x (cand_hist, radix_pick) (a block per chunk) ->
// cand_count -> the chunk scan -> cand_write_{u32,u64} -> [tie_write_{u32,u64}] -> [residual_delta] ->
// kept_fix_{u32,u64}.
// A segment with fewer candidates than k but enough keys equal to lo (exact zeros, ties) keeps its candidates and
// its first keys equal to lo: no selection runs for it, and tie_write reads again the few chunks that supply them.
// If a segment has fewer than k keys at or above lo (the bracket missed) or the pool overflows (only the total of
// every chunk's candidates can), the caller runs the unfused passes above instead, which are exact for any input.
// Twins with the same names and arguments are in cpu_fallback/fused.py.

// fused_scan: consecutive elements a thread per round (a round of BLOCK * SCAN_VEC elements, one barrier)
#define SCAN_VEC 2
static_assert(ITEMS % SCAN_VEC == 0, "a chunk is a whole number of fused_scan rounds");


// The element that sample slot r of tensor t reads (see sample_keys); the NumPy twin is
// gpu_codec.backends.kernels.sample_positions.
__device__ __forceinline__ i64 sample_position(int t, i64 r, i64 n, i64 stride, int run)
{
    const i64 w = r / run;
    const i64 start = w * stride;
    const i64 len = (n - start < stride ? n - start : stride) / run;  // whole runs in window w
    u32 h = ((u32)w ^ ((u32)t * 0x632BE5ABu)) * 0x9E3779B1u;
    h ^= h >> 15;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    const i64 off = len > 1 ? (i64)((u64)h % (u64)len) * run : 0;
    return start + off + r % run;
}

// keys[j] = key of sample slot j. Slot j of tensor t (samp_off[t] <= j < samp_off[t + 1]) is slot r = j - samp_off[t]
// of window w = r / run (the elements [w * stride[t], (w + 1) * stride[t])): runs of `run` consecutive elements,
// one run a window at a run-aligned place that a hash of (t, w) picks, so that the sample does not fall in step
// with rows or channels. Non-finite values are not reported here (fused_scan checks every element).
extern "C" __global__ void sample_keys(
    int nt, u64 total, const u64* samp_off, const i64* numel, const i64* stride, int run, const int* dtypes,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* score_ptrs, const int* score_dtypes,
    int crit, u32* keys)
{
    const u64 j = (u64)blockIdx.x * BLOCK + threadIdx.x;
    if (j >= total) return;
    const int t = tensor_of_entry(samp_off, nt, j);
    const i64 i = sample_position(t, (i64)(j - samp_off[t]), numel[t], stride[t], run);
    bool bad;
    float d32;
    double d64;
    keys[j] = element_key((const void*)new_ptrs[t], (const void*)base_ptrs[t], (const void*)res_ptrs[t],
                          (const void*)score_ptrs[t], dtypes[t], score_dtypes[t], crit, i, bad, d32, d64);
}

// A segment of a few chunks (own_k: gpu_codec/backends/kernels.py OWN_CHUNKS) is selected by fused_scan's blocks: in
// each chunk, the exact radix select on the m staged keys (every key of the chunk: its lo is 0), then the k kept
// entries compacted in place, in index order (the keys above the threshold and the first ones equal to it);
// returns min(k, m) (a chunk of at most k elements keeps them all). The segment's k best are among the chunks'
// (a chunk leaves out only elements that k of its own beat), and the later kernels select them exactly.
__device__ __forceinline__ u32 own_select(u16* st_idx, u32* st_key, u32 m, u32 k, u32* wa, u32* wb, u32* hist,
                                          u32& sh_prefix, u32& sh_k)
{
    if (threadIdx.x == 0) { sh_prefix = 0; sh_k = k; }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += BLOCK) hist[b] = 0;
        __syncthreads();
        const u32 top = sh_prefix >> (shift + 8);  // shift 24: the whole key matches (a shift of 32 is not one)
        for (u32 j = threadIdx.x; j < m; j += BLOCK) {
            const u32 key = st_key[j];
            if (shift == 24 || (key >> (shift + 8)) == top) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 k_rem = sh_k;
            for (int b = 255; b >= 0; --b) {
                if (k_rem <= hist[b]) { sh_prefix |= ((u32)b) << shift; break; }
                k_rem -= hist[b];
            }
            sh_k = k_rem;
        }
        __syncthreads();
    }
    const u32 T = sh_prefix, take = sh_k;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 lt_mask = (1u << lane) - 1u;
    u32 out = 0, eq_seen = 0;
    for (u32 j0 = 0; j0 < m; j0 += BLOCK) {  // uniform across the block
        const u32 j = j0 + threadIdx.x;
        const u32 key = j < m ? st_key[j] : 0u;  // keys are never 0 (a NaN's), so 0 is below every threshold
        const u16 idx = j < m ? st_idx[j] : (u16)0;
        const bool eq = j < m && key == T;
        const u32 beq = __ballot_sync(0xFFFFFFFFu, eq);
        if (lane == 0) wb[warp] = __popc(beq);
        __syncthreads();
        u32 eq_before = eq_seen + __popc(beq & lt_mask);
        for (int w = 0; w < warp; ++w) eq_before += wb[w];
        const bool sel = key > T || (eq && eq_before < take);
        const u32 bsel = __ballot_sync(0xFFFFFFFFu, sel);
        if (lane == 0) wa[warp] = __popc(bsel);
        __syncthreads();
        u32 slot = out + __popc(bsel & lt_mask);
        for (int w = 0; w < WARPS; ++w) {
            if (w < warp) slot += wa[w];
            out += wa[w];
            eq_seen += wb[w];
        }
        if (sel) {  // at or before j: every entry of this round was read before the barriers above
            st_key[slot] = key;
            st_idx[slot] = idx;
        }
        __syncthreads();  // wa and wb read before the next round writes them
    }
    return m < k ? m : k;
}

// fused_scan's round (BLOCK threads, VEC consecutive elements a thread from local index lb, keys key[], mask: those
// above lo): the selected ones staged in index order (thread by thread, then within a thread) at pos onwards in
// st_idx / st_key; ws: this round's WARPS per-warp counts (two sets alternate, so one barrier a round). Returns the
// round's selected count.
template <int VEC>
__device__ __forceinline__ u32 stage_round(const u32 (&key)[VEC], u32 mask, u32 lb, u32 pos, u32* ws, u16* st_idx,
                                           u32* st_key)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 cnt = __popc(mask);
    u32 incl = cnt;
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xFFFFFFFFu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) ws[warp] = incl;
    __syncthreads();
    u32 before = incl - cnt, total = 0;
    for (int w = 0; w < WARPS; ++w) {
        const u32 x = ws[w];
        total += x;
        if (w < warp) before += x;
    }
    u32 slot = pos + before;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
        if ((mask >> v) & 1u) {
            st_idx[slot] = (u16)(lb + v);
            st_key[slot] = key[v];
            ++slot;
        }
    }
    return total;
}

// The end of fused_scan's block, after its rounds (pos staged candidates, eqs this thread's keys equal to lo):
// the check word, the chunk selected whole where its segment is this chunk, and the chunk's place in the pool.
__device__ __forceinline__ void place_chunk(
    i64 c, int t, int s, bool bad_any, u32 pos, u32 eqs, const u64* own_k, u64 pool_cap, u64* cand_base,
    u32* cand_cnt, u16* cand_idx, u32* cand_key, u32* eq_cnt, u64* status, u32 (*wsel)[WARPS], u16* st_idx,
    u32* st_key, u64& sh_at, u32& sh_eq, u32* own_hist, u32* own)
{
    if (bad_any) atomicMin(&status[0], (u64)t);
    const u64 K = own_k[s];
    if (K) pos = own_select(st_idx, st_key, pos, (u32)K, wsel[0], wsel[1], own_hist, own[0], own[1]);  // uniform
    for (int o = 16; o > 0; o >>= 1) eqs += __shfl_down_sync(0xFFFFFFFFu, eqs, o);
    if ((threadIdx.x & 31) == 0 && eqs) atomicAdd(&sh_eq, eqs);
    __syncthreads();
    if (threadIdx.x == 0) {
        const u64 at = pos ? atomicAdd(&status[1], (u64)pos) : 0;
        const bool fits = at + pos <= pool_cap;
        cand_base[c] = fits ? at : 0;
        cand_cnt[c] = fits ? pos : 0u;
        eq_cnt[c] = sh_eq;
        if (pos) atomicAdd(&status[2 + 2 * s], (u64)pos);
        if (sh_eq) atomicAdd(&status[3 + 2 * s], (u64)sh_eq);
        sh_at = fits ? at : ~0ull;
    }
    __syncthreads();
    const u64 at = sh_at;
    if (at != ~0ull) {
        for (u32 j = threadIdx.x; j < pos; j += BLOCK) {
            cand_idx[at + j] = st_idx[j];
            cand_key[at + j] = st_key[j];
        }
    }
}

// One block per chunk, SCAN_VEC consecutive elements a thread per round and one barrier a round (the per-warp
// counts double-buffered): key and checks (status[0] = lowest tensor with a non-finite delta or score,
// initialised to ~0), residual = delta into early_ptrs[t] where non-zero, and the elements whose key is above
// lo[seg] (lo = 2^32: none) compacted in index order into shared memory (cand_idx = index within the chunk,
// cand_key = key); the keys equal to lo are only counted, eq_cnt[c] (a bracket on a value that many elements
// share, exact zeros or ties, then costs no candidate slots). The chunk then takes its place in the candidate
// pool with one atomicAdd on status[1] (the pool's fill, which counts every candidate, stored or not): chunk c's
// candidates start at cand_base[c] and cand_cnt[c] of them were stored (0 where the pool of pool_cap entries
// could not hold them). Chunks lie in the pool in the order their blocks finish; later kernels find them through
// cand_base and cand_cnt only. status[2 + 2s] += candidates of segment s, status[3 + 2s] += its keys equal to lo.
// Any dtype, criterion and score; fused_scan_f32 below is the common case's specialisation.
extern "C" __global__ void fused_scan(
    int nt, const i64* chunk_start, const i64* numel, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* score_ptrs, const int* score_dtypes,
    int crit, const u64* early_ptrs, const u64* lo, const u64* own_k, u64 pool_cap, u64* cand_base, u32* cand_cnt,
    u16* cand_idx, u32* cand_key, u32* eq_cnt, u64* status)
{
    __shared__ u32 wsel[2][WARPS];  // per warp, selected in the round; two sets, so one barrier a round
    __shared__ u16 st_idx[CHUNK];   // the chunk's candidates, staged in index order
    __shared__ u32 st_key[CHUNK];
    __shared__ u64 sh_at;
    __shared__ u32 sh_eq;
    __shared__ u32 own_hist[256], own[2];  // own_select's histogram, threshold and keys equal to it to take
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const int s = seg_of[t];
    const u64 L = lo[s];
    const i64 n = numel[t];
    const int dt = dtypes[t];
    const void* nw = (const void*)new_ptrs[t];
    const void* bs = (const void*)base_ptrs[t];
    const void* rs = (const void*)res_ptrs[t];
    const void* sc = (const void*)score_ptrs[t];
    void* ep = (void*)early_ptrs[t];
    const int sdt = score_dtypes[t];
    const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
    u32 pos = 0, eqs = 0;
    int parity = 0;
    bool bad_any = false;
    if (threadIdx.x == 0) sh_eq = 0;  // read after the rounds' barriers
    for (int j = 0; j < ITEMS / SCAN_VEC; ++j) {
        const i64 i0 = e0 + (i64)j * (BLOCK * SCAN_VEC);
        if (i0 >= n) break;  // uniform across the block
        const i64 ib = i0 + (i64)threadIdx.x * SCAN_VEC;  // SCAN_VEC consecutive elements a thread
        u32 key[SCAN_VEC];
        u32 mask = 0;
#pragma unroll
        for (int v = 0; v < SCAN_VEC; ++v) {
            const i64 i = ib + v;
            key[v] = 0;
            if (i < n) {
                bool bad;
                float d32 = 0.0f;
                double d64 = 0.0;
                key[v] = element_key(nw, bs, rs, sc, dt, sdt, crit, i, bad, d32, d64);
                bad_any |= bad;
                if (ep) {
                    if (dt == DT_F64) ((double*)ep)[i] = d64;
                    else ((float*)ep)[i] = d32;
                }
                mask |= (u32)((u64)key[v] > L) << v;
                eqs += (u64)key[v] == L;
            }
        }
        pos += stage_round<SCAN_VEC>(key, mask, (u32)(ib - e0), pos, wsel[parity], st_idx, st_key);
        parity ^= 1;
    }
    place_chunk(c, t, s, bad_any, pos, eqs, own_k, pool_cap, cand_base, cand_cnt, cand_idx, cand_key, eq_cnt,
                status, wsel, st_idx, st_key, sh_at, sh_eq, own_hist, own);
}

// fused_scan_f32: fused_scan where every tensor is fp32 (its base and residual too) and scored by the magnitude of
// its delta (CRIT_MAGNITUDE or CRIT_LARGEST_CHANGE, no score of the caller's), which the host checks before it
// launches this instead (gpu_codec/backends/kernels.py, scan_kernel): the same arguments, the same outputs to the
// bit. It aims at the full width of the memory system: SCAN_VEC_F32 = 4 consecutive elements a thread per round,
// so that new, base and residual are read, and the early residual written, with one 128-bit access a thread each
// (a warp's access is 512 contiguous bytes) where the tensor's four addresses are 16-byte aligned (a chunk starts
// CHUNK elements apart, so every thread's 4 elements then are too); scalar accesses for the elements past the last
// whole vector of a tensor and for every element of a tensor with a misaligned address. 32-bit offsets within the
// chunk keep it within fused_scan's register budget. Its speed on a GPU is unmeasured (benchmarks/gpu_suite.py's
// ncu step measures both scans' loads and traffic on the first run).
#define SCAN_VEC_F32 4
static_assert(ITEMS % SCAN_VEC_F32 == 0, "a chunk is a whole number of fused_scan_f32 rounds");
static_assert(CHUNK % SCAN_VEC_F32 == 0 && CHUNK <= 65536, "chunks start 16-byte aligned; u16 local indices");

// Element i of a 16-bit tensor (fp16 or bf16, as dt says) widened to fp32, exactly.
__device__ __forceinline__ float h16_to_f32(u16 h, int dt) {
    return dt == DT_BF16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
}

// Elements i..i + 3 of a tensor widened to fp32: one 128-bit read-only load (fp32) or one 64-bit one (H16: fp16 or
// bf16, dt says which; element i is the low half of the first word).
template <bool H16>
__device__ __forceinline__ float4 load4(const void* p, u32 i, int dt) {
    if (!H16) return __ldg((const float4*)((const float*)p + i));
    const uint2 w = __ldg((const uint2*)((const u16*)p + i));
    float4 a;
    a.x = h16_to_f32((u16)(w.x & 0xFFFFu), dt);
    a.y = h16_to_f32((u16)(w.x >> 16), dt);
    a.z = h16_to_f32((u16)(w.y & 0xFFFFu), dt);
    a.w = h16_to_f32((u16)(w.y >> 16), dt);
    return a;
}

template <bool H16>
__device__ __forceinline__ float load1(const void* p, u32 i, int dt) {
    if (!H16) return __ldg((const float*)p + i);
    return h16_to_f32(__ldg((const u16*)p + i), dt);
}

// The body of fused_scan_f32 (H16 false: every tensor fp32) and fused_scan_h16 (H16 true: every tensor fp16 or
// bf16, its residual fp32): the inputs read four elements a thread with one wide load each where the tensor's
// addresses allow it (new and base 16-byte aligned for fp32, 8-byte for 16-bit; residual and early residual, fp32,
// 16-byte), scalar loads otherwise; the same outputs as fused_scan.
template <bool H16>
__device__ __forceinline__ void scan_vec(
    int nt, const i64* chunk_start, const i64* numel, const int* dtypes, const int* seg_of, const u64* new_ptrs,
    const u64* base_ptrs, const u64* res_ptrs, const u64* early_ptrs, const u64* lo, const u64* own_k, u64 pool_cap,
    u64* cand_base, u32* cand_cnt, u16* cand_idx, u32* cand_key, u32* eq_cnt, u64* status)
{
    __shared__ u32 wsel[2][WARPS];  // fused_scan's shared memory, one set per instantiation (per kernel)
    __shared__ u16 st_idx[CHUNK];
    __shared__ u32 st_key[CHUNK];
    __shared__ u64 sh_at;
    __shared__ u32 sh_eq;
    __shared__ u32 own_hist[256], own[2];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const int s = seg_of[t];
    const u64 L = lo[s];
    const int dt = H16 ? dtypes[t] : DT_F32;
    const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
    const i64 left = numel[t] - e0;
    const u32 m = left < CHUNK ? (u32)left : (u32)CHUNK;  // elements in this chunk
    const u64 pn = new_ptrs[t], pb = base_ptrs[t], pr = res_ptrs[t], pe = early_ptrs[t];
    const bool vec = (((pn | pb) & (H16 ? 7u : 15u)) | ((pr | pe) & 15u)) == 0;  // uniform across the block
    const void* nw = H16 ? (const void*)((const u16*)pn + e0) : (const void*)((const float*)pn + e0);
    const void* bs = pb ? (H16 ? (const void*)((const u16*)pb + e0) : (const void*)((const float*)pb + e0)) : nullptr;
    const float* rs = pr ? (const float*)pr + e0 : nullptr;
    float* ep = pe ? (float*)pe + e0 : nullptr;
    u32 pos = 0, eqs = 0;
    int parity = 0;
    bool bad_any = false;
    if (threadIdx.x == 0) sh_eq = 0;  // read after the rounds' barriers
    for (u32 r0 = 0; r0 < m; r0 += BLOCK * SCAN_VEC_F32) {  // uniform across the block
        const u32 ib = r0 + threadIdx.x * SCAN_VEC_F32;
        float d[SCAN_VEC_F32];
        if (vec && ib + SCAN_VEC_F32 <= m) {
            float4 a = load4<H16>(nw, ib, dt);
            if (bs) {
                const float4 b = load4<H16>(bs, ib, dt);
                a.x = a.x - b.x;
                a.y = a.y - b.y;
                a.z = a.z - b.z;
                a.w = a.w - b.w;
            }
            if (rs) {
                const float4 r = __ldg((const float4*)(rs + ib));
                a.x = a.x + r.x;
                a.y = a.y + r.y;
                a.z = a.z + r.z;
                a.w = a.w + r.w;
            }
            if (ep) *(float4*)(ep + ib) = a;
            d[0] = a.x;
            d[1] = a.y;
            d[2] = a.z;
            d[3] = a.w;
        } else {
#pragma unroll
            for (int v = 0; v < SCAN_VEC_F32; ++v) {
                d[v] = 0.0f;
                if (ib + v < m) {
                    d[v] = load1<H16>(nw, ib + v, dt) - (bs ? load1<H16>(bs, ib + v, dt) : 0.0f);
                    if (rs) d[v] = d[v] + __ldg(rs + ib + v);
                    if (ep) ep[ib + v] = d[v];
                }
            }
        }
        u32 key[SCAN_VEC_F32];
        u32 mask = 0;
#pragma unroll
        for (int v = 0; v < SCAN_VEC_F32; ++v) {
            const bool valid = ib + v < m;
            key[v] = valid ? score_key(fabsf(d[v])) : 0u;
            bad_any |= valid && !finite_f32(d[v]);
            mask |= (u32)(valid && (u64)key[v] > L) << v;
            eqs += valid && (u64)key[v] == L;
        }
        pos += stage_round<SCAN_VEC_F32>(key, mask, ib, pos, wsel[parity], st_idx, st_key);
        parity ^= 1;
    }
    place_chunk(c, t, s, bad_any, pos, eqs, own_k, pool_cap, cand_base, cand_cnt, cand_idx, cand_key, eq_cnt,
                status, wsel, st_idx, st_key, sh_at, sh_eq, own_hist, own);
}

extern "C" __global__ void fused_scan_f32(
    int nt, const i64* chunk_start, const i64* numel, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* score_ptrs, const int* score_dtypes,
    int crit, const u64* early_ptrs, const u64* lo, const u64* own_k, u64 pool_cap, u64* cand_base, u32* cand_cnt,
    u16* cand_idx, u32* cand_key, u32* eq_cnt, u64* status)
{
    scan_vec<false>(nt, chunk_start, numel, dtypes, seg_of, new_ptrs, base_ptrs, res_ptrs, early_ptrs, lo, own_k,
                    pool_cap, cand_base, cand_cnt, cand_idx, cand_key, eq_cnt, status);
}

// fused_scan_h16: fused_scan_f32 where every tensor is fp16 or bf16 (a bf16 model's update, say; the residual fp32),
// four elements a thread read with one 64-bit load each of new and base and one 128-bit load of the residual where
// aligned; the same arguments and outputs as fused_scan. Its speed on a GPU is unmeasured.
extern "C" __global__ void fused_scan_h16(
    int nt, const i64* chunk_start, const i64* numel, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* score_ptrs, const int* score_dtypes,
    int crit, const u64* early_ptrs, const u64* lo, const u64* own_k, u64 pool_cap, u64* cand_base, u32* cand_cnt,
    u16* cand_idx, u32* cand_key, u32* eq_cnt, u64* status)
{
    scan_vec<true>(nt, chunk_start, numel, dtypes, seg_of, new_ptrs, base_ptrs, res_ptrs, early_ptrs, lo, own_k,
                   pool_cap, cand_base, cand_cnt, cand_idx, cand_key, eq_cnt, status);
}

// Exact radix select on the candidates, one block (SCAN_THREADS threads, a chunk each in turn) per segment s over chunks
// [seg_chunks[s], seg_chunks[s + 1]); state as radix_pick leaves it: [T, take_eq] (k = 0: [~0, 0] unchanged).
// For segments of a few chunks (per-tensor scope); a segment of many chunks takes cand_hist below instead.
extern "C" __global__ void cand_select(
    int nseg, const i64* seg_chunks, const u64* cand_base, const u32* cand_cnt, const u32* cand_key, u64* state)
{
    __shared__ u32 h[256];
    __shared__ u64 sh_prefix, sh_k;
    const int s = blockIdx.x;
    if (threadIdx.x == 0) { sh_prefix = state[2 * s]; sh_k = state[2 * s + 1]; }
    __syncthreads();
    if (sh_k == 0) return;  // uniform across the block
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += SCAN_THREADS) h[b] = 0;
        __syncthreads();
        const u32 prefix = (u32)sh_prefix;
        for (i64 c = seg_chunks[s] + threadIdx.x; c < seg_chunks[s + 1]; c += SCAN_THREADS) {  // a chunk a thread
            const u64 base = cand_base[c];
            const u32 m = cand_cnt[c];
            for (u32 j = 0; j < m; ++j) {
                const u32 key = cand_key[base + j];
                if (shift == 24 || (key >> (shift + 8)) == (prefix >> (shift + 8)))
                    atomicAdd(&h[(key >> shift) & 255u], 1u);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 k_rem = sh_k;
            u32 p = prefix;
            for (int b = 255; b >= 0; --b) {
                const u64 hb = h[b];
                if (k_rem <= hb) { p |= ((u32)b) << shift; break; }
                k_rem -= hb;
            }
            sh_prefix = p;
            sh_k = k_rem;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) { state[2 * s] = sh_prefix; state[2 * s + 1] = sh_k; }
}

// One radix digit (8 bits at `shift`) of the candidates that still match their segment's prefix, as radix_hist
// over the keys: one block per chunk (all SMs busy whatever the segment count), a shared histogram flushed into
// hist (256 u64 per segment) with one atomic per non-empty bin. Four rounds of (cand_hist, radix_pick) are the
// exact radix select on the candidates; state as radix_pick leaves it: [T, take_eq] (k = 0: [~0, 0] unchanged).
extern "C" __global__ void cand_hist(
    int nt, const i64* chunk_start, const int* seg_of, const u64* cand_base, const u32* cand_cnt,
    const u32* cand_key, const u64* state, int shift, u64* hist)
{
    __shared__ u32 bins[256];
    const i64 c = blockIdx.x;
    const int s = seg_of[tensor_of_chunk(chunk_start, nt, c)];
    for (int b = threadIdx.x; b < 256; b += BLOCK) bins[b] = 0;
    __syncthreads();
    if (state[2 * s + 1] != 0) {  // uniform across the block
        const u32 high = shift == 24 ? 0u : (u32)state[2 * s] >> (shift + 8);
        const u64 base = cand_base[c];
        const u32 m = cand_cnt[c];
        for (u32 j = threadIdx.x; j < m; j += BLOCK) {
            const u32 key = cand_key[base + j];
            if (shift == 24 || (key >> (shift + 8)) == high) atomicAdd(&bins[(key >> shift) & 255u], 1u);
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += BLOCK)
        if (bins[b]) atomicAdd(&hist[256 * (i64)s + b], (u64)bins[b]);
}

// Per chunk, over its candidates: how many keys are above the segment's threshold, and how many equal it; where
// the threshold is lo itself (fewer candidates than k: the first keys equal to lo make up the rest), the equal
// ones are eq_cnt[c], which fused_scan counted.
extern "C" __global__ void cand_count(
    int nt, const i64* chunk_start, const int* seg_of, const u64* cand_base, const u32* cand_cnt,
    const u32* cand_key, const u64* state, const u64* lo, const u32* eq_cnt, u32* cnt)
{
    __shared__ u32 sg[WARPS], se[WARPS];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const u32 T = (u32)state[2 * seg_of[t]];
    const u64 base = cand_base[c];
    const u32 m = cand_cnt[c];
    u32 g = 0, e = 0;
    for (u32 j = threadIdx.x; j < m; j += BLOCK) {
        const u32 key = cand_key[base + j];
        g += key > T;
        e += key == T;
    }
    for (int o = 16; o > 0; o >>= 1) {
        g += __shfl_down_sync(0xFFFFFFFFu, g, o);
        e += __shfl_down_sync(0xFFFFFFFFu, e, o);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sg[warp] = g; se[warp] = e; }
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 G = 0u, E = 0u;
        for (int w = 0; w < WARPS; ++w) { G += sg[w]; E += se[w]; }
        const int s = seg_of[t];
        cnt[2 * c] = G;
        cnt[2 * c + 1] = state[2 * s] == lo[s] ? eq_cnt[c] : E;
    }
}

// Ordered write of the kept candidates (as chunk_write, over the candidates only): index and delta at out_base[c]
// onwards. The delta is read from early_ptrs[t] where fused_scan wrote it there (one input read instead of
// three), else recomputed from new, base and the residual read, which nothing has overwritten yet.
template <typename IDX>
__device__ __forceinline__ void cand_write_impl(
    int nt, const i64* chunk_start, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* early_ptrs,
    const u64* cand_base, const u32* cand_cnt, const u16* cand_idx, const u32* cand_key,
    const u64* state, const u64* eq_base, const u64* out_base, IDX* out_idx, float* vals32, double* vals64)
{
    __shared__ u32 wsel[WARPS], weq[WARPS];
    __shared__ u32 tot[2];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const int s = seg_of[t];
    const u32 T = (u32)state[2 * s];
    const u64 take = state[2 * s + 1];
    const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
    const int dt = dtypes[t];
    const void* nw = (const void*)new_ptrs[t];
    const void* bs = (const void*)base_ptrs[t];
    const void* rs = (const void*)res_ptrs[t];
    const void* ep = (const void*)early_ptrs[t];
    const u64 base = cand_base[c];
    const u32 m = cand_cnt[c];
    u64 eq_seen = eq_base[c];
    u64 pos = out_base[c];
    for (u32 j0 = 0; j0 < m; j0 += BLOCK) {  // uniform across the block
        const u32 j = j0 + threadIdx.x;
        const bool valid = j < m;
        const u32 key = valid ? cand_key[base + j] : 0u;
        const bool gt = valid && key > T;
        const bool eq = valid && key == T;
        u32 sel_before;
        const bool sel = rank_select(gt, eq, eq_seen, take, wsel, weq, sel_before);
        if (sel) {
            const u64 slot = pos + sel_before;
            const i64 i = e0 + (i64)cand_idx[base + j];
            out_idx[slot] = (IDX)i;
            if (dt == DT_F64) vals64[slot] = ep ? ((const double*)ep)[i] : delta_f64(nw, bs, rs, i);
            else vals32[slot] = ep ? ((const float*)ep)[i] : delta_f32(nw, bs, rs, dt, i);
        }
        rank_advance(wsel, weq, tot, pos, eq_seen);
    }
}

extern "C" __global__ void cand_write_u32(
    int nt, const i64* chunk_start, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* early_ptrs,
    const u64* cand_base, const u32* cand_cnt, const u16* cand_idx, const u32* cand_key,
    const u64* state, const u64* eq_base, const u64* out_base, u32* out_idx, float* vals32, double* vals64)
{
    cand_write_impl<u32>(nt, chunk_start, dtypes, seg_of, new_ptrs, base_ptrs, res_ptrs, early_ptrs, cand_base,
                         cand_cnt, cand_idx, cand_key, state, eq_base, out_base, out_idx, vals32, vals64);
}

extern "C" __global__ void cand_write_u64(
    int nt, const i64* chunk_start, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* early_ptrs,
    const u64* cand_base, const u32* cand_cnt, const u16* cand_idx, const u32* cand_key,
    const u64* state, const u64* eq_base, const u64* out_base, u64* out_idx, float* vals32, double* vals64)
{
    cand_write_impl<u64>(nt, chunk_start, dtypes, seg_of, new_ptrs, base_ptrs, res_ptrs, early_ptrs, cand_base,
                         cand_cnt, cand_idx, cand_key, state, eq_base, out_base, out_idx, vals32, vals64);
}

// The chunks that supply keys equal to the threshold where it is lo (their segment had fewer candidates than k):
// the chunk read again up to its last kept entry, every element's key recomputed, and its kept entries written at
// out_base[c] onwards in index order (over what cand_write wrote there from the candidates alone). Every other
// block returns at once.
template <typename IDX>
__device__ __forceinline__ void tie_write_impl(
    int nt, const i64* chunk_start, const i64* numel, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* score_ptrs, const int* score_dtypes,
    int crit, const u64* lo, const u32* cnt, const u64* state, const u64* eq_base, const u64* out_base,
    IDX* out_idx, float* vals32, double* vals64)
{
    __shared__ u32 wsel[WARPS], weq[WARPS];
    __shared__ u32 tot[2];
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    const int s = seg_of[t];
    const u64 take = state[2 * s + 1];
    u64 eq_seen = eq_base[c];
    if (state[2 * s] != lo[s] || eq_seen >= take || cnt[2 * c + 1] == 0) return;  // uniform across the block
    const u32 T = (u32)state[2 * s];
    const i64 n = numel[t];
    const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
    const int dt = dtypes[t];
    const void* nw = (const void*)new_ptrs[t];
    const void* bs = (const void*)base_ptrs[t];
    const void* rs = (const void*)res_ptrs[t];
    const void* sc = (const void*)score_ptrs[t];
    const int sdt = score_dtypes[t];
    u64 pos = out_base[c];
    const u64 end = out_base[c + 1];
    for (int j = 0; j < ITEMS && pos < end; ++j) {  // up to the chunk's last kept entry (uniform across the block)
        const i64 i0 = e0 + (i64)j * BLOCK;
        if (i0 >= n) break;  // uniform across the block
        const i64 i = i0 + threadIdx.x;
        const bool valid = i < n;
        bool bad;
        float d32 = 0.0f;
        double d64 = 0.0;
        const u32 key = valid ? element_key(nw, bs, rs, sc, dt, sdt, crit, i, bad, d32, d64) : 0u;
        u32 sel_before;
        const bool sel = rank_select(valid && key > T, valid && key == T, eq_seen, take, wsel, weq, sel_before);
        if (sel) {
            const u64 slot = pos + sel_before;
            out_idx[slot] = (IDX)i;
            if (dt == DT_F64) vals64[slot] = d64;
            else vals32[slot] = d32;
        }
        rank_advance(wsel, weq, tot, pos, eq_seen);
    }
}

extern "C" __global__ void tie_write_u32(
    int nt, const i64* chunk_start, const i64* numel, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* score_ptrs, const int* score_dtypes,
    int crit, const u64* lo, const u32* cnt, const u64* state, const u64* eq_base, const u64* out_base,
    u32* out_idx, float* vals32, double* vals64)
{
    tie_write_impl<u32>(nt, chunk_start, numel, dtypes, seg_of, new_ptrs, base_ptrs, res_ptrs, score_ptrs,
                        score_dtypes, crit, lo, cnt, state, eq_base, out_base, out_idx, vals32, vals64);
}

extern "C" __global__ void tie_write_u64(
    int nt, const i64* chunk_start, const i64* numel, const int* dtypes, const int* seg_of,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* score_ptrs, const int* score_dtypes,
    int crit, const u64* lo, const u32* cnt, const u64* state, const u64* eq_base, const u64* out_base,
    u64* out_idx, float* vals32, double* vals64)
{
    tie_write_impl<u64>(nt, chunk_start, numel, dtypes, seg_of, new_ptrs, base_ptrs, res_ptrs, score_ptrs,
                        score_dtypes, crit, lo, cnt, state, eq_base, out_base, out_idx, vals32, vals64);
}

// residual = delta of every element of t where res_out_ptrs[t] is non-zero (it may alias res_ptrs[t]): the late
// residual write, for residuals that fused_scan could not write early because they are read in place.
extern "C" __global__ void residual_delta(
    int nt, const i64* chunk_start, const i64* numel, const int* dtypes,
    const u64* new_ptrs, const u64* base_ptrs, const u64* res_ptrs, const u64* res_out_ptrs)
{
    const i64 c = blockIdx.x;
    const int t = tensor_of_chunk(chunk_start, nt, c);
    void* ro = (void*)res_out_ptrs[t];
    if (!ro) return;
    const i64 n = numel[t];
    const i64 e0 = (c - chunk_start[t]) * (i64)CHUNK;
    const int dt = dtypes[t];
    const void* nw = (const void*)new_ptrs[t];
    const void* bs = (const void*)base_ptrs[t];
    const void* rs = (const void*)res_ptrs[t];
    for (int j = 0; j < ITEMS; ++j) {
        const i64 i = e0 + (i64)j * BLOCK + threadIdx.x;
        if (i >= n) break;
        if (dt == DT_F64) ((double*)ro)[i] = delta_f64(nw, bs, rs, i);
        else ((float*)ro)[i] = delta_f32(nw, bs, rs, dt, i);
    }
}

// The residual of every kept entry: res_out[idx] = v - decoded(v), entries ent_start[t] .. ent_start[t + 1] of
// the output belonging to tensor t (tensors without a residual output are skipped).
template <typename IDX>
__device__ __forceinline__ void kept_fix_impl(
    int nt, u64 total, const u64* ent_start, const int* dtypes, const u64* res_out_ptrs, int qmode,
    const IDX* idx, const float* vals32, const double* vals64)
{
    const u64 j = (u64)blockIdx.x * BLOCK + threadIdx.x;
    if (j >= total) return;
    const int t = tensor_of_entry(ent_start, nt, j);
    void* ro = (void*)res_out_ptrs[t];
    if (!ro) return;
    const u64 i = (u64)idx[j];
    if (dtypes[t] == DT_F64) {
        const double d = vals64[j];
        ((double*)ro)[i] = d - decoded_f64(d, qmode);
    } else {
        const float d = vals32[j];
        ((float*)ro)[i] = d - decoded_f32(d, qmode);
    }
}

extern "C" __global__ void kept_fix_u32(
    int nt, u64 total, const u64* ent_start, const int* dtypes, const u64* res_out_ptrs, int qmode,
    const u32* idx, const float* vals32, const double* vals64)
{
    kept_fix_impl<u32>(nt, total, ent_start, dtypes, res_out_ptrs, qmode, idx, vals32, vals64);
}

extern "C" __global__ void kept_fix_u64(
    int nt, u64 total, const u64* ent_start, const int* dtypes, const u64* res_out_ptrs, int qmode,
    const u64* idx, const float* vals32, const double* vals64)
{
    kept_fix_impl<u64>(nt, total, ent_start, dtypes, res_out_ptrs, qmode, idx, vals32, vals64);
}
