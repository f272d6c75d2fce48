// Host shim: just enough CUDA for g++ (C++20) to compile gpu_codec's kernels/*.cu unchanged and run them on the CPU.
//
// The emulator (gpu_codec/backends/emulated.py) compiles each kernels/*.cu, with this header first and a generated
// launcher per `extern "C" __global__` kernel after it, into one shared library. emu_runtime.cpp runs a launch:
//
//   * blocks run one after another, in an order the launch chooses (forward, reverse or shuffled);
//   * the threads of a block are fibers (ucontext) on one OS thread, switched only at __syncthreads and at the
//     warp intrinsics, so every run is deterministic for a given schedule and seed;
//   * __syncthreads is a real barrier: no thread passes it before every thread of the block has reached it.
//     All threads must reach the same __syncthreads (same file and line) and none may have exited; anything
//     else is reported as an error (CUDA leaves it undefined);
//   * the warp intrinsics below are collectives over the lanes named in `mask`: every one of them must arrive
//     at the same intrinsic (same file, line, kind and width) before any returns (lockstep semantics); a lane
//     that exits or waits elsewhere while its warp waits for it is a reported deadlock;
//   * `__shared__` variables are `static` storage in the ELF section "emu_shared". There is one copy per
//     library, which is correct because blocks never overlap; the runtime fills the whole section with a poison
//     byte before every block, so a kernel that reads shared memory before writing it sees garbage, as on a GPU.
//
// What this shim does NOT model faithfully (each is a documented limitation, see kernels/host/README.md):
//   * Data races and memory ordering. Threads only switch at barriers and warp collectives, so the code between
//     two of them runs as one indivisible step per thread. A race between such steps is exposed only as far as
//     the schedule order (reverse, shuffled) changes the outcome; a race inside a step never shows. Use
//     compute-sanitizer --tool racecheck on a GPU (benchmarks/gpu_suite.py).
//   * Out-of-bounds accesses are not checked (compute-sanitizer --tool memcheck on a GPU does).
//   * Floating point: host IEEE arithmetic with -ffp-contract=off: every operation rounds on its own, as the
//     NumPy twins compute. On the device, NVRTC's default -fmad=true lets ptxas fuse a float multiply and a
//     following add or subtract into one FMA (PTX `mul.f32` without `.rn`), which rounds once: a kernel that
//     writes `a * b + c` can differ from its twin on a GPU although it matches here. tests/test_nvrtc.py
//     audits the PTX for such multiplies; use __fmul_rn (or compile with --fmad=false) where bytes must match.
//     The bit pattern of a NaN produced by arithmetic can differ from the device's canonical NaN; our kernels
//     only produce NaN keys on inputs they reject.
//   * Only static `__shared__` arrays; `extern __shared__` (dynamic shared memory) does not compile here.
//   * Shared-memory size, register and occupancy limits are not enforced (benchmarks/kernel_resources.py
//     reports them from ptxas).
//   * __threadfence*, the memory fences, are plain host fences: with no preemption they change nothing.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

// ---------------------------------------------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static __attribute__((section("emu_shared")))
#define __constant__ static const

// ---------------------------------------------------------------------------------------------- built-in indices
struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

// ------------------------------------------------------------------------------------------------ vector types
// As CUDA's: 16-byte aligned, so that a load or store of one is a single 128-bit access (and one 16-byte access in
// the traffic-counting build).
struct alignas(16) float4 {
    float x, y, z, w;
};
static_assert(sizeof(float4) == 16 && alignof(float4) == 16, "float4 is CUDA's 16-byte vector");
// The read-only data path's load: an ordinary load here.
struct alignas(8) uint2 {
    unsigned int x, y;
};
static_assert(sizeof(uint2) == 8 && alignof(uint2) == 8, "uint2 is CUDA's 8-byte vector");
static __forceinline__ float4 __ldg(const float4* p) { return *p; }
static __forceinline__ uint2 __ldg(const uint2* p) { return *p; }
static __forceinline__ float __ldg(const float* p) { return *p; }
static __forceinline__ unsigned short __ldg(const unsigned short* p) { return *p; }

namespace emu {
struct Thread {
    uint3 tid;  // threadIdx of this fiber
};
extern Thread* volatile g_current;
extern uint3 g_block_idx;
extern dim3 g_block_dim;
extern dim3 g_grid_dim;

// Collective kinds for warp_collective (emu_runtime.cpp).
enum WarpKind : int {
    W_SHFL_IDX = 0,
    W_SHFL_UP = 1,
    W_SHFL_DOWN = 2,
    W_SHFL_XOR = 3,
    W_BALLOT = 4,
    W_ANY = 5,
    W_ALL = 6,
    W_SYNCWARP = 7,
};

void syncthreads(const char* file, int line);
unsigned long long warp_collective(int kind, unsigned mask, unsigned long long value, int param, int width,
                                   const char* file, int line);
}  // namespace emu

// Reads go through a volatile pointer to the running fiber, so they are re-done after every switch point.
#define threadIdx (::emu::g_current->tid)
#define blockIdx (::emu::g_block_idx)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)
#define warpSize 32

// -------------------------------------------------------------------------------------------- barriers, fences
// A compiler barrier around the switch, so that no value of shared or global memory stays cached in a register
// across it (the runtime call is opaque too; this keeps it so under LTO).
#define __syncthreads()                              \
    do {                                             \
        __atomic_thread_fence(__ATOMIC_SEQ_CST);     \
        ::emu::syncthreads(__FILE__, __LINE__);      \
        __atomic_thread_fence(__ATOMIC_SEQ_CST);     \
    } while (0)
#define __threadfence_block() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_system() __atomic_thread_fence(__ATOMIC_SEQ_CST)

// ------------------------------------------------------------------------------------------------ bit casts
static __forceinline__ unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static __forceinline__ float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static __forceinline__ int __float_as_int(float f) {
    int u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static __forceinline__ float __int_as_float(int u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static __forceinline__ long long __double_as_longlong(double d) {
    long long u;
    memcpy(&u, &d, sizeof u);
    return u;
}
static __forceinline__ double __longlong_as_double(long long u) {
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}
static __forceinline__ int __popc(unsigned int x) { return __builtin_popcount(x); }
static __forceinline__ int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static __forceinline__ int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static __forceinline__ int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
static __forceinline__ int __ffs(int x) { return __builtin_ffs(x); }
static __forceinline__ int __ffsll(long long x) { return __builtin_ffsll(x); }
static __forceinline__ unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
    return (x >> 16) | (x << 16);
}

// ------------------------------------------------------------------------------- rounded arithmetic, min/max
// The _rn intrinsics are IEEE round-to-nearest operations that the device never fuses; the host compiles with
// -ffp-contract=off, so plain operators are never fused here either.
static __forceinline__ float __fadd_rn(float a, float b) { return a + b; }
static __forceinline__ float __fsub_rn(float a, float b) { return a - b; }
static __forceinline__ float __fmul_rn(float a, float b) { return a * b; }
static __forceinline__ float __fdiv_rn(float a, float b) { return a / b; }
static __forceinline__ float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static __forceinline__ double __dadd_rn(double a, double b) { return a + b; }
static __forceinline__ double __dsub_rn(double a, double b) { return a - b; }
static __forceinline__ double __dmul_rn(double a, double b) { return a * b; }
static __forceinline__ double __ddiv_rn(double a, double b) { return a / b; }
static __forceinline__ double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
template <typename T>
static __forceinline__ T min(T a, T b) { return b < a ? b : a; }
template <typename T>
static __forceinline__ T max(T a, T b) { return a < b ? b : a; }

// -------------------------------------------------------------------------------------------------- atomics
// Fibers never interleave inside an atomic, but these are real atomics anyway (and work on any address).
// In the traffic-counting build (EMU_TRACE) an atomic reports its read and its write, as the compiler's
// instrumentation does for plain loads and stores (it does not instrument atomics).
#ifdef EMU_TRACE
extern "C" void emu_trace_access(const void* p, unsigned long size, int write);
#define EMU_TRACE_RMW(p) (emu_trace_access((p), sizeof(*(p)), 0), emu_trace_access((p), sizeof(*(p)), 1))
#else
#define EMU_TRACE_RMW(p) ((void)0)
#endif
#define EMU_ATOMIC_RMW(T)                                                                                  \
    static __forceinline__ T atomicAdd(T* p, T v) { EMU_TRACE_RMW(p); return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); } \
    static __forceinline__ T atomicSub(T* p, T v) { EMU_TRACE_RMW(p); return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); } \
    static __forceinline__ T atomicAnd(T* p, T v) { EMU_TRACE_RMW(p); return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); } \
    static __forceinline__ T atomicOr(T* p, T v) { EMU_TRACE_RMW(p); return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }   \
    static __forceinline__ T atomicXor(T* p, T v) { EMU_TRACE_RMW(p); return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); } \
    static __forceinline__ T atomicExch(T* p, T v) { EMU_TRACE_RMW(p); return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); } \
    static __forceinline__ T atomicMin(T* p, T v) {                                                        \
        EMU_TRACE_RMW(p);                                                                                  \
        T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);                                                      \
        while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
        }                                                                                                  \
        return old;                                                                                        \
    }                                                                                                      \
    static __forceinline__ T atomicMax(T* p, T v) {                                                        \
        EMU_TRACE_RMW(p);                                                                                  \
        T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);                                                      \
        while (v > old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) { \
        }                                                                                                  \
        return old;                                                                                        \
    }                                                                                                      \
    static __forceinline__ T atomicCAS(T* p, T cmp, T v) {                                                 \
        EMU_TRACE_RMW(p);                                                                                  \
        __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                \
        return cmp;                                                                                        \
    }
EMU_ATOMIC_RMW(int)
EMU_ATOMIC_RMW(unsigned int)
EMU_ATOMIC_RMW(long long)
EMU_ATOMIC_RMW(unsigned long long)
#undef EMU_ATOMIC_RMW

template <typename F, typename U>
static __forceinline__ F emu_atomic_fadd(F* p, F v) {
    EMU_TRACE_RMW(p);
    U old = __atomic_load_n((U*)p, __ATOMIC_SEQ_CST);
    for (;;) {
        F f;
        memcpy(&f, &old, sizeof f);
        const F nf = f + v;
        U nu;
        memcpy(&nu, &nf, sizeof nu);
        if (__atomic_compare_exchange_n((U*)p, &old, nu, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return f;
    }
}
static __forceinline__ float atomicAdd(float* p, float v) { return emu_atomic_fadd<float, unsigned int>(p, v); }
static __forceinline__ double atomicAdd(double* p, double v) {
    return emu_atomic_fadd<double, unsigned long long>(p, v);
}

// ------------------------------------------------------------------------------------------ warp intrinsics
// Each is a collective of the lanes in `mask` (see the top of this file). Values travel as 64-bit patterns.
template <typename T>
static __forceinline__ unsigned long long emu_bits(T v) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "warp shuffles move 4- or 8-byte values");
    unsigned long long b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}
template <typename T>
static __forceinline__ T emu_from_bits(unsigned long long b) {
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}

#define __shfl_sync(mask, var, src, ...) emu_shfl(::emu::W_SHFL_IDX, mask, var, src, __FILE__, __LINE__ __VA_OPT__(,) __VA_ARGS__)
#define __shfl_up_sync(mask, var, d, ...) emu_shfl(::emu::W_SHFL_UP, mask, var, d, __FILE__, __LINE__ __VA_OPT__(,) __VA_ARGS__)
#define __shfl_down_sync(mask, var, d, ...) \
    emu_shfl(::emu::W_SHFL_DOWN, mask, var, d, __FILE__, __LINE__ __VA_OPT__(,) __VA_ARGS__)
#define __shfl_xor_sync(mask, var, m, ...) emu_shfl(::emu::W_SHFL_XOR, mask, var, m, __FILE__, __LINE__ __VA_OPT__(,) __VA_ARGS__)
#define __ballot_sync(mask, pred) \
    ((unsigned)::emu::warp_collective(::emu::W_BALLOT, (mask), (pred) ? 1ull : 0ull, 0, 32, __FILE__, __LINE__))
#define __any_sync(mask, pred) \
    ((int)::emu::warp_collective(::emu::W_ANY, (mask), (pred) ? 1ull : 0ull, 0, 32, __FILE__, __LINE__))
#define __all_sync(mask, pred) \
    ((int)::emu::warp_collective(::emu::W_ALL, (mask), (pred) ? 1ull : 0ull, 0, 32, __FILE__, __LINE__))
#define __syncwarp(...) emu_syncwarp(__FILE__, __LINE__ __VA_OPT__(,) __VA_ARGS__)

template <typename T>
static __forceinline__ T emu_shfl(int kind, unsigned mask, T var, int param, const char* file, int line,
                                  int width = 32) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    const T r = emu_from_bits<T>(::emu::warp_collective(kind, mask, emu_bits(var), param, width, file, line));
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return r;
}
static __forceinline__ void emu_syncwarp(const char* file, int line, unsigned mask = 0xFFFFFFFFu) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    ::emu::warp_collective(::emu::W_SYNCWARP, mask, 0, 0, 32, file, line);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

// --------------------------------------------------------------------------------------------- launch glue
namespace emu {
// One launch, filled in by the Python side (gpu_codec/backends/emulated.py mirrors this layout with ctypes).
struct LaunchConfig {
    unsigned int grid[3];
    unsigned int block[3];
    int schedule;             // 0 forward, 1 reverse, 2 shuffled (blocks and threads)
    int poison;               // byte written over shared memory before each block; -1: leave as is
    unsigned long long seed;  // for the shuffled schedule
    // outputs
    unsigned long long blocks_run, barriers, warp_collectives, switches;
    char error[2048];
};
typedef void (*KernelThunk)(void* args);
int launch(LaunchConfig* cfg, KernelThunk thunk, void* args);
}  // namespace emu
