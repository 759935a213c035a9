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
extern "C" __global__ void attn_combine(const float* part, const int* tok_pos, int n_head, int hd,
                                        int n_split, int split_len, float* out) {
    int t = blockIdx.x, h = blockIdx.y;
    int len = tok_pos[t] + 1;
    int ns = min(n_split, (len + split_len - 1) / split_len);
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
}

#define DEF_ATTN(D) \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attn_partial_d##D( \
        const float* q, const u16* kc, const u16* vc, const int* tok_pos, const int* tok_seq, \
        const int* btab, int max_blocks, int bt, int n_head, int n_kv, float scale, int split_len, \
        float* part) { \
        attn_partial_impl<D>(q, kc, vc, tok_pos, tok_seq, btab, max_blocks, bt, n_head, n_kv, \
                             scale, split_len, part); \
    }
DEF_ATTN(2)
DEF_ATTN(3)
DEF_ATTN(4)
DEF_ATTN(8)
