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
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float oa = __shfl_xor_sync(0xffffffffu, a, o);
        int oi = __shfl_xor_sync(0xffffffffu, ai, o);
        if (oa > a || (oa == a && oi < ai)) { a = oa; ai = oi; }
    }
    __syncthreads();  // the scratch may still be read by the previous chunk's threads
    if (lane == 0) { shf[warp] = a; shi[warp] = ai; }
    __syncthreads();
    float am = shf[0];
    int im = shi[0];
    for (int w = 1; w < 8; w++) {
        if (shf[w] > am || (shf[w] == am && shi[w] < im)) { am = shf[w]; im = shi[w]; }
    }
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
        qs[c] = (i8)q;
        if (lane == 0) ds[c / 32] = make_float2(d, __int_as_float((s & 0xffff) | (s_hi << 16)));
    }
    if (valid && xh) xh[c] = f2h(d * (float)q);
}

// Quantize rows of x (n columns each) for integer products. grid = (rows, ceil(n / 256)),
// blockDim.x = 256: one block per 256 elements (a Q8_K super-block, 8 Q8_0 blocks), so a
// decode step's single row spreads over many SMs. qs/ds (int8 values and scales) or xh (the
// dequantized values as f16, for the GEMM path) may be null.
extern "C" __global__ void quantize_act(const float* x, int n, int fmt, i8* qs, float2* ds,
                                        u16* xh) {
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
        return (float)(s0 + s1) * (p.d * a.x);
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
        return (float)(s0 + s1) * (p.d * a.x) + p.m * a.y;
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
        return (float)(s0 + s1) * (p.d * a.x);
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
        return (float)(s0 + s1) * (p.d * a.x) + p.m * a.y;
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
        return (float)(s0 + s1) * (p.d * a.x);
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

template <> struct QI<T_Q4_K> {
    struct P { float d, dmin; int sc, m; };
    __device__ static __forceinline__ void unit(const u8* b, int j, int* q, P& p) {
        u32 dd = ld_u32(b);
        p.d = h2f((u16)(dd & 0xffff));
        p.dmin = h2f((u16)(dd >> 16));
        k4_scale_min(b + 4, j, &p.sc, &p.m);
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
        u32 dd = ld_u32(b);
        p.d = h2f((u16)(dd & 0xffff));
        p.dmin = h2f((u16)(dd >> 16));
        k4_scale_min(b + 4, j, &p.sc, &p.m);
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

template <> struct QI<T_Q6_K> {
    struct P { float d; int s0, s1; };
    __device__ static __forceinline__ void unit(const u8* b, int j, int* q, P& p) {
        p.d = h2f(ld_u16(b + 208));
        int h = j / 4, k = j % 4;
        u32 scw = ld_u16(b + 192 + 8 * h + 2 * k);
        p.s0 = (int)(i8)(scw & 0xff);
        p.s1 = (int)(i8)(scw >> 8);
        const u8* ql = b + 64 * h + 32 * (k & 1);
        const u8* qh = b + 128 + 32 * h;
        int ls = 4 * (k >> 1), hs = 2 * k;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 lo = (ld_u32_a2(ql + 4 * i) >> ls) & 0x0f0f0f0fu;
            u32 hi = (ld_u32_a2(qh + 4 * i) >> hs) & 0x03030303u;
            q[i] = SUB_BYTES(lo | (hi << 4), 32);
        }
    }
    __device__ static __forceinline__ float combine(const P& p, int s0, int s1, float2 a) {
        return (p.d * a.x) * (float)(p.s0 * s0 + p.s1 * s1);
    }
};

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
template <int T, int NT, bool GLU>
__device__ void mvq_impl(const u8* w, const u8* wu, int rows, int cols, const i8* aq,
                         const float2* ad, int nt, float* y, int accumulate) {
    __shared__ float sh[2][4][NT];
    int row = blockIdx.x;
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
        if (GLU) *o = ggml_swiglu(s, su);
        else *o = accumulate ? *o + s : s;
    }
}

// One token, one warp per row (GLU: the gate row and the up row), four rows per block of 128:
// lane i takes units i, i + 32, ... (unrolled, so several units' loads are in flight before the
// first dot), then a warp reduction; no shared memory or block barrier, and every lane of a
// 3072-wide Q4_K row is busy (the block-per-row form leaves 32 of 128 threads idle there).
template <int T, bool GLU>
__device__ void mvqw_impl(const u8* w, const u8* wu, int rows, int cols, const i8* aq,
                          const float2* ad, float* y, int accumulate) {
    int lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    int units = cols / 32;
    constexpr int UPB = Q<T>::BE / 32;
    long long row_bytes = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    const u8* wr = w + (long long)row * row_bytes;
    const u8* wur = GLU ? wu + (long long)row * row_bytes : wr;
    float acc = 0.0f, accu = 0.0f;
#pragma unroll 4
    for (int u = lane; u < units; u += 32) {
        long long off = (long long)(u / UPB) * Q<T>::BB;
        int j = u % UPB;
        int q[8], qu[8];
        typename QI<T>::P p, pu;
        QI<T>::unit(wr + off, j, q, p);
        if (GLU) QI<T>::unit(wur + off, j, qu, pu);
        const i8* a = aq + 32 * u;
        const float2* d = ad + u;
        acc += unit_dot<T>(q, p, a, d);
        if (GLU) accu += unit_dot<T>(qu, pu, a, d);
    }
    acc = warp_sum(acc);
    if (GLU) accu = warp_sum(accu);
    if (lane == 0) {
        if (GLU) y[row] = ggml_swiglu(acc, accu);
        else y[row] = accumulate ? y[row] + acc : acc;
    }
}

#define DEF_MVQW(name, T) \
    extern "C" __global__ void __launch_bounds__(128) mvqw_##name( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, float* y, \
        int accumulate) { \
        mvqw_impl<T, false>(w, w, rows, cols, aq, ad, y, accumulate); \
    } \
    extern "C" __global__ void __launch_bounds__(128) mvqw_swiglu_##name( \
        const u8* wg, const u8* wu, int rows, int cols, const i8* aq, const float2* ad, \
        float* y) { \
        mvqw_impl<T, true>(wg, wu, rows, cols, aq, ad, y, 0); \
    }

#define DEF_MVQ_NT(name, T, NT) \
    extern "C" __global__ void __launch_bounds__(128) mvq_##name##_##NT( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, int nt, float* y, \
        int accumulate) { \
        mvq_impl<T, NT, false>(w, w, rows, cols, aq, ad, nt, y, accumulate); \
    }
#define DEF_MVQ_GLU_NT(name, T, NT) \
    extern "C" __global__ void __launch_bounds__(128) mvq_swiglu_##name##_##NT( \
        const u8* wg, const u8* wu, int rows, int cols, const i8* aq, const float2* ad, int nt, \
        float* y) { \
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
FOR_EACH_QTYPE(DEF_MVQW)
