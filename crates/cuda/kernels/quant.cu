// Weight formats. Each `Q<TYPE>` knows its block size and decodes one "unit" of 32 consecutive
// elements of a row: a whole legacy block, or one eighth of a K-quant super-block. Every GPU
// path (matrix-vector products, embedding rows, dequantization for the GEMM path) goes
// through these, so one check per format against the CPU dequantizer covers them all.
// Layouts follow ggml-common.h (see crates/quant/src/blocks.rs).

enum {
    T_F32 = 0, T_F16 = 1, T_BF16 = 2, T_Q4_0 = 3, T_Q4_1 = 4, T_Q5_0 = 5, T_Q5_1 = 6,
    T_Q8_0 = 7, T_Q2_K = 8, T_Q3_K = 9, T_Q4_K = 10, T_Q5_K = 11, T_Q6_K = 12,
    // Not GGUF types: Q6_K blocks padded to 16-byte slots (Q<T_Q6_KA>), and the same copy read
    // by the one-token products with the - 32 taken from the activation's sums (Q<T_Q6_KU>);
    // session 32: the same two for copies of four blocks per 848-byte group (Q<T_Q6_KA4>).
    T_Q6_KA = 13, T_Q6_KU = 14, T_Q6_KA4 = 15, T_Q6_KU4 = 16
};

template <int T> struct Q;

template <> struct Q<T_F32> {
    static constexpr int BE = 32, BB = 128;
    __device__ static __forceinline__ void unit(const u8* b, int, float* v) {
        const float4* p = (const float4*)b;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float4 a = p[i];
            v[4 * i] = a.x; v[4 * i + 1] = a.y; v[4 * i + 2] = a.z; v[4 * i + 3] = a.w;
        }
    }
};

template <> struct Q<T_F16> {
    static constexpr int BE = 32, BB = 64;
    __device__ static __forceinline__ void unit(const u8* b, int, float* v) {
        const uint4* p = (const uint4*)b;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint4 a = p[i];
            u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                v[8 * i + 2 * k] = h2f((u16)(w[k] & 0xffff));
                v[8 * i + 2 * k + 1] = h2f((u16)(w[k] >> 16));
            }
        }
    }
};

template <> struct Q<T_BF16> {
    static constexpr int BE = 32, BB = 64;
    __device__ static __forceinline__ void unit(const u8* b, int, float* v) {
        const uint4* p = (const uint4*)b;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint4 a = p[i];
            u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                v[8 * i + 2 * k] = __uint_as_float(w[k] << 16);
                v[8 * i + 2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
            }
        }
    }
};

// Q4_0: 18 bytes {f16 d; u8 qs[16]}, x = d * (q - 8); low nibbles are elements 0..16.
template <> struct Q<T_Q4_0> {
    static constexpr int BE = 32, BB = 18;
    __device__ static __forceinline__ void unit(const u8* b, int, float* v) {
        float d = h2f(ld_u16(b));
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 w = ld_u16(b + 2 + 2 * i);
#pragma unroll
            for (int k = 0; k < 2; k++) {
                u32 q = (w >> (8 * k)) & 0xff;
                v[2 * i + k] = d * (float)((int)(q & 15) - 8);
                v[2 * i + k + 16] = d * (float)((int)(q >> 4) - 8);
            }
        }
    }
};

// Q4_1: 20 bytes {f16 d, m; u8 qs[16]}, x = d * q + m.
template <> struct Q<T_Q4_1> {
    static constexpr int BE = 32, BB = 20;
    __device__ static __forceinline__ void unit(const u8* b, int, float* v) {
        u32 dm = ld_u32(b);
        float d = h2f((u16)(dm & 0xffff)), m = h2f((u16)(dm >> 16));
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w = ld_u32(b + 4 + 4 * i);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                u32 q = (w >> (8 * k)) & 0xff;
                v[4 * i + k] = d * (float)(q & 15) + m;
                v[4 * i + k + 16] = d * (float)(q >> 4) + m;
            }
        }
    }
};

// Q5_0: 22 bytes {f16 d; u8 qh[4]; u8 qs[16]}, x = d * (q - 16), fifth bit j in qh bit j.
template <> struct Q<T_Q5_0> {
    static constexpr int BE = 32, BB = 22;
    __device__ static __forceinline__ void unit(const u8* b, int, float* v) {
        float d = h2f(ld_u16(b));
        u32 qh = ld_u32_a2(b + 2);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 w = ld_u16(b + 6 + 2 * i);
#pragma unroll
            for (int k = 0; k < 2; k++) {
                int j = 2 * i + k;
                u32 q = (w >> (8 * k)) & 0xff;
                int x0 = (int)((q & 15) | (((qh >> j) & 1) << 4)) - 16;
                int x1 = (int)((q >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
                v[j] = d * (float)x0;
                v[j + 16] = d * (float)x1;
            }
        }
    }
};

// Q5_1: 24 bytes {f16 d, m; u8 qh[4]; u8 qs[16]}, x = d * q + m.
template <> struct Q<T_Q5_1> {
    static constexpr int BE = 32, BB = 24;
    __device__ static __forceinline__ void unit(const u8* b, int, float* v) {
        u32 dm = ld_u32(b);
        float d = h2f((u16)(dm & 0xffff)), m = h2f((u16)(dm >> 16));
        u32 qh = ld_u32(b + 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w = ld_u32(b + 8 + 4 * i);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int j = 4 * i + k;
                u32 q = (w >> (8 * k)) & 0xff;
                v[j] = d * (float)((q & 15) | (((qh >> j) & 1) << 4)) + m;
                v[j + 16] = d * (float)((q >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
            }
        }
    }
};

// Q8_0: 34 bytes {f16 d; i8 qs[32]}, x = d * q.
template <> struct Q<T_Q8_0> {
    static constexpr int BE = 32, BB = 34;
    __device__ static __forceinline__ void unit(const u8* b, int, float* v) {
        float d = h2f(ld_u16(b));
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u32 w = ld_u16(b + 2 + 2 * i);
            v[2 * i] = d * (float)(i8)(w & 0xff);
            v[2 * i + 1] = d * (float)(i8)(w >> 8);
        }
    }
};

// Q2_K: 84 bytes {u8 scales[16]; u8 qs[64]; f16 d, dmin}. Group g of 16 elements: scale byte g
// (low nibble scale, high nibble min), 2-bit values in qs[(g/8)*32 + (g%2)*16 + l] at shift
// 2*((g%8)/2). Unit j covers groups 2j and 2j+1: 32 consecutive qs bytes, one shift.
template <> struct Q<T_Q2_K> {
    static constexpr int BE = 256, BB = 84;
    __device__ static __forceinline__ void unit(const u8* b, int j, float* v) {
        u32 dd = ld_u32(b + 80);
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        u32 sc = ld_u16(b + 2 * j);
        float d0 = d * (float)(sc & 15), m0 = dmin * (float)((sc >> 4) & 15);
        float d1 = d * (float)((sc >> 8) & 15), m1 = dmin * (float)((sc >> 12) & 15);
        int shift = 2 * (j % 4);
        const u8* q = b + 16 + (j / 4) * 32;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 w = ld_u32(q + 4 * i);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int l = 4 * i + k;
                float x = (float)((w >> (8 * k + shift)) & 3);
                v[l] = l < 16 ? d0 * x - m0 : d1 * x - m1;
            }
        }
    }
};

// Q3_K: 110 bytes {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}. Element e = 128h + 32k + l:
// low 2 bits at qs[32h + l] >> 2k, high bit hmask[l] bit (4h + k) (clear means subtract 4),
// 6-bit scale (offset 32) number e / 16.
__device__ __forceinline__ int q3k_scale(const u8* s, int i) {
    int low = i < 8 ? (s[i] & 15) : (s[i - 8] >> 4);
    int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | (high << 4)) - 32;
}

template <> struct Q<T_Q3_K> {
    static constexpr int BE = 256, BB = 110;
    __device__ static __forceinline__ void unit(const u8* b, int j, float* v) {
        float d = h2f(ld_u16(b + 108));
        int h = j / 4, k = j % 4;
        float d0 = d * (float)q3k_scale(b + 96, 2 * j);
        float d1 = d * (float)q3k_scale(b + 96, 2 * j + 1);
        const u8* q = b + 32 + 32 * h;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u32 w = ld_u16(q + 2 * i);
            u32 hm = ld_u16(b + 2 * i);
#pragma unroll
            for (int t = 0; t < 2; t++) {
                int l = 2 * i + t;
                int lo = (w >> (8 * t + 2 * k)) & 3;
                int hb = (hm >> (8 * t + 4 * h + k)) & 1;
                float x = (float)(lo - (hb ? 0 : 4));
                v[l] = (l < 16 ? d0 : d1) * x;
            }
        }
    }
};

// Q4_K / Q5_K 6-bit scale and min of sub-block j from the 12 packed bytes.
__device__ __forceinline__ void k4_scale_min(const u8* q, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q4_K: 144 bytes {f16 d, dmin; u8 scales[12]; u8 qs[128]}. Sub-block j: qs[32*(j/2) + l],
// low nibble for even j, high for odd; x = d*sc*q - dmin*m. 144 = 9*16, so qs is 16-aligned.
template <> struct Q<T_Q4_K> {
    static constexpr int BE = 256, BB = 144;
    __device__ static __forceinline__ void unit(const u8* b, int j, float* v) {
        u32 dd = ld_u32(b);
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        int sc, mn;
        k4_scale_min(b + 4, j, &sc, &mn);
        float dl = d * (float)sc, ml = dmin * (float)mn;
        int shift = 4 * (j & 1);
        const uint4* q = (const uint4*)(b + 16 + 32 * (j / 2));
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint4 a = q[i];
            u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int t = 0; t < 4; t++)
#pragma unroll
                for (int k = 0; k < 4; k++)
                    v[16 * i + 4 * t + k] = dl * (float)((w[t] >> (8 * k + shift)) & 15) - ml;
        }
    }
};

// Q5_K: 176 bytes {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}; the fifth bit of
// element l of sub-block j is qh[l] bit j.
template <> struct Q<T_Q5_K> {
    static constexpr int BE = 256, BB = 176;
    __device__ static __forceinline__ void unit(const u8* b, int j, float* v) {
        u32 dd = ld_u32(b);
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        int sc, mn;
        k4_scale_min(b + 4, j, &sc, &mn);
        float dl = d * (float)sc, ml = dmin * (float)mn;
        int shift = 4 * (j & 1);
        const uint4* q = (const uint4*)(b + 48 + 32 * (j / 2));
        const uint4* hp = (const uint4*)(b + 16);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint4 a = q[i], hh = hp[i];
            u32 w[4] = {a.x, a.y, a.z, a.w};
            u32 hw[4] = {hh.x, hh.y, hh.z, hh.w};
#pragma unroll
            for (int t = 0; t < 4; t++)
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    u32 lo = (w[t] >> (8 * k + shift)) & 15;
                    u32 hi = ((hw[t] >> (8 * k + j)) & 1) << 4;
                    v[16 * i + 4 * t + k] = dl * (float)(lo | hi) - ml;
                }
        }
    }
};

// Q6_K: 210 bytes {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}. Element e = 128h + 32k + l:
// low 4 bits ql[64h + 32(k&1) + l] (high nibble when k >= 2), 2 high bits qh[32h + l] >> 2k,
// x = d * scales[8h + 2k + l/16] * (q - 32).
// q6_unit_f32 decodes unit j of a block whose ql, qh, scales and d start at the given bytes.
__device__ __forceinline__ void q6_unit_f32(const u8* qlb, const u8* qhb, const u8* scb,
                                            const u8* db, int j, float* v) {
    float d = h2f(ld_u16(db));
    int h = j / 4, k = j % 4;
    u32 scw = ld_u16(scb + 8 * h + 2 * k);
    float d0 = d * (float)(i8)(scw & 0xff), d1 = d * (float)(i8)(scw >> 8);
    const u8* ql = qlb + 64 * h + 32 * (k & 1);
    const u8* qh = qhb + 32 * h;
    int ls = 4 * (k >> 1), hs = 2 * k;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u32 lw = ld_u16(ql + 2 * i), hw = ld_u16(qh + 2 * i);
#pragma unroll
        for (int t = 0; t < 2; t++) {
            int l = 2 * i + t;
            int q = (int)(((lw >> (8 * t + ls)) & 15) | (((hw >> (8 * t + hs)) & 3) << 4)) - 32;
            v[l] = (l < 16 ? d0 : d1) * (float)q;
        }
    }
}

template <> struct Q<T_Q6_K> {
    static constexpr int BE = 256, BB = 210;
    __device__ static __forceinline__ void unit(const u8* b, int j, float* v) {
        q6_unit_f32(b, b + 128, b + 192, b + 208, j, v);
    }
};

// The aligned copies of Q6_K matrices (q6k_pad) group G consecutive blocks of a row (G = 1:
// Q6_KA, G = 4: Q6_KA4, for rows of a multiple of 1024 columns) into one slot of
// Q6G<G>::BB bytes: the G blocks' ql runs (128 bytes each), then their qh runs (64), their
// scales (16) and their d (2), zeros up to a multiple of 16. So every ql and qh run and every
// block's scales start at a multiple of 16, and a G = 4 slot wastes 8 of 848 bytes where G = 1
// wastes 14 of 224 (session 32). For G = 1 the slot is the block itself, then 14 zero bytes.
template <int G> struct Q6G {
    static constexpr int BE = 256 * G, BB = (210 * G + 15) / 16 * 16;
    __device__ static __forceinline__ int ql(int blk) { return 128 * blk; }
    __device__ static __forceinline__ int qh(int blk) { return 128 * G + 64 * blk; }
    __device__ static __forceinline__ int sc(int blk) { return 192 * G + 16 * blk; }
    __device__ static __forceinline__ int d(int blk) { return 208 * G + 2 * blk; }
    // Unit j (0 .. 8G) of slot b: the Q6_K values.
    __device__ static __forceinline__ void unit(const u8* b, int j, float* v) {
        int blk = j >> 3;
        q6_unit_f32(b + ql(blk), b + qh(blk), b + sc(blk), b + d(blk), j & 7, v);
    }
};

template <> struct Q<T_Q6_KA> : Q6G<1> {};
template <> struct Q<T_Q6_KA4> : Q6G<4> {};

// Q6_KU (session 20): the Q6_KA copy itself; only the one-token products' integer decoding
// differs (QI<T_Q6_KU>, matvec_q.cu).
template <> struct Q<T_Q6_KU> : Q<T_Q6_KA> {};
template <> struct Q<T_Q6_KU4> : Q<T_Q6_KA4> {};

// Unit u (0 .. cols/32) of row `row` of a matrix of `cols` columns.
template <int T>
__device__ __forceinline__ void load_unit(const u8* w, long long row, int cols, int u, float* v) {
    constexpr int UPB = Q<T>::BE / 32;
    long long row_bytes = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    Q<T>::unit(w + row * row_bytes + (long long)(u / UPB) * Q<T>::BB, u % UPB, v);
}

// Embedding lookup: out[i, :] = row ids[i] of w, as f32. grid.x = tokens; any block size.
template <int T>
__device__ void get_rows_impl(const u8* w, int cols, const int* ids, float* out) {
    int i = blockIdx.x;
    long long row = ids[i];
    for (int u = threadIdx.x; u < cols / 32; u += blockDim.x) {
        float v[32];
        load_unit<T>(w, row, cols, u, v);
        float4* o = (float4*)(out + (long long)i * cols + 32 * u);
#pragma unroll
        for (int k = 0; k < 8; k++) o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
}

// Whole-matrix dequantization to f16 (the GEMM path's weight operand): one unit per thread.
template <int T>
__device__ void dequant_f16_impl(const u8* w, long long rows, int cols, u16* out) {
    long long units = rows * (cols / 32);
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < units;
         g += (long long)gridDim.x * blockDim.x) {
        long long row = g / (cols / 32);
        int u = (int)(g % (cols / 32));
        float v[32];
        load_unit<T>(w, row, cols, u, v);
        uint4* o = (uint4*)(out + row * cols + 32 * u);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 p[4];
#pragma unroll
            for (int t = 0; t < 4; t++)
                p[t] = (u32)f2h(v[8 * k + 2 * t]) | ((u32)f2h(v[8 * k + 2 * t + 1]) << 16);
            o[k] = make_uint4(p[0], p[1], p[2], p[3]);
        }
    }
}

#define FOR_EACH_TYPE(X) \
    X(f32, T_F32) X(f16, T_F16) X(bf16, T_BF16) X(q4_0, T_Q4_0) X(q4_1, T_Q4_1) \
    X(q5_0, T_Q5_0) X(q5_1, T_Q5_1) X(q8_0, T_Q8_0) X(q2_k, T_Q2_K) X(q3_k, T_Q3_K) \
    X(q4_k, T_Q4_K) X(q5_k, T_Q5_K) X(q6_k, T_Q6_K)

#define DEF_GET_ROWS(name, T) \
    extern "C" __global__ void get_rows_##name(const u8* w, int cols, const int* ids, float* out) { PDL_ENTRY(); \
        get_rows_impl<T>(w, cols, ids, out); \
    } \
    extern "C" __global__ void dequant_f16_##name(const u8* w, long long rows, int cols, u16* out) { PDL_ENTRY(); \
        dequant_f16_impl<T>(w, rows, cols, out); \
    }
FOR_EACH_TYPE(DEF_GET_ROWS)

// Q6_K blocks to the aligned copy of groups of g blocks (Q6G<g>, g = 1 or 4): 16-byte chunk c
// of dst from group c / n of src (n = Q6G<g>::BB / 16 chunks a group), 2-byte aligned; the
// chunk's 8 halfwords are each read from the block and field they belong to, bytes past the
// fields zero. dst is 16-byte aligned; blocks is a multiple of g.
extern "C" __global__ void q6k_pad(const u8* src, long long blocks, u8* dst, int g) {
    PDL_ENTRY();
    int n = (210 * g + 15) / 16;
    long long total = blocks / g * n;
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < total;
         c += (long long)gridDim.x * blockDim.x) {
        long long grp = c / n;
        int o = (int)(c - grp * n) * 16;
        const u8* s = src + grp * g * 210;
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            // Byte x of the slot: which field of which block, and where that is in src.
            int x = o + 2 * i, from = -1;
            if (x < 128 * g) from = (x / 128) * 210 + x % 128;
            else if (x < 192 * g) from = ((x - 128 * g) / 64) * 210 + 128 + (x - 128 * g) % 64;
            else if (x < 208 * g) from = ((x - 192 * g) / 16) * 210 + 192 + (x - 192 * g) % 16;
            else if (x < 210 * g) from = ((x - 208 * g) / 2) * 210 + 208;
            u32 h = from >= 0 ? (u32)ld_u16(s + from) : 0u;
            if (i & 1) w[i / 2] |= h << 16;
            else w[i / 2] = h;
        }
        *(uint4*)(dst + 16 * c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}
