// Thin integer GEMM on the tensor cores for batched decode steps (9..64 tokens): y[t, r] (+)=
// W[r, :] . x[t, :] on activations quantized as the CPU quantizes them (matvec_q.cu's layout),
// with the weights' 32-element units decoded by the same QI<T> decoders as the matrix-vector
// kernels into signed bytes in shared memory, and the integer dots done by
// mma.sync.m16n8k32 / m16n8k16 .s8 (exact int32, as dp4a). Block = 4 warps over 64 weight rows
// (16 per warp) and 8*NB tokens (NB n8 tiles), walking the row 8 units (one K-quant
// super-block) per step. After the integer dots, each type's scales are applied as the CPU's
// scalar kernel applies them (crates/quant/src/dot/scalar.rs):
// - Q4_K: per super-block isum = sum sc_j * dot_j and msum = sum m_j * (bsum_j), then
//   acc = fma(isum, d * dy, acc), accm = fma(msum, dmin * dy, accm), result acc - accm (the
//   CPU's one-token order, dot_q4_k_gemv).
// - Q5_K, Q6_K (and Q2_K, Q3_K through the per-unit path below): llama.cpp's tiled step,
//   r = isum * d (- dmin * msum by fma), acc = fma(r, dy, acc) for Q5_K and Q6_K.
// - The other types: each unit's share by QI<T>::combine, the matrix-vector kernels' numbers,
//   added in unit order.
// So the rows agree with the CPU's integer products up to float order only where the CPU's own
// order differs (none for Q4_K's one-token path).

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// cp.async of 4 or 8 bytes (src_bytes 0: zeros).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem_u32(smem)), "l"(gmem),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    u32 s = smem_u32(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

#define MMQ_BM 64
#define MMQ_WS (8 * 32 + 16)  // weight tile row stride in bytes (8 units + pad: no bank conflicts)
#define MMQ_AS (8 * 32 + 16)  // activation tile row stride

__device__ __forceinline__ void mma_s8_k32(int* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_s8_k16(int* d, u32 a0, u32 a1, u32 b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// How a type's unit results are scaled: 0 = per unit (QI<T>::combine), 1 = one scale and min
// per 32 (Q4_K, Q5_K), 2 = one scale per 16, no min (Q6_K).
template <int T> struct MQ { static constexpr int MODE = 0; };
template <> struct MQ<T_Q4_K> { static constexpr int MODE = 1; };
template <> struct MQ<T_Q5_K> { static constexpr int MODE = 1; };
template <> struct MQ<T_Q6_K> { static constexpr int MODE = 2; };

// The super-block's integer sums folded into the float accumulators (MODE 1, 2).
template <int T>
__device__ __forceinline__ void mmq_finish(float& acc, float& accm, int isum, int msum, float d,
                                           float dmin, float dy) {
    if constexpr (T == T_Q4_K) {
        acc = __fmaf_rn((float)isum, __fmul_rn(d, dy), acc);
        accm = __fmaf_rn((float)msum, __fmul_rn(dmin, dy), accm);
    } else if constexpr (T == T_Q5_K) {
        float r = __fmaf_rn(-dmin, (float)msum, __fmul_rn((float)isum, d));
        acc = __fmaf_rn(r, dy, acc);
    } else {
        acc = __fmaf_rn(__fmul_rn((float)isum, d), dy, acc);
    }
}

// Raw weight bytes one step (8 units) of a row spans, plus room to start at a 4-byte boundary,
// rounded to 16 bytes (the staging buffer's row stride).
template <int T> __device__ constexpr int mmq_rawb() {
    return ((8 / (Q<T>::BE / 32)) * Q<T>::BB + 4 + 15) / 16 * 16;
}

// Shared memory (dynamic, laid out by mmq_impl; kernels.rs computes the same total): decoded
// weight tile Ws, activation tile As, per-unit weight parameters Ps (16 bytes each at most),
// activation scales Ds, raw weight bytes Raw.
template <int T, int NB>
__device__ void mmq_impl(const u8* __restrict__ w, int rows, int cols, const i8* __restrict__ aq,
                         const float2* __restrict__ ad, int n, float* y, int accumulate,
                         u8* sh) {
    constexpr int NTOK = 8 * NB;
    constexpr int UPB = Q<T>::BE / 32;
    constexpr int MODE = MQ<T>::MODE;
    constexpr int RAWB = mmq_rawb<T>();
    typedef typename QI<T>::P P;
    static_assert(sizeof(P) <= 16, "unit parameters over 16 bytes");
    // Ws, Ps, then two stages of {As, Ds, Raw}: the next step's copies land in one stage while
    // the current step decodes and multiplies from the other.
    constexpr int STG = NTOK * MMQ_AS + NTOK * 8 * 8 + MMQ_BM * RAWB;
    u8* Ws = sh;
    P* Ps = (P*)(Ws + MMQ_BM * MMQ_WS);
    u8* stages = Ws + MMQ_BM * MMQ_WS + MMQ_BM * 8 * 16;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, c = lane & 3;
    // Token chunks vary fastest, so the blocks that share a weight tile run together (L2 hits).
    int tok0 = blockIdx.x * NTOK, row0 = blockIdx.y * MMQ_BM;
    int units = cols / 32;
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    float acc[NB][4], accm[NB][4];
    int isum[NB][4], msum[NB][4];
#pragma unroll
    for (int j = 0; j < NB; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            acc[j][e] = 0.0f;
            accm[j][e] = 0.0f;
        }
    // Loader roles: thread tid decodes units (tid & 1) * 4 .. + 3 of tile row tid >> 1, from the
    // raw bytes the whole block first copies into shared memory with consecutive threads on
    // consecutive words (a warp decoding 16 rows straight from global memory touches 16+ lines
    // per load: v7's first version ran at 0.1 TB/s).
    int lr = tid >> 1, lu = (tid & 1) * 4;
    bool lrow_ok = row0 + lr < rows;
    pdl_wait();
    pdl_launch();
    auto issue = [&](int k0, int st) {
        u8* As = stages + st * STG;
        float2* Ds = (float2*)(As + NTOK * MMQ_AS);
        u8* Raw = As + NTOK * MMQ_AS + NTOK * 8 * 8;
        {
            // Bytes [s, s + bytes) of each row: the step's whole blocks.
            int nun = min(units - k0, 8);
            int bytes = (nun + UPB - 1) / UPB * Q<T>::BB;
            long long sb = (long long)(k0 / UPB) * Q<T>::BB;
            constexpr int NW = RAWB / 4;
            for (int i = tid; i < MMQ_BM * NW; i += 128) {
                int r = i / NW, wi = i % NW;
                int gr = row0 + r;
                if (gr >= rows) continue;
                const u8* rs = w + (long long)gr * rb + sb;
                int off = (int)((unsigned long long)rs & 3);
                const u8* a = rs - off + 4 * wi;
                int end = off + bytes;  // span end, relative to the aligned start
                if (4 * wi >= end) continue;
                // Asynchronous copies: every load of the step is in flight at once (plain
                // loads and shared stores through generic pointers were issued one at a time).
                if (4 * wi + 4 <= end) cp_async4(Raw + r * RAWB + 4 * wi, a);
                else *(u32*)(Raw + r * RAWB + 4 * wi) = (u32)ld_u16(a);  // even-sized blocks
            }
        }
        for (int i = tid; i < NTOK * 16; i += 128) {
            int t = i >> 4, ch = i & 15;
            int gt = tok0 + t, u = k0 + (ch >> 1);
            bool ok = gt < n && u < units;
            cp_async16(As + t * MMQ_AS + ch * 16,
                       ok ? (const void*)(aq + (long long)gt * cols + k0 * 32 + ch * 16) : aq,
                       ok ? 16 : 0);
        }
        for (int i = tid; i < NTOK * 8; i += 128) {
            int t = i >> 3, ul = i & 7;
            int gt = tok0 + t, u = k0 + ul;
            bool ok = gt < n && u < units;
            cp_async8(Ds + i, ok ? (const void*)(ad + (long long)gt * units + u) : ad, ok ? 8 : 0);
        }
        cp_async_commit();
    };
    issue(0, 0);
    for (int k0 = 0, it = 0; k0 < units; k0 += 8, it++) {
        int st = it & 1;
        u8* As = stages + st * STG;
        float2* Ds = (float2*)(As + NTOK * MMQ_AS);
        u8* Raw = As + NTOK * MMQ_AS + NTOK * 8 * 8;
        // Every warp has left the previous step (whose stage the next copies overwrite).
        __syncthreads();
        if (k0 + 8 < units) {
            issue(k0 + 8, st ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u8* rraw = Raw + lr * RAWB +
                         (int)((unsigned long long)(w + (long long)min(row0 + lr, rows - 1) * rb +
                                                    (long long)(k0 / UPB) * Q<T>::BB) & 3);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int ul = lu + i, u = k0 + ul;
            int q[8];
            P p;
            if (lrow_ok && u < units) {
                QI<T>::unit(rraw + (u / UPB - k0 / UPB) * Q<T>::BB, u % UPB, q, p);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) q[e] = 0;
                p = P{};
            }
            uint4* dst = (uint4*)(Ws + lr * MMQ_WS + ul * 32);
            dst[0] = make_uint4(q[0], q[1], q[2], q[3]);
            dst[1] = make_uint4(q[4], q[5], q[6], q[7]);
            Ps[lr * 8 + ul] = p;
        }
        __syncthreads();
        int wr0 = warp * 16 + g;  // this thread's two tile rows: wr0 and wr0 + 8
        if constexpr (MODE != 0) {
#pragma unroll
            for (int j = 0; j < NB; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    isum[j][e] = 0;
                    msum[j][e] = 0;
                }
        }
#pragma unroll
        for (int ul = 0; ul < 8; ul++) {
            if (k0 + ul >= units) break;
            u32 a[4];
            a[0] = *(const u32*)(Ws + wr0 * MMQ_WS + ul * 32 + 4 * c);
            a[1] = *(const u32*)(Ws + (wr0 + 8) * MMQ_WS + ul * 32 + 4 * c);
            a[2] = *(const u32*)(Ws + wr0 * MMQ_WS + ul * 32 + 16 + 4 * c);
            a[3] = *(const u32*)(Ws + (wr0 + 8) * MMQ_WS + ul * 32 + 16 + 4 * c);
            P p0 = Ps[wr0 * 8 + ul], p1 = Ps[(wr0 + 8) * 8 + ul];
#pragma unroll
            for (int j = 0; j < NB; j++) {
                const u8* ar = As + (j * 8 + g) * MMQ_AS + ul * 32 + 4 * c;
                u32 b0 = *(const u32*)ar, b1 = *(const u32*)(ar + 16);
                int t0 = j * 8 + 2 * c;
                if constexpr (MODE == 1) {
                    int s[4] = {0, 0, 0, 0};
                    mma_s8_k32(s, a, b0, b1);
                    int bl0, bh0, bl1, bh1;
                    act_bsums(Ds[t0 * 8 + ul], &bl0, &bh0);
                    act_bsums(Ds[(t0 + 1) * 8 + ul], &bl1, &bh1);
                    int B0 = bl0 + bh0, B1 = bl1 + bh1;
                    isum[j][0] += p0.sc * s[0];
                    isum[j][1] += p0.sc * s[1];
                    isum[j][2] += p1.sc * s[2];
                    isum[j][3] += p1.sc * s[3];
                    msum[j][0] += p0.m * B0;
                    msum[j][1] += p0.m * B1;
                    msum[j][2] += p1.m * B0;
                    msum[j][3] += p1.m * B1;
                } else {
                    int s0[4] = {0, 0, 0, 0}, s1[4] = {0, 0, 0, 0};
                    mma_s8_k16(s0, a[0], a[1], b0);
                    mma_s8_k16(s1, a[2], a[3], b1);
                    if constexpr (MODE == 2) {
                        isum[j][0] += p0.s0 * s0[0] + p0.s1 * s1[0];
                        isum[j][1] += p0.s0 * s0[1] + p0.s1 * s1[1];
                        isum[j][2] += p1.s0 * s0[2] + p1.s1 * s1[2];
                        isum[j][3] += p1.s0 * s0[3] + p1.s1 * s1[3];
                    } else {
                        float2 d0 = Ds[t0 * 8 + ul], d1 = Ds[(t0 + 1) * 8 + ul];
                        acc[j][0] += QI<T>::combine(p0, s0[0], s1[0], d0);
                        acc[j][1] += QI<T>::combine(p0, s0[1], s1[1], d1);
                        acc[j][2] += QI<T>::combine(p1, s0[2], s1[2], d0);
                        acc[j][3] += QI<T>::combine(p1, s0[3], s1[3], d1);
                    }
                }
            }
        }
        if constexpr (MODE != 0) {
            // One super-block per step (K-quants: 8 units); its d and dmin are in every unit's P.
            P p0 = Ps[wr0 * 8], p1 = Ps[(wr0 + 8) * 8];
#pragma unroll
            for (int j = 0; j < NB; j++) {
                int t0 = j * 8 + 2 * c;
                float dy0 = Ds[t0 * 8].x, dy1 = Ds[(t0 + 1) * 8].x;
                float m0 = 0.0f, m1 = 0.0f;
                if constexpr (MODE == 1) {
                    m0 = p0.dmin;
                    m1 = p1.dmin;
                }
                mmq_finish<T>(acc[j][0], accm[j][0], isum[j][0], msum[j][0], p0.d, m0, dy0);
                mmq_finish<T>(acc[j][1], accm[j][1], isum[j][1], msum[j][1], p0.d, m0, dy1);
                mmq_finish<T>(acc[j][2], accm[j][2], isum[j][2], msum[j][2], p1.d, m1, dy0);
                mmq_finish<T>(acc[j][3], accm[j][3], isum[j][3], msum[j][3], p1.d, m1, dy1);
            }
        }
    }
    int r0 = row0 + warp * 16 + g;
#pragma unroll
    for (int j = 0; j < NB; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = r0 + (e >> 1) * 8, t = tok0 + j * 8 + 2 * c + (e & 1);
            if (r < rows && t < n) {
                float v = T == T_Q4_K ? acc[j][e] - accm[j][e] : acc[j][e];
                float* o = y + (long long)t * rows + r;
                *o = accumulate ? *o + v : v;
            }
        }
    }
}

#define DEF_MMQ_NB(name, T, NB) \
    extern "C" __global__ void __launch_bounds__(128) mmq_##name##_##NB( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, int n, float* y, \
        int accumulate) { \
        extern __shared__ __align__(16) u8 mmq_sh[]; \
        mmq_impl<T, NB>(w, rows, cols, aq, ad, n, y, accumulate, mmq_sh); \
    }
#define DEF_MMQ(name, T) DEF_MMQ_NB(name, T, 2) DEF_MMQ_NB(name, T, 4) DEF_MMQ_NB(name, T, 8)
FOR_EACH_QTYPE(DEF_MMQ)
