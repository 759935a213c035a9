//! Weight matrices repacked once, at load, into a layout made for this CPU's kernels.
//!
//! `Q4_K` rows in GGUF order make an AVX-512 kernel unpack every row's nibbles and scales per
//! 64-element chunk and reduce each (row, token) pair's integer sums horizontally, which costs
//! more than the integer products themselves. llama.cpp repacks `Q4_K` at load for the same
//! reason (`q4_K_8x8`). Here 16 rows are interleaved per super-block so that one 512-bit vector
//! holds 4 consecutive elements of each of the 16 rows: `vpdpbusd` against 4 activation bytes
//! broadcast to every lane then yields 16 rows' partial dot products in 16 lanes, with no
//! horizontal work, and the per-row scales, mins and `d` are vectors across rows.
//!
//! Only the integer work is rearranged: per (row, token) the float operations are the same, in
//! the same order, as [`super::scalar::dot_q4_k`] (groups of 4 tokens) and
//! [`super::scalar::dot_q4_k_gemv`] (the tokens left over, and decode), so the results are bit
//! for bit those of the GGUF-layout kernels (and of llama.cpp).
//!
//! The AVX2 kernels (`super::avx2_packed`) read the same layouts as two 8-row halves: bytes
//! 0..32 of each 64-byte vector are rows 0..8, bytes 32..64 rows 8..16.
//!
//! `Q4_0`, `Q4_1` and `Q8_0` use the same idea for decode, where a one-token product otherwise
//! spends most of its time on per-row unpacking and scalar scale work: per 16-row group and
//! block, the rows' `d` (and `m`) as f16 vectors and the quants as vectors of 16 rows × 4
//! bytes, so each of ggml's eight per-group accumulators is one vector across the 16 rows
//! (`avx512::legacy_x16`, bit-identical to `scalar::dot_q4_1` and its siblings); in the
//! whole-block order (`SumOrder::Block`) the eight `vpdpbusd` of a block chain into one integer
//! vector, with one conversion and one fma per block for the 16 rows
//! (`avx512::legacy_x16_block`, bit-identical to `scalar::dot_q4_1_block`).
//!
//! Layout of one `Q4_K` group (16 rows) for super-block `b`, [`Q4K_GROUP_BYTES`] = 16 × 144 bytes,
//! groups of super-blocks stored super-block after super-block, groups after groups (so group
//! `g` starts at byte `16 g` × row bytes, as in the GGUF layout):
//!
//! | bytes | content |
//! |---|---|
//! | 0..32 | `d` of rows 0..16 (f16) |
//! | 32..64 | `dmin` of rows 0..16 (f16) |
//! | 64..256 | the 12 packed scale bytes, byte `k` of row `r` at `64 + 16 k + r` |
//! | 256..2304 | 32 vectors of 64 bytes: vector `4 j + k` (sub-block `j`, quarter `k`), byte `4 r + i`: low nibble = element `32 j + 8 k + i` of row `r`, high nibble = element `32 j + 8 k + 4 + i` |
//!
//! `Q6_K` (the 1B models' output matrix, `ffn_down` and `attn_v`) takes the same grouping for
//! its 16 sub-blocks of 16 elements: each element's unsigned 6-bit value `u` (the stored
//! `q + 32`) in the bytes of vectors of 16 rows × 4 elements, so `vpdpbusd` gives a
//! sub-block's sum per row; the `- 32` comes from the activation's 16-element sums (`bsums`)
//! seeding that sum, the sub-block scale is one `vpmulld`, and the float side per
//! (row, token) is [`super::scalar::dot_q6_k`]'s (`isum * d`, then one fma with `d_y` per
//! super-block). Layout of one group block, [`Q6K_GROUP_BYTES`] = 16 × 210 bytes:
//!
//! | bytes | content |
//! |---|---|
//! | 0..32 | `d` of rows 0..16 (f16) |
//! | 32..288 | the 16 scales (i8), scale `j` of row `r` at `32 + 16 j + r` |
//! | 288..3360 | per sub-block `j`, 3 vectors of 64 bytes at `288 + 192 j`; with `e_k` = element `16 j + 4 k + i` of row `r`, byte `4 r + i` of vector 0 holds the low 4 bits of `u(e_0)` and (high nibble) of `u(e_2)`, vector 1 those of `u(e_1)` and `u(e_3)`, vector 2 the top 2 bits of `u(e_k)` at bits `2 k` for `k` = 0..4 |

use gguf::GgmlType;

use super::kernels::Kernel;
use super::{row_bytes, DotError, Isa, SumOrder};

/// Rows interleaved per group of the packed `Q4_K` layout.
pub const Q4K_GROUP_ROWS: usize = 16;
/// Bytes of one group of [`Q4K_GROUP_ROWS`] rows for one super-block (the same as in GGUF).
pub const Q4K_GROUP_BYTES: usize = Q4K_GROUP_ROWS * 144;
/// Bytes of one group of 16 rows of the packed `Q6_K` layout for one super-block.
pub const Q6K_GROUP_BYTES: usize = Q4K_GROUP_ROWS * 210;
/// Bytes of the source read per stretch by [`PackedMat::pack_with`] and
/// [`PackedMat::copy_with`] before the caller is told it may release them.
const STRETCH: usize = 4 << 20;

/// 64-byte aligned storage unit.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A weight matrix in owned memory, in a kernel-specific layout (see the module docs) made by
/// [`PackedMat::pack`], or a plain copy ([`PackedMat::copy`]), from GGUF bytes; multiplied by [`super::matmul_f32_packed`] /
/// [`super::matmul_packed`], with results bit-identical to [`super::matmul`] on the GGUF bytes.
pub struct PackedMat {
    /// Whether `data` is in the interleaved layout (else a plain copy of the GGUF bytes).
    interleaved: bool,
    /// The instruction set whose kernels multiply the interleaved layout.
    isa: Isa,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    len: usize,
    data: Vec<Line>,
}

impl std::fmt::Debug for PackedMat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMat")
            .field("ty", &self.ty)
            .field("isa", &self.isa)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl PackedMat {
    /// Whether [`PackedMat::pack_with_isa`] would pack a `rows × cols` matrix of `ty` for `isa`:
    /// `Q4_K`, `Q6_K`, `Q4_0`, `Q4_1` or `Q8_0` with a multiple of 16 rows, on AVX-512 or AVX2.
    pub fn packable(ty: GgmlType, rows: usize, cols: usize, isa: Isa) -> bool {
        let ty_ok = matches!(isa, Isa::Avx512 | Isa::Avx2)
            && matches!(
                ty,
                GgmlType::Q4K | GgmlType::Q6K | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0
            );
        ty_ok
            && isa.available()
            && rows > 0
            && rows.is_multiple_of(Q4K_GROUP_ROWS)
            && cols > 0
            && cols.is_multiple_of(ty.block_size())
    }

    /// Repack `rows` rows of `cols` elements of `ty` (GGUF layout, `w`) for the best
    /// instruction set, or `Ok(None)` when no packed kernel takes this type, shape or CPU (then
    /// multiply the GGUF bytes with [`super::matmul`]).
    pub fn pack(
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<Option<PackedMat>, DotError> {
        Self::pack_with_isa(ty, w, rows, cols, super::best_isa())
    }

    /// [`PackedMat::pack`] for an explicit instruction set.
    pub fn pack_with_isa(
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        isa: Isa,
    ) -> Result<Option<PackedMat>, DotError> {
        Self::pack_with(ty, w, rows, cols, isa, |_| {})
    }

    /// [`PackedMat::pack_with_isa`], calling `done` with each stretch of `w` (a few MiB of
    /// whole 16-row groups, in order) once it is packed, so a caller can release the source's
    /// pages as it goes: a large matrix (a 1B model's 215 MB output) is then never held twice.
    /// `done` is not called when the matrix is not packed (`Ok(None)`).
    pub fn pack_with(
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        isa: Isa,
        mut done: impl FnMut(&[u8]),
    ) -> Result<Option<PackedMat>, DotError> {
        let wrb = row_bytes(ty, cols)?;
        let len = wrb.checked_mul(rows).ok_or(DotError::Overflow {
            what: "weight matrix size",
        })?;
        if w.len() != len {
            return Err(DotError::Length {
                what: "weights (bytes)",
                expected: len,
                got: w.len(),
            });
        }
        if !Self::packable(ty, rows, cols, isa) {
            return Ok(None);
        }
        let mut data = lines(len);
        // SAFETY: `data` holds at least `len` bytes; `Line` is plain bytes.
        let dst = unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr() as *mut u8, len) };
        let bs = ty.block_size();
        let wb = ty.type_size();
        let nb = cols / bs;
        let gb = Q4K_GROUP_ROWS * wb;
        let group = Q4K_GROUP_ROWS * wrb;
        // Groups are independent: spread them over rayon's threads (a 1B model packs about
        // 760 MiB at load), a stretch of them at a time.
        use rayon::prelude::*;
        let stretch = (STRETCH / group).max(1) * group;
        for (ws, ds) in w.chunks(stretch).zip(dst.chunks_mut(stretch)) {
            ws.par_chunks_exact(group)
                .zip(ds.par_chunks_exact_mut(group))
                .for_each(|(src, out)| {
                    for b in 0..nb {
                        let o = &mut out[b * gb..(b + 1) * gb];
                        for r in 0..Q4K_GROUP_ROWS {
                            let x = &src[r * wrb + b * wb..r * wrb + (b + 1) * wb];
                            match ty {
                                GgmlType::Q4K => pack_q4k_row(x, r, o),
                                GgmlType::Q6K => pack_q6k_row(x, r, o),
                                _ => pack_legacy_row(ty, x, r, o),
                            }
                        }
                    }
                });
            done(ws);
        }
        Ok(Some(PackedMat {
            interleaved: true,
            isa,
            ty,
            rows,
            cols,
            len,
            data,
        }))
    }

    /// A plain copy of `rows` rows of `ty` weights (GGUF layout, `w`) in aligned owned
    /// memory, multiplied with the same kernels as the original: for callers that release
    /// the original's file pages (which the kernel maps in large runs that straddle tensors).
    pub fn copy(ty: GgmlType, w: &[u8], rows: usize, cols: usize) -> Result<PackedMat, DotError> {
        Self::copy_with(ty, w, rows, cols, |_| {})
    }

    /// [`PackedMat::copy`], calling `done` with each stretch of `w` (a few MiB) once it is
    /// copied, so a caller can release the source's pages as it goes (a large matrix is then
    /// never held twice).
    pub fn copy_with(
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        mut done: impl FnMut(&[u8]),
    ) -> Result<PackedMat, DotError> {
        let wrb = row_bytes(ty, cols)?;
        let len = wrb.checked_mul(rows).ok_or(DotError::Overflow {
            what: "weight matrix size",
        })?;
        if w.len() != len {
            return Err(DotError::Length {
                what: "weights (bytes)",
                expected: len,
                got: w.len(),
            });
        }
        let mut data = lines(len);
        // SAFETY: `data` holds at least `len` bytes; `Line` is plain bytes.
        let dst = unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr() as *mut u8, len) };
        for (d, s) in dst.chunks_mut(STRETCH).zip(w.chunks(STRETCH)) {
            d.copy_from_slice(s);
            done(s);
        }
        Ok(PackedMat {
            interleaved: false,
            isa: Isa::Scalar,
            ty,
            rows,
            cols,
            len,
            data,
        })
    }

    /// Whether the rows are interleaved for a packed kernel (else a plain copy).
    pub fn is_interleaved(&self) -> bool {
        self.interleaved
    }

    /// The weight type.
    pub fn weight_type(&self) -> GgmlType {
        self.ty
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The packed bytes (as many as the GGUF layout has).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `data` holds at least `len` initialized bytes; `Line` is plain bytes.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.len) }
    }

    /// Row `r` back in GGUF layout (`None` past the last row).
    pub fn unpack_row(&self, r: usize) -> Option<Vec<u8>> {
        if r >= self.rows {
            return None;
        }
        if !self.interleaved {
            let wrb = self.len / self.rows;
            return self.bytes().get(r * wrb..(r + 1) * wrb).map(|b| b.to_vec());
        }
        let wb = self.ty.type_size();
        let nb = self.cols / self.ty.block_size();
        let gb = Q4K_GROUP_ROWS * wb;
        let (g, rr) = (r / Q4K_GROUP_ROWS, r % Q4K_GROUP_ROWS);
        let group = self.bytes().get(g * nb * gb..(g + 1) * nb * gb)?;
        let mut out = vec![0u8; nb * wb];
        for (b, x) in out.chunks_exact_mut(wb).enumerate() {
            let o = &group[b * gb..(b + 1) * gb];
            match self.ty {
                GgmlType::Q4K => unpack_q4k_row(o, rr, x),
                GgmlType::Q6K => unpack_q6k_row(o, rr, x),
                _ => unpack_legacy_row(self.ty, o, rr, x),
            }
        }
        Some(out)
    }

    /// The AMX kernel for products of many tokens in summation order `order`, where AMX is
    /// usable, and whether it reads transposed activations (`super::avx512::wide_acts`); `None`
    /// for other types.
    pub(crate) fn amx_kernel(&self, order: SumOrder) -> Option<(Kernel, bool)> {
        #[cfg(target_arch = "x86_64")]
        if self.interleaved && self.isa == Isa::Avx512 && super::amx::amx_available() {
            if self.ty == GgmlType::Q4K {
                return Some((super::amx::packed_q4k_amx_kernel(), false));
            }
            return super::amx::packed_legacy_amx_kernel(self.ty, order);
        }
        let _ = order;
        None
    }

    /// The kernel for groups of 4 tokens and the one for the tokens left over, in summation
    /// order `order` (heeded by the 32-element block types).
    pub(crate) fn kernels(&self, order: SumOrder) -> Option<(Kernel, Kernel)> {
        #[cfg(target_arch = "x86_64")]
        if self.interleaved && self.isa == Isa::Avx2 {
            return match self.ty {
                GgmlType::Q4K => Some(super::avx2_packed::packed_q4k_kernels()),
                GgmlType::Q6K => {
                    let k = super::avx2_packed::packed_q6k_kernel();
                    Some((k, k))
                }
                _ => super::avx2_packed::packed_legacy_kernel(self.ty, order).map(|k| (k, k)),
            };
        }
        #[cfg(target_arch = "x86_64")]
        if self.interleaved {
            if self.ty == GgmlType::Q4K {
                return Some(super::avx512::packed_q4k_kernels());
            }
            if self.ty == GgmlType::Q6K {
                let k = super::avx512::packed_q6k_kernel();
                return Some((k, k));
            }
            return super::avx512::packed_legacy_kernel(self.ty, order).map(|k| (k, k));
        }
        let _ = order;
        None
    }
}

/// Zeroed storage for `len` bytes. Large buffers are asked to be backed by huge pages
/// (`MADV_HUGEPAGE`, before anything touches them): a decode step streams every weight once,
/// and 2 MiB pages spare it most of the page-table walks of 4 KiB ones.
fn lines(len: usize) -> Vec<Line> {
    let n = len.div_ceil(64);
    // Reserve first and advise before the zeroing touches the pages.
    let mut v: Vec<Line> = Vec::with_capacity(n);
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let (start, end) = (v.as_ptr() as usize, v.as_ptr() as usize + n * 64);
        let (a, b) = (start.div_ceil(HUGE) * HUGE, end / HUGE * HUGE);
        if b > a {
            // SAFETY: [a, b) lies inside `v`'s allocation; MADV_HUGEPAGE only changes how the
            // kernel backs the pages, never their contents.
            unsafe {
                libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE);
            }
        }
    }
    v.resize(n, Line([0; 64]));
    v
}

/// Place one row's `Q4_K` block `x` (144 bytes) as row `r` of the packed group block `o`.
fn pack_q4k_row(x: &[u8], r: usize, o: &mut [u8]) {
    o[2 * r..2 * r + 2].copy_from_slice(&x[0..2]);
    o[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&x[2..4]);
    for k in 0..12 {
        o[64 + 16 * k + r] = x[4 + k];
    }
    let qs = &x[16..144];
    // Element e = 64c + 32h + l is nibble h of qs[32c + l].
    let q = |e: usize| (qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 0x0f;
    for j in 0..8 {
        for k in 0..4 {
            for i in 0..4 {
                let e = 32 * j + 8 * k + i;
                o[256 + 64 * (4 * j + k) + 4 * r + i] = q(e) | (q(e + 4) << 4);
            }
        }
    }
}

/// Where a legacy type's group block keeps its quant vectors, and whether it has a min.
fn legacy_layout(ty: GgmlType) -> (usize, usize, bool) {
    // (offset of the quants in the GGUF block, offset of the vectors in the group block, min)
    match ty {
        GgmlType::Q4_1 => (4, 64, true),
        _ => (2, 32, false),
    }
}

/// Place one row's block `x` of `Q4_0`/`Q4_1`/`Q8_0` as row `r` of the packed group block `o`:
/// `d` at `2 r`, `m` at `32 + 2 r`, then vectors of 16 rows × 4 quant bytes (`Q8_0`: 8 of
/// them, stored `q + 128`; the 4-bit types: 4, whose low nibbles are the group `k` and high
/// nibbles the group `k + 4`, as in the GGUF bytes).
fn pack_legacy_row(ty: GgmlType, x: &[u8], r: usize, o: &mut [u8]) {
    let (xq, oq, min) = legacy_layout(ty);
    o[2 * r..2 * r + 2].copy_from_slice(&x[0..2]);
    if min {
        o[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&x[2..4]);
    }
    let flip = if ty == GgmlType::Q8_0 { 0x80 } else { 0 };
    for (k, q) in x[xq..].chunks_exact(4).enumerate() {
        for (i, &v) in q.iter().enumerate() {
            o[oq + 64 * k + 4 * r + i] = v ^ flip;
        }
    }
}

/// The inverse of [`pack_legacy_row`].
fn unpack_legacy_row(ty: GgmlType, o: &[u8], r: usize, x: &mut [u8]) {
    let (xq, oq, min) = legacy_layout(ty);
    x[0..2].copy_from_slice(&o[2 * r..2 * r + 2]);
    if min {
        x[2..4].copy_from_slice(&o[32 + 2 * r..32 + 2 * r + 2]);
    }
    let flip = if ty == GgmlType::Q8_0 { 0x80 } else { 0 };
    for (k, q) in x[xq..].chunks_exact_mut(4).enumerate() {
        for (i, v) in q.iter_mut().enumerate() {
            *v = o[oq + 64 * k + 4 * r + i] ^ flip;
        }
    }
}

/// The inverse of [`pack_q4k_row`].
fn unpack_q4k_row(o: &[u8], r: usize, x: &mut [u8]) {
    x[0..2].copy_from_slice(&o[2 * r..2 * r + 2]);
    x[2..4].copy_from_slice(&o[32 + 2 * r..32 + 2 * r + 2]);
    for k in 0..12 {
        x[4 + k] = o[64 + 16 * k + r];
    }
    let qs = &mut x[16..144];
    qs.fill(0);
    for j in 0..8 {
        for k in 0..4 {
            for i in 0..4 {
                let e = 32 * j + 8 * k + i;
                let v = o[256 + 64 * (4 * j + k) + 4 * r + i];
                for (e, q) in [(e, v & 0x0f), (e + 4, v >> 4)] {
                    qs[32 * (e / 64) + e % 32] |= q << (4 * ((e / 32) % 2));
                }
            }
        }
    }
}

/// The unsigned 6-bit values (`q + 32`, 0..64) of the 256 elements of a `Q6_K` block `x`.
/// Element e = 128h + 32s + l: its low 4 bits are nibble `s >> 1` of `ql[64h + 32(s & 1) + l]`,
/// its top 2 bits sit at `2s` of `qh[32h + l]` (as in `scalar::dot_q6_k`).
fn q6k_values(x: &[u8]) -> [u8; 256] {
    let (ql, qh) = (&x[0..128], &x[128..192]);
    let mut u = [0u8; 256];
    for (e, v) in u.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let lq = (ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0x0f;
        let hq = (qh[32 * h + l] >> (2 * s)) & 3;
        *v = lq | (hq << 4);
    }
    u
}

/// Place one row's `Q6_K` block `x` (210 bytes) as row `r` of the packed group block `o`
/// (layout in the module docs).
fn pack_q6k_row(x: &[u8], r: usize, o: &mut [u8]) {
    o[2 * r..2 * r + 2].copy_from_slice(&x[208..210]);
    for j in 0..16 {
        o[32 + 16 * j + r] = x[192 + j];
    }
    let u = q6k_values(x);
    for j in 0..16 {
        for i in 0..4 {
            let e = |k: usize| u[16 * j + 4 * k + i];
            let at = 288 + 192 * j + 4 * r + i;
            o[at] = (e(0) & 0x0f) | (e(2) << 4);
            o[at + 64] = (e(1) & 0x0f) | (e(3) << 4);
            o[at + 128] =
                (e(0) >> 4) | ((e(1) >> 4) << 2) | ((e(2) >> 4) << 4) | ((e(3) >> 4) << 6);
        }
    }
}

/// The inverse of [`pack_q6k_row`].
fn unpack_q6k_row(o: &[u8], r: usize, x: &mut [u8]) {
    x[208..210].copy_from_slice(&o[2 * r..2 * r + 2]);
    for j in 0..16 {
        x[192 + j] = o[32 + 16 * j + r];
    }
    x[0..192].fill(0);
    for j in 0..16 {
        for i in 0..4 {
            let at = 288 + 192 * j + 4 * r + i;
            let (l0, l1, hb) = (o[at], o[at + 64], o[at + 128]);
            for k in 0..4 {
                let lo = [l0 & 0x0f, l1 & 0x0f, l0 >> 4, l1 >> 4][k];
                let u = lo | (((hb >> (2 * k)) & 3) << 4);
                let e = 16 * j + 4 * k + i;
                let (h, s, l) = (e / 128, (e % 128) / 32, e % 32);
                x[64 * h + 32 * (s & 1) + l] |= (u & 0x0f) << (4 * (s >> 1));
                x[128 + 32 * h + l] |= (u >> 4) << (2 * s);
            }
        }
    }
}
