// Exact mode: the CPU backend's forward pass, float operation by float operation, so the GPU's
// logits are the CPU's bit for bit (crates/cuda/src/exact.rs drives these).
//
// Every kernel here is a pure function of one flat thread index `i`: no shared memory, no
// barriers, no warp operations, no atomics. On the GPU each first waits for the kernel before it
// (PDL_ENTRY, common.cu: the backend launches everything with programmatic dependent launch, so
// a kernel that does not wait may read its predecessor's output before it is written; session
// 24's first GPU run of exact mode did, and its logits varied from run to run). Each has a body `ex_<name>_at(i, ...)` and a
// launcher; the same file compiles for the host (`EXACT_HOST`, build.rs: plain C, contraction
// off) where `ex_host_<name>(n, ...)` runs the body for every `i < n`, so the tests check these
// exact kernels against the CPU engine on a machine without a GPU.
//
// Every float operation that the CPU's order fixes is written as an explicit round-to-nearest
// operation (EX_MUL, EX_ADD, EX_FMA, ...): NVRTC compiles the program with `--fmad=true`, and
// these intrinsics are never contracted or reordered. The references are in quant::dot::scalar
// (products), quant::dot::ggml (expf, softmax, the f16 dots, their lane trees), cpu::ops
// (RMSNorm, RoPE) and cpu::attention::attend_reference.

#ifdef EXACT_HOST
#include <math.h>
#include <string.h>
#define EX_DEV static inline
#define EX_KERNEL(name, params, args)                                                        \
    void ex_host_##name(long long n_threads, EX_UNPAREN params) {                            \
        for (long long i = 0; i < n_threads; i++) ex_##name##_at(i, EX_UNPAREN args);          \
    }
#define EX_MUL(a, b) ((float)(a) * (float)(b))
#define EX_ADD(a, b) ((float)(a) + (float)(b))
#define EX_SUB(a, b) ((float)(a) - (float)(b))
#define EX_DIV(a, b) ((float)(a) / (float)(b))
#define EX_FMA(a, b, c) fmaf((a), (b), (c))
#define EX_SQRT(a) sqrtf(a)
#define EX_DADD(a, b) ((double)(a) + (double)(b))
#define EX_DDIV(a, b) ((double)(a) / (double)(b))
#define EX_LDEXP(a, e) ldexp((a), (e))
static inline float ex_h2f(unsigned short h) {
    unsigned int s = (unsigned int)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 31) {
        bits = s | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        bits = s | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {
        bits = s;
    } else {
        // Subnormal: normalize.
        int k = -1;
        do { k++; m <<= 1; } while ((m & 1024) == 0);
        bits = s | ((unsigned int)(112 - k) << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline unsigned short ex_f2h(float f) {
    unsigned int x;
    memcpy(&x, &f, 4);
    unsigned int s = (x >> 16) & 0x8000u, e = (x >> 23) & 255, m = x & 0x7fffffu;
    if (e == 255) return (unsigned short)(s | 0x7c00u | (m ? 0x200u | (m >> 13) : 0u));
    int ue = (int)e - 127 + 15;
    if (ue >= 31) return (unsigned short)(s | 0x7c00u);
    if (ue <= 0) {
        if (ue < -10) return (unsigned short)s;
        m |= 0x800000u;
        int shift = 14 - ue;
        unsigned int r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (unsigned short)(s | r);
    }
    unsigned int r = ((unsigned int)ue << 10) | (m >> 13), rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (unsigned short)(s | r);
}
#else
#define EX_DEV __device__ static __forceinline__
#define EX_KERNEL(name, params, args)                                                        \
    extern "C" __global__ void ex_##name(long long n_threads, EX_UNPAREN params) {          \
        PDL_ENTRY();                                                                         \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                      \
        if (i < n_threads) ex_##name##_at(i, EX_UNPAREN args);                               \
    }
#define EX_MUL(a, b) __fmul_rn((a), (b))
#define EX_ADD(a, b) __fadd_rn((a), (b))
#define EX_SUB(a, b) __fsub_rn((a), (b))
#define EX_DIV(a, b) __fdiv_rn((a), (b))
#define EX_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#define EX_SQRT(a) __fsqrt_rn(a)
#define EX_DADD(a, b) __dadd_rn((a), (b))
#define EX_DDIV(a, b) __ddiv_rn((a), (b))
#define EX_LDEXP(a, e) ldexp((a), (e))
// common.cu's hardware conversions (round to nearest even).
EX_DEV float ex_h2f(unsigned short h) { return h2f(h); }
EX_DEV unsigned short ex_f2h(float f) { return f2h(f); }
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#endif
#define EX_UNPAREN(...) __VA_ARGS__
// Session 28: loops whose loads do not depend on their float chain, unrolled on the GPU so the
// next blocks' loads go out before this block's operations (which keep their order).
#ifdef EXACT_HOST
#define EX_UNROLL4
#else
#define EX_UNROLL4 _Pragma("unroll 4")
#endif

typedef unsigned char ex_u8;
typedef signed char ex_i8;
typedef unsigned short ex_u16;

// Weight type codes (ggml's numbering, as gguf::GgmlType).
#define EX_Q4_0 2
#define EX_Q4_1 3
#define EX_Q5_0 6
#define EX_Q5_1 7
#define EX_Q8_0 8
#define EX_Q2_K 10
#define EX_Q3_K 11
#define EX_Q4_K 12
#define EX_Q5_K 13
#define EX_Q6_K 14

#ifdef EXACT_HOST
EX_DEV unsigned short ex_ld16(const ex_u8* p) { return (unsigned short)(p[0] | (p[1] << 8)); }
#else
// One load where p is 2-byte aligned (session 28).
EX_DEV unsigned short ex_ld16(const ex_u8* p) {
    if (((unsigned long long)p & 1) == 0) return *(const unsigned short*)p;
    return (unsigned short)(p[0] | (p[1] << 8));
}
#endif
EX_DEV unsigned int ex_ld32(const ex_u8* p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
           ((unsigned int)p[3] << 24);
}
EX_DEV float ex_f16at(const ex_u8* p) { return ex_h2f(ex_ld16(p)); }

// Session 28: the products' integer pass reads words, not bytes. ex_w32 is ex_ld32 (the four
// bytes at p, little-endian) in one load where p is 4-byte aligned on the GPU (two where it is
// 2-byte aligned: Q6_K's 210-byte blocks); ex_dp4a adds the four products of the signed bytes
// of a and b to c (the `dp4a` instruction on the GPU). Integer sums are exact in any order, so
// the integers, hence the bits, are the byte-wise loops'.
#ifdef EXACT_HOST
EX_DEV unsigned int ex_w32(const ex_u8* p) { return ex_ld32(p); }
EX_DEV int ex_dp4a(unsigned int a, unsigned int b, int c) {
    for (int k = 0; k < 4; k++)
        c += (int)(signed char)(unsigned char)(a >> (8 * k)) *
             (int)(signed char)(unsigned char)(b >> (8 * k));
    return c;
}
#else
EX_DEV unsigned int ex_w32(const ex_u8* p) {
    unsigned long long a = (unsigned long long)p;
    if ((a & 3) == 0) return *(const unsigned int*)p;
    if ((a & 1) == 0)
        return (unsigned int)*(const ex_u16*)p | ((unsigned int)*(const ex_u16*)(p + 2) << 16);
    return ex_ld32(p);
}
EX_DEV int ex_dp4a(unsigned int a, unsigned int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#endif

// ---- products: one (weight row, token) per thread -----------------------------------------
//
// Activations as crates/cuda's quantize_act writes them: `qs` int8 values, `ds` one float2 per
// 32 values: Q8_0/Q8_1 blocks {d, s} (f16 values as f32); Q8_K {d, two i16 sums of 16 packed}.

// The 32 weights of legacy block `b` (at `x`) as integers (unsigned for the types with a min).
EX_DEV void ex_legacy_q(int ty, const ex_u8* x, int* q, float* d, float* m) {
    *m = 0.0f;
    if (ty == EX_Q8_0) {
        *d = ex_f16at(x);
        for (int e = 0; e < 32; e++) q[e] = (ex_i8)x[2 + e];
        return;
    }
    const ex_u8* qs;
    unsigned int qh = 0;
    int off = 0, has_hi = 0;
    *d = ex_f16at(x);
    if (ty == EX_Q4_0) { qs = x + 2; off = 8; }
    else if (ty == EX_Q4_1) { *m = ex_f16at(x + 2); qs = x + 4; }
    else if (ty == EX_Q5_0) { qh = ex_ld32(x + 2); qs = x + 6; off = 16; has_hi = 1; }
    else { *m = ex_f16at(x + 2); qh = ex_ld32(x + 4); qs = x + 8; has_hi = 1; }
    for (int j = 0; j < 16; j++) {
        q[j] = qs[j] & 15;
        q[j + 16] = qs[j] >> 4;
    }
    for (int e = 0; e < 32; e++) {
        if (has_hi) q[e] |= (int)(((qh >> e) & 1u) << 4);
        q[e] -= off;
    }
}

EX_DEV int ex_legacy_bytes(int ty) {
    return ty == EX_Q4_0 ? 18 : ty == EX_Q4_1 ? 20 : ty == EX_Q5_0 ? 22 : ty == EX_Q5_1 ? 24 : 34;
}

// The products run in two passes (session 24): the integer part of every (token, row, block) in
// parallel (integer sums are exact in any order), then one thread per (token, row) walks the
// blocks in the CPU's order doing the float operations on those integers. One thread per row
// doing both (session 23) left most of the GPU idle on one-token steps: 87 ms per 3B token.
//
// Integers per block in `part` (ex_ints): legacy types 8 partial sums of 4 (order 0, `Lanes8`)
// or the block's sum (order 1, `BlockSums`); Q2_K {isum, msum}; Q3_K and Q6_K {isum}; Q4_K and
// Q5_K {pi, pm} of each of the four pairs of sub-blocks.
EX_DEV int ex_ints(int ty, int order) {
    if (ty == EX_Q4_K || ty == EX_Q5_K) return 8;
    if (ty == EX_Q2_K) return 2;
    if (ty >= EX_Q2_K) return 1;
    return order == 0 ? 8 : 1;
}

// Blocks per row: super-blocks of 256 for the K-quants, blocks of 32 for the others.
EX_DEV int ex_blocks(int ty, int cols) { return ty >= EX_Q2_K ? cols / 256 : cols / 32; }

// Sum of 16 activations `k` (0..16) of Q8_K super-block `b`.
EX_DEV int ex_bsum(const float* ds, int b, int k) {
    unsigned int bits;
    float f = ds[2 * (8 * b + k / 2) + 1];
#ifdef EXACT_HOST
    memcpy(&bits, &f, 4);
#else
    bits = __float_as_uint(f);
#endif
    // Two i16 sums: the first 16 values in the low half, the next 16 in the high half.
    return (k & 1) ? (int)bits >> 16 : (int)(short)(bits & 0xffffu);
}

// scalar::k4_scale_min.
EX_DEV void ex_k4(int j, const ex_u8* s, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The integers of block `b` of one row (`w`: the row) against one token's activations (`qs`,
// `ds`: the token's row), into p[0 .. ex_ints).
EX_DEV void ex_block_ints(int ty, int order, const ex_u8* w, const ex_i8* qs, const float* ds,
                          int b, int* p) {
    if (ty == EX_Q4_0 || ty == EX_Q4_1 || ty == EX_Q8_0) {
        // Word form (session 28): sum j of order 0 is elements 4j..4j+3, one dp4a; Q4_0's
        // -8 comes off as 8 times the activations' sum.
        const ex_u8* x = w + (long long)b * ex_legacy_bytes(ty);
        const ex_u8* y = (const ex_u8*)(qs + 32 * b);
        const ex_u8* q4 = x + (ty == EX_Q4_0 ? 2 : 4);
        int tot = 0;
        for (int j = 0; j < 8; j++) {
            unsigned int yw = ex_w32(y + 4 * j);
            unsigned int q = ty == EX_Q8_0
                                 ? ex_w32(x + 2 + 4 * j)
                                 : (ex_w32(q4 + 4 * (j & 3)) >> (4 * (j >> 2))) & 0x0f0f0f0fu;
            int isum = ex_dp4a(q, yw, 0);
            if (ty == EX_Q4_0) isum -= 8 * ex_dp4a(0x01010101u, yw, 0);
            if (order == 0) p[j] = isum;
            tot += isum;
        }
        if (order != 0) p[0] = tot;
        return;
    }
    if (ty < EX_Q2_K) {
        int q[32];
        float dw, mw;
        ex_legacy_q(ty, w + (long long)b * ex_legacy_bytes(ty), q, &dw, &mw);
        const ex_i8* y = qs + 32 * b;
        if (order == 0) {
            for (int j = 0; j < 8; j++) {
                int isum = 0;
                for (int e = 4 * j; e < 4 * j + 4; e++) isum += q[e] * y[e];
                p[j] = isum;
            }
        } else {
            int isum = 0;
            for (int e = 0; e < 32; e++) isum += q[e] * y[e];
            p[0] = isum;
        }
        return;
    }
    const ex_i8* y = qs + 256 * b;
    if (ty == EX_Q2_K) {
        const ex_u8* x = w + (long long)b * 84;
        int isum = 0, msum = 0;
        for (int sb = 0; sb < 16; sb++) {
            int h = sb / 8, s = (sb % 8) / 2, l0 = (sb % 2) * 16, d = 0;
            for (int l = l0; l < l0 + 16; l++)
                d += ((x[16 + 32 * h + l] >> (2 * s)) & 3) * y[sb * 16 + l - l0];
            isum += (x[sb] & 15) * d;
            msum += (x[sb] >> 4) * ex_bsum(ds, b, sb);
        }
        p[0] = isum;
        p[1] = msum;
    } else if (ty == EX_Q3_K) {
        const ex_u8* x = w + (long long)b * 110;
        const ex_u8* s = x + 96;
        int sc[16];
        for (int k = 0; k < 4; k++) {
            int hi = s[8 + k];
            sc[k] = ((s[k] & 15) | ((hi & 3) << 4)) - 32;
            sc[4 + k] = ((s[4 + k] & 15) | (((hi >> 2) & 3) << 4)) - 32;
            sc[8 + k] = ((s[k] >> 4) | (((hi >> 4) & 3) << 4)) - 32;
            sc[12 + k] = ((s[4 + k] >> 4) | (((hi >> 6) & 3) << 4)) - 32;
        }
        int isum = 0;
        for (int e = 0; e < 256; e++) {
            int h = e / 128, sh = (e % 128) / 32, l = e % 32;
            int lo = (x[32 + 32 * h + l] >> (2 * sh)) & 3;
            int hb = (x[l] >> (4 * h + sh)) & 1;
            isum += sc[e / 16] * (lo - (hb ? 0 : 4)) * y[e];
        }
        p[0] = isum;
    } else if (ty == EX_Q4_K || ty == EX_Q5_K) {
        int hi5 = ty == EX_Q5_K;
        const ex_u8* x = w + (long long)b * (hi5 ? 176 : 144);
        const ex_u8* q4 = x + (hi5 ? 48 : 16);
        int pi = 0, pm = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m;
            ex_k4(j, x + 4, &sc, &m);
            int c = j / 2, half = j % 2, d = 0;
            // Four elements per word (session 28): bit j of each byte of the high bits.
            for (int l = 0; l < 32; l += 4) {
                unsigned int q = (ex_w32(q4 + 32 * c + l) >> (4 * half)) & 0x0f0f0f0fu;
                if (hi5) q |= ((ex_w32(x + 16 + l) >> j) & 0x01010101u) << 4;
                d = ex_dp4a(q, ex_w32((const ex_u8*)(y + 32 * j + l)), d);
            }
            pi += sc * d;
            pm += m * (ex_bsum(ds, b, 2 * j) + ex_bsum(ds, b, 2 * j + 1));
            if (half == 1) {
                p[2 * c] = pi;
                p[2 * c + 1] = pm;
                pi = 0;
                pm = 0;
            }
        }
    } else {
        const ex_u8* x = w + (long long)b * 210;
        int isum = 0;
        // Four elements per word (session 28): each 16-element group's sum of q * y as
        // sum((q + 32) * y) - 32 * sum(y), then times its scale.
        for (int sb = 0; sb < 16; sb++) {
            int d = 0, ys = 0;
            for (int e = 16 * sb; e < 16 * sb + 16; e += 4) {
                int h = e / 128, s = (e % 128) / 32, l = e % 32;
                unsigned int lq =
                    (ex_w32(x + 64 * h + l + 32 * (s & 1)) >> (4 * (s >> 1))) & 0x0f0f0f0fu;
                unsigned int hq = (ex_w32(x + 128 + 32 * h + l) >> (2 * s)) & 0x03030303u;
                unsigned int yw = ex_w32((const ex_u8*)(y + e));
                d = ex_dp4a(lq | (hq << 4), yw, d);
                ys = ex_dp4a(0x01010101u, yw, ys);
            }
            isum += (ex_i8)x[192 + sb] * (d - 32 * ys);
        }
        p[0] = isum;
    }
}

// Pass 1, thread i = (t * rows + r) * nb + b: block b of row r (rows of `row_bytes` from `w`)
// against token t's activations.
EX_DEV void ex_mm_int_at(long long i, int ty, int order, const ex_u8* w, long long row_bytes,
                         int rows, int cols, const ex_i8* qs, const float* ds, int* part) {
    int nb = ex_blocks(ty, cols);
    long long tr = i / nb;
    int b = (int)(i % nb);
    long long t = tr / rows, r = tr % rows;
    ex_block_ints(ty, order, w + r * row_bytes, qs + t * cols, ds + t * (cols / 32) * 2, b,
                  part + i * ex_ints(ty, order));
}
EX_KERNEL(mm_int,
          (int ty, int order, const ex_u8* w, long long row_bytes, int rows, int cols,
           const ex_i8* qs, const float* ds, int* part),
          (ty, order, w, row_bytes, rows, cols, qs, ds, part))

// scalar::tiled_step.
EX_DEV float ex_tiled_step(float acc, int isum, int has_min, float dmin, int msum, float d,
                           float dy) {
    float r = EX_MUL((float)isum, d);
    if (has_min) r = EX_FMA(-dmin, (float)msum, r);
    return EX_FMA(r, dy, acc);
}

// The float walk of one row against one token over its blocks' integers `p` (ex_ints per
// block), in quant::dot::scalar's order: dot_q4_0 (order 0) / dot_q4_0_block (order 1) and
// siblings; for the K-quants tiled_step, or Q4_K's pair order (dot_q4_k: one fma per pair of
// sub-blocks) or its gemv order (`gemv`).
EX_DEV float ex_row_float(int ty, int order, int gemv, const ex_u8* w, const float* ds,
                          const int* p, int nb) {
    int k = ex_ints(ty, order);
    if (ty < EX_Q2_K) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, acc1 = 0.0f, summs = 0.0f;
        int bytes = ex_legacy_bytes(ty);
        int has_min = ty == EX_Q4_1 || ty == EX_Q5_1;
        EX_UNROLL4
        for (int b = 0; b < nb; b++) {
            const ex_u8* x = w + (long long)b * bytes;
            float dw = ex_f16at(x), mw = has_min ? ex_f16at(x + 2) : 0.0f;
            float dy = ds[2 * b], sy = ds[2 * b + 1];
            if (has_min) summs = EX_FMA(mw, sy, summs);
            float d = EX_MUL(dw, dy);
            const int* pb = p + (long long)b * k;
            if (order == 0) {
                for (int j = 0; j < 8; j++) acc[j] = EX_FMA(d, (float)pb[j], acc[j]);
            } else {
                acc1 = EX_FMA(d, (float)pb[0], acc1);
            }
        }
        if (order != 0) return EX_ADD(acc1, summs);
        float h0 = EX_ADD(acc[4], acc[0]), h1 = EX_ADD(acc[5], acc[1]);
        float h2 = EX_ADD(acc[6], acc[2]), h3 = EX_ADD(acc[7], acc[3]);
        return EX_ADD(EX_ADD(EX_ADD(h0, h2), EX_ADD(h1, h3)), summs);
    }
    float sum = 0.0f, acc = 0.0f, accm = 0.0f;
    EX_UNROLL4
    for (int b = 0; b < nb; b++) {
        float dy = ds[2 * (8 * b)];
        const int* pb = p + (long long)b * k;
        if (ty == EX_Q2_K) {
            const ex_u8* x = w + (long long)b * 84;
            sum = ex_tiled_step(sum, pb[0], 1, ex_f16at(x + 82), pb[1], ex_f16at(x + 80), dy);
        } else if (ty == EX_Q3_K) {
            const ex_u8* x = w + (long long)b * 110;
            sum = ex_tiled_step(sum, pb[0], 0, 0.0f, 0, ex_f16at(x + 108), dy);
        } else if (ty == EX_Q4_K || ty == EX_Q5_K) {
            int hi5 = ty == EX_Q5_K;
            const ex_u8* x = w + (long long)b * (hi5 ? 176 : 144);
            float dw = ex_f16at(x), dmin = ex_f16at(x + 2);
            int isum = 0, msum = 0;
            for (int c = 0; c < 4; c++) {
                if (ty == EX_Q4_K && !gemv) {
                    acc = EX_FMA((float)pb[2 * c], EX_MUL(dw, dy), acc);
                    accm = EX_FMA((float)pb[2 * c + 1], EX_MUL(dmin, dy), accm);
                }
                isum += pb[2 * c];
                msum += pb[2 * c + 1];
            }
            if (hi5) {
                sum = ex_tiled_step(sum, isum, 1, dmin, msum, dw, dy);
            } else if (gemv) {
                acc = EX_FMA((float)isum, EX_MUL(dw, dy), acc);
                accm = EX_FMA((float)msum, EX_MUL(dmin, dy), accm);
            }
        } else {
            const ex_u8* x = w + (long long)b * 210;
            sum = ex_tiled_step(sum, pb[0], 0, 0.0f, 0, ex_f16at(x + 208), dy);
        }
    }
    return ty == EX_Q4_K ? EX_SUB(acc, accm) : sum;
}

// Pass 2, thread i = t * rows + r: out[t * out_stride + r] = row r . token t from pass 1's
// integers. Tokens from `tail_from` on take Q4_K's gemv order (the CPU's tokens left over from
// groups of 4).
EX_DEV void ex_mm_float_at(long long i, int ty, int order, const ex_u8* w, long long row_bytes,
                           int rows, int cols, const float* ds, int tail_from, const int* part,
                           long long out_stride, float* out) {
    long long t = i / rows, r = i % rows;
    int nb = ex_blocks(ty, cols);
    const int* p = part + i * nb * ex_ints(ty, order);
    out[t * out_stride + r] = ex_row_float(ty, order, t >= tail_from, w + r * row_bytes,
                                           ds + t * (cols / 32) * 2, p, nb);
}
EX_KERNEL(mm_float,
          (int ty, int order, const ex_u8* w, long long row_bytes, int rows, int cols,
           const float* ds, int tail_from, const int* part, long long out_stride, float* out),
          (ty, order, w, row_bytes, rows, cols, ds, tail_from, part, out_stride, out))

// ---- RMSNorm (cpu::ops::rms_norm) ---------------------------------------------------------

// scale[i] = 1 / sqrt(mean(x_i^2) + eps), the squares summed in f64 in order.
EX_DEV void ex_rms_scale_at(long long i, const float* x, int n, float eps, float* scale) {
    const float* r = x + i * n;
    double s = 0.0;
    // Session 28: the next 32 elements' loads go out before this 32's (ordered) additions.
    int k = 0;
    if (n >= 32) {
        float v[32], nx[32];
        for (int u = 0; u < 32; u++) v[u] = r[u];
        for (; k + 32 <= n; k += 32) {
            int more = k + 64 <= n;
            for (int u = 0; u < 32; u++) nx[u] = more ? r[k + 32 + u] : 0.0f;
            for (int u = 0; u < 32; u++) s = EX_DADD(s, (double)EX_MUL(v[u], v[u]));
            for (int u = 0; u < 32; u++) v[u] = nx[u];
        }
    }
    for (; k < n; k++) s = EX_DADD(s, (double)EX_MUL(r[k], r[k]));
    float mean = (float)EX_DDIV(s, (double)n);
    scale[i] = EX_DIV(1.0f, EX_SQRT(EX_ADD(mean, eps)));
}
EX_KERNEL(rms_scale, (const float* x, int n, float eps, float* scale), (x, n, eps, scale))

EX_DEV void ex_rms_apply_at(long long i, const float* x, const float* w, const float* scale,
                            int n, float* out) {
    out[i] = EX_MUL(EX_MUL(x[i], scale[i / n]), w[i % n]);
}
EX_KERNEL(rms_apply, (const float* x, const float* w, const float* scale, int n, float* out),
          (x, w, scale, n, out))

// ---- element-wise --------------------------------------------------------------------------

// x[i] += y[i % n] (residual adds with n = all, biases with n = the row).
EX_DEV void ex_add_at(long long i, float* x, const float* y, long long n) {
    x[i] = EX_ADD(x[i], y[i % n]);
}
EX_KERNEL(add, (float* x, const float* y, long long n), (x, y, n))

// ggml's vector expf (quant::dot::ggml::expf).
EX_DEV float ex_expf(float x) {
    const float R = 0x1.8p23f;
    const float LOG2E = 0x1.715476p+0f;
    const float LN2_HI = 0x1.62e4p-1f;
    const float LN2_LO = 0x1.7f7d1cp-20f;
    const float P5 = 0x1.0e4020p-7f;
    const float P4 = 0x1.573e2ep-5f;
    const float P3 = 0x1.555e66p-3f;
    const float P2 = 0x1.fffdb6p-2f;
    const float P1 = 0x1.ffffecp-1f;
    float z = EX_FMA(x, LOG2E, R);
    float n = EX_SUB(z, R);
    float b = EX_FMA(-n, LN2_LO, EX_FMA(-n, LN2_HI, x));
    float u = EX_MUL(b, b);
    float j = EX_FMA(EX_FMA(EX_FMA(P5, b, P4), u, EX_FMA(P3, b, P2)), u, EX_FMA(P1, b, 1.0f));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
    return (float)EX_LDEXP((double)j, (int)n);
}

// g[i] = silu(g[i]) * u[i] (ggml's vector body; rows a multiple of 16 long).
EX_DEV void ex_swiglu_at(long long i, float* g, const float* u) {
    float x = g[i];
    g[i] = EX_MUL(EX_DIV(x, EX_ADD(1.0f, ex_expf(EX_SUB(0.0f, x)))), u[i]);
}
EX_KERNEL(swiglu, (float* g, const float* u), (g, u))

// ---- RoPE and the KV store -----------------------------------------------------------------

// One rotation pair per thread: i = (t * heads + h) * (n_rot / 2) + p, rows of `stride` floats,
// `cs` the (cos, sin) of every token's pairs (cpu::ops::Rope::angles, computed on the host).
EX_DEV void ex_rope_at(long long i, float* x, int heads, int hd, int n_rot, int neox,
                       long long stride, const float* cs) {
    int half = n_rot / 2;
    long long th = i / half;
    int p = (int)(i % half);
    long long t = th / heads;
    int h = (int)(th % heads);
    float c = cs[2 * (t * half + p)], s = cs[2 * (t * half + p) + 1];
    float* v = x + t * stride + (long long)h * hd;
    int a = neox ? p : 2 * p, b = neox ? p + half : 2 * p + 1;
    float x0 = v[a], x1 = v[b];
    v[a] = EX_FMA(x0, c, -EX_MUL(x1, s));
    v[b] = EX_FMA(x0, s, EX_MUL(x1, c));
}
EX_KERNEL(rope, (float* x, int heads, int hd, int n_rot, int neox, long long stride,
                 const float* cs),
          (x, heads, hd, n_rot, neox, stride, cs))

// Token t's K and V rows (`row` floats) rounded to f16 into its cache slot.
EX_DEV void ex_store_kv_at(long long i, const float* k, const float* v, const int* slot,
                           int row, ex_u16* kc, ex_u16* vc) {
    long long t = i / row, e = i % row;
    long long dst = (long long)slot[t] * row + e;
    kc[dst] = ex_f2h(k[i]);
    vc[dst] = ex_f2h(v[i]);
}
EX_KERNEL(store_kv, (const float* k, const float* v, const int* slot, int row, ex_u16* kc,
                     ex_u16* vc),
          (k, v, slot, row, kc, vc))

// ---- attention (cpu::attention::attend_reference) ------------------------------------------
//
// Per token t: `tok[4 t ..]` = {chunk (row of the block tables), length (positions read),
// lanes (64: ggml_vec_dot_f16's order, a one-token chunk; 16: tinyBLAS's), unused}.

EX_DEV long long ex_kv_row(const int* btab, int max_blocks, int bt, int chunk, int j) {
    return (long long)btab[chunk * max_blocks + j / bt] * bt + j % bt;
}

// _mm512_reduce_add_ps's tree (quant::dot::ggml::reduce16).
EX_DEV float ex_reduce16(const float* v) {
    float h[8];
    for (int k = 0; k < 8; k++) h[k] = EX_ADD(v[8 + k], v[k]);
    float q0 = EX_ADD(h[4], h[0]), q1 = EX_ADD(h[5], h[1]), q2 = EX_ADD(h[6], h[2]),
          q3 = EX_ADD(h[7], h[3]);
    return EX_ADD(EX_ADD(q0, q2), EX_ADD(q1, q3));
}

// quant::dot::ggml::reduce64 of 64 values `stride` apart.
EX_DEV float ex_reduce64(const float* a, long long stride) {
    float v[16];
    for (int l = 0; l < 16; l++)
        v[l] = EX_ADD(EX_ADD(a[l * stride], a[(32 + l) * stride]),
                      EX_ADD(a[(16 + l) * stride], a[(48 + l) * stride]));
    return ex_reduce16(v);
}

// Score of position j for query head h of token t: i = (t * n_head + h) * max_len + j.
EX_DEV void ex_attn_scores_at(long long i, const float* q, const ex_u16* kc, const int* tok,
                              const int* btab, int max_blocks, int bt, int n_head, int gqa,
                              int hd, int row, int max_len, float scale, float* sc) {
    long long th = i / max_len;
    int j = (int)(i % max_len);
    long long t = th / n_head;
    int h = (int)(th % n_head);
    if (j >= tok[4 * t + 1]) return;
    const float* qh = q + th * hd;
    const ex_u16* kr =
        kc + ex_kv_row(btab, max_blocks, bt, tok[4 * t], j) * row + (long long)(h / gqa) * hd;
    float d;
    if (tok[4 * t + 2] == 64) {
        // ggml_vec_dot_f16: four 16-lane accumulators over 64-element steps, f64 tail.
        int body = hd & ~63;
        float acc[64];
        for (int l = 0; l < 64; l++) acc[l] = 0.0f;
        for (int c = 0; c < body; c += 64)
            for (int l = 0; l < 64; l++)
                acc[l] = EX_FMA(ex_h2f(kr[c + l]), ex_h2f(ex_f2h(qh[c + l])), acc[l]);
        double s = (double)ex_reduce64(acc, 1);
        for (int e = body; e < hd; e++)
            s = EX_DADD(s, (double)EX_MUL(ex_h2f(kr[e]), ex_h2f(ex_f2h(qh[e]))));
        d = (float)s;
    } else {
        // tinyBLAS: one 16-lane accumulator, fma tail.
        int body = hd & ~15;
        float acc[16];
        for (int l = 0; l < 16; l++) acc[l] = 0.0f;
        for (int c = 0; c < body; c += 16)
            for (int l = 0; l < 16; l++)
                acc[l] = EX_FMA(ex_h2f(kr[c + l]), ex_h2f(ex_f2h(qh[c + l])), acc[l]);
        d = ex_reduce16(acc);
        for (int e = body; e < hd; e++) d = EX_FMA(ex_h2f(kr[e]), ex_h2f(ex_f2h(qh[e])), d);
    }
    sc[i] = EX_MUL(d, scale);
}
EX_KERNEL(attn_scores,
          (const float* q, const ex_u16* kc, const int* tok, const int* btab, int max_blocks,
           int bt, int n_head, int gqa, int hd, int row, int max_len, float scale, float* sc),
          (q, kc, tok, btab, max_blocks, bt, n_head, gqa, hd, row, max_len, scale, sc))

// ggml's softmax of each (token, head) row of scores, in place (quant::dot::ggml::softmax), in
// four launches (session 28; one thread walking the whole row took 12 % of a GPU decode step):
// the row's maximum (one thread per row), every exp (one thread per score), the f64 sum of the
// 16-wide trees in chunk order and 1 / sum (one thread per row, reads only), the scaling (one
// thread per score). Positions past the row's length enter the trees as expf(-inf - max) = +0;
// `rowv` holds {max, 1 / sum} per row.
EX_DEV void ex_attn_rowmax_at(long long i, const int* tok, int n_head, int max_len,
                              const float* sc, float* rowv) {
    long long t = i / n_head;
    int len = tok[4 * t + 1];
    const float* r = sc + i * max_len;
    float max = -INFINITY;
    int j0 = 0;
    for (; j0 + 16 <= len; j0 += 16) {
        float v[16];
        for (int k = 0; k < 16; k++) v[k] = r[j0 + k];
        for (int k = 0; k < 16; k++) max = v[k] > max ? v[k] : max;
    }
    for (; j0 < len; j0++) max = r[j0] > max ? r[j0] : max;
    rowv[2 * i] = max;
}
EX_KERNEL(attn_rowmax, (const int* tok, int n_head, int max_len, const float* sc, float* rowv),
          (tok, n_head, max_len, sc, rowv))

// The score row of thread i = row * max_len + j, or -1 where j is past that row's length.
EX_DEV long long ex_score_row(long long i, const int* tok, int n_head, int max_len) {
    long long row = i / max_len;
    return (int)(i % max_len) < tok[4 * (row / n_head) + 1] ? row : -1;
}

EX_DEV void ex_attn_exp_at(long long i, const int* tok, int n_head, int max_len, float* sc,
                           const float* rowv) {
    long long row = ex_score_row(i, tok, n_head, max_len);
    if (row >= 0) sc[i] = ex_expf(EX_SUB(sc[i], rowv[2 * row]));
}
EX_KERNEL(attn_exp, (const int* tok, int n_head, int max_len, float* sc, const float* rowv),
          (tok, n_head, max_len, sc, rowv))

EX_DEV void ex_attn_rowsum_at(long long i, const int* tok, int n_head, int max_len,
                              const float* sc, float* rowv) {
    long long t = i / n_head;
    int len = tok[4 * t + 1];
    const float* r = sc + i * max_len;
    double sum = 0.0;
    for (int c = 0; c < len; c += 16) {
        float e[16];
        for (int k = 0; k < 16; k++) e[k] = c + k < len ? r[c + k] : 0.0f;
        sum = EX_DADD(sum, (double)ex_reduce16(e));
    }
    rowv[2 * i + 1] = (float)EX_DDIV(1.0, sum);
}
EX_KERNEL(attn_rowsum, (const int* tok, int n_head, int max_len, const float* sc, float* rowv),
          (tok, n_head, max_len, sc, rowv))

EX_DEV void ex_attn_scale_at(long long i, const int* tok, int n_head, int max_len, float* sc,
                             const float* rowv) {
    long long row = ex_score_row(i, tok, n_head, max_len);
    if (row >= 0) sc[i] = EX_MUL(sc[i], rowv[2 * row + 1]);
}
EX_KERNEL(attn_scale, (const int* tok, int n_head, int max_len, float* sc, const float* rowv),
          (tok, n_head, max_len, sc, rowv))

// Lane l of element d of V . p: i = ((t * n_head + h) * 64 + l) * hd + d; position j in lane
// j % lanes, weights rounded to f16, one fused multiply-add per position.
EX_DEV void ex_attn_pv_at(long long i, const float* sc, const ex_u16* vc, const int* tok,
                          const int* btab, int max_blocks, int bt, int n_head, int gqa, int hd,
                          int row, int max_len, float* lanes) {
    int d = (int)(i % hd);
    long long tl = i / hd;
    int l = (int)(tl % 64);
    long long th = tl / 64;
    long long t = th / n_head;
    int h = (int)(th % n_head);
    int len = tok[4 * t + 1], nl = tok[4 * t + 2];
    float acc = 0.0f;
    if (l < nl) {
        const float* p = sc + th * max_len;
        for (int j = l; j < len; j += nl) {
            long long o = ex_kv_row(btab, max_blocks, bt, tok[4 * t], j) * row +
                          (long long)(h / gqa) * hd + d;
            acc = EX_FMA(ex_h2f(vc[o]), ex_h2f(ex_f2h(p[j])), acc);
        }
    }
    lanes[i] = acc;
}
EX_KERNEL(attn_pv,
          (const float* sc, const ex_u16* vc, const int* tok, const int* btab, int max_blocks,
           int bt, int n_head, int gqa, int hd, int row, int max_len, float* lanes),
          (sc, vc, tok, btab, max_blocks, bt, n_head, gqa, hd, row, max_len, lanes))

// The lanes of element d reduced by ggml's tree: i = (t * n_head + h) * hd + d.
EX_DEV void ex_attn_reduce_at(long long i, const float* lanes, const int* tok, int n_head,
                              int hd, float* out) {
    long long th = i / hd;
    int d = (int)(i % hd);
    long long t = th / n_head;
    const float* a = lanes + th * 64 * hd + d;
    if (tok[4 * t + 2] == 64) {
        out[i] = ex_reduce64(a, hd);
    } else {
        float v[16];
        for (int l = 0; l < 16; l++) v[l] = a[(long long)l * hd];
        out[i] = ex_reduce16(v);
    }
}
EX_KERNEL(attn_reduce, (const float* lanes, const int* tok, int n_head, int hd, float* out),
          (lanes, tok, n_head, hd, out))
