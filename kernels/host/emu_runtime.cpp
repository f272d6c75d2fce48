// Runtime of the host emulator: runs one kernel launch, blocks one after another, the threads of a block as
// fibers with real barrier and warp-lockstep semantics. See cuda_shim.h for the model and its limits.
#include "cuda_shim.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace emu {
Thread* volatile g_current = nullptr;
uint3 g_block_idx = {0, 0, 0};
dim3 g_block_dim = {1, 1, 1};
dim3 g_grid_dim = {1, 1, 1};
}  // namespace emu

// Anchor of the shared-memory section, so that __start_/__stop_emu_shared exist even in a library whose kernels
// declare no __shared__ variable.
__attribute__((section("emu_shared"), used)) static char emu_shared_anchor[16];
extern "C" char __start_emu_shared[];
extern "C" char __stop_emu_shared[];

namespace {

constexpr size_t kStackSize = 256 * 1024;
constexpr unsigned kMaxThreads = 1024;

enum State : int { READY = 0, RUNNING = 1, AT_BARRIER = 2, AT_WARP = 3, DONE = 4 };

const char* kind_name(int kind) {
    switch (kind) {
        case emu::W_SHFL_IDX: return "__shfl_sync";
        case emu::W_SHFL_UP: return "__shfl_up_sync";
        case emu::W_SHFL_DOWN: return "__shfl_down_sync";
        case emu::W_SHFL_XOR: return "__shfl_xor_sync";
        case emu::W_BALLOT: return "__ballot_sync";
        case emu::W_ANY: return "__any_sync";
        case emu::W_ALL: return "__all_sync";
        case emu::W_SYNCWARP: return "__syncwarp";
        default: return "?";
    }
}

struct Fiber : emu::Thread {
    ucontext_t ctx;
    unsigned linear = 0;
    int state = DONE;
    const char* file = "";
    int line = 0;
    int wkind = -1;
    unsigned long long wout = 0;
};

struct WarpOp {
    unsigned mask = 0;
    int kind = 0;
    int width = 32;
    const char* file = "";
    int line = 0;
    unsigned arrived = 0;
    unsigned long long in[32] = {};
    int param[32] = {};
};

struct Run {
    emu::LaunchConfig* cfg = nullptr;
    emu::KernelThunk thunk = nullptr;
    void* args = nullptr;
    unsigned nthreads = 0;
    std::vector<Fiber> fibers;
    std::vector<std::vector<WarpOp>> warps;
    std::vector<unsigned> ready;  // FIFO: ready[head..]
    size_t head = 0;
    ucontext_t sched;
    bool failed = false;
    std::mt19937_64 rng;
};

Run* R = nullptr;
std::mutex g_mutex;
std::vector<char*> g_stacks;  // kStackSize each, a guard page below; kept for the life of the process

bool same_site(const char* f1, int l1, const char* f2, int l2) { return l1 == l2 && strcmp(f1, f2) == 0; }

void failf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void failf(const char* fmt, ...) {
    if (R->failed) return;
    R->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(R->cfg->error, sizeof R->cfg->error, fmt, ap);
    va_end(ap);
}

std::string where(const Fiber& f) {
    char buf[160];
    snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z, emu::g_block_idx.x,
             emu::g_block_idx.y, emu::g_block_idx.z);
    return buf;
}

void order(std::vector<unsigned>& v, unsigned n) {
    v.resize(n);
    std::iota(v.begin(), v.end(), 0u);
    if (R->cfg->schedule == 1) std::reverse(v.begin(), v.end());
    else if (R->cfg->schedule == 2) std::shuffle(v.begin(), v.end(), R->rng);
}

void make_ready(unsigned t) {
    R->fibers[t].state = READY;
    R->ready.push_back(t);
}

bool pop_ready(unsigned& t) {
    if (R->head == R->ready.size()) {
        R->ready.clear();
        R->head = 0;
        return false;
    }
    t = R->ready[R->head++];
    return true;
}

// Leave the running fiber `self` (already marked with why it stopped) for the next ready one or the scheduler.
void switch_away(Fiber* self) {
    unsigned t;
    if (!R->failed && pop_ready(t)) {
        Fiber* next = &R->fibers[t];
        next->state = RUNNING;
        ++R->cfg->switches;
        if (next == self) return;
        emu::g_current = next;
        swapcontext(&self->ctx, &next->ctx);
    } else {
        swapcontext(&self->ctx, &R->sched);
    }
    // resumed: whoever resumed us set g_current
}

void fiber_main() {
    R->thunk(R->args);
    Fiber* self = static_cast<Fiber*>(emu::g_current);
    self->state = DONE;
    unsigned t;
    if (!R->failed && pop_ready(t)) {
        Fiber* next = &R->fibers[t];
        next->state = RUNNING;
        ++R->cfg->switches;
        emu::g_current = next;
        setcontext(&next->ctx);
    }
    setcontext(&R->sched);
}

char* stack_for(unsigned t) {
    while (g_stacks.size() <= t) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        void* m = mmap(nullptr, kStackSize + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (m == MAP_FAILED) return nullptr;
        mprotect(m, page, PROT_NONE);  // guard: an overflow faults instead of corrupting a neighbour
        g_stacks.push_back((char*)m + page);
    }
    return g_stacks[t];
}

// Why the block cannot go on: every fiber not done is waiting, and no barrier can be released.
void explain_stall() {
    std::string msg;
    unsigned done = 0, at_bar = 0;
    const Fiber* first_done = nullptr;
    const Fiber* first_bar = nullptr;
    for (const Fiber& f : R->fibers) {
        if (f.state == DONE) {
            ++done;
            if (!first_done) first_done = &f;
        } else if (f.state == AT_BARRIER) {
            ++at_bar;
            if (!first_bar) first_bar = &f;
        }
    }
    for (size_t w = 0; w < R->warps.size(); ++w) {
        for (const WarpOp& op : R->warps[w]) {
            const unsigned missing = op.mask & ~op.arrived;
            const unsigned lane = (unsigned)__builtin_ctz(missing);
            const Fiber& f = R->fibers[w * 32 + lane];
            const char* st = f.state == DONE ? "has exited" : f.state == AT_BARRIER ? "waits at __syncthreads" : "waits elsewhere";
            failf("deadlock: %s at %s:%d (warp %zu, mask 0x%08x) waits for lane %u, which %s (%s:%d)",
                  kind_name(op.kind), op.file, op.line, w, op.mask, lane, st, f.file, f.line);
            return;
        }
    }
    if (first_bar && done) {
        failf("__syncthreads at %s:%d is waited on by %u thread(s) of block (%u,%u,%u) while %u have exited (%s "
              "exited first); CUDA leaves this undefined",
              first_bar->file, first_bar->line, at_bar, emu::g_block_idx.x, emu::g_block_idx.y, emu::g_block_idx.z,
              done, where(*first_done).c_str());
        return;
    }
    failf("deadlock in block (%u,%u,%u): %u thread(s) at barriers, %u exited", emu::g_block_idx.x, emu::g_block_idx.y,
          emu::g_block_idx.z, at_bar, done);
}

// All threads not done wait somewhere. Release a barrier if that is legal, else record why not.
bool resolve(std::vector<unsigned>& ord) {
    unsigned at_bar = 0;
    const Fiber* ref = nullptr;
    for (const Fiber& f : R->fibers) {
        if (f.state == AT_BARRIER) {
            ++at_bar;
            if (!ref) {
                ref = &f;
            } else if (!same_site(ref->file, ref->line, f.file, f.line)) {
                failf("divergent __syncthreads in block (%u,%u,%u): %s waits at %s:%d, %s at %s:%d",
                      emu::g_block_idx.x, emu::g_block_idx.y, emu::g_block_idx.z, where(*ref).c_str(), ref->file,
                      ref->line, where(f).c_str(), f.file, f.line);
                return false;
            }
        }
    }
    if (at_bar != R->nthreads) {
        explain_stall();
        return false;
    }
    ++R->cfg->barriers;
    order(ord, R->nthreads);
    for (unsigned t : ord) make_ready(t);
    return true;
}

// A fresh context for thread t at the start of fiber_main (kept out of run_block: getcontext returns twice).
__attribute__((noinline)) bool init_fiber(unsigned t) {
    const dim3 bd = emu::g_block_dim;
    Fiber& f = R->fibers[t];
    f.tid = {t % bd.x, (t / bd.x) % bd.y, t / (bd.x * bd.y)};
    f.linear = t;
    f.state = READY;
    f.file = "";
    f.line = 0;
    char* stack = stack_for(t);
    if (!stack) return false;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = kStackSize;
    f.ctx.uc_link = &R->sched;
    makecontext(&f.ctx, fiber_main, 0);
    return true;
}

int run_block(std::vector<unsigned>& ord) {
    for (unsigned t = 0; t < R->nthreads; ++t) {
        if (!init_fiber(t)) {
            failf("cannot allocate a fiber stack");
            return -1;
        }
    }
    for (auto& w : R->warps) w.clear();
    if (R->cfg->poison >= 0) memset(__start_emu_shared, R->cfg->poison, (size_t)(__stop_emu_shared - __start_emu_shared));
    R->ready.clear();
    R->head = 0;
    order(ord, R->nthreads);
    for (unsigned t : ord) make_ready(t);
    for (;;) {
        unsigned t;
        if (pop_ready(t)) {
            Fiber* f = &R->fibers[t];
            f->state = RUNNING;
            ++R->cfg->switches;
            emu::g_current = f;
            swapcontext(&R->sched, &f->ctx);
            if (R->failed) return -1;
            continue;
        }
        if (R->failed) return -1;
        bool all_done = true;
        for (const Fiber& f : R->fibers) all_done &= f.state == DONE;
        if (all_done) return 0;
        if (!resolve(ord)) return -1;
    }
}

}  // namespace

namespace emu {

void syncthreads(const char* file, int line) {
    Fiber* self = static_cast<Fiber*>(g_current);
    self->state = AT_BARRIER;
    self->file = file;
    self->line = line;
    switch_away(self);
}

unsigned long long warp_collective(int kind, unsigned mask, unsigned long long value, int param, int width,
                                   const char* file, int line) {
    Fiber* self = static_cast<Fiber*>(g_current);
    const unsigned lane = self->linear & 31u, warp = self->linear >> 5;
    const unsigned nlanes = std::min(32u, R->nthreads - warp * 32u);
    const unsigned existing = nlanes == 32 ? 0xFFFFFFFFu : ((1u << nlanes) - 1u);
    ++R->cfg->warp_collectives;
    if (!((mask >> lane) & 1u)) {
        failf("%s at %s:%d: %s (lane %u) calls it with mask 0x%08x, which does not name it", kind_name(kind), file,
              line, where(*self).c_str(), lane, mask);
        switch_away(self);
    }
    if (mask & ~existing) {
        failf("%s at %s:%d: mask 0x%08x names lanes that do not exist in warp %u (block of %u threads)",
              kind_name(kind), file, line, mask, warp, R->nthreads);
        switch_away(self);
    }
    if (width < 1 || width > 32 || (width & (width - 1))) {
        failf("%s at %s:%d: width %d is not a power of two in 1..32", kind_name(kind), file, line, width);
        switch_away(self);
    }
    std::vector<WarpOp>& pend = R->warps[warp];
    WarpOp* op = nullptr;
    for (WarpOp& o : pend) {
        if (o.mask & mask) {
            // __syncwarp may be reached at different call sites (sm_70+); every other intrinsic must be the same.
            const bool site_ok = kind == W_SYNCWARP || same_site(o.file, o.line, file, line);
            if (o.mask != mask || o.kind != kind || o.width != width || !site_ok) {
                failf("divergent warp collectives in warp %u of block (%u,%u,%u): %s at %s:%d (mask 0x%08x) and %s at "
                      "%s:%d (mask 0x%08x, from %s)",
                      warp, g_block_idx.x, g_block_idx.y, g_block_idx.z, kind_name(o.kind), o.file, o.line, o.mask,
                      kind_name(kind), file, line, mask, where(*self).c_str());
                switch_away(self);
            }
            op = &o;
            break;
        }
    }
    if (!op) {
        pend.emplace_back();
        op = &pend.back();
        op->mask = mask;
        op->kind = kind;
        op->width = width;
        op->file = file;
        op->line = line;
        op->arrived = 0;
    }
    op->in[lane] = value;
    op->param[lane] = param;
    op->arrived |= 1u << lane;
    if (op->arrived != mask) {
        self->state = AT_WARP;
        self->file = file;
        self->line = line;
        self->wkind = kind;
        switch_away(self);
        return self->wout;
    }
    // Every lane of the mask is here: compute all results at once, then let the others go.
    unsigned long long ballot = 0;
    for (unsigned l = 0; l < 32; ++l)
        if (((mask >> l) & 1u) && op->in[l]) ballot |= 1ull << l;
    for (unsigned l = 0; l < 32; ++l) {
        if (!((mask >> l) & 1u)) continue;
        const unsigned w = (unsigned)width, base = l & ~(w - 1u), pos = l & (w - 1u);
        const int p = op->param[l];
        unsigned src = l;
        unsigned long long out = 0;
        switch (kind) {
            case W_SHFL_IDX: src = base + (unsigned)(((p % (int)w) + (int)w) % (int)w); break;
            case W_SHFL_UP: src = (p >= 0 && pos >= (unsigned)p) ? l - (unsigned)p : l; break;
            case W_SHFL_DOWN: src = (p >= 0 && pos + (unsigned)p < w) ? l + (unsigned)p : l; break;
            case W_SHFL_XOR: {
                const unsigned s = l ^ (unsigned)p;
                src = s < base + w ? s : l;
                break;
            }
            case W_BALLOT: out = ballot; break;
            case W_ANY: out = ballot != 0; break;
            case W_ALL: out = ballot == (unsigned long long)mask; break;
            default: break;
        }
        if (kind <= W_SHFL_XOR) {
            if (src > 31 || !((mask >> src) & 1u)) {
                failf("%s at %s:%d: lane %u reads lane %u, which is not in the mask 0x%08x (undefined in CUDA)",
                      kind_name(kind), file, line, l, src, mask);
                switch_away(self);
            }
            out = op->in[src];
        }
        R->fibers[warp * 32 + l].wout = out;
    }
    const unsigned others = mask & ~(1u << lane);
    const unsigned long long mine = self->wout;
    for (size_t i = 0; i < pend.size(); ++i) {
        if (&pend[i] == op) {
            pend.erase(pend.begin() + (long)i);
            break;
        }
    }
    if (R->cfg->schedule == 1) {
        for (int l = 31; l >= 0; --l)
            if ((others >> l) & 1u) make_ready(warp * 32 + (unsigned)l);
    } else {
        for (unsigned l = 0; l < 32; ++l)
            if ((others >> l) & 1u) make_ready(warp * 32 + l);
    }
    return mine;
}

#ifdef EMU_TRACE
void trace_enter();
void trace_exit();
#endif

int launch(LaunchConfig* cfg, KernelThunk thunk, void* args) {
    std::lock_guard<std::mutex> lock(g_mutex);
    cfg->error[0] = 0;
    cfg->blocks_run = cfg->barriers = cfg->warp_collectives = cfg->switches = 0;
    const unsigned long long nthreads = (unsigned long long)cfg->block[0] * cfg->block[1] * cfg->block[2];
    const unsigned long long nblocks = (unsigned long long)cfg->grid[0] * cfg->grid[1] * cfg->grid[2];
    if (nthreads == 0 || nthreads > kMaxThreads || cfg->block[2] > 64 || nblocks == 0 || cfg->grid[1] > 65535 ||
        cfg->grid[2] > 65535 || cfg->grid[0] > 0x7FFFFFFFu) {
        snprintf(cfg->error, sizeof cfg->error,
                 "invalid configuration argument: grid (%u,%u,%u), block (%u,%u,%u) (CUDA needs 1..1024 threads per "
                 "block and a non-empty grid)",
                 cfg->grid[0], cfg->grid[1], cfg->grid[2], cfg->block[0], cfg->block[1], cfg->block[2]);
        return -1;
    }
    Run run;
    run.cfg = cfg;
    run.thunk = thunk;
    run.args = args;
    run.nthreads = (unsigned)nthreads;
    run.fibers.resize(run.nthreads);
    run.warps.resize((run.nthreads + 31) / 32);
    run.ready.reserve(run.nthreads * 2);
    run.rng.seed(cfg->seed);
    R = &run;
#ifdef EMU_TRACE
    trace_enter();  // only the kernel's own accesses count, not the launcher's reading of its arguments
#endif
    g_grid_dim = {cfg->grid[0], cfg->grid[1], cfg->grid[2]};
    g_block_dim = {cfg->block[0], cfg->block[1], cfg->block[2]};
    std::vector<unsigned long long> blocks(nblocks);
    std::iota(blocks.begin(), blocks.end(), 0ull);
    if (cfg->schedule == 1) std::reverse(blocks.begin(), blocks.end());
    else if (cfg->schedule == 2) std::shuffle(blocks.begin(), blocks.end(), run.rng);
    std::vector<unsigned> ord;
    int rc = 0;
    for (unsigned long long b : blocks) {
        g_block_idx = {(unsigned)(b % cfg->grid[0]), (unsigned)((b / cfg->grid[0]) % cfg->grid[1]),
                       (unsigned)(b / ((unsigned long long)cfg->grid[0] * cfg->grid[1]))};
        rc = run_block(ord);
        if (rc) break;
        ++cfg->blocks_run;
    }
    g_current = nullptr;
    R = nullptr;
#ifdef EMU_TRACE
    trace_exit();
#endif
    return rc;
}

}  // namespace emu

EMU_EXPORT int emu_abi_version() { return 1; }
EMU_EXPORT unsigned long long emu_shared_bytes() {
    return (unsigned long long)(__stop_emu_shared - __start_emu_shared) - sizeof emu_shared_anchor;
}

// ------------------------------------------------------------------------------------ global-memory traffic
// The traffic-counting build compiles the kernel sources (not this file) with GCC's address instrumentation in
// call mode (-fsanitize=kernel-address --param asan-instrumentation-with-call-threshold=0): every load and
// store of a kernel calls __asan_{load,store}N_noabort(address), defined here. An access counts when it falls
// in one of the launch's buffers (registered by the Python side: the arrays passed and the arrays named in
// address tables); shared memory, fiber stacks and the runtime's own variables are never such a buffer. Each
// launch reports the distinct 32-byte sectors it read and wrote.
#ifdef EMU_TRACE
#include <unordered_set>

namespace {
std::vector<std::pair<uintptr_t, uintptr_t>> g_ranges;  // [begin, end), sorted, disjoint
std::unordered_set<unsigned long long> g_read, g_written;
bool g_armed = false, g_tracing = false;

bool in_buffer(uintptr_t a) {
    auto it = std::upper_bound(g_ranges.begin(), g_ranges.end(), std::make_pair(a, UINTPTR_MAX));
    if (it == g_ranges.begin()) return false;
    --it;
    return a >= it->first && a < it->second;
}
}  // namespace

extern "C" void emu_trace_access(const void* p, unsigned long size, int write) {
    if (!g_tracing || size == 0) return;
    const uintptr_t a = (uintptr_t)p;
    if (!in_buffer(a)) return;
    auto& set = write ? g_written : g_read;
    for (unsigned long long s = a >> 5, e = (a + size - 1) >> 5; s <= e; ++s) set.insert(s);
}

#define EMU_ASAN_HOOKS(N)                                                                                   \
    extern "C" __attribute__((visibility("default"))) void __asan_load##N##_noabort(uintptr_t a) {        \
        emu_trace_access((const void*)a, N, 0);                                                            \
    }                                                                                                      \
    extern "C" __attribute__((visibility("default"))) void __asan_store##N##_noabort(uintptr_t a) {       \
        emu_trace_access((const void*)a, N, 1);                                                            \
    }
EMU_ASAN_HOOKS(1)
EMU_ASAN_HOOKS(2)
EMU_ASAN_HOOKS(4)
EMU_ASAN_HOOKS(8)
EMU_ASAN_HOOKS(16)
#undef EMU_ASAN_HOOKS
extern "C" __attribute__((visibility("default"))) void __asan_loadN_noabort(uintptr_t a, uintptr_t n) {
    emu_trace_access((const void*)a, n, 0);
}
extern "C" __attribute__((visibility("default"))) void __asan_storeN_noabort(uintptr_t a, uintptr_t n) {
    emu_trace_access((const void*)a, n, 1);
}
extern "C" __attribute__((visibility("default"))) void __asan_handle_no_return() {}

// ranges: n pairs (begin, end) of the launch's buffers, any order, may overlap.
EMU_EXPORT void emu_trace_begin(const unsigned long long* ranges, int n) {
    std::vector<std::pair<uintptr_t, uintptr_t>> r;
    for (int i = 0; i < n; ++i)
        if (ranges[2 * i + 1] > ranges[2 * i]) r.emplace_back((uintptr_t)ranges[2 * i], (uintptr_t)ranges[2 * i + 1]);
    std::sort(r.begin(), r.end());
    g_ranges.clear();
    for (auto& x : r) {
        if (!g_ranges.empty() && x.first <= g_ranges.back().second) {
            g_ranges.back().second = std::max(g_ranges.back().second, x.second);
        } else {
            g_ranges.push_back(x);
        }
    }
    g_read.clear();
    g_written.clear();
    g_armed = true;
}
namespace emu {
void trace_enter() { g_tracing = g_armed; }
void trace_exit() { g_tracing = false; }
}  // namespace emu

// out: sectors read, sectors written, sectors touched (read or written).
EMU_EXPORT void emu_trace_end(unsigned long long* out) {
    g_armed = g_tracing = false;
    unsigned long long both = 0;
    for (unsigned long long s : g_written) both += g_read.count(s);
    out[0] = g_read.size();
    out[1] = g_written.size();
    out[2] = g_read.size() + g_written.size() - both;
}
EMU_EXPORT int emu_traced() { return 1; }
#else
EMU_EXPORT int emu_traced() { return 0; }
#endif
