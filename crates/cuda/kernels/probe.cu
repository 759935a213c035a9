// Streaming-read probes (session 15): the fastest a one-token product could stream its
// weights inside a chain of launches under programmatic dependent launch. Each probe reads
// `n16` 16-byte words of `p` (block b the contiguous words [b * per_block, (b + 1) * per_block))
// and writes the XOR of every 32-bit word it read to out[b], so nothing is optimized away and a
// test can check that every byte was read once. `cuda_bench --roofline` times chains of them
// next to the real product kernels (docs/perf/cuda.md, "Session 15").
//
// - probe_ld<U>: each thread U 16-byte loads in flight per step (ld.global.nc).
// - probe_cp: each warp streams its 512-byte chunks through PROBE_CP_D shared-memory slots
//   with cp.async, the first PROBE_CP_D issued before the wait on the kernel before (the bytes
//   depend on no earlier kernel, and shared memory, not registers, holds them in flight).
// `prefetch` 1: the block first asks L2 for its whole range (as the mvr kernels do).

__device__ __forceinline__ void probe_finish(u32 acc, u32* out) {
    __shared__ u32 sx[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) sx[w] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 r = 0;
        for (int i = 0; i < nw; i++) r ^= sx[i];
        out[blockIdx.x] = r;
    }
}

template <int U>
__device__ void probe_ld_impl(const uint4* __restrict__ p, long long n16, long long per_block,
                              u32* out, int prefetch) {
    long long b0 = (long long)blockIdx.x * per_block;
    long long b1 = min(n16, b0 + per_block);
    if (prefetch && b0 < b1) prefetch_l2((const u8*)(p + b0), (b1 - b0) * 16);
    pdl_wait();
    pdl_launch();
    u32 acc = 0;
    long long step = blockDim.x;
    long long i = b0 + threadIdx.x;
    for (; i + (U - 1) * step < b1; i += U * step) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = ld_nc16(p + i + u * step);
#pragma unroll
        for (int u = 0; u < U; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < b1; i += step) {
        uint4 v = ld_nc16(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    probe_finish(acc, out);
}

#define DEF_PROBE_LD(U) \
    extern "C" __global__ void __launch_bounds__(256) probe_ld##U( \
        const uint4* p, long long n16, long long per_block, u32* out, int prefetch) { \
        probe_ld_impl<U>(p, n16, per_block, out, prefetch); \
    }
DEF_PROBE_LD(1)
DEF_PROBE_LD(4)
DEF_PROBE_LD(8)

#define PROBE_CP_D 8
extern "C" __global__ void __launch_bounds__(256) probe_cp(const uint4* p, long long n16,
                                                           long long per_block, u32* out,
                                                           int prefetch) {
    __shared__ __align__(16) uint4 ring[8][PROBE_CP_D][32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    long long b0 = (long long)blockIdx.x * per_block;
    long long b1 = min(n16, b0 + per_block);
    if (prefetch && b0 < b1) prefetch_l2((const u8*)(p + b0), (b1 - b0) * 16);
    // Chunk c (32 words) of the block: words b0 + 32c + lane; warp w takes c = w, w + nw, ...
    long long chunks = b1 > b0 ? (b1 - b0 + 31) / 32 : 0;
    auto issue = [&](long long c, int slot) {
        long long i = b0 + 32 * c + lane;
        bool ok = c < chunks && i < b1;
        cp_async16(&ring[w][slot][lane], ok ? p + i : p, ok ? 16 : 0);
    };
    long long c = w;
#pragma unroll
    for (int s = 0; s < PROBE_CP_D; s++) {
        issue(c + (long long)s * nw, s);
        cp_async_commit();
    }
    pdl_wait();
    pdl_launch();
    u32 acc = 0;
    for (int s = 0; c < chunks; c += nw, s = (s + 1) % PROBE_CP_D) {
        cp_async_wait<PROBE_CP_D - 1>();
        __syncwarp();
        uint4 v = ring[w][s][lane];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
        __syncwarp();
        issue(c + (long long)PROBE_CP_D * nw, s);
        cp_async_commit();
    }
    cp_async_wait<0>();
    probe_finish(acc, out);
}
