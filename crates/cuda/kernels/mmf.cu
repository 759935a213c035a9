// Batched-decode products (9..64 tokens) on the tensor cores, reading the quantized weights
// themselves: y[t, r] (+)= sum_k W16[r, k] * X16[t, k], where W16 is exactly the f16 copy
// dequant_f16 (quant.cu) makes (each 32-element unit decoded by the same Q<T>::unit, then
// rounded to f16 the same way) and X16 is the f16 operand the cuBLAS path multiplies
// (act_f16_w / quantize_act_f16 / to_f16). mma.sync m16n8k16 f16 x f16 -> f32, so the
// operands are cuBLAS's and only the order of the f32 sum differs.
//
// Layout. Block = blockDim.x / 32 warps (4 or 8); warp w owns MMF_MT row tiles of 16 rows, so a
// block owns 32 rows per warp, consecutive, for every token of the step (more warps per block:
// fewer passes over the activations per matrix). blockIdx.y splits the row's 32-element
// units into equal slices (split K, for matrices with few row tiles); slices other than the
// only one write f32 partial sums to `ws`, and the last block of a row tile to arrive (a
// counter per row tile, left at zero) adds them in slice order: deterministic.
//
// The k order inside a mma is free as long as A and B agree on it. Lane (g = lane / 4, c =
// lane % 4) decodes unit 4i + c of its rows (32 consecutive k) for group i of 4 units, and the
// group's 8 k-steps of 16 take, from every lane, 4 consecutive k of its unit: k-step s maps the
// fragment's slots {2c, 2c+1, 2c+8, 2c+9} to unit-local k {4s .. 4s+3}. So a lane's weights
// are decoded into its own registers, and its activation operand for two k-steps is one 16-byte
// shared-memory load. The block's activation slice (all tokens, its units) is loaded once (in
// chunks when it does not fit), by cp.async, with the first weight stage.
//
// Activations in shared memory: token rows of MMF_S(groups) bytes (256 per group of 4 units plus
// 64, so consecutive tokens fall 64 bytes apart modulo 128); inside a group the 16 chunks of 8
// halves (unit c, eighth t) sit at position 4t + c, so the 4 lanes of one token read 64
// consecutive bytes and two tokens the two halves of the banks: no bank conflicts.

#define MMF_MT 2

__device__ __forceinline__ u32 mmf_pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void mma_f16_k16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                            u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Exact small integer q as a float without the conversion unit (I2F runs at a quarter of the
// FP32 rate): byte `sel` of x placed under the exponent of 2^23 gives 2^23 + q, and the
// subtraction of 2^23 + bias is exact. So these decoders compute the same floats as Q<T>::unit
// (the one-hot test checks it bit for bit against dequant_f16).
__device__ __forceinline__ float mmf_qf(u32 x, int sel, float bias) {
    return __fsub_rn(__int_as_float(__byte_perm(x, 0x4B000000u, sel | 0x7540)), bias);
}

// Q<T>::unit's values from shared memory, for the types where the faster form exists (Q4_K,
// Q6_K); `fast` false, or any other type: Q<T>::unit itself.
template <int T>
__device__ __forceinline__ void mmf_dec(const u8* b, int j, bool fast, float* v) {
    if (T == T_Q4_K && fast) {
        u32 dd = ld_u32(b);
        float d = h2f((u16)(dd & 0xffff)), dmin = h2f((u16)(dd >> 16));
        int sc, mn;
        k4_scale_min(b + 4, j, &sc, &mn);
        float dl = d * (float)sc, ml = dmin * (float)mn;
        int shift = 4 * (j & 1);
        const uint4* q = (const uint4*)(b + 16 + 32 * (j / 2));
#pragma unroll
        for (int i = 0; i < 2; i++) {
            uint4 a = q[i];
            u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int t = 0; t < 4; t++) {
                u32 x = (w[t] >> shift) & 0x0F0F0F0Fu;
#pragma unroll
                for (int k = 0; k < 4; k++)
                    v[16 * i + 4 * t + k] = __fmaf_rn(dl, mmf_qf(x, k, 8388608.0f), -ml);
            }
        }
    } else if (T == T_Q6_K && fast) {
        float d = h2f(ld_u16(b + 208));
        int h = j / 4, k = j % 4;
        u32 scw = ld_u16(b + 192 + 8 * h + 2 * k);
        float d0 = d * (float)(i8)(scw & 0xff), d1 = d * (float)(i8)(scw >> 8);
        const u8* ql = b + 64 * h + 32 * (k & 1);
        const u8* qh = b + 128 + 32 * h;
        int ls = 4 * (k >> 1), hs = 2 * k;
        // 8 words of each from the 4-byte aligned address at or below (blocks are 2-aligned).
        u32 wl[8], wh[8];
        int off = (int)((unsigned long long)ql & 3ull);
        const u32* pl = (const u32*)(ql - off);
        const u32* ph = (const u32*)(qh - off);
        if (off == 0) {
#pragma unroll
            for (int i = 0; i < 8; i++) { wl[i] = pl[i]; wh[i] = ph[i]; }
        } else {
            u32 al[9], ah[9];
#pragma unroll
            for (int i = 0; i < 9; i++) { al[i] = pl[i]; ah[i] = ph[i]; }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                wl[i] = __funnelshift_r(al[i], al[i + 1], 16);
                wh[i] = __funnelshift_r(ah[i], ah[i + 1], 16);
            }
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 x = ((wl[i] >> ls) & 0x0F0F0F0Fu) | (((wh[i] >> hs) & 0x03030303u) << 4);
#pragma unroll
            for (int t = 0; t < 4; t++)
                v[4 * i + t] = (i < 4 ? d0 : d1) * mmf_qf(x, t, 8388640.0f);
        }
    } else {
        Q<T>::unit(b, j, v);
    }
}

// Raw weight bytes are staged per warp in shared memory: a stage is 8 units (one K-quant
// super-block, or 8 legacy blocks) of the warp's 32 rows, copied with coalesced cp.async (16
// bytes where blocks are 16-byte aligned, else 4-byte words from the aligned address below the
// stage, the block then starting `off` = 0 or 2 bytes into its row), two stages per warp in
// flight. (v1 decoded straight from global memory: every load instruction of a warp touched 32
// rows' lines, ~0.2 TB/s.)
template <int T, int WR> struct MmfStage {
    static constexpr int UPB = Q<T>::BE / 32;
    static constexpr int BYTES = 8 / UPB * Q<T>::BB;          // one row's stage
    static constexpr int CP = Q<T>::BB % 16 == 0 ? 16 : 4;    // copy width
    static constexpr int NW = (BYTES + CP - 1) / CP + (CP == 4 ? 1 : 0);  // copies per row
    static constexpr int RS = (NW * CP + 15) / 16 * 16;       // shared-memory row stride
    static constexpr int WS = WR * RS;                        // one warp's stage buffer
};

// Issue the copies of stage [ua, ua + 8) of rows row0 .. row0 + WR - 1 into buf.
template <int T, int WR>
__device__ __forceinline__ void mmf_stage_load(const u8* w, long long row_bytes, const u8* wend,
                                               int rows, int row0, int ua, int u1, u8* buf) {
    using M = MmfStage<T, WR>;
    const int lane = threadIdx.x & 31;
    const int nb = M::UPB > 1 ? 1 : min(8, u1 - ua);  // blocks in this stage
    const int bytes = nb * Q<T>::BB;
#pragma unroll 4
    for (int it = lane; it < WR * M::NW; it += 32) {
        int r = it / M::NW, k = it % M::NW;
        int row = row0 + r;
        if (row >= rows) continue;
        const u8* gs = w + row * row_bytes + (long long)(ua / M::UPB) * Q<T>::BB;
        if (M::CP == 16) {
            if (k * 16 < bytes) cp_async16(buf + r * M::RS + k * 16, gs + k * 16, 16);
        } else {
            const u8* a = (const u8*)((unsigned long long)gs & ~3ull);
            const u8* src = a + 4 * k;
            if (src < gs + bytes) {
                int nbytes = (int)min((long long)4, (long long)(wend - src));
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(
                                 smem_u32(buf + r * M::RS + 4 * k)),
                             "l"(src), "r"(nbytes));
            }
        }
    }
}

// Issue the copies of the activation chunk [c0, c1) of 8 * NT token rows into sh (the layout
// of the header comment; rows past ntok and units past c1 are zero-filled).
template <int NT>
__device__ __forceinline__ void mmf_acts_load(const u16* x, int cols, int ntok, int c0, int c1,
                                              int S, u8* sh) {
    const int groups = (c1 - c0 + 3) / 4;
    // Token n, unit c0 + 4i + cc, eighth t at n * S + 256 i + 16 (4t + cc).
    for (int q = threadIdx.x; q < 8 * NT * groups * 16; q += blockDim.x) {
        int n = q / (groups * 16), r = q % (groups * 16), i = r / 16, cc = (r / 4) & 3, t = r & 3;
        int u = c0 + 4 * i + cc;
        bool in = n < ntok && u < c1;
        const u16* src = in ? x + (long long)n * cols + 32 * u + 8 * t : x;
        cp_async16(sh + n * S + 256 * i + 16 * (4 * t + cc), src, in ? 16 : 0);
    }
}

// Write a block's sums: straight to y with one K slice, else this slice's partials to ws, and
// the last block of the row tile to arrive adds every slice's in slice order (deterministic)
// and leaves its counter at zero. a[m][j][e]: row row0 + 16 m + 8 (e / 2) + g, token
// 8 j + 2 c + e % 2; rpb: rows per block.
template <int MT, int NT>
__device__ __forceinline__ void mmf_finish(float (&a)[MT][NT][4], float* y, int rows, int ntok,
                                           int acc, int row0, int rpb, float* ws, u32* cnt) {
    __shared__ int last;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    // One K slice: into y (adding to it when accumulating); else this slice's partials.
    const bool one = gridDim.y == 1;
    float* dst = one ? y : ws + (long long)blockIdx.y * ntok * rows;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = row0 + 16 * m + 8 * (e >> 1) + g, n = 8 * j + 2 * c + (e & 1);
                if (row < rows && n < ntok) {
                    float* o = dst + (long long)n * rows + row;
                    *o = one && acc ? *o + a[m][j][e] : a[m][j][e];
                }
            }
    if (one) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(cnt + blockIdx.x, 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int rb = blockIdx.x * rpb;
    const long long stride = (long long)ntok * rows;
    if ((rows & 3) == 0) {
        // Four rows per thread, four such items in flight, every slice's loads issued together.
        const int q4 = rpb / 4;
        for (int q0 = threadIdx.x; q0 < q4 * ntok; q0 += 4 * blockDim.x) {
            float4 sum[4];
#pragma unroll
            for (int i = 0; i < 4; i++) sum[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
            for (int k = 0; k < (int)gridDim.y; k++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int q = q0 + i * blockDim.x, row = rb + 4 * (q % q4), n = q / q4;
                    if (q < q4 * ntok && row < rows) {
                        float4 v;
                        asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                                     : "l"(ws + k * stride + (long long)n * rows + row));
                        sum[i].x += v.x; sum[i].y += v.y; sum[i].z += v.z; sum[i].w += v.w;
                    }
                }
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int q = q0 + i * blockDim.x, row = rb + 4 * (q % q4), n = q / q4;
                if (q < q4 * ntok && row < rows) {
                    float4* o = (float4*)(y + (long long)n * rows + row);
                    float4 s4 = sum[i];
                    if (acc) {
                        float4 y4 = *o;
                        s4 = make_float4(y4.x + s4.x, y4.y + s4.y, y4.z + s4.z, y4.w + s4.w);
                    }
                    *o = s4;
                }
            }
        }
    } else {
        for (int q = threadIdx.x; q < rpb * ntok; q += blockDim.x) {
            int row = rb + q % rpb, n = q / rpb;
            if (row >= rows) continue;
            long long o = (long long)n * rows + row;
            float s = 0.0f;
            for (int k = 0; k < (int)gridDim.y; k++) s += ld_cg(ws + k * stride + o);
            y[o] = acc ? y[o] + s : s;
        }
    }
    if (threadIdx.x == 0) cnt[blockIdx.x] = 0u;
}

// grid = (row tiles of 32 * warps rows, K slices); blockDim = 32 * warps; dynamic shared memory
// 8 * NT token rows of 64 * chunk + 64 bytes, then two stage buffers per warp. `per`: units per
// K slice, `chunk`: units per shared-memory load of the activations (both multiples of 8). x: f16
// operand, ntok rows of cols. y: ntok rows of `rows` floats. ws: gridDim.y * ntok * rows floats
// (unused when gridDim.y == 1); cnt: one zeroed counter per row tile.
template <int T, int NT>
__device__ void mmf_impl(const u8* w, int rows, int cols, const u16* x, int ntok, float* y,
                         int acc, int per, int chunk, float* ws, u32* cnt, bool fast) {
    using M = MmfStage<T, 16 * MMF_MT>;
    extern __shared__ __align__(16) u8 mmf_sh[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int units = cols / 32;
    const int u0 = blockIdx.y * per, u1 = min(units, u0 + per);
    const int S = chunk * 64 + 64;
    const int rpb = (blockDim.x >> 5) * MMF_MT * 16;
    const int row0 = blockIdx.x * rpb + warp * MMF_MT * 16;
    const long long row_bytes = (long long)(cols / Q<T>::BE) * Q<T>::BB;
    const u8* wend = w + (long long)rows * row_bytes;
    u8* wbuf = mmf_sh + 8 * NT * S + warp * 2 * M::WS;

    float a[MMF_MT][NT][4];
#pragma unroll
    for (int m = 0; m < MMF_MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) a[m][j][e] = 0.0f;

    for (int c0 = u0; c0 < u1; c0 += chunk) {
        const int c1 = min(u1, c0 + chunk);
        if (c0 != u0) __syncthreads();  // every warp is done with the previous chunk
        mmf_acts_load<NT>(x, cols, ntok, c0, c1, S, mmf_sh);
        mmf_stage_load<T, 16 * MMF_MT>(w, row_bytes, wend, rows, row0, c0, c1, wbuf);
        cp_async_commit();
        for (int ua = c0, st = 0; ua < c1; ua += 8, st++) {
            u8* buf = wbuf + (st & 1) * M::WS;
            if (ua + 8 < c1) {
                mmf_stage_load<T, 16 * MMF_MT>(w, row_bytes, wend, rows, row0, ua + 8, c1,
                                  wbuf + ((st + 1) & 1) * M::WS);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            if (st == 0) __syncthreads();  // the activations, copied by every warp
            else __syncwarp();
#pragma unroll
            for (int gi = 0; gi < 2; gi++) {
                const int lu = 4 * gi + c, u = ua + lu;
                if (ua + 4 * gi >= c1) break;
                u32 p[MMF_MT][2][16];
#pragma unroll
                for (int m = 0; m < MMF_MT; m++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        int rr = 16 * m + 8 * h + g, row = row0 + rr;
                        if (u < c1 && row < rows) {
                            const u8* gs = w + row * row_bytes + (long long)(ua / M::UPB) * Q<T>::BB;
                            int off = M::CP == 4 ? (int)((unsigned long long)gs & 3ull) : 0;
                            float v[32];
                            mmf_dec<T>(buf + rr * M::RS + off + (lu / M::UPB) * Q<T>::BB,
                                       lu % M::UPB, fast, v);
#pragma unroll
                            for (int i = 0; i < 16; i++) p[m][h][i] = mmf_pack(v[2 * i], v[2 * i + 1]);
                        } else {
#pragma unroll
                            for (int i = 0; i < 16; i++) p[m][h][i] = 0u;
                        }
                    }
                const u8* xs = mmf_sh + 256 * ((ua - c0) / 4 + gi) + 16 * c;
#pragma unroll
                for (int t = 0; t < 4; t++) {
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        uint4 b = *(const uint4*)(xs + (8 * j + g) * S + 64 * t);
#pragma unroll
                        for (int m = 0; m < MMF_MT; m++) {
                            mma_f16_k16(a[m][j], p[m][0][4 * t], p[m][1][4 * t],
                                        p[m][0][4 * t + 1], p[m][1][4 * t + 1], b.x, b.y);
                            mma_f16_k16(a[m][j], p[m][0][4 * t + 2], p[m][1][4 * t + 2],
                                        p[m][0][4 * t + 3], p[m][1][4 * t + 3], b.z, b.w);
                        }
                    }
                }
            }
            __syncwarp();  // every lane is done with buf before it is refilled
        }
    }

    mmf_finish<MMF_MT, NT>(a, y, rows, ntok, acc, row0, rpb, ws, cnt);
}

#define DEF_MMF_NT(name, T, NT) \
    extern "C" __global__ void __launch_bounds__(256) mmf_##name##_##NT( \
        const u8* w, int rows, int cols, const u16* x, int ntok, float* y, int acc, int per, \
        int chunk, float* ws, u32* cnt, int fast) { \
        PDL_ENTRY(); \
        mmf_impl<T, NT>(w, rows, cols, x, ntok, y, acc, per, chunk, ws, cnt, fast != 0); \
    }
#define DEF_MMF(name, T) DEF_MMF_NT(name, T, 2) DEF_MMF_NT(name, T, 4) DEF_MMF_NT(name, T, 8)
FOR_EACH_QTYPE(DEF_MMF)

// ---------------------------------------------------------------------------------------------
// mmk: Q4_K products of 9..64-token steps on the tensor cores, in the CPU's integer order.
//
// The activations are Q8_K (act_quant_w with ACT_RAW): x = dt * qa with one dt per token and
// super-block, qa the int8 values, held in the f16 operand as themselves (exact), and `ds` (one
// float2 per 32: dt, the two 16-element sums of qa). A Q4_K weight is d * sc_j * q - dmin * m_j
// (sub-block j of 32, 6-bit sc_j and m_j, 4-bit q). Per super-block and (row, token) the
// kernel forms
//   C  = sum_k (q_k * sc_j(k)) * qa_k    (f16 mma; q * sc <= 945 is exact in f16, every product
//                                          and partial sum an integer, exact in f32 below 2^24)
//   Cm = sum_j m_j * bsum_j              (one more mma per super-block: bsum_j = 32 h + l with
//                                          h, l exact in f16, m_j against both; exact)
// and y += (d dt) C - (dmin dt) Cm: the CPU's one-token Q4_K x Q8_K sums (isum, msum) exactly
// where C < 2^24 (always, for real activations), scaled in f32 per super-block.
//
// The weight operand is made without the conversion unit: the nibbles of a word (masked in
// place, low or high by the unit's parity) go under the f16 exponent of 1024 by one byte
// permute (1024 + q, or 1024 + 16 q for a high nibble) and one f16x2 fma takes them to q * sc
// exactly: (1024 + q) sc - 1024 sc, or (1024 + 16 q) (sc / 16) - 64 sc.
//
// Layout as mmf_impl's (lane (g, c) owns unit 4 gi + c of each half super-block gi, the same
// activation layout), with one m16 tile per warp (16 rows) so the per-super-block sums C fit
// beside the accumulators. Shared memory after the activations: per super-block of the chunk
// and token, the min operand (32 bytes: lane c's b0 = {32 h_2c, 32 h_2c+1}, b1 = {l_2c,
// l_2c+1} at 8 c) and dt (a float), then two weight stages per warp.

#define MMK_WR 16

__device__ __forceinline__ u32 hfma2_u(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

template <int NT>
__device__ void mmk_q4k_impl(const u8* w, int rows, int cols, const u16* xq, const float2* ds,
                             int ntok, float* y, int acc, int per, int chunk, float* ws,
                             u32* cnt) {
    using M = MmfStage<T_Q4_K, MMK_WR>;
    extern __shared__ __align__(16) u8 mmf_sh[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int units = cols / 32;
    const int u0 = blockIdx.y * per, u1 = min(units, u0 + per);
    const int S = chunk * 64 + 64;
    const int sbc = chunk / 8;
    const int rpb = (blockDim.x >> 5) * MMK_WR;
    const int row0 = blockIdx.x * rpb + warp * MMK_WR;
    const long long row_bytes = (long long)(cols / 256) * 144;
    const u8* wend = w + (long long)rows * row_bytes;
    u8* mt = mmf_sh + 8 * NT * S;
    float* dts = (float*)(mt + sbc * 8 * NT * 32);
    u8* wbuf = (u8*)(dts + sbc * 8 * NT) + warp * 2 * M::WS;
    const bool v0 = row0 + g < rows, v1 = row0 + g + 8 < rows;
    // The lane's units are 4 gi + c: low nibbles for even c, high for odd.
    const u32 mask = (c & 1) ? 0xF0F0F0F0u : 0x0F0F0F0Fu;

    float a[1][NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) a[0][j][e] = 0.0f;

    for (int c0 = u0; c0 < u1; c0 += chunk) {
        const int c1 = min(u1, c0 + chunk);
        if (c0 != u0) __syncthreads();  // every warp is done with the previous chunk
        mmf_acts_load<NT>(xq, cols, ntok, c0, c1, S, mmf_sh);
        mmf_stage_load<T_Q4_K, MMK_WR>(w, row_bytes, wend, rows, row0, c0, c1, wbuf);
        cp_async_commit();
        // The min operand and dt of each (super-block, token) of the chunk.
        const int nsb = (c1 - c0) / 8;
        for (int q = threadIdx.x; q < nsb * 8 * NT; q += blockDim.x) {
            const int sb = q / (8 * NT), n = q % (8 * NT);
            int bs[8];
            float dt = 0.0f;
            if (n < ntok) {
                const float2* p = ds + (long long)n * units + c0 + 8 * sb;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    float2 v = p[i];
                    u32 bits = __float_as_uint(v.y);
                    bs[i] = (int)(short)(bits & 0xffffu) + (int)(short)(bits >> 16);
                    dt = v.x;
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) bs[i] = 0;
            }
            u32 o[8];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int b0 = bs[2 * k], b1 = bs[2 * k + 1];
                o[2 * k] = (u32)f2h((float)((b0 >> 5) * 32)) | ((u32)f2h((float)((b1 >> 5) * 32)) << 16);
                o[2 * k + 1] = (u32)f2h((float)(b0 & 31)) | ((u32)f2h((float)(b1 & 31)) << 16);
            }
            uint4* dst = (uint4*)(mt + (sb * 8 * NT + n) * 32);
            dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
            dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
            dts[sb * 8 * NT + n] = dt;
        }
        for (int ua = c0, st = 0; ua < c1; ua += 8, st++) {
            u8* buf = wbuf + (st & 1) * M::WS;
            if (ua + 8 < c1) {
                mmf_stage_load<T_Q4_K, MMK_WR>(w, row_bytes, wend, rows, row0, ua + 8, c1,
                                               wbuf + ((st + 1) & 1) * M::WS);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            if (st == 0) __syncthreads();  // the activations and tables, from every warp
            else __syncwarp();
            const int sb = (ua - c0) / 8;
            const u8* r0 = buf + g * M::RS;
            const u8* r1 = buf + (g + 8) * M::RS;
            const u32 h0 = ld_u32(r0), h1 = ld_u32(r1);
            const float dw0 = v0 ? h2f((u16)(h0 & 0xffff)) : 0.0f;
            const float dm0 = v0 ? h2f((u16)(h0 >> 16)) : 0.0f;
            const float dw1 = v1 ? h2f((u16)(h1 & 0xffff)) : 0.0f;
            const float dm1 = v1 ? h2f((u16)(h1 >> 16)) : 0.0f;
            // Min operand of the lane: m of sub-blocks 2c, 2c + 1 of both rows.
            u32 am0, am1;
            {
                int t, m0, m1;
                k4_scale_min(r0 + 4, 2 * c, &t, &m0);
                k4_scale_min(r0 + 4, 2 * c + 1, &t, &m1);
                am0 = mmf_pack((float)m0, (float)m1);
                k4_scale_min(r1 + 4, 2 * c, &t, &m0);
                k4_scale_min(r1 + 4, 2 * c + 1, &t, &m1);
                am1 = mmf_pack((float)m0, (float)m1);
            }
            float C[NT][4];
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) C[j][e] = 0.0f;
#pragma unroll
            for (int gi = 0; gi < 2; gi++) {
                const int jj = 4 * gi + c;
                u32 sm[2], so[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int sc, mn;
                    k4_scale_min((h ? r1 : r0) + 4, jj, &sc, &mn);
                    float f = (c & 1) ? (float)sc * 0.0625f : (float)sc;
                    float off = (c & 1) ? -64.0f * (float)sc : -1024.0f * (float)sc;
                    sm[h] = mmf_pack(f, f);
                    so[h] = mmf_pack(off, off);
                }
                const uint4* q0 = (const uint4*)(r0 + 16 + 32 * (jj >> 1));
                const uint4* q1 = (const uint4*)(r1 + 16 + 32 * (jj >> 1));
                const uint4 x0a = q0[0], x0b = q0[1], x1a = q1[0], x1b = q1[1];
                const u32 W0[8] = {x0a.x, x0a.y, x0a.z, x0a.w, x0b.x, x0b.y, x0b.z, x0b.w};
                const u32 W1[8] = {x1a.x, x1a.y, x1a.z, x1a.w, x1b.x, x1b.y, x1b.z, x1b.w};
                const u8* xs = mmf_sh + 256 * ((ua - c0) / 4 + gi) + 16 * c;
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    // Values 8t .. 8t + 7 of the lane's unit: words 2t, 2t + 1.
                    const u32 m0a = W0[2 * t] & mask, m0b = W0[2 * t + 1] & mask;
                    const u32 m1a = W1[2 * t] & mask, m1b = W1[2 * t + 1] & mask;
                    const u32 A00 = hfma2_u(__byte_perm(m0a, 0x64646464u, 0x5140), sm[0], so[0]);
                    const u32 A01 = hfma2_u(__byte_perm(m0a, 0x64646464u, 0x5342), sm[0], so[0]);
                    const u32 A02 = hfma2_u(__byte_perm(m0b, 0x64646464u, 0x5140), sm[0], so[0]);
                    const u32 A03 = hfma2_u(__byte_perm(m0b, 0x64646464u, 0x5342), sm[0], so[0]);
                    const u32 A10 = hfma2_u(__byte_perm(m1a, 0x64646464u, 0x5140), sm[1], so[1]);
                    const u32 A11 = hfma2_u(__byte_perm(m1a, 0x64646464u, 0x5342), sm[1], so[1]);
                    const u32 A12 = hfma2_u(__byte_perm(m1b, 0x64646464u, 0x5140), sm[1], so[1]);
                    const u32 A13 = hfma2_u(__byte_perm(m1b, 0x64646464u, 0x5342), sm[1], so[1]);
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        uint4 b = *(const uint4*)(xs + (8 * j + g) * S + 64 * t);
                        mma_f16_k16(C[j], A00, A10, A01, A11, b.x, b.y);
                        mma_f16_k16(C[j], A02, A12, A03, A13, b.z, b.w);
                    }
                }
            }
            // y += (d dt) C - (dmin dt) Cm for this super-block.
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const uint2 bm = *(const uint2*)(mt + (sb * 8 * NT + 8 * j + g) * 32 + 8 * c);
                const float2 dt = *(const float2*)(dts + sb * 8 * NT + 8 * j + 2 * c);
                float Cm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_f16_k16(Cm, am0, am1, am0, am1, bm.x, bm.y);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float td = (e & 1) ? dt.y : dt.x;
                    const float dw = (e >> 1) ? dw1 : dw0, dm = (e >> 1) ? dm1 : dm0;
                    a[0][j][e] = fmaf(C[j][e], dw * td, a[0][j][e]);
                    a[0][j][e] = fmaf(-Cm[e], dm * td, a[0][j][e]);
                }
            }
            __syncwarp();  // every lane is done with buf before it is refilled
        }
    }

    mmf_finish<1, NT>(a, y, rows, ntok, acc, row0, rpb, ws, cnt);
}

#define DEF_MMK(NT) \
    extern "C" __global__ void __launch_bounds__(256, 2) mmk_q4_k_##NT( \
        const u8* w, int rows, int cols, const u16* xq, const float2* ds, int ntok, float* y, \
        int acc, int per, int chunk, float* ws, u32* cnt) { \
        PDL_ENTRY(); \
        mmk_q4k_impl<NT>(w, rows, cols, xq, ds, ntok, y, acc, per, chunk, ws, cnt); \
    }
DEF_MMK(2)
DEF_MMK(4)
DEF_MMK(8)
