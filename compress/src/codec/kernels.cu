// hprt codec, format version 2 (compress/FORMAT.md), as CUDA C for NVRTC.
//
// One source, three compilers: NVRTC for the device; the CUDA emulator's NVRTC, which compiles it
// as host C++ against platform/src/cuda/host_shim.h (every block's threads are fibers that meet
// at barriers and warp operations); and the byte-equality test in cuda.rs, which compiles it the
// same way and calls the kernels through the shim's grid runner.
//
// Batched: one launch sequence codes a batch of tensors. The host writes a header and one
// descriptor per tensor at the start of the workspace (one host-to-device copy), and every
// kernel reads them from there: its only parameter is the workspace. Work items are coding
// blocks numbered across the batch ("global blocks"); a tensor's blocks are consecutive.
//
// Encode, three launches (cuda.rs `CudaCodec`; W = HPRT_WARPS warps of 32 threads a CTA):
//   count  <<<min(blocks, G), 256>>>  one pass over the input: the symbol histogram (shared
//          memory, then u64 atomics) and the checksum terms from the same 16-byte loads; the
//          CTA that finishes a tensor's last block builds its frequency table (FORMAT.md's
//          normalisation, in shared memory) and zeroes the counts for the next use.
//   measure <<<min(ceil(blocks / W), G), 32 W>>>  warp per block: the table in shared memory,
//          32 interleaved rANS states (lane l owns state l), the block's coded length only
//          (no payload is kept: no tensor-sized workspace). The warp that measures a tensor's
//          last block scans its block lengths, writes header, table, index and prefix checksum,
//          and the encoding's length (device memory: the host reads it after an event).
//   encode <<<min(ceil(blocks / W), G), 32 W>>>  every block coded again, straight to its
//          place after the prefix: emitting lanes' word positions by ballot + popcount, the
//          mantissa stream packed by shuffles from the same loads; raw blocks copied.
// Decode, one launch:
//   decode <<<G', 32 W>>>  per tensor, every CTA checks the prefix (header, prefix checksum,
//          table, block lengths) and builds the decoding table in shared memory; its warps
//          decode blocks (warp per block) straight into the output, with their checksum terms;
//          the CTA that finishes last compares the tensor checksum and leaves the status word.
// Counters that make "last" work (tickets, histogram, checksum terms) are zero between launch
// sequences: the workspace starts zeroed and each sequence's last user of a counter resets it,
// so no memset runs per call. Nothing waits on the host: lengths, offsets and statuses travel in
// device memory.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define HPRT_LANES 32u
#define HPRT_WARPS 4u
#define HPRT_FULL 0xffffffffu
#define HPRT_HEADER_LEN 48u
#define HPRT_STATES_LEN 128u
#define HPRT_RANS_L (1u << 15)
#define HPRT_K1 0x9E3779B97F4A7C15ull
#define HPRT_K2 0xD6E8FEB86659FD93ull

// Decoder status codes (0 = fine); the Rust side names them.
#define HPRT_BAD_HEADER 1u
#define HPRT_BAD_CHECKSUM 2u
#define HPRT_BAD_TABLE 3u
#define HPRT_BAD_LENGTH 4u
#define HPRT_BAD_PADDING 5u
#define HPRT_BAD_STATE 6u
#define HPRT_BAD_STREAM 7u
#define HPRT_BAD_DATA 8u
#define HPRT_MISMATCH 9u
#define HPRT_VERSION_1 10u

// Workspace layout (u64 words at the start; cuda.rs `Layout` writes them).
#define HPRT_W_TENSORS 0
#define HPRT_W_BLOCKS 1
#define HPRT_W_HIST 2
#define HPRT_W_TABLE 3
#define HPRT_W_COUNTERS 4
#define HPRT_W_RESULTS 5
#define HPRT_W_LENS 6
#define HPRT_W_OFFSETS 7
#define HPRT_W_DESC 8
#define HPRT_HEAD_WORDS 16
// Descriptor fields (u64 each, HPRT_DESC_WORDS per tensor).
#define HPRT_D_SRC 0        // encode: the tensor; decode: the encoding
#define HPRT_D_DST 1        // encode: the scratch buffer; decode: the tensor
#define HPRT_D_NUMEL 2
#define HPRT_D_LEN 3        // decode: the encoding's length
#define HPRT_D_DTYPE 4      // dtype code
#define HPRT_D_SIZE 5       // element bytes
#define HPRT_D_MANT 6       // mantissa bits
#define HPRT_D_PROB 7       // encode: prob_bits
#define HPRT_D_BLOCK 8      // encode: block_elems
#define HPRT_D_NBLOCKS 9    // encode: blocks; decode: the most blocks the encoding can have
#define HPRT_D_FIRST 10     // encode: the tensor's first global block
#define HPRT_DESC_WORDS 16
// Per-tensor counters (u64 each, HPRT_CTR_WORDS per tensor); zero between sequences except
// TOTAL and PREFIX, which the encode finisher writes for place.
#define HPRT_C_TERMS 0
#define HPRT_C_COUNT_DONE 1
#define HPRT_C_ENCODE_DONE 2
#define HPRT_C_TOTAL 3
#define HPRT_C_PREFIX 4
#define HPRT_C_STATUS 5
#define HPRT_C_DECODE_DONE 6
#define HPRT_C_RANGES 7     // three words: the sign ranges of a sampled tensor (hprt_tally_word)
#define HPRT_CTR_WORDS 10

// Symbol counts (FORMAT.md, "Symbol counts"; v2/counts.rs): a tensor of HPRT_SAMPLE_FROM
// elements or more is counted on the elements i with i % HPRT_SAMPLE_PERIOD < HPRT_SAMPLE_RUN,
// plus one for every symbol the sample missed that may be in the tensor: inside its sign's range
// over all elements (zero and all-ones exponents left out), or an edge exponent that occurs.
#define HPRT_SAMPLE_FROM (1ull << 20)
#define HPRT_SAMPLE_RUN 64ull
#define HPRT_SAMPLE_PERIOD 512ull

// The work model: bytes each kernel moves through global memory for the data (input, slots,
// output; not its few words of tables and counters), counted where the host-compiled test
// defines HPRT_COUNT_BYTES and compiled away everywhere else.
#ifdef HPRT_COUNT_BYTES
extern "C" { u64 hprt_bytes_read = 0, hprt_bytes_written = 0; }
#define HPRT_READ(n) __atomic_fetch_add(&hprt_bytes_read, (u64)(n), __ATOMIC_RELAXED)
#define HPRT_WRITE(n) __atomic_fetch_add(&hprt_bytes_written, (u64)(n), __ATOMIC_RELAXED)
#else
#define HPRT_READ(n) ((void)0)
#define HPRT_WRITE(n) ((void)0)
#endif

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
typedef ulonglong2 hprt_u128;
#else
struct hprt_u128 { u64 x, y; };
// Register allocation hints, for NVRTC only (the platform compiles a cubin for the device's own
// architecture, sm_XY, where NVRTC knows it).
#define __launch_bounds__(n)
#endif

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define HPRT_UNROLL _Pragma("unroll")
#else
#define HPRT_UNROLL
#endif

// Groups of 32 elements whose loads a coding warp issues together, ahead of their use: a warp
// codes its block group after group through one dependent chain of rANS states, so one load in
// flight at a time left it waiting on device memory for every group (on an H200 at 64 MiB:
// 1 ms per pass, 4 % of its memory bandwidth, with one or two warps per multiprocessor).
#define HPRT_AHEAD 8u

// The high 32 bits of a * b.
__device__ __forceinline__ u32 hprt_mulhi(u32 a, u32 b) {
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
    return __umulhi(a, b);
#else
    return (u32)(((u64)a * b) >> 32);
#endif
}

__device__ __forceinline__ u64 hprt_term(u64 w, u64 i) {
    u64 z = (w ^ (i * HPRT_K1)) * HPRT_K2;
    return z ^ (z >> 29);
}

__device__ __forceinline__ u64 hprt_finish_check(u64 terms, u64 len) {
    u64 z = (terms ^ len) * HPRT_K1;
    return z ^ (z >> 31);
}

// The 8-byte little-endian word `i` of `p` (zero-padded past `len`).
__device__ __forceinline__ u64 hprt_word(const u8* p, u64 len, u64 i) {
    u64 w = 0;
    for (u32 k = 0; k < 8; ++k) {
        u64 at = i * 8 + k;
        if (at < len) w |= (u64)p[at] << (8 * k);
    }
    return w;
}

// Element `i` of `p` (elements of `size` bytes; `aligned`: p is size-aligned).
__device__ __forceinline__ u32 hprt_load(const u8* p, u64 i, u32 size, int aligned) {
    if (aligned) return size == 2 ? (u32)((const u16*)p)[i] : ((const u32*)p)[i];
    u32 v = 0;
    for (u32 k = 0; k < size; ++k) v |= (u32)p[i * size + k] << (8 * k);
    return v;
}

__device__ __forceinline__ void hprt_store(u8* p, u64 i, u32 size, u32 v, int aligned) {
    if (aligned) {
        if (size == 2) ((u16*)p)[i] = (u16)v;
        else ((u32*)p)[i] = v;
        return;
    }
    for (u32 k = 0; k < size; ++k) p[i * size + k] = (u8)(v >> (8 * k));
}

__device__ __forceinline__ void hprt_put_u64(u8* p, u64 v) {
    for (u32 k = 0; k < 8; ++k) p[k] = (u8)(v >> (8 * k));
}

__device__ __forceinline__ u64 hprt_get_u64(const u8* p) {
    u64 v = 0;
    for (u32 k = 0; k < 8; ++k) v |= (u64)p[k] << (8 * k);
    return v;
}

__device__ __forceinline__ u32 hprt_get_u32(const u8* p) {
    return (u32)p[0] | (u32)p[1] << 8 | (u32)p[2] << 16 | (u32)p[3] << 24;
}

__device__ __forceinline__ const u64* hprt_head(const u8* ws) { return (const u64*)ws; }

__device__ __forceinline__ const u64* hprt_desc(const u8* ws, u32 t) {
    return (const u64*)(ws + hprt_head(ws)[HPRT_W_DESC]) + (u64)t * HPRT_DESC_WORDS;
}

__device__ __forceinline__ u64* hprt_ctr(u8* ws, u32 t) {
    return (u64*)(ws + hprt_head(ws)[HPRT_W_COUNTERS]) + (u64)t * HPRT_CTR_WORDS;
}

// The tensor holding global block `gb` (descriptors are in block order).
__device__ __forceinline__ u32 hprt_tensor_of(const u8* ws, u64 gb) {
    u32 lo = 0, hi = (u32)hprt_head(ws)[HPRT_W_TENSORS];
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (hprt_desc(ws, mid)[HPRT_D_FIRST] <= gb) lo = mid; else hi = mid;
    }
    return lo;
}

__device__ __forceinline__ u64 hprt_volatile_u64(const u64* p) { return *(const volatile u64*)p; }
__device__ __forceinline__ u32 hprt_volatile_u32(const u32* p) { return *(const volatile u32*)p; }

// Sum over the warp (every lane gets it).
__device__ __forceinline__ u64 hprt_warp_sum(u64 v) {
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(HPRT_FULL, v, d);
    return v;
}

// Bitwise or over the warp (every lane gets it).
__device__ __forceinline__ u32 hprt_warp_or(u32 v) {
    for (int d = 16; d > 0; d >>= 1) v |= __shfl_xor_sync(HPRT_FULL, v, d);
    return v;
}

// Whether symbol `b` is a better unit to move than `a` (0xffffffff: none): for `take`, the
// smallest counts / (2 freq - 1); otherwise the largest counts / (2 freq + 1); ties go to the
// lowest symbol (FORMAT.md, "Frequency normalisation").
__device__ __forceinline__ int hprt_better(const u64* counts, const u32* freq, u32 a, u32 b,
                                           int take) {
    if (b == 0xffffffffu) return 0;
    if (a == 0xffffffffu) return 1;
    u64 lhs, rhs;
    if (take) {
        lhs = counts[b] * (2ull * freq[a] - 1);
        rhs = counts[a] * (2ull * freq[b] - 1);
    } else {
        lhs = counts[a] * (2ull * freq[b] + 1);
        rhs = counts[b] * (2ull * freq[a] + 1);
    }
    return lhs < rhs || (lhs == rhs && b < a);
}

// FORMAT.md's integer normalisation of `counts` (shared memory, 512 entries) into `freq`
// (shared), by the whole CTA: each unit moved is the best symbol found by a tree reduction over
// the alphabet (ties: the lowest symbol, as the sequential scan picks). `best` is scratch.
__device__ void hprt_normalise(const u64* counts, u32 alphabet, u32 prob_bits, u32* freq,
                               u32* best, u64* n_s, u64* sum_s, u32* present_s, u32* last_s) {
    u64 m = 1ull << prob_bits;
    if (threadIdx.x == 0) {
        u64 n = 0;
        u32 present = 0, last = 0;
        for (u32 s = 0; s < alphabet; ++s) {
            n += counts[s];
            if (counts[s]) { present += 1; last = s; }
        }
        *n_s = n;
        *present_s = present;
        *last_s = last;
    }
    __syncthreads();
    u64 n = *n_s;
    for (u32 s = threadIdx.x; s < 512; s += blockDim.x) {
        u64 f = s < alphabet && *present_s > 1 && counts[s] ? (counts[s] * m + n / 2) / n : 0;
        freq[s] = (u32)(s < alphabet && *present_s > 1 && counts[s] && f < 1 ? 1 : f);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (*present_s == 1) freq[*last_s] = (u32)m;
        u64 sum = 0;
        for (u32 s = 0; s < alphabet; ++s) sum += freq[s];
        *sum_s = *present_s > 1 ? sum : m;
    }
    __syncthreads();
    // Every thread reads sum_s after a barrier, so all take the same number of turns.
    while (*sum_s != m) {
        int take = *sum_s > m;
        for (u32 s = threadIdx.x; s < 512; s += blockDim.x)
            best[s] = s < alphabet && (take ? freq[s] > 1 : counts[s] > 0) ? s : 0xffffffffu;
        __syncthreads();
        for (u32 half = 256; half > 0; half >>= 1) {
            for (u32 s = threadIdx.x; s < half; s += blockDim.x)
                if (hprt_better(counts, freq, best[s], best[s + half], take)) best[s] = best[s + half];
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            if (take) { freq[best[0]] -= 1; *sum_s -= 1; }
            else { freq[best[0]] += 1; *sum_s += 1; }
        }
        __syncthreads();
    }
}

// Tallies the symbols of one 8-byte word (elements wholly before `n_in_word` only) whose
// first element is element `e0` of its tensor: counted when the tensor is not sampled or the
// word is in the sample; a sampled tensor's sign ranges, in `r`, as maxima that are 0 for none,
// over the symbols whose exponent is neither zero nor all ones: r[0] = half - least
// non-negative symbol, r[1] = 1 + greatest, r[2] = alphabet - least negative symbol,
// r[3] = 1 + greatest - half; and r[4] the edge exponents seen, bits 1 << (2 sign) for zero and
// 2 << (2 sign) for all ones (a word never straddles a run of the sample).
__device__ __forceinline__ void hprt_tally_word(u32* local, u32* r, u64 w, u32 size,
                                                u32 mant_bits, u32 n_in_word, u64 e0,
                                                int sampled) {
    u32 per = 8 / size, bits = 8 * size;
    u32 alphabet = 1u << (8 * size - mant_bits), half = alphabet / 2;
    int count = !sampled || e0 % HPRT_SAMPLE_PERIOD < HPRT_SAMPLE_RUN;
    for (u32 e = 0; e < per && e < n_in_word; ++e) {
        u32 v = (u32)(w >> (bits * e)) & (size == 4 ? 0xffffffffu : 0xffffu);
        u32 sym = (v >> mant_bits) & 511u;
        if (count) atomicAdd(&local[sym], 1u);
        u32 exp = sym & (half - 1), neg = sym >= half;
        if (sampled && (exp == 0 || exp == half - 1)) {
            r[4] |= (exp == 0 ? 1u : 2u) << (2 * neg);
        } else if (sampled) {
            if (!neg) {
                r[0] = r[0] > half - sym ? r[0] : half - sym;
                r[1] = r[1] > sym + 1 ? r[1] : sym + 1;
            } else {
                r[2] = r[2] > alphabet - sym ? r[2] : alphabet - sym;
                r[3] = r[3] > sym + 1 - half ? r[3] : sym + 1 - half;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) hprt_codec_count(u8* ws) {
    // A histogram per warp (at most 8 warps: the launch has 256 threads): activations put most
    // of their elements on a few exponents, and one shared histogram serialised the CTA's
    // atomics on those few counters.
    __shared__ u32 local[8 * 512];
    __shared__ u64 counts[512];
    __shared__ u32 freq[512];
    __shared__ u32 best[512];
    __shared__ u64 sum_s, n_s, fsum_s;
    __shared__ u32 present_s, last_sym_s, last_s, ranges_s[5];
    const u64* head = hprt_head(ws);
    u64 blocks = head[HPRT_W_BLOCKS];
    for (u64 gb = blockIdx.x; gb < blocks; gb += gridDim.x) {
        u32 t = hprt_tensor_of(ws, gb);
        const u64* d = hprt_desc(ws, t);
        u64 numel = d[HPRT_D_NUMEL], block_elems = d[HPRT_D_BLOCK];
        u32 size = (u32)d[HPRT_D_SIZE], mant_bits = (u32)d[HPRT_D_MANT];
        u64 b = gb - d[HPRT_D_FIRST], first = b * block_elems;
        u64 n = numel - first < block_elems ? numel - first : block_elems;
        const u8* p = (const u8*)(d[HPRT_D_SRC]) + first * size;
        u64 bytes = n * size, words = (bytes + 7) / 8, w0 = first * size / 8;
        u32 warps = (blockDim.x + HPRT_LANES - 1) / HPRT_LANES;
        u32* mine = local + 512 * (threadIdx.x / HPRT_LANES);
        for (u32 s = threadIdx.x; s < 512 * warps; s += blockDim.x) local[s] = 0;
        if (threadIdx.x == 0) sum_s = 0;
        if (threadIdx.x < 5) ranges_s[threadIdx.x] = 0;
        __syncthreads();
        u64 sum = 0, done = 0;
        u32 per = 8 / size;
        int sampled = numel >= HPRT_SAMPLE_FROM;
        u32 r[5] = {0, 0, 0, 0, 0};
        if (((u64)p & 15) == 0) {
            // Coalesced 16-byte loads, four in flight a thread: two words each, their terms and
            // their symbols.
            const hprt_u128* v = (const hprt_u128*)p;
            u64 n16 = bytes / 16;
            for (u64 i0 = threadIdx.x; i0 < n16; i0 += 4ull * blockDim.x) {
                hprt_u128 q[4];
                HPRT_UNROLL for (u32 k = 0; k < 4; ++k) {
                    u64 i = i0 + (u64)k * blockDim.x;
                    if (i < n16) q[k] = v[i];
                }
                HPRT_UNROLL for (u32 k = 0; k < 4; ++k) {
                    u64 i = i0 + (u64)k * blockDim.x;
                    if (i >= n16) break;
                    HPRT_READ(16);
                    sum += hprt_term(q[k].x, w0 + 2 * i) + hprt_term(q[k].y, w0 + 2 * i + 1);
                    u64 e0 = first + 2 * i * per;
                    hprt_tally_word(mine, r, q[k].x, size, mant_bits, per, e0, sampled);
                    hprt_tally_word(mine, r, q[k].y, size, mant_bits, per, e0 + per, sampled);
                }
            }
            done = n16 * 2;
        }
        for (u64 i = done + threadIdx.x; i < words; i += blockDim.x) {
            u64 w = hprt_word(p, bytes, i);
            HPRT_READ(bytes - 8 * i < 8 ? bytes - 8 * i : 8);
            sum += hprt_term(w, w0 + i);
            u64 e0 = i * per;
            hprt_tally_word(mine, r, w, size, mant_bits, (u32)(n - e0 < per ? n - e0 : per),
                            first + e0, sampled);
        }
        if (sum) atomicAdd(&sum_s, sum);
        if (sampled) {
            for (u32 k = 0; k < 4; ++k)
                if (r[k]) atomicMax(&ranges_s[k], r[k]);
            if (r[4]) atomicOr(&ranges_s[4], r[4]);
        }
        __syncthreads();
        u64* hist = (u64*)(ws + head[HPRT_W_HIST]) + 512ull * t;
        u64* ctr = hprt_ctr(ws, t);
        for (u32 s = threadIdx.x; s < 512; s += blockDim.x) {
            u32 c = 0;
            for (u32 k = 0; k < warps; ++k) c += local[512 * k + s];
            if (c) atomicAdd(&hist[s], (u64)c);
        }
        if (threadIdx.x == 0 && sum_s) atomicAdd(&ctr[HPRT_C_TERMS], sum_s);
        u32* ranges = (u32*)(ctr + HPRT_C_RANGES);
        if (threadIdx.x < 4 && ranges_s[threadIdx.x]) atomicMax(&ranges[threadIdx.x], ranges_s[threadIdx.x]);
        if (threadIdx.x == 4 && ranges_s[4]) atomicOr(&ranges[4], ranges_s[4]);
        // Every thread's counts are out before the ticket is taken.
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0)
            last_s = atomicAdd(&ctr[HPRT_C_COUNT_DONE], 1ull) == d[HPRT_D_NBLOCKS] - 1;
        __syncthreads();
        if (last_s) {
            // The last block of tensor t: its table, then its counts zeroed for the next use.
            __threadfence();
            u32 alphabet = 1u << (8 * size - mant_bits), prob_bits = (u32)d[HPRT_D_PROB];
            for (u32 s = threadIdx.x; s < 512; s += blockDim.x) counts[s] = hprt_volatile_u64(&hist[s]);
            __syncthreads();
            if (sampled) {
                // Every symbol of a sign's range counts at least one (it may be present).
                u32 half = alphabet / 2, g[5];
                for (u32 k = 0; k < 5; ++k) g[k] = hprt_volatile_u32(&ranges[k]);
                for (u32 s = threadIdx.x; s < alphabet; s += blockDim.x) {
                    u32 neg = s >= half, exp = s & (half - 1);
                    int in_pos = g[1] && s < half && half - s <= g[0] && s + 1 <= g[1];
                    int in_neg = g[3] && s >= half && alphabet - s <= g[2] && s + 1 - half <= g[3];
                    int edge = (exp == 0 && (g[4] >> (2 * neg) & 1)) ||
                               (exp == half - 1 && (g[4] >> (2 * neg) & 2));
                    if ((in_pos || in_neg || edge) && counts[s] == 0) counts[s] = 1;
                }
                __syncthreads();
                if (threadIdx.x < 5) ranges[threadIdx.x] = 0;
            }
            hprt_normalise(counts, alphabet, prob_bits, freq, best, &n_s, &fsum_s, &present_s,
                           &last_sym_s);
            // The encoder's constants per symbol (16 bytes, rans.rs `EncSym`): x_max, an exact
            // reciprocal of the frequency, bias and M - freq | shift << 16, so coding a symbol
            // is a multiply-high, not a division.
            u32* table = (u32*)(ws + head[HPRT_W_TABLE]) + 2048ull * t;
            if (threadIdx.x == 0) {
                u32 c = 0, m = 1u << prob_bits, lim = (HPRT_RANS_L >> prob_bits) << 16;
                for (u32 s = 0; s < 512; ++s) {
                    u32 f = s < alphabet ? freq[s] : 0, *e = table + 4 * s;
                    if (f == 0) {
                        e[0] = e[1] = e[2] = e[3] = 0;
                    } else if (f == 1) {
                        e[0] = lim;
                        e[1] = 0xffffffffu;
                        e[2] = c + m - 1;
                        e[3] = m - 1;
                    } else {
                        u32 shift = 32 - __clz((int)(f - 1));
                        e[0] = lim * f;
                        e[1] = (u32)(((1ull << (shift + 31)) + f - 1) / f);
                        e[2] = c;
                        e[3] = (m - f) | (shift - 1) << 16;
                    }
                    c += f;
                }
                ctr[HPRT_C_COUNT_DONE] = 0;
            }
            for (u32 s = threadIdx.x; s < 512; s += blockDim.x) hist[s] = 0;
        }
        __syncthreads();
    }
}

// The header, table, index and prefix checksum of tensor `t`, and its length, by one warp once
// every block of it is coded (its lengths are in `lens`).
__device__ void hprt_encode_finish(u8* ws, u32 t, u32 lane) {
    const u64* head = hprt_head(ws);
    const u64* d = hprt_desc(ws, t);
    u64* ctr = hprt_ctr(ws, t);
    u64 numel = d[HPRT_D_NUMEL], nb = d[HPRT_D_NBLOCKS], gb0 = d[HPRT_D_FIRST];
    u32 size = (u32)d[HPRT_D_SIZE], mant_bits = (u32)d[HPRT_D_MANT];
    u32 alphabet = 1u << (8 * size - mant_bits);
    const u32* table = (const u32*)(ws + head[HPRT_W_TABLE]) + 2048ull * t;
    u32 pb_shift = 31 - (u32)d[HPRT_D_PROB];
    const u32* lens = (const u32*)(ws + head[HPRT_W_LENS]) + gb0;
    u64* offsets = (u64*)(ws + head[HPRT_W_OFFSETS]) + gb0;
    u8* out = (u8*)(d[HPRT_D_DST]);
    // Exclusive scan of the block lengths (32 at a time), and their total.
    u64 run = 0;
    for (u64 k = 0; k < nb; k += HPRT_LANES) {
        u64 len = k + lane < nb ? hprt_volatile_u32(&lens[k + lane]) : 0, incl = len;
        for (u32 dd = 1; dd < HPRT_LANES; dd <<= 1) {
            u64 o = __shfl_up_sync(HPRT_FULL, incl, dd);
            if (lane >= dd) incl += o;
        }
        if (k + lane < nb) offsets[k + lane] = run + incl - len;
        run += __shfl_sync(HPRT_FULL, incl, 31);
    }
    // Table: the presence bitmap, then the present symbols' frequencies in symbol order.
    u64 table_at = HPRT_HEADER_LEN + alphabet / 8;
    u32 present = 0;
    for (u32 s0 = 0; s0 < alphabet; s0 += HPRT_LANES) {
        u32 s = s0 + lane;
        u32 f = s < alphabet ? table[4 * s] >> pb_shift : 0;
        u32 bal = __ballot_sync(HPRT_FULL, f != 0);
        if (f) {
            u64 at = table_at + 2ull * (present + __popc(bal & ((1u << lane) - 1)));
            out[at] = (u8)f;
            out[at + 1] = (u8)(f >> 8);
        }
        if (lane < 4 && s0 / 8 + lane < alphabet / 8) out[HPRT_HEADER_LEN + s0 / 8 + lane] = (u8)(bal >> (8 * lane));
        present += __popc(bal);
    }
    u64 index_at = table_at + 2ull * present, prefix = index_at + 4 * nb;
    for (u64 b = lane; b < nb; b += HPRT_LANES) {
        u32 len = hprt_volatile_u32(&lens[b]);
        for (u32 k = 0; k < 4; ++k) out[index_at + 4 * b + k] = (u8)(len >> (8 * k));
    }
    if (lane == 0) {
        out[0] = 'H'; out[1] = 'P'; out[2] = 'R'; out[3] = 'Z';
        out[4] = 2; out[5] = 0;
        out[6] = (u8)d[HPRT_D_DTYPE];
        out[7] = (u8)HPRT_LANES;
        out[8] = (u8)d[HPRT_D_PROB];
        out[9] = out[10] = out[11] = 0;
        for (u32 k = 0; k < 4; ++k) out[12 + k] = (u8)(d[HPRT_D_BLOCK] >> (8 * k));
        hprt_put_u64(out + 16, numel);
        hprt_put_u64(out + 24, run);
        hprt_put_u64(out + 32, hprt_finish_check(hprt_volatile_u64(&ctr[HPRT_C_TERMS]), numel * size));
        hprt_put_u64(out + 40, 0);
    }
    __syncwarp();
    u64 sum = 0;
    for (u64 i = lane; i < (prefix + 7) / 8; i += HPRT_LANES) sum += hprt_term(hprt_word(out, prefix, i), i);
    sum = hprt_warp_sum(sum);
    if (lane == 0) {
        hprt_put_u64(out + 40, hprt_finish_check(sum, prefix));
        HPRT_WRITE(prefix);
        HPRT_READ(prefix);
        ctr[HPRT_C_TOTAL] = run;
        ctr[HPRT_C_PREFIX] = prefix;
        ctr[HPRT_C_TERMS] = 0;
        ctr[HPRT_C_ENCODE_DONE] = 0;
        ((u64*)(ws + head[HPRT_W_RESULTS]))[t] = prefix + run;
    }
    __syncwarp();
}

// The table of tensor `t` in this warp's shared copy (`tab`, for tensor `*tab_of`).
__device__ __forceinline__ void hprt_warp_table(const u8* ws, u32 t, u32* tab, u32* tab_of, u32 lane) {
    if (*tab_of == t) return;
    const u32* table = (const u32*)(ws + hprt_head(ws)[HPRT_W_TABLE]) + 2048ull * t;
    for (u32 s = lane; s < 2048; s += HPRT_LANES) tab[s] = table[s];
    __syncwarp();
    if (lane == 0) *tab_of = t;
    __syncwarp();
}

// Elements of the `HPRT_AHEAD` groups below group `top` (group `top - 1 - k` in `v[k]`; 0
// past the block's `n` elements), loaded together.
#define HPRT_LOAD_AHEAD(v, top)                                                              \
    HPRT_UNROLL for (u32 k = 0; k < HPRT_AHEAD; ++k) {                                        \
        u32 i = ((top) - 1 - k) * HPRT_LANES + lane;                                          \
        v[k] = (top) > k && i < n ? hprt_load(in, i, size, aligned) : 0;                      \
    }

// Codes block `b` of the tensor of descriptor `d` with one warp (lane `lane` owns rANS state
// `lane`). With `dst` null it only measures: the coded length, or the raw size once the stream
// reaches it (the stream only grows). Otherwise the block is known to be coded (shorter than
// raw) and its payload (mantissas, words, states) is written at `dst`.
__device__ u64 hprt_code_block(const u64* d, u64 b, const u32* tab, u8* dst, u32 lane) {
    u64 numel = d[HPRT_D_NUMEL], block_elems = d[HPRT_D_BLOCK];
    u32 size = (u32)d[HPRT_D_SIZE], w = (u32)d[HPRT_D_MANT];
    u64 first = b * block_elems;
    u32 n = (u32)(numel - first < block_elems ? numel - first : block_elems);
    const u8* __restrict__ in = (const u8*)(d[HPRT_D_SRC]) + first * size;
    int aligned = ((u64)in % size) == 0;
    u64 raw = (u64)n * size, mlen = ((u64)n * w + 7) / 8;
    u32 mask = (1u << w) - 1;
    u32 x = HPRT_RANS_L, pos = 0, groups = (n + HPRT_LANES - 1) / HPRT_LANES;
    u32 rounds = dst ? (4 * w + HPRT_LANES - 1) / HPRT_LANES : 0;
    u32 cur[HPRT_AHEAD], next[HPRT_AHEAD];
    HPRT_LOAD_AHEAD(cur, groups)
    for (u32 top = groups; top > 0;) {
        u32 below = top > HPRT_AHEAD ? top - HPRT_AHEAD : 0;
        HPRT_LOAD_AHEAD(next, below)
        HPRT_UNROLL for (u32 k = 0; k < HPRT_AHEAD; ++k) {
            if (k >= top - below) break;
            u32 gi = top - 1 - k;
            if (mlen + 2ull * pos + HPRT_STATES_LEN >= raw) return raw;
            u32 base = gi * HPRT_LANES, cnt = n - base < HPRT_LANES ? n - base : HPRT_LANES;
            int active = lane < cnt;
            u32 v = cur[k];
            if (active) HPRT_READ(size);
            u32 s = (v >> w) & 511u, mant = v & mask;
            const u32* e = tab + 4 * s;
            int emit = active && x >= e[0];
            u32 bal = __ballot_sync(HPRT_FULL, emit);
            if (emit) {
                if (dst) {
                    // Lanes emit from the highest to the lowest, as the sequential coder does.
                    u32 before = lane == 31 ? 0 : __popc(bal >> (lane + 1));
                    u64 at = mlen + 2ull * (pos + before);
                    HPRT_WRITE(2);
                    dst[at] = (u8)x;
                    dst[at + 1] = (u8)(x >> 8);
                }
                x >>= 16;
            }
            if (active) x = x + e[2] + (hprt_mulhi(x, e[1]) >> (e[3] >> 16)) * (e[3] & 0xffffu);
            pos += __popc(bal);
            // This group's mantissa bytes (32 w bits = 4 w bytes from byte 4 w gi), gathered
            // from the lanes holding them; inactive lanes hold 0, the padding.
            u32 gbytes = (cnt * w + 7) / 8;
            for (u32 r = 0; r < rounds; ++r) {
                u32 j = lane + HPRT_LANES * r, bit = 8 * j, e0 = bit / w, sh = bit - e0 * w;
                u32 m0 = __shfl_sync(HPRT_FULL, mant, e0 < 32 ? e0 : 0);
                u32 m1 = __shfl_sync(HPRT_FULL, mant, e0 + 1 < 32 ? e0 + 1 : 0);
                if (j < gbytes) {
                    u32 byte = m0 >> sh;
                    if (e0 + 1 < cnt) byte |= m1 << (w - sh);
                    HPRT_WRITE(1);
                    dst[4ull * w * gi + j] = (u8)byte;
                }
            }
        }
        HPRT_UNROLL for (u32 k = 0; k < HPRT_AHEAD; ++k) cur[k] = next[k];
        top = below;
    }
    u64 len = mlen + 2ull * pos + HPRT_STATES_LEN;
    if (len >= raw) return raw;
    if (dst) {
        u64 at = mlen + 2ull * pos;
        for (u32 k = 0; k < 4; ++k) dst[at + 4 * lane + k] = (u8)(x >> (8 * k));
        HPRT_WRITE(4);
    }
    return len;
}

// Pass 1 of the coder: every block's length (no payload written); the warp that measures a
// tensor's last block writes its prefix (`hprt_encode_finish`).
extern "C" __global__ void __launch_bounds__(128) hprt_codec_measure(u8* ws) {
    __shared__ u32 tab[HPRT_WARPS][2048];
    __shared__ u32 tab_of[HPRT_WARPS];
    const u64* head = hprt_head(ws);
    u64 blocks = head[HPRT_W_BLOCKS];
    u32 lane = threadIdx.x % HPRT_LANES, warp = threadIdx.x / HPRT_LANES;
    if (lane == 0) tab_of[warp] = 0xffffffffu;
    __syncwarp();
    u32* lens = (u32*)(ws + head[HPRT_W_LENS]);
    for (u64 gb = (u64)blockIdx.x * HPRT_WARPS + warp; gb < blocks;
         gb += (u64)gridDim.x * HPRT_WARPS) {
        u32 t = hprt_tensor_of(ws, gb);
        const u64* d = hprt_desc(ws, t);
        hprt_warp_table(ws, t, tab[warp], &tab_of[warp], lane);
        u64 len = hprt_code_block(d, gb - d[HPRT_D_FIRST], tab[warp], 0, lane);
        u32 last = 0;
        if (lane == 0) {
            lens[gb] = (u32)len;
            __threadfence();
            last = atomicAdd(&hprt_ctr(ws, t)[HPRT_C_ENCODE_DONE], 1ull) == d[HPRT_D_NBLOCKS] - 1;
        }
        last = __shfl_sync(HPRT_FULL, last, 0);
        if (last) {
            __threadfence();
            hprt_encode_finish(ws, t, lane);
        }
    }
}

// Pass 2: every block coded again, straight to its place after the prefix (raw blocks copied).
extern "C" __global__ void __launch_bounds__(128) hprt_codec_encode(u8* ws) {
    __shared__ u32 tab[HPRT_WARPS][2048];
    __shared__ u32 tab_of[HPRT_WARPS];
    const u64* head = hprt_head(ws);
    u64 blocks = head[HPRT_W_BLOCKS];
    u32 lane = threadIdx.x % HPRT_LANES, warp = threadIdx.x / HPRT_LANES;
    if (lane == 0) tab_of[warp] = 0xffffffffu;
    __syncwarp();
    const u32* lens = (const u32*)(ws + head[HPRT_W_LENS]);
    const u64* offsets = (const u64*)(ws + head[HPRT_W_OFFSETS]);
    for (u64 gb = (u64)blockIdx.x * HPRT_WARPS + warp; gb < blocks;
         gb += (u64)gridDim.x * HPRT_WARPS) {
        u32 t = hprt_tensor_of(ws, gb);
        const u64* d = hprt_desc(ws, t);
        u64 b = gb - d[HPRT_D_FIRST], len = lens[gb], size = d[HPRT_D_SIZE];
        u64 first = b * d[HPRT_D_BLOCK], numel = d[HPRT_D_NUMEL];
        u64 raw = (numel - first < d[HPRT_D_BLOCK] ? numel - first : d[HPRT_D_BLOCK]) * size;
        u8* to = (u8*)(d[HPRT_D_DST]) + hprt_ctr(ws, t)[HPRT_C_PREFIX] + offsets[gb];
        if (len == raw) {
            const u8* in = (const u8*)(d[HPRT_D_SRC]) + first * size;
            if (lane == 0) { HPRT_READ(raw); HPRT_WRITE(raw); }
            if ((((u64)to | (u64)in) & 3) == 0) {
                for (u64 j = lane; j < raw / 4; j += HPRT_LANES) ((u32*)to)[j] = ((const u32*)in)[j];
                for (u64 j = raw / 4 * 4 + lane; j < raw; j += HPRT_LANES) to[j] = in[j];
            } else {
                for (u64 j = lane; j < raw; j += HPRT_LANES) to[j] = in[j];
            }
            continue;
        }
        hprt_warp_table(ws, t, tab[warp], &tab_of[warp], lane);
        hprt_code_block(d, b, tab[warp], to, lane);
    }
}

// What a decoding warp stages in shared memory, so that the loads of a chunk of groups go out
// together instead of one dependent load per group: the mantissa bytes of `HPRT_AHEAD` groups
// (4 w bytes a group, w <= 23, and 4 zero bytes after them), and a window of the rANS words
// the next groups will read (the decoder reads them from the stream's end downwards).
#define HPRT_MANT_STAGE (HPRT_AHEAD * 4u * 23u + 4u)
#define HPRT_WORD_WINDOW 256u

// Decodes one coded block (warp per block) of `n` elements from `p` (`len` bytes) into `dst`;
// returns its status (0 = fine) and adds the checksum terms of its words to `sum`. `mst` and
// `wst` are this warp's staging buffers (HPRT_MANT_STAGE bytes, HPRT_WORD_WINDOW words).
__device__ u32 hprt_decode_block(const u8* p, u64 len, u32 n, u8* dst, u32 size, u32 w,
                                 u32 prob_bits, const u16* sym, const u32* tab, u64 w0,
                                 int aligned, u32 lane, u64* sum, u8* mst, u16* wst) {
    u64 mlen = ((u64)n * w + 7) / 8;
    u32 used = (u32)(((u64)n * w) % 8), m = 1u << prob_bits;
    u32 bad = (used != 0 && (p[mlen - 1] >> used) != 0) ? HPRT_BAD_PADDING : 0;
    u32 pos = (u32)((len - mlen - HPRT_STATES_LEN) / 2);
    const u8* words = p + mlen;
    u32 x = hprt_get_u32(p + len - HPRT_STATES_LEN + 4 * lane);
    if (x < HPRT_RANS_L || x >= (HPRT_RANS_L << 16)) bad |= HPRT_BAD_STATE;
    bad = hprt_warp_or(bad);
    u32 groups = (n + HPRT_LANES - 1) / HPRT_LANES, per = 8 / size, wpg = 4 * size;
    // Words [wlo, pos) are in `wst` (from wst[0]); empty at first.
    u32 wlo = pos;
    // A group's mantissa bits start on a byte: lane l's are at bit l w of the group's bytes.
    u32 mat = (lane * w) / 8, msh = (lane * w) % 8, mmask = (1u << w) - 1;
    for (u32 g0 = 0; g0 < groups && bad == 0; g0 += HPRT_AHEAD) {
        u64 mfrom = 4ull * w * g0;
        u32 mcount = (u32)(mlen - mfrom < 4ull * w * HPRT_AHEAD ? mlen - mfrom : 4ull * w * HPRT_AHEAD);
        __syncwarp();
        for (u32 j = lane; j < mcount; j += HPRT_LANES) mst[j] = p[mfrom + j];
        if (lane < 4) mst[mcount + lane] = 0;
        __syncwarp();
        for (u32 g = g0; g < g0 + HPRT_AHEAD && g < groups && bad == 0; ++g) {
            // A group reads at most 32 words, the ones just below `pos`.
            if ((pos > HPRT_LANES ? pos - HPRT_LANES : 0) < wlo) {
                u32 lo = pos > HPRT_WORD_WINDOW ? pos - HPRT_WORD_WINDOW : 0;
                __syncwarp();
                for (u32 j = lane; j < pos - lo; j += HPRT_LANES)
                    wst[j] = (u16)((u32)words[2 * (lo + j)] | (u32)words[2 * (lo + j) + 1] << 8);
                __syncwarp();
                wlo = lo;
            }
            u32 base = g * HPRT_LANES, cnt = n - base < HPRT_LANES ? n - base : HPRT_LANES;
            int active = lane < cnt;
            u32 v = 0, need = 0;
            if (active) {
                u32 slot = x & (m - 1), s = sym[slot], e = tab[s];
                x = (e & 0xffffu) * (x >> prob_bits) + slot - (e >> 16);
                need = x < HPRT_RANS_L;
                const u8* q = mst + 4 * w * (g - g0) + mat;
                u32 mant = (u32)q[0] | (u32)q[1] << 8 | (u32)q[2] << 16 | (u32)q[3] << 24;
                mant = (mant >> msh) & mmask;
                v = s << w | mant;
                hprt_store(dst, base + lane, size, v, aligned);
                HPRT_WRITE(size);
            }
            u32 bal = __ballot_sync(HPRT_FULL, need);
            u32 total = __popc(bal);
            if (total > pos) {
                bad = HPRT_BAD_STREAM;
            } else {
                if (need) {
                    // The decoder reads in lane order 0, 1, ...: the reverse of the encoder.
                    u32 at = pos - __popc(bal & ((1u << lane) - 1)) - 1;
                    x = x << 16 | (u32)wst[at - wlo];
                }
                pos -= total;
            }
            // The group's words (8 bytes from `per` elements), their checksum terms.
            u64 word = 0;
            for (u32 i = 0; i < per; ++i) {
                u32 src = (lane * per + i) & 31u;
                u64 e = __shfl_sync(HPRT_FULL, v, src);
                word |= e << (8 * size * i);
            }
            if (lane < wpg && lane * per < cnt) *sum += hprt_term(word, w0 + (u64)g * wpg + lane);
        }
    }
    if (bad == 0 && pos != 0) bad = HPRT_BAD_STREAM;
    if (bad == 0 && __ballot_sync(HPRT_FULL, x != HPRT_RANS_L)) bad = HPRT_BAD_STREAM;
    return bad;
}

extern "C" __global__ void __launch_bounds__(128) hprt_codec_decode(u8* ws) {
    __shared__ u16 sym[1 << 14];
    __shared__ u32 tab[512];
    __shared__ u8 mant_s[HPRT_WARPS][HPRT_MANT_STAGE];
    __shared__ u16 words_s[HPRT_WARPS][HPRT_WORD_WINDOW];
    __shared__ u32 status_s, prob_s, block_s, last_s;
    __shared__ u64 nblocks_s, prefix_s, index_s, sum_s, total_s, base_s;
    const u64* head = hprt_head(ws);
    u32 nt = (u32)head[HPRT_W_TENSORS];
    u32 lane = threadIdx.x % HPRT_LANES, warp = threadIdx.x / HPRT_LANES;
    u32 warps = blockDim.x / HPRT_LANES;
    for (u32 t = 0; t < nt; ++t) {
        const u64* d = hprt_desc(ws, t);
        u64* ctr = hprt_ctr(ws, t);
        const u8* enc = (const u8*)(d[HPRT_D_SRC]);
        u8* out = (u8*)(d[HPRT_D_DST]);
        u64 enc_len = d[HPRT_D_LEN], numel = d[HPRT_D_NUMEL];
        u32 size = (u32)d[HPRT_D_SIZE], w = (u32)d[HPRT_D_MANT];
        u32 alphabet = 1u << (8 * size - w);
        if (threadIdx.x == 0) {
            u32 st = 0;
            sum_s = 0;
            total_s = 0;
            base_s = 0;
            if (enc_len >= HPRT_HEADER_LEN && enc[0] == 'H' && enc[1] == 'P' && enc[2] == 'R' &&
                enc[3] == 'Z' && enc[4] == 1 && enc[5] == 0) st = HPRT_VERSION_1;
            else if (enc_len < HPRT_HEADER_LEN || enc[0] != 'H' || enc[1] != 'P' || enc[2] != 'R' ||
                     enc[3] != 'Z' || enc[4] != 2 || enc[5] != 0 || enc[7] != HPRT_LANES || enc[9] ||
                     enc[10] || enc[11]) st = HPRT_BAD_HEADER;
            else if (enc[6] != (u8)d[HPRT_D_DTYPE] || hprt_get_u64(enc + 16) != numel) st = HPRT_MISMATCH;
            u32 prob_bits = 0, block_elems = 0;
            u64 nblocks = 0, table_at = HPRT_HEADER_LEN + alphabet / 8, present = 0, index_at = 0, prefix = 0;
            if (st == 0) {
                prob_bits = enc[8];
                block_elems = hprt_get_u32(enc + 12);
                if (prob_bits < 9 || prob_bits > 14 || block_elems == 0 || block_elems % HPRT_LANES != 0 ||
                    block_elems > (1u << 24)) st = HPRT_BAD_HEADER;
            }
            if (st == 0) {
                nblocks = (numel + block_elems - 1) / block_elems;
                if (nblocks > d[HPRT_D_NBLOCKS]) st = HPRT_BAD_HEADER;
            }
            if (st == 0 && table_at > enc_len) st = HPRT_BAD_LENGTH;
            if (st == 0) {
                for (u32 k = 0; k < alphabet / 8; ++k) present += __popc((u32)enc[HPRT_HEADER_LEN + k]);
                index_at = table_at + 2 * present;
                prefix = index_at + 4ull * nblocks;
                if (prefix > enc_len) st = HPRT_BAD_LENGTH;
            }
            status_s = st;
            prob_s = prob_bits;
            block_s = block_elems;
            nblocks_s = nblocks;
            prefix_s = prefix;
            index_s = index_at;
        }
        __syncthreads();
        if (status_s == 0) {
            // The prefix checksum and the block lengths, by every thread.
            u64 prefix = prefix_s, nblocks = nblocks_s, sum = 0, total = 0;
            for (u64 i = threadIdx.x; i < (prefix + 7) / 8; i += blockDim.x)
                sum += hprt_term(i == 5 ? 0 : hprt_word(enc, prefix, i), i);
            if (threadIdx.x == 0) HPRT_READ(prefix);
            atomicAdd(&sum_s, sum);
            u32 bad = 0;
            // This CTA decodes blocks [lo, hi): their place starts after the lengths before lo.
            u64 lo = blockIdx.x * ((nblocks + gridDim.x - 1) / gridDim.x), base = 0;
            for (u64 b = threadIdx.x; b < nblocks; b += blockDim.x) {
                u64 len = hprt_get_u32(enc + index_s + 4 * b);
                u64 n = numel - b * block_s < block_s ? numel - b * block_s : block_s;
                u64 raw = n * size, min = (n * w + 7) / 8 + HPRT_STATES_LEN;
                if (len != raw && !(len >= min && len < raw && (len - min) % 2 == 0)) bad = 1;
                total += len;
                if (b < lo) base += len;
            }
            atomicAdd(&total_s, total);
            if (base) atomicAdd(&base_s, base);
            if (bad) atomicOr(&status_s, 1u << 31);
        }
        __syncthreads();
        if (threadIdx.x == 0 && status_s != 0 && status_s != (1u << 31)) {
            // Already failed in the header checks.
        } else if (threadIdx.x == 0) {
            // In the CPU decoder's order: checksum, payload length, table, block lengths.
            u32 st = 0, lengths_bad = status_s != 0;
            u64 prefix = prefix_s, payload = hprt_get_u64(enc + 24);
            if (hprt_finish_check(sum_s, prefix) != hprt_get_u64(enc + 40)) st = HPRT_BAD_CHECKSUM;
            else if (prefix + payload != enc_len || payload > enc_len) st = HPRT_BAD_LENGTH;
            if (st == 0) {
                u32 c = 0;
                u64 at = HPRT_HEADER_LEN + alphabet / 8;
                for (u32 s = 0; s < alphabet && st == 0; ++s) {
                    u32 f = 0;
                    if ((enc[HPRT_HEADER_LEN + s / 8] >> (s % 8)) & 1) {
                        f = (u32)enc[at] | (u32)enc[at + 1] << 8;
                        at += 2;
                        if (f == 0) st = HPRT_BAD_TABLE;
                    }
                    tab[s] = f | c << 16;
                    c += f;
                }
                if (st == 0 && ((numel == 0 && c != 0) || (numel > 0 && c != (1u << prob_s)))) st = HPRT_BAD_TABLE;
            }
            if (st == 0 && (lengths_bad || prefix_s + total_s != enc_len)) st = HPRT_BAD_LENGTH;
            status_s = st;
        }
        __syncthreads();
        if (status_s == 0) {
            for (u32 s = 0; s < alphabet; ++s) {
                u32 f = tab[s] & 0xffffu, c = tab[s] >> 16;
                for (u32 k = threadIdx.x; k < f; k += blockDim.x) sym[c + k] = (u16)s;
            }
        }
        __syncthreads();
        if (status_s == 0) {
            u64 nblocks = nblocks_s, block_elems = block_s;
            int aligned = ((u64)out % size) == 0;
            u64 sum = 0;
            u32 bad = 0;
            // Contiguous ranges (one pass over the index, not one per block): warp w of a round
            // of `warps` blocks places its block after the round's earlier ones.
            u64 per = (nblocks + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per;
            u64 hi = lo + per < nblocks ? lo + per : nblocks, run = base_s;
            for (u64 c = lo; c < hi && bad == 0; c += warps) {
                u64 b = c + warp, before = run;
                for (u64 k = c; k < b && k < hi; ++k) before += hprt_get_u32(enc + index_s + 4 * k);
                for (u64 k = c; k < c + warps && k < hi; ++k) run += hprt_get_u32(enc + index_s + 4 * k);
                if (b >= hi) continue;
                u64 len = hprt_get_u32(enc + index_s + 4 * b);
                const u8* p = enc + prefix_s + before;
                u64 first = b * block_elems;
                u32 n = (u32)(numel - first < block_elems ? numel - first : block_elems);
                u64 raw = (u64)n * size, w0 = first * size / 8;
                u8* dst = out + first * size;
                if (len == raw) {
                    for (u64 j = lane; j < raw; j += HPRT_LANES) dst[j] = p[j];
                    if (lane == 0) { HPRT_READ(raw); HPRT_WRITE(raw); }
                    for (u64 i = lane; i < (raw + 7) / 8; i += HPRT_LANES) sum += hprt_term(hprt_word(p, raw, i), w0 + i);
                } else {
                    if (lane == 0) HPRT_READ(len);
                    bad |= hprt_decode_block(p, len, n, dst, size, w, prob_s, sym, tab, w0, aligned,
                                             lane, &sum, mant_s[warp], words_s[warp]);
                }
            }
            sum = hprt_warp_sum(sum);
            if (lane == 0) {
                if (sum) atomicAdd(&ctr[HPRT_C_TERMS], sum);
                if (bad) atomicOr((u32*)&ctr[HPRT_C_STATUS], bad);
            }
        } else if (threadIdx.x == 0) {
            atomicOr((u32*)&ctr[HPRT_C_STATUS], status_s);
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0)
            last_s = atomicAdd(&ctr[HPRT_C_DECODE_DONE], 1ull) == gridDim.x - 1;
        __syncthreads();
        if (threadIdx.x == 0 && last_s) {
            // Every CTA is done with tensor t: its status, then the counters zeroed.
            __threadfence();
            u32 st = (u32)hprt_volatile_u64(&ctr[HPRT_C_STATUS]);
            if (st == 0 && hprt_finish_check(hprt_volatile_u64(&ctr[HPRT_C_TERMS]), numel * size) !=
                               hprt_get_u64(enc + 32))
                st = HPRT_BAD_DATA;
            ((u64*)(ws + head[HPRT_W_RESULTS]))[t] = st;
            ctr[HPRT_C_STATUS] = 0;
            ctr[HPRT_C_TERMS] = 0;
            ctr[HPRT_C_DECODE_DONE] = 0;
        }
        __syncthreads();
    }
}
