// One-token decode kernels of v9 that need the attention files' helpers (ab_slice, AM_MAXS,
// AM_MC from attn_batch.cu), hence their own file after them.

// attn_merge (attn_batch.cu) for whole 256-element groups of the attention output, quantized in
// the same launch for the output projection's integer product exactly as quantize_act would
// (quant_act_elem over 256 threads: the same bytes). Removes the quantize_act launch between
// the merge and the O product. Block = 256 threads = 256 / hd heads (hd divides 256), thread i
// element i of the block's group: head blockIdx.y * (256 / hd) + i / hd, lane d = i % hd of it.
// Each head's merge takes attn_merge's operations in its order (the maximum over the slices'
// maxima, exp(m - M) per slice, L and A summed in slice order, A / L): the same bits.
// grid = (tokens, n_head * hd / 256); fmt is the O product's activation format.
#define AMQ_MAXH 4
extern "C" __global__ void __launch_bounds__(256) attn_merge_q(
    const float* part, const int* tok_pos, int n_head, int hd, int n_split, int split_len,
    float* out, int fmt, i8* qs, float2* ds) {
    PDL_ENTRY();
    __shared__ float sc[AMQ_MAXH][AM_MAXS], sls[AMQ_MAXH][AM_MAXS], red[8];
    __shared__ float shf[9];
    __shared__ int shi[8];
    int hpb = 256 / hd;
    int t = blockIdx.x, hi = threadIdx.x / hd, d = threadIdx.x % hd;
    int h = blockIdx.y * hpb + hi;
    int len = tok_pos[t] + 1;
    int sl = split_len > 0 ? split_len : ab_slice(len, n_split);
    int ns = min(n_split, (len + sl - 1) / sl);
    int stride = hd + 2;
    const float* pp = part + ((long long)t * n_head + h) * n_split * stride;
    float av[AM_MC];
#pragma unroll
    for (int j = 0; j < AM_MC; j++) av[j] = j < ns ? pp[j * stride + 2 + d] : 0.0f;
    float mx = NEG_INF;
    for (int s = d; s < ns; s += hd) {
        float m = pp[s * stride];
        sc[hi][s] = m;
        sls[hi][s] = pp[s * stride + 1];
        mx = fmaxf(mx, m);
    }
    // A warp never spans two heads (hd is a multiple of 32).
    mx = warp_max(mx);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
    __syncthreads();
    float M = NEG_INF;
    int wph = hd >> 5;
    for (int w = hi * wph; w < (hi + 1) * wph; w++) M = fmaxf(M, red[w]);
    for (int s = d; s < ns; s += hd) sc[hi][s] = sc[hi][s] == NEG_INF ? 0.0f : expf(sc[hi][s] - M);
    __syncthreads();
    float L = 0.0f, A = 0.0f;
    for (int s = 0; s < ns; s++) L += sls[hi][s] * sc[hi][s];
    for (int k0 = 0; k0 < ns; k0 += AM_MC) {
        if (k0 > 0) {
#pragma unroll
            for (int j = 0; j < AM_MC; j++)
                av[j] = k0 + j < ns ? pp[(k0 + j) * stride + 2 + d] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < AM_MC; j++)
            if (k0 + j < ns) A += av[j] * sc[hi][k0 + j];
    }
    float v = A / L;
    long long row = (long long)n_head * hd;
    int c = blockIdx.y * 256 + threadIdx.x;
    out[t * row + c] = v;
    quant_act_elem(v, true, c, fmt, qs + t * row, ds + t * (row / 32), (u16*)0, shf, shi);
}
