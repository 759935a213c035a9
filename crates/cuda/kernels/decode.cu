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
    PDL_ENTRY_SMALL(PDL_MERGE);
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

// v11: RMSNorm (with the integer products' quantization) of one row for one-token steps, a
// block of one warp per 256-element group: no block barrier. Each warp sums the whole row's
// squares itself in exactly rms_scale's order at 256 threads: lane l stands for threads
// l + 32 w (w < 8), each summing x[t + 256 i]^2 over i in order; then warp w's butterfly over
// its 32 threads (the same shuffles), then block_sum_d's second butterfly over the 8 warp sums
// (with its zero lanes, which add exactly). So the scale, the normalized values and (through
// quant8_warp, the same bytes as quant_act_elem) the quantized row are rms_norm's, bit for bit.
// The ncu timeline of session 9 put rms_norm at 4.1 us per launch alone and ~2.9 us inside the
// captured step (quantize_act: 2.7 / ~1.0). n: a multiple of 256, at most RMS1_MAX.
// grid = n / 256, blockDim.x = 32.
#define RMS1_MAX 4096

// The one-row RMSNorms' tail (rms_norm1, rms_norm1s): the lane's 8 elements at c0 (x in xa, xb,
// the norm weights in wa, wb) times the row's scale, then the weight (cpu::ops::rms_norm's two
// products), to `out` (may be null), quantized in `fmt` (with f16(d q) to out_h, may be null)
// or, with fmt 0, converted to f16 into out_h (may be null). Called by every lane of the warp.
__device__ __forceinline__ void rms1_tail(float4 xa, float4 xb, float4 wa, float4 wb, int c0,
                                          float scale, float* out, u16* out_h, int fmt, i8* qs,
                                          float2* ds) {
    float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    float wv[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
    float o[8];
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = __fmul_rn(__fmul_rn(xv[i], scale), wv[i]);
    if (out) {
        *(float4*)(out + c0) = make_float4(o[0], o[1], o[2], o[3]);
        *(float4*)(out + c0 + 4) = make_float4(o[4], o[5], o[6], o[7]);
    }
    if (fmt) {
        quant8_warp(o, true, c0, fmt, qs, ds, out_h);
    } else if (out_h) {
        u32 h[4];
#pragma unroll
        for (int i = 0; i < 4; i++) h[i] = (u32)f2h(o[2 * i]) | ((u32)f2h(o[2 * i + 1]) << 16);
        *(uint4*)(out_h + c0) = make_uint4(h[0], h[1], h[2], h[3]);
    }
}
extern "C" __global__ void __launch_bounds__(32) rms_norm1(const float* x, const float* w, int n,
                                                           float eps, float* out, u16* out_h,
                                                           int fmt, i8* qs, float2* ds) {
    int lane = threadIdx.x;
    int c0 = blockIdx.x * 256 + lane * 8;
    // The lane's 8 norm weights (a constant) before the wait.
    float4 wa = *(const float4*)(w + c0), wb = *(const float4*)(w + c0 + 4);
    PDL_ENTRY_SMALL(PDL_RMS);
    int reps = n / 256;  // rms_scale's i range at 256 threads
    double p[8];
#pragma unroll
    for (int t = 0; t < 8; t++) p[t] = 0.0;
    float v[RMS1_MAX / 32];
#pragma unroll
    for (int k = 0; k < RMS1_MAX / 32; k++)
        if (k < 8 * reps) v[k] = x[lane + 32 * k];
#pragma unroll
    for (int i = 0; i < RMS1_MAX / 256; i++) {
        if (i < reps) {
#pragma unroll
            for (int t = 0; t < 8; t++) p[t] += (double)v[8 * i + t] * (double)v[8 * i + t];
        }
    }
#pragma unroll
    for (int t = 0; t < 8; t++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) p[t] += __shfl_xor_sync(0xffffffffu, p[t], o);
    }
    // block_sum_d's second stage: lanes 0..7 hold the 8 warp sums, the rest 0.0; offsets 16 and
    // 8 only add zeros, then the butterfly over 4, 2, 1 (addition commutes, so every lane's sum
    // is lane 0's).
    double a0 = p[0] + p[4], a1 = p[1] + p[5], a2 = p[2] + p[6], a3 = p[3] + p[7];
    double b0 = a0 + a2, b1 = a1 + a3;
    double s = b0 + b1;
    float mean = (float)(s / (double)n);
    float scale = 1.0f / sqrtf(mean + eps);
    float4 xa = *(const float4*)(x + c0), xb = *(const float4*)(x + c0 + 4);
    rms1_tail(xa, xb, wa, wb, c0, scale, out, out_h, fmt, qs, ds);
}

// Session 34: rms_norm's one-row form from the products' slot sums (`ss`, RMS_SLOTS doubles;
// session 16) as one warp per 256-element group: rms_norm's block of 256 threads per group
// quantizes with three block barriers (quant_act_elem), this warp with shuffles only
// (quant8_warp: the same bytes). Each warp sums the slots as rms_norm does (ss_load and
// ss_scale, the same code), so the scale, the normalized values (`out`, may be null) and the
// quantized row are rms_norm's, bit for bit; fmt may carry ACT_PERM (Q8_K). Block 0 zeroes the
// other slot set `ssz` (may be null) for the next product, as rms_norm's block (0, 0) does.
// The lane's 8 norm weights (a constant) are loaded before the wait. n: a multiple of 256.
// grid = n / 256, blockDim.x = 32.
extern "C" __global__ void __launch_bounds__(32) rms_norm1s(const float* x, const float* w, int n,
                                                            float eps, float* out, int fmt,
                                                            i8* qs, float2* ds, const double* ss,
                                                            double* ssz) {
    int lane = threadIdx.x;
    int c0 = blockIdx.x * 256 + lane * 8;
    float4 wa = *(const float4*)(w + c0), wb = *(const float4*)(w + c0 + 4);
    PDL_ENTRY_SMALL((fmt & ACT_PERM) ? PDL_RMS_FFN : PDL_RMS);
    double p[RMS_SLOTS / 32];
    ss_load(ss, p);
    float4 xa = *(const float4*)(x + c0), xb = *(const float4*)(x + c0 + 4);
    float scale = ss_scale(p, n, eps);
    if (ssz && blockIdx.x == 0) {
#pragma unroll
        for (int k = 0; k < RMS_SLOTS / 32; k++) ssz[lane + 32 * k] = 0.0;
    }
    rms1_tail(xa, xb, wa, wb, c0, scale, out, (u16*)0, fmt, qs, ds);
}

// Session 35: quantize_act of one row as one warp per 256-element group (quant8_warp: the same
// bytes, shuffles instead of quant_act_elem's three block barriers), so the launch's body is
// shorter where its successor was launched early (PDL_QUANT) and waits on it alone.
// n: a multiple of 256. grid = n / 256, blockDim.x = 32.
extern "C" __global__ void __launch_bounds__(32) quantize_act1(const float* x, int n, int fmt,
                                                               i8* qs, float2* ds) {
    PDL_ENTRY_SMALL(PDL_QUANT);
    int c0 = blockIdx.x * 256 + threadIdx.x * 8;
    float4 a = *(const float4*)(x + c0), b = *(const float4*)(x + c0 + 4);
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    quant8_warp(v, true, c0, fmt, qs, ds, (u16*)0);
}

// v11: greedy argmax of each row (the lowest index among equals; NaN never wins) in one launch
// of gridDim.y blocks per row instead of argmax_rows' single block, whose 1024 threads each
// walked ~125 logits one dependent round trip after another (47 us for 128,256 logits in the
// ncu timeline of session 9). Block (r, b) takes columns [b per, (b + 1) per), each thread 4
// loads in flight at a time, writes its best (value, index) to pv / pi, and the block that
// arrives last at the row's counter (cnt, zero between launches: it resets it) reduces the
// row's gridDim.y partials. grid = (rows, P), blockDim.x = 256.
extern "C" __global__ void __launch_bounds__(256) argmax_mb(const float* x, int n, int per,
                                                            float* pv, int* pi, u32* cnt,
                                                            int* out) {
    PDL_ENTRY();
    __shared__ float sv[8];
    __shared__ int si[8];
    __shared__ int last;
    int row = blockIdx.x, P = gridDim.y, b = blockIdx.y;
    const float* r = x + (long long)row * n;
    int c1 = min(n, (b + 1) * per);
    float best = NEG_INF;
    int bi = n;
    for (int c = b * per + threadIdx.x; c < c1; c += 4 * 256) {
        float v[4];
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = c + 256 * k < c1 ? r[c + 256 * k] : NEG_INF;
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (c + 256 * k < c1 && v[k] > best) { best = v[k]; bi = c + 256 * k; }
    }
    warp_argmax(best, bi);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < 8; k++)
            argmax_take(best, bi, sv[k], si[k]);
        pv[row * P + b] = best;
        pi[row * P + b] = bi;
        __threadfence();
        last = atomicAdd(&cnt[row], 1u) == (u32)(P - 1);
    }
    __syncthreads();
    if (!last || warp != 0) return;
    __threadfence();
    best = NEG_INF;
    bi = n;
    for (int k = lane; k < P; k += 32) {
        float ov = ld_cg(pv + row * P + k);
        int oi = __float_as_int(ld_cg((const float*)(pi + row * P + k)));
        argmax_take(best, bi, ov, oi);
    }
    warp_argmax(best, bi);
    if (lane == 0) {
        out[row] = bi < n ? bi : 0;
        cnt[row] = 0;
    }
}

// Session 21: the k best logits of each row (top-k sampling without copying the rows back),
// in runtime::sampling::top_k's order: descending logit, the lower id first among equals, NaN
// as -inf, +0 above -0 (Rust's total order). Each (logit, id) is one u64 key whose descending
// order is that order: the logit's bits made order-preserving in the high word, ~id in the
// low word. topk_slice: block (s, row) sorts the keys of slice s (`slice` logits, a power of
// two; past the row end key 0, below every real key) descending in shared memory (bitonic)
// and writes its best k; topk_merge: block row sorts the S * k keys of its slices (`m`, a
// power of two >= S * k, padded with 0) and writes the row's k best keys, which the host
// decodes (topk_key_id / topk_key_logit in kernels.rs). Dynamic shared memory: slice * 8 and
// m * 8 bytes.
__device__ __forceinline__ unsigned long long topk_key(float v, int id) {
    if (isnan(v)) v = NEG_INF;
    u32 b = __float_as_uint(v);
    u32 o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)o << 32) | (unsigned long long)(0xffffffffu - (u32)id);
}

// Bitonic sort of s[0..m) (m a power of two) into descending order by the block's threads.
__device__ void topk_sort_desc(unsigned long long* s, int m) {
    for (int k = 2; k <= m; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < m; i += blockDim.x) {
                int ixj = i ^ j;
                if (ixj > i) {
                    unsigned long long a = s[i], b = s[ixj];
                    bool desc = (i & k) == 0;
                    if (desc ? (a < b) : (a > b)) {
                        s[i] = b;
                        s[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void topk_slice(const float* x, int n, int slice, int k,
                                      unsigned long long* part) { PDL_ENTRY();
    extern __shared__ unsigned long long tks[];
    int s = blockIdx.x, row = blockIdx.y, ns = gridDim.x;
    const float* xr = x + (long long)row * n;
    int base = s * slice;
    for (int i = threadIdx.x; i < slice; i += blockDim.x) {
        int c = base + i;
        tks[i] = c < n ? topk_key(xr[c], c) : 0ull;
    }
    __syncthreads();
    topk_sort_desc(tks, slice);
    unsigned long long* o = part + ((long long)row * ns + s) * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) o[i] = tks[i];
}

extern "C" __global__ void topk_merge(const unsigned long long* part, int ns, int k, int m,
                                      unsigned long long* out) { PDL_ENTRY();
    extern __shared__ unsigned long long tkm[];
    int row = blockIdx.x;
    const unsigned long long* p = part + (long long)row * ns * k;
    for (int i = threadIdx.x; i < m; i += blockDim.x) tkm[i] = i < ns * k ? p[i] : 0ull;
    __syncthreads();
    topk_sort_desc(tkm, m);
    for (int i = threadIdx.x; i < k; i += blockDim.x) out[(long long)row * k + i] = tkm[i];
}
