// Session 19: one-token products whose weights are staged in shared memory before the PDL wait.
//
// The one-token `mvr` kernels are latency-bound inside the step (docs/perf/cuda.md, session 16):
// each launch waits for the kernel before it to finish, then loads its weights (one or two
// memory round trips per warp), and only its L2 prefetch overlaps the wait. Here block b copies
// all the bytes of its contiguous rows [first, last) into shared memory with cp.async *before*
// griddepcontrol.wait, so the weight stream runs while the previous kernel (the attention's
// quantization before the output projection, the SwiGLU product before the down projection)
// still runs; after the wait only the activation is read from L2 and the weights from shared
// memory. The grid is one block per multiprocessor (ppb row pairs per block), so every block is
// resident and copying from the start.
//
// Warp w takes the block's row pairs w, w + nw, ... with mvr_dot, the `mvr` kernels' own unit
// order and float operations: the same bits as `mvr_<type>` / `mvr4_<type>` (the test
// `staged_products_equal_mvr_products_and_cpu_scalar_vec_dot`). Types whose blocks are 16-byte
// multiples only (Q4_K, Q5_K and the aligned Q6_KA copies), so every row starts 16-byte aligned.
//
// PREP (session 20, `mvsmp_*`): the activation comes as f32 (`px`, the attention's merged rows)
// and each block quantizes it into shared memory itself after the wait, a warp per 256-element
// group (quant_group_vals: quantize_act's bytes), so no quantization launch runs between the
// attention and the output projection. Every block reads the whole row (12 KB for 3072
// columns), once per multiprocessor. The same bits as `mvsm_*` on quantize_act's output.
template <int T, bool PREP>
__device__ void mvsm_impl(const u8* __restrict__ w, int rows, int cols, const i8* __restrict__ aq,
                          const float2* __restrict__ ad, float* y, int accumulate, int ppb,
                          double* ss, const float* __restrict__ px) {
    extern __shared__ __align__(16) u8 smw[];
    int warp = threadIdx.x >> 5, nw = blockDim.x >> 5, lane = threadIdx.x & 31;
    int units = cols / 32;
    long long rb = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    int first = blockIdx.x * ppb * 2;
    int last = min(first + 2 * ppb, rows);
    if (first < last) {
        const u8* src = w + (long long)first * rb;
        int bytes = (int)((long long)(last - first) * rb);
        for (int i = threadIdx.x * 16; i < bytes; i += blockDim.x * 16)
            cp_async16(smw + i, src + i, 16);
        cp_async_commit();
    }
    pdl_wait();
    pdl_launch();
    if (first >= last) return;
    if (PREP) {
        __shared__ __align__(16) i8 sq[MVR_PREP_MAX];
        __shared__ __align__(16) float2 sd[MVR_PREP_MAX / 32];
        for (int g = warp; g * 256 < cols; g += nw) {
            int c0 = g * 256 + lane * 8;
            float v[8];
            float4 a = *(const float4*)(px + c0), b = *(const float4*)(px + c0 + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
            quant_group_vals(v, true, c0, ACT_Q8_K, sq, sd);
        }
        aq = sq;
        ad = sd;
    }
    cp_async_wait<0>();
    __syncthreads();
    for (int p = warp; first + 2 * p < last; p += nw) {
        int row = first + 2 * p;
        bool second = row + 1 < last;
        const u8* wr[2];
        wr[0] = smw + (long long)(2 * p) * rb;
        // A missing second row reads the first again (its result is dropped).
        wr[1] = second ? wr[0] + rb : wr[0];
        float acc[2];
        mvr_dot<T>(wr, units, aq, ad, acc);
        if (lane != 0) continue;
#pragma unroll
        for (int s = 0; s < 2; s++) {
            if (s == 1 && !second) break;
            float v = accumulate ? y[row + s] + acc[s] : acc[s];
            y[row + s] = v;
            if (ss) ss_add(ss, row + s, v);
        }
    }
}

#define DEF_MVSM(name, T) \
    extern "C" __global__ void __launch_bounds__(512, 1) mvsm_##name( \
        const u8* w, int rows, int cols, const i8* aq, const float2* ad, float* y, \
        int accumulate, int ppb, double* ss) { \
        mvsm_impl<T, false>(w, rows, cols, aq, ad, y, accumulate, ppb, ss, nullptr); \
    } \
    extern "C" __global__ void __launch_bounds__(512, 1) mvsmp_##name( \
        const u8* w, int rows, int cols, const float* px, float* y, int accumulate, int ppb, \
        double* ss) { \
        mvsm_impl<T, true>(w, rows, cols, nullptr, nullptr, y, accumulate, ppb, ss, px); \
    }
DEF_MVSM(q4_k, T_Q4_K)
DEF_MVSM(q5_k, T_Q5_K)
DEF_MVSM(q6_ka, T_Q6_KA)
DEF_MVSM(q6_ku, T_Q6_KU)
DEF_MVSM(q6_ka4, T_Q6_KA4)
DEF_MVSM(q6_ku4, T_Q6_KU4)
