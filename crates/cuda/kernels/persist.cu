// Persistent one-token decode (v15, session 14): every layer of a one-token step in one launch.
//
// The captured one-token step is a chain of ~10 dependent launches per layer (RMSNorm, the
// activation quantization, Q/K/V with RoPE, the split attention, its merge, O, RMSNorm, gate/up
// with SwiGLU, down), and the ablations of docs/perf/cuda.md put most of its time in the chain
// itself: the products alone run at ~1.8 TB/s because HBM idles at every kernel boundary, and
// the small kernels between them add ~0.4 ms with nothing streaming under them. Here one block
// per multiprocessor stays resident for the whole step. The phases of a layer are separated by
// grid barriers (five per layer: after Q/K/V, the attention, O, gate/up and down), and at the
// start of a phase each block asks L2 for its own weight rows of a later phase (flags bit 0),
// so HBM keeps streaming under barriers, norms and attention.
//
// Each phase runs the same per-row arithmetic as the launches it replaces, so the step gives
// the captured chain's bits:
// - Q/K/V, O and gate/up: `mvr_rows` (matvec_q.cu) per warp and row pair, on the activation
//   each block prepares in shared memory with `mvr_prep` (RMSNorm in rms_norm's order, the
//   quantization of quantize_act); RoPE and the KV-cache store inside the Q/K/V rows; gate/up
//   quantizes the down projection's activation as its 256-row groups complete (quant_arrive).
// - the attention: `attn_group_impl` (attn_batch.cu, the warp-private form) per 128-thread
//   group of a block, with a named barrier per group; the last slice of each KV head to finish
//   merges them (ab_merge_slices: attn_combine's bits, which are attn_merge's).
// - down: the rows of `mvq_impl<T, 1>` (a 128-thread group per row, thread i taking units
//   i, i + 128, ..., warp sums, then the four warp sums in order), PD_DR rows per group at once.
// Rows are dealt to blocks in contiguous ranges (pd_range), so a block's rows of a matrix are
// one run of bytes for its prefetch.

#define PD_QUADS 3
#define PD_THREADS (128 * PD_QUADS)
#define PD_DR 4
#define PD_MARKS 10
#define PD_MARK(k) \
    do { \
        if (a.prof && blockIdx.x == 0 && threadIdx.x == 0) a.prof[l * PD_MARKS + (k)] = clock64(); \
    } while (0)

struct PdLayer {
    const u8* wq;
    const u8* wk;
    const u8* wv;
    const u8* wo;
    const u8* wg;
    const u8* wu;
    const u8* wd;
    const float* an;
    const float* fn;
    u16* kc;
    u16* vc;
    // Type codes (T_*) of Q and K, V, O, gate and up, down: Q4_K_M files mix them by layer.
    int tq, tv, to, tg, td, pad;
};

// Mirrors `PdArgs` in src/kernels.rs field for field.
struct PdArgs {
    const PdLayer* layers;
    const int* pos;
    const int* slot;
    const int* tok_seq;
    const int* btab;
    const float* factors;
    float* x;
    float* q;
    float* part;
    float* att;
    float* g;
    i8* aq2;
    float2* ad2;
    u32* qcnt;
    u32* acnt;
    u32* bar;
    // Diagnostics (0: none): block 0's clock64 at PD_MARKS points of every layer.
    long long* prof;
    float eps, scale, theta_scale, freq_scale;
    int n_layer;
    int e, qd, kvd, ff, nh, nkv;
    int n_rot, hd, max_blocks, bt, n_split, flags;
};

__device__ __forceinline__ u32 pd_ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void pd_st_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Grid barrier over the launch's blocks (all resident: one per multiprocessor, launched
// cooperatively). bar[0] counts arrivals, bar[1] is the generation: each block reads the
// generation before it arrives, the last to arrive zeroes the count and publishes the next
// generation, the others wait for it. Both words are left ready for the next barrier and the
// next launch (graph replays), so nothing is reset between steps.
__device__ __forceinline__ void pd_grid_sync(u32* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 gen = pd_ld_acquire(bar + 1);
        __threadfence();
        u32 arrived = atomicAdd(bar, 1u);
        if (arrived == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            pd_st_release(bar + 1, gen + 1);
        } else {
            while (pd_ld_acquire(bar + 1) == gen) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// This block's share [a, b) of `items` work items.
__device__ __forceinline__ void pd_range(int items, int& a, int& b) {
    a = (int)((long long)items * blockIdx.x / gridDim.x);
    b = (int)((long long)items * (blockIdx.x + 1) / gridDim.x);
}

// The weight types the kernel takes (others keep the launch chain).
#define PD_CASE(TT, CALL) \
    case TT: { \
        constexpr int T = TT; \
        CALL; \
    } break;
#define PD_SWITCH(ty, CALL) \
    switch (ty) { \
        PD_CASE(T_Q4_0, CALL) \
        PD_CASE(T_Q4_1, CALL) \
        PD_CASE(T_Q8_0, CALL) \
        PD_CASE(T_Q4_K, CALL) \
        PD_CASE(T_Q5_K, CALL) \
        PD_CASE(T_Q6_K, CALL) \
        default: break; \
    }

__device__ __forceinline__ long long pd_row_bytes(int ty, int cols) {
    long long rb = 0;
    PD_SWITCH(ty, rb = (long long)(cols / Q<T>::BE) * Q<T>::BB)
    return rb;
}

__device__ __forceinline__ bool pd_kfmt(int ty) { return ty == T_Q4_K || ty == T_Q5_K || ty == T_Q6_K; }

// The block's activation for a product of weight type `ty`: RMSNorm (nw non-null) and the
// quantization into shared memory, exactly as the products preparing their own activation do.
__device__ __forceinline__ void pd_prep(int ty, const float* x, const float* nw, float eps, int n,
                                        i8* sq, float2* sd, double* shd) {
    if (pd_kfmt(ty)) mvr_prep<T_Q4_K>(x, nw, eps, n, sq, sd, shd);
    else mvr_prep<T_Q8_0>(x, nw, eps, n, sq, sd, shd);
}

// Ask L2 for rows [a, b) of the rows [lo, hi) stored at w (rb bytes each).
__device__ __forceinline__ void pd_pf_seg(const u8* w, long long rb, int a, int b, int lo, int hi) {
    int s = max(a, lo), e = min(b, hi);
    if (s < e) prefetch_l2(w + (long long)(s - lo) * rb, (long long)(e - s) * rb);
}

// This block's weights of each product phase (the rows pd_range gives it there).
__device__ __forceinline__ void pd_pf_qkv(const PdArgs& a, const PdLayer& L) {
    int pa, pb;
    int total = a.qd + 2 * a.kvd;
    pd_range(total / 2, pa, pb);
    long long rq = pd_row_bytes(L.tq, a.e), rv = pd_row_bytes(L.tv, a.e);
    pd_pf_seg(L.wq, rq, 2 * pa, 2 * pb, 0, a.qd);
    pd_pf_seg(L.wk, rq, 2 * pa, 2 * pb, a.qd, a.qd + a.kvd);
    pd_pf_seg(L.wv, rv, 2 * pa, 2 * pb, a.qd + a.kvd, total);
}
__device__ __forceinline__ void pd_pf_o(const PdArgs& a, const PdLayer& L) {
    int pa, pb;
    pd_range(a.e / 2, pa, pb);
    pd_pf_seg(L.wo, pd_row_bytes(L.to, a.qd), 2 * pa, 2 * pb, 0, a.e);
}
__device__ __forceinline__ void pd_pf_gu(const PdArgs& a, const PdLayer& L) {
    int ra, rb;
    pd_range(a.ff, ra, rb);
    long long r = pd_row_bytes(L.tg, a.e);
    pd_pf_seg(L.wg, r, ra, rb, 0, a.ff);
    pd_pf_seg(L.wu, r, ra, rb, 0, a.ff);
}
__device__ __forceinline__ void pd_pf_down(const PdArgs& a, const PdLayer& L) {
    int ra, rb;
    pd_range(a.e, ra, rb);
    pd_pf_seg(L.wd, pd_row_bytes(L.td, a.ff), ra, rb, 0, a.e);
}

// One warp's row pair (or gate/up row for GLU) of a product on the block's prepared activation.
template <int T, bool GLU>
__device__ __forceinline__ void pd_rows(int row, const u8* w0, const u8* w1, const u8* w2, int r0,
                                        int r1, int total, int cols, const i8* aq,
                                        const float2* ad, float* y, int accumulate, int qfmt,
                                        u32* qcnt, i8* qso, float2* dso, const RopeArgs* rp) {
    MvrPre<T> pre;
    pre.n = 0;
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    mvr_rows<T, GLU>(row, w0, w1, w2, r0, r1, total, cols / 32, rb, aq, ad, y, y, y, accumulate,
                     qfmt, qcnt, qso, dso, rp, pre, false);
}

// Rows row0 .. row0 + nr - 1 (nr <= PD_DR) of y += W x by one 128-thread group (`tid`, barrier
// `sync`, scratch red[4][PD_DR]): each row in mvq_impl<T, 1>'s order, so its bits.
template <int T>
__device__ __forceinline__ void pd_down_rows(const u8* w, int row0, int nr, int cols,
                                             const i8* aq, const float2* ad, float* y, int tid,
                                             float (*red)[PD_DR], NamedSync sync) {
    constexpr int UPB = Q<T>::BE / 32;
    int units = cols / 32;
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    const u8* wr = w + (long long)row0 * rb;
    float acc[PD_DR];
#pragma unroll
    for (int r = 0; r < PD_DR; r++) acc[r] = 0.0f;
    for (int u = tid; u < units; u += 128) {
        long long off = (long long)(u / UPB) * Q<T>::BB;
        int j = u % UPB;
        int q[PD_DR][8];
        typename QI<T>::P p[PD_DR];
#pragma unroll
        for (int r = 0; r < PD_DR; r++)
            if (r < nr) QI<T>::unit(wr + r * rb + off, j, q[r], p[r]);
#pragma unroll
        for (int r = 0; r < PD_DR; r++)
            if (r < nr) acc[r] += unit_dot<T>(q[r], p[r], aq + 32 * u, ad + u);
    }
    int lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int r = 0; r < PD_DR; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0) red[warp][r] = v;
    }
    sync();
    if (tid < nr) {
        float s = 0.0f;
        for (int k = 0; k < 4; k++) s += red[k][tid];
        float* o = y + row0 + tid;
        *o = *o + s;
    }
    sync();
}

template <int HD>
__device__ void pd_main(const PdArgs& a) {
    extern __shared__ __align__(16) u16 pd_sh[];  // PD_QUADS groups' attention stages
    __shared__ __align__(16) i8 sq[MVR_PREP_MAX];
    __shared__ __align__(16) float2 sd[MVR_PREP_MAX / 32];
    __shared__ double shd[32];
    __shared__ float sm[PD_QUADS][4][8], sl[PD_QUADS][4][8];
    __shared__ int last[PD_QUADS];
    __shared__ float red[PD_QUADS][4][PD_DR];
    constexpr int ATT_HALVES = 2 * AB_STAGES * FA_BK * (HD + 8);
    int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int quad = warp >> 2, qtid = threadIdx.x & 127;
    NamedSync qsync{1 + quad, 128};
    bool pf = (a.flags & 1) != 0;
    int total = a.qd + 2 * a.kvd;
    if (a.flags & 2) pd_pf_qkv(a, a.layers[0]);
    for (int l = 0; l < a.n_layer; l++) {
        const PdLayer L = a.layers[l];
        int dfmt = pd_kfmt(L.td) ? ACT_Q8_K : ACT_Q8_32;
        // Q/K/V with RoPE and the KV-cache store, on the block's normalized activation.
        PD_MARK(0);
        if (pf) pd_pf_o(a, L);
        pd_prep(L.tq, a.x, L.an, a.eps, a.e, sq, sd, shd);
        {
            RopeArgs rp;
            rp.pos = a.pos;
            rp.slot = a.slot;
            rp.factors = a.factors;
            rp.theta_scale = a.theta_scale;
            rp.freq_scale = a.freq_scale;
            rp.n_rot = a.n_rot;
            rp.hd = a.hd;
            rp.kv_row = a.kvd;
            rp.pad = 0;
            rp.kc = L.kc;
            rp.vc = L.vc;
            int pa, pb;
            pd_range(total / 2, pa, pb);
            for (int p = pa + warp; p < pb; p += nw) {
                int row = 2 * p;
                int ty = row < a.qd + a.kvd ? L.tq : L.tv;
                PD_SWITCH(ty, (pd_rows<T, false>(row, L.wq, L.wk, L.wv, a.qd, a.kvd, total, a.e, sq,
                                                 sd, a.q, 0, 0, 0, 0, 0, &rp)))
            }
        }
        PD_MARK(1);
        pd_grid_sync(a.bar);
        PD_MARK(2);
        // The split attention, each slice by a 128-thread group; the last slice of a KV head
        // merges them into att.
        if (pf) pd_pf_gu(a, L);
        {
            u16* sh = pd_sh + quad * ATT_HALVES;
            int nvb = a.nkv * a.n_split;
            for (int vb = blockIdx.x * PD_QUADS + quad; vb < nvb; vb += gridDim.x * PD_QUADS) {
                int kvh = vb % a.nkv, s = vb / a.nkv;
                if (a.n_split == 1)
                    attn_group_impl<HD, false, false, true, NamedSync>(
                        a.q, L.kc, L.vc, a.pos, a.tok_seq, a.btab, a.max_blocks, a.bt, a.nh,
                        a.nkv, a.scale, a.part, sh, nullptr, nullptr, a.att, 0, kvh, s, 1, qtid,
                        qsync, sm[quad], sl[quad], &last[quad]);
                else
                    attn_group_impl<HD, false, true, true, NamedSync>(
                        a.q, L.kc, L.vc, a.pos, a.tok_seq, a.btab, a.max_blocks, a.bt, a.nh,
                        a.nkv, a.scale, a.part, sh, a.att, a.acnt, nullptr, 0, kvh, s, a.n_split,
                        qtid, qsync, sm[quad], sl[quad], &last[quad]);
                // cp.async groups and the stages are the group's own: nothing to wait for here.
            }
        }
        PD_MARK(3);
        pd_grid_sync(a.bar);
        PD_MARK(4);
        // O, accumulated into the residual row.
        pd_prep(L.to, a.att, nullptr, 0.0f, a.qd, sq, sd, shd);
        {
            int pa, pb;
            pd_range(a.e / 2, pa, pb);
            for (int p = pa + warp; p < pb; p += nw)
                PD_SWITCH(L.to, (pd_rows<T, false>(2 * p, L.wo, L.wo, L.wo, a.e, 0, a.e, a.qd, sq,
                                                   sd, a.x, 1, 0, 0, 0, 0, nullptr)))
        }
        PD_MARK(5);
        pd_grid_sync(a.bar);
        PD_MARK(6);
        // gate/up with SwiGLU, the down projection's activation quantized as groups complete.
        if (pf) pd_pf_down(a, L);
        pd_prep(L.tg, a.x, L.fn, a.eps, a.e, sq, sd, shd);
        {
            int ra, rb;
            pd_range(a.ff, ra, rb);
            for (int r = ra + warp; r < rb; r += nw)
                PD_SWITCH(L.tg, (pd_rows<T, true>(r, L.wg, L.wu, L.wu, a.ff, 0, a.ff, a.e, sq, sd,
                                                  a.g, 0, dfmt, a.qcnt, a.aq2, a.ad2, nullptr)))
        }
        PD_MARK(7);
        pd_grid_sync(a.bar);
        PD_MARK(8);
        // down, accumulated into the residual row.
        if (pf && l + 1 < a.n_layer) pd_pf_qkv(a, a.layers[l + 1]);
        {
            int ra, rb;
            pd_range(a.e, ra, rb);
            for (int r = ra + quad * PD_DR; r < rb; r += PD_QUADS * PD_DR)
                PD_SWITCH(L.td, (pd_down_rows<T>(L.wd, r, min(PD_DR, rb - r), a.ff, a.aq2, a.ad2,
                                                 a.x, qtid, red[quad], qsync)))
        }
        PD_MARK(9);
        if (l + 1 < a.n_layer) pd_grid_sync(a.bar);
    }
}

// grid = one block per multiprocessor (cooperative launch), PD_THREADS threads, dynamic shared
// memory PD_QUADS x the attention's two K/V stages.
extern "C" __global__ void __launch_bounds__(PD_THREADS, 1) pdec_d2(PdArgs a) { pd_main<64>(a); }
extern "C" __global__ void __launch_bounds__(PD_THREADS, 1) pdec_d4(PdArgs a) { pd_main<128>(a); }
