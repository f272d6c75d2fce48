// Shared device helpers for gpu_codec kernels.
//
// Everything here is plain C++ on integer and float bits so that the same source compiles with NVRTC for the
// device and with g++ through the host shim (kernels/host/), and so that every conversion is bit-exact with
// the NumPy twins in cpu_fallback/.
#pragma once

// Every shared constant (launch sizes, dtype codes, criteria, modes) comes from gpu_codec/constants.py as a -D
// flag (constants.compile_options()); none has a default here, so a compile that misses one stops.
#ifndef BLOCK
#error "BLOCK must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef ITEMS
#error "ITEMS must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CHUNK
#error "CHUNK must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef WARPS
#error "WARPS must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef SCAN_THREADS
#error "SCAN_THREADS must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CHUNK_SCAN_THREADS
#error "CHUNK_SCAN_THREADS must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CHUNK_SCAN_PART
#error "CHUNK_SCAN_PART must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef RICE_SCAN_THREADS
#error "RICE_SCAN_THREADS must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef DT_F32
#error "DT_F32 must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef DT_F16
#error "DT_F16 must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef DT_BF16
#error "DT_BF16 must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef DT_F64
#error "DT_F64 must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CRIT_MAGNITUDE
#error "CRIT_MAGNITUDE must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CRIT_LARGEST_FINAL
#error "CRIT_LARGEST_FINAL must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CRIT_SMALLEST_FINAL
#error "CRIT_SMALLEST_FINAL must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CRIT_LARGEST_CHANGE
#error "CRIT_LARGEST_CHANGE must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CRIT_SMALLEST_CHANGE
#error "CRIT_SMALLEST_CHANGE must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CRIT_LARGEST_INCREASE
#error "CRIT_LARGEST_INCREASE must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CRIT_SMALLEST_INCREASE
#error "CRIT_SMALLEST_INCREASE must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef CRIT_EXTERNAL
#error "CRIT_EXTERNAL must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef QMODE_EXACT
#error "QMODE_EXACT must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef QMODE_F16
#error "QMODE_F16 must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef QMODE_BF16
#error "QMODE_BF16 must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef Q_F16
#error "Q_F16 must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef Q_BF16
#error "Q_BF16 must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef SCATTER_ZEROS
#error "SCATTER_ZEROS must be defined: compile with gpu_codec.constants.compile_options()"
#endif
#ifndef SCATTER_ADD
#error "SCATTER_ADD must be defined: compile with gpu_codec.constants.compile_options()"
#endif

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;


__device__ __forceinline__ float f16_bits_to_float(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exp = (h >> 10) & 0x1Fu;
    u32 man = h & 0x3FFu;
    u32 bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise into an fp32 normal
            int e = -1;
            do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
            bits = sign | ((u32)(127 - 15 - e) << 23) | ((man & 0x3FFu) << 13);
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + (127 - 15)) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

// Round-to-nearest-even fp32 -> fp16 bits (finite inputs; overflow saturates to inf as IEEE does).
__device__ __forceinline__ u16 float_to_f16_bits(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (u16)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u));
    if (ax >= 0x477FF000u) return (u16)(sign | 0x7C00u);  // rounds to >= 65520: inf
    if (ax < 0x38800000u) {  // result is subnormal or zero
        if (ax < 0x33000000u) return (u16)sign;  // < 2^-25 rounds to 0
        u32 e = ax >> 23;
        u32 m = (ax & 0x7FFFFFu) | 0x800000u;
        u32 shift = 126u - e;  // 14 - (e - 127) + 13 - 1 ... so that m >> shift is the fp16 mantissa
        u32 q = m >> shift;
        u32 rem = m & ((1u << shift) - 1u);
        u32 half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) ++q;
        return (u16)(sign | q);
    }
    u32 q = (ax - 0x38000000u) >> 13;  // rebias exponent 127 -> 15
    u32 rem = ax & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
    return (u16)(sign | q);
}

__device__ __forceinline__ float bf16_bits_to_float(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Round-to-nearest-even fp32 -> bf16 bits (finite inputs).
__device__ __forceinline__ u16 float_to_bf16_bits(float f) {
    u32 x = __float_as_uint(f);
    u32 lsb = (x >> 16) & 1u;
    return (u16)((x + 0x7FFFu + lsb) >> 16);
}

__device__ __forceinline__ bool finite_f32(float f) { return (__float_as_uint(f) & 0x7F800000u) != 0x7F800000u; }
__device__ __forceinline__ bool finite_f64(double d) {
    return ((u64)__double_as_longlong(d) & 0x7FF0000000000000ull) != 0x7FF0000000000000ull;
}

// Order-preserving map of an fp32 score to u32: a > b (as floats) <=> key(a) > key(b); -0.0 and +0.0 map alike.
__device__ __forceinline__ u32 score_key(float s) {
    u32 u = __float_as_uint(s);
    if (u == 0x80000000u) u = 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Element i of a tensor of logical dtype `dt`, widened to fp32 (fp64 tensors are narrowed; callers that
// need fp64 use load_f64).
__device__ __forceinline__ float load_f32(const void* p, int dt, i64 i) {
    if (dt == DT_F32) return ((const float*)p)[i];
    if (dt == DT_F16) return f16_bits_to_float(((const u16*)p)[i]);
    if (dt == DT_BF16) return bf16_bits_to_float(((const u16*)p)[i]);
    return (float)((const double*)p)[i];
}

__device__ __forceinline__ double load_f64(const void* p, int dt, i64 i) {
    if (dt == DT_F64) return ((const double*)p)[i];
    return (double)load_f32(p, dt, i);
}

// Store an fp32 value into a tensor of logical dtype `dt`, rounding to nearest even.
__device__ __forceinline__ void store_f32(void* p, int dt, i64 i, float v) {
    if (dt == DT_F32) ((float*)p)[i] = v;
    else if (dt == DT_F16) ((u16*)p)[i] = float_to_f16_bits(v);
    else if (dt == DT_BF16) ((u16*)p)[i] = float_to_bf16_bits(v);
    else ((double*)p)[i] = (double)v;
}

// Exclusive scan of v over the first nthreads threads of a block (Hillis-Steele in shared memory sh[nthreads];
// every thread of the block must call it).
__device__ __forceinline__ u64 block_exclusive_scan(u64 v, u64* sh, int nthreads) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int o = 1; o < nthreads; o <<= 1) {
        const u64 add = threadIdx.x >= (unsigned)o ? sh[threadIdx.x - o] : 0ull;
        __syncthreads();
        sh[threadIdx.x] += add;
        __syncthreads();
    }
    const u64 r = sh[threadIdx.x] - v;
    __syncthreads();
    return r;
}

// Which tensor owns chunk c: the last t with chunk_start[t] <= c (chunk_start has nt + 1 entries).
__device__ __forceinline__ int tensor_of_chunk(const i64* chunk_start, int nt, i64 c) {
    int lo = 0, hi = nt - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (chunk_start[mid] <= c) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// Which tensor owns flat entry j of a concatenated entry list: the last t with start[t] <= j.
__device__ __forceinline__ int tensor_of_entry(const u64* start, int nt, u64 j) {
    int lo = 0, hi = nt - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (start[mid] <= j) lo = mid; else hi = mid - 1;
    }
    return lo;
}
