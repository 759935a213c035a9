// Session 21: one-token products on thread block clusters (sm_90).
//
// The one-token down projection (`mvqp_*`, a block per row) reads the SwiGLU output quantized
// by a `quantize_act` launch of its own, a link of ~1.5 us in each layer's dependent chain
// (docs/perf/cuda.md, session 21's ablation: 0.05 ms per token for all of them). Here the
// product quantizes its activation itself without every block redoing the whole row: the
// grid runs in clusters of CL blocks (launch attribute, device.rs), block r of a cluster
// quantizes the 256-element groups r * nw + w, r * nw + w + CL * nw, ... (warp w, nw warps per
// block; quant_group_vals, so quantize_act's bytes) into its own shared memory and stores the
// same bytes into the other CL - 1 blocks' shared memory (st.shared::cluster), then the cluster
// barrier (release / acquire) makes the whole row visible to every block. The row product
// itself is mvqp's code (mvq_impl) on that shared copy: the same bits as quantize_act followed
// by mvqp_<type> (`cluster_product_equals_quantize_then_product`).
//
// Each cluster reads the f32 row once (32 KB for 8192 columns), not each block. The weights'
// L2 prefetch goes out before the PDL wait as in mvqp. Blocks past the last row (the grid is a
// whole number of clusters) quantize their groups and write nothing else.
//
// Cluster operations are inline PTX (NVRTC ships no cooperative_groups header here); kernels
// built for an architecture before sm_90 have an empty body and the host never launches them
// there (Gpu::mvqc_takes).

__device__ __forceinline__ u32 cl_rank() {
    u32 r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

__device__ __forceinline__ u32 cl_blocks() {
    u32 r = 1;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
#endif
    return r;
}

// 8 bytes at shared address `a` of this block to the same address in block `rank`'s shared
// memory.
__device__ __forceinline__ void cl_store8(u32 a, u32 rank, uint2 v) {
#if __CUDA_ARCH__ >= 900
    u32 ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.v2.u32 [%0], {%1, %2};" ::"r"(ra), "r"(v.x), "r"(v.y)
                 : "memory");
#endif
}

// The first half of a cluster barrier, at the kernel's start: a block may store into another
// block's shared memory only once that block has started (the CUDA programming guide's rule for
// distributed shared memory; without it the 3B model's decode step failed with an unspecified
// launch failure on the H200 while the kernel test, its launch alone on an idle stream,
// passed). cl_started's wait then returns at once, the blocks having arrived long before.
__device__ __forceinline__ void cl_arrive_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cl_started() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// Every thread of every block of the cluster arrives (its earlier shared-memory stores
// released) and waits for all the others (acquire).
__device__ __forceinline__ void cl_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The row x (cols f32, cols a multiple of 32) quantized in `fmt` into every block of the
// cluster: sq (cols int8) and sd (cols / 32 float2) at the same shared offsets in each block.
// Every thread has called cl_arrive_start before.
__device__ __forceinline__ void cl_quant_row(const float* __restrict__ x, int cols, int fmt,
                                             i8* sq, float2* sd) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u32 rank = cl_rank(), ncl = cl_blocks();
    u32 qa = smem_u32(sq), da = smem_u32(sd);
    cl_started();
    for (int g = (int)rank * nw + warp; g * 256 < cols; g += (int)ncl * nw) {
        int c0 = g * 256 + lane * 8;
        bool valid = c0 < cols;
        float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (valid) {
            float4 a = *(const float4*)(x + c0), b = *(const float4*)(x + c0 + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        }
        quant_group_vals(v, valid, c0, fmt, sq, sd);
        if (!valid) continue;
        // This lane's own bytes (it wrote them), to the other blocks.
        uint2 q = *(const uint2*)(sq + c0);
        bool has_d = (lane & 3) == 0;
        uint2 d = has_d ? *(const uint2*)(sd + c0 / 32) : make_uint2(0u, 0u);
        for (u32 r = 0; r < ncl; r++) {
            if (r == rank) continue;
            cl_store8(qa + (u32)c0, r, q);
            if (has_d) cl_store8(da + (u32)(c0 / 32) * 8u, r, d);
        }
    }
    cl_sync();
}

// mvqc_<type>: one token's y (+)= W x for rows too wide for the mvr kernels (the down
// projection), x as f32; dynamic shared memory cols + cols / 32 * 8 bytes; grid rows rounded
// up to the cluster size, or fewer blocks that loop over the rows; blockDim mvqp's.
template <int T>
__device__ void mvqc_impl(const u8* __restrict__ w, int rows, int cols,
                          const float* __restrict__ x, int fmt, float* y, int accumulate,
                          double* ss) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) u8 smc[];
    i8* sq = (i8*)smc;
    float2* sd = (float2*)(smc + cols);
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    cl_arrive_start();
    if ((int)blockIdx.x < rows) prefetch_l2(w + (long long)blockIdx.x * rb, rb);
    PDL_ENTRY();
    cl_quant_row(x, cols, fmt, sq, sd);
    if ((int)gridDim.x >= rows) {
        mvq_impl<T, 1, false>(w, w, rows, cols, sq, sd, 1, y, accumulate, ss);
        return;
    }
    // A grid smaller than the rows (Gpu::mvqc_per_sm): each block takes rows blockIdx.x,
    // blockIdx.x + gridDim.x, ..., so the cluster's quantization is paid once per block.
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        if (row != (int)blockIdx.x) __syncthreads();
        mvq_impl<T, 1, false>(w, w, rows, cols, sq, sd, 1, y, accumulate, ss, row);
    }
#endif
}

#define DEF_MVQC(name, T) \
    extern "C" __global__ void __launch_bounds__(128) mvqc_##name( \
        const u8* w, int rows, int cols, const float* x, int fmt, float* y, int accumulate, \
        double* ss) { \
        mvqc_impl<T>(w, rows, cols, x, fmt, y, accumulate, ss); \
    }
FOR_EACH_QTYPE(DEF_MVQC)
DEF_MVQC(q6_ka, T_Q6_KA)
DEF_MVQC(q6_ku, T_Q6_KU)
DEF_MVQC(q6_ka4, T_Q6_KA4)
DEF_MVQC(q6_ku4, T_Q6_KU4)
