//! AVX2 kernels over the packed 16-row layouts of [`super::packed`] (the same bytes the AVX-512
//! kernels read): each 64-byte vector of a group holds 4 consecutive elements of each of 16
//! rows, so its two 32-byte halves are rows 0..8 and rows 8..16, one 8-row vector each.
//!
//! Without `vpdpbusd`, a row's partial sums come from `vpmaddubsw` (unsigned weight bytes times
//! the signed activation bytes broadcast to every lane, pairs added to i16) kept in i16 over a
//! whole 32-element sub-block (at most 8 such pairs per lane: |sum| <= 8 * 2 * 15 * 127 =
//! 30,480 for 4-bit values, so no i16 overflows or saturates), then one `vpmaddwd` with the
//! row's sub-block scale in both i16 halves of its lane: exactly `scale * sum` in i32. The
//! integers are therefore those of the scalar reference, and the float steps per (row, token)
//! are its own, lane by lane, so the results are bit for bit [`super::scalar::dot_q4_k`]'s
//! (groups of 4 tokens) and [`super::scalar::dot_q4_k_gemv`]'s (the tokens left over).
//! `Q6_K`'s 6-bit values take 4 products per i16 sum (|sum| <= 4 * 63 * 127 = 32,004), so each
//! sub-block makes two `vpmaddwd` with its signed scale, and the value offset (`- 32` per
//! element) is subtracted once per super-block as `32 * sum_j scale_j * bsum_j`: the same
//! integer as [`super::scalar::dot_q6_k`]'s.
//!
//! The 32-element types (`Q4_0`, `Q4_1`, `Q8_0`, `avx512::LegacyX16`'s layout) keep ggml's
//! eight group accumulators per row as eight vectors across the rows (prompts), or in the
//! whole-block order sum a block's eight groups exactly before one fma (decode); `Q8_0`'s
//! values, stored `q + 128` for `vpdpbusd`, go back to signed bytes and ggml's sign trick.
//!
//! Next to the GGUF-layout 8-row kernels of [`super::avx2`] this drops every horizontal
//! reduction and transpose (lane `r` is row `r` throughout), unpacks each weight byte once for
//! up to 4 tokens and 16 rows, and loads each activation word once for 16 rows.

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::avx2::{ld256, rd_f16};
use super::avx512::{LegacyX16, BLOCK_ACT, BLOCK_ACT_Q, X16Q4_0, X16Q4_1, X16Q8_0};
use super::kernels::{packed16, toks_dispatch, Kernel, Tile};
use super::packed::{Q4K_GROUP_BYTES, Q6K_GROUP_BYTES};
use super::SumOrder;

/// The 4 bytes at `p` in every 32-bit lane.
///
/// # Safety
/// `p` valid for 4 bytes; AVX2 available.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn bcast32(p: *const u8) -> __m256i {
    // SAFETY: caller's contract.
    _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(p as *const i32) })
}

/// The 8 f16 at `p` as f32.
///
/// # Safety
/// `p` valid for 16 bytes; F16C available.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn f16x8(p: *const u8) -> __m256 {
    // SAFETY: caller's contract.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
}

/// 256 bytes of unpacked scales and mins, aligned (see [`q4k_scales`]).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct ScaleMins([u8; 256]);

/// The 6-bit scales and mins of the 16 rows of the packed `Q4_K` group block at `x`
/// (`scalar::k4_scale_min` of each row's 12 scale bytes: sc_j = s[j] & 63 and m_j = s[j+4] & 63
/// for j < 4; sc_j = (s[j+4] & 15) | (s[j-4] >> 6) << 4 and m_j = (s[j+4] >> 4) | (s[j] >> 6)
/// << 4 for j >= 4), laid out for the tile: byte `16 j + r` is row `r`'s scale of sub-block
/// `j`; bytes `128 + 32 p + 2 r` and `+ 1` are row `r`'s mins of sub-blocks `2p` and `2p + 1`.
///
/// # Safety
/// `x` at a packed `Q4_K` group block; AVX2 available.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q4k_scales(x: *const u8, sm: &mut ScaleMins) {
    let m4 = _mm256_set1_epi8(0x0f);
    let c63 = _mm256_set1_epi8(63);
    let c30 = _mm256_set1_epi8(0x30);
    let o = sm.0.as_mut_ptr() as *mut __m256i;
    // SAFETY: bytes 64..256 of the group block hold the 12 scale bytes of the 16 rows (byte k
    // of row r at 64 + 16 k + r); `sm` is 256 bytes.
    unsafe {
        for h in 0..2 {
            // Bytes k = 2h, 2h + 1 (z0), 4 + 2h, 5 + 2h (z1), 8 + 2h, 9 + 2h (z2), 16 rows each.
            let z0 = ld256(x.add(64 + 32 * h));
            let z1 = ld256(x.add(128 + 32 * h));
            let z2 = ld256(x.add(192 + 32 * h));
            let sc_hi = _mm256_or_si256(
                _mm256_and_si256(z2, m4),
                _mm256_and_si256(_mm256_srli_epi16::<2>(z0), c30),
            );
            let m_hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(z2), m4),
                _mm256_and_si256(_mm256_srli_epi16::<2>(z1), c30),
            );
            // Scales of sub-blocks 2h, 2h + 1 and 4 + 2h, 5 + 2h; min pairs p = h and 2 + h.
            _mm256_store_si256(o.add(h), _mm256_and_si256(z0, c63));
            _mm256_store_si256(o.add(2 + h), sc_hi);
            _mm256_store_si256(o.add(4 + h), zip_rows(_mm256_and_si256(z1, c63)));
            _mm256_store_si256(o.add(6 + h), zip_rows(m_hi));
        }
    }
}

/// Two sub-blocks' 16 row bytes (`v`: the first in the low 128-bit lane, the second in the
/// high one) interleaved row by row: bytes `2r` and `2r + 1` are row `r`'s.
#[target_feature(enable = "avx2")]
#[inline]
fn zip_rows(v: __m256i) -> __m256i {
    // After the qword permute: the two sub-blocks' rows 0..8 in the low lane, rows 8..16 in
    // the high lane; then bytes 0..8 and 8..16 of each lane interleaved.
    let zip = _mm256_setr_epi8(
        0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5,
        13, 6, 14, 7, 15,
    );
    _mm256_shuffle_epi8(_mm256_permute4x64_epi64::<0xd8>(v), zip)
}

/// Lane `r` of half `h` (rows `8h..8h+8`) as the i16 pair `(b_r, b_r)` of the 16 row bytes at
/// `p`: one byte shuffle of the 16 bytes in both 128-bit lanes.
///
/// # Safety
/// `p` valid for 16 bytes; AVX2 available.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn row_pairs(p: *const u8, h: usize) -> __m256i {
    const Z: i8 = -128;
    let ctrl = if h == 0 {
        _mm256_setr_epi8(
            0, Z, 0, Z, 1, Z, 1, Z, 2, Z, 2, Z, 3, Z, 3, Z, 4, Z, 4, Z, 5, Z, 5, Z, 6, Z, 6, Z, 7,
            Z, 7, Z,
        )
    } else {
        _mm256_setr_epi8(
            8, Z, 8, Z, 9, Z, 9, Z, 10, Z, 10, Z, 11, Z, 11, Z, 12, Z, 12, Z, 13, Z, 13, Z, 14, Z,
            14, Z, 15, Z, 15, Z,
        )
    };
    // SAFETY: caller's contract.
    let b = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i)) };
    _mm256_shuffle_epi8(b, ctrl)
}

/// A tile of 16 packed `Q4_K` rows × `T` tokens: lane `r` of the two 8-row halves (`[0]`: rows
/// 0..8, `[1]`: rows 8..16) belongs to row `r`. Per sub-block and token, eight `vpmaddubsw`
/// summed in i16 and one `vpmaddwd` with the row's scale give `scale * sum`, added into the
/// pair's (`PAIRS`) or the super-block's integer sum; the min sums are one `vpmaddwd` of the
/// rows' min pairs with the activation's pair of 32-element sums. The float side per
/// (row, token) is that of [`super::scalar::dot_q4_k`] (`PAIRS`: one fma per pair of
/// sub-blocks) or [`super::scalar::dot_q4_k_gemv`] (one per super-block), lane by lane.
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 16`, `T == t.toks`, `t.w` at the start of a packed
/// group of `t.nb` super-blocks; AVX2/FMA/F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `h` and `k` index several arrays in step
unsafe fn q4k_x16<const T: usize, const PAIRS: bool>(t: &Tile) {
    let mut arow = [t.a; T];
    for (k, p) in arow.iter_mut().enumerate() {
        *p = t.a.wrapping_add(k * t.a_stride);
    }
    let zi = _mm256_setzero_si256();
    let m4 = _mm256_set1_epi8(0x0f);
    let mut acc = [[_mm256_setzero_ps(); T]; 2];
    let mut accm = [[_mm256_setzero_ps(); T]; 2];
    let mut sm = ScaleMins([0; 256]);
    for b in 0..t.nb {
        // SAFETY: super-block b of the group (2304 bytes at x) and block b of every token's
        // activation row (292 bytes at ys[k]) exist by the tile contract.
        unsafe {
            let x = t.w.add(b * Q4K_GROUP_BYTES);
            let d = [f16x8(x), f16x8(x.add(16))];
            let dmin = [f16x8(x.add(32)), f16x8(x.add(48))];
            q4k_scales(x, &mut sm);
            let smb = sm.0.as_ptr();
            let mut ys = [t.a; T];
            let mut dd = [[_mm256_setzero_ps(); T]; 2];
            let mut dm = [[_mm256_setzero_ps(); T]; 2];
            // Per token, the activation sums of sub-blocks (2p, 2p + 1) as i16 pairs in i32
            // lane p' = [0, 1, 4, 5][p] of `sp`.
            let mut sp = [[0i32; 8]; T];
            for k in 0..T {
                ys[k] = arow[k].add(b * 292);
                let yd = _mm256_set1_ps(std::ptr::read_unaligned(ys[k] as *const f32));
                for h in 0..2 {
                    dd[h][k] = _mm256_mul_ps(d[h], yd);
                    dm[h][k] = _mm256_mul_ps(dmin[h], yd);
                }
                let s = _mm256_madd_epi16(ld256(ys[k].add(260)), _mm256_set1_epi16(1));
                let pk = _mm256_packs_epi32(s, s);
                _mm256_storeu_si256(sp[k].as_mut_ptr() as *mut __m256i, pk);
            }
            let mut isb = [[zi; T]; 2];
            let mut msb = [[zi; T]; 2];
            for p in 0..4 {
                let mut ip = [[zi; T]; 2];
                for j in [2 * p, 2 * p + 1] {
                    let mut sj = [[zi; T]; 2];
                    for q in 0..4 {
                        let v = x.add(256 + 64 * (4 * j + q));
                        let (v0, v1) = (ld256(v), ld256(v.add(32)));
                        let w0 = [_mm256_and_si256(v0, m4), _mm256_and_si256(v1, m4)];
                        let w1 = [
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v0), m4),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v1), m4),
                        ];
                        for k in 0..T {
                            let yq = ys[k].add(4 + 32 * j + 8 * q);
                            let (b0, b1) = (bcast32(yq), bcast32(yq.add(4)));
                            for h in 0..2 {
                                let s = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(w0[h], b0),
                                    _mm256_maddubs_epi16(w1[h], b1),
                                );
                                sj[h][k] = _mm256_add_epi16(sj[h][k], s);
                            }
                        }
                    }
                    for h in 0..2 {
                        let sc = row_pairs(smb.add(16 * j), h);
                        for k in 0..T {
                            ip[h][k] = _mm256_add_epi32(ip[h][k], _mm256_madd_epi16(sj[h][k], sc));
                        }
                    }
                }
                let lane = [0usize, 1, 4, 5][p];
                for h in 0..2 {
                    // Lane r: (m_{2p}, m_{2p+1}) of row 8h + r.
                    let mp = _mm256_cvtepu8_epi16(_mm_load_si128(
                        smb.add(128 + 32 * p + 16 * h) as *const __m128i
                    ));
                    for k in 0..T {
                        let ms = _mm256_madd_epi16(mp, _mm256_set1_epi32(sp[k][lane]));
                        if PAIRS {
                            acc[h][k] =
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(ip[h][k]), dd[h][k], acc[h][k]);
                            accm[h][k] =
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), dm[h][k], accm[h][k]);
                        } else {
                            isb[h][k] = _mm256_add_epi32(isb[h][k], ip[h][k]);
                            msb[h][k] = _mm256_add_epi32(msb[h][k], ms);
                        }
                    }
                }
            }
            if !PAIRS {
                for h in 0..2 {
                    for k in 0..T {
                        acc[h][k] =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(isb[h][k]), dd[h][k], acc[h][k]);
                        accm[h][k] =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(msb[h][k]), dm[h][k], accm[h][k]);
                    }
                }
            }
        }
    }
    for k in 0..T {
        for h in 0..2 {
            // SAFETY: outputs (k, 0..16) are inside the tile.
            unsafe {
                _mm256_storeu_ps(
                    t.out.add(k * t.out_stride + 8 * h),
                    _mm256_sub_ps(acc[h][k], accm[h][k]),
                )
            };
        }
    }
}

macro_rules! packed_q4k_tile {
    ($name:ident, $pairs:expr) => {
        /// # Safety
        /// The [`Tile`] contract of [`q4k_x16`].
        unsafe fn $name(t: &Tile) {
            // SAFETY: forwarded; the plan hands packed kernels whole 16-row groups only.
            unsafe { toks_dispatch!(t, [1, 2, 3, 4], |T| q4k_x16::<T, { $pairs }>(t)) }
        }
    };
}
packed_q4k_tile!(t_q4k_x16, true);
packed_q4k_tile!(t_q4k_x16_gemv, false);

/// The packed `Q4_K` kernels on AVX2: groups of 4 tokens (llama.cpp's gemm order) and the
/// tokens left over (its gemv order). Rows come in whole groups of 16.
pub(crate) fn packed_q4k_kernels() -> (Kernel, Kernel) {
    (packed16(t_q4k_x16, 4), packed16(t_q4k_x16_gemv, 4))
}

/// Lane `r` of half `h` (rows `8h..8h+8`) as the i16 pair `(s_r, s_r)` of the 16 signed row
/// bytes at `p`, sign-extended: a byte shuffle puts `s_r` in the high byte of both i16, an
/// arithmetic shift brings it down.
///
/// # Safety
/// `p` valid for 16 bytes; AVX2 available.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn row_pairs_i8(p: *const u8, h: usize) -> __m256i {
    const Z: i8 = -128;
    let ctrl = if h == 0 {
        _mm256_setr_epi8(
            Z, 0, Z, 0, Z, 1, Z, 1, Z, 2, Z, 2, Z, 3, Z, 3, Z, 4, Z, 4, Z, 5, Z, 5, Z, 6, Z, 6, Z,
            7, Z, 7,
        )
    } else {
        _mm256_setr_epi8(
            Z, 8, Z, 8, Z, 9, Z, 9, Z, 10, Z, 10, Z, 11, Z, 11, Z, 12, Z, 12, Z, 13, Z, 13, Z, 14,
            Z, 14, Z, 15, Z, 15,
        )
    };
    // SAFETY: caller's contract.
    let b = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i)) };
    _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(b, ctrl))
}

/// A tile of 16 packed `Q6_K` rows × `T` tokens, lane `r` of the two 8-row halves = row `r`.
/// Per sub-block `j`, half and token: the four quarters' unsigned 6-bit values times the
/// broadcast activation bytes (`vpmaddubsw`, two quarters per i16 sum), each i16 sum times the
/// row's scale (`vpmaddwd`) into the super-block's integer; then `32 * sum_j scale_j * bsum_j`
/// (the value offset) subtracted: exactly the scalar reference's integer. The float side per
/// (row, token) is [`super::scalar::dot_q6_k`]'s: `r = isum * d`, `acc = fma(r, d_y, acc)` per
/// super-block, lane by lane.
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 16`, `T == t.toks`, `t.w` at the start of a packed
/// group of `t.nb` super-blocks; AVX2/FMA/F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `h` and `k` index several arrays in step
unsafe fn q6k_x16<const T: usize>(t: &Tile) {
    let zi = _mm256_setzero_si256();
    let m4 = _mm256_set1_epi8(0x0f);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = [[_mm256_setzero_ps(); T]; 2];
    // Scale pairs (sub-blocks 2m, 2m + 1) of the 16 rows, interleaved row by row.
    let mut scp = ScaleMins([0; 256]);
    for b in 0..t.nb {
        // SAFETY: super-block b of the group (3360 bytes at x) and block b of every token's
        // activation row (292 bytes at ys[k]) exist by the tile contract.
        unsafe {
            let x = t.w.add(b * Q6K_GROUP_BYTES);
            let d = [f16x8(x), f16x8(x.add(16))];
            let mut ys = [t.a; T];
            let mut dy = [_mm256_setzero_ps(); T];
            for k in 0..T {
                ys[k] = t.a.add(k * t.a_stride + b * 292);
                dy[k] = _mm256_set1_ps(std::ptr::read_unaligned(ys[k] as *const f32));
            }
            let mut isum = [[zi; T]; 2];
            for j in 0..16 {
                let q = x.add(288 + 192 * j);
                for h in 0..2 {
                    let l0 = ld256(q.add(32 * h));
                    let l1 = ld256(q.add(64 + 32 * h));
                    let hb = ld256(q.add(128 + 32 * h));
                    // Quarter k: low 4 bits from l0/l1 (low or high nibble), top 2 bits moved
                    // from bits 2k of `hb` to bits 4..6 (16-bit shifts: the masked bits never
                    // cross a byte).
                    let w0 = _mm256_or_si256(
                        _mm256_and_si256(l0, m4),
                        _mm256_and_si256(_mm256_slli_epi16::<4>(hb), m30),
                    );
                    let w1 = _mm256_or_si256(
                        _mm256_and_si256(l1, m4),
                        _mm256_and_si256(_mm256_slli_epi16::<2>(hb), m30),
                    );
                    let w2 = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4),
                        _mm256_and_si256(hb, m30),
                    );
                    let w3 = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(hb), m30),
                    );
                    let sc = row_pairs_i8(x.add(32 + 16 * j), h);
                    for k in 0..T {
                        let yq = ys[k].add(4 + 16 * j);
                        let s01 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(w0, bcast32(yq)),
                            _mm256_maddubs_epi16(w1, bcast32(yq.add(4))),
                        );
                        let s23 = _mm256_add_epi16(
                            _mm256_maddubs_epi16(w2, bcast32(yq.add(8))),
                            _mm256_maddubs_epi16(w3, bcast32(yq.add(12))),
                        );
                        let s = _mm256_add_epi32(
                            _mm256_madd_epi16(s01, sc),
                            _mm256_madd_epi16(s23, sc),
                        );
                        isum[h][k] = _mm256_add_epi32(isum[h][k], s);
                    }
                }
            }
            // Lane pairs (scale_{2m}, scale_{2m+1}) per row, for the offset's sums.
            let o = scp.0.as_mut_ptr() as *mut __m256i;
            for m in 0..8 {
                _mm256_store_si256(o.add(m), zip_rows(ld256(x.add(32 + 32 * m))));
            }
            let sp = scp.0.as_ptr();
            for h in 0..2 {
                for k in 0..T {
                    let mut corr = zi;
                    for m in 0..8 {
                        let pair = _mm256_cvtepi8_epi16(_mm_load_si128(
                            sp.add(32 * m + 16 * h) as *const __m128i
                        ));
                        let bs = bcast32(ys[k].add(260 + 4 * m));
                        corr = _mm256_add_epi32(corr, _mm256_madd_epi16(pair, bs));
                    }
                    let is = _mm256_sub_epi32(isum[h][k], _mm256_slli_epi32::<5>(corr));
                    let r = _mm256_mul_ps(_mm256_cvtepi32_ps(is), d[h]);
                    acc[h][k] = _mm256_fmadd_ps(r, dy[k], acc[h][k]);
                }
            }
        }
    }
    for k in 0..T {
        for h in 0..2 {
            // SAFETY: outputs (k, 0..16) are inside the tile.
            unsafe { _mm256_storeu_ps(t.out.add(k * t.out_stride + 8 * h), acc[h][k]) };
        }
    }
}

/// # Safety
/// The [`Tile`] contract of [`q6k_x16`].
unsafe fn t_q6k_x16(t: &Tile) {
    // SAFETY: forwarded; the plan hands packed kernels whole 16-row groups only.
    unsafe { toks_dispatch!(t, [1, 2, 3, 4], |T| q6k_x16::<T>(t)) }
}

/// The packed `Q6_K` kernel on AVX2 (every token count; llama.cpp's tiled order per
/// super-block). Rows come in whole groups of 16.
pub(crate) fn packed_q6k_kernel() -> Kernel {
    packed16(t_q6k_x16, 4)
}

// ---- packed 32-element types (Q4_0, Q4_1, Q8_0; `LegacyX16`'s layout) -------------------------

/// The 32-bit lane pairs of `w` (8 rows × 4 weight values, unsigned or signed by `Q8`) times
/// the 4 activation bytes at `y` broadcast to every lane, as i16 pairs: `vpmaddubsw` of the
/// unsigned weights, or for the signed `Q8_0` values (stored `q + 128`, here `q`) ggml's sign
/// trick `|w| * (y * sign(w))`, which stays inside i16 where `q + 128` would not.
///
/// # Safety
/// `y` valid for 4 bytes; AVX2 available.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn group_pairs<const Q8: bool>(w: __m256i, y: *const u8) -> __m256i {
    // SAFETY: caller's contract.
    let b = unsafe { bcast32(y) };
    if Q8 {
        _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(b, w))
    } else {
        _mm256_maddubs_epi16(w, b)
    }
}

/// Weight vector `j` (group `j`: 4 values of each of rows `8h..8h+8`) of the packed group
/// block whose quant vectors start at `q`: nibbles (low for `j < 4`, high for the rest) or,
/// for `Q8`, the signed bytes.
///
/// # Safety
/// `q` at the quant vectors of a packed group block; AVX2 available.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn group_weights<const Q8: bool>(q: *const u8, j: usize, h: usize) -> __m256i {
    // SAFETY: the group block holds 4 (nibbles) or 8 (Q8) vectors of 64 bytes at `q`.
    unsafe {
        if Q8 {
            _mm256_xor_si256(ld256(q.add(64 * j + 32 * h)), _mm256_set1_epi8(-128))
        } else {
            let v = ld256(q.add(64 * (j % 4) + 32 * h));
            let m4 = _mm256_set1_epi8(0x0f);
            if j < 4 {
                _mm256_and_si256(v, m4)
            } else {
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4)
            }
        }
    }
}

/// A tile of 16 packed rows of a 32-element type × `T` tokens (at most 2) in ggml's `vec_dot`
/// order, one 8-row half at a time: per (row, token) eight accumulators, `j` holding group `j`
/// of every block (`fma(d_w * d_y, isum_j, acc_j)`; `Q4_0`'s value offset as the seed
/// `-8 * sum(y_j)` of each group's integer), the min term its own fma chain, then
/// `hsum_float_8` (`((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`) plus the min sum, all as
/// vectors across the rows (`scalar::dot_q4_1` and its siblings, lane by lane).
///
/// # Safety
/// The [`Tile`] contract with `t.rows == 16`, `T == t.toks`, `t.w` at a packed group of `t.nb`
/// blocks of `L`; AVX2/FMA/F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `h`, `k` and `j` index several arrays in step
unsafe fn legacy_x16<L: LegacyX16, const T: usize, const Q8: bool>(t: &Tile) {
    let zf = _mm256_setzero_ps();
    let gb = 16 * L::WB;
    let mut acc = [[[zf; 8]; T]; 2];
    let mut summs = [[zf; T]; 2];
    for b in 0..t.nb {
        // SAFETY: group block b and every token's block b exist by the tile contract.
        unsafe {
            let x = t.w.add(b * gb);
            let mut ys = [t.a; T];
            let mut dy = [zf; T];
            let mut sy = [zf; T];
            // Per token, minus the offset times each group's activation sum (`Q4_0`).
            let mut seeds = [[0i32; 8]; T];
            for k in 0..T {
                ys[k] = t.a.add(k * t.a_stride + b * L::AB);
                let y = ys[k];
                dy[k] = _mm256_set1_ps(rd_f16(y));
                if L::MIN {
                    sy[k] = _mm256_set1_ps(rd_f16(y.add(2)));
                }
                if L::OFF_SHIFT != 0 && !Q8 {
                    let yq = ld256(y.add(L::AQ));
                    let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), yq);
                    let sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
                    let sh = _mm_cvtsi32_si128(L::OFF_SHIFT);
                    let neg = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_sll_epi32(sums, sh));
                    _mm256_storeu_si256(seeds[k].as_mut_ptr() as *mut __m256i, neg);
                }
            }
            let q = x.add(L::QOFF);
            for h in 0..2 {
                let dw = f16x8(x.add(16 * h));
                let mw = if L::MIN {
                    f16x8(x.add(32 + 16 * h))
                } else {
                    zf
                };
                let mut dd = [zf; T];
                for k in 0..T {
                    dd[k] = _mm256_mul_ps(dw, dy[k]);
                    if L::MIN {
                        summs[h][k] = _mm256_fmadd_ps(mw, sy[k], summs[h][k]);
                    }
                }
                for j in 0..8 {
                    let w = group_weights::<Q8>(q, j, h);
                    for k in 0..T {
                        let p = group_pairs::<Q8>(w, ys[k].add(L::AQ + 4 * j));
                        let mut i = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
                        if L::OFF_SHIFT != 0 && !Q8 {
                            i = _mm256_add_epi32(i, _mm256_set1_epi32(seeds[k][j]));
                        }
                        acc[h][k][j] = _mm256_fmadd_ps(dd[k], _mm256_cvtepi32_ps(i), acc[h][k][j]);
                    }
                }
            }
        }
    }
    for k in 0..T {
        for h in 0..2 {
            let a = &acc[h][k];
            let s = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6])),
                _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7])),
            );
            // SAFETY: outputs (k, 0..16) are inside the tile.
            unsafe {
                _mm256_storeu_ps(
                    t.out.add(k * t.out_stride + 8 * h),
                    _mm256_add_ps(s, summs[h][k]),
                )
            };
        }
    }
}

/// [`legacy_x16`] in the whole-block order (`scalar::dot_q4_1_block` and its siblings, lane by
/// lane): per (8-row half, token) and block, the exact integer sum of the block (the unsigned
/// types' eight groups' `vpmaddubsw` pairs summed in i16: at most 8 * 2 * 15 * 127 = 30,480;
/// `Q8_0`'s by `vpmaddwd` per group; `Q4_0` seeded with `-8 * sum(y)`), then one conversion and
/// one `acc = fma(d_w * d_y, isum, acc)`; the min term its own fma chain; at the end
/// `acc + summs`. The activations are the rows of `avx512::block_acts` (`d`, `s` or the seed
/// ready per block: the matmul prepares them for every packed whole-block product).
///
/// # Safety
/// As [`legacy_x16`], with `t.a` at rows of `block_acts` made for this type.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // `h` and `k` index several arrays in step
unsafe fn legacy_x16_block<L: LegacyX16, const T: usize, const Q8: bool>(t: &Tile) {
    let zf = _mm256_setzero_ps();
    let zi = _mm256_setzero_si256();
    let ones = _mm256_set1_epi16(1);
    let gb = 16 * L::WB;
    let mut acc = [[zf; T]; 2];
    let mut summs = [[zf; T]; 2];
    for b in 0..t.nb {
        // SAFETY: group block b and every token's block b exist by the tile contract.
        unsafe {
            let x = t.w.add(b * gb);
            let mut ys = [t.a; T];
            for k in 0..T {
                ys[k] = t.a.add(k * t.a_stride + b * BLOCK_ACT);
            }
            let q = x.add(L::QOFF);
            for h in 0..2 {
                let mut p16 = [zi; T];
                let mut p32 = [zi; T];
                for j in 0..8 {
                    let w = group_weights::<Q8>(q, j, h);
                    for k in 0..T {
                        let p = group_pairs::<Q8>(w, ys[k].add(BLOCK_ACT_Q + 4 * j));
                        if Q8 {
                            p32[k] = _mm256_add_epi32(p32[k], _mm256_madd_epi16(p, ones));
                        } else {
                            p16[k] = _mm256_add_epi16(p16[k], p);
                        }
                    }
                }
                let dw = f16x8(x.add(16 * h));
                let mw = if L::MIN {
                    f16x8(x.add(32 + 16 * h))
                } else {
                    zf
                };
                for k in 0..T {
                    let y = ys[k];
                    let mut isum = if Q8 {
                        p32[k]
                    } else {
                        _mm256_madd_epi16(p16[k], ones)
                    };
                    if L::OFF_SHIFT != 0 && !Q8 {
                        let seed = std::ptr::read_unaligned(y.add(4) as *const i32);
                        isum = _mm256_add_epi32(isum, _mm256_set1_epi32(seed));
                    }
                    let dy = _mm256_set1_ps(std::ptr::read_unaligned(y as *const f32));
                    let dd = _mm256_mul_ps(dw, dy);
                    acc[h][k] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum), acc[h][k]);
                    if L::MIN {
                        let sy = _mm256_set1_ps(std::ptr::read_unaligned(y.add(4) as *const f32));
                        summs[h][k] = _mm256_fmadd_ps(mw, sy, summs[h][k]);
                    }
                }
            }
        }
    }
    for k in 0..T {
        for h in 0..2 {
            // SAFETY: outputs (k, 0..16) are inside the tile.
            unsafe {
                _mm256_storeu_ps(
                    t.out.add(k * t.out_stride + 8 * h),
                    _mm256_add_ps(acc[h][k], summs[h][k]),
                )
            };
        }
    }
}

macro_rules! legacy_x16_kernels {
    ($ggml:ident, $block:ident, $ty:ty, $q8:expr) => {
        /// # Safety
        /// The [`Tile`] contract of [`legacy_x16`].
        unsafe fn $ggml(t: &Tile) {
            // SAFETY: forwarded; the plan hands packed kernels whole 16-row groups only.
            unsafe { toks_dispatch!(t, [1, 2], |T| legacy_x16::<$ty, T, { $q8 }>(t)) }
        }

        /// # Safety
        /// The [`Tile`] contract of [`legacy_x16_block`].
        unsafe fn $block(t: &Tile) {
            // SAFETY: forwarded; the plan hands packed kernels whole 16-row groups only.
            unsafe { toks_dispatch!(t, [1, 2, 3, 4], |T| legacy_x16_block::<$ty, T, { $q8 }>(t)) }
        }
    };
}
legacy_x16_kernels!(x16_q4_0, x16b_q4_0, X16Q4_0, false);
legacy_x16_kernels!(x16_q4_1, x16b_q4_1, X16Q4_1, false);
legacy_x16_kernels!(x16_q8_0, x16b_q8_0, X16Q8_0, true);

/// The packed kernel of a 32-element type on AVX2 in summation order `order` (up to 2 tokens
/// per tile in ggml's order, 4 in the whole-block order).
pub(crate) fn packed_legacy_kernel(ty: GgmlType, order: SumOrder) -> Option<Kernel> {
    let (tile, nt): (unsafe fn(&Tile), usize) = match (ty, order) {
        (GgmlType::Q4_0, SumOrder::Ggml) => (x16_q4_0, 2),
        (GgmlType::Q4_1, SumOrder::Ggml) => (x16_q4_1, 2),
        (GgmlType::Q8_0, SumOrder::Ggml) => (x16_q8_0, 2),
        (GgmlType::Q4_0, SumOrder::Block) => (x16b_q4_0, 4),
        (GgmlType::Q4_1, SumOrder::Block) => (x16b_q4_1, 4),
        (GgmlType::Q8_0, SumOrder::Block) => (x16b_q8_0, 4),
        _ => return None,
    };
    Some(packed16(tile, nt))
}
