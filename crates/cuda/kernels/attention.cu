// Attention over the paged f16 KV cache, split along the context ("split-K"): block
// (t, kvh, s) handles positions [s*split_len, (s+1)*split_len) of token t's context for the
// G = n_head / n_kv query heads that share key/value head kvh, keeping an online softmax
// (running max m, sum l, weighted sum acc). attn_combine merges the splits. Decode at 4K
// context thus spreads one token's 4096 positions over many blocks, and prefill runs the
// same code with each token's own context length (causal mask = length pos + 1).
//
// The cache row of position p of token t's sequence is
// btab[tok_seq[t] * max_blocks + p / bt] * bt + p % bt.

#define ATT_WARPS 4
#define ATT_MAXG 8

template <int D>  // D = head_dim / 32 elements per lane
__device__ void attn_partial_impl(const float* q, const u16* kc, const u16* vc, const int* tok_pos,
                                  const int* tok_seq, const int* btab, int max_blocks, int bt,
                                  int n_head, int n_kv, float scale, int split_len, float* part) {
    constexpr int HD = 32 * D;
    __shared__ float sm[ATT_WARPS][ATT_MAXG], sl[ATT_WARPS][ATT_MAXG];
    __shared__ float sacc[ATT_WARPS][ATT_MAXG][HD];
    int t = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, n_split = gridDim.z;
    int G = n_head / n_kv;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int len = tok_pos[t] + 1;
    int p0 = s * split_len, p1 = min(len, p0 + split_len);
    // Slices past the context hold nothing: attn_combine reads only the slices that do. (Decode
    // graphs are captured with splits for the longest context, so most are empty early on.)
    if (p0 >= len) return;
    const int* bl = btab + (long long)tok_seq[t] * max_blocks;
    long long kv_row = (long long)n_kv * HD;

    float qv[ATT_MAXG][D], acc[ATT_MAXG][D], m[ATT_MAXG], l[ATT_MAXG];
#pragma unroll
    for (int g = 0; g < ATT_MAXG; g++) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int d = 0; d < D; d++) {
            acc[g][d] = 0.0f;
            // The query is rounded to f16 before meeting the f16 keys, as the CPU backend
            // (and ggml's CPU mul_mat) does; the scale multiplies the finished dot product,
            // as there (not the query).
            qv[g][d] = g < G ? h2f(f2h(q[((long long)t * n_head + kvh * G + g) * HD + lane * D + d])) : 0.0f;
        }
    }
    // Each iteration issues the next position's K/V loads (and its block-table lookup) before
    // computing on the current one, so a warp's walk is not one memory latency per position.
    float kf[D], vf[D], kn[D], vn[D];
    auto load = [&](int p, float* kk, float* vv) {
        long long row = (long long)bl[p / bt] * bt + p % bt;
        const u16* kr = kc + row * kv_row + kvh * HD + lane * D;
        const u16* vr = vc + row * kv_row + kvh * HD + lane * D;
#pragma unroll
        for (int d = 0; d < D; d++) { kk[d] = h2f(kr[d]); vv[d] = h2f(vr[d]); }
    };
    int p = p0 + warp;
    if (p < p1) load(p, kn, vn);
    for (; p < p1; p += ATT_WARPS) {
#pragma unroll
        for (int d = 0; d < D; d++) { kf[d] = kn[d]; vf[d] = vn[d]; }
        if (p + ATT_WARPS < p1) load(p + ATT_WARPS, kn, vn);
#pragma unroll
        for (int g = 0; g < ATT_MAXG; g++) {
            if (g < G) {
                float sc = 0.0f;
#pragma unroll
                for (int d = 0; d < D; d++) sc += qv[g][d] * kf[d];
                sc = warp_sum(sc) * scale;
                float mn = fmaxf(m[g], sc);
                float c = expf(m[g] - mn), e = expf(sc - mn);
                l[g] = l[g] * c + e;
#pragma unroll
                for (int d = 0; d < D; d++) acc[g][d] = acc[g][d] * c + e * vf[d];
                m[g] = mn;
            }
        }
    }
#pragma unroll
    for (int g = 0; g < ATT_MAXG; g++) {
        if (g < G) {
            if (lane == 0) { sm[warp][g] = m[g]; sl[warp][g] = l[g]; }
#pragma unroll
            for (int d = 0; d < D; d++) sacc[warp][g][lane * D + d] = acc[g][d];
        }
    }
    __syncthreads();
    // Merge the warps: thread i handles element i of every head.
    for (int e = threadIdx.x; e < G * HD; e += blockDim.x) {
        int g = e / HD, d = e % HD;
        float M = NEG_INF;
        for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm[w][g]);
        float L = 0.0f, A = 0.0f;
        if (M != NEG_INF) {
            for (int w = 0; w < ATT_WARPS; w++) {
                float c = sm[w][g] == NEG_INF ? 0.0f : expf(sm[w][g] - M);
                L += sl[w][g] * c;
                A += sacc[w][g][d] * c;
            }
        }
        int h = kvh * G + g;
        float* o = part + (((long long)t * n_head + h) * n_split + s) * (HD + 2);
        o[2 + d] = A;
        if (d == 0) { o[0] = M; o[1] = L; }
    }
}

// out[t, h*HD + d] = merge of the partial results of the slices that hold any of token t's
// context (the first ceil(len / split_len) of n_split). grid = (tokens, n_head), block = HD.
// Branch-free and unrolled, so the loads of several slices are in flight at once.
// qfmt != 0: the output rows (n_head * hd wide) are also quantized for the integer products as
// their 256-element groups complete (quant_arrive; qcnt holds one zeroed counter per token and
// group), so the output projection needs no quantization launch.
extern "C" __global__ void attn_combine(const float* part, const int* tok_pos, int n_head, int hd,
                                        int n_split, int split_len, float* out, int qfmt,
                                        u32* qcnt, i8* qso, float2* dso) { PDL_ENTRY();
    int t = blockIdx.x, h = blockIdx.y;
    int len = tok_pos[t] + 1;
    // split_len 0: attn_batch's slices (equal parts of the token's own length, whole 64-tiles).
    int sl = split_len > 0 ? split_len : ((len + n_split - 1) / n_split + 63) / 64 * 64;
    int ns = min(n_split, (len + sl - 1) / sl);
    const float* pp = part + ((long long)t * n_head + h) * n_split * (hd + 2);
    float M = NEG_INF;
#pragma unroll 8
    for (int s = 0; s < ns; s++) M = fmaxf(M, pp[s * (hd + 2)]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float L = 0.0f, A = 0.0f;
#pragma unroll 8
        for (int s = 0; s < ns; s++) {
            float ms = pp[s * (hd + 2)];
            float c = ms == NEG_INF ? 0.0f : expf(ms - M);
            L += pp[s * (hd + 2) + 1] * c;
            A += pp[s * (hd + 2) + 2 + d] * c;
        }
        out[((long long)t * n_head + h) * hd + d] = A / L;
    }
    if (qfmt) {
        __threadfence();
        // hd divides 256 or 256 divides hd: a head's elements lie in one group, or span whole ones.
        int n = n_head * hd, groups = (n + 255) / 256;
        __syncthreads();
        if (threadIdx.x >= 32) return;
        const float* row = out + (long long)t * n;
        i8* qr = qso + (long long)t * n;
        float2* dr = dso + (long long)t * (n / 32);
        for (int c = h * hd; c < (h + 1) * hd; c += 256) {
            int g = c >> 8;
            int gsize = min(256, n - g * 256);
            quant_arrive(row, n, g, gsize, min(hd, 256), qfmt, qcnt + (long long)t * groups + g,
                         qr, dr);
        }
    }
}

#define DEF_ATTN(D) \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attn_partial_d##D( \
        const float* q, const u16* kc, const u16* vc, const int* tok_pos, const int* tok_seq, \
        const int* btab, int max_blocks, int bt, int n_head, int n_kv, float scale, int split_len, \
        float* part) { PDL_ENTRY(); \
        attn_partial_impl<D>(q, kc, vc, tok_pos, tok_seq, btab, max_blocks, bt, n_head, n_kv, \
                             scale, split_len, part); \
    }
DEF_ATTN(2)
DEF_ATTN(3)
DEF_ATTN(4)
DEF_ATTN(8)

// ---------------------------------------------------------------------------------------------
// Prefill attention on the tensor cores (mma.sync m16n8k16, f16 in, f32 accumulate), one launch
// per sequence chunk of T tokens at positions p0 .. p0+T-1 whose keys/values (earlier positions
// included) are already in the paged cache. Block (tile, h): 64 queries of head h, 4 warps of 16
// rows; the context walks in tiles of 64 positions (K rows, and V transposed, in shared memory)
// with an online softmax per row, as flash attention does. The query is rounded to f16 and the
// scale multiplies the finished dot product, as on the CPU; the probabilities meet V as f16
// (the CPU rounds the normalized ones to f16; here the not-yet-normalized ones are rounded).
// grid = (ceil(T / 64), n_head), block = 128. out[t0 + i, h*HD + d], token-major like attn_combine.
#define FA_BQ 64
#define FA_BK 64

__device__ __forceinline__ u32 pack_h2(float a, float b) {
    return (u32)f2h(a) | ((u32)f2h(b) << 16);
}

// d += a * b for one m16n8k16 tile: a row-major 16x16 f16, b column-major 16x8 f16, d 16x8 f32.
__device__ __forceinline__ void mma_16816(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int HD>
__device__ void attn_prefill_impl(const float* q, const u16* kc, const u16* vc, const int* bl,
                                  int bt, int t0, int T, int p0, int n_head, int n_kv,
                                  float scale, float* out) {
    constexpr int KS = HD + 8;     // K row stride in halves (the pad spreads a warp's banks)
    constexpr int VS = FA_BK + 8;  // V^T row stride
    constexpr int CH = HD / 8;     // 16-byte pieces per K/V row
    __shared__ __align__(16) u16 Ks[FA_BK * KS];
    __shared__ __align__(16) u16 Vt[HD * VS];
    // Heaviest tiles (latest queries, longest context) first.
    int tile = gridDim.x - 1 - blockIdx.x;
    int h = blockIdx.y, kvh = h / (n_head / n_kv);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, c = lane & 3;
    int q0 = tile * FA_BQ;
    int last = min(T, q0 + FA_BQ) - 1;
    int kmax = p0 + last;
    // This thread's two rows (rows past the chunk repeat its last token and are not written).
    int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    int qp0 = p0 + min(r0, last), qp1 = p0 + min(r1, last);
    u32 qa[HD / 16][4];
    {
        const float* qr0 = q + ((long long)(t0 + min(r0, last)) * n_head + h) * HD + 2 * c;
        const float* qr1 = q + ((long long)(t0 + min(r1, last)) * n_head + h) * HD + 2 * c;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            float2 a = *(const float2*)(qr0 + kk * 16), b = *(const float2*)(qr1 + kk * 16);
            float2 a8 = *(const float2*)(qr0 + kk * 16 + 8), b8 = *(const float2*)(qr1 + kk * 16 + 8);
            qa[kk][0] = pack_h2(a.x, a.y);
            qa[kk][1] = pack_h2(b.x, b.y);
            qa[kk][2] = pack_h2(a8.x, a8.y);
            qa[kk][3] = pack_h2(b8.x, b8.y);
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    long long kv_row = (long long)n_kv * HD;
    int nkt = kmax / FA_BK + 1;
    for (int kt = 0; kt < nkt; kt++) {
        __syncthreads();
        // K: 16 lanes read one row's 256 contiguous bytes. V: lanes take consecutive positions,
        // so the transposed stores to Vt are consecutive halves. Positions past kmax are zero
        // (never NaN: a masked probability of 0 times a NaN would still poison the sum).
        for (int i = threadIdx.x; i < FA_BK * CH; i += 128) {
            int pr = i / CH, ch = i % CH;
            int p = kt * FA_BK + pr;
            uint4 kv = make_uint4(0, 0, 0, 0);
            if (p <= kmax) {
                long long row = (long long)bl[p / bt] * bt + p % bt;
                kv = *(const uint4*)(kc + row * kv_row + kvh * HD + ch * 8);
            }
            *(uint4*)(Ks + pr * KS + ch * 8) = kv;
        }
        for (int i = threadIdx.x; i < FA_BK * CH; i += 128) {
            int pr = i % FA_BK, ch = i / FA_BK;
            int p = kt * FA_BK + pr;
            uint4 vv = make_uint4(0, 0, 0, 0);
            if (p <= kmax) {
                long long row = (long long)bl[p / bt] * bt + p % bt;
                vv = *(const uint4*)(vc + row * kv_row + kvh * HD + ch * 8);
            }
            u32 w[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int e = 0; e < 8; e++)
                Vt[(ch * 8 + e) * VS + pr] = (u16)(w[e >> 1] >> ((e & 1) * 16));
        }
        __syncthreads();
        float s[FA_BK / 8][4];
#pragma unroll
        for (int j = 0; j < FA_BK / 8; j++) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            const u16* kr = Ks + (j * 8 + g) * KS + 2 * c;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++)
                mma_16816(s[j], qa[kk], *(const u32*)(kr + kk * 16), *(const u32*)(kr + kk * 16 + 8));
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int j = 0; j < FA_BK / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int kp = kt * FA_BK + j * 8 + 2 * c + e;
                s[j][e] = kp <= qp0 ? s[j][e] * scale : NEG_INF;
                s[j][2 + e] = kp <= qp1 ? s[j][2 + e] * scale : NEG_INF;
                mx0 = fmaxf(mx0, s[j][e]);
                mx1 = fmaxf(mx1, s[j][2 + e]);
            }
        }
#pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
        }
        // Key 0 is in every row's context, so mx is finite from the first tile on.
        float c0 = expf(m0 - mx0), c1 = expf(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
        }
        u32 pa[FA_BK / 16][4];
#pragma unroll
        for (int j = 0; j < FA_BK / 8; j++) {
            float e0 = expf(s[j][0] - m0), e1 = expf(s[j][1] - m0);
            float e2 = expf(s[j][2] - m1), e3 = expf(s[j][3] - m1);
            l0 += e0 + e1;
            l1 += e2 + e3;
            pa[j >> 1][(j & 1) * 2] = pack_h2(e0, e1);
            pa[j >> 1][(j & 1) * 2 + 1] = pack_h2(e2, e3);
        }
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            const u16* vr = Vt + (n * 8 + g) * VS + 2 * c;
#pragma unroll
            for (int kk = 0; kk < FA_BK / 16; kk++)
                mma_16816(o[n], pa[kk], *(const u32*)(vr + kk * 16), *(const u32*)(vr + kk * 16 + 8));
        }
    }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    float i0 = 1.0f / l0, i1 = 1.0f / l1;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        if (r0 <= last)
            *(float2*)(out + ((long long)(t0 + r0) * n_head + h) * HD + n * 8 + 2 * c) =
                make_float2(o[n][0] * i0, o[n][1] * i0);
        if (r1 <= last)
            *(float2*)(out + ((long long)(t0 + r1) * n_head + h) * HD + n * 8 + 2 * c) =
                make_float2(o[n][2] * i1, o[n][3] * i1);
    }
}

#define DEF_ATTN_PREFILL(D) \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_d##D( \
        const float* q, const u16* kc, const u16* vc, const int* bl, int bt, int t0, int T, \
        int p0, int n_head, int n_kv, float scale, float* out) { PDL_ENTRY(); \
        attn_prefill_impl<32 * D>(q, kc, vc, bl, bt, t0, T, p0, n_head, n_kv, scale, out); \
    }
DEF_ATTN_PREFILL(2)
DEF_ATTN_PREFILL(4)

// ---------------------------------------------------------------------------------------------
// Split-K attention on the tensor cores for decode-like steps: block (t, kvh, s) takes the
// G = n_head / n_kv query heads of token t that share KV head kvh as the rows of one 16-row
// mma tile (rows >= G are zero) and positions [s*split_len, (s+1)*split_len) of its context in
// tiles of 64 (K rows and V transposed in shared memory, as attn_prefill); warp w takes keys
// 16w..16w+15 of each tile with its own online softmax, the four warps merge at the end and
// write the same partial result (max, sum, weighted sum) attn_partial writes, so attn_combine
// merges the splits unchanged. Each K/V row is read once for all G heads. Same rounding as
// attn_prefill (query f16, scale after the dot, unnormalized probabilities as f16 into PV).
// Pieces shared by the split decode attention kernels (attn_decode here, attn_batch in
// attn_batch.cu): four warps per block, each taking 16 keys of a 64-key tile, the G query heads
// of one KV head as the rows of the m16n8k16 products (rows past G are zero).

// Four 8x8 b16 matrices from shared memory (lanes 8m..8m+7 give matrix m's row addresses).
__device__ __forceinline__ void ldsm_x4(u32* r, const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(smem)));
}

// The G query heads of KV head `kvh` for token `t`, as f16 A fragments of Q . K^T.
template <int HD>
__device__ __forceinline__ void dec_load_q(u32 (&qa)[HD / 16][4], const float* q, int t, int n_head,
                                           int kvh, int G, int g, int c) {
    bool real = g < G;
    const float* qr = q + ((long long)t * n_head + kvh * G + (real ? g : 0)) * HD + 2 * c;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        float2 a = real ? *(const float2*)(qr + kk * 16) : make_float2(0.0f, 0.0f);
        float2 a8 = real ? *(const float2*)(qr + kk * 16 + 8) : make_float2(0.0f, 0.0f);
        qa[kk][0] = pack_h2(a.x, a.y);
        qa[kk][1] = 0u;
        qa[kk][2] = pack_h2(a8.x, a8.y);
        qa[kk][3] = 0u;
    }
}

// One warp's 16 keys of the tile starting at position `base` (K rows in shared memory, row
// stride KS): two n8 tiles of S, masked from p1 on and scaled, the online-softmax update of
// (m0, l0, o), and the probabilities packed as the A operand of P . V.
template <int HD, int KS>
__device__ __forceinline__ void dec_tile_softmax(const u32 (&qa)[HD / 16][4], const u16* K, int base,
                                                 int p1, float scale, int warp, int g, int c,
                                                 float& m0, float& l0, float (&o)[HD / 8][4],
                                                 u32 (&pa)[4]) {
    float sc[2][4];
    // v11: the K operands by ldmatrix, two k-steps per instruction (lane L names row L % 8 of
    // matrix L / 8: dims +0, +8 of this k-step, +0, +8 of the next), the same registers the
    // 32-bit loads of K[g][2c..] gave before: the same products in the same order.
    int lane = g * 4 + c;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
        const u16* kr = K + (warp * 16 + j * 8 + (lane & 7)) * KS + (lane >> 3) * 8;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk += 2) {
            u32 b[4];
            ldsm_x4(b, kr + kk * 16);
            mma_16816(sc[j], qa[kk], b[0], b[1]);
            mma_16816(sc[j], qa[kk + 1], b[2], b[3]);
        }
    }
    float mx = m0;
#pragma unroll
    for (int j = 0; j < 2; j++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int p = base + warp * 16 + j * 8 + 2 * c + e;
            sc[j][e] = p < p1 ? sc[j][e] * scale : NEG_INF;
            mx = fmaxf(mx, sc[j][e]);
        }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // A warp whose keys so far are all past the slice has nothing to add yet.
    float cr = mx == NEG_INF ? 1.0f : expf(m0 - mx);
    m0 = mx;
    l0 *= cr;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        o[n][0] *= cr;
        o[n][1] *= cr;
    }
    float e[2][2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
#pragma unroll
        for (int x = 0; x < 2; x++) {
            e[j][x] = mx == NEG_INF ? 0.0f : expf(sc[j][x] - mx);
            l0 += e[j][x];
        }
    }
    pa[0] = pack_h2(e[0][0], e[0][1]);
    pa[1] = 0u;
    pa[2] = pack_h2(e[1][0], e[1][1]);
    pa[3] = 0u;
}

// The four warps' (m, l, o) of the G heads merged through shared memory `so` ([4][8][HD]
// floats; the caller has synchronized after its last read of that space) into this split's
// slice of `part`: [m, l, o[0..HD]] per (token, head, split).
template <int HD>
__device__ __forceinline__ void dec_merge_warps(float* so, float (&sm)[4][8], float (&sl)[4][8],
                                                float m0, float l0, const float (&o)[HD / 8][4],
                                                int G, int warp, int g, int c, float* part, int t,
                                                int n_head, int kvh, int n_split, int s,
                                                float* direct = nullptr) {
    if (g < G) {
        if (c == 0) { sm[warp][g] = m0; sl[warp][g] = l0; }
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            so[(warp * 8 + g) * HD + n * 8 + 2 * c] = o[n][0];
            so[(warp * 8 + g) * HD + n * 8 + 2 * c + 1] = o[n][1];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * HD; e += blockDim.x) {
        int r = e / HD, d = e % HD;
        float M = NEG_INF;
        for (int w = 0; w < 4; w++) M = fmaxf(M, sm[w][r]);
        float L = 0.0f, A = 0.0f;
        for (int w = 0; w < 4; w++) {
            float cw = sm[w][r] == NEG_INF ? 0.0f : expf(sm[w][r] - M);
            L += sl[w][r] * cw;
            A += so[(w * 8 + r) * HD + d] * cw;
        }
        if (direct) {
            // Session 11 (one split): attn_combine's operations on this one slice, in its order
            // (weight exp(M - M), sums from 0, A / L), so the same bits without its launch.
            float cw = M == NEG_INF ? 0.0f : expf(M - M);
            float Lc = 0.0f, Ac = 0.0f;
            Lc += L * cw;
            Ac += A * cw;
            direct[((long long)t * n_head + kvh * G + r) * HD + d] = Ac / Lc;
            continue;
        }
        float* out = part + (((long long)t * n_head + kvh * G + r) * n_split + s) * (HD + 2);
        out[2 + d] = A;
        if (d == 0) { out[0] = M; out[1] = L; }
    }
}

template <int HD>
__device__ void attn_decode_impl(const float* q, const u16* kc, const u16* vc, const int* tok_pos,
                                 const int* tok_seq, const int* btab, int max_blocks, int bt,
                                 int n_head, int n_kv, float scale, int split_len, float* part,
                                 float* merged, u32* cnt) {
    constexpr int KS = HD + 8, VS = FA_BK + 8, CH = HD / 8;
    __shared__ __align__(16) u16 Ks[FA_BK * KS];
    __shared__ __align__(16) u16 Vt[HD * VS];
    __shared__ float sm[4][8], sl[4][8];
    int t = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, n_split = gridDim.z;
    int G = n_head / n_kv;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, c = lane & 3;
    int len = tok_pos[t] + 1;
    int p0 = s * split_len, p1 = min(len, p0 + split_len);
    if (p0 >= len) return;
    const int* bl = btab + (long long)tok_seq[t] * max_blocks;
    long long kv_row = (long long)n_kv * HD;
    u32 qa[HD / 16][4];
    dec_load_q<HD>(qa, q, t, n_head, kvh, G, g, c);
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = NEG_INF, l0 = 0.0f;
    constexpr int LD = FA_BK * CH / 128;  // 16-byte loads of K (and of V) per thread per tile
    for (int base = p0; base < p1; base += FA_BK) {
        // v7: every K and V load of the tile is issued before the first is stored (one memory
        // round trip per tile, not one per loop).
        uint4 kr[LD], vr[LD];
#pragma unroll
        for (int k = 0; k < LD; k++) {
            int i = threadIdx.x + k * 128;
            int pk = base + i / CH, pv = base + i % FA_BK;
            kr[k] = make_uint4(0, 0, 0, 0);
            vr[k] = make_uint4(0, 0, 0, 0);
            if (pk < p1) {
                long long row = (long long)bl[pk / bt] * bt + pk % bt;
                kr[k] = *(const uint4*)(kc + row * kv_row + kvh * HD + (i % CH) * 8);
            }
            if (pv < p1) {
                long long row = (long long)bl[pv / bt] * bt + pv % bt;
                vr[k] = *(const uint4*)(vc + row * kv_row + kvh * HD + (i / FA_BK) * 8);
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < LD; k++) {
            int i = threadIdx.x + k * 128;
            *(uint4*)(Ks + (i / CH) * KS + (i % CH) * 8) = kr[k];
            int pr = i % FA_BK, ch = i / FA_BK;
            u32 w[4] = {vr[k].x, vr[k].y, vr[k].z, vr[k].w};
#pragma unroll
            for (int e = 0; e < 8; e++)
                Vt[(ch * 8 + e) * VS + pr] = (u16)(w[e >> 1] >> ((e & 1) * 16));
        }
        __syncthreads();
        u32 pa[4];
        dec_tile_softmax<HD, KS>(qa, Ks, base, p1, scale, warp, g, c, m0, l0, o, pa);
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            const u16* vr = Vt + (n * 8 + g) * VS + warp * 16 + 2 * c;
            mma_16816(o[n], pa, *(const u32*)vr, *(const u32*)(vr + 8));
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    // Merge the warps through shared memory (the K tile's space, no longer needed).
    __syncthreads();
    float* so = (float*)Ks;  // [4][8][HD] floats = 4 * 8 * HD * 4 bytes <= sizeof(Ks)
    dec_merge_warps<HD>(so, sm, sl, m0, l0, o, G, warp, g, c, part, t, n_head, kvh, n_split, s);
    if (!merged) return;
    // v7: the last block of (t, kvh) to finish merges the slices of its G heads into
    // merged[t, h*HD + d] with attn_combine's operations in attn_combine's order (same bits),
    // so the merge needs no launch; it resets the counter for the next graph replay.
    __shared__ int last;
    int ns = min(n_split, (len + split_len - 1) / split_len);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* cp = cnt + (long long)t * n_kv + kvh;
        u32 old = atomicAdd(cp, 1u);
        last = old + 1 == (u32)ns;
        if (last) *cp = 0u;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Slices in chunks of MC, each chunk's loads issued together (the sums still run in slice
    // order: attn_combine's bits).
    constexpr int MC = 16;
    for (int e = threadIdx.x; e < G * HD; e += blockDim.x) {
        int r = e / HD, d = e % HD, h = kvh * G + r;
        const float* pp = part + ((long long)t * n_head + h) * n_split * (HD + 2);
        float M = NEG_INF;
        for (int k0 = 0; k0 < ns; k0 += MC) {
            float mv[MC];
#pragma unroll
            for (int j = 0; j < MC; j++)
                mv[j] = k0 + j < ns ? ld_cg(pp + (k0 + j) * (HD + 2)) : NEG_INF;
#pragma unroll
            for (int j = 0; j < MC; j++) M = fmaxf(M, mv[j]);
        }
        float L = 0.0f, A = 0.0f;
        for (int k0 = 0; k0 < ns; k0 += MC) {
            float mv[MC], lv[MC], av[MC];
#pragma unroll
            for (int j = 0; j < MC; j++) {
                const float* ps = pp + (k0 + j) * (HD + 2);
                bool ok = k0 + j < ns;
                mv[j] = ok ? ld_cg(ps) : NEG_INF;
                lv[j] = ok ? ld_cg(ps + 1) : 0.0f;
                av[j] = ok ? ld_cg(ps + 2 + d) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < MC; j++) {
                if (k0 + j < ns) {
                    float c = mv[j] == NEG_INF ? 0.0f : expf(mv[j] - M);
                    L += lv[j] * c;
                    A += av[j] * c;
                }
            }
        }
        merged[((long long)t * n_head + h) * HD + d] = A / L;
    }
}

#define DEF_ATTN_DECODE(D) \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_d##D( \
        const float* q, const u16* kc, const u16* vc, const int* tok_pos, const int* tok_seq, \
        const int* btab, int max_blocks, int bt, int n_head, int n_kv, float scale, int split_len, \
        float* part, float* merged, u32* cnt) { PDL_ENTRY(); \
        attn_decode_impl<32 * D>(q, kc, vc, tok_pos, tok_seq, btab, max_blocks, bt, n_head, n_kv, \
                                 scale, split_len, part, merged, cnt); \
    }
DEF_ATTN_DECODE(2)
DEF_ATTN_DECODE(4)
