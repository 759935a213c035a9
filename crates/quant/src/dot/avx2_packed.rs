//! AVX2 kernels over the packed 16-row layouts of [`super::packed`] (the same bytes the AVX-512
//! kernels read): each 64-byte vector of a group holds 4 consecutive elements of each of 16
//! rows, so its two 32-byte halves are rows 0..8 and rows 8..16, one 8-row vector each.
//!
//! Without `vpdpbusd`, a row's partial sums come from `vpmaddubsw` (unsigned weight bytes times
//! the signed activation bytes broadcast to every lane, pairs added to i16) kept in i16 over a
//! whole 32-element sub-block (at most 8 such pairs per lane: |sum| <= 8 * 2 * 15 * 128 =
//! 30,720 for 4-bit values, so no i16 overflows or saturates), then one `vpmaddwd` with the
//! row's sub-block scale in both i16 halves of its lane: exactly `scale * sum` in i32. The
//! integers are therefore those of the scalar reference, and the float steps per (row, token)
//! are its own, lane by lane, so the results are bit for bit [`super::scalar::dot_q4_k`]'s
//! (groups of 4 tokens) and [`super::scalar::dot_q4_k_gemv`]'s (the tokens left over).
//! `Q6_K`'s 6-bit values take 4 pairs per i16 sum (|sum| <= 4 * 63 * 127 = 32,004), so each
//! sub-block makes two `vpmaddwd` with its signed scale, and the value offset (`- 32` per
//! element) is subtracted once per super-block as `32 * sum_j scale_j * bsum_j`: the same
//! integer as [`super::scalar::dot_q6_k`]'s.
//!
//! Next to the GGUF-layout 8-row kernels of [`super::avx2`] this drops every horizontal
//! reduction and transpose (lane `r` is row `r` throughout), unpacks each weight byte once for
//! up to 4 tokens and 16 rows, and loads each activation word once for 16 rows.

use std::arch::x86_64::*;

use super::avx2::ld256;
use super::kernels::{packed16, Kernel, Tile};
use super::packed::{Q4K_GROUP_BYTES, Q6K_GROUP_BYTES};

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
            unsafe {
                match t.toks {
                    1 => q4k_x16::<1, { $pairs }>(t),
                    2 => q4k_x16::<2, { $pairs }>(t),
                    3 => q4k_x16::<3, { $pairs }>(t),
                    4 => q4k_x16::<4, { $pairs }>(t),
                    _ => debug_assert!(false, "tile with {} tokens", t.toks),
                }
            }
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
    unsafe {
        match t.toks {
            1 => q6k_x16::<1>(t),
            2 => q6k_x16::<2>(t),
            3 => q6k_x16::<3>(t),
            4 => q6k_x16::<4>(t),
            _ => debug_assert!(false, "tile with {} tokens", t.toks),
        }
    }
}

/// The packed `Q6_K` kernel on AVX2 (every token count; llama.cpp's tiled order per
/// super-block). Rows come in whole groups of 16.
pub(crate) fn packed_q6k_kernel() -> Kernel {
    packed16(t_q6k_x16, 4)
}
