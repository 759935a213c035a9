// Session 15: one-token products whose weights stream through shared memory (`mvs_*`).
//
// The streaming-read probes (probe.cu, `cuda_bench --roofline`) read 28 MB in a launch chain
// in 7.3 us (3.9 TB/s) with per-warp cp.async rings, where the gate/up product (`mvr_swiglu`)
// took 12.5 us for the same bytes; the output head's 323 MB 72.5 us against 116. The `mvr`
// kernels load each weight unit with several 16-byte loads per lane that touch many lines
// (a lane per 32-weight unit, two lanes reading the same 32 bytes), which keeps the L1 busy
// without keeping DRAM busy. Here each warp copies its own work items (row pairs, gate/up row
// pairs, or single wide rows) with coalesced 16-byte cp.async into a private ring of MVS_D
// shared-memory slots, the first MVS_D - 1 items issued before the wait on the kernel before
// (the weights depend on no earlier kernel, and shared memory, not registers, holds them in
// flight), then decodes each slot with the same per-unit code and in the same order as the
// kernel it replaces, so every output has that kernel's bits:
//
// - mvs_<t>: rows in pairs, `mvr_rows`' order (lane l units l, l + 32, ...; a warp butterfly):
//   the output projection and the head, `mvr4_<t>`'s bits.
// - mvs_swiglu_<t>: a gate row and an up row, `mvr_swiglu_<t>`'s bits, with its fused
//   quantization of the down projection's activation.
// - mvs_row_<t>: one wide row (the down projection), `mvq_<t>_1`'s order at MVS_ROW_B threads
//   per row (thread t of it units t, t + B, ...; per-warp butterflies; the warps' sums in
//   order), so `mvqp_<t>`'s bits.
//
// Dynamic shared memory: blockDim.x / 32 warps x MVS_D slots x `slot` bytes (a multiple of 16,
// at least an item's bytes). Every row's byte length (or a pair's) is a multiple of 16 and
// every row start 16-byte aligned where the host takes these kernels (`Gpu::mvs_fits`).

#define MVS_D 3
#define MVS_ROW_B 128

// Copy `bytes` (a multiple of 16) from `src` to the warp's slot `dst`, lane by lane.
__device__ __forceinline__ void mvs_copy(u8* dst, const u8* src, int bytes) {
    int lane = threadIdx.x & 31;
    for (int o = lane * 16; o < bytes; o += 32 * 16) cp_async16(dst + o, src + o, 16);
}

// MODE 0: pairs of rows of one matrix (rows r, r + 1 of item r / 2); 1: gate row + up row;
// 2: one row.
template <int T, int MODE>
__device__ __forceinline__ void mvs_issue(const u8* w0, const u8* w1, int rows, long long rb,
                                          int item, int items, u8* slot) {
    if (item < items) {
        if (MODE == 0) {
            int r = 2 * item;
            int n = min(2, rows - r);
            mvs_copy(slot, w0 + (long long)r * rb, (int)(n * rb));
        } else if (MODE == 1) {
            mvs_copy(slot, w0 + (long long)item * rb, (int)rb);
            mvs_copy(slot + rb, w1 + (long long)item * rb, (int)rb);
        } else {
            mvs_copy(slot, w0 + (long long)item * rb, (int)rb);
        }
    }
    cp_async_commit();
}

template <int T, int MODE>
__device__ void mvs_impl(const u8* __restrict__ w0, const u8* __restrict__ w1, int rows,
                         int cols, const i8* __restrict__ aq, const float2* __restrict__ ad,
                         float* y, int accumulate, int slot_bytes, int qfmt, u32* qcnt, i8* qso,
                         float2* dso) {
    extern __shared__ __align__(16) u8 mvs_smem[];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int units = cols / 32;
    constexpr int UPB = Q<T>::BE / 32;
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    int items = MODE == 0 ? (rows + 1) / 2 : rows;
    int gw = blockIdx.x * nw + warp, stride = gridDim.x * nw;
    u8* ring = mvs_smem + (long long)warp * MVS_D * slot_bytes;
#pragma unroll
    for (int s = 0; s < MVS_D - 1; s++)
        mvs_issue<T, MODE>(w0, w1, rows, rb, gw + s * stride, items, ring + s * slot_bytes);
    pdl_wait();
    pdl_launch();
    int k = 0;
    for (int item = gw; item < items; item += stride, k++) {
        int s = k % MVS_D;
        mvs_issue<T, MODE>(w0, w1, rows, rb, item + (MVS_D - 1) * stride, items,
                           ring + ((k + MVS_D - 1) % MVS_D) * slot_bytes);
        cp_async_wait<MVS_D - 1>();
        __syncwarp();
        const u8* sl = ring + s * slot_bytes;
        if (MODE == 2) {
            // mvq_impl's order at MVS_ROW_B threads: virtual thread l + 32 v sums its units
            // l + 32 v, l + 32 v + B, ...; each virtual warp v its butterfly; then v in order.
            constexpr int NV = MVS_ROW_B / 32;
            float a[NV];
#pragma unroll
            for (int v = 0; v < NV; v++) {
                a[v] = 0.0f;
                for (int u = lane + 32 * v; u < units; u += MVS_ROW_B) {
                    int q[8];
                    typename QI<T>::P p;
                    QI<T>::unit(sl + (long long)(u / UPB) * Q<T>::BB, u % UPB, q, p);
                    a[v] += unit_dot<T>(q, p, aq + 32 * u, ad + u);
                }
            }
            float sum = 0.0f;
#pragma unroll
            for (int v = 0; v < NV; v++) sum += warp_sum(a[v]);
            if (lane == 0) y[item] = accumulate ? y[item] + sum : sum;
        } else {
            const u8* wr[2] = {sl, sl + rb};
            float acc[2] = {0.0f, 0.0f};
            int u = lane;
            for (; u + 32 < units; u += 64) {
                mvr_unit<T>(wr, u, aq, ad, acc);
                mvr_unit<T>(wr, u + 32, aq, ad, acc);
            }
            if (u < units) mvr_unit<T>(wr, u, aq, ad, acc);
            acc[0] = warp_sum(acc[0]);
            acc[1] = warp_sum(acc[1]);
            if (MODE == 1) {
                if (lane == 0) y[item] = ggml_swiglu(acc[0], acc[1]);
                if (qfmt) {
                    int g = item >> 8;
                    quant_arrive(y, rows, g, min(256, rows - g * 256), 1, qfmt, qcnt + g, qso,
                                 dso);
                }
            } else if (lane == 0) {
                int r = 2 * item;
                y[r] = accumulate ? y[r] + acc[0] : acc[0];
                if (r + 1 < rows) y[r + 1] = accumulate ? y[r + 1] + acc[1] : acc[1];
            }
        }
        __syncwarp();
    }
    cp_async_wait<0>();
}

#define DEF_MVS(name, T) \
    extern "C" __global__ void __launch_bounds__(256) mvs_##name( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, float* y, \
        int accumulate, int slot) { \
        mvs_impl<T, 0>(w, w, rows, cols, aq, ad, y, accumulate, slot, 0, 0, 0, 0); \
    } \
    extern "C" __global__ void __launch_bounds__(256) mvs_swiglu_##name( \
        const u8* wg, const u8* wu, int rows, int cols, const i8* aq, const float2* ad, \
        float* y, int slot, int qfmt, u32* qcnt, i8* qso, float2* dso) { \
        mvs_impl<T, 1>(wg, wu, rows, cols, aq, ad, y, 0, slot, qfmt, qcnt, qso, dso); \
    } \
    extern "C" __global__ void __launch_bounds__(256) mvs_row_##name( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, float* y, \
        int accumulate, int slot) { \
        mvs_impl<T, 2>(w, w, rows, cols, aq, ad, y, accumulate, slot, 0, 0, 0, 0); \
    }
DEF_MVS(q4_k, T_Q4_K)
DEF_MVS(q6_k, T_Q6_K)
