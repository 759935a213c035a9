//! AMX (Advanced Matrix Extensions) int8 tiles for the many-token products of the packed
//! matrices (`Q4_0`, `Q4_1`, `Q8_0`, `Q4_K` in the 16-row layouts of `super::packed`), with
//! results bit-identical to the `vpdpbusd` kernels of `super::avx512`.
//!
//! Integer sums are exact whichever unit computes them, so the tile unit computes them and the
//! vector unit does exactly the float work of the `vpdpbusd` kernel, in its order. What that
//! order needs decides what AMX can do:
//! - Legacy types (`super::avx512::legacy_x16`, ggml's `vec_dot`): per (row, token) eight
//!   accumulators, accumulator `j` taking `fma(d_w * d_y, isum_j, acc_j)` block by block,
//!   `isum_j` the dot product of the block's 4-element group `j`. So each tile product may only
//!   sum 4 elements: `tdpbssd` of a 16-token × 4-byte activation tile (one group of one block,
//!   from the transposed activations of `super::avx512::wide_acts`) with a 1 × 64-byte weight
//!   tile (that group of the 16 rows, unpacked to signed bytes) gives 16 × 16 group sums. A
//!   whole-block (K = 32) product would change that order's rounding.
//! - Legacy types in the whole-block order ([`super::SumOrder::Block`],
//!   `super::avx512::legacy_x16_block`): the integer unit of the order is the whole block, so
//!   one product with K = 32 (16 tokens × 32 activation bytes of `super::avx512::block_acts`
//!   rows, 8 × 64-byte weight tile) gives every (token, row) block sum, and the vector side does
//!   one conversion and one fma per token and block for the 16 rows (`amx_legacy_block`).
//!   Measured here (session 6, docs/perf/cpu.md) it is slower than `legacy_x16_block` once that
//!   kernel reads the prepared activation rows too (0.7-0.85x, 64 tokens, one thread), so it too
//!   is opt-in.
//! - `Q4_K` (`super::avx512::q4k_x16`, gemm order): the integer unit of the order is the
//!   32-element sub-block (its sum is multiplied by the row's 6-bit scale before the pair's
//!   fma), so one product (`tdpbssd`, 16 tokens × 32 bytes read straight from the Q8_K rows,
//!   8 × 64-byte weight tile of unpacked nibbles) gives the 16 × 16 sub-block sums.
//!
//! Each 16 × 16 tile of sums goes to an L1 scratch (`tilestored`) and the vector side reads a
//! token's 16 rows' sums as one vector. Measured on this machine (Xeon with AMX under KVM, 2
//! cores; docs/perf/cpu.md "Session 5: AMX"), a tile product with its loads and store costs
//! 12-20 ns (4-element groups) and 39-67 ns (32-element sub-blocks), so the tile side alone
//! takes about as long as the whole `vpdpbusd` kernel; with the float work beside it both AMX
//! kernels are slower (legacy 0.5x, `Q4_K` 0.7-0.9x). They are therefore not used by default
//! ([`amx_enabled`] is false unless asked for): `CROSSOVER_AMX=1` (or [`set_amx`]) turns them on
//! for comparisons, and `super::matmul_packed_with_amx` takes them explicitly.
//!
//! Using AMX needs the CPU (CPUID leaf 7: AMX-TILE, AMX-INT8) and the kernel's permission for
//! the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, asked for once per
//! process by [`amx_available`]; Linux refuses the instructions with SIGILL until then).

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::sync::atomic::{AtomicU8, Ordering};

use gguf::GgmlType;

use super::avx512::{
    LegacyX16, Line64, BLOCK_ACT, BLOCK_ACT_Q, WIDE_BLOCK, WIDE_LANES, X16Q4_0, X16Q4_1, X16Q8_0,
};
use super::kernels::{Kernel, Tile, TileFn};
use super::SumOrder;

/// Tokens per AMX tile call at most (four 16-token groups of transposed activations).
pub(crate) const AMX_NT: usize = 64;

/// Blocks per stretch of the legacy tile (8 KiB of group sums each; two stretches in flight,
/// so the scratch stays in L1).
const STRETCH: usize = 2;

/// 0: not yet detected; 1: absent or refused; 2: present and permitted.
static AVAILABLE: AtomicU8 = AtomicU8::new(0);
/// 0: not yet decided; 1: off; 2: on (when available).
static ENABLED: AtomicU8 = AtomicU8::new(0);

/// Whether this CPU has AMX-INT8 and the OS lets this process use the tile registers. The
/// first call asks Linux for the permission (once per process; every thread then has it).
pub fn amx_available() -> bool {
    match AVAILABLE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let ok = detect();
            AVAILABLE.store(if ok { 2 } else { 1 }, Ordering::Relaxed);
            ok
        }
    }
}

#[cfg(target_os = "linux")]
fn detect() -> bool {
    if !super::Isa::Avx512.available() {
        return false;
    }
    let r = __cpuid_count(7, 0);
    let (tile, int8) = ((r.edx >> 24) & 1 == 1, (r.edx >> 25) & 1 == 1);
    if !(tile && int8) {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only asks for a permission; it touches no memory
    // of ours, and a kernel that does not know it returns an error.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

#[cfg(not(target_os = "linux"))]
fn detect() -> bool {
    false
}

/// Whether the engine's packed products of many tokens use the AMX kernels: only when asked
/// for, with `CROSSOVER_AMX=1` (read once) or [`set_amx`], and [`amx_available`]. Off by default
/// because they measured slower than the `vpdpbusd` kernels here (see the module docs).
pub fn amx_enabled() -> bool {
    let e = match ENABLED.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("CROSSOVER_AMX")
                .map(|v| matches!(v.trim(), "1" | "on" | "true" | "yes"))
                .unwrap_or(false);
            let e = if on { 2 } else { 1 };
            ENABLED.store(e, Ordering::Relaxed);
            e
        }
        e => e,
    };
    e == 2 && amx_available()
}

/// Turn the AMX kernels on (where available) or off for the whole process, overriding
/// `CROSSOVER_AMX`; results are the same bit for bit either way, only the speed differs.
pub fn set_amx(on: bool) {
    ENABLED.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// The 64-byte tile configuration (palette 1): `tmm0..3` sums (16 × 64 bytes), `tmm4`/`tmm6`
/// activations (16 tokens × 4 bytes), `tmm5`/`tmm7` weights (1 × 64 bytes: 16 rows × 4).
#[repr(C, align(64))]
struct TileCfg([u8; 64]);

const fn tile_cfg() -> TileCfg {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut i = 0;
    while i < 4 {
        c[16 + 2 * i] = 64;
        c[48 + i] = 16;
        i += 1;
    }
    c[16 + 2 * 4] = 4;
    c[48 + 4] = 16;
    c[16 + 2 * 5] = 64;
    c[48 + 5] = 1;
    c[16 + 2 * 6] = 4;
    c[48 + 6] = 16;
    c[16 + 2 * 7] = 64;
    c[48 + 7] = 1;
    TileCfg(c)
}
static CFG: TileCfg = tile_cfg();

/// The 8 four-byte groups of one block of the 16 rows as signed bytes, group `j` in vector `j`
/// (row `r` at bytes `4r..4r+4`): nibbles unpacked (`Q4_0`: minus 8), `Q8_0`'s stored `q + 128`
/// flipped back.
///
/// # Safety
/// `x` at a packed group block of `L`; `out` holds 8 lines; AVX-512 F/BW available.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_groups<L: LegacyX16>(x: *const u8, out: &mut [Line64; 8]) {
    let q = x.wrapping_add(L::QOFF);
    let o = out.as_mut_ptr() as *mut __m512i;
    // SAFETY: the group block holds the quant vectors at QOFF (4 for nibbles, 8 for Q8_0);
    // `out` holds 8 vectors.
    unsafe {
        if L::Q8 {
            let flip = _mm512_set1_epi8(-128);
            for j in 0..8 {
                let v = _mm512_loadu_si512(q.add(64 * j) as *const __m512i);
                _mm512_store_si512(o.add(j), _mm512_xor_si512(v, flip));
            }
        } else {
            let m4 = _mm512_set1_epi8(0x0f);
            let off = _mm512_set1_epi8(if L::OFF_SHIFT == 3 { 8 } else { 0 });
            for k in 0..4 {
                let v = _mm512_loadu_si512(q.add(64 * k) as *const __m512i);
                let lo = _mm512_sub_epi8(_mm512_and_si512(v, m4), off);
                let hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16::<4>(v), m4), off);
                _mm512_store_si512(o.add(k), lo);
                _mm512_store_si512(o.add(k + 4), hi);
            }
        }
    }
}

/// One stretch of blocks, prepared for the vector side: the unpacked weight groups, the rows'
/// `d` and `m` as f32 vectors, and the group sums of the tile unit.
#[repr(C, align(64))]
struct Stage {
    wq: [[Line64; 8]; STRETCH],
    sums: [[[Line64; 16]; 8]; STRETCH],
    dw: [__m512; STRETCH],
    mw: [__m512; STRETCH],
}

/// Unpack the weights and scales of blocks `b0..b0 + sn` of the group at `w` into `st`.
///
/// # Safety
/// Blocks `b0..b0 + sn` of the packed group exist; `sn <= STRETCH`; AVX-512 F/BW and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
#[inline]
unsafe fn prepare<L: LegacyX16>(w: *const u8, b0: usize, sn: usize, st: &mut Stage) {
    let gb = 16 * L::WB;
    for s in 0..sn {
        // SAFETY: group block b0 + s exists (caller's contract).
        unsafe {
            let x = w.add((b0 + s) * gb);
            unpack_groups::<L>(x, &mut st.wq[s]);
            st.dw[s] = _mm512_cvtph_ps(_mm256_loadu_si256(x as *const __m256i));
            if L::MIN {
                st.mw[s] = _mm512_cvtph_ps(_mm256_loadu_si256(x.add(32) as *const __m256i));
            }
        }
    }
}

/// Issue the tile products `i0..i1` (product `i` = block `i / 8`, group `i % 8` of the
/// stretch) of a prepared stage whose blocks start at `ab` in the transposed activations.
///
/// # Safety
/// Tiles configured; `st` prepared for at least `i1 / 8` blocks (rounded up) starting at the
/// block whose transposed activations are at `ab`.
#[inline(always)]
unsafe fn issue(st: &mut Stage, ab: *const u8, i0: usize, i1: usize) {
    for i in i0..i1 {
        let (s, j) = (i / 8, i % 8);
        // SAFETY: block s of the stage exists (caller's contract); its transposed activations
        // hold group j's 64 bytes at 64 j; the stage's lines are ours to write.
        unsafe {
            tile_product(
                i,
                ab.add(s * WIDE_BLOCK + 64 * j),
                4,
                st.wq[s][j].0.as_ptr(),
                st.sums[s][j].as_mut_ptr() as *mut u8,
            );
        }
    }
}

/// A tile of 16 packed rows of a legacy type × up to [`AMX_NT`] tokens over transposed
/// activations ([`super::avx512::wide_acts`]), with the float operations of
/// `super::avx512::legacy_x16` per (row, token), in the same order: per block
/// `dd = d_w * d_y`, the min term `fma(m_w, s_y, summs)`, per group
/// `acc_j = fma(dd, isum_j, acc_j)`; at the end `((a4 + a0) + (a6 + a2)) + ((a5 + a1) +
/// (a7 + a3)) + summs`. The integer group sums come from the tile unit ([`tile_product`]), a
/// stretch of [`STRETCH`] blocks at a time, double-buffered: the products of the next stretch
/// are issued between the token pairs of the vector side's work on the current one, so the
/// two units run side by side. The vector side runs two tokens at a time over a stretch, their
/// accumulators parked in a small buffer between stretches.
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 16`, `1 <= t.toks <= AMX_NT`, `t.w` at a packed group
/// of `t.nb` blocks, `t.a` at the first of `t.toks.div_ceil(16)` consecutive token groups of
/// transposed activations of `t.nb` blocks each; AMX usable ([`amx_available`]); AVX-512
/// F/BW/VL and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn amx_legacy<L: LegacyX16>(t: &Tile) {
    let zf = _mm512_setzero_ps();
    let gstride = t.nb * WIDE_BLOCK;
    let blank = || Stage {
        wq: [[Line64([0; 64]); 8]; STRETCH],
        sums: [[[Line64([0; 64]); 16]; 8]; STRETCH],
        dw: [_mm512_setzero_ps(); STRETCH],
        mw: [_mm512_setzero_ps(); STRETCH],
    };
    let mut stages = [blank(), blank()];
    // Per token of the group: 8 accumulators and the min sum, between stretches.
    let mut park = [[zf; 9]; WIDE_LANES];
    // SAFETY: CFG is a valid palette-1 configuration; AMX is usable by the contract.
    unsafe {
        std::arch::asm!("ldtilecfg [{c}]", c = in(reg) CFG.0.as_ptr(), options(nostack, readonly, preserves_flags));
    }
    let groups = t.toks.div_ceil(WIDE_LANES);
    for g in 0..groups {
        let valid = (t.toks - g * WIDE_LANES).min(WIDE_LANES);
        let pairs = valid.div_ceil(2);
        let ag = t.a.wrapping_add(g * gstride);
        let first = t.nb.min(STRETCH);
        // SAFETY: blocks 0..first exist; stage 0 is ours.
        unsafe {
            prepare::<L>(t.w, 0, first, &mut stages[0]);
            issue(&mut stages[0], ag, 0, 8 * first);
        }
        let mut b0 = 0;
        let mut cur = 0;
        while b0 < t.nb {
            let sn = (t.nb - b0).min(STRETCH);
            let nb0 = b0 + sn;
            let nsn = (t.nb - nb0).min(STRETCH);
            let last = nsn == 0;
            let (sc, sx) = if cur == 0 {
                let (a, b) = stages.split_at_mut(1);
                (&a[0], &mut b[0])
            } else {
                let (a, b) = stages.split_at_mut(1);
                (&b[0], &mut a[0])
            };
            let nab = ag.wrapping_add(nb0 * WIDE_BLOCK);
            // The next stretch's products, spread over this stretch's token pairs.
            let total = 8 * nsn;
            let per = total.div_ceil(pairs);
            if !last {
                // SAFETY: blocks nb0..nb0 + nsn exist.
                unsafe { prepare::<L>(t.w, nb0, nsn, sx) };
            }
            for pi in 0..pairs {
                let p = 2 * pi;
                let i0 = (pi * per).min(total);
                // SAFETY: `sx` prepared for the nsn blocks at `nab` above.
                unsafe { issue(sx, nab, i0, (i0 + per).min(total)) };
                let mut acc = [[zf; 8]; 2];
                let mut summs = [zf; 2];
                if b0 > 0 {
                    for k in 0..2 {
                        acc[k].copy_from_slice(&park[p + k][..8]);
                        summs[k] = park[p + k][8];
                    }
                }
                for s in 0..sn {
                    // SAFETY: the transposed block b0 + s of this token group holds 16 tokens'
                    // `d` at 512 and `s` at 576 (f32); tokens p, p + 1 < 16.
                    unsafe {
                        let yb = ag.add((b0 + s) * WIDE_BLOCK);
                        let mut dd = [zf; 2];
                        for k in 0..2 {
                            let dy =
                                std::ptr::read_unaligned(yb.add(512 + 4 * (p + k)) as *const f32);
                            dd[k] = _mm512_mul_ps(sc.dw[s], _mm512_set1_ps(dy));
                            if L::MIN {
                                let sy = std::ptr::read_unaligned(
                                    yb.add(576 + 4 * (p + k)) as *const f32
                                );
                                summs[k] = _mm512_fmadd_ps(sc.mw[s], _mm512_set1_ps(sy), summs[k]);
                            }
                        }
                        for j in 0..8 {
                            for k in 0..2 {
                                let i = _mm512_load_si512(
                                    sc.sums[s][j][p + k].0.as_ptr() as *const __m512i
                                );
                                acc[k][j] =
                                    _mm512_fmadd_ps(dd[k], _mm512_cvtepi32_ps(i), acc[k][j]);
                            }
                        }
                    }
                }
                for k in 0..2 {
                    if last {
                        if p + k >= valid {
                            continue;
                        }
                        let tok = g * WIDE_LANES + p + k;
                        let r = super::avx512::legacy_x16_finish(&acc[k], summs[k]);
                        // SAFETY: outputs (tok, 0..16) are inside the tile (tok < toks).
                        unsafe { _mm512_storeu_ps(t.out.add(tok * t.out_stride), r) };
                    } else {
                        park[p + k][..8].copy_from_slice(&acc[k]);
                        park[p + k][8] = summs[k];
                    }
                }
            }
            b0 = nb0;
            cur ^= 1;
        }
    }
    // SAFETY: releases the tile state configured above (back to its initial state, so context
    // switches of this thread do not save 8 KiB of tiles).
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
}

/// # Safety
/// The [`Tile`] contract of [`amx_legacy`].
unsafe fn amx_q4_0(t: &Tile) {
    // SAFETY: forwarded.
    unsafe { amx_legacy::<X16Q4_0>(t) }
}
/// # Safety
/// The [`Tile`] contract of [`amx_legacy`].
unsafe fn amx_q4_1(t: &Tile) {
    // SAFETY: forwarded.
    unsafe { amx_legacy::<X16Q4_1>(t) }
}
/// # Safety
/// The [`Tile`] contract of [`amx_legacy`].
unsafe fn amx_q8_0(t: &Tile) {
    // SAFETY: forwarded.
    unsafe { amx_legacy::<X16Q8_0>(t) }
}

/// A tile of 16 packed rows of a legacy type × up to [`AMX_NT`] tokens in the whole-block order
/// ([`super::SumOrder::Block`]): per block one tile product (`tdpbssd`, K = 32) of 16 tokens'
/// activation quants (rows of `super::avx512::block_acts`) with the block's 8 groups of the
/// 16 rows (unpacked to signed values, [`unpack_groups`]), giving every (token, row) block sum
/// exactly; then per token one conversion and one `acc = fma(d_w * d_y, isum, acc)` for the 16
/// rows, the min term its own fma chain, at the end `acc + summs`: the float operations of
/// `super::avx512::legacy_x16_block`, so the results are its bits. The next block's product is
/// issued (into the other sum tile and scratch) before the vector side reads this block's sums,
/// so the two units overlap.
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 16`, `1 <= t.toks <= AMX_NT`, `t.w` at a packed group
/// of `t.nb` blocks, `t.a` at `block_acts` rows for this type (`t.a_stride` apart); AMX usable; AVX-512
/// F/BW/VL and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn amx_legacy_block<L: LegacyX16>(t: &Tile) {
    let zf = _mm512_setzero_ps();
    let gb = 16 * L::WB;
    let mut wq = [[Line64([0; 64]); 8]; 2];
    let mut sums = [[Line64([0; 64]); 16]; 2];
    let mut cfg_rows = 0;
    let groups = t.toks.div_ceil(WIDE_LANES);
    for g in 0..groups {
        let valid = (t.toks - g * WIDE_LANES).min(WIDE_LANES);
        if valid != cfg_rows {
            let cfg = q4k_cfg(valid);
            // SAFETY: a valid palette-1 configuration; AMX is usable by the contract.
            unsafe {
                std::arch::asm!("ldtilecfg [{c}]", c = in(reg) cfg.0.as_ptr(), options(nostack, readonly, preserves_flags));
            }
            cfg_rows = valid;
        }
        let ag = t.a.wrapping_add(g * WIDE_LANES * t.a_stride);
        let mut acc = [zf; WIDE_LANES];
        let mut summs = [zf; WIDE_LANES];
        // SAFETY (for the block loop): block b of the group and of the `valid` token rows exist
        // (b < nb); the scratch buffers are ours; the tiles are configured for `valid` rows.
        unsafe {
            unpack_groups::<L>(t.w, &mut wq[0]);
            tile_product(
                0,
                ag.add(BLOCK_ACT_Q),
                t.a_stride,
                wq[0].as_ptr() as *const u8,
                sums[0].as_mut_ptr() as *mut u8,
            );
            for b in 0..t.nb {
                let cur = b & 1;
                if b + 1 < t.nb {
                    let nx = cur ^ 1;
                    unpack_groups::<L>(t.w.add((b + 1) * gb), &mut wq[nx]);
                    tile_product(
                        nx,
                        ag.add((b + 1) * BLOCK_ACT + BLOCK_ACT_Q),
                        t.a_stride,
                        wq[nx].as_ptr() as *const u8,
                        sums[nx].as_mut_ptr() as *mut u8,
                    );
                }
                let x = t.w.add(b * gb);
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(x as *const __m256i));
                let mw = if L::MIN {
                    _mm512_cvtph_ps(_mm256_loadu_si256(x.add(32) as *const __m256i))
                } else {
                    zf
                };
                for k in 0..valid {
                    let y = ag.add(k * t.a_stride + b * BLOCK_ACT);
                    let dy = _mm512_set1_ps(std::ptr::read_unaligned(y as *const f32));
                    if L::MIN {
                        let sy = _mm512_set1_ps(std::ptr::read_unaligned(y.add(4) as *const f32));
                        summs[k] = _mm512_fmadd_ps(mw, sy, summs[k]);
                    }
                    let i = _mm512_load_si512(sums[cur][k].0.as_ptr() as *const __m512i);
                    acc[k] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dy), _mm512_cvtepi32_ps(i), acc[k]);
                }
            }
        }
        for k in 0..valid {
            let tok = g * WIDE_LANES + k;
            // SAFETY: outputs (tok, 0..16) are inside the tile (tok < toks).
            unsafe {
                _mm512_storeu_ps(
                    t.out.add(tok * t.out_stride),
                    _mm512_add_ps(acc[k], summs[k]),
                )
            };
        }
    }
    // SAFETY: releases the tile state configured above.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
}

/// # Safety
/// The [`Tile`] contract of [`amx_legacy_block`].
unsafe fn amx_q4_0_block(t: &Tile) {
    // SAFETY: forwarded.
    unsafe { amx_legacy_block::<X16Q4_0>(t) }
}
/// # Safety
/// The [`Tile`] contract of [`amx_legacy_block`].
unsafe fn amx_q4_1_block(t: &Tile) {
    // SAFETY: forwarded.
    unsafe { amx_legacy_block::<X16Q4_1>(t) }
}
/// # Safety
/// The [`Tile`] contract of [`amx_legacy_block`].
unsafe fn amx_q8_0_block(t: &Tile) {
    // SAFETY: forwarded.
    unsafe { amx_legacy_block::<X16Q8_0>(t) }
}

/// The AMX kernel of a packed legacy type in summation order `order`, and whether it reads
/// transposed activations, or `None` for other types. The caller checks [`amx_available`].
pub(crate) fn packed_legacy_amx_kernel(ty: GgmlType, order: SumOrder) -> Option<(Kernel, bool)> {
    // (tile, whether it reads transposed activations)
    let (tile, wide): (TileFn, bool) = match (ty, order) {
        (GgmlType::Q4_0, SumOrder::Ggml) => (amx_q4_0, true),
        (GgmlType::Q4_1, SumOrder::Ggml) => (amx_q4_1, true),
        (GgmlType::Q8_0, SumOrder::Ggml) => (amx_q8_0, true),
        (GgmlType::Q4_0, SumOrder::Block) => (amx_q4_0_block, false),
        (GgmlType::Q4_1, SumOrder::Block) => (amx_q4_1_block, false),
        (GgmlType::Q8_0, SumOrder::Block) => (amx_q8_0_block, false),
        _ => return None,
    };
    Some((
        Kernel {
            mr: 16,
            nt: AMX_NT,
            mr1: 16,
            exact_rows: true,
            tile,
        },
        wide,
    ))
}

// ---- packed Q4_K ------------------------------------------------------------------------------

/// Super-blocks per stretch of the `Q4_K` tile (12 KiB of scratch each).
const K_STRETCH: usize = 2;

/// A palette-1 configuration for `Q4_K` with `rows` tokens (1..=16): `tmm0..3` sums (`rows` ×
/// 64 bytes), `tmm4`/`tmm6` activations (`rows` tokens × 32 bytes: one sub-block), `tmm5`/`tmm7`
/// weights (8 × 64 bytes: the sub-block's 8 four-element groups of 16 rows).
fn q4k_cfg(rows: usize) -> TileCfg {
    let mut c = [0u8; 64];
    c[0] = 1;
    let r = rows as u8;
    for i in 0..4 {
        c[16 + 2 * i] = 64;
        c[48 + i] = r;
    }
    for (i, (colsb, nrows)) in [(32u8, r), (64, 8), (32, r), (64, 8)]
        .into_iter()
        .enumerate()
    {
        c[16 + 2 * (4 + i)] = colsb;
        c[48 + 4 + i] = nrows;
    }
    TileCfg(c)
}

/// One stretch of `Q4_K` super-blocks, prepared: each sub-block's weights as 8 rows of 16 rows ×
/// 4 unsigned nibble values (a `B` tile), the tile unit's 16 × 16 sub-block sums, and per
/// super-block the rows' `d`, `dmin`, sub-block scales (as f32) and min pairs (i16).
#[repr(C, align(64))]
struct KStage {
    wq: [[[Line64; 8]; 8]; K_STRETCH],
    sums: [[[Line64; 16]; 8]; K_STRETCH],
    sc: [[__m512; 8]; K_STRETCH],
    mp: [[__m512i; 4]; K_STRETCH],
    d: [__m512; K_STRETCH],
    dmin: [__m512; K_STRETCH],
}

/// Prepare super-blocks `b0..b0 + sn` of the packed `Q4_K` group at `w` (scales as
/// `super::avx512::q4k_x16` unpacks them).
///
/// # Safety
/// Those super-blocks exist; `sn <= K_STRETCH`; AVX-512 F/BW/VL and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
#[inline]
unsafe fn q4k_prepare(w: *const u8, b0: usize, sn: usize, st: &mut KStage) {
    let m4 = _mm512_set1_epi8(0x0f);
    for s in 0..sn {
        // SAFETY: super-block b0 + s of the group (2304 bytes) exists (caller's contract); the
        // stage's lines are ours.
        unsafe {
            let x = w.add((b0 + s) * super::packed::Q4K_GROUP_BYTES);
            st.d[s] = _mm512_cvtph_ps(_mm256_loadu_si256(x as *const __m256i));
            st.dmin[s] = _mm512_cvtph_ps(_mm256_loadu_si256(x.add(32) as *const __m256i));
            let mut sm = [Line64([0; 64]); 4];
            super::avx512::q4k_x16_scales(x, &mut sm);
            let smb = sm.as_ptr() as *const u8;
            for j in 0..8 {
                let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(smb.add(16 * j) as *const __m128i));
                st.sc[s][j] = _mm512_cvtepi32_ps(sc);
            }
            for p in 0..4 {
                let ma = _mm_loadu_si128(smb.add(128 + 32 * p) as *const __m128i);
                let mb = _mm_loadu_si128(smb.add(128 + 32 * p + 16) as *const __m128i);
                st.mp[s][p] = _mm512_cvtepu8_epi16(_mm256_set_m128i(
                    _mm_unpackhi_epi8(ma, mb),
                    _mm_unpacklo_epi8(ma, mb),
                ));
            }
            // Sub-block j's vector k holds elements 8k..8k+4 (low nibbles) and 8k+4..8k+8
            // (high) of the 16 rows: the B tile's rows 2k and 2k + 1.
            for j in 0..8 {
                for k in 0..4 {
                    let v = _mm512_loadu_si512(x.add(256 + 64 * (4 * j + k)) as *const __m512i);
                    let o = st.wq[s][j].as_mut_ptr() as *mut __m512i;
                    _mm512_store_si512(o.add(2 * k), _mm512_and_si512(v, m4));
                    _mm512_store_si512(
                        o.add(2 * k + 1),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4),
                    );
                }
            }
        }
    }
}

/// One tile product of sums: `tdpbssd` of the configured token rows of activation bytes (at
/// `a`, `astride` apart: 4 bytes of one 4-element group for the legacy kernel, 32 of one
/// `Q4_K` sub-block) with the weight tile at `w` (1 or 8 rows of 64 bytes: 16 weight rows × 4),
/// the 16 × 16 int32 sums stored at `c` (row `t`: token `t`'s sums for the 16 weight rows).
/// `q` (0..4) picks the sum tile (`tmm0..3`) and the operand pair (`tmm4/5` or `tmm6/7`), so
/// four products can be in flight.
///
/// # Safety
/// Tiles configured ([`CFG`] or [`q4k_cfg`]); `a` valid for the configured rows and columns at
/// `astride`; `w` for the configured weight rows of 64 bytes; `c` for the configured rows of
/// 64 bytes of writes.
#[inline(always)]
unsafe fn tile_product(q: usize, a: *const u8, astride: usize, w: *const u8, c: *mut u8) {
    macro_rules! product {
        ($c:literal, $a:literal, $b:literal) => {
            // SAFETY: reads the configured rows of 32 bytes at `a` (stride `astride`) and 8
            // rows of 64 bytes at `w`, writes the configured rows of 64 bytes at `c`, as the
            // caller guarantees; the tiles are configured.
            unsafe {
                std::arch::asm!(
                    concat!("tilezero ", $c),
                    concat!("tileloadd ", $a, ", [{a} + {sa}*1]"),
                    concat!("tileloadd ", $b, ", [{w} + {s64}*1]"),
                    concat!("tdpbssd ", $c, ", ", $a, ", ", $b),
                    concat!("tilestored [{c} + {s64}*1], ", $c),
                    a = in(reg) a,
                    sa = in(reg) astride,
                    w = in(reg) w,
                    c = in(reg) c,
                    s64 = in(reg) 64usize,
                    options(nostack, preserves_flags),
                )
            }
        };
    }
    match q & 3 {
        0 => product!("tmm0", "tmm4", "tmm5"),
        1 => product!("tmm1", "tmm6", "tmm7"),
        2 => product!("tmm2", "tmm4", "tmm5"),
        _ => product!("tmm3", "tmm6", "tmm7"),
    }
}

/// Issue the tile products `i0..i1` of a prepared `Q4_K` stage (product `i`: super-block
/// `i / 8` of the stretch, sub-block `i % 8`), whose first super-block's activations are at
/// `ab` in token rows `astride` apart.
///
/// # Safety
/// Tiles configured by [`q4k_cfg`] for the token rows that exist at `ab`; `st` prepared for
/// the super-blocks `i1` reaches.
#[inline(always)]
unsafe fn q4k_issue(st: &mut KStage, ab: *const u8, astride: usize, i0: usize, i1: usize) {
    for i in i0..i1 {
        let (s, j) = (i / 8, i % 8);
        // SAFETY: super-block s of the stage exists and its activations (292 bytes per token
        // row, quants at 4) too (caller's contract); the stage's lines are ours to write.
        unsafe {
            tile_product(
                i,
                ab.add(s * 292 + 4 + 32 * j),
                astride,
                st.wq[s][j].as_ptr() as *const u8,
                st.sums[s][j].as_mut_ptr() as *mut u8,
            );
        }
    }
}

/// A tile of 16 packed `Q4_K` rows × up to [`AMX_NT`] tokens in llama.cpp's gemm order (one
/// fma per pair of sub-blocks, `super::avx512::q4k_x16::<T, true>`), the sub-block sums from
/// the tile unit: per (row, token) and pair `p` of sub-blocks, `ip = sc_2p S_2p + sc_2p+1
/// S_2p+1`, `ms = m_2p bsum_2p + m_2p+1 bsum_2p+1`, `acc = fma(ip, d d_y, acc)`,
/// `accm = fma(ms, dmin d_y, accm)`, finally `acc - accm`. Activations are the plain Q8_K rows
/// (`t.a`, `t.a_stride` apart): a tile reads each sub-block's 32 bytes of up to 16 tokens.
/// Stretches of [`K_STRETCH`] super-blocks are double-buffered: the next stretch's products
/// are issued between the tokens of the vector side's work on the current one.
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 16`, `1 <= t.toks <= AMX_NT`, `t.w` at a packed
/// `Q4_K` group of `t.nb` super-blocks; AMX usable; AVX-512 F/BW/VL/VNNI and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn amx_q4k_tile(t: &Tile) {
    let zf = _mm512_setzero_ps();
    let zi = _mm512_setzero_si512();
    // SAFETY: a zeroed `KStage` is valid (plain bytes and vectors).
    let mut stages: Box<[KStage; 2]> = KSTAGE.with(|c| c.take()).unwrap_or_else(|| unsafe {
        Box::new(std::mem::MaybeUninit::<[KStage; 2]>::zeroed().assume_init())
    });
    let mut park = [[zf; 2]; WIDE_LANES];
    let mut cfg_rows = 0;
    let groups = t.toks.div_ceil(WIDE_LANES);
    for g in 0..groups {
        let valid = (t.toks - g * WIDE_LANES).min(WIDE_LANES);
        if valid != cfg_rows {
            let cfg = q4k_cfg(valid);
            // SAFETY: a valid palette-1 configuration; AMX is usable by the contract.
            unsafe {
                std::arch::asm!("ldtilecfg [{c}]", c = in(reg) cfg.0.as_ptr(), options(nostack, readonly, preserves_flags));
            }
            cfg_rows = valid;
        }
        let ag = t.a.wrapping_add(g * WIDE_LANES * t.a_stride);
        let first = t.nb.min(K_STRETCH);
        // SAFETY: super-blocks 0..first exist, and the group's `valid` token rows.
        unsafe {
            q4k_prepare(t.w, 0, first, &mut stages[0]);
            q4k_issue(&mut stages[0], ag, t.a_stride, 0, 8 * first);
        }
        let mut b0 = 0;
        let mut cur = 0;
        while b0 < t.nb {
            let sn = (t.nb - b0).min(K_STRETCH);
            let nb0 = b0 + sn;
            let nsn = (t.nb - nb0).min(K_STRETCH);
            let last = nsn == 0;
            let (lo, hi) = stages.split_at_mut(1);
            let (sc, sx) = if cur == 0 {
                (&lo[0], &mut hi[0])
            } else {
                (&hi[0], &mut lo[0])
            };
            let nab = ag.wrapping_add(nb0 * 292);
            let total = 8 * nsn;
            let per = total.div_ceil(valid);
            if !last {
                // SAFETY: super-blocks nb0..nb0 + nsn exist.
                unsafe { q4k_prepare(t.w, nb0, nsn, sx) };
            }
            for k in 0..valid {
                let i0 = (k * per).min(total);
                // SAFETY: `sx` was prepared for the nsn super-blocks at `nab` above.
                unsafe { q4k_issue(sx, nab, t.a_stride, i0, (i0 + per).min(total)) };
                let (mut acc, mut accm) = if b0 > 0 {
                    (park[k][0], park[k][1])
                } else {
                    (zf, zf)
                };
                for s in 0..sn {
                    // SAFETY: token k's super-block b0 + s (292 bytes: d at 0, bsums at 260)
                    // exists; the stage's sums rows k < valid were stored by its products.
                    unsafe {
                        let ys = ag.add(k * t.a_stride + (b0 + s) * 292);
                        let yd = _mm512_set1_ps(std::ptr::read_unaligned(ys as *const f32));
                        let dd = _mm512_mul_ps(sc.d[s], yd);
                        let dm = _mm512_mul_ps(sc.dmin[s], yd);
                        let bs = _mm256_madd_epi16(
                            _mm256_loadu_si256(ys.add(260) as *const __m256i),
                            _mm256_set1_epi16(1),
                        );
                        let mut sp = [0i32; 8];
                        _mm256_storeu_si256(
                            sp.as_mut_ptr() as *mut __m256i,
                            _mm256_packs_epi32(bs, bs),
                        );
                        for p in 0..4 {
                            // The pair's integer `sc_2p S_2p + sc_2p+1 S_2p+1`, in f32: every
                            // product (|S| <= 32 * 15 * 128, scale <= 63) and the sum stay
                            // below 2^24, so each step is exact and the result equals the
                            // converted integer of `q4k_x16` bit for bit, in 4 operations
                            // instead of two `vpmulld` (2 each), an add and a convert.
                            let s0 = _mm512_cvtepi32_ps(_mm512_load_si512(
                                sc.sums[s][2 * p][k].0.as_ptr() as *const __m512i,
                            ));
                            let s1 = _mm512_cvtepi32_ps(_mm512_load_si512(
                                sc.sums[s][2 * p + 1][k].0.as_ptr() as *const __m512i,
                            ));
                            let ipf = _mm512_fmadd_ps(
                                s1,
                                sc.sc[s][2 * p + 1],
                                _mm512_mul_ps(s0, sc.sc[s][2 * p]),
                            );
                            let lane = [0usize, 1, 4, 5][p];
                            let ms = super::avx512::dpwssd_bcast(
                                zi,
                                sc.mp[s][p],
                                sp.as_ptr().add(lane) as *const u8,
                            );
                            acc = _mm512_fmadd_ps(ipf, dd, acc);
                            accm = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms), dm, accm);
                        }
                    }
                }
                if last {
                    let tok = g * WIDE_LANES + k;
                    // SAFETY: outputs (tok, 0..16) are inside the tile (tok < toks).
                    unsafe {
                        _mm512_storeu_ps(t.out.add(tok * t.out_stride), _mm512_sub_ps(acc, accm))
                    };
                } else {
                    park[k] = [acc, accm];
                }
            }
            b0 = nb0;
            cur ^= 1;
        }
    }
    // SAFETY: releases the tile state configured above.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    KSTAGE.with(|c| c.set(Some(stages)));
}

thread_local! {
    /// The `Q4_K` tile's double-buffered scratch (2 × 26 KiB), kept per thread between calls.
    static KSTAGE: std::cell::Cell<Option<Box<[KStage; 2]>>> = const { std::cell::Cell::new(None) };
}

/// # Safety
/// The [`Tile`] contract of [`amx_q4k_tile`].
unsafe fn amx_q4k(t: &Tile) {
    // SAFETY: forwarded.
    unsafe { amx_q4k_tile(t) }
}

/// The AMX kernel of packed `Q4_K` for groups of 4 tokens (llama.cpp's gemm order; the tokens
/// left over take the `vpdpbusd` gemv kernel), over plain Q8_K activation rows.
pub(crate) fn packed_q4k_amx_kernel() -> Kernel {
    Kernel {
        mr: 16,
        nt: AMX_NT,
        mr1: 16,
        exact_rows: true,
        tile: amx_q4k,
    }
}
