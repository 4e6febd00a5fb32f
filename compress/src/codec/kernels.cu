// hprt codec, format version 2 (compress/FORMAT.md), as CUDA C for NVRTC.
//
// One source, two compilers: NVRTC for the device, and the host C++ compiler in the byte-equality
// test, where a shim gives the launch variables the values of a one-thread launch (blockIdx = 0,
// blockDim = gridDim = 1) and makes __syncthreads a no-op. Every kernel is therefore written with
// loops over its blocks (`b += gridDim.x`) and over its lanes (`l += blockDim.x`) and only
// communicates between lanes through __shared__ arrays separated by __syncthreads: a single host
// thread running each phase for every lane before the next computes what the warp computes.
//
// Launch shapes (the host side is `CudaCodec` in cuda.rs; G = 4096): histogram
// <<<min(numel / 256, G), 256>>> into zeroed counts and checksum terms, table <<<1, 512>>>,
// encode_blocks <<<min(blocks, G), 32>>> (one warp per block: lane l owns rANS state l),
// scan <<<1, T <= 1024>>> (256), place <<<min(blocks, G), 256>>>, finish <<<1, 1>>>;
// decode_prefix <<<1, 1>>>, decode_blocks <<<min(max_blocks, G), 32>>> into zeroed checksum
// terms (the host does not know the block count: max_blocks bounds it, extra blocks return),
// decode_check <<<1, 1>>>. All on one stream, with no host round trip: lengths, offsets and the
// total travel in device memory; the host reads back only the encoding's length and the
// decoder's status word.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define HPRT_LANES 32u
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

__device__ __forceinline__ u32 hprt_load(const u8* p, u64 i, u32 size) {
    u32 v = 0;
    for (u32 k = 0; k < size; ++k) v |= (u32)p[i * size + k] << (8 * k);
    return v;
}

__device__ __forceinline__ void hprt_store(u8* p, u64 i, u32 size, u32 v) {
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

// Symbol counts (u64 per symbol of the alphabet) and the checksum terms of the input bytes.
extern "C" __global__ void hprt_codec_histogram(const u8* src, u64 numel, u32 size, u32 mant_bits,
                                                u64* hist, u64* terms) {
    __shared__ u32 local[512];
    for (u32 s = threadIdx.x; s < 512; s += blockDim.x) local[s] = 0;
    __syncthreads();
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride)
        atomicAdd(&local[(hprt_load(src, i, size) >> mant_bits) & 511u], 1u);
    __syncthreads();
    for (u32 s = threadIdx.x; s < 512; s += blockDim.x)
        if (local[s]) atomicAdd(&hist[s], (u64)local[s]);
    u64 nbytes = numel * size, words = (nbytes + 7) / 8, sum = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride)
        sum += hprt_term(hprt_word(src, nbytes, i), i);
    if (sum) atomicAdd(terms, sum);
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

// The integer frequency normalisation of FORMAT.md (the same steps as `v2::normalize`), and
// each symbol's cumulative frequency. One block of up to 512 threads: each unit moved is the
// best symbol found by a tree reduction over the alphabet (ties: the lowest symbol, as the
// sequential scan picks).
extern "C" __global__ void hprt_codec_table(const u64* counts, u32 alphabet, u32 prob_bits,
                                            u32* freq, u32* cum) {
    __shared__ u32 best[512];
    __shared__ u64 n_s, sum_s;
    __shared__ u32 present_s, last_s;
    if (blockIdx.x != 0) return;
    u64 m = 1ull << prob_bits;
    if (threadIdx.x == 0) {
        u64 n = 0;
        u32 present = 0, last = 0;
        for (u32 s = 0; s < alphabet; ++s) {
            n += counts[s];
            if (counts[s]) { present += 1; last = s; }
        }
        n_s = n;
        present_s = present;
        last_s = last;
    }
    __syncthreads();
    u64 n = n_s;
    for (u32 s = threadIdx.x; s < alphabet; s += blockDim.x) {
        u64 f = present_s > 1 && counts[s] ? (counts[s] * m + n / 2) / n : 0;
        freq[s] = (u32)(present_s > 1 && counts[s] && f < 1 ? 1 : f);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (present_s == 1) freq[last_s] = (u32)m;
        u64 sum = 0;
        for (u32 s = 0; s < alphabet; ++s) sum += freq[s];
        sum_s = present_s > 1 ? sum : m;
    }
    __syncthreads();
    // Every thread reads sum_s after a barrier, so all take the same number of turns.
    while (sum_s != m) {
        int take = sum_s > m;
        for (u32 s = threadIdx.x; s < 512; s += blockDim.x)
            best[s] = s < alphabet && (take ? freq[s] > 1 : counts[s] > 0) ? s : 0xffffffffu;
        __syncthreads();
        for (u32 half = 256; half > 0; half >>= 1) {
            for (u32 s = threadIdx.x; s < half; s += blockDim.x)
                if (hprt_better(counts, freq, best[s], best[s + half], take)) best[s] = best[s + half];
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            if (take) { freq[best[0]] -= 1; sum_s -= 1; }
            else { freq[best[0]] += 1; sum_s += 1; }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        u32 c = 0;
        for (u32 s = 0; s < alphabet; ++s) { cum[s] = c; c += freq[s]; }
    }
}

// Byte `j` of the mantissa stream of elements [0, n) of `src` (w bits each, element k at bit k*w).
__device__ __forceinline__ u32 hprt_mant_byte(const u8* src, u64 n, u32 size, u32 w, u64 j) {
    u64 lo = 8 * j, hi = n * w < lo + 8 ? n * w : lo + 8;
    u32 byte = 0;
    u32 mask = (1u << w) - 1;
    for (u64 k = lo / w; k * w < hi; ++k) {
        u64 m = hprt_load(src, k, size) & mask;
        i64 sh = (i64)(k * w) - (i64)lo;
        byte |= (u32)(sh >= 0 ? m << sh : m >> -sh);
    }
    return byte & 0xffu;
}

// One warp per block: the block's payload into its slot of `slot_bytes` (the raw size of a
// full block, or of the whole tensor when it is smaller), its length into `lens[b]`.
extern "C" __global__ void hprt_codec_encode_blocks(const u8* src, u64 numel, u32 size,
                                                    u32 mant_bits, u32 prob_bits, u32 block_elems,
                                                    const u32* freq, const u32* cum, u8* slots,
                                                    u32* lens) {
    __shared__ u32 x[HPRT_LANES];
    __shared__ u32 emit_s;  // bit l: lane l emits in this group
    __shared__ u32 pos_s;
    u64 nblocks = (numel + block_elems - 1) / block_elems;
    u64 slot_bytes = (numel < block_elems ? numel : (u64)block_elems) * size;
    u32 m = 1u << prob_bits;
    for (u64 b = blockIdx.x; b < nblocks; b += gridDim.x) {
        u64 first = b * block_elems;
        u32 n = (u32)(numel - first < block_elems ? numel - first : block_elems);
        const u8* in = src + first * size;
        u8* slot = slots + b * slot_bytes;
        u64 raw = (u64)n * size, mlen = ((u64)n * mant_bits + 7) / 8;
        for (u64 j = threadIdx.x; j < mlen; j += blockDim.x)
            slot[j] = (u8)hprt_mant_byte(in, n, size, mant_bits, j);
        for (u32 l = threadIdx.x; l < HPRT_LANES; l += blockDim.x) x[l] = HPRT_RANS_L;
        if (threadIdx.x == 0) { pos_s = 0; emit_s = 0; }
        __syncthreads();
        u32 full = n / HPRT_LANES * HPRT_LANES;
        u32 groups = full / HPRT_LANES + (n > full ? 1 : 0);
        int overflow = 0;
        for (u32 gi = groups; gi-- > 0;) {
            // The stream only grows: once it reaches the raw size the block is stored raw.
            if (mlen + 2ull * pos_s + HPRT_STATES_LEN >= raw) { overflow = 1; break; }
            u32 base = gi * HPRT_LANES;
            u32 cnt = n - base < HPRT_LANES ? n - base : HPRT_LANES;
            for (u32 l = threadIdx.x; l < cnt; l += blockDim.x) {
                u32 s = (hprt_load(in, base + l, size) >> mant_bits) & 511u;
                if (x[l] >= ((HPRT_RANS_L >> prob_bits) << 16) * freq[s]) atomicOr(&emit_s, 1u << l);
            }
            __syncthreads();
            u32 emit = emit_s, total = __popc(emit);
            for (u32 l = threadIdx.x; l < HPRT_LANES; l += blockDim.x) {
                if (l >= cnt) continue;
                u32 s = (hprt_load(in, base + l, size) >> mant_bits) & 511u;
                u32 f = freq[s], v = x[l];
                if ((emit >> l) & 1) {
                    // Lanes emit from the highest to the lowest, as the sequential coder does:
                    // the emitting lanes above this one go first.
                    u32 before = __popc((emit >> l) >> 1);
                    u64 at = mlen + 2ull * (pos_s + before);
                    if (at + 2 <= slot_bytes) {
                        slot[at] = (u8)v;
                        slot[at + 1] = (u8)(v >> 8);
                    }
                    v >>= 16;
                }
                x[l] = (v / f) * m + v % f + cum[s];
            }
            __syncthreads();
            if (threadIdx.x == 0) { pos_s += total; emit_s = 0; }
            __syncthreads();
        }
        u64 len = mlen + 2ull * pos_s + HPRT_STATES_LEN;
        if (overflow || len >= raw) {
            for (u64 j = threadIdx.x; j < raw; j += blockDim.x) slot[j] = in[j];
            if (threadIdx.x == 0) lens[b] = (u32)raw;
        } else {
            u64 at = mlen + 2ull * pos_s;
            for (u32 l = threadIdx.x; l < HPRT_LANES; l += blockDim.x)
                for (u32 k = 0; k < 4; ++k) slot[at + 4 * l + k] = (u8)(x[l] >> (8 * k));
            if (threadIdx.x == 0) lens[b] = (u32)len;
        }
        __syncthreads();
    }
}

// Exclusive scan of the block lengths into payload offsets, and their total (one block); also
// the prefix length (header, bitmap, present frequencies, index), which places the payload.
extern "C" __global__ void hprt_codec_scan(const u32* lens, u64 nblocks, const u32* freq,
                                           u32 alphabet, u64* offsets, u64* total,
                                           u64* prefix_len) {
    __shared__ u64 part[1024];
    u32 t = threadIdx.x, T = blockDim.x;
    u64 per = (nblocks + T - 1) / T;
    for (u32 i = t; i < T; i += blockDim.x) {
        u64 lo = i * per, hi = lo + per < nblocks ? lo + per : nblocks, s = 0;
        for (u64 k = lo; k < hi; ++k) s += lens[k];
        part[i] = s;
    }
    __syncthreads();
    if (t == 0) {
        u64 run = 0;
        for (u32 i = 0; i < T; ++i) { u64 s = part[i]; part[i] = run; run += s; }
        *total = run;
        u64 present = 0;
        for (u32 s = 0; s < alphabet; ++s) present += freq[s] != 0;
        *prefix_len = HPRT_HEADER_LEN + alphabet / 8 + 2 * present + 4 * nblocks;
    }
    __syncthreads();
    for (u32 i = t; i < T; i += blockDim.x) {
        u64 lo = i * per, hi = lo + per < nblocks ? lo + per : nblocks, run = part[i];
        for (u64 k = lo; k < hi; ++k) { offsets[k] = run; run += lens[k]; }
    }
}

// Copies every block from its slot to its place after the prefix.
extern "C" __global__ void hprt_codec_place(const u8* slots, u64 slot_bytes, const u32* lens,
                                            const u64* offsets, u64 nblocks, u8* out,
                                            const u64* prefix_len) {
    for (u64 b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const u8* from = slots + b * slot_bytes;
        u8* to = out + *prefix_len + offsets[b];
        for (u64 j = threadIdx.x; j < lens[b]; j += blockDim.x) to[j] = from[j];
    }
}

// Header, table and index, the prefix checksum, and the encoding's length into `out_len`.
extern "C" __global__ void hprt_codec_finish(u8* out, u32 dtype_code, u32 alphabet, u32 prob_bits,
                                             u32 block_elems, u64 numel, u32 size,
                                             const u32* freq, const u32* lens, u64 nblocks,
                                             const u64* total, const u64* terms,
                                             const u64* prefix_len, u64* out_len) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    u64 prefix = *prefix_len;
    out[0] = 'H'; out[1] = 'P'; out[2] = 'R'; out[3] = 'Z';
    out[4] = 2; out[5] = 0;
    out[6] = (u8)dtype_code;
    out[7] = (u8)HPRT_LANES;
    out[8] = (u8)prob_bits;
    out[9] = out[10] = out[11] = 0;
    for (u32 k = 0; k < 4; ++k) out[12 + k] = (u8)(block_elems >> (8 * k));
    hprt_put_u64(out + 16, numel);
    hprt_put_u64(out + 24, *total);
    hprt_put_u64(out + 32, hprt_finish_check(*terms, numel * size));
    hprt_put_u64(out + 40, 0);
    // Table: a presence bitmap, then the frequencies of the present symbols.
    u64 at = HPRT_HEADER_LEN + alphabet / 8;
    for (u32 k = 0; k < alphabet / 8; ++k) out[HPRT_HEADER_LEN + k] = 0;
    for (u32 s = 0; s < alphabet; ++s) {
        if (freq[s] == 0) continue;
        out[HPRT_HEADER_LEN + s / 8] |= (u8)(1u << (s % 8));
        out[at++] = (u8)freq[s];
        out[at++] = (u8)(freq[s] >> 8);
    }
    for (u64 b = 0; b < nblocks; ++b)
        for (u32 k = 0; k < 4; ++k) out[at + 4 * b + k] = (u8)(lens[b] >> (8 * k));
    u64 sum = 0;
    for (u64 i = 0; i < (prefix + 7) / 8; ++i) sum += hprt_term(hprt_word(out, prefix, i), i);
    hprt_put_u64(out + 40, hprt_finish_check(sum, prefix));
    *out_len = prefix + *total;
}

// Checks header, prefix checksum, table and block lengths against the expected dtype and
// element count; fills `freq`, `cum`, `offsets` (absolute) and `data_check`, or sets `status`.
extern "C" __global__ void hprt_codec_decode_prefix(const u8* enc, u64 enc_len, u32 dtype_code,
                                                    u32 alphabet, u32 size, u32 mant_bits,
                                                    u64 numel, u64 max_blocks, u32* freq, u32* cum,
                                                    u64* offsets, u64* data_check, u32* status) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    *status = 0;
    if (enc_len >= HPRT_HEADER_LEN && enc[0] == 'H' && enc[1] == 'P' && enc[2] == 'R' &&
        enc[3] == 'Z' && enc[4] == 1 && enc[5] == 0) { *status = HPRT_VERSION_1; return; }
    if (enc_len < HPRT_HEADER_LEN || enc[0] != 'H' || enc[1] != 'P' || enc[2] != 'R' ||
        enc[3] != 'Z' || enc[4] != 2 || enc[5] != 0 || enc[7] != HPRT_LANES || enc[9] ||
        enc[10] || enc[11]) { *status = HPRT_BAD_HEADER; return; }
    u32 prob_bits = enc[8], block_elems = hprt_get_u32(enc + 12);
    if (enc[6] != dtype_code || hprt_get_u64(enc + 16) != numel) { *status = HPRT_MISMATCH; return; }
    if (prob_bits < 9 || prob_bits > 14 || block_elems == 0 || block_elems % HPRT_LANES != 0 ||
        block_elems > (1u << 24)) { *status = HPRT_BAD_HEADER; return; }
    u64 nblocks = (numel + block_elems - 1) / block_elems;
    if (nblocks > max_blocks) { *status = HPRT_BAD_HEADER; return; }
    u64 table_at = HPRT_HEADER_LEN + alphabet / 8, present = 0;
    if (table_at > enc_len) { *status = HPRT_BAD_LENGTH; return; }
    for (u32 s = 0; s < alphabet; ++s) present += (enc[HPRT_HEADER_LEN + s / 8] >> (s % 8)) & 1;
    u64 index_at = table_at + 2 * present, prefix = index_at + 4ull * nblocks;
    if (prefix > enc_len) { *status = HPRT_BAD_LENGTH; return; }
    u64 sum = 0;
    for (u64 i = 0; i < (prefix + 7) / 8; ++i) {
        u64 w = hprt_word(enc, prefix, i);
        if (i == 5) w = 0;  // bytes 40..48: the stored prefix checksum
        sum += hprt_term(w, i);
    }
    if (hprt_finish_check(sum, prefix) != hprt_get_u64(enc + 40)) { *status = HPRT_BAD_CHECKSUM; return; }
    if (prefix + hprt_get_u64(enc + 24) != enc_len || hprt_get_u64(enc + 24) > enc_len) {
        *status = HPRT_BAD_LENGTH; return;
    }
    u32 c = 0;
    u64 at = table_at;
    for (u32 s = 0; s < alphabet; ++s) {
        freq[s] = 0;
        if ((enc[HPRT_HEADER_LEN + s / 8] >> (s % 8)) & 1) {
            freq[s] = (u32)enc[at] | (u32)enc[at + 1] << 8;
            at += 2;
            if (freq[s] == 0) { *status = HPRT_BAD_TABLE; return; }
        }
        cum[s] = c;
        c += freq[s];
    }
    if ((numel == 0 && c != 0) || (numel > 0 && c != (1u << prob_bits))) { *status = HPRT_BAD_TABLE; return; }
    u64 off = prefix;
    for (u64 b = 0; b < nblocks; ++b) {
        u64 len = hprt_get_u32(enc + index_at + 4 * b);
        u64 n = numel - b * block_elems < block_elems ? numel - b * block_elems : block_elems;
        u64 raw = n * size, min = (n * mant_bits + 7) / 8 + HPRT_STATES_LEN;
        if (len != raw && !(len >= min && len < raw && (len - min) % 2 == 0)) { *status = HPRT_BAD_LENGTH; return; }
        offsets[b] = off;
        off += len;
    }
    if (off != enc_len) { *status = HPRT_BAD_LENGTH; return; }
    *data_check = hprt_get_u64(enc + 32);
}

// One warp per block, after decode_prefix: the elements of block `b` into `out`, their checksum
// terms into `terms`; any inconsistency sets `status`.
extern "C" __global__ void hprt_codec_decode_blocks(const u8* enc, u64 enc_len, u32 size,
                                                    u32 mant_bits, u64 numel, const u32* freq,
                                                    const u32* cum, const u64* offsets, u8* out,
                                                    u64* terms, u32* status) {
    __shared__ u16 slot_sym[1 << 14];
    __shared__ u32 x[HPRT_LANES];
    __shared__ u32 need_s;  // bit l: lane l refills in this group
    __shared__ u32 pos_s;
    __shared__ u32 bad_s;
    __shared__ u32 failed_s;
    // Read once for the whole block: another block may set it meanwhile, and threads that
    // disagreed would miss each other at the barriers below.
    if (threadIdx.x == 0) failed_s = *status;
    __syncthreads();
    if (failed_s != 0) return;
    u32 prob_bits = enc[8], block_elems = hprt_get_u32(enc + 12), m = 1u << prob_bits;
    u32 alphabet = 1u << (8 * size - mant_bits);
    for (u32 s = 0; s < alphabet; ++s)
        for (u32 k = threadIdx.x; k < freq[s]; k += blockDim.x) slot_sym[cum[s] + k] = (u16)s;
    __syncthreads();
    u64 nblocks = (numel + block_elems - 1) / block_elems;
    u64 sum = 0;
    for (u64 b = blockIdx.x; b < nblocks; b += gridDim.x) {
        u64 first = b * block_elems;
        u32 n = (u32)(numel - first < block_elems ? numel - first : block_elems);
        u64 raw = (u64)n * size, mlen = ((u64)n * mant_bits + 7) / 8;
        u64 end = b + 1 < nblocks ? offsets[b + 1] : enc_len;
        u64 len = end - offsets[b];
        const u8* p = enc + offsets[b];
        u8* dst = out + first * size;
        if (len == raw) {
            for (u64 j = threadIdx.x; j < raw; j += blockDim.x) dst[j] = p[j];
        } else {
            u32 used = (u32)(((u64)n * mant_bits) % 8);
            if (threadIdx.x == 0) {
                bad_s = (used != 0 && (p[mlen - 1] >> used) != 0) ? HPRT_BAD_PADDING : 0;
                need_s = 0;
                pos_s = (u32)((len - mlen - HPRT_STATES_LEN) / 2);
            }
            __syncthreads();
            const u8* words = p + mlen;
            for (u32 l = threadIdx.x; l < HPRT_LANES; l += blockDim.x) {
                x[l] = hprt_get_u32(p + len - HPRT_STATES_LEN + 4 * l);
                if (x[l] < HPRT_RANS_L || x[l] >= (HPRT_RANS_L << 16)) atomicOr(&bad_s, HPRT_BAD_STATE);
            }
            __syncthreads();
            u32 groups = (n + HPRT_LANES - 1) / HPRT_LANES;
            for (u32 g = 0; g < groups && bad_s == 0; ++g) {
                u32 base = g * HPRT_LANES;
                u32 cnt = n - base < HPRT_LANES ? n - base : HPRT_LANES;
                for (u32 l = threadIdx.x; l < HPRT_LANES; l += blockDim.x) {
                    if (l < cnt) {
                        u32 slot = x[l] & (m - 1), s = slot_sym[slot];
                        u32 v = freq[s] * (x[l] >> prob_bits) + slot - cum[s];
                        x[l] = v;
                        if (v < HPRT_RANS_L) atomicOr(&need_s, 1u << l);
                        u64 k = base + l, bit = k * mant_bits;
                        u32 mant = 0;
                        for (u32 q = 0; q < 4 && bit / 8 + q < mlen; ++q)
                            mant |= (u32)p[bit / 8 + q] << (8 * q);
                        mant = (mant >> (bit % 8)) & ((1u << mant_bits) - 1);
                        hprt_store(dst, k, size, s << mant_bits | mant);
                    }
                }
                __syncthreads();
                u32 need = need_s, total = __popc(need);
                for (u32 l = threadIdx.x; l < HPRT_LANES; l += blockDim.x) {
                    if (l >= cnt || !((need >> l) & 1)) continue;
                    // The decoder reads in lane order 0, 1, ...: the reverse of the encoder.
                    u32 before = __popc(need & ((1u << l) - 1));
                    if (pos_s < before + 1) { atomicOr(&bad_s, HPRT_BAD_STREAM); continue; }
                    u32 at = pos_s - before - 1;
                    x[l] = x[l] << 16 | (u32)words[2 * at] | (u32)words[2 * at + 1] << 8;
                }
                __syncthreads();
                if (threadIdx.x == 0) {
                    if (bad_s == 0) pos_s -= total;
                    need_s = 0;
                }
                __syncthreads();
            }
            if (threadIdx.x == 0 && bad_s == 0 && pos_s != 0) bad_s = HPRT_BAD_STREAM;
            for (u32 l = threadIdx.x; l < HPRT_LANES; l += blockDim.x)
                if (x[l] != HPRT_RANS_L) atomicOr(&bad_s, HPRT_BAD_STREAM);
            __syncthreads();
            if (threadIdx.x == 0 && bad_s != 0) atomicOr(status, bad_s);
            __syncthreads();
        }
        // Every thread's bytes of the block are written before any thread sums its words.
        __syncthreads();
        // Blocks start at multiples of 8 bytes (block_elems is a multiple of 32).
        u64 w0 = first * size / 8, words_n = (raw + 7) / 8;
        for (u64 i = threadIdx.x; i < words_n; i += blockDim.x)
            sum += hprt_term(hprt_word(dst, raw, i), w0 + i);
    }
    if (sum) atomicAdd(terms, sum);
}

// The decoded tensor against the header's checksum.
extern "C" __global__ void hprt_codec_decode_check(const u64* terms, u64 nbytes,
                                                   const u64* data_check, u32* status) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (*status == 0 && hprt_finish_check(*terms, nbytes) != *data_check) *status = HPRT_BAD_DATA;
}
