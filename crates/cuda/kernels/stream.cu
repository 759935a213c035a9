// v14 (session 12): one-token products whose weights stream into shared memory.
//
// The mvr_* kernels read each weight row in the warp that uses it: those loads start only when
// the warp runs, and the HBM pipe drains at every kernel boundary of the decode step. Here one
// warp of each block (the producer, the block's last) copies the block's contiguous share of the
// weight rows into a ring of shared-memory slots with bulk asynchronous copies (sm_90
// cp.async.bulk, completion counted in bytes on an mbarrier per slot), from the moment the block
// starts, before the wait on the kernel before it (the weights depend on no kernel). The other
// warps (consumers) wait for that kernel, then take the row pairs of each slot as it lands and
// run mvr_pair on them (the weights read from shared memory, the activation from global memory
// as mvr does), so every output gets the operations, and bits, of the mvr launches. A consumer
// warp releases the slot (mbarrier) when it is done with it, and the producer refills it.
//
// Work: P row pairs. Plain and Q/K/V launches: rows 2i and 2i + 1 of up to three matrices laid
// end to end (r0 and r1 even, so no pair spans two matrices; the third may end on a lone row);
// SwiGLU: gate row i with up row i. Block b takes pairs [b P / G, (b + 1) P / G); a chunk is up
// to kmax[s] consecutive pairs of one matrix s (as many as a slot holds), and the producer and
// every consumer walk the same chunk sequence (mvs_next, mvs_spans). One block per SM.

// Bytes of the dynamic shared memory before the slots (the mbarriers; Q6_K's loads read up to
// 14 bytes before a super-block) and after them (up to 16 bytes past one).
#define MVS_HEAD 256
#define MVS_TAIL 64
#define MVS_MAX_SLOTS 16
// Consumer warps at most 16, plus the producer.
#define MVS_MAX_THREADS 544

__device__ __forceinline__ void mbar_init(u64* b, u32 count) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count)
                 : "memory");
#endif
}
__device__ __forceinline__ void mbar_init_fence() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(u64* b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
#endif
}
// One arrival that also tells the barrier `bytes` more are coming from bulk copies.
__device__ __forceinline__ void mbar_expect(u64* b, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)),
                 "r"(bytes)
                 : "memory");
#endif
}
// Wait until the phase of parity `parity` of barrier b has completed.
__device__ __forceinline__ void mbar_wait(u64* b, u32 parity) {
#if __CUDA_ARCH__ >= 900
    u32 a = smem_u32(b), done = 0;
    while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(a), "r"(parity)
            : "memory");
#endif
}
// Bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared
// memory, its completion counted on barrier `bar`.
__device__ __forceinline__ void bulk_to_shared(void* dst, const void* src, u32 bytes, u64* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
        : "memory");
#endif
}

struct MvsWork {
    const u8* w[3];
    long long rb[3];  // row bytes of each matrix
    int rows0[4];     // first row of each matrix, and the total
    int sp[4];        // first pair of each matrix, and P
    int kmax[3];      // pairs per chunk of each matrix
    int pb, pe;       // the block's pairs
};

// The next chunk from pair p: its matrix and pair count; false when the block's pairs are done.
__device__ __forceinline__ bool mvs_next(const MvsWork& w, int p, int& seg, int& np) {
    if (p >= w.pe) return false;
    seg = p < w.sp[1] ? 0 : p < w.sp[2] ? 1 : 2;
    np = min(min(w.pe, w.sp[seg + 1]), p + w.kmax[seg]) - p;
    return true;
}

// The chunk's byte spans in global memory (GLU: the gate rows, then the up rows), each copied
// from its 16-byte aligned start: span i lands at slot offset off[i], its first row at
// off[i] + lead[i]. Returns the number of spans; `tx` = bytes copied.
template <bool GLU>
__device__ __forceinline__ int mvs_spans(const MvsWork& w, int seg, int p, int np,
                                         const u8** src, u32* off, u32* lead, u32* len, u32& tx) {
    int n;
    if (GLU) {
        src[0] = w.w[0] + (long long)p * w.rb[0];
        src[1] = w.w[1] + (long long)p * w.rb[0];
        n = 2;
    } else {
        src[0] = w.w[seg] + (long long)(2 * p - w.rows0[seg]) * w.rb[seg];
        n = 1;
    }
    long long bytes = GLU ? (long long)np * w.rb[0]
                          : (long long)(min(2 * (p + np), w.rows0[3]) - 2 * p) * w.rb[seg];
    tx = 0;
    for (int i = 0; i < n; i++) {
        lead[i] = (u32)((unsigned long long)src[i] & 15ull);
        len[i] = (u32)((lead[i] + bytes + 15) & ~15ll);
        off[i] = tx;
        tx += len[i];
    }
    return n;
}

template <int TA, int TB, bool GLU>
__device__ void mvs_impl(const u8* __restrict__ w0, const u8* __restrict__ w1,
                         const u8* __restrict__ w2, int r0, int r1, int r2, int cols,
                         const i8* __restrict__ aq, const float2* __restrict__ ad, float* y0,
                         float* y1, float* y2, int accumulate, const RopeArgs* rp,
                         int slot_bytes, int nslots) {
    extern __shared__ __align__(128) u8 mvs_sh[];
    u64* full = (u64*)mvs_sh;
    u64* empty = full + MVS_MAX_SLOTS;
    u8* slots = mvs_sh + MVS_HEAD;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nc = (int)(blockDim.x >> 5) - 1;
    MvsWork w;
    w.w[0] = w0;
    w.w[1] = w1;
    w.w[2] = w2;
    long long rba = (long long)(cols / Q<TA>::BE) * Q<TA>::BB;
    long long rbb = (long long)(cols / Q<TB>::BE) * Q<TB>::BB;
    w.rb[0] = rba;
    w.rb[1] = rba;
    w.rb[2] = rbb;
    int total = GLU ? r0 : r0 + r1 + r2;
    int P = GLU ? r0 : (total + 1) / 2;
    w.rows0[0] = 0;
    w.rows0[1] = GLU ? total : r0;
    w.rows0[2] = GLU ? total : r0 + r1;
    w.rows0[3] = total;
    w.sp[0] = 0;
    // A lone last row can only end the launch's last matrix (the host keeps r0, r1 even
    // when a matrix follows them).
    w.sp[1] = GLU || r1 + r2 == 0 ? P : r0 / 2;
    w.sp[2] = GLU || r2 == 0 ? P : (r0 + r1) / 2;
    w.sp[3] = P;
    // Each span may take 30 bytes more than its rows (alignment at both ends).
    for (int s = 0; s < 3; s++) w.kmax[s] = max(1, (slot_bytes - 64) / (int)(2 * w.rb[s]));
    w.pb = (int)((long long)blockIdx.x * P / gridDim.x);
    w.pe = (int)((long long)(blockIdx.x + 1) * P / gridDim.x);
    if (threadIdx.x == 0) {
        for (int s = 0; s < nslots; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], nc);
        }
        mbar_init_fence();
    }
    __syncthreads();
    const u8* src[2];
    u32 off[2], lead[2], len[2], tx;
    int seg, np;
    if (warp == nc) {
        // The producer: no wait on the kernel before (the weights are not its output).
        if (lane != 0) return;
        for (int p = w.pb, k = 0; mvs_next(w, p, seg, np); p += np, k++) {
            int s = k % nslots, round = k / nslots;
            if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
            int n = mvs_spans<GLU>(w, seg, p, np, src, off, lead, len, tx);
            u8* dst = slots + (long long)s * slot_bytes;
            mbar_expect(&full[s], tx);
            for (int i = 0; i < n; i++)
                bulk_to_shared(dst + off[i], src[i] - lead[i], len[i], &full[s]);
        }
        return;
    }
    pdl_wait();
    pdl_launch();
    int units = cols / 32;
    MvrPre<TA> prea;
    MvrPre<TB> preb;
    prea.n = 0;
    preb.n = 0;
    for (int p = w.pb, k = 0; mvs_next(w, p, seg, np); p += np, k++) {
        int s = k % nslots;
        // Every consumer waits for every chunk, so none can release a slot's next round early.
        mbar_wait(&full[s], (k / nslots) & 1);
        mvs_spans<GLU>(w, seg, p, np, src, off, lead, len, tx);
        const u8* base = slots + (long long)s * slot_bytes;
        const u8* d0 = base + off[0] + lead[0];
        const u8* d1 = GLU ? base + off[1] + lead[1] : d0;
        for (int i = warp; i < np; i += nc) {
            const u8* wr[2];
            if (GLU) {
                wr[0] = d0 + (long long)i * rba;
                wr[1] = d1 + (long long)i * rba;
                mvr_pair<TA, true>(p + i, wr, true, r0, 0, total, units, aq, ad, y0, y0, y0, 0,
                                   0, 0, 0, 0, 0, prea, false);
            } else {
                int row = 2 * (p + i);
                bool second = row + 1 < total;
                long long rb = w.rb[seg];
                wr[0] = d0 + (long long)(2 * i) * rb;
                wr[1] = second ? wr[0] + rb : wr[0];
                if (seg == 2 && TB != TA)
                    mvr_pair<TB, false>(row, wr, second, r0, r1, total, units, aq, ad, y0, y1,
                                        y2, accumulate, 0, 0, 0, 0, rp, preb, false);
                else
                    mvr_pair<TA, false>(row, wr, second, r0, r1, total, units, aq, ad, y0, y1,
                                        y2, accumulate, 0, 0, 0, 0, rp, prea, false);
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
    }
}

// mvs_<t>: plain products of up to three matrices of one type (rope != 0: the Q/K/V launch
// with RoPE and the KV-cache store, as mvr_rope_<t>); mvs_swiglu_<t>: gate and up with the
// SwiGLU (as mvr_swiglu_<t> without the fused quantization); mvs2_<q>_<v>: the Q/K/V launch
// with a V of another type (as mvr_rope2_<q>_<v>).
#define MVS_ARGS \
    const u8 *w0, const u8 *w1, const u8 *w2, int r0, int r1, int r2, int cols, const i8 *aq, \
        const float2 *ad, float *y0, float *y1, float *y2, int accumulate, RopeArgs rp, \
        int rope, int slot_bytes, int nslots
#define DEF_MVS(name, T) \
    extern "C" __global__ void __launch_bounds__(MVS_MAX_THREADS, 1) mvs_##name(MVS_ARGS) { \
        mvs_impl<T, T, false>(w0, w1, w2, r0, r1, r2, cols, aq, ad, y0, y1, y2, accumulate, \
                              rope ? &rp : 0, slot_bytes, nslots); \
    } \
    extern "C" __global__ void __launch_bounds__(MVS_MAX_THREADS, 1) mvs_swiglu_##name(MVS_ARGS) { \
        mvs_impl<T, T, true>(w0, w1, w2, r0, r1, r2, cols, aq, ad, y0, y1, y2, 0, 0, \
                             slot_bytes, nslots); \
    }
FOR_EACH_QTYPE(DEF_MVS)
#define DEF_MVS2(a, TA, b, TB) \
    extern "C" __global__ void __launch_bounds__(MVS_MAX_THREADS, 1) mvs2_##a##_##b(MVS_ARGS) { \
        mvs_impl<TA, TB, false>(w0, w1, w2, r0, r1, r2, cols, aq, ad, y0, y1, y2, accumulate, \
                                rope ? &rp : 0, slot_bytes, nslots); \
    }
FOR_EACH_QKV_PAIR(DEF_MVS2)
