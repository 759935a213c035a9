// Row and element-wise operations of the forward pass.

// out[i] = x[r] / sqrt(mean(x[r]^2) + eps) * w, r = rows ? rows[i] : i; grid = (output rows,
// G), blockDim.x = 256: block (i, c) sums row r's squares (the whole row, from L2) and writes
// elements [256k, 256k + 256) for k = c, c + G, ...: decode steps take G = ceil(n / 256), so a
// single row spreads over many SMs; prompt-sized steps a smaller G, so rows are re-summed less.
// fmt != 0 also quantizes the row for the integer products (qs/ds, see matvec_q.cu; either may
// be null), so decode needs no separate launch for it; out_h (optional) receives the row as
// f16, the GEMM path's operand: f16(d * q) of that quantization when fmt != 0 (what
// quantize_act's f16 output holds), else plain f16. The arithmetic is cpu::ops::rms_norm's: the
// sum of squares in f64, mean rounded to f32, scale = 1 / sqrt(mean + eps) correctly rounded.
//
// Session 16 (`ss` non-null; one row, `rows` null): the row's sum of squares is not taken here
// but read from the RMS_SLOTS f64 partial sums that the products which last wrote x added it
// into (mvr_impl / mvq_impl with their `ss`); each warp sums the slots in one fixed order (four
// per lane, then a butterfly), so no block barrier, the block's first element loaded with them. Every square is exact in f64 and their sum nearly always is too, so the
// scale is the whole-row sum's (tested bit for bit). `ssz` (may be null): RMS_SLOTS doubles
// that block (0, 0) zeroes for the next product to add into (the step's chain orders it: that
// product runs after this kernel has finished, and the set's last reader before it).
extern "C" __global__ void rms_norm(const float* x, const int* rows, const float* w, int n, float eps,
                                    float* out, u16* out_h, int fmt, i8* qs, float2* ds,
                                    const double* ss, double* ssz) {
    // v9: the block's first chunk of the norm weight (a constant) is loaded before the wait, so
    // its round trip overlaps the kernel before.
    int c1 = blockIdx.y * blockDim.x + threadIdx.x;
    float w1 = c1 < n ? w[c1] : 0.0f;
    PDL_ENTRY_SMALL((fmt & ACT_PERM) ? PDL_RMS_FFN : PDL_RMS);
    __shared__ double sh[32];
    __shared__ float shf[9];
    __shared__ int shi[8];
    long long i = blockIdx.x;
    long long r = rows ? rows[i] : i;
    const float* xr = x + r * n;
    float scale;
    // The block's first element, loaded with the slots (one round trip for both).
    float x1 = 0.0f;
    if (ss) {
        double p[RMS_SLOTS / 32];
        ss_load(ss, p);
        if (c1 < n) x1 = xr[c1];
        scale = ss_scale(p, n, eps);
    } else {
        scale = rms_scale(xr, n, eps, sh);
    }
    if (ssz && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < RMS_SLOTS) ssz[threadIdx.x] = 0.0;
    for (int cb = blockIdx.y; cb * 256 < n; cb += gridDim.y) {
        int c = cb * blockDim.x + threadIdx.x;
        bool valid = c < n;
        float wc = cb == (int)blockIdx.y ? w1 : valid ? w[c] : 0.0f;
        float xc = ss && cb == (int)blockIdx.y ? x1 : valid ? xr[c] : 0.0f;
        float o = valid ? __fmul_rn(__fmul_rn(xc, scale), wc) : 0.0f;
        if (valid) {
            if (out) out[i * n + c] = o;
            if (out_h && !fmt) out_h[i * n + c] = f2h(o);
        }
        if (fmt)
            quant_act_elem(o, valid, c, fmt, qs ? qs + i * n : qs, ds ? ds + i * (n / 32) : ds,
                           out_h ? out_h + i * n : out_h, shf, shi);
    }
}

// Q/K/V bias, RoPE on Q and K, and the new K/V rows written to the paged f16 cache.
// grid.x = tokens. q is rotated into qo (rows of n_head*hd; qo == q: in place, it feeds
// attention next); k and v go to row slot[t] of kc/vc (rows of n_kv*hd). Input rows are qs
// (q) and kvs (k, v) floats apart: one fused Q/K/V product's rows hold all three (v10). neox selects pairs (i, i + n_rot/2) instead of (2i, 2i+1); pairs
// past n_rot/2 are left unrotated.
//
// The angle of pair i follows cpu::ops::Rope exactly: theta_0 = pos, theta_{i+1} = theta_i *
// theta_scale by repeated f32 multiplication (ggml's recurrence, not pos * base^(-2i/n)), then
// freq_scale * (theta_i / factor_i). At positions in the thousands the two formulas differ by
// ~1e-4 rad, which moves logits measurably after 30 layers. cos and sin are evaluated in f64 and
// rounded, i.e. correctly rounded like the CPU's libm.
extern "C" __global__ void rope_store(float* q, const float* k, const float* v, const float* bq,
                                      const float* bk, const float* bv, const int* pos,
                                      const int* slot, const float* factors, float theta_scale,
                                      float freq_scale, int n_rot, int n_head, int n_kv, int hd,
                                      int neox, u16* kc, u16* vc, float* qo, int qs,
                                      int kvs) { PDL_ENTRY();
    __shared__ float th[128], cs[128], sn[128];
    int t = blockIdx.x;
    int half = hd / 2, rhalf = n_rot / 2;
    long long kv_row = (long long)n_kv * hd;
    const float* qt = q + (long long)t * qs;
    float* qot = qo + (long long)t * n_head * hd;
    const float* kt = k + (long long)t * kvs;
    const float* vt = v + (long long)t * kvs;
    int total = (n_head + n_kv) * half, bd = blockDim.x;
    // v10: each thread's loads (RU rotation pairs, RV V elements at a time) go out together,
    // the first ones before the angles are computed: one memory round trip under the sincos
    // work instead of one per loop iteration (the writes could alias the reads for all the
    // compiler knew). The arithmetic is unchanged.
    constexpr int RU = 8, RV = 4;
    float x0s[RU], x1s[RU], vs[RV];
    auto pair = [&](int e, bool& is_q, int& i, int& ia, int& ib) {
        is_q = e < n_head * half;
        int pe = is_q ? e : e - n_head * half;
        int h = pe / half;
        i = pe % half;
        bool rot = i < rhalf;
        int a = (neox && rot) ? i : 2 * i, b = (neox && rot) ? i + rhalf : 2 * i + 1;
        ia = h * hd + a;
        ib = h * hd + b;
    };
    auto load_pairs = [&](int e0) {
#pragma unroll
        for (int u = 0; u < RU; u++) {
            int e = e0 + u * bd;
            if (e >= total) break;
            bool is_q;
            int i, ia, ib;
            pair(e, is_q, i, ia, ib);
            if (is_q) {
                x0s[u] = qt[ia] + (bq ? bq[ia] : 0.0f);
                x1s[u] = qt[ib] + (bq ? bq[ib] : 0.0f);
            } else {
                x0s[u] = kt[ia] + (bk ? bk[ia] : 0.0f);
                x1s[u] = kt[ib] + (bk ? bk[ib] : 0.0f);
            }
        }
    };
    auto load_v = [&](int e0) {
#pragma unroll
        for (int u = 0; u < RV; u++) {
            int e = e0 + u * bd;
            if (e < kv_row) vs[u] = vt[e] + (bv ? bv[e] : 0.0f);
        }
    };
    load_pairs(threadIdx.x);
    load_v(threadIdx.x);
    if (threadIdx.x == 0) {
        float theta = (float)pos[t];
        for (int i = 0; i < rhalf; i++) {
            th[i] = theta;
            theta *= theta_scale;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rhalf; i += blockDim.x) {
        float ff = (factors && factors[i] != 0.0f) ? factors[i] : 1.0f;
        float a = freq_scale * (th[i] / ff);
        double s, c;
        sincos((double)a, &s, &c);
        cs[i] = (float)c;
        sn[i] = (float)s;
    }
    __syncthreads();
    long long dst = (long long)slot[t] * kv_row;
    for (int e0 = threadIdx.x; e0 < total; e0 += RU * bd) {
        if (e0 != (int)threadIdx.x) load_pairs(e0);
#pragma unroll
        for (int u = 0; u < RU; u++) {
            int e = e0 + u * bd;
            if (e >= total) break;
            bool is_q;
            int i, ia, ib;
            pair(e, is_q, i, ia, ib);
            float x0 = x0s[u], x1 = x1s[u];
            float y0 = x0, y1 = x1;
            if (i < rhalf) {
                float c = cs[i], s = sn[i];
                // cpu::ops::Rope's fused forms (ggml's, as GCC contracts them in llama.cpp's
                // build).
                y0 = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
                y1 = __fmaf_rn(x0, s, __fmul_rn(x1, c));
            }
            if (is_q) {
                qot[ia] = y0;
                qot[ib] = y1;
            } else {
                kc[dst + ia] = f2h(y0);
                kc[dst + ib] = f2h(y1);
            }
        }
    }
    for (int e0 = threadIdx.x; e0 < kv_row; e0 += RV * bd) {
        if (e0 != (int)threadIdx.x) load_v(e0);
#pragma unroll
        for (int u = 0; u < RV; u++) {
            int e = e0 + u * bd;
            if (e < kv_row) vc[dst + e] = f2h(vs[u]);
        }
    }
}

// g = silu(g) * u (the GEMM path; the decode path fuses this into the gate/up product).
extern "C" __global__ void swiglu(float* g, const float* u, long long n) { PDL_ENTRY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float x = g[i];
        g[i] = ggml_swiglu(x, u[i]);
    }
}

extern "C" __global__ void to_f16(const float* x, long long n, u16* out) { PDL_ENTRY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = f2h(x[i]);
}

// Index of the largest logit of each row (the lowest index among equals; NaN never wins).
// grid.x = rows, blockDim.x = 1024.
extern "C" __global__ void argmax_rows(const float* x, int n, int* out) { PDL_ENTRY();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* r = x + (long long)blockIdx.x * n;
    float best = NEG_INF;
    int bi = n;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        float v = r[c];
        if (v > best) { best = v; bi = c; }
    }
    warp_argmax(best, bi);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : NEG_INF;
        bi = lane < nw ? si[lane] : n;
        warp_argmax(best, bi);
        if (lane == 0) out[blockIdx.x] = bi < n ? bi : 0;
    }
}

// The GEMM path's g = silu(g) * u (rows x n) that also writes the down projection's f16
// operand xh: f16(d * q) of the result's quantization in fmt (what quantize_act's f16 output
// holds, i.e. the CPU's activations for that matrix), or plain f16 when fmt == 0; one launch
// instead of two. grid = (rows, ceil(n / 256)), blockDim.x = 256.
extern "C" __global__ void swiglu_q(float* g, const float* u, int n, int fmt, u16* xh) { PDL_ENTRY();
    __shared__ float shf[9];
    __shared__ int shi[8];
    long long r = blockIdx.x;
    int c = blockIdx.y * 256 + threadIdx.x;
    bool valid = c < n;
    float v = 0.0f;
    if (valid) {
        v = ggml_swiglu(g[r * n + c], u[r * n + c]);
        g[r * n + c] = v;
    }
    if (fmt) quant_act_elem(v, valid, c, fmt, (i8*)0, (float2*)0, xh + r * n, shf, shi);
    else if (valid) xh[r * n + c] = f2h(v);
}

// Session 11: ask L2 for up to four byte ranges ahead of the kernels that read them. Launched
// on a second stream beside the main chain (device.rs `Gpu::side_prefetch`), so the memory
// streams the next products' weights while small kernels (norms, attention) run. kind 0: one
// cp.async.bulk.prefetch.L2 per `chunk` bytes (sm_90; starts and sizes multiples of 16);
// kind 1: prefetch.global.L2 per 128-byte line. Thread t takes chunks t, t + T, ... of each
// range in turn. A hint only: nothing is written, a range never faults the kernel.
struct PfRanges {
    const u8* p[4];
    long long n[4];
};
extern "C" __global__ void l2_prefetch(PfRanges r, int kind, int chunk) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long nt = (long long)gridDim.x * blockDim.x;
    for (int s = 0; s < 4; s++) {
        const u8* p = r.p[s];
        long long n = r.n[s];
        if (!p || n <= 0) continue;
        if (kind == 0) {
#if __CUDA_ARCH__ >= 900
            for (long long o = t * chunk; o < n; o += nt * chunk) {
                long long sz = (n - o < chunk ? n - o : (long long)chunk) & ~15LL;
                if (sz > 0)
                    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + o),
                                 "r"((u32)sz)
                                 : "memory");
            }
#endif
        } else {
            for (long long o = t * 128; o < n; o += nt * 128)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
        }
    }
}

// Session 30: ask L2 for the cached K and V rows that a later layer's one-token attention reads
// (positions 0 .. tok_pos[0] - 1 of token 0's sequence: every row but the one the step itself
// writes), from inside the main chain while products that leave memory bandwidth to spare run.
// Piece i of 2 * blocks * per (K's cache blocks in table order, then V's; `per` 16 KB pieces of
// a cache block's written rows) goes to thread i mod T. policy 1: the lines are marked
// L2::evict_last. A hint only: nothing is written. The successor may start at once; the kernel
// still waits for its predecessor before it exits, so a later kernel's wait covers both.
extern "C" __global__ void kv_prefetch(const u8* kc, const u8* vc, const int* tok_pos,
                                       const int* tok_seq, const int* btab, int max_blocks, int bt,
                                       int row_bytes, int policy) {
    pdl_launch();
#if __CUDA_ARCH__ >= 900
    constexpr int PIECE = 16384;
    int len = tok_pos[0];
    const int* bl = btab + (long long)tok_seq[0] * max_blocks;
    long long page = (long long)bt * row_bytes;
    long long per = (page + PIECE - 1) / PIECE;
    long long nb = (len + bt - 1) / bt;
    unsigned long long pol = 0;
    if (policy) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    long long total = 2 * nb * per;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long kv = i / (nb * per), rem = i % (nb * per);
        long long b = rem / per, off = rem % per * PIECE;
        long long rows = min((long long)bt, (long long)len - b * bt);
        long long bytes = rows * row_bytes;
        if (off >= bytes) continue;
        u32 sz = (u32)(min((long long)PIECE, bytes - off) & ~15LL);
        if (sz == 0) continue;
        const u8* p = (kv ? vc : kc) + (long long)bl[b] * page + off;
        if (policy)
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p),
                         "r"(sz), "l"(pol)
                         : "memory");
        else
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(sz)
                         : "memory");
    }
#endif
    pdl_wait();
}

// Session 34 (`cuda_bench --ab-hop`): a launch that only waits for the kernel before it and
// lets the next one start: what a link of the step's dependent chain costs by itself, when it
// stands in for a kernel (`CudaBackend::set_skip` with a "~" prefix). Writes nothing.
extern "C" __global__ void pdl_hop() { PDL_ENTRY_SMALL(PDL_HOP); }
