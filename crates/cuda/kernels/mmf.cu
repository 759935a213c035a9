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
template <int T> struct MmfStage {
    static constexpr int UPB = Q<T>::BE / 32;
    static constexpr int BYTES = 8 / UPB * Q<T>::BB;          // one row's stage
    static constexpr int CP = Q<T>::BB % 16 == 0 ? 16 : 4;    // copy width
    static constexpr int NW = (BYTES + CP - 1) / CP + (CP == 4 ? 1 : 0);  // copies per row
    static constexpr int RS = (NW * CP + 15) / 16 * 16;       // shared-memory row stride
    static constexpr int WS = 32 * RS;                        // one warp's stage buffer
};

// Issue the copies of stage [ua, ua + 8) of rows row0 .. row0 + 31 into buf.
template <int T>
__device__ __forceinline__ void mmf_stage_load(const u8* w, long long row_bytes, const u8* wend,
                                               int rows, int row0, int ua, int u1, u8* buf) {
    using M = MmfStage<T>;
    const int lane = threadIdx.x & 31;
    const int nb = M::UPB > 1 ? 1 : min(8, u1 - ua);  // blocks in this stage
    const int bytes = nb * Q<T>::BB;
#pragma unroll 4
    for (int it = lane; it < 32 * M::NW; it += 32) {
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

// grid = (row tiles of 32 * warps rows, K slices); blockDim = 32 * warps; dynamic shared memory
// 8 * NT token rows of 64 * chunk + 64 bytes, then two stage buffers per warp. `per`: units per
// K slice, `chunk`: units per shared-memory load of the activations (both multiples of 8). x: f16
// operand, ntok rows of cols. y: ntok rows of `rows` floats. ws: gridDim.y * ntok * rows floats
// (unused when gridDim.y == 1); cnt: one zeroed counter per row tile.
template <int T, int NT>
__device__ void mmf_impl(const u8* w, int rows, int cols, const u16* x, int ntok, float* y,
                         int acc, int per, int chunk, float* ws, u32* cnt, bool fast) {
    using M = MmfStage<T>;
    extern __shared__ __align__(16) u8 mmf_sh[];
    __shared__ int last;
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
        const int c1 = min(u1, c0 + chunk), groups = (c1 - c0 + 3) / 4;
        if (c0 != u0) __syncthreads();  // every warp is done with the previous chunk
        // Token n, unit c0 + 4i + cc, eighth t at n * S + 256 i + 16 (4t + cc).
        for (int q = threadIdx.x; q < 8 * NT * groups * 16; q += blockDim.x) {
            int n = q / (groups * 16), r = q % (groups * 16), i = r / 16, cc = (r / 4) & 3,
                t = r & 3;
            int u = c0 + 4 * i + cc;
            bool in = n < ntok && u < c1;
            const u16* src = in ? x + (long long)n * cols + 32 * u + 8 * t : x;
            cp_async16(mmf_sh + n * S + 256 * i + 16 * (4 * t + cc), src, in ? 16 : 0);
        }
        mmf_stage_load<T>(w, row_bytes, wend, rows, row0, c0, c1, wbuf);
        cp_async_commit();
        for (int ua = c0, st = 0; ua < c1; ua += 8, st++) {
            u8* buf = wbuf + (st & 1) * M::WS;
            if (ua + 8 < c1) {
                mmf_stage_load<T>(w, row_bytes, wend, rows, row0, ua + 8, c1,
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

    if (gridDim.y == 1) {
#pragma unroll
        for (int m = 0; m < MMF_MT; m++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int row = row0 + 16 * m + 8 * (e >> 1) + g, n = 8 * j + 2 * c + (e & 1);
                    if (row < rows && n < ntok) {
                        float* o = y + (long long)n * rows + row;
                        *o = acc ? *o + a[m][j][e] : a[m][j][e];
                    }
                }
        return;
    }
    float* part = ws + (long long)blockIdx.y * ntok * rows;
#pragma unroll
    for (int m = 0; m < MMF_MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = row0 + 16 * m + 8 * (e >> 1) + g, n = 8 * j + 2 * c + (e & 1);
                if (row < rows && n < ntok) part[(long long)n * rows + row] = a[m][j][e];
            }
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

#define DEF_MMF_NT(name, T, NT) \
    extern "C" __global__ void __launch_bounds__(256) mmf_##name##_##NT( \
        const u8* w, int rows, int cols, const u16* x, int ntok, float* y, int acc, int per, \
        int chunk, float* ws, u32* cnt, int fast) { \
        PDL_ENTRY(); \
        mmf_impl<T, NT>(w, rows, cols, x, ntok, y, acc, per, chunk, ws, cnt, fast != 0); \
    }
#define DEF_MMF(name, T) DEF_MMF_NT(name, T, 2) DEF_MMF_NT(name, T, 4) DEF_MMF_NT(name, T, 8)
FOR_EACH_QTYPE(DEF_MMF)
