// Fused dequantize + matrix-vector products for decode (a few tokens per step).
//
// y[t, r] (+)= sum_c W[r, c] * x[t, c] for t < nt <= NT. One warp per row; each lane decodes
// 32-element units of the row (its own share of the quantized bytes, read once from memory)
// and multiplies them against every token's activations, so the weights - the bytes that
// bound decode - are read once per step whatever the batch. Activations are f32 and small
// (they stay in L1/L2).

#define MV_WARPS 4

template <int T, int NT>
__device__ __forceinline__ void mv_row(const u8* w, long long row, int cols, const float* x, int nt,
                                       float* acc) {
    int lane = threadIdx.x & 31;
    for (int u = lane; u < cols / 32; u += 32) {
        float v[32];
        load_unit<T>(w, row, cols, u, v);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float4* xp = (const float4*)(x + (long long)t * cols + 32 * u);
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    float4 a = xp[i];
                    s += v[4 * i] * a.x + v[4 * i + 1] * a.y + v[4 * i + 2] * a.z + v[4 * i + 3] * a.w;
                }
                acc[t] += s;
            }
        }
    }
}

// Several rows per warp (R) share each activation load: a lane decodes unit u of rows
// row0..row0+R and multiplies them with the same x values held in registers, so activation
// traffic through L1 drops by R and R independent weight loads are in flight per lane.
// accumulate != 0 adds into y (the residual connection) instead of overwriting it.
template <int T, int NT, int R>
__device__ void matvec_impl(const u8* w, int rows, int cols, const float* x, int nt, float* y,
                            int accumulate) {
    int row0 = (blockIdx.x * MV_WARPS + (threadIdx.x >> 5)) * R;
    if (row0 >= rows) return;
    int lane = threadIdx.x & 31;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;
    if (R == 1) {
        mv_row<T, NT>(w, row0, cols, x, nt, acc[0]);
    } else {
        for (int u = lane; u < cols / 32; u += 32) {
            float xv[NT][32];
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < nt) {
                    const float4* xp = (const float4*)(x + (long long)t * cols + 32 * u);
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        float4 a = xp[i];
                        xv[t][4 * i] = a.x; xv[t][4 * i + 1] = a.y;
                        xv[t][4 * i + 2] = a.z; xv[t][4 * i + 3] = a.w;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (row0 + r < rows) {
                    float v[32];
                    load_unit<T>(w, row0 + r, cols, u, v);
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        if (t < nt) {
                            float s = 0.0f;
#pragma unroll
                            for (int i = 0; i < 32; i++) s += v[i] * xv[t][i];
                            acc[r][t] += s;
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = warp_sum(acc[r][t]);
        if (lane == 0 && row0 + r < rows) {
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < nt) {
                    float* o = y + (long long)t * rows + row0 + r;
                    *o = accumulate ? *o + acc[r][t] : acc[r][t];
                }
            }
        }
    }
}

// Gate and up projections with the SwiGLU activation fused: y = silu(Wg x) * (Wu x).
template <int T, int NT>
__device__ void matvec_swiglu_impl(const u8* wg, const u8* wu, int rows, int cols, const float* x,
                                   int nt, float* y) {
    int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    float ag[NT], au[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) { ag[t] = 0.0f; au[t] = 0.0f; }
    mv_row<T, NT>(wg, row, cols, x, nt, ag);
    mv_row<T, NT>(wu, row, cols, x, nt, au);
#pragma unroll
    for (int t = 0; t < NT; t++) { ag[t] = warp_sum(ag[t]); au[t] = warp_sum(au[t]); }
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                float g = ag[t];
                y[(long long)t * rows + row] = ggml_swiglu(g, au[t]);
            }
        }
    }
}

#define DEF_MATVEC_NT(name, T, NT) \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS) matvec_##name##_##NT( \
        const u8* w, int rows, int cols, const float* x, int nt, float* y, int accumulate) { PDL_ENTRY(); \
        matvec_impl<T, NT, 1>(w, rows, cols, x, nt, y, accumulate); \
    } \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS) matvec_swiglu_##name##_##NT( \
        const u8* wg, const u8* wu, int rows, int cols, const float* x, int nt, float* y) { PDL_ENTRY(); \
        matvec_swiglu_impl<T, NT>(wg, wu, rows, cols, x, nt, y); \
    }

#define DEF_MATVEC_R4(name, T) \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS) matvec_r4_##name( \
        const u8* w, int rows, int cols, const float* x, int nt, float* y, int accumulate) { PDL_ENTRY(); \
        matvec_impl<T, 1, 4>(w, rows, cols, x, nt, y, accumulate); \
    } \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS) matvec_r2_##name( \
        const u8* w, int rows, int cols, const float* x, int nt, float* y, int accumulate) { PDL_ENTRY(); \
        matvec_impl<T, 1, 2>(w, rows, cols, x, nt, y, accumulate); \
    }

#define DEF_MATVEC(name, T) \
    DEF_MATVEC_NT(name, T, 1) DEF_MATVEC_NT(name, T, 2) DEF_MATVEC_NT(name, T, 4) \
    DEF_MATVEC_NT(name, T, 8) DEF_MATVEC_R4(name, T)
FOR_EACH_TYPE(DEF_MATVEC)
