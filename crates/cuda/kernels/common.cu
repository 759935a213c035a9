// Shared helpers for every kernel file. The files are concatenated in the order
// `src/compile.rs` lists them and compiled as one NVRTC program, so nothing here may
// depend on CUDA headers: NVRTC ships none by default and the CI check has none.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// Session 16: the f64 partial sums of squares of a one-token residual row that the products
// writing the row add into and the next RMSNorm reads (rms_norm's `ss`). A power of two, a
// multiple of 32 and at most 256 (rms_norm's block zeroes a set): 128 keeps the atomic adds of
// one launch (up to 3072, one per row) at ~24 per slot.
#define RMS_SLOTS 128

// Add v * v (exact in f64) of the row element at `row` into its slot (no return value: a
// reduction, so the writer does not wait for it).
__device__ __forceinline__ void ss_add(double* ss, int row, float v) {
    atomicAdd(ss + (row & (RMS_SLOTS - 1)), (double)v * (double)v);
}

// The next RMSNorm's side of the slots, for one warp: ss_load issues the lane's RMS_SLOTS / 32
// loads (apart, so the caller's other loads go out with them); ss_scale sums them in lane
// order, then by a butterfly over the warp (every lane gets the whole sum, in one fixed order),
// and returns cpu::ops::rms_norm's scale: the mean rounded to f32, 1 / sqrt(mean + eps)
// correctly rounded.
__device__ __forceinline__ void ss_load(const double* ss, double* p) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < RMS_SLOTS / 32; k++) p[k] = ss[lane + 32 * k];
}
__device__ __forceinline__ float ss_scale(const double* p, int n, float eps) {
    double v = p[0];
#pragma unroll
    for (int k = 1; k < RMS_SLOTS / 32; k++) v += p[k];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    float mean = (float)(v / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

// Programmatic dependent launch (sm_90): with the launch attribute set (device.rs), a kernel may
// be started while the one before it in the stream is still running. Every kernel therefore
// waits for its predecessor's completion (and memory) before touching anything, then lets its
// own successor start: so the successor's launch and any prologue that reads no produced data
// (the matrix-vector kernels prefetch their weights into L2) overlap this kernel, and a chain
// never runs more than one kernel ahead. Without the attribute both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// A 16-byte read-only load (ld.global.nc).
__device__ __forceinline__ uint4 ld_nc16(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// A 16-byte load that stays before a later PDL wait (session 33): the compilers keep a plain
// ld.global on its side of griddepcontrol.wait, while ptxas moved the wait above `.nc` loads
// (`__ldg` or ld_nc16), so their bytes were asked for only after the kernel before had ended.
__device__ __forceinline__ uint4 ld_early16(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

#define PDL_ENTRY() \
    do { \
        pdl_wait(); \
        pdl_launch(); \
    } while (0)

// Session 35 (`Gpu::set_pdl_small`): the small kernels of the one-token chain may let their
// successor launch *before* their own wait, so the product after an RMSNorm, quantize_act or
// attention merge loads its weights while the product before that small kernel still runs (as
// it does where no small kernel sits between two products). Safe from deadlock: a small
// kernel is launched only once every block of the kernel before it has started (those trigger
// after their wait), so the successor's blocks never stand in the way of a block its chain
// waits for; and its successor's wait still returns only after the small kernel has finished,
// which is after the kernel before it. Bit k of the mask: PDL_RMS (rms_norm, rms_norm1; the
// norms that do not write the permuted layout: the attention's and the output head's),
// PDL_QUANT (quantize_act), PDL_MERGE (attn_merge_q), PDL_HOP (pdl_hop), PDL_ATTN (the
// one-token attention attn_one*/attn_onew*), PDL_RMS_FFN (rms_norm writing the ACT_PERM layout:
// the FFN norm before the pipelined SwiGLU product).
#define PDL_RMS 1
#define PDL_QUANT 2
#define PDL_MERGE 4
#define PDL_HOP 8
#define PDL_ATTN 16
#define PDL_RMS_FFN 32
__constant__ int pdl_small_c;
#define PDL_ENTRY_SMALL(bit) \
    do { \
        if (pdl_small_c & (bit)) { \
            pdl_launch(); \
            pdl_wait(); \
        } else { \
            pdl_wait(); \
            pdl_launch(); \
        } \
    } while (0)

// One step of a (value, index) argmax: the larger value wins, the lower index among equals, and
// a NaN never wins (every comparison with it is false).
__device__ __forceinline__ void argmax_take(float& best, int& bi, float v, int i) {
    if (v > best || (v == best && i < bi)) { best = v; bi = i; }
}

// argmax_take over a warp's 32 (value, index) pairs by a butterfly: every lane ends with the
// warp's winner.
__device__ __forceinline__ void warp_argmax(float& best, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_take(best, bi, ov, oi);
    }
}

// Ask L2 for the lines of [p, p + bytes), spread over the block's threads (a hint: no fault, no
// register result).
__device__ __forceinline__ void prefetch_l2(const u8* p, long long bytes) {
    for (long long o = (long long)threadIdx.x * 128; o < bytes; o += (long long)blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

// f16 bits to f32 through the hardware conversion (no cuda_fp16.h needed).
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 to f16 bits, round to nearest even (what the CPU's `half::f16::from_f32` does).
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Loads at the widths a block's alignment allows. GGUF blocks are packed, so a block of 18,
// 22, 34, 110 or 210 bytes is only 2-byte aligned inside a row.
__device__ __forceinline__ u16 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld_u32(const u8* p) { return *(const u32*)p; }
// A 4-byte value at a 2-byte aligned address.
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    return (u32)ld_u16(p) | ((u32)ld_u16(p + 2) << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads; every thread gets the result. `sh` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    float t = lane < nw ? sh[lane] : 0.0f;
    return warp_sum(t);
}

// Sum of doubles over a block of up to 1024 threads; every thread gets the result.
__device__ __forceinline__ double block_sum_d(double v, double* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    double t = lane < nw ? sh[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// RMSNorm's scale 1 / sqrt(mean(x^2) + eps) of a row of n, computed by the whole block as
// cpu::ops::rms_norm computes it (sum of squares in f64, mean rounded to f32, correctly rounded
// reciprocal square root). The f64 sum's order depends on blockDim.x only (each thread's strided
// partial sum, then block_sum_d), so every kernel that calls this with 256 threads gets the
// bits rms_norm gets. `sh` holds 32 doubles.
// v9: each thread's loads (up to 16) are issued together before the ordered sum (one L2 round
// trip for a 3072-wide row at 256 threads instead of three); the order of the additions and so
// the bits are unchanged (and x * x is exact in f64, so contraction cannot move them).
__device__ __forceinline__ float rms_scale(const float* xr, int n, float eps, double* sh) {
    double s = 0.0;
    for (int c0 = threadIdx.x; c0 < n; c0 += 16 * blockDim.x) {
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int c = c0 + i * blockDim.x;
            v[i] = c < n ? xr[c] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 16; i++)
            if (c0 + i * (int)blockDim.x < n) s += (double)v[i] * (double)v[i];
    }
    s = block_sum_d(s, sh);
    float mean = (float)(s / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

// A load that skips L1 (data other blocks of the running kernel wrote, after a fence).
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// ggml's vector expf (quant::dot::ggml::expf, the CPU backend's SwiGLU and softmax), bit for
// bit: the same fused multiply-adds in the same order, then j * 2^n with one rounding.
__device__ __forceinline__ float ggml_expf(float x) {
    const float R = __int_as_float(0x4b400000), LOG2E = __int_as_float(0x3fb8aa3b),
                LN2_HI = __int_as_float(0x3f317200), LN2_LO = __int_as_float(0x35bfbe8e),
                P5 = __int_as_float(0x3c072010), P4 = __int_as_float(0x3d2b9f17),
                P3 = __int_as_float(0x3e2aaf33), P2 = __int_as_float(0x3efffedb),
                P1 = __int_as_float(0x3f7ffff6);
    float z = __fmaf_rn(x, LOG2E, R);
    float n = __fsub_rn(z, R);
    float b = __fmaf_rn(-n, LN2_LO, __fmaf_rn(-n, LN2_HI, x));
    float u = __fmul_rn(b, b);
    float j = __fmaf_rn(__fmaf_rn(__fmaf_rn(P5, b, P4), u, __fmaf_rn(P3, b, P2)), u,
                        __fmaf_rn(P1, b, 1.0f));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : __int_as_float(0x7f800000);
    return (float)ldexp((double)j, (int)n);
}

// silu(g) * u as the CPU backend (ggml_vec_swiglu_f32) rounds it.
__device__ __forceinline__ float ggml_swiglu(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, ggml_expf(__fsub_rn(0.0f, g)))), u);
}
