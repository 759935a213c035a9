// Session 15: one-token Q4_K products a super-block per lane, in the CPU's order (`mvk_*`).
//
// `cuda_bench --roofline` put a pure streaming read of the gate/up product's 28 MB at 7.3-8.1
// us in the launch chain, against 12.5 us for `mvr_swiglu_q4_k`; streaming the same kernel's
// weights through shared memory (mvs.cu) left it at 12.5 us, so that kernel is bound by its
// instructions, not its loads: a lane per 32-weight unit decodes the unit's header and scales
// and converts its integer sums to float for every unit (~65 instructions per 32 weights).
//
// Here a lane takes one super-block (256 weights) of two rows that share an activation (a
// gate row and its up row, or rows 2k and 2k + 1): one 16-byte header load per row, the
// scales unpacked from registers, 64 dp4a per row, and the super-block's integer sums (the
// scaled sum and the min sum) kept as integers, as the CPU's `dot_q4_k_gemv` keeps them. A
// warp takes a tile of P row pairs x all super-blocks (P * SB lane tasks), writes each task's
// integer sums and f32 scales to shared memory, and then lane p < P runs its pair's two rows
// super-block by super-block in the CPU's float order:
//
//     acc  = fma(isum, d(x) * d(y), acc);  accm = fma(msum, dmin(x) * d(y), accm);  acc - accm
//
// so each output is the CPU scalar kernel's result bit for bit (crates/quant dot_q4_k_gemv).
// Shared memory: blockDim.x / 32 warps x P x 2 x SB entries of 16 bytes (dynamic).

// The integer sums of one Q4_K super-block `b` (16-byte aligned) against the Q8_K activation
// super-block (`a`: 256 int8, `d`: its 8 unit scales {d, bsum bits}): {isum, msum, bits of
// d(x) * d(y), bits of dmin(x) * d(y)}.
__device__ __forceinline__ int4 mvk_q4k_block(const uint4& h, const uint4* qs, const int4* a,
                                              const float2* d) {
    float dy = d[0].x;
    float dd = __fmul_rn(h2f((u16)(h.x & 0xffff)), dy);
    float dm = __fmul_rn(h2f((u16)(h.x >> 16)), dy);
    u32 sw[3] = {h.y, h.z, h.w};
#define MVK_SB(k) ((int)((sw[(k) >> 2] >> (8 * ((k) & 3))) & 0xff))
    int isum = 0, msum = 0;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        uint4 q0 = qs[2 * c], q1 = qs[2 * c + 1];
        u32 w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        int4 x0 = a[4 * c], x1 = a[4 * c + 1], x2 = a[4 * c + 2], x3 = a[4 * c + 3];
        int xl[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        int xh[8] = {x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            s0 = dp4a((int)(w[i] & 0x0f0f0f0fu), xl[i], s0);
            s1 = dp4a((int)((w[i] >> 4) & 0x0f0f0f0fu), xh[i], s1);
        }
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int j = 2 * c + hh;
            int sc, m;
            if (j < 4) {
                sc = MVK_SB(j) & 63;
                m = MVK_SB(j + 4) & 63;
            } else {
                sc = (MVK_SB(j + 4) & 15) | ((MVK_SB(j - 4) >> 6) << 4);
                m = (MVK_SB(j + 4) >> 4) | ((MVK_SB(j) >> 6) << 4);
            }
            int b0, b1;
            act_bsums(d[j], &b0, &b1);
            isum += sc * (hh ? s1 : s0);
            msum += m * (b0 + b1);
        }
    }
#undef MVK_SB
    return make_int4(isum, msum, __float_as_int(dd), __float_as_int(dm));
}

// A row's super-blocks in order, the CPU's dot_q4_k_gemv float steps.
__device__ __forceinline__ float mvk_q4k_chain(const int4* e, int sb) {
    float acc = 0.0f, accm = 0.0f;
    for (int s = 0; s < sb; s++) {
        int4 v = e[s];
        acc = __fmaf_rn((float)v.x, __int_as_float(v.z), acc);
        accm = __fmaf_rn((float)v.y, __int_as_float(v.w), accm);
    }
    return __fsub_rn(acc, accm);
}

// GLU: pair p is gate row p and up row p (w0, w1), y[p] = swiglu, with the down projection's
// activation quantized as the groups of 256 complete (mvr_swiglu's quant_arrive). Else pair p
// is rows 2p and 2p + 1 of w0, y (+)= each.
//
// A lane reading its own 144-byte super-block straight from global memory makes every 16-byte
// load of the warp touch 32 lines (measured: slower than mvr). So each warp first copies its
// tile's rows into shared memory with coalesced cp.async (two stages: the next tile's copy in
// flight while this one is decoded; the first issued before the wait on the kernel before),
// pair p at p * (2 * row bytes + 16), so the lanes of a quarter-warp (P pairs of one
// super-block) read distinct banks. Lane task t is pair t % P, super-block t / P.
template <bool GLU>
__device__ void mvk_q4k_impl(const u8* __restrict__ w0, const u8* __restrict__ w1, int rows,
                             int cols, const i8* __restrict__ aq, const float2* __restrict__ ad,
                             float* y, int accumulate, int P, int qfmt, u32* qcnt, i8* qso,
                             float2* dso) {
    extern __shared__ __align__(16) u8 mvk_smem[];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int sb = cols / 256;
    int rb = sb * 144;
    int pstride = 2 * rb + 16;
    int stage = P * pstride;
    int pairs = GLU ? rows : (rows + 1) / 2;
    int tiles = (pairs + P - 1) / P;
    u8* base = mvk_smem + (long long)warp * (2 * stage + P * 2 * sb * 16);
    int4* ent = (int4*)(base + 2 * stage);
    int first = blockIdx.x * nw + warp, step = gridDim.x * nw;
    auto issue = [&](int tile, int slot) {
        if (tile < tiles) {
            u8* dst = base + slot * stage;
            for (int p = 0; p < P; p++) {
                int pr = tile * P + p;
                if (pr >= pairs) break;
                const u8 *ra, *rv;
                if (GLU) {
                    ra = w0 + (long long)pr * rb;
                    rv = w1 + (long long)pr * rb;
                } else {
                    ra = w0 + (long long)(2 * pr) * rb;
                    rv = w0 + (long long)min(2 * pr + 1, rows - 1) * rb;
                }
                mvs_copy(dst + p * pstride, ra, rb);
                mvs_copy(dst + p * pstride + rb, rv, rb);
            }
        }
        cp_async_commit();
    };
    issue(first, 0);
    pdl_wait();
    pdl_launch();
    int k = 0;
    for (int tile = first; tile < tiles; tile += step, k++) {
        issue(tile + step, (k + 1) & 1);
        cp_async_wait<1>();
        __syncwarp();
        const u8* src = base + (k & 1) * stage;
        int p0 = tile * P;
        for (int t = lane; t < P * sb; t += 32) {
            int p = t % P, s = t / P;
            if (p0 + p >= pairs) continue;
            const u8* ba = src + p * pstride + 144 * s;
            const u8* bb = ba + rb;
            const int4* a = (const int4*)(aq + 256 * s);
            const float2* d = ad + 8 * s;
            uint4 ha = *(const uint4*)ba, hb = *(const uint4*)bb;
            ent[(2 * p) * sb + s] = mvk_q4k_block(ha, (const uint4*)(ba + 16), a, d);
            ent[(2 * p + 1) * sb + s] = mvk_q4k_block(hb, (const uint4*)(bb + 16), a, d);
        }
        __syncwarp();
        if (lane < P && p0 + lane < pairs) {
            int pr = p0 + lane;
            float ra = mvk_q4k_chain(ent + (2 * lane) * sb, sb);
            float rv = mvk_q4k_chain(ent + (2 * lane + 1) * sb, sb);
            if (GLU) {
                y[pr] = ggml_swiglu(ra, rv);
                __threadfence();
            } else {
                int r = 2 * pr;
                y[r] = accumulate ? y[r] + ra : ra;
                if (r + 1 < rows) y[r + 1] = accumulate ? y[r + 1] + rv : rv;
            }
        }
        __syncwarp();
        if (GLU && qfmt) {
            int g = p0 >> 8;
            quant_arrive(y, rows, g, min(256, rows - g * 256), min(P, pairs - p0), qfmt,
                         qcnt + g, qso, dso);
        }
    }
    cp_async_wait<0>();
}

extern "C" __global__ void __launch_bounds__(256) mvk_q4_k(const u8* w, int rows, int cols,
                                                           const i8* aq, const float2* ad,
                                                           float* y, int accumulate, int P) {
    mvk_q4k_impl<false>(w, w, rows, cols, aq, ad, y, accumulate, P, 0, 0, 0, 0);
}

extern "C" __global__ void __launch_bounds__(256)
    mvk_swiglu_q4_k(const u8* wg, const u8* wu, int rows, int cols, const i8* aq,
                    const float2* ad, float* y, int P, int qfmt, u32* qcnt, i8* qso,
                    float2* dso) {
    mvk_q4k_impl<true>(wg, wu, rows, cols, aq, ad, y, 0, P, qfmt, qcnt, qso, dso);
}
