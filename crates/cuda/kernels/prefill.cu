// The prompt path's f16 GEMM operands, with the activation quantization done a warp per
// 256-element group (8 consecutive elements per lane, shuffles only) instead of a block per
// group with three barriers (quant_act_elem): the same bytes, since the largest magnitude, its
// first index and the sums are exact and each element takes the same operations.

// Quantize one 256-element group held 8 per lane (lane l: elements c0 .. c0 + 7 of the row,
// c0 = group start + 8 l) as quant_act_elem does, writing any of the int8 values qs, the scales
// ds (one float2 per 32, indexed from the row start) and the f16 values f16(d * q) xh (all
// row-relative pointers, may be null; with ACT_RAW in fmt, xh gets q itself). `valid`: this
// lane's 8 are in the row (rows are whole multiples of 32, so a lane's 8 are all in or all out).
__device__ __forceinline__ void quant8_warp(const float* v, bool valid, int c0, int fmt, i8* qs,
                                            float2* ds, u16* xh) {
    const bool raw = (fmt & ACT_RAW) != 0;
    // Session 34: ACT_PERM (Q8_K only) stores the values in k_perm's layout, as quant_act_elem
    // does: a lane's 8 lie in one sub-block, which moves as a whole.
    const bool perm = (fmt & ACT_PERM) != 0;
    fmt &= ~(ACT_RAW | ACT_PERM);
    int lane = threadIdx.x & 31;
    int q[8];
    float dq;  // the value one step of q stands for
    if (fmt == ACT_Q8_32) {
        float am = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) am = fmaxf(am, valid ? fabsf(v[i]) : 0.0f);
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
        float d = am / 127.0f;
        float id = am != 0.0f ? 127.0f / am : 0.0f;
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            q[i] = __float2int_rn(v[i] * id);
            s += q[i];
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        dq = h2f(f2h(d));
        if (valid && ds && (lane & 3) == 0) ds[c0 / 32] = make_float2(dq, h2f(f2h(d * (float)s)));
    } else {
        float a = -1.0f;
        int ai = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float m = valid && !isnan(v[i]) ? fabsf(v[i]) : -1.0f;
            if (m > a) { a = m; ai = lane * 8 + i; }
        }
        warp_argmax(a, ai);
        float xm = __shfl_sync(0xffffffffu, v[0], 0);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float t = __shfl_sync(0xffffffffu, v[i], (ai >> 3) & 31);
            if ((ai & 7) == i) xm = t;
        }
        float d = 0.0f, iscale = 0.0f;
        bool nz = a > 0.0f;
        if (nz) {
            iscale = -127.0f / xm;
            d = 1.0f / iscale;
        }
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            q[i] = nz ? min(__float2int_rn(iscale * v[i]), 127) : 0;
            s += q[i];
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        int s_hi = __shfl_down_sync(0xffffffffu, s, 2);
        dq = d;
        if (valid && ds && (lane & 3) == 0)
            ds[c0 / 32] = make_float2(d, __int_as_float((s & 0xffff) | (s_hi << 16)));
    }
    if (!valid) return;
    if (qs) {
        u32 w0 = 0u, w1 = 0u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w0 |= ((u32)(q[i] & 0xff)) << (8 * i);
            w1 |= ((u32)(q[i + 4] & 0xff)) << (8 * i);
        }
        *(uint2*)(qs + (perm ? k_perm(c0) : c0)) = make_uint2(w0, w1);
    }
    if (xh) {
        u32 h[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            h[i] = raw ? (u32)f2h((float)q[2 * i]) | ((u32)f2h((float)q[2 * i + 1]) << 16)
                       : (u32)f2h(dq * (float)q[2 * i]) | ((u32)f2h(dq * (float)q[2 * i + 1]) << 16);
        *(uint4*)(xh + c0) = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

// rms_norm (ops.cu) for prompt-sized steps: one block of 256 threads per row (same f64 sum of
// squares, so the same scale bits), then each warp normalizes and quantizes whole 256-element
// groups. out (may be null) gets the normalized row; out_h the f16 operand (f16(d * q) when
// fmt != 0, else plain f16); qs/ds the quantized row (may be null). grid = (rows, ceil(n /
// 2048)): each block sums the whole row (the same bits in every block) and takes a warp per
// group of its 2048 columns (session 10: a 64-row step was 64 blocks on 132 SMs).
extern "C" __global__ void rms_norm_w(const float* x, const float* w, int n, float eps,
                                      float* out, u16* out_h, int fmt, i8* qs, float2* ds) {
    PDL_ENTRY();
    __shared__ double sh[32];
    long long r = blockIdx.x;
    const float* xr = x + r * n;
    float scale = rms_scale(xr, n, eps, sh);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g0 = (blockIdx.y * 8 + warp) * 256; g0 < n; g0 += gridDim.y * 8 * 256) {
        int c0 = g0 + lane * 8;
        bool valid = c0 < n;
        float o[8];
        if (valid) {
            float4 a = *(const float4*)(xr + c0), b = *(const float4*)(xr + c0 + 4);
            float4 wa = *(const float4*)(w + c0), wb = *(const float4*)(w + c0 + 4);
            float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
            float wv[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = __fmul_rn(__fmul_rn(xv[i], scale), wv[i]);
            if (out) {
                *(float4*)(out + r * n + c0) = make_float4(o[0], o[1], o[2], o[3]);
                *(float4*)(out + r * n + c0 + 4) = make_float4(o[4], o[5], o[6], o[7]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = 0.0f;
        }
        if (fmt) {
            quant8_warp(o, valid, c0, fmt, qs ? qs + r * n : qs, ds ? ds + r * (n / 32) : ds,
                        out_h ? out_h + r * n : out_h);
        } else if (valid && out_h) {
            u32 h[4];
#pragma unroll
            for (int i = 0; i < 4; i++) h[i] = (u32)f2h(o[2 * i]) | ((u32)f2h(o[2 * i + 1]) << 16);
            *(uint4*)(out_h + r * n + c0) = make_uint4(h[0], h[1], h[2], h[3]);
        }
    }
}

// Rows of x (n columns) quantized in fmt as quantize_act does: int8 values qs and scales ds
// and/or the f16 GEMM operand xh (f16(d * q), q with ACT_RAW; plain f16 when fmt == 0), any of
// them null; with
// u != null, x = silu(x) * u first (ggml's SwiGLU, written back to x), as swiglu_q. Rows of x
// and u are xs floats apart (n, or the width of one fused gate/up product's rows, v10); the
// outputs' rows are dense.
// grid = (rows, ceil(n / (256 * warps))), blockDim.x = 32 * warps: a warp per 256-element group.
extern "C" __global__ void act_quant_w(float* x, const float* u, int n, int fmt, i8* qs,
                                       float2* ds, u16* xh, long long xs) {
    PDL_ENTRY();
    long long r = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int c0 = (blockIdx.y * nw + warp) * 256 + lane * 8;
    if ((blockIdx.y * nw + warp) * 256 >= n) return;  // whole warps leave together
    bool valid = c0 < n;
    float v[8];
    if (valid) {
        float* xr = x + r * xs + c0;
        float4 a = *(const float4*)xr, b = *(const float4*)(xr + 4);
        float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        if (u) {
            const float* ur = u + r * xs + c0;
            float4 ua = *(const float4*)ur, ub = *(const float4*)(ur + 4);
            float uv[8] = {ua.x, ua.y, ua.z, ua.w, ub.x, ub.y, ub.z, ub.w};
#pragma unroll
            for (int i = 0; i < 8; i++) xv[i] = ggml_swiglu(xv[i], uv[i]);
            *(float4*)xr = make_float4(xv[0], xv[1], xv[2], xv[3]);
            *(float4*)(xr + 4) = make_float4(xv[4], xv[5], xv[6], xv[7]);
        }
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = xv[i];
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = 0.0f;
    }
    if (fmt) {
        quant8_warp(v, valid, c0, fmt, qs ? qs + r * n : qs, ds ? ds + r * (n / 32) : ds,
                    xh ? xh + r * n : xh);
    } else if (valid && xh) {
        u32 h[4];
#pragma unroll
        for (int i = 0; i < 4; i++) h[i] = (u32)f2h(v[2 * i]) | ((u32)f2h(v[2 * i + 1]) << 16);
        *(uint4*)(xh + r * n + c0) = make_uint4(h[0], h[1], h[2], h[3]);
    }
}
