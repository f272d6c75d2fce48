// Dense reconstruction from sparse COO entries, for a whole list of tensors in one launch.
//
// Entries are concatenated across tensors: tensor t owns entries [ent_start[t], ent_start[t + 1]). Every entry
// is checked on the device before it is used: an index out of range, equal to or below its predecessor, or a
// non-finite value records the lowest offending entry in *err (initialised to ~0) and that entry writes nothing. The caller discards the
// output if *err was set, so a hostile payload never writes outside a tensor and never yields a result.
// NumPy twins: cpu_fallback/kernels.py.
#include "common.cuh"

template <typename IDX>
__device__ __forceinline__ void scatter_impl(
    int nt, u64 total, const u64* ent_start, const i64* numel, const int* out_dtypes, const u64* out_ptrs,
    const IDX* idx, const float* vals32, const double* vals64, int mode, u64* err)
{
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= total) return;
    const int t = tensor_of_entry(ent_start, nt, j);
    const u64 i = (u64)idx[j];
    const int dt = out_dtypes[t];
    const bool finite = dt == DT_F64 ? finite_f64(vals64[j]) : finite_f32(vals32[j]);
    const bool bad = i >= (u64)numel[t] || (j > ent_start[t] && i <= (u64)idx[j - 1]) || !finite;
    if (bad) { atomicMin(err, j); return; }
    void* out = (void*)out_ptrs[t];
    if (dt == DT_F64) {
        double* o = (double*)out;
        o[i] = mode == SCATTER_ADD ? o[i] + vals64[j] : vals64[j];
    } else {
        const float v = vals32[j];
        store_f32(out, dt, (i64)i, mode == SCATTER_ADD ? load_f32(out, dt, (i64)i) + v : v);
    }
}

extern "C" __global__ void scatter_u32(
    int nt, u64 total, const u64* ent_start, const i64* numel, const int* out_dtypes, const u64* out_ptrs,
    const u32* idx, const float* vals32, const double* vals64, int mode, u64* err)
{
    scatter_impl<u32>(nt, total, ent_start, numel, out_dtypes, out_ptrs, idx, vals32, vals64, mode, err);
}

extern "C" __global__ void scatter_u64(
    int nt, u64 total, const u64* ent_start, const i64* numel, const int* out_dtypes, const u64* out_ptrs,
    const u64* idx, const float* vals32, const double* vals64, int mode, u64* err)
{
    scatter_impl<u64>(nt, total, ent_start, numel, out_dtypes, out_ptrs, idx, vals32, vals64, mode, err);
}

// Dense records (every element sent, entry j of tensor t is element j - ent_start[t]): out = v (SCATTER_ZEROS) or
// round(base + v) (SCATTER_ADD). Values, bases and outputs are read in place through address tables (values fp64
// for fp64 outputs, else fp32): no copy of the base, no concatenation, no index table. A non-finite value records
// the lowest such entry in *err and writes nothing, as in scatter_*.
extern "C" __global__ void dense_apply(
    int nt, u64 total, const u64* ent_start, const int* out_dtypes, const u64* out_ptrs, const u64* base_ptrs,
    const u64* val_ptrs, int mode, u64* err)
{
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= total) return;
    const int t = tensor_of_entry(ent_start, nt, j);
    const i64 i = (i64)(j - ent_start[t]);
    const int dt = out_dtypes[t];
    void* out = (void*)out_ptrs[t];
    const void* base = (const void*)base_ptrs[t];
    if (dt == DT_F64) {
        const double v = ((const double*)val_ptrs[t])[i];
        if (!finite_f64(v)) { atomicMin(err, j); return; }
        ((double*)out)[i] = mode == SCATTER_ADD ? ((const double*)base)[i] + v : v;
    } else {
        const float v = ((const float*)val_ptrs[t])[i];
        if (!finite_f32(v)) { atomicMin(err, j); return; }
        store_f32(out, dt, i, mode == SCATTER_ADD ? load_f32(base, dt, i) + v : v);
    }
}

// Element i of src copied to element j of out, its bits as they are (esize: the bytes of an element, 2, 4 or 8).
__device__ __forceinline__ void copy_bits(void* out, u64 j, const void* src, u64 i, int esize)
{
    if (esize == 8) {
        ((u64*)out)[j] = ((const u64*)src)[i];
    } else if (esize == 4) {
        ((u32*)out)[j] = ((const u32*)src)[i];
    } else {
        ((u16*)out)[j] = ((const u16*)src)[i];
    }
}

// Whole tensors copied end to end into one output, in one launch (a decode onto a base starts from the bases of a
// run of small tensors): element j of the output, owned by tensor t where ent_start[t] <= j < ent_start[t + 1], is
// element j - ent_start[t] of src_ptrs[t]. esize is the bytes of an element (2, 4 or 8); the bits are copied as
// they are (no float arithmetic, so no rounding and no flush of subnormals).
extern "C" __global__ void gather_copy(
    int nt, u64 total, const u64* ent_start, const u64* src_ptrs, int esize, void* out)
{
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= total) return;
    const int t = tensor_of_entry(ent_start, nt, j);
    const u64 i = j - ent_start[t];
    copy_bits(out, j, (const void*)src_ptrs[t], i, esize);
}

// A run's bases read at its entries, in one launch (an aggregator checks the sums of a run's entries with their
// bases from the entries' worth of memory, not from a copy of every base): entry j, owned by tensor t where
// ent_start[t] <= j < ent_start[t + 1], sits at position idx[j] of the run's span, in which tensor t holds
// [elem_start[t], elem_start[t + 1]); out[j] is element idx[j] - elem_start[t] of src_ptrs[t], its bits as they
// are. The caller checked every index; one outside its tensor writes nothing (and reads nothing).
template <typename IDX>
__device__ __forceinline__ void gather_entries_impl(
    int nt, u64 total, const u64* ent_start, const u64* elem_start, const u64* src_ptrs, const IDX* idx, int esize,
    void* out)
{
    const u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= total) return;
    const int t = tensor_of_entry(ent_start, nt, j);
    const u64 at = (u64)idx[j];
    if (at < elem_start[t] || at >= elem_start[t + 1]) return;
    const u64 i = at - elem_start[t];
    copy_bits(out, j, (const void*)src_ptrs[t], i, esize);
}

extern "C" __global__ void gather_entries_u32(
    int nt, u64 total, const u64* ent_start, const u64* elem_start, const u64* src_ptrs, const u32* idx, int esize,
    void* out)
{
    gather_entries_impl<u32>(nt, total, ent_start, elem_start, src_ptrs, idx, esize, out);
}

extern "C" __global__ void gather_entries_u64(
    int nt, u64 total, const u64* ent_start, const u64* elem_start, const u64* src_ptrs, const u64* idx, int esize,
    void* out)
{
    gather_entries_impl<u64>(nt, total, ent_start, elem_start, src_ptrs, idx, esize, out);
}
