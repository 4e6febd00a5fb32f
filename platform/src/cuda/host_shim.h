// CUDA C as host C++: the device-side names hprt's kernels use, given their IEEE meaning, and a
// grid runner. Two users: the host-compiled check of the generated kernel source
// (platform/src/cuda/kernels.rs, which calls kernels as plain functions: one thread, one block),
// and the CUDA emulator's NVRTC (tests/cuda-emulator), which appends a launcher per kernel.
//
// A launch runs the grid's blocks one after another on the calling (stream worker) thread. In a
// module that needs cooperation (__syncthreads, warp shuffles / votes, shared memory), each block's
// threads are fibers (ucontext) switched at every barrier, so they really meet there; other
// modules run their threads as a plain loop. Static __shared__ arrays are per OS thread, hence per
// running block; `extern __shared__` (dynamic) arrays are the launch's sharedMemBytes.
#include <cstring>
#include <cfenv>
#include <cstdint>
#include <cstdlib>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static thread_local
#define __align__(n) alignas(n)

struct dim3 { unsigned int x, y, z; };

namespace hprt_emu {
enum { RUN = 0, DONE = 1, AT_WARP = 2, AT_BLOCK = 3 };
struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    int state;
    unsigned lane, warp;
};
struct Grid {
    dim3 block_idx, block_dim, grid_dim, tid;
    Fiber* cur;
    ucontext_t sched;
    void (*body)(void*);
    void* body_arg;
    unsigned char* dyn_smem;
    unsigned long long slots[32][32];
};
static thread_local Grid g = {{0, 0, 0}, {1, 1, 1}, {1, 1, 1}, {0, 0, 0}, nullptr, {}, nullptr, nullptr, nullptr, {}};
static inline const dim3& thread_idx() { return g.cur ? g.cur->tid : g.tid; }

static inline void yield_as(int state) {
    Fiber* f = g.cur;
    f->state = state;
    swapcontext(&f->ctx, &g.sched);
}
// Every thread of the warp reaches this point before any goes on.
static inline void warp_sync() { if (g.cur) yield_as(AT_WARP); }
static inline unsigned lane() { return g.cur ? g.cur->lane : 0; }
static inline unsigned warp() { return g.cur ? g.cur->warp : 0; }
static inline unsigned block_threads() { return g.block_dim.x * g.block_dim.y * g.block_dim.z; }
// Lanes present in the calling thread's warp (the last warp of a block may be partial).
static inline unsigned warp_lanes() {
    unsigned n = block_threads(), first = warp() * 32;
    return n - first >= 32 ? 32 : n - first;
}

template <typename T>
static inline T exchange(T v, unsigned src) {
    static_assert(sizeof(T) <= 8, "warp exchanges move at most 8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    g.slots[warp()][lane()] = bits;
    warp_sync();
    bits = g.slots[warp()][src < warp_lanes() ? src : lane()];
    warp_sync();
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}

static void fiber_entry() {
    g.body(g.body_arg);
    g.cur->state = DONE;
}

// Runs one block of `n` fiber threads; 0, or 1 when its threads wait at barriers that can never
// all be reached (a divergent __syncthreads), which the launch reports as a failure.
static inline int run_block(Fiber* fs, unsigned n, char* stacks, size_t stack) {
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = fs[i];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks + i * stack;
        f.ctx.uc_stack.ss_size = stack;
        f.ctx.uc_link = &g.sched;
        makecontext(&f.ctx, fiber_entry, 0);
        f.tid.x = i % g.block_dim.x;
        f.tid.y = (i / g.block_dim.x) % g.block_dim.y;
        f.tid.z = i / (g.block_dim.x * g.block_dim.y);
        f.state = RUN;
        f.lane = i % 32;
        f.warp = i / 32;
    }
    for (;;) {
        for (unsigned i = 0; i < n; ++i) {
            if (fs[i].state != RUN) continue;
            g.cur = &fs[i];
            swapcontext(&g.sched, &fs[i].ctx);
            g.cur = nullptr;
        }
        bool all_done = true, block_ready = true, released = false;
        for (unsigned i = 0; i < n; ++i) {
            all_done &= fs[i].state == DONE;
            block_ready &= fs[i].state == DONE || fs[i].state == AT_BLOCK;
        }
        if (all_done) return 0;
        if (block_ready) {
            for (unsigned i = 0; i < n; ++i)
                if (fs[i].state == AT_BLOCK) fs[i].state = RUN;
            continue;
        }
        for (unsigned w = 0; w * 32 < n; ++w) {
            unsigned end = (w + 1) * 32 < n ? (w + 1) * 32 : n;
            bool ready = true, any = false;
            for (unsigned i = w * 32; i < end; ++i) {
                ready &= fs[i].state == DONE || fs[i].state == AT_WARP;
                any |= fs[i].state == AT_WARP;
            }
            if (ready && any) {
                for (unsigned i = w * 32; i < end; ++i)
                    if (fs[i].state == AT_WARP) fs[i].state = RUN;
                released = true;
            }
        }
        if (!released) return 1;
    }
}

// dims: grid x, y, z, block x, y, z. Returns 0, or 1 for a launch that failed (see run_block).
static inline int run_grid(const unsigned* dims, unsigned shmem, bool coop, void (*body)(void*), void* arg) {
    Grid saved = g;
    g.grid_dim = {dims[0], dims[1], dims[2]};
    g.block_dim = {dims[3], dims[4], dims[5]};
    g.body = body;
    g.body_arg = arg;
    unsigned n = block_threads();
    const size_t stack = 64 * 1024;
    unsigned char* smem = static_cast<unsigned char*>(std::calloc(shmem ? shmem : 1, 1));
    char* stacks = coop ? static_cast<char*>(std::malloc(n * stack)) : nullptr;
    Fiber* fibers = coop ? static_cast<Fiber*>(std::calloc(n, sizeof(Fiber))) : nullptr;
    int failed = (!smem || (coop && (!stacks || !fibers))) ? 1 : 0;
    g.dyn_smem = smem;
    for (unsigned bz = 0; bz < dims[2] && !failed; ++bz)
        for (unsigned by = 0; by < dims[1] && !failed; ++by)
            for (unsigned bx = 0; bx < dims[0] && !failed; ++bx) {
                g.block_idx = {bx, by, bz};
                if (coop) {
                    failed = run_block(fibers, n, stacks, stack);
                    continue;
                }
                for (unsigned i = 0; i < n; ++i) {
                    g.tid = {i % dims[3], (i / dims[3]) % dims[4], i / (dims[3] * dims[4])};
                    body(arg);
                }
            }
    std::free(fibers);
    std::free(stacks);
    std::free(smem);
    g = saved;
    return failed;
}
}  // namespace hprt_emu

#define threadIdx (::hprt_emu::thread_idx())
#define blockIdx (::hprt_emu::g.block_idx)
#define blockDim (::hprt_emu::g.block_dim)
#define gridDim (::hprt_emu::g.grid_dim)
#define warpSize 32

static inline void __syncthreads() { if (::hprt_emu::g.cur) ::hprt_emu::yield_as(::hprt_emu::AT_BLOCK); }
static inline void __syncwarp(unsigned = 0xffffffffu) { ::hprt_emu::warp_sync(); }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline unsigned __activemask() {
    unsigned n = ::hprt_emu::warp_lanes();
    return n == 32 ? 0xffffffffu : (1u << n) - 1u;
}
template <typename T>
static inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    unsigned l = ::hprt_emu::lane();
    return ::hprt_emu::exchange(v, l - l % width + (unsigned)src % width);
}
template <typename T>
static inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    unsigned l = ::hprt_emu::lane();
    return ::hprt_emu::exchange(v, l % width + delta < (unsigned)width ? l + delta : l);
}
template <typename T>
static inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    unsigned l = ::hprt_emu::lane();
    return ::hprt_emu::exchange(v, l % width >= delta ? l - delta : l);
}
template <typename T>
static inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    unsigned l = ::hprt_emu::lane(), s = l ^ (unsigned)mask;
    return ::hprt_emu::exchange(v, s / width == l / width ? s : l);
}
static inline unsigned __ballot_sync(unsigned mask, int pred) {
    using ::hprt_emu::g;
    unsigned w = ::hprt_emu::warp(), n = ::hprt_emu::warp_lanes(), bits = 0;
    g.slots[w][::hprt_emu::lane()] = pred != 0;
    ::hprt_emu::warp_sync();
    for (unsigned i = 0; i < n; ++i) bits |= (unsigned)g.slots[w][i] << i;
    ::hprt_emu::warp_sync();
    return bits & mask;
}
static inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
static inline int __all_sync(unsigned mask, int pred) {
    return __ballot_sync(mask, pred) == (mask & __activemask());
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }

template <typename T>
static inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline float atomicAdd(float* p, float v) {
    float old = *p, next;
    do {
        next = old + v;
    } while (!__atomic_compare_exchange(p, &old, &next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}
template <typename T>
static inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }
template <typename T>
static inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <typename T>
static inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
template <typename T>
static inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
template <typename T>
static inline T atomicCAS(T* p, T expected, T desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
template <typename T>
static inline T atomicMax(T* p, T v) {
    T old = *p;
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <typename T>
static inline T atomicMin(T* p, T v) {
    T old = *p;
    while (old > v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}

static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline long long __double_as_longlong(double d) { long long u; std::memcpy(&u, &d, 8); return u; }
static inline double __longlong_as_double(long long u) { double d; std::memcpy(&d, &u, 8); return d; }
static inline float __double2float_rn(double x) { return (float)x; }
static inline float __double2float_rz(double x) {
    int mode = std::fegetround();
    std::fesetround(FE_TOWARDZERO);
    volatile double v = x;
    volatile float r = (float)v;
    std::fesetround(mode);
    return r;
}
static inline long long __double2ll_rz(double x) { return (long long)x; }
static inline float __ll2float_rn(long long n) { return (float)n; }
static inline double __ll2double_rn(long long n) { return (double)n; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
