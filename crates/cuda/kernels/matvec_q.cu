// Integer-dot matrix-vector products for decode, on activations quantized the way the CPU
// backend quantizes them (crates/quant/src/dot/scalar.rs):
//
// - ACT_Q8_32: blocks of 32, d = amax / 127 rounded to f16, q = round-half-even(x * 127 / amax),
//   s = f16(d * sum(q)) (Q8_0 and Q8_1 are the same numbers; Q8_1 adds s). For Q4_0, Q4_1,
//   Q5_0, Q5_1, Q8_0 weights.
// - ACT_Q8_K: super-blocks of 256, d = 1 / (-127 / x_max) with x_max the signed value of the first
//   element of largest magnitude, q = min(round-half-even(x * -127 / x_max), 127), and the sums
//   of each 16 q. For the K-quants.
//
// Layout on the device (not ggml's packed blocks: those are only 2-byte aligned): `qs` holds the
// int8 values row after row (cols bytes per token, 16-byte aligned), `ds` one float2 per
// 32 elements: {d, s} for ACT_Q8_32, {d, bits(bsum_lo16 | bsum_hi16 << 16)} for ACT_Q8_K (d of
// the super-block repeated in each of its 8 units).
//
// Weights are decoded 32 elements ("unit") at a time into 8 words of 4 signed bytes, dotted with
// dp4a (exact int32), and each unit's integer sums are scaled the way the CPU's scalar kernel
// scales them; only the order of the float additions across units differs. The activation
// bytes a product reads are a quarter of the f32 ones, and the decoded weights (8 registers)
// serve up to 8 tokens.

#define ACT_Q8_32 1
#define ACT_Q8_K 2
// Or'ed into a format by act_quant_w: the f16 operand holds the int8 values themselves (exact in
// f16), not f16(d * q): the operand of the K-quant tensor-core products (mmk, mmf.cu), which
// apply d from `ds` per super-block.
#define ACT_RAW 256
// Or'ed into ACT_Q8_K by rms_norm (session 16): the int8 values of each super-block stored with
// its even sub-blocks first, then its odd ones (k_perm), the layout the half-unit Q4_K SwiGLU
// product (mvh_swiglu_q4_k) reads with contiguous 16-byte loads. The scales and sums (`ds`)
// keep their order.
#define ACT_PERM 512

// Where element c of a row goes in the ACT_PERM layout: sub-block j of super-block s moves to
// slot (j & 1) * 4 + j / 2.
__device__ __forceinline__ int k_perm(int c) {
    int j = (c >> 5) & 7;
    return (c & ~255) + ((j & 1) << 7) + ((j >> 1) << 5) + (c & 31);
}

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Quantize one element per thread of a 256-thread block: element c of a row whose int8 values
// start at qs and whose per-32 scales start at ds. Every thread of the block calls it with the
// same chunk (c = chunk start + threadIdx.x); `valid` is false past the row end (only possible for
// ACT_Q8_32, whose rows are whole warps). `shf`/`shi` hold 9 floats / 8 ints of scratch. qs/ds
// may be null; xh (may be null) receives f16(d * q), the value the CPU's integer dot stands for,
// as the GEMM path's activation operand.
__device__ __forceinline__ void quant_act_elem(float v, bool valid, int c, int fmt, i8* qs,
                                               float2* ds, u16* xh, float* shf, int* shi) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (fmt == ACT_Q8_32) {
        // f32 max skips NaN, as the CPU's fold over f32::max does.
        float am = warp_max(valid ? fabsf(v) : 0.0f);
        float d = am / 127.0f;
        float id = am != 0.0f ? 127.0f / am : 0.0f;
        int q = __float2int_rn(v * id);
        int s = warp_sum_i(valid ? q : 0);
        float dh = h2f(f2h(d));
        if (valid && qs) {
            qs[c] = (i8)q;
            if (lane == 0) ds[c / 32] = make_float2(dh, h2f(f2h(d * (float)s)));
        }
        if (valid && xh) xh[c] = f2h(dh * (float)q);
        return;
    }
    // ACT_Q8_K: the first element (lowest index) of largest magnitude over the 256 of the block.
    float a = valid && !isnan(v) ? fabsf(v) : -1.0f;
    int ai = threadIdx.x;
    warp_argmax(a, ai);
    __syncthreads();  // the scratch may still be read by the previous chunk's threads
    if (lane == 0) { shf[warp] = a; shi[warp] = ai; }
    __syncthreads();
    float am = shf[0];
    int im = shi[0];
    for (int w = 1; w < 8; w++) argmax_take(am, im, shf[w], shi[w]);
    if (threadIdx.x == im) shf[8] = v;
    __syncthreads();
    float xmax = shf[8];
    int q = 0;
    float d = 0.0f;
    if (am > 0.0f) {
        float iscale = -127.0f / xmax;
        q = min(__float2int_rn(iscale * v), 127);
        d = 1.0f / iscale;
    }
    // Sums of each 16: lanes 0-15 and 16-31 reduce separately.
    int s = q;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    int s_hi = __shfl_sync(0xffffffffu, s, 16);
    if (valid && qs) {
        qs[(fmt & ACT_PERM) ? k_perm(c) : c] = (i8)q;
        if (lane == 0) ds[c / 32] = make_float2(d, __int_as_float((s & 0xffff) | (s_hi << 16)));
    }
    if (valid && xh) xh[c] = f2h(d * (float)q);
}

// Quantize 256-element group g of the row x (n columns; n - 256 g may be less than 256 for
// ACT_Q8_32) with one warp, 8 consecutive elements per lane, to the same bytes quant_act_elem
// writes (max and sums are exact, and each element's value takes the same operations). x is
// read around L1 (other multiprocessors wrote it in this kernel).
// quant_group_vals does the work on values already in registers: lane i holds elements
// c0 = 256 g + 8 i .. c0 + 7 in v (zeros where !valid); qs/ds may point to shared memory.
__device__ __forceinline__ void quant_group_vals(const float* v, bool valid, int c0, int fmt,
                                                 i8* qs, float2* ds);
__device__ void quant_group_warp(const float* x, int n, int g, int fmt, i8* qs, float2* ds) {
    int lane = threadIdx.x & 31;
    int c0 = g * 256 + lane * 8;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int c = c0 + i;
        v[i] = c < n ? *(volatile const float*)(x + c) : 0.0f;
    }
    quant_group_vals(v, c0 < n, c0, fmt, qs, ds);
}

__device__ __forceinline__ void quant_group_vals(const float* v, bool valid, int c0, int fmt,
                                                 i8* qs, float2* ds) {
    // n is a multiple of 32: a lane's 8 are all in or all out
    int lane = threadIdx.x & 31;
    if (fmt == ACT_Q8_32) {
        float am = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) am = fmaxf(am, valid ? fabsf(v[i]) : 0.0f);
        // Lanes 4k..4k+3 hold one block of 32.
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
        float d = am / 127.0f;
        float id = am != 0.0f ? 127.0f / am : 0.0f;
        int s = 0;
        u32 w[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int q = __float2int_rn(v[i] * id);
            s += q;
            w[i / 4] |= ((u32)(q & 0xff)) << (8 * (i % 4));
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (valid) {
            *(uint2*)(qs + c0) = make_uint2(w[0], w[1]);
            if ((lane & 3) == 0) ds[c0 / 32] = make_float2(h2f(f2h(d)), h2f(f2h(d * (float)s)));
        }
        return;
    }
    // ACT_Q8_K: the first element of largest magnitude.
    float a = -1.0f;
    int ai = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float m = valid && !isnan(v[i]) ? fabsf(v[i]) : -1.0f;
        if (m > a) { a = m; ai = lane * 8 + i; }
    }
    warp_argmax(a, ai);
    float xm = __shfl_sync(0xffffffffu, v[0], 0);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float t = __shfl_sync(0xffffffffu, v[i], (ai >> 3) & 31);
        if ((ai & 7) == i) xm = t;
    }
    float d = 0.0f, iscale = 0.0f;
    bool nz = a > 0.0f;
    if (nz) {
        iscale = -127.0f / xm;
        d = 1.0f / iscale;
    }
    int s = 0;
    u32 w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int q = nz ? min(__float2int_rn(iscale * v[i]), 127) : 0;
        s += q;
        w[i / 4] |= ((u32)(q & 0xff)) << (8 * (i % 4));
    }
    // Sums of 16: lane pairs (2k, 2k + 1); a unit of 32 is lanes 4k..4k+3.
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    int s_hi = __shfl_down_sync(0xffffffffu, s, 2);
    if (valid) {
        *(uint2*)(qs + c0) = make_uint2(w[0], w[1]);
        if ((lane & 3) == 0)
            ds[c0 / 32] = make_float2(d, __int_as_float((s & 0xffff) | (s_hi << 16)));
    }
}

// Called by one warp after its lane 0 stored `cnt` elements of group `g` of a row being
// quantized as it is produced: the warp whose elements complete the group (of `gsize`) quantizes
// it and resets the group's counter, so the counters are zero again when the kernel ends (graph
// replays reuse them).
__device__ __forceinline__ void quant_arrive(const float* x, int n, int g, int gsize, int cnt,
                                             int fmt, u32* counter, i8* qs, float2* ds) {
    int lane = threadIdx.x & 31;
    u32 old = 0;
    if (lane == 0) {
        __threadfence();
        old = atomicAdd(counter, (u32)cnt);
    }
    old = __shfl_sync(0xffffffffu, old, 0);
    if (old + cnt != (u32)gsize) return;
    __threadfence();
    quant_group_warp(x, n, g, fmt, qs, ds);
    if (lane == 0) *counter = 0;
}

// Quantize rows of x (n columns each) for integer products. grid = (rows, ceil(n / 256)),
// blockDim.x = 256: one block per 256 elements (a Q8_K super-block, 8 Q8_0 blocks), so a
// decode step's single row spreads over many SMs. qs/ds (int8 values and scales) or xh (the
// dequantized values as f16, for the GEMM path) may be null.
extern "C" __global__ void quantize_act(const float* x, int n, int fmt, i8* qs, float2* ds,
                                        u16* xh) { PDL_ENTRY_SMALL(PDL_QUANT);
    __shared__ float shf[9];
    __shared__ int shi[8];
    long long r = blockIdx.x;
    int c = blockIdx.y * 256 + threadIdx.x;
    bool valid = c < n;
    float v = valid ? x[r * n + c] : 0.0f;
    quant_act_elem(v, valid, c, fmt, qs ? qs + r * n : qs, qs ? ds + r * (n / 32) : ds,
                   xh ? xh + r * n : xh, shf, shi);
}

// Byte-wise x - k for bytes 0 <= x, x + (128 - k) < 256 (no carry between bytes).
#define SUB_BYTES(x, k) ((((u32)(x)) + 0x01010101u * (128u - (k))) ^ 0x80808080u)

// Bits 0..3 of b to bit 4 of bytes 0..3.
__device__ __forceinline__ u32 spread4(u32 b) {
    return ((b & 1u) | ((b & 2u) << 7) | ((b & 4u) << 14) | ((b & 8u) << 21)) << 4;
}

// Per-unit integer decoding: `unit` fills q[8] (elements 4i..4i+3 in word i, signed bytes) and
// the unit's parameters; `combine` turns the integer dot of elements 0..15 (s0) and 16..31 (s1)
// with the activation unit's {d, s} into this unit's share of the row's dot product, with the
// same float operations as the CPU's scalar kernel.
template <int T> struct QI;

// The 32-element block types' share of a unit, (float)isum * (d * a.d), rounded after every
// operation (session 32): with plain operators the compiler may fuse a product into the add
// that follows it (the `+ m * a.s` of Q4_1 and Q5_1, or the caller's `acc +=`) differently in
// different kernels, and `mvqe_q4_1` then differed from `mvqp_q4_1` in the last bit
// (docs/perf/cuda.md session 32). The CPU's scalar kernel rounds each operation too.
__device__ __forceinline__ float q32_scaled(int isum, float d, float ad) {
    return __fmul_rn((float)isum, __fmul_rn(d, ad));
}

template <> struct QI<T_Q4_0> {
    struct P { float d; };
    __device__ static __forceinline__ void unit(const u8* b, int, int* q, P& p) {
        p.d = h2f(ld_u16(b));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w = ld_u32_a2(b + 2 + 4 * i);
            q[i] = SUB_BYTES(w & 0x0f0f0f0fu, 8);
            q[i + 4] = SUB_BYTES((w >> 4) & 0x0f0f0f0fu, 8);
        }
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        return q32_scaled(s0 + s1, p.d, a.x);
    }
};

template <> struct QI<T_Q4_1> {
    struct P { float d, m; };
    __device__ static __forceinline__ void unit(const u8* b, int, int* q, P& p) {
        u32 dm = ld_u32(b);
        p.d = h2f((u16)(dm & 0xffff));
        p.m = h2f((u16)(dm >> 16));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w = ld_u32(b + 4 + 4 * i);
            q[i] = w & 0x0f0f0f0fu;
            q[i + 4] = (w >> 4) & 0x0f0f0f0fu;
        }
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        return __fadd_rn(q32_scaled(s0 + s1, p.d, a.x), __fmul_rn(p.m, a.y));
    }
};

template <> struct QI<T_Q5_0> {
    struct P { float d; };
    __device__ static __forceinline__ void unit(const u8* b, int, int* q, P& p) {
        p.d = h2f(ld_u16(b));
        u32 qh = ld_u32_a2(b + 2);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w = ld_u32_a2(b + 6 + 4 * i);
            q[i] = SUB_BYTES((w & 0x0f0f0f0fu) | spread4((qh >> (4 * i)) & 15), 16);
            q[i + 4] = SUB_BYTES(((w >> 4) & 0x0f0f0f0fu) | spread4((qh >> (16 + 4 * i)) & 15), 16);
        }
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        return q32_scaled(s0 + s1, p.d, a.x);
    }
};

template <> struct QI<T_Q5_1> {
    struct P { float d, m; };
    __device__ static __forceinline__ void unit(const u8* b, int, int* q, P& p) {
        u32 dm = ld_u32(b);
        p.d = h2f((u16)(dm & 0xffff));
        p.m = h2f((u16)(dm >> 16));
        u32 qh = ld_u32(b + 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w = ld_u32(b + 8 + 4 * i);
            q[i] = (w & 0x0f0f0f0fu) | spread4((qh >> (4 * i)) & 15);
            q[i + 4] = ((w >> 4) & 0x0f0f0f0fu) | spread4((qh >> (16 + 4 * i)) & 15);
        }
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        return __fadd_rn(q32_scaled(s0 + s1, p.d, a.x), __fmul_rn(p.m, a.y));
    }
};

template <> struct QI<T_Q8_0> {
    struct P { float d; };
    __device__ static __forceinline__ void unit(const u8* b, int, int* q, P& p) {
        p.d = h2f(ld_u16(b));
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = ld_u32_a2(b + 2 + 4 * i);
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        return q32_scaled(s0 + s1, p.d, a.x);
    }
};

__device__ __forceinline__ void act_bsums(float2 a, int* lo, int* hi) {
    int bits = __float_as_int(a.y);
    *lo = (int)(short)(bits & 0xffff);
    *hi = bits >> 16;
}

template <> struct QI<T_Q2_K> {
    struct P { float d, dmin; int sc0, sc1; };
    __device__ static __forceinline__ void unit(const u8* b, int j, int* q, P& p) {
        u32 dd = ld_u32(b + 80);
        p.d = h2f((u16)(dd & 0xffff));
        p.dmin = h2f((u16)(dd >> 16));
        u32 sc = ld_u16(b + 2 * j);
        p.sc0 = sc & 0xff;
        p.sc1 = sc >> 8;
        int shift = 2 * (j % 4);
        const u8* qs = b + 16 + (j / 4) * 32;
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = (ld_u32(qs + 4 * i) >> shift) & 0x03030303u;
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        int b0, b1;
        act_bsums(a, &b0, &b1);
        int isum = (p.sc0 & 15) * s0 + (p.sc1 & 15) * s1;
        int msum = (p.sc0 >> 4) * b0 + (p.sc1 >> 4) * b1;
        return (a.x * p.d) * (float)isum - (a.x * p.dmin) * (float)msum;
    }
};

template <> struct QI<T_Q3_K> {
    struct P { float d; int s0, s1; };
    __device__ static __forceinline__ void unit(const u8* b, int j, int* q, P& p) {
        p.d = h2f(ld_u16(b + 108));
        int h = j / 4, k = j % 4;
        p.s0 = q3k_scale(b + 96, 2 * j);
        p.s1 = q3k_scale(b + 96, 2 * j + 1);
        const u8* qs = b + 32 + 32 * h;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 lo = (ld_u32_a2(qs + 4 * i) >> (2 * k)) & 0x03030303u;
            u32 hb = (ld_u32_a2(b + 4 * i) >> (4 * h + k)) & 0x01010101u;
            q[i] = SUB_BYTES(lo | (hb << 2), 4);
        }
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        return (p.d * a.x) * (float)(p.s0 * s0 + p.s1 * s1);
    }
};

// Session 16: the K-quant super-block header {f16 d, dmin; u8 scales[12]} of Q4_K and Q5_K as
// one 16-byte load (both blocks are 16-byte multiples, so it is aligned), and sub-block j's
// 6-bit scale and min taken from its words without a branch: k4_scale_min's values. Was a
// 4-byte load and three byte loads per unit, each touching as many cache lines as the warp
// covers super-blocks: with the nibble loads, more L1 wavefronts than the 16-byte loads of the
// weights themselves.
// Sub-block j's 6-bit scale and min from the K-quant header's words (k4_scale_min's values).
__device__ __forceinline__ void k4_sc_m(const uint4& h, int j, int* sc, int* m) {
    u32 sh = 8u * (u32)(j & 3);
    u32 yb = (h.y >> sh) & 0xffu, zb = (h.z >> sh) & 0xffu, wb = (h.w >> sh) & 0xffu;
    bool lo = j < 4;
    *sc = (int)(lo ? (yb & 63u) : ((wb & 15u) | ((yb >> 6) << 4)));
    *m = (int)(lo ? (zb & 63u) : ((wb >> 4) | ((zb >> 6) << 4)));
}

__device__ __forceinline__ void k4_header(const u8* b, int j, float* d, float* dmin, int* sc,
                                          int* m) {
    uint4 h = *(const uint4*)b;
    *d = h2f((u16)(h.x & 0xffff));
    *dmin = h2f((u16)(h.x >> 16));
    k4_sc_m(h, j, sc, m);
}

template <> struct QI<T_Q4_K> {
    struct P { float d, dmin; int sc, m; };
    __device__ static __forceinline__ void unit(const u8* b, int j, int* q, P& p) {
        k4_header(b, j, &p.d, &p.dmin, &p.sc, &p.m);
        int shift = 4 * (j & 1);
        const uint4* qs = (const uint4*)(b + 16 + 32 * (j / 2));
        uint4 a0 = qs[0], a1 = qs[1];
        u32 w[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = (w[i] >> shift) & 0x0f0f0f0fu;
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        int b0, b1;
        act_bsums(a, &b0, &b1);
        return (p.d * a.x) * (float)(p.sc * (s0 + s1)) - (p.dmin * a.x) * (float)(p.m * (b0 + b1));
    }
};

template <> struct QI<T_Q5_K> {
    struct P { float d, dmin; int sc, m; };
    __device__ static __forceinline__ void unit(const u8* b, int j, int* q, P& p) {
        k4_header(b, j, &p.d, &p.dmin, &p.sc, &p.m);
        int shift = 4 * (j & 1);
        const uint4* qs = (const uint4*)(b + 48 + 32 * (j / 2));
        const uint4* qh = (const uint4*)(b + 16);
        uint4 a0 = qs[0], a1 = qs[1], h0 = qh[0], h1 = qh[1];
        u32 w[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        u32 hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = ((w[i] >> shift) & 0x0f0f0f0fu) | (((hw[i] >> j) & 0x01010101u) << 4);
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        int b0, b1;
        act_bsums(a, &b0, &b1);
        return (p.d * a.x) * (float)(p.sc * (s0 + s1)) - (p.dmin * a.x) * (float)(p.m * (b0 + b1));
    }
};

// The 32 bytes at the 2-byte aligned address p as eight little-endian words, read as the three
// aligned 16-byte loads that cover them (v8; was sixteen 2-byte loads), the words picked by two
// selects and a funnel shift. Reads up to 14 bytes before p and 16 after p + 32, which callers
// keep inside the same block (Q6_K: its ql and qh runs).
__device__ __forceinline__ void ld32_a2_wide(const u8* p, u32* w) {
    unsigned long long a = (unsigned long long)p;
    const uint4* v = (const uint4*)(a & ~15ull);
    uint4 x0 = v[0], x1 = v[1], x2 = v[2];
    u32 x[12] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w, x2.x, x2.y, x2.z, x2.w};
    int r = (int)(a & 15);
    bool s1 = (r & 4) != 0, s2 = (r & 8) != 0;
    u32 sh = (u32)(r & 3) * 8;
    u32 y[11], z[9];
#pragma unroll
    for (int i = 0; i < 11; i++) y[i] = s1 ? x[i + 1] : x[i];
#pragma unroll
    for (int i = 0; i < 9; i++) z[i] = s2 ? y[i + 2] : y[i];
#pragma unroll
    for (int i = 0; i < 8; i++)
        asm("shf.r.wrap.b32 %0, %1, %2, %3;" : "=r"(w[i]) : "r"(z[i]), "r"(z[i + 1]), "r"(sh));
}

template <> struct QI<T_Q6_K> {
    struct P { float d; int s0, s1; };
    __device__ static __forceinline__ void unit(const u8* b, int j, int* q, P& p) {
        p.d = h2f(ld_u16(b + 208));
        int h = j / 4, k = j % 4;
        u32 scw = ld_u16(b + 192 + 8 * h + 2 * k);
        p.s0 = (int)(i8)(scw & 0xff);
        p.s1 = (int)(i8)(scw >> 8);
        // ql run [64h + 32(k & 1), +32) and qh run [128 + 32h, +32): with the wide loads' reach
        // (14 before, 16 after) they stay within bytes [-14, 208) of this 210-byte block.
        u32 lw[8], hw[8];
        ld32_a2_wide(b + 64 * h + 32 * (k & 1), lw);
        ld32_a2_wide(b + 128 + 32 * h, hw);
        int ls = 4 * (k >> 1), hs = 2 * k;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 lo = (lw[i] >> ls) & 0x0f0f0f0fu;
            u32 hi = (hw[i] >> hs) & 0x03030303u;
            q[i] = SUB_BYTES(lo | (hi << 4), 32);
        }
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        return (p.d * a.x) * (float)(p.s0 * s0 + p.s1 * s1);
    }
};

// Q6_KA / Q6_KA4 (the aligned copies of groups of G = 1 / 4 Q6_K blocks, Q6G in quant.cu):
// QI<T_Q6_K>::unit's q and P from plain 16-byte loads of the two 32-byte runs (no ld32_a2_wide
// selects and shifts) and aligned 2-byte loads of the scale pair and d; Q6_K's combine, so
// Q6_K's bits. U (Q6_KU, session 20): the unsigned 6-bit values in q (0..63, so the signed dp4a
// reads them unchanged) and the - 32 taken from the activation's sums of 16 in combine:
// s - 32 * bsum is the same int32 as the sum over (q - 32) * a, so Q6_K's bits with two
// operations fewer per word (no byte-wise subtraction).
template <int G, bool U> struct QI6G {
    using P = QI<T_Q6_K>::P;
    __device__ static __forceinline__ void unit(const u8* b, int j, int* q, P& p) {
        int blk = j >> 3, jj = j & 7;
        p.d = h2f(ld_u16(b + Q6G<G>::d(blk)));
        int h = jj / 4, k = jj % 4;
        u32 scw = ld_u16(b + Q6G<G>::sc(blk) + 2 * jj);
        p.s0 = (int)(i8)(scw & 0xff);
        p.s1 = (int)(i8)(scw >> 8);
        const uint4* ql = (const uint4*)(b + Q6G<G>::ql(blk) + 64 * h + 32 * (k & 1));
        const uint4* qh = (const uint4*)(b + Q6G<G>::qh(blk) + 32 * h);
        uint4 l0 = ql[0], l1 = ql[1], h0 = qh[0], h1 = qh[1];
        u32 lw[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
        u32 hw[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
        int ls = 4 * (k >> 1), hs = 2 * k;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 lo = (lw[i] >> ls) & 0x0f0f0f0fu;
            u32 hi = (hw[i] >> hs) & 0x03030303u;
            q[i] = U ? (int)(lo | (hi << 4)) : SUB_BYTES(lo | (hi << 4), 32);
        }
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        if (!U) return QI<T_Q6_K>::combine(p, s0, s1, a);
        int b0, b1;
        act_bsums(a, &b0, &b1);
        return QI<T_Q6_K>::combine(p, s0 - 32 * b0, s1 - 32 * b1, a);
    }
};
template <> struct QI<T_Q6_KA> : QI6G<1, false> {};
template <> struct QI<T_Q6_KU> : QI6G<1, true> {};
template <> struct QI<T_Q6_KA4> : QI6G<4, false> {};
template <> struct QI<T_Q6_KU4> : QI6G<4, true> {};

// One weight unit against token t's activation unit.
template <int T>
__device__ __forceinline__ float unit_dot(const int* q, const typename QI<T>::P& p, const i8* aq,
                                          const float2* ad) {
    const int4* a = (const int4*)aq;
    int4 a0 = a[0], a1 = a[1];
    int s0 = dp4a(q[0], a0.x, 0);
    s0 = dp4a(q[1], a0.y, s0);
    s0 = dp4a(q[2], a0.z, s0);
    s0 = dp4a(q[3], a0.w, s0);
    int s1 = dp4a(q[4], a1.x, 0);
    s1 = dp4a(q[5], a1.y, s1);
    s1 = dp4a(q[6], a1.z, s1);
    s1 = dp4a(q[7], a1.w, s1);
    return QI<T>::combine(p, s0, s1, *ad);
}

// The block's threads (blockDim.x, a multiple of 32, at most 128) share one row (two for the
// SwiGLU form): thread i takes units i, i + blockDim.x, ... so a row's bytes are read by many
// warps at once (more loads in flight than one warp per row gives), then a block reduction.
// `row` < 0: the block's own row, blockIdx.x; a block calling it for several rows (session 21's
// persistent mvqc_*) synchronizes its threads between calls.
template <int T, int NT, bool GLU>
__device__ void mvq_impl(const u8* w, const u8* wu, int rows, int cols, const i8* aq,
                         const float2* ad, int nt, float* y, int accumulate,
                         double* ss = nullptr, int row = -1) {
    __shared__ float sh[2][4][NT];
    if (row < 0) row = blockIdx.x;
    if (row >= rows) return;
    int units = cols / 32;
    constexpr int UPB = Q<T>::BE / 32;
    long long row_bytes = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    const u8* wr = w + (long long)row * row_bytes;
    const u8* wur = GLU ? wu + (long long)row * row_bytes : wr;
    float acc[NT], accu[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) { acc[t] = 0.0f; accu[t] = 0.0f; }
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        long long off = (long long)(u / UPB) * Q<T>::BB;
        int j = u % UPB;
        int q[8], qu[8];
        typename QI<T>::P p, pu;
        QI<T>::unit(wr + off, j, q, p);
        if (GLU) QI<T>::unit(wur + off, j, qu, pu);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const i8* a = aq + (long long)t * cols + 32 * u;
                const float2* d = ad + (long long)t * units + u;
                acc[t] += unit_dot<T>(q, p, a, d);
                if (GLU) accu[t] += unit_dot<T>(qu, pu, a, d);
            }
        }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        acc[t] = warp_sum(acc[t]);
        if (GLU) accu[t] = warp_sum(accu[t]);
        if (lane == 0) {
            sh[0][warp][t] = acc[t];
            sh[1][warp][t] = accu[t];
        }
    }
    __syncthreads();
    int t = threadIdx.x;
    if (t < nt) {
        float s = 0.0f, su = 0.0f;
        for (int k = 0; k < nw; k++) {
            s += sh[0][k][t];
            su += sh[1][k][t];
        }
        float* o = y + (long long)t * rows + row;
        if (GLU) {
            *o = ggml_swiglu(s, su);
        } else {
            float v = accumulate ? *o + s : s;
            *o = v;
            // Session 16: the new row's squares for the next RMSNorm (one token only).
            if (ss) ss_add(ss, row, v);
        }
    }
}

// One token, R = 2 row slots per warp, 8 warps per block (v6). Plain form: a warp takes two
// consecutive rows of up to three matrices of one type laid end to end (`r0 + r1 + r2` rows:
// Q, K and V of a layer in one launch), each row to its own output; SwiGLU form: the warp's two
// slots are the gate row and the up row of one output. Lane i decodes units i, i + 32, ... of
// both slots, two units per slot per iteration, so four units' loads (36 B each for Q4_K) are in
// flight per lane before the first dot, then a warp reduction: no shared memory, no barrier.
// Under programmatic dependent launch (`prefetch` != 0) the block first asks L2 for its rows'
// bytes, which depend on no earlier kernel, while the kernel before it finishes.
template <int T>
__device__ __forceinline__ void mvr_seg(int g, const u8* w0, const u8* w1, const u8* w2, int r0,
                                        int r1, long long rb, const u8** wr) {
    if (g < r0) *wr = w0 + (long long)g * rb;
    else if (g < r0 + r1) *wr = w1 + (long long)(g - r0) * rb;
    else *wr = w2 + (long long)(g - r0 - r1) * rb;
}

template <int T>
__device__ __forceinline__ void mvr_unit(const u8* const* wr, int u, const i8* __restrict__ aq,
                                         const float2* __restrict__ ad, float* acc) {
    constexpr int UPB = Q<T>::BE / 32;
    long long off = (long long)(u / UPB) * Q<T>::BB;
    int j = u % UPB;
    int q0[8], q1[8];
    typename QI<T>::P p0, p1;
    QI<T>::unit(wr[0] + off, j, q0, p0);
    QI<T>::unit(wr[1] + off, j, q1, p1);
    const i8* a = aq + 32 * u;
    const float2* d = ad + u;
    acc[0] += unit_dot<T>(q0, p0, a, d);
    acc[1] += unit_dot<T>(q1, p1, a, d);
}

// What the Q/K/V launch needs to finish rope_store's work itself (ops.cu): one token; rows
// [0, r0) are Q, [r0, r0 + r1) K, the rest V (kv_row = K or V row width of the cache).
struct RopeArgs {
    const int* pos;
    const int* slot;
    const float* factors;
    float theta_scale, freq_scale;
    int n_rot, hd, kv_row, pad;
    u16* kc;
    u16* vc;
};

// Widest row whose activation a one-token product prepares itself in shared memory (v7).
#define MVR_PREP_MAX 4096

// v7: the one-token products take their activation as f32 (`px`) and prepare it themselves,
// so neither RMSNorm nor quantize_act needs a launch of its own: each block computes the row's
// RMSNorm (with weight `pw`; none when pw is null) exactly as rms_norm does (rms_scale, 256
// threads, the same per-element products) and quantizes it to shared memory exactly as
// quantize_act does (quant_group_vals: a warp per 256-element group). The row is read from L2
// by every block (12 KB for 3072 columns), which is why the fused launches give each warp
// several row pairs (`loops`) rather than one.
template <int T>
__device__ __forceinline__ void mvr_prep(const float* __restrict__ x, const float* __restrict__ nw,
                                         float eps, int n, i8* sq, float2* sd, double* shd) {
    constexpr int fmt = Q<T>::BE == 256 ? ACT_Q8_K : ACT_Q8_32;
    float scale = nw ? rms_scale(x, n, eps, shd) : 1.0f;
    int lane = threadIdx.x & 31;
    for (int g = threadIdx.x >> 5; g * 256 < n; g += blockDim.x >> 5) {
        int c0 = g * 256 + lane * 8;
        bool valid = c0 < n;
        float v[8];
        if (valid) {
            float4 a = *(const float4*)(x + c0), b = *(const float4*)(x + c0 + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
            if (nw) {
                float4 wa = *(const float4*)(nw + c0), wb = *(const float4*)(nw + c0 + 4);
                float w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
                for (int i = 0; i < 8; i++) v[i] = __fmul_rn(__fmul_rn(v[i], scale), w[i]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = 0.0f;
        }
        quant_group_vals(v, valid, c0, fmt, sq, sd);
    }
    __syncthreads();
}

// The one-token Q/K/V launch's output of rows (row, row + 1) with sums (a0, a1): rows [0, r0)
// are Q, [r0, r0 + r1) K, the rest V; rows g, g + 1 are rotation pair (2i, 2i + 1) of a Q or K
// head; K and V rows go to the cache as f16 at the token's slot, Q rows rotated to y0.
__device__ __forceinline__ void qkv_pair_out(int row, int r0, int r1, float a0, float a1,
                                             float* y0, const RopeArgs* rp) {
    // Q/K/V with RoPE and the KV-cache store fused (one token, rope_store's arithmetic):
    // rows g, g + 1 are rotation pair (2i, 2i + 1) of a Q or K head; K and V rows go to the
    // cache as f16 at the token's slot, Q rows rotated to y0.
    int g = row;
    int hd = rp->hd, rhalf = rp->n_rot / 2;
    int li = g < r0 ? g : g < r0 + r1 ? g - r0 : g - r0 - r1;
    float x0 = a0, x1 = a1;
    if (g < r0 + r1) {
        int i = (li % hd) / 2;
        if (i < rhalf) {
            float theta = (float)rp->pos[0];
            for (int k = 0; k < i; k++) theta *= rp->theta_scale;
            float ff = (rp->factors && rp->factors[i] != 0.0f) ? rp->factors[i] : 1.0f;
            float a = rp->freq_scale * (theta / ff);
            double sd, cd;
            sincos((double)a, &sd, &cd);
            float c = (float)cd, sn = (float)sd;
            float y0v = __fmaf_rn(x0, c, -__fmul_rn(x1, sn));
            float y1v = __fmaf_rn(x0, sn, __fmul_rn(x1, c));
            x0 = y0v;
            x1 = y1v;
        }
    }
    long long dst = (long long)rp->slot[0] * rp->kv_row + li;
    if (g < r0) {
        y0[li] = x0;
        y0[li + 1] = x1;
    } else if (g < r0 + r1) {
        rp->kc[dst] = f2h(x0);
        rp->kc[dst + 1] = f2h(x1);
    } else {
        rp->vc[dst] = f2h(x0);
        rp->vc[dst + 1] = f2h(x1);
    }
}

// The weight rows of a warp's row pair (`row`, `row + 1`; the gate and up row `row` for GLU).
template <int T, bool GLU>
__device__ __forceinline__ bool mvr_ptrs(int row, const u8* __restrict__ w0,
                                         const u8* __restrict__ w1, const u8* __restrict__ w2,
                                         int r0, int r1, int total, long long rb, const u8** wr) {
    bool second = GLU || row + 1 < total;
    if (GLU) {
        wr[0] = w0 + (long long)row * rb;
        wr[1] = w1 + (long long)row * rb;
    } else {
        mvr_seg<T>(row, w0, w1, w2, r0, r1, rb, &wr[0]);
        // A missing second row reads the first again (its result is dropped).
        mvr_seg<T>(second ? row + 1 : row, w0, w1, w2, r0, r1, rb, &wr[1]);
    }
    return second;
}

// One warp's dot products of the rows at wr[0] and wr[1] (`units` units each) with the
// activation: lane i takes units i, i + 32, ..., two per row per iteration, then a warp
// reduction; every lane gets both sums.
template <int T>
__device__ __forceinline__ void mvr_dot(const u8* const* wr, int units, const i8* __restrict__ aq,
                                        const float2* __restrict__ ad, float* acc) {
    int u = threadIdx.x & 31;
    acc[0] = acc[1] = 0.0f;
    for (; u + 32 < units; u += 64) {
        mvr_unit<T>(wr, u, aq, ad, acc);
        mvr_unit<T>(wr, u + 32, aq, ad, acc);
    }
    if (u < units) mvr_unit<T>(wr, u, aq, ad, acc);
    acc[0] = warp_sum(acc[0]);
    acc[1] = warp_sum(acc[1]);
}

// The work of one warp on one row pair (`row`, `row + 1`; the gate and up row `row` for GLU).
template <int T, bool GLU>
__device__ __forceinline__ void mvr_rows(int row, const u8* __restrict__ w0,
                                         const u8* __restrict__ w1, const u8* __restrict__ w2,
                                         int r0, int r1, int total, int units, long long rb,
                                         const i8* __restrict__ aq, const float2* __restrict__ ad,
                                         float* y0, float* y1, float* y2, int accumulate,
                                         int qfmt, u32* qcnt, i8* qso, float2* dso,
                                         const RopeArgs* rp, double* ss = nullptr) {
    int lane = threadIdx.x & 31;
    const u8* wr[2];
    bool second = mvr_ptrs<T, GLU>(row, w0, w1, w2, r0, r1, total, rb, wr);
    float acc[2];
    mvr_dot<T>(wr, units, aq, ad, acc);
    if (GLU) {
        if (lane == 0) y0[row] = ggml_swiglu(acc[0], acc[1]);
        // The down projection's activation, quantized as its groups complete (no launch).
        if (qfmt) {
            int g = row >> 8;
            quant_arrive(y0, total, g, min(256, total - g * 256), 1, qfmt, qcnt + g, qso, dso);
        }
        return;
    }
    if (lane != 0) return;
    if (rp && second) {
        // Q/K/V with RoPE and the KV-cache store fused (one token, rope_store's arithmetic).
        qkv_pair_out(row, r0, r1, acc[0], acc[1], y0, rp);
        return;
    }
#pragma unroll
    for (int s = 0; s < 2; s++) {
        int g = row + s;
        if (s == 1 && !second) break;
        float* y = g < r0 ? y0 + g : g < r0 + r1 ? y1 + (g - r0) : y2 + (g - r0 - r1);
        float v = accumulate ? *y + acc[s] : acc[s];
        *y = v;
        // Session 16: the new row's squares for the next RMSNorm (one matrix: y0 is the row).
        if (ss) ss_add(ss, g, v);
    }
}

// v10: L2 prefetch of [p, p + bytes) by one warp (a hint, as prefetch_l2).
__device__ __forceinline__ void warp_prefetch_l2(const u8* p, long long bytes) {
    for (long long o = (long long)(threadIdx.x & 31) * 128; o < bytes; o += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

// v10: one warp asks L2 for the weights of its row pair `row` (mvr_ptrs' rows), if any.
template <int T, bool GLU>
__device__ __forceinline__ void mvr_prefetch_rows(int row, const u8* __restrict__ w0,
                                                  const u8* __restrict__ w1,
                                                  const u8* __restrict__ w2, int r0, int r1,
                                                  int total, long long rb) {
    if (row >= total) return;
    const u8* wr[2];
    bool second = mvr_ptrs<T, GLU>(row, w0, w1, w2, r0, r1, total, rb, wr);
    if (second && wr[1] == wr[0] + rb) {
        warp_prefetch_l2(wr[0], 2 * rb);
    } else {
        warp_prefetch_l2(wr[0], rb);
        if (second) warp_prefetch_l2(wr[1], rb);
    }
}

// Block b takes the contiguous row pairs [b * nw * loops, (b + 1) * nw * loops) (pairs of rows,
// or gate/up rows for GLU); warp w of it pairs b * nw * loops + w + k * nw, k < loops.
// PREP: the launch prepares its activation from `px` (v7, the `mvrp_*` kernels; 256 threads).
// Session 17: a template argument, so the kernels on quantized activations carry neither its
// code nor its shared memory (mvr_swiglu_q4_k: 62 -> 42 registers).
template <int T, bool GLU, bool PREP>
__device__ void mvr_impl(const u8* __restrict__ w0, const u8* __restrict__ w1,
                         const u8* __restrict__ w2, int r0, int r1, int r2, int cols,
                         const i8* __restrict__ aq, const float2* __restrict__ ad, float* y0,
                         float* y1, float* y2, int accumulate, int prefetch, int qfmt,
                         u32* qcnt, i8* qso, float2* dso, const RopeArgs* rp,
                         const float* __restrict__ px, const float* __restrict__ pw, float eps,
                         int loops, double* ss = nullptr) {
    int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int units = cols / 32;
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    int total = GLU ? r0 : r0 + r1 + r2;
    int per_warp = GLU ? 1 : 2;
    int first = blockIdx.x * nw * loops * per_warp;
    // v10 (`prefetch` bit 2, the grid sized to what is resident at once): the block asks L2
    // for its first two steps only, and each warp for its rows two steps ahead as it goes.
    bool ahead = (prefetch & 4) != 0;
    if (prefetch & 1) {
        int last = min(first + nw * (ahead ? min(loops, 2) : loops) * per_warp, total);
        if (GLU) {
            prefetch_l2(w0 + (long long)first * rb, (long long)(last - first) * rb);
            prefetch_l2(w1 + (long long)first * rb, (long long)(last - first) * rb);
        } else {
            // The block's rows are contiguous within each matrix they touch.
            int bounds[4] = {0, r0, r0 + r1, total};
            const u8* ws[3] = {w0, w1, w2};
            for (int s = 0; s < 3; s++) {
                int a = max(first, bounds[s]), b = min(last, bounds[s + 1]);
                if (a < b)
                    prefetch_l2(ws[s] + (long long)(a - bounds[s]) * rb, (long long)(b - a) * rb);
            }
        }
    }
    pdl_wait();
    pdl_launch();
    if (PREP) {
        __shared__ __align__(16) i8 sq[MVR_PREP_MAX];
        __shared__ __align__(16) float2 sd[MVR_PREP_MAX / 32];
        __shared__ double shd[32];
        mvr_prep<T>(px, pw, eps, cols, sq, sd, shd);
        aq = sq;
        ad = sd;
    }
    for (int k = 0; k < loops; k++) {
        int row = first + (warp + k * nw) * per_warp;
        if (row >= total) break;
        if (ahead && k + 2 < loops) mvr_prefetch_rows<T, GLU>(row + 2 * nw * per_warp, w0, w1, w2,
                                                               r0, r1, total, rb);
        mvr_rows<T, GLU>(row, w0, w1, w2, r0, r1, total, units, rb, aq, ad, y0, y1, y2,
                         accumulate, qfmt, qcnt, qso, dso, rp, ss);
    }
}

// The one-token mvr kernels of a type: plain, Q/K/V with RoPE, SwiGLU; prefix mvr on quantized
// activations, mvrp preparing their own (PREP).
#define DEF_MVR_FORM(pre, name, T, PREP) \
    extern "C" __global__ void __launch_bounds__(256) pre##_##name( \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols, \
        const i8* aq, const float2* ad, float* y0, float* y1, float* y2, int accumulate, \
        int prefetch, const float* px, const float* pw, float eps, int loops, double* ss) { \
        mvr_impl<T, false, PREP>(w0, w1, w2, r0, r1, r2, cols, aq, ad, y0, y1, y2, accumulate, \
                                 prefetch, 0, 0, 0, 0, 0, px, pw, eps, loops, ss); \
    } \
    extern "C" __global__ void __launch_bounds__(256) pre##_rope_##name( \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols, \
        const i8* aq, const float2* ad, float* yq, int prefetch, RopeArgs rp, const float* px, \
        const float* pw, float eps, int loops) { \
        mvr_impl<T, false, PREP>(w0, w1, w2, r0, r1, r2, cols, aq, ad, yq, yq, yq, 0, prefetch, \
                                 0, 0, 0, 0, &rp, px, pw, eps, loops); \
    } \
    extern "C" __global__ void __launch_bounds__(256) pre##_swiglu_##name( \
        const u8* wg, const u8* wu, int rows, int cols, const i8* aq, const float2* ad, \
        float* y, int prefetch, int qfmt, u32* qcnt, i8* qso, float2* dso, const float* px, \
        const float* pw, float eps, int loops) { \
        mvr_impl<T, true, PREP>(wg, wu, wu, rows, 0, 0, cols, aq, ad, y, y, y, 0, prefetch, qfmt, \
                                qcnt, qso, dso, 0, px, pw, eps, loops); \
    }
#define DEF_MVR(name, T) DEF_MVR_FORM(mvr, name, T, false)
#define DEF_MVRP(name, T) DEF_MVR_FORM(mvrp, name, T, true)

#define DEF_MVQ_NT(name, T, NT) \
    extern "C" __global__ void __launch_bounds__(128) mvq_##name##_##NT( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, int nt, float* y, \
        int accumulate) { PDL_ENTRY(); \
        mvq_impl<T, NT, false>(w, w, rows, cols, aq, ad, nt, y, accumulate); \
    }
#define DEF_MVQ_GLU_NT(name, T, NT) \
    extern "C" __global__ void __launch_bounds__(128) mvq_swiglu_##name##_##NT( \
        const u8* wg, const u8* wu, int rows, int cols, const i8* aq, const float2* ad, int nt, \
        float* y) { PDL_ENTRY(); \
        mvq_impl<T, NT, true>(wg, wu, rows, cols, aq, ad, nt, y, 0); \
    }
#define DEF_MVQ(name, T) \
    DEF_MVQ_NT(name, T, 1) DEF_MVQ_NT(name, T, 2) DEF_MVQ_NT(name, T, 4) DEF_MVQ_NT(name, T, 8) \
    DEF_MVQ_GLU_NT(name, T, 1) DEF_MVQ_GLU_NT(name, T, 2) DEF_MVQ_GLU_NT(name, T, 4) \
    DEF_MVQ_GLU_NT(name, T, 8)

#define FOR_EACH_QTYPE(X) \
    X(q4_0, T_Q4_0) X(q4_1, T_Q4_1) X(q5_0, T_Q5_0) X(q5_1, T_Q5_1) X(q8_0, T_Q8_0) \
    X(q2_k, T_Q2_K) X(q3_k, T_Q3_K) X(q4_k, T_Q4_K) X(q5_k, T_Q5_K) X(q6_k, T_Q6_K)
FOR_EACH_QTYPE(DEF_MVQ)
FOR_EACH_QTYPE(DEF_MVR)
FOR_EACH_QTYPE(DEF_MVRP)

// v9: the one-token Q/K/V launch (mvr_rope_*) for a V of another type TV than Q and K (TQ),
// both with one activation format (Q4_K_M files store half the layers' V as Q6_K): V's rows
// join the launch instead of taking a second one that waits for the first. One row pair per
// warp (r0 and r1 even, so no pair spans two matrices); each warp runs mvr_rows of its rows'
// type, so every output takes the operations of the single-type launches: the same bits.
template <int TQ, int TV>
__device__ void mvr_rope2_impl(const u8* __restrict__ w0, const u8* __restrict__ w1,
                               const u8* __restrict__ w2, int r0, int r1, int r2, int cols,
                               const i8* __restrict__ aq, const float2* __restrict__ ad,
                               float* yq, int prefetch, const RopeArgs* rp, int loops) {
    int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int units = cols / 32;
    long long rbq = (long long)(cols / Q<TQ>::BE) * Q<TQ>::BB;
    long long rbv = (long long)(cols / Q<TV>::BE) * Q<TV>::BB;
    int total = r0 + r1 + r2;
    // v10: `loops` row pairs per warp (block b: pairs [b nw loops, (b + 1) nw loops)), the
    // grid sized to what is resident at once; with prefetch bit 2 the block asks L2 for its
    // first two steps and each warp for its pair two steps ahead.
    bool ahead = (prefetch & 4) != 0;
    int first = blockIdx.x * nw * loops * 2;
    if (prefetch & 1) {
        int last = min(first + nw * (ahead ? min(loops, 2) : loops) * 2, total);
        int bounds[4] = {0, r0, r0 + r1, total};
        const u8* ws[3] = {w0, w1, w2};
        for (int s = 0; s < 3; s++) {
            long long rb = s == 2 ? rbv : rbq;
            int a = max(first, bounds[s]), b = min(last, bounds[s + 1]);
            if (a < b) prefetch_l2(ws[s] + (long long)(a - bounds[s]) * rb, (long long)(b - a) * rb);
        }
    }
    pdl_wait();
    pdl_launch();
    for (int k = 0; k < loops; k++) {
        int row = first + (warp + k * nw) * 2;
        if (row >= total) return;
        if (ahead && k + 2 < loops) {
            int pr = row + 4 * nw;
            if (pr >= r0 + r1) mvr_prefetch_rows<TV, false>(pr, w0, w1, w2, r0, r1, total, rbv);
            else mvr_prefetch_rows<TQ, false>(pr, w0, w1, w2, r0, r1, total, rbq);
        }
        if (row >= r0 + r1)
            mvr_rows<TV, false>(row, w0, w1, w2, r0, r1, total, units, rbv, aq, ad, yq, yq, yq, 0,
                                0, 0, 0, 0, rp);
        else
            mvr_rows<TQ, false>(row, w0, w1, w2, r0, r1, total, units, rbq, aq, ad, yq, yq, yq, 0,
                                0, 0, 0, 0, rp);
    }
}

#define DEF_MVR_ROPE2(a, TA, b, TB) \
    extern "C" __global__ void __launch_bounds__(256) mvr_rope2_##a##_##b( \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols, \
        const i8* aq, const float2* ad, float* yq, int prefetch, RopeArgs rp, int loops) { \
        mvr_rope2_impl<TA, TB>(w0, w1, w2, r0, r1, r2, cols, aq, ad, yq, prefetch, &rp, loops); \
    }
#define FOR_EACH_QKV_PAIR(X) X(q4_k, T_Q4_K, q6_k, T_Q6_K) X(q5_k, T_Q5_K, q6_k, T_Q6_K)
FOR_EACH_QKV_PAIR(DEF_MVR_ROPE2)

// v7: one-token product for wide rows (the down projection, 8192 columns) that quantizes its
// f32 activation in the launch (px; or reads it quantized from aq/ad when px is null): block =
// 256 threads and MVW_ROWS rows; thread i takes units i, i + 256, ... of every row (each
// thread's MVW_ROWS weight units in flight at once, one activation unit for all of them), then
// a block reduction per row. Each block reads the whole f32 row (32 KB for 8192 columns) from
// L2 to quantize it, hence several rows per block.
#define MVW_ROWS 8
#define MVW_MAX 16384
template <int T>
__device__ void mvw_impl(const u8* __restrict__ w, int rows, int cols,
                         const i8* __restrict__ aq, const float2* __restrict__ ad,
                         const float* __restrict__ px, float* y, int accumulate, int prefetch) {
    __shared__ __align__(16) i8 sq[MVW_MAX];
    __shared__ __align__(16) float2 sd[MVW_MAX / 32];
    __shared__ double shd[32];
    __shared__ float red[8][MVW_ROWS];
    constexpr int UPB = Q<T>::BE / 32;
    int units = cols / 32;
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    int first = blockIdx.x * MVW_ROWS;
    int nr = min(MVW_ROWS, rows - first);
    if (prefetch) prefetch_l2(w + (long long)first * rb, (long long)nr * rb);
    pdl_wait();
    pdl_launch();
    if (px) {
        mvr_prep<T>(px, (const float*)0, 0.0f, cols, sq, sd, shd);
        aq = sq;
        ad = sd;
    }
    const u8* wr = w + (long long)first * rb;
    float acc[MVW_ROWS];
#pragma unroll
    for (int r = 0; r < MVW_ROWS; r++) acc[r] = 0.0f;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        long long off = (long long)(u / UPB) * Q<T>::BB;
        int j = u % UPB;
        int q[MVW_ROWS][8];
        typename QI<T>::P p[MVW_ROWS];
#pragma unroll
        for (int r = 0; r < MVW_ROWS; r++)
            if (r < nr) QI<T>::unit(wr + r * rb + off, j, q[r], p[r]);
#pragma unroll
        for (int r = 0; r < MVW_ROWS; r++)
            if (r < nr) acc[r] += unit_dot<T>(q[r], p[r], aq + 32 * u, ad + u);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < MVW_ROWS; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0) red[warp][r] = v;
    }
    __syncthreads();
    if ((int)threadIdx.x < nr) {
        float s = 0.0f;
        for (int k = 0; k < (int)(blockDim.x >> 5); k++) s += red[k][threadIdx.x];
        float* o = y + first + threadIdx.x;
        *o = accumulate ? *o + s : s;
    }
}

#define DEF_MVW(name, T) \
    extern "C" __global__ void __launch_bounds__(256) mvw_##name( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, const float* px, \
        float* y, int accumulate, int prefetch) { \
        mvw_impl<T>(w, rows, cols, aq, ad, px, y, accumulate, prefetch); \
    }
FOR_EACH_QTYPE(DEF_MVW)

// ld32_a2_wide for NW words (a multiple of 4): NW / 4 + 1 aligned 16-byte loads, reaching up
// to 14 bytes before p and 16 after p + 4 NW.
template <int NW>
__device__ __forceinline__ void ld_a2_wide(const u8* p, u32* w) {
    constexpr int NV = NW / 4 + 1;
    unsigned long long a = (unsigned long long)p;
    const uint4* v = (const uint4*)(a & ~15ull);
    u32 x[4 * NV];
#pragma unroll
    for (int i = 0; i < NV; i++) {
        uint4 t = v[i];
        x[4 * i] = t.x;
        x[4 * i + 1] = t.y;
        x[4 * i + 2] = t.z;
        x[4 * i + 3] = t.w;
    }
    int r = (int)(a & 15);
    bool s1 = (r & 4) != 0, s2 = (r & 8) != 0;
    u32 sh = (u32)(r & 3) * 8;
    u32 y[NW + 3], z[NW + 1];
#pragma unroll
    for (int i = 0; i < NW + 3; i++) y[i] = s1 ? x[i + 1] : x[i];
#pragma unroll
    for (int i = 0; i < NW + 1; i++) z[i] = s2 ? y[i + 2] : y[i];
#pragma unroll
    for (int i = 0; i < NW; i++)
        asm("shf.r.wrap.b32 %0, %1, %2, %3;" : "=r"(w[i]) : "r"(z[i]), "r"(z[i + 1]), "r"(sh));
}

// Unsigned bytes of a times signed bytes of b, summed into c.
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// v10: the integer dot of half h (128 elements, units 4h..4h+3) of the Q6_K block at b with
// the Q8_K activation units at aq (128 int8) / ad (their 4 {d, bsums}): the sum over its 8
// groups of 16 of scale * sum((q - 32) * a), exact in int32 (|sum| <= 128 * 128 * 32 * 127).
// Unlike QI<T_Q6_K>::unit, which loads a unit's 32 ql and 32 qh bytes for each of the 4 units
// that share them, the half's 64 ql and 32 qh bytes are loaded once (8 aligned 16-byte loads
// instead of 24), and the - 32 is taken from the activation's sums of 16 (sum(q a) - 32
// sum(a)) instead of per byte. *ax receives the activation's d (the super-block's, the same in
// each unit).
__device__ __forceinline__ int q6_half_isum(const u8* b, int h, const i8* __restrict__ aq,
                                            const float2* __restrict__ ad, float* ax) {
    u32 lw[16], hw[8];
    ld_a2_wide<16>(b + 64 * h, lw);
    ld_a2_wide<8>(b + 128 + 32 * h, hw);
    u32 s03 = ld_u32_a2(b + 192 + 8 * h), s47 = ld_u32_a2(b + 196 + 8 * h);
    const int4* a = (const int4*)aq;
    int isum = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        int4 a0 = a[2 * k], a1 = a[2 * k + 1];
        float2 d = ad[k];
        if (k == 0) *ax = d.x;
        u32 q[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 l = lw[8 * (k & 1) + i];
            u32 lo = (k < 2 ? l : l >> 4) & 0x0f0f0f0fu;
            q[i] = lo | (((hw[i] >> (2 * k)) & 0x03030303u) << 4);
        }
        int s0 = dp4a_us(q[0], a0.x, 0);
        s0 = dp4a_us(q[1], a0.y, s0);
        s0 = dp4a_us(q[2], a0.z, s0);
        s0 = dp4a_us(q[3], a0.w, s0);
        int s1 = dp4a_us(q[4], a1.x, 0);
        s1 = dp4a_us(q[5], a1.y, s1);
        s1 = dp4a_us(q[6], a1.z, s1);
        s1 = dp4a_us(q[7], a1.w, s1);
        int b0, b1;
        act_bsums(d, &b0, &b1);
        u32 sw = k < 2 ? s03 : s47;
        int sc0 = (int)(i8)((sw >> (16 * (k & 1))) & 0xff);
        int sc1 = (int)(i8)((sw >> (16 * (k & 1) + 8)) & 0xff);
        isum += sc0 * (s0 - 32 * b0) + sc1 * (s1 - 32 * b1);
    }
    return isum;
}

// v10: one token's y (+)= W x for a Q6_K matrix (the 3B model's output head, 128,256 x 3072,
// 323 MB: the largest product of a token). A warp takes MV6_ROWS rows at a time and spreads
// their half super-blocks over its lanes (3072 columns: 4 x 24 halves, 3 per lane), each
// half's bytes loaded once (q6_half_isum); one float product per half:
// (d * a.d) * isum. The grid is sized by the launch to what is resident at once (`loops` row
// groups per warp, block b taking groups [b nw loops, (b + 1) nw loops)), and each warp asks
// L2 for its group two steps ahead, so the loads of a step find their bytes in L2 rather
// than waiting a DRAM round trip per wave of blocks (prefetch bit 0: the block's first two
// steps are asked for before the PDL wait).
#define MV6_ROWS 4
extern "C" __global__ void __launch_bounds__(256, 2)
    mv6_q6_k(const u8* __restrict__ w, int rows, int cols, const i8* __restrict__ aq,
             const float2* __restrict__ ad, float* y, int accumulate, int prefetch, int loops) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int halves = cols / 128;
    long long rb = (long long)(cols / 256) * 210;
    int groups = (rows + MV6_ROWS - 1) / MV6_ROWS;
    int g0 = blockIdx.x * nw * loops;
    if (prefetch & 1) {
        int a = g0 * MV6_ROWS, e = min((g0 + nw * min(loops, 2)) * MV6_ROWS, rows);
        if (a < e) prefetch_l2(w + (long long)a * rb, (long long)(e - a) * rb);
    }
    pdl_wait();
    pdl_launch();
    for (int k = 0; k < loops; k++) {
        int grp = g0 + warp + k * nw;
        if (grp >= groups) return;
        if (k + 2 < loops) {
            int pg = grp + 2 * nw;
            if (pg < groups) {
                int p0 = pg * MV6_ROWS, p1 = min(p0 + MV6_ROWS, rows);
                warp_prefetch_l2(w + (long long)p0 * rb, (long long)(p1 - p0) * rb);
            }
        }
        int row0 = grp * MV6_ROWS;
        int nr = min(MV6_ROWS, rows - row0);
        int tasks = nr * halves;
        float acc[MV6_ROWS];
#pragma unroll
        for (int r = 0; r < MV6_ROWS; r++) acc[r] = 0.0f;
        for (int t = lane; t < tasks; t += 32) {
            int r = t / halves, hh = t - r * halves;
            const u8* b = w + (long long)(row0 + r) * rb + (long long)(hh >> 1) * 210;
            int u = 4 * hh;
            float ax;
            int isum = q6_half_isum(b, hh & 1, aq + 32 * u, ad + u, &ax);
            float v = (h2f(ld_u16(b + 208)) * ax) * (float)isum;
#pragma unroll
            for (int rr = 0; rr < MV6_ROWS; rr++)
                if (rr == r) acc[rr] += v;
        }
        float out = 0.0f;
#pragma unroll
        for (int rr = 0; rr < MV6_ROWS; rr++) {
            float s = warp_sum(acc[rr]);
            if (lane == rr) out = s;
        }
        if (lane < nr) {
            float* o = y + row0 + lane;
            *o = accumulate ? *o + out : out;
        }
    }
}

// v10: one token's y (+)= W x over rows wider than the mvr kernels take (the down projection:
// 8192 columns) with one warp per row (blocks of MVD_WARPS rows) instead of a block of 128
// threads per row (mvq_<type>_1): the 3B model's 3,072 down rows are 768 blocks, all resident
// at once, where the 3,072 blocks of 128 threads ran ~1.5 waves. The warp asks L2 for its row
// before the PDL wait (as mvr does); each lane decodes MVD_U units (lane + 32 i) into registers
// before its first dot (8192 columns: two steps of 4), then a warp reduction: no shared
// memory, no barrier.
#define MVD_WARPS 4
#define MVD_U 4
template <int T>
__device__ void mvd_impl(const u8* __restrict__ w, int rows, int cols, const i8* __restrict__ aq,
                         const float2* __restrict__ ad, float* y, int accumulate, int prefetch) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    int units = cols / 32;
    constexpr int UPB = Q<T>::BE / 32;
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    const u8* wr = w + (long long)row * rb;
    if (prefetch & 1) warp_prefetch_l2(wr, rb);
    pdl_wait();
    pdl_launch();
    float acc = 0.0f;
    for (int u0 = lane; u0 < units; u0 += 32 * MVD_U) {
        int q[MVD_U][8];
        typename QI<T>::P p[MVD_U];
#pragma unroll
        for (int i = 0; i < MVD_U; i++) {
            int u = u0 + 32 * i;
            if (u < units) QI<T>::unit(wr + (long long)(u / UPB) * Q<T>::BB, u % UPB, q[i], p[i]);
        }
#pragma unroll
        for (int i = 0; i < MVD_U; i++) {
            int u = u0 + 32 * i;
            if (u < units) acc += unit_dot<T>(q[i], p[i], aq + 32 * u, ad + u);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) y[row] = accumulate ? y[row] + acc : acc;
}

#define DEF_MVD(name, T) \
    extern "C" __global__ void __launch_bounds__(32 * MVD_WARPS) mvd_##name( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, float* y, \
        int accumulate, int prefetch) { \
        mvd_impl<T>(w, rows, cols, aq, ad, y, accumulate, prefetch); \
    }
FOR_EACH_QTYPE(DEF_MVD)

// v10: the plain and mixed Q/K/V one-token kernels with at most 64 registers (4 blocks of 256
// threads per SM instead of 2 at 124-128 registers: the head's mvr_q6_k ran at 25 %
// occupancy, issue-bound, and the mixed Q/K/V launch's 320 blocks in 1.2 waves). The same
// code as mvr_<type> / mvr_rope2_<qk>_<v>, so the same operations on every output.
#define DEF_MVR4(name, T) \
    extern "C" __global__ void __launch_bounds__(256, 4) mvr4_##name( \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols, \
        const i8* aq, const float2* ad, float* y0, float* y1, float* y2, int accumulate, \
        int prefetch, const float* px, const float* pw, float eps, int loops, double* ss) { \
        mvr_impl<T, false, false>(w0, w1, w2, r0, r1, r2, cols, aq, ad, y0, y1, y2, accumulate, \
                                  prefetch, 0, 0, 0, 0, 0, px, pw, eps, loops, ss); \
    }
FOR_EACH_QTYPE(DEF_MVR4)

// Session 16: one token's SwiGLU of the Q4_K gate and up products with half-unit lanes, the
// grid and epilogue of mvr_swiglu_q4_k (a warp per output row; the down projection's
// activation quantized as its groups complete). Lane l of a warp takes, in super-block
// 4 i + l / 8 of both rows, qs bytes [32 c + 16 h, + 16) with c = (l & 7) / 2, h = l & 1: 16
// elements of sub-block 2c (low nibbles) and 16 of sub-block 2c + 1 (high), so the warp's 16-byte
// weight loads cover 128 contiguous bytes per super-block and every byte is loaded once (the
// unit-per-lane kernels load each 32-byte run twice, for the low and the high nibbles). The
// activation is in the ACT_PERM layout, so the two 16-byte activation loads of the warp are
// contiguous as well; the super-block header is one 16-byte load (k4_header). The integer
// sums of the two halves of a sub-block are added across the lane pair (exact), and lane h
// then scales sub-block 2c + h exactly as QI<T_Q4_K>::combine scales a unit: the same value
// per sub-block as mvr_swiglu_q4_k, added in another order.
// A half-unit lane's integer sums: its 16 weight bytes' low nibbles against `alo` and high
// nibbles against `ahi` (dp4a), each added to its lane pair's (lane ^ 1) so both lanes hold the
// whole sub-blocks' sums: *psl of sub-block 2c, *psh of 2c + 1. Exact integers.
__device__ __forceinline__ void half_unit_isums(const uint4& w, int4 alo, int4 ahi, int* psl,
                                                int* psh) {
    u32 wv[4] = {w.x, w.y, w.z, w.w};
    int al[4] = {alo.x, alo.y, alo.z, alo.w}, ah[4] = {ahi.x, ahi.y, ahi.z, ahi.w};
    int sl = 0, sh = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        sl = dp4a((int)(wv[i] & 0x0f0f0f0fu), al[i], sl);
        sh = dp4a((int)((wv[i] >> 4) & 0x0f0f0f0fu), ah[i], sh);
    }
    sl += __shfl_xor_sync(0xffffffffu, sl, 1);
    sh += __shfl_xor_sync(0xffffffffu, sh, 1);
    *psl = sl;
    *psh = sh;
}

__device__ __forceinline__ float mvh_sub(const uint4& w, const uint4& hd, int4 alo, int4 ahi,
                                         float4 a2, int c, int h) {
    int sl, sh;
    half_unit_isums(w, alo, ahi, &sl, &sh);
    // Lane h scales sub-block j = 2c + h with its whole-sub-block sum.
    int j = 2 * c + h;
    float d, dmin;
    int sc, m;
    k4_header((const u8*)&hd, j, &d, &dmin, &sc, &m);
    float2 a = h ? make_float2(a2.z, a2.w) : make_float2(a2.x, a2.y);
    int b0, b1;
    act_bsums(a, &b0, &b1);
    int s32 = h ? sh : sl;
    return (d * a.x) * (float)(sc * s32) - (dmin * a.x) * (float)(m * (b0 + b1));
}

extern "C" __global__ void __launch_bounds__(256) mvh_swiglu_q4_k(
    const u8* __restrict__ wg, const u8* __restrict__ wu, int rows, int cols,
    const i8* __restrict__ aq, const float2* __restrict__ ad, float* y, int prefetch, int qfmt,
    u32* qcnt, i8* qso, float2* dso) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int row = blockIdx.x * nw + warp;
    int sbs = cols / 256;
    long long rb = (long long)sbs * 144;
    if ((prefetch & 1) && blockIdx.x * nw < rows) {
        int last = min((int)(blockIdx.x + 1) * nw, rows);
        long long first = (long long)blockIdx.x * nw;
        prefetch_l2(wg + first * rb, (last - first) * rb);
        prefetch_l2(wu + first * rb, (last - first) * rb);
    }
    pdl_wait();
    pdl_launch();
    if (row >= rows) return;
    const u8* g0 = wg + (long long)row * rb;
    const u8* u0 = wu + (long long)row * rb;
    int c = (lane & 7) >> 1, h = lane & 1;
    int qoff = 16 + 32 * c + 16 * h;
    float accg = 0.0f, accu = 0.0f;
    int slot = lane >> 3;
    const uint4 z4 = make_uint4(0u, 0u, 0u, 0u);
    // Two steps (8 super-blocks) of loads in flight before the first dot. The loop and the
    // shuffles in mvh_sub are warp-uniform; a lane past the row's end adds nothing.
    for (int b = 0; b < sbs; b += 8) {
        int s0 = b + slot, s1 = b + 4 + slot;
        bool v0 = s0 < sbs, v1 = s1 < sbs, two = b + 4 < sbs;
        uint4 wg0 = z4, hg0 = z4, wu0 = z4, hu0 = z4, wg1 = z4, hg1 = z4, wu1 = z4, hu1 = z4;
        if (v0) {
            const u8* gb = g0 + (long long)s0 * 144;
            const u8* ub = u0 + (long long)s0 * 144;
            wg0 = *(const uint4*)(gb + qoff);
            hg0 = *(const uint4*)gb;
            wu0 = *(const uint4*)(ub + qoff);
            hu0 = *(const uint4*)ub;
        }
        if (v1) {
            const u8* gb = g0 + (long long)s1 * 144;
            const u8* ub = u0 + (long long)s1 * 144;
            wg1 = *(const uint4*)(gb + qoff);
            hg1 = *(const uint4*)gb;
            wu1 = *(const uint4*)(ub + qoff);
            hu1 = *(const uint4*)ub;
        }
        int4 alo = make_int4(0, 0, 0, 0), ahi = alo;
        float4 dd = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (v0) {
            const i8* a = aq + 256 * s0 + 32 * c + 16 * h;
            alo = *(const int4*)a;
            ahi = *(const int4*)(a + 128);
            dd = *(const float4*)(ad + 8 * s0 + 2 * c);
        }
        float pg = mvh_sub(wg0, hg0, alo, ahi, dd, c, h);
        float pu = mvh_sub(wu0, hu0, alo, ahi, dd, c, h);
        if (v0) {
            accg += pg;
            accu += pu;
        }
        if (two) {
            alo = make_int4(0, 0, 0, 0);
            ahi = alo;
            dd = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (v1) {
                const i8* a = aq + 256 * s1 + 32 * c + 16 * h;
                alo = *(const int4*)a;
                ahi = *(const int4*)(a + 128);
                dd = *(const float4*)(ad + 8 * s1 + 2 * c);
            }
            pg = mvh_sub(wg1, hg1, alo, ahi, dd, c, h);
            pu = mvh_sub(wu1, hu1, alo, ahi, dd, c, h);
            if (v1) {
                accg += pg;
                accu += pu;
            }
        }
    }
    accg = warp_sum(accg);
    accu = warp_sum(accu);
    if (lane == 0) y[row] = ggml_swiglu(accg, accu);
    if (qfmt) {
        int g = row >> 8;
        quant_arrive(y, rows, g, min(256, rows - g * 256), 1, qfmt, qcnt + g, qso, dso);
    }
}
// Session 29 (`mvp3_swiglu_q4_k`): mvh_swiglu_q4_k's arithmetic with a row's weights in
// registers before the PDL wait. Each warp walks `rpw` consecutive output rows as one stream of
// steps of four super-blocks (lane slot l takes super-block 4k + l of step k, mvh's lane roles
// within a super-block), the gate and up weights of the next D - 1 steps already in registers
// while a step is computed, and the first D steps' loads issued before the wait (the weights
// depend on no earlier kernel; the mvr/mvh kernels only ask L2 for them there). With one row
// per warp and D = 3, a 3072-column row is all in registers when the wait returns. A lane adds
// its steps in mvh's order (super-blocks l, 4 + l, 8 + l, ...) and each row ends with mvh's warp
// sums, so the outputs are mvh's bits. The activation is Q8_K in the permuted layout (ACT_PERM);
// no fused quantization (quantize_act follows). Measured in session 29 (docs/perf/cuda.md).
struct MvpW {
    uint4 g, hg, u, hu;
};

__device__ __forceinline__ void mvp_load(MvpW& w, const u8* __restrict__ wg,
                                         const u8* __restrict__ wu, long long off, bool ok,
                                         int qoff) {
    if (ok) {
        w.g = __ldg((const uint4*)(wg + off + qoff));
        w.hg = __ldg((const uint4*)(wg + off));
        w.u = __ldg((const uint4*)(wu + off + qoff));
        w.hu = __ldg((const uint4*)(wu + off));
    } else {
        w.g = w.hg = w.u = w.hu = make_uint4(0u, 0u, 0u, 0u);
    }
}

template <int D>
__device__ void mvp_swiglu_impl(const u8* __restrict__ wg, const u8* __restrict__ wu, int rows,
                                int cols, const i8* __restrict__ aq,
                                const float2* __restrict__ ad, float* y, int prefetch, int rpw) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int sbs = cols / 256, steps = (sbs + 3) / 4;
    long long rb = (long long)sbs * 144;
    int row0 = (blockIdx.x * nw + warp) * rpw;
    int nrows = max(0, min(rpw, rows - row0));
    int items = nrows * steps;
    if (prefetch & 1) {
        long long first = (long long)blockIdx.x * nw * rpw;
        long long last = min((long long)rows, first + (long long)nw * rpw);
        if (first < last) {
            prefetch_l2(wg + first * rb, (last - first) * rb);
            prefetch_l2(wu + first * rb, (last - first) * rb);
        }
    }
    int c = (lane & 7) >> 1, h = lane & 1, slot = lane >> 3;
    int qoff = 16 + 32 * c + 16 * h;
    // The load cursor (row, step) runs D steps ahead of the compute cursor.
    int lr = 0, lk = 0;
    MvpW w[D];
#pragma unroll
    for (int j = 0; j < D; j++) {
        int s = 4 * lk + slot;
        mvp_load(w[j], wg, wu, (long long)(row0 + lr) * rb + (long long)s * 144,
                 lr < nrows && s < sbs, qoff);
        if (++lk == steps) { lk = 0; lr++; }
    }
    pdl_wait();
    pdl_launch();
    float accg = 0.0f, accu = 0.0f;
    int cr = 0, ck = 0;
    for (int i0 = 0; i0 < items; i0 += D) {
#pragma unroll
        for (int j = 0; j < D; j++) {
            if (i0 + j < items) {
                int s = 4 * ck + slot;
                bool v = s < sbs;
                int4 alo = make_int4(0, 0, 0, 0), ahi = alo;
                float4 dd = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (v) {
                    const i8* a = aq + 256 * s + 32 * c + 16 * h;
                    alo = *(const int4*)a;
                    ahi = *(const int4*)(a + 128);
                    dd = *(const float4*)(ad + 8 * s + 2 * c);
                }
                float pg = mvh_sub(w[j].g, w[j].hg, alo, ahi, dd, c, h);
                float pu = mvh_sub(w[j].u, w[j].hu, alo, ahi, dd, c, h);
                if (v) {
                    accg += pg;
                    accu += pu;
                }
                int sl = 4 * lk + slot;
                mvp_load(w[j], wg, wu, (long long)(row0 + lr) * rb + (long long)sl * 144,
                         lr < nrows && sl < sbs, qoff);
                if (++lk == steps) { lk = 0; lr++; }
                if (++ck == steps) {
                    float g = warp_sum(accg), u = warp_sum(accu);
                    if (lane == 0) y[row0 + cr] = ggml_swiglu(g, u);
                    accg = accu = 0.0f;
                    ck = 0;
                    cr++;
                }
            }
        }
    }
}

#define DEF_MVP(D) \
    extern "C" __global__ void __launch_bounds__(128) mvp##D##_swiglu_q4_k( \
        const u8* __restrict__ wg, const u8* __restrict__ wu, int rows, int cols, \
        const i8* __restrict__ aq, const float2* __restrict__ ad, float* y, int prefetch, \
        int rpw) { \
        mvp_swiglu_impl<D>(wg, wu, rows, cols, aq, ad, y, prefetch, rpw); \
    }
DEF_MVP(3)

// Session 33 (`mvps<S>_swiglu_q4_k`): mvp3's product at one row per warp for rows of exactly S
// steps (cols = 1024 S), written without mvp3's cursors: no per-step bounds or zeroed loads, no
// L2 prefetch (the warp loads every byte of its row itself), and each lane's two super-block
// headers a step decoded before the PDL wait while the weights arrive (the f16 pair as loaded,
// the 6-bit scale and min as one word: 2 registers a header instead of 4). After the wait only
// the activation loads, the nibble unpacking, the dp4a sums and the scaling remain (the weight
// loads are ld_early16: as `.nc` loads ptxas put them after the wait). A lane adds
// its steps in mvh's order and each sub-block's share is mvh_sub's, its float operations spelled
// out as the compiler contracts them there (d a.x (sc s) - (dmin a.x)(m b) as one FMA after a
// product), so the outputs are mvh's bits.
struct K4Pre {
    u32 dd;   // f16 d | f16 dmin << 16
    int scm;  // 6-bit scale | 6-bit min << 8
};

__device__ __forceinline__ K4Pre k4_pre(const uint4& hd, int j) {
    int sc, m;
    k4_sc_m(hd, j, &sc, &m);
    K4Pre p;
    p.dd = hd.x;
    p.scm = sc | (m << 8);
    return p;
}

__device__ __forceinline__ float mvps_sub(const uint4& w, K4Pre hp, int4 alo, int4 ahi,
                                          float4 a2, int h) {
    int sl, sh;
    half_unit_isums(w, alo, ahi, &sl, &sh);
    float d = h2f((u16)(hp.dd & 0xffffu)), dmin = h2f((u16)(hp.dd >> 16));
    int sc = hp.scm & 0xff, m = hp.scm >> 8;
    float2 a = h ? make_float2(a2.z, a2.w) : make_float2(a2.x, a2.y);
    int b0, b1;
    act_bsums(a, &b0, &b1);
    int s32 = h ? sh : sl;
    float mins = __fmul_rn(__fmul_rn(dmin, a.x), (float)(m * (b0 + b1)));
    return __fmaf_rn(__fmul_rn(d, a.x), (float)(sc * s32), -mins);
}

// Two Q4_K rows of S four-super-block steps (`p0`, `p1`: the rows' first bytes) against one
// token's Q8_K activation, a warp's lanes in mvh's half-unit roles: each lane's weights and
// decoded headers loaded before the PDL wait (which this waits on), its partial sums of the two
// rows in *acc0, *acc1 (the caller's warp sums finish them). PERM: the activation in the
// permuted layout (ACT_PERM: lane (c, h) reads elements 32c + 16h and 128 + 32c + 16h of each
// super-block's permuted bytes), else the plain one (64c + 16h and 64c + 32 + 16h): the same
// values either way.
template <int S, bool PERM>
__device__ __forceinline__ void mvps_pair(const u8* p0, const u8* p1, const i8* __restrict__ aq,
                                          const float2* __restrict__ ad, float* acc0,
                                          float* acc1) {
    int lane = threadIdx.x & 31;
    int c = (lane & 7) >> 1, h = lane & 1, slot = lane >> 3;
    int j = 2 * c + h, qoff = 16 + 32 * c + 16 * h;
    const u8* b0 = p0 + slot * 144;
    const u8* b1 = p1 + slot * 144;
    uint4 q0[S], q1[S], h0[S], h1[S];
#pragma unroll
    for (int k = 0; k < S; k++) {
        q0[k] = ld_early16((const uint4*)(b0 + k * 576 + qoff));
        h0[k] = ld_early16((const uint4*)(b0 + k * 576));
        q1[k] = ld_early16((const uint4*)(b1 + k * 576 + qoff));
        h1[k] = ld_early16((const uint4*)(b1 + k * 576));
    }
    K4Pre e0[S], e1[S];
#pragma unroll
    for (int k = 0; k < S; k++) {
        e0[k] = k4_pre(h0[k], j);
        e1[k] = k4_pre(h1[k], j);
    }
    pdl_wait();
    pdl_launch();
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int k = 0; k < S; k++) {
        int s = 4 * k + slot;
        const i8* a = aq + 256 * s + (PERM ? 32 : 64) * c + 16 * h;
        int4 alo = *(const int4*)a, ahi = *(const int4*)(a + (PERM ? 128 : 32));
        float4 dd = *(const float4*)(ad + 8 * s + 2 * c);
        s0 += mvps_sub(q0[k], e0[k], alo, ahi, dd, h);
        s1 += mvps_sub(q1[k], e1[k], alo, ahi, dd, h);
    }
    *acc0 = s0;
    *acc1 = s1;
}

template <int S>
__device__ __forceinline__ void mvps_swiglu_impl(const u8* __restrict__ wg,
                                                 const u8* __restrict__ wu, int rows,
                                                 const i8* __restrict__ aq,
                                                 const float2* __restrict__ ad, float* y) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int row = blockIdx.x * nw + warp;
    if (row >= rows) return;  // the whole warp: it shares one row
    constexpr long long RB = 4LL * S * 144;
    float accg, accu;
    mvps_pair<S, true>(wg + (long long)row * RB, wu + (long long)row * RB, aq, ad, &accg, &accu);
    float g = warp_sum(accg), u = warp_sum(accu);
    if (lane == 0) y[row] = ggml_swiglu(g, u);
}

// Session 33 (`mvpq<S>_q4_k_<v>`): the one-token Q/K/V launch with RoPE and the KV store
// (mvr_rope2's outputs, qkv_pair_out's arithmetic) on mvps's form: a warp per rotation pair of
// Q4_K rows (rows 2p and 2p + 1 where mvps takes a gate and an up row), each lane's weights and
// decoded headers in registers before the PDL wait, mvh_sub's half-unit sums on the plain Q8_K
// activation (lane (c, h) reads elements 64c + 16h and 64c + 32 + 16h of each super-block).
// Lane l ends up summing sub-block l % 8 of super-blocks l / 8 + 4k in k order, each with the
// unit code's value (the pair's integer sums are exact), which is mvr's unit order: mvr's bits.
// V rows of another type TV (Q4_K_M files store some layers' V as Q6_K) take mvr_rows's unit
// code after the wait, their row pair asked of L2 before it. cols = 1024 S.
template <int S, int TV>
__device__ __forceinline__ void mvpq_impl(const u8* __restrict__ w0, const u8* __restrict__ w1,
                                          const u8* __restrict__ w2, int r0, int r1, int r2,
                                          const i8* __restrict__ aq,
                                          const float2* __restrict__ ad, float* yq,
                                          const RopeArgs* rp) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int row = 2 * (blockIdx.x * nw + warp);
    int total = r0 + r1 + r2;
    if (row >= total) return;  // the whole warp: it shares one pair
    if (TV != T_Q4_K && row >= r0 + r1) {
        long long rbv = (long long)(S * 1024 / Q<TV>::BE) * Q<TV>::BB;
        mvr_prefetch_rows<TV, false>(row, w0, w1, w2, r0, r1, total, rbv);
        pdl_wait();
        pdl_launch();
        mvr_rows<TV, false>(row, w0, w1, w2, r0, r1, total, S * 32, rbv, aq, ad, yq, yq, yq, 0,
                            0, 0, 0, 0, rp);
        return;
    }
    constexpr long long RB = 4LL * S * 144;
    const u8* w = row < r0 ? w0 + (long long)row * RB
                 : row < r0 + r1 ? w1 + (long long)(row - r0) * RB
                                 : w2 + (long long)(row - r0 - r1) * RB;
    float acc0, acc1;
    mvps_pair<S, false>(w, w + RB, aq, ad, &acc0, &acc1);
    float y0 = warp_sum(acc0), y1 = warp_sum(acc1);
    if (lane == 0) qkv_pair_out(row, r0, r1, y0, y1, yq, rp);
}

// Session 36 (`mvpd<S>_q4_k`): the one-token down projection on Q4_K rows of S
// four-super-block steps (cols = 1024 S) as a warp per row in mvps's form: each lane's weights
// and decoded headers in registers before the PDL wait (mvps_pair's loads, on one row), so a
// block of 4 warps holds 4 rows' bytes where `mvqe` decodes 2 units a thread of one row per
// block of 128 threads. Lane l takes units l + 32 k (mvps's lane roles: sub-block l % 8 of
// super-block l / 8 + 4 k), each with the unit code's value, and adds unit k into acc[k % 4] in
// k order: the value mvqe's thread l + 32 (k % 4) holds at 128 threads (its units t, t + 128).
// Then each acc's warp sum (mvqe's butterfly) and their sum in warp order from zero (mvqe's
// thread 0), so mvqe's bits wherever mvqe runs 128 threads (4 <= S <= 8: 128 to 256 units).
// The activation is Q8_K in the plain layout (quantize_act's).
// The end of a warp-per-row product in mvqe's order (mvpd, mvqw): acc[w] holds what mvqe's
// thread l + 32 w holds; each one's warp sum (mvqe's butterfly), their sum from zero in warp
// order (mvqe's thread 0), then lane 0 writes row `row` (adding into it with `accumulate`) and
// its square into the RMS slots (ss, may be null). Called by every lane.
__device__ __forceinline__ void warp_row_out(const float* acc, int row, float* y, int accumulate,
                                             double* ss) {
    float t = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) t += warp_sum(acc[i]);
    if ((threadIdx.x & 31) != 0) return;
    float v = accumulate ? y[row] + t : t;
    y[row] = v;
    if (ss) ss_add(ss, row, v);
}

template <int S>
__device__ __forceinline__ void mvpd_impl(const u8* __restrict__ w, int rows,
                                          const i8* __restrict__ aq,
                                          const float2* __restrict__ ad, float* y,
                                          int accumulate, double* ss) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int row = blockIdx.x * nw + warp;
    if (row >= rows) return;  // the whole warp: it shares one row
    constexpr long long RB = 4LL * S * 144;
    int c = (lane & 7) >> 1, h = lane & 1, slot = lane >> 3;
    int j = 2 * c + h, qoff = 16 + 32 * c + 16 * h;
    const u8* b = w + (long long)row * RB + slot * 144;
    uint4 q[S], hd[S];
#pragma unroll
    for (int k = 0; k < S; k++) {
        q[k] = ld_early16((const uint4*)(b + k * 576 + qoff));
        hd[k] = ld_early16((const uint4*)(b + k * 576));
    }
    K4Pre e[S];
#pragma unroll
    for (int k = 0; k < S; k++) e[k] = k4_pre(hd[k], j);
    pdl_wait();
    pdl_launch();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < S; k++) {
        int s = 4 * k + slot;
        const i8* a = aq + 256 * s + 64 * c + 16 * h;
        int4 alo = *(const int4*)a, ahi = *(const int4*)(a + 32);
        float4 dd = *(const float4*)(ad + 8 * s + 2 * c);
        acc[k & 3] += mvps_sub(q[k], e[k], alo, ahi, dd, h);
    }
    warp_row_out(acc, row, y, accumulate, ss);
}

#define DEF_MVPD(S) \
    extern "C" __global__ void __launch_bounds__(128) mvpd##S##_q4_k( \
        const u8* __restrict__ w, int rows, const i8* __restrict__ aq, \
        const float2* __restrict__ ad, float* y, int accumulate, double* ss) { \
        mvpd_impl<S>(w, rows, aq, ad, y, accumulate, ss); \
    }
DEF_MVPD(4)
DEF_MVPD(5)
DEF_MVPD(6)
DEF_MVPD(7)
DEF_MVPD(8)

#define DEF_MVPQ(S, v, TV) \
    extern "C" __global__ void __launch_bounds__(128) mvpq##S##_q4_k_##v( \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, const i8* aq, \
        const float2* ad, float* yq, RopeArgs rp) { \
        mvpq_impl<S, TV>(w0, w1, w2, r0, r1, r2, aq, ad, yq, &rp); \
    }
#define DEF_MVPQ_S(S) \
    DEF_MVPQ(S, q4_k, T_Q4_K) DEF_MVPQ(S, q6_k, T_Q6_K) DEF_MVPQ(S, q6_ku, T_Q6_KU) \
    DEF_MVPQ(S, q6_ku4, T_Q6_KU4)

#define DEF_MVPS(S) \
    extern "C" __global__ void __launch_bounds__(128) mvps##S##_swiglu_q4_k( \
        const u8* __restrict__ wg, const u8* __restrict__ wu, int rows, \
        const i8* __restrict__ aq, const float2* __restrict__ ad, float* y) { \
        mvps_swiglu_impl<S>(wg, wu, rows, aq, ad, y); \
    }
DEF_MVPS(1)
DEF_MVPS(2)
DEF_MVPS(3)
DEF_MVPS(4)
DEF_MVPQ_S(1)
DEF_MVPQ_S(2)
DEF_MVPQ_S(3)
DEF_MVPQ_S(4)

#define DEF_MVR4_ROPE2(a, TA, b, TB) \
    extern "C" __global__ void __launch_bounds__(256, 4) mvr4_rope2_##a##_##b( \
        const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int cols, \
        const i8* aq, const float2* ad, float* yq, int prefetch, RopeArgs rp, int loops) { \
        mvr_rope2_impl<TA, TB>(w0, w1, w2, r0, r1, r2, cols, aq, ad, yq, prefetch, &rp, loops); \
    }
FOR_EACH_QKV_PAIR(DEF_MVR4_ROPE2)
// Session 20: V read from its Q6_KA copy with Q6_KU's decoding (Q6_K's bits); session 32: from
// its Q6_KA4 copy.
DEF_MVR_ROPE2(q4_k, T_Q4_K, q6_ku, T_Q6_KU)
DEF_MVR_ROPE2(q5_k, T_Q5_K, q6_ku, T_Q6_KU)
DEF_MVR4_ROPE2(q4_k, T_Q4_K, q6_ku, T_Q6_KU)
DEF_MVR4_ROPE2(q5_k, T_Q5_K, q6_ku, T_Q6_KU)
DEF_MVR_ROPE2(q4_k, T_Q4_K, q6_ku4, T_Q6_KU4)
DEF_MVR_ROPE2(q5_k, T_Q5_K, q6_ku4, T_Q6_KU4)
DEF_MVR4_ROPE2(q4_k, T_Q4_K, q6_ku4, T_Q6_KU4)
DEF_MVR4_ROPE2(q5_k, T_Q5_K, q6_ku4, T_Q6_KU4)

// v10: mvq_<type>_1 (one token, a block of up to 128 threads per row: the down projection)
// that first asks L2 for its row, before the PDL wait (no registers held over the wait). The
// same code after it, so the same bits.
#define DEF_MVQP(name, T) \
    extern "C" __global__ void __launch_bounds__(128) mvqp_##name( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, float* y, \
        int accumulate, double* ss) { \
        if ((int)blockIdx.x < rows) \
            prefetch_l2(w + (long long)blockIdx.x * ((cols / Q<T>::BE) * Q<T>::BB), \
                        (long long)(cols / Q<T>::BE) * Q<T>::BB); \
        PDL_ENTRY(); \
        mvq_impl<T, 1, false>(w, w, rows, cols, aq, ad, 1, y, accumulate, ss); \
    }
FOR_EACH_QTYPE(DEF_MVQP)

// Session 30 (`mvqe_*`): mvqp_*'s row product with each thread's units (at most MVQE_U of them:
// units tid, tid + blockDim, ...) already decoded in registers when the PDL wait returns.
// QI<T>::unit reads weights only, so the loads and the unpacking go before the wait (mvqp only
// asks L2 for the row there); after it, unit_dot on the activation in mvq_impl's order and
// mvq_impl's reductions, so mvqp's bits. The host takes it for rows of at most MVQE_U * blockDim
// units (the 8192-column down projection at 128 threads).
#define MVQE_U 2
template <int T>
__device__ __forceinline__ void mvqe_impl(const u8* w, int rows, int cols, const i8* aq,
                                          const float2* ad, float* y, int accumulate,
                                          double* ss) {
    __shared__ float sh[32];
    int row = blockIdx.x;
    int units = cols / 32;
    constexpr int UPB = Q<T>::BE / 32;
    long long row_bytes = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    const u8* wr = w + (long long)row * row_bytes;
    bool live = row < rows;
    int q[MVQE_U][8];
    typename QI<T>::P p[MVQE_U];
#pragma unroll
    for (int m = 0; m < MVQE_U; m++) {
        int u = threadIdx.x + m * blockDim.x;
        if (live && u < units) QI<T>::unit(wr + (long long)(u / UPB) * Q<T>::BB, u % UPB, q[m], p[m]);
    }
    PDL_ENTRY();
    if (!live) return;
    float acc = 0.0f;
#pragma unroll
    for (int m = 0; m < MVQE_U; m++) {
        int u = threadIdx.x + m * blockDim.x;
        if (u < units) acc += unit_dot<T>(q[m], p[m], aq + 32 * u, ad + u);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    acc = warp_sum(acc);
    if (lane == 0) sh[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int k = 0; k < nw; k++) s += sh[k];
        float* o = y + row;
        float v = accumulate ? *o + s : s;
        *o = v;
        if (ss) ss_add(ss, row, v);
    }
}
// Session 36 (`mvqw_*`): mvqe's product as a warp per row: lane l decodes units l + 32 k
// (k < MVQW_U) before the PDL wait and adds unit k into acc[k % 4] in k order, the value mvqe's
// thread l + 32 (k % 4) holds at 128 threads (its units t, t + 128); then each acc's warp sum
// and their sum in warp order from zero (mvqe's thread 0), so mvqe's bits wherever mvqe runs
// 128 threads (rows of 97 to 256 units). A block of 4 warps holds 4 rows' decoded units where
// mvqe's block of 128 threads holds one row's.
#define MVQW_U 8
template <int T>
__device__ __forceinline__ void mvqw_impl(const u8* w, int rows, int cols, const i8* aq,
                                          const float2* ad, float* y, int accumulate,
                                          double* ss) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int row = blockIdx.x * nw + warp;
    if (row >= rows) return;  // the whole warp: it shares one row
    int units = cols / 32;
    constexpr int UPB = Q<T>::BE / 32;
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    const u8* wr = w + (long long)row * rb;
    int q[MVQW_U][8];
    typename QI<T>::P p[MVQW_U];
#pragma unroll
    for (int k = 0; k < MVQW_U; k++) {
        int u = lane + 32 * k;
        if (u < units) QI<T>::unit(wr + (long long)(u / UPB) * Q<T>::BB, u % UPB, q[k], p[k]);
    }
    pdl_wait();
    pdl_launch();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < MVQW_U; k++) {
        int u = lane + 32 * k;
        if (u < units) acc[k & 3] += unit_dot<T>(q[k], p[k], aq + 32 * u, ad + u);
    }
    warp_row_out(acc, row, y, accumulate, ss);
}
#define DEF_MVQW(name, T) \
    extern "C" __global__ void __launch_bounds__(128) mvqw_##name( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, float* y, \
        int accumulate, double* ss) { \
        mvqw_impl<T>(w, rows, cols, aq, ad, y, accumulate, ss); \
    }
#define DEF_MVQE(name, T) \
    extern "C" __global__ void __launch_bounds__(128) mvqe_##name( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, float* y, \
        int accumulate, double* ss) { \
        mvqe_impl<T>(w, rows, cols, aq, ad, y, accumulate, ss); \
    }
FOR_EACH_QTYPE(DEF_MVQE)

// The one-token products of the output head (mvr4) and the down projection (mvqp) on Q6_KA
// copies of Q6_K weights: the same code, so the Q6_K kernels' bits.
DEF_MVR4(q6_ka, T_Q6_KA)
DEF_MVQP(q6_ka, T_Q6_KA)
DEF_MVQE(q6_ka, T_Q6_KA)
// Session 20: the same products with Q6_KU's decoding (the same bits).
DEF_MVR4(q6_ku, T_Q6_KU)
DEF_MVQP(q6_ku, T_Q6_KU)
DEF_MVQE(q6_ku, T_Q6_KU)
// Session 32: the same products on the four-block Q6_KA4 copies (the same bits).
DEF_MVR4(q6_ka4, T_Q6_KA4)
DEF_MVQP(q6_ka4, T_Q6_KA4)
DEF_MVQE(q6_ka4, T_Q6_KA4)
DEF_MVR4(q6_ku4, T_Q6_KU4)
DEF_MVQP(q6_ku4, T_Q6_KU4)
DEF_MVQE(q6_ku4, T_Q6_KU4)
DEF_MVQW(q4_k, T_Q4_K)
DEF_MVQW(q5_k, T_Q5_K)
DEF_MVQW(q6_k, T_Q6_K)
DEF_MVQW(q6_ka, T_Q6_KA)
DEF_MVQW(q6_ku, T_Q6_KU)
DEF_MVQW(q6_ka4, T_Q6_KA4)
DEF_MVQW(q6_ku4, T_Q6_KU4)
