// Decode attention for many sequences at once (batched decode steps of 9..64 tokens, one token
// per sequence, each sequence its own length in the paged cache). attn_decode takes one
// 64-position tile per block, so a 64-sequence step launches thousands of short blocks that each
// wait for their loads, then compute, then exit; here a block (t, kvh, s) walks its slice of
// the context tile after tile with the next tile's K and V rows already on their way
// (cp.async into a second shared-memory stage), so the memory system always has work. The
// slice is chosen from the token's own length (n_split = gridDim.z equal parts, whole tiles), so
// a graph captured for the longest context still spreads a short one over every split.
//
// Same arithmetic as attn_decode (query rounded to f16, scale after the dot, unnormalized
// probabilities as f16 into P.V, online softmax per warp, warps merged at the end), and the same
// partial-result format, merged by attn_combine with split_len = 0 (the same slice rule).
// Warp w takes keys 16w..16w+15 of each 64-position tile; V stays row-major in shared memory and
// its mma operand comes through ldmatrix.trans.

#define AB_STAGES 2

// The slice length attn_batch (and attn_combine with split_len 0) gives a token of `len`
// positions over `n_split` splits: equal parts rounded up to whole 64-position tiles.
__device__ __forceinline__ int ab_slice(int len, int n_split) {
    int per = (len + n_split - 1) / n_split;
    return (per + FA_BK - 1) / FA_BK * FA_BK;
}

__device__ __forceinline__ void ldsm_x4_trans(u32* r, const void* smem) {
    u32 s = smem_u32(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// The slices of token t's G heads of KV head kvh merged into merged[t, h*HD + d] by the last of
// the token's `ns` working blocks to arrive (a counter per (token, KV head), reset by that block
// for the next replay), with attn_combine's operations in its order: the maximum over the
// slices, then L and A summed in slice order, A / L (the same bits as attn_combine with
// split_len 0). Loads of MC slices go out together; ld_cg reads the other blocks' slices from
// L2. Every thread of the block calls it after its own slice is written.
template <int HD>
__device__ __forceinline__ void ab_merge_slices(const float* part, float* merged, u32* cnt, int t,
                                                int kvh, int G, int n_head, int n_kv, int n_split,
                                                int ns) {
    __shared__ int last;
    ns = min(n_split, ns);
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
    constexpr int MC = 8;
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

// WP (session 11, attn_batchw_d* / attn_onew_d*): each warp copies the 16 rows of every tile
// it multiplies itself (rows 16w..16w+15, the rows dec_tile_softmax and P.V read for warp w),
// so a warp waits for its own copies and syncs with itself only: no block barrier in the tile
// loop, and the four warps no longer step together. The same rows land in the same places and
// each warp does the same arithmetic in the same order, so the bits are attn_batch's.
//
// EARLY is a template parameter, not a kernel argument (v9): with the one-token path's own-row
// registers in the same function, ptxas gave attn_batch_d4 178 registers instead of v7's 140,
// two blocks per SM instead of three (70 KB of shared memory each), and the many-sequence steps
// lost ~8-11% (docs/perf/cuda.md v9). Each entry point now carries only its own path.
//
// MERGE (v9, attn_batchm_d*): the last block of (token, KV head) to finish merges the slices of
// its G heads into merged[t, h*HD + d] (ab_merge_slices), so steps need no attn_combine launch.
template <int HD, bool EARLY, bool MERGE, bool WP>
__device__ void attn_batch_impl(const float* q, const u16* kc, const u16* vc, const int* tok_pos,
                                const int* tok_seq, const int* btab, int max_blocks, int bt,
                                int n_head, int n_kv, float scale, float* part, u16* sh,
                                float* merged, u32* cnt, float* direct) {
    constexpr int KS = HD + 8, CH = HD / 8;
    constexpr int TILE = FA_BK * KS;  // halves per K (or V) tile
    u16* Ks = sh;                          // [AB_STAGES][FA_BK][KS]
    u16* Vs = sh + AB_STAGES * TILE;       // [AB_STAGES][FA_BK][KS]
    __shared__ float sm[4][8], sl[4][8];
    int t = blockIdx.x, kvh = blockIdx.y, s = blockIdx.z, n_split = gridDim.z;
    int G = n_head / n_kv;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, c = lane & 3;
    int len = tok_pos[t] + 1;
    int slen = ab_slice(len, n_split);
    int p0 = s * slen, p1 = min(len, p0 + slen);
    if (p0 >= len) return;
    const int* bl = btab + (long long)tok_seq[t] * max_blocks;
    long long kv_row = (long long)n_kv * HD;
    int ntiles = (p1 - p0 + FA_BK - 1) / FA_BK;
    // v8 (`early`, one-token steps): every K/V row but the token's own (position len - 1, which
    // the kernel before this one writes) was written by earlier steps, so the first two tiles'
    // copies go out before waiting for that kernel, overlapping its tail; the own row is loaded
    // after the wait and stored into its tile by plain stores (issue() leaves it alone).
    int own = EARLY ? len - 1 : -1;
    // Loader: thread tid copies 16-byte piece (tid % CH) of rows tid / CH + (128 / CH) * j;
    // with WP, lane copies piece (lane % CH) of its warp's rows 16 w + lane / CH + (32 / CH) j.
    constexpr int RSTEP = (WP ? 32 : 128) / CH;
    const int li = WP ? lane : tid, r0 = WP ? warp * 16 : 0;
    // Session 11 (WP; the host takes these forms only for cache blocks of a multiple of 16
    // positions): a warp's 16 rows start at a multiple of 16 (slices and tiles start at
    // multiples of 64), so they lie in one cache block: one block-table lookup and one division
    // per tile instead of one per row (Nsight Compute: integer multiply-adds were 29 % of the
    // kernel's instructions, most of them the per-row `p / bt`, `p % bt` and row products). The
    // same rows land in the same places.
    const int ch_l = li % CH;
    auto issue = [&](int tile, int stage) {
        int base = p0 + tile * FA_BK;
        if (WP) {
            int w0 = base + r0 + li / CH;  // this lane's first row
            int w16 = base + r0;
            long long rb = w16 < p1 ? (long long)bl[w16 / bt] * bt + w16 % bt : 0;
            long long e0 = (rb + li / CH) * kv_row + kvh * HD + ch_l * 8;
            const u16* kp = kc + e0;
            const u16* vp = vc + e0;
            int sd = stage * TILE + (r0 + li / CH) * KS + ch_l * 8;
            const int step = RSTEP * (int)kv_row;
#pragma unroll
            for (int j = 0; j < 16 / RSTEP; j++) {
                int p = w0 + RSTEP * j;
                bool ok = p < p1;
                if (!EARLY || p != own) {
                    cp_async16(Ks + sd, ok ? kp : kc, ok ? 16 : 0);
                    cp_async16(Vs + sd, ok ? vp : vc, ok ? 16 : 0);
                }
                kp += step;
                vp += step;
                sd += RSTEP * KS;
            }
            cp_async_commit();
            return;
        }
#pragma unroll
        for (int j = 0; j < (WP ? 16 : FA_BK) / RSTEP; j++) {
            int pr = r0 + li / CH + RSTEP * j, ch = li % CH;
            int p = base + pr;
            bool ok = p < p1;
            long long row = ok ? (long long)bl[p / bt] * bt + p % bt : 0;
            const u16* ksrc = kc + row * kv_row + kvh * HD + ch * 8;
            const u16* vsrc = vc + row * kv_row + kvh * HD + ch * 8;
            if (!EARLY || p != own) {
                cp_async16(Ks + stage * TILE + pr * KS + ch * 8, ksrc, ok ? 16 : 0);
                cp_async16(Vs + stage * TILE + pr * KS + ch * 8, vsrc, ok ? 16 : 0);
            }
        }
        cp_async_commit();
    };
    if (!EARLY) {
        pdl_wait();
        pdl_launch();
    }
    // Tiles 0 and 1 take stages 0 and 1; tile k + 1 (k >= 1) is issued in iteration k.
    issue(0, 0);
    if (ntiles > 1) issue(1, 1);
    uint4 ownk = make_uint4(0, 0, 0, 0), ownv = ownk;
    int own_tile = -1;
    // The threads that store the own row: the first CH of the block (WP: of the warp whose
    // rows hold it).
    bool own_st = false;
    if (EARLY) {
        PDL_ENTRY_SMALL(PDL_ATTN);
        if (own < p1) {
            own_tile = (own - p0) / FA_BK;
            own_st = WP ? warp == (own - p0) % FA_BK / 16 && lane < CH : tid < CH;
            if (own_st) {
                long long row = (long long)bl[own / bt] * bt + own % bt;
                ownk = *(const uint4*)(kc + row * kv_row + kvh * HD + li * 8);
                ownv = *(const uint4*)(vc + row * kv_row + kvh * HD + li * 8);
            }
        }
    }
    u32 qa[HD / 16][4];
    dec_load_q<HD>(qa, q, t, n_head, kvh, G, g, c);
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = NEG_INF, l0 = 0.0f;
    for (int tile = 0; tile < ntiles; tile++) {
        int stage = tile % AB_STAGES;
        // The next tile's copy goes out before this one is waited for (its stage was last read
        // in the previous iteration, which every warp has left: the barrier at its end).
        if (tile >= 1 && tile + 1 < ntiles) issue(tile + 1, (tile + 1) % AB_STAGES);
        if (tile + 1 < ntiles) cp_async_wait<1>();
        else cp_async_wait<0>();
        const u16* K = Ks + stage * TILE;
        const u16* V = Vs + stage * TILE;
        if (EARLY && tile == own_tile && own_st) {
            int pr = (own - p0) % FA_BK;
            *(uint4*)(Ks + stage * TILE + pr * KS + li * 8) = ownk;
            *(uint4*)(Vs + stage * TILE + pr * KS + li * 8) = ownv;
        }
        if (WP) __syncwarp();
        else __syncthreads();
        int base = p0 + tile * FA_BK;
        u32 pa[4];
        dec_tile_softmax<HD, KS>(qa, K, base, p1, scale, warp, g, c, m0, l0, o, pa);
        // V rows of this warp's 16 keys: lane L addresses key (L / 8 % 2) * 8 + L % 8, dims
        // n0 + (L / 16) * 8, so the four 8x8 matrices come back transposed as the B operands
        // of dims n0..n0+7 (r0, r1) and n0+8..n0+15 (r2, r3).
        const u16* vr = V + (warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * KS + (lane >> 4) * 8;
#pragma unroll
        for (int n = 0; n < HD / 8; n += 2) {
            u32 b[4];
            ldsm_x4_trans(b, vr + n * 8);
            mma_16816(o[n], pa, b[0], b[1]);
            mma_16816(o[n + 1], pa, b[2], b[3]);
        }
        if (WP) __syncwarp();
        else __syncthreads();
    }
    // The warps' results go through shared memory over the K stages: every warp's last read
    // of them comes first (the non-WP loop ends on a block barrier already).
    if (WP) __syncthreads();
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    float* so = (float*)sh;  // [4][8][HD] floats, within the K stages
    // `direct` (one split only): the merged output itself, no attn_combine launch after.
    dec_merge_warps<HD>(so, sm, sl, m0, l0, o, G, warp, g, c, part, t, n_head, kvh, n_split, s,
                        n_split == 1 ? direct : nullptr);
    if (MERGE)
        ab_merge_slices<HD>(part, merged, cnt, t, kvh, G, n_head, n_kv, n_split,
                            (len + slen - 1) / slen);
}

// attn_batch_d*: every step of more than one token (and one-token steps without the early
// copies); attn_one_d*: one-token steps whose first tiles' copies go out before the PDL wait.
// MINB: blocks per SM the registers must allow (the warp-private forms ask for 3, what the
// 70 KB of shared memory per block allows; without it ptxas may take 174 registers, 2 blocks).
#define DEF_ATTN_BATCH(NAME, D, EARLY, WP, MINB) \
    extern "C" __global__ void __launch_bounds__(128, MINB) NAME##_d##D( \
        const float* q, const u16* kc, const u16* vc, const int* tok_pos, const int* tok_seq, \
        const int* btab, int max_blocks, int bt, int n_head, int n_kv, float scale, \
        float* part, float* direct) { \
        extern __shared__ __align__(16) u16 ab_sh[]; \
        attn_batch_impl<32 * D, EARLY, false, WP>(q, kc, vc, tok_pos, tok_seq, btab, max_blocks, \
                                                  bt, n_head, n_kv, scale, part, ab_sh, nullptr, \
                                                  nullptr, direct); \
    }
DEF_ATTN_BATCH(attn_batch, 2, false, false, 1)
DEF_ATTN_BATCH(attn_batch, 4, false, false, 1)
DEF_ATTN_BATCH(attn_one, 2, true, false, 1)
DEF_ATTN_BATCH(attn_one, 4, true, false, 1)
// Session 11: the warp-private loaders (WP above).
DEF_ATTN_BATCH(attn_batchw, 2, false, true, 3)
DEF_ATTN_BATCH(attn_batchw, 4, false, true, 3)
DEF_ATTN_BATCH(attn_onew, 2, true, true, 3)
DEF_ATTN_BATCH(attn_onew, 4, true, true, 3)
// attn_batchm_d*: attn_batch_d* that also merges the slices (cnt: one zeroed u32 per (token,
// KV head), left zeroed).
#define DEF_ATTN_BATCHM(D) \
    extern "C" __global__ void __launch_bounds__(128) attn_batchm_d##D( \
        const float* q, const u16* kc, const u16* vc, const int* tok_pos, const int* tok_seq, \
        const int* btab, int max_blocks, int bt, int n_head, int n_kv, float scale, \
        float* part, float* merged, u32* cnt) { \
        extern __shared__ __align__(16) u16 ab_sh[]; \
        attn_batch_impl<32 * D, false, true, false>(q, kc, vc, tok_pos, tok_seq, btab, max_blocks, bt, \
                                             n_head, n_kv, scale, part, ab_sh, merged, cnt, nullptr); \
    }
DEF_ATTN_BATCHM(2)
DEF_ATTN_BATCHM(4)
// v8: attn_combine's merge, bit for bit (the same maximum, the same products summed in slice
// order, the same division), with its loads issued together: every thread's weighted values of
// up to AM_MC slices and the slices' (max, sum) pairs go out at once, so the merge costs about
// one memory round trip instead of one per 8 slices (attn_combine walks ~33-66 slices at 4K
// context in dependent groups). grid = (tokens, n_head), block = hd threads; n_split <= AM_MAXS.
#define AM_MAXS 1024
#define AM_MC 64
extern "C" __global__ void __launch_bounds__(256) attn_merge(const float* part, const int* tok_pos,
                                                              int n_head, int hd, int n_split,
                                                              int split_len, float* out) {
    PDL_ENTRY();
    __shared__ float sc[AM_MAXS], sls[AM_MAXS], red[8];
    int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    int len = tok_pos[t] + 1;
    int sl = split_len > 0 ? split_len : ab_slice(len, n_split);
    int ns = min(n_split, (len + sl - 1) / sl);
    int stride = hd + 2;
    const float* pp = part + ((long long)t * n_head + h) * n_split * stride;
    float av[AM_MC];
#pragma unroll
    for (int j = 0; j < AM_MC; j++) av[j] = j < ns ? pp[j * stride + 2 + d] : 0.0f;
    float mx = NEG_INF;
    for (int s = d; s < ns; s += blockDim.x) {
        float m = pp[s * stride];
        sc[s] = m;
        sls[s] = pp[s * stride + 1];
        mx = fmaxf(mx, m);
    }
    mx = warp_max(mx);
    if ((d & 31) == 0) red[d >> 5] = mx;
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) M = fmaxf(M, red[w]);
    for (int s = d; s < ns; s += blockDim.x) sc[s] = sc[s] == NEG_INF ? 0.0f : expf(sc[s] - M);
    __syncthreads();
    float L = 0.0f, A = 0.0f;
    for (int s = 0; s < ns; s++) L += sls[s] * sc[s];
    for (int k0 = 0; k0 < ns; k0 += AM_MC) {
        if (k0 > 0) {
#pragma unroll
            for (int j = 0; j < AM_MC; j++)
                av[j] = k0 + j < ns ? pp[(k0 + j) * stride + 2 + d] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < AM_MC; j++)
            if (k0 + j < ns) A += av[j] * sc[k0 + j];
    }
    out[((long long)t * n_head + h) * hd + d] = A / L;
}
