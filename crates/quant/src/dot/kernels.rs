//! The kernel table: which tile function computes a weight type on an instruction set, and the
//! activation quantizer each level uses.

use super::{scalar, Isa, SumOrder};
use gguf::GgmlType;

/// One tile of a matrix product: `rows` consecutive weight rows times `toks` consecutive
/// activation rows, written to `out[t * out_stride + r]`.
///
/// A tile function may assume: `w` points at `rows` rows of `nb` blocks each (`w_stride` bytes
/// apart), `a` at `toks` activation rows of the matching activation type (`a_stride` bytes
/// apart), `out` has room for every `(t, r)` it writes, `rows <= mr` (`mr1` when `toks == 1`)
/// and `1 <= toks <= nt` of its [`Kernel`], and its instruction set is available. For float types a "block" is one element.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub nb: usize,
    pub w: *const u8,
    pub w_stride: usize,
    pub a: *const u8,
    pub a_stride: usize,
    pub out: *mut f32,
    pub out_stride: usize,
    pub rows: usize,
    pub toks: usize,
}

impl Tile {
    /// The one-row tile of row `r` (`r < rows`).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub fn row(&self, r: usize) -> Tile {
        Tile {
            // Pointer arithmetic only: the caller's contract keeps it in bounds.
            w: self.w.wrapping_add(r * self.w_stride),
            out: self.out.wrapping_add(r),
            rows: 1,
            ..*self
        }
    }
}

pub(crate) type TileFn = unsafe fn(&Tile);

/// A kernel over a packed 16-row layout (`super::packed`): tiles of exactly 16 rows and up to
/// `nt` tokens.
#[cfg(target_arch = "x86_64")]
pub(crate) fn packed16(tile: TileFn, nt: usize) -> Kernel {
    Kernel {
        mr: 16,
        nt,
        mr1: 16,
        exact_rows: true,
        tile,
    }
}

/// A tile function and the largest tile it takes.
#[derive(Clone, Copy)]
pub(crate) struct Kernel {
    /// Rows per full tile; the function also takes fewer.
    pub mr: usize,
    /// Tokens per full tile; the function also takes fewer.
    pub nt: usize,
    /// Rows per tile when the tile has a single token (decode).
    pub mr1: usize,
    /// The tile takes exactly `mr` rows, never fewer (packed layouts interleave `mr` rows), so
    /// a product's chunks must be whole multiples of `mr` rows.
    pub exact_rows: bool,
    pub tile: TileFn,
}

/// Expand a tile function generic over `<const R: usize, const T: usize>` into one taking any
/// `rows <= max(MR, MR1)` and `toks in 1..=NT`: one-token tiles of `MR1` rows use `f::<MR1, 1>`,
/// tiles of `MR` rows use `f::<MR, toks>`, anything shorter runs row by row with `f::<1, toks>`.
#[cfg(target_arch = "x86_64")]
macro_rules! tile_dispatch {
    ($tile:expr, $f:ident, $mr:literal, [$($nt:literal),+], $mr1:literal) => {{
        let t: &$crate::dot::kernels::Tile = $tile;
        if t.toks == 1 && t.rows == $mr1 {
            $f::<$mr1, 1>(t)
        } else if t.rows == $mr {
            match t.toks {
                $($nt => $f::<$mr, $nt>(t),)+
                _ => debug_assert!(false, "tile with {} tokens", t.toks),
            }
        } else {
            for r in 0..t.rows {
                let s = t.row(r);
                match t.toks {
                    $($nt => $f::<1, $nt>(&s),)+
                    _ => debug_assert!(false, "tile with {} tokens", t.toks),
                }
            }
        }
    }};
}
#[cfg(target_arch = "x86_64")]
pub(crate) use tile_dispatch;

/// Run `$call` with the const `$T` set to the tile's token count, one of the listed counts (a
/// count not listed is a planning error): the token dispatch of the packed 16-row kernels.
#[cfg(target_arch = "x86_64")]
macro_rules! toks_dispatch {
    ($t:expr, [$($nt:literal),+], |$T:ident| $call:expr) => {
        match $t.toks {
            $($nt => {
                const $T: usize = $nt;
                $call
            })+
            _ => debug_assert!(false, "tile with {} tokens", $t.toks),
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use toks_dispatch;

/// Run a scalar row-dot over every `(row, token)` of a tile.
///
/// # Safety
/// The [`Tile`] contract, with `wb`/`ab` the byte lengths of one weight/activation row.
#[inline(always)]
unsafe fn scalar_tile(t: &Tile, wb: usize, ab: usize, f: fn(&[u8], &[u8]) -> f32) {
    for r in 0..t.rows {
        // SAFETY: the tile contract: row r of the weights is `wb` readable bytes.
        let w = unsafe { std::slice::from_raw_parts(t.w.add(r * t.w_stride), wb) };
        for k in 0..t.toks {
            // SAFETY: as above for activation row k and output element (k, r).
            unsafe {
                let a = std::slice::from_raw_parts(t.a.add(k * t.a_stride), ab);
                *t.out.add(k * t.out_stride + r) = f(w, a);
            }
        }
    }
}

macro_rules! scalar_kernel {
    ($name:ident, $f:path, $wsize:expr, $asize:expr) => {
        /// # Safety
        /// The [`Tile`] contract.
        unsafe fn $name(t: &Tile) {
            // SAFETY: forwarded from the caller.
            unsafe { scalar_tile(t, t.nb * $wsize, t.nb * $asize, $f) }
        }
    };
}
scalar_kernel!(s_f32, scalar::dot_f32w, 4, 4);
scalar_kernel!(s_f16, scalar::dot_f16w, 2, 4);
scalar_kernel!(s_bf16, scalar::dot_bf16w, 2, 4);
scalar_kernel!(s_q4_0, scalar::dot_q4_0, 18, 34);
scalar_kernel!(s_q4_1, scalar::dot_q4_1, 20, 36);
scalar_kernel!(s_q5_0, scalar::dot_q5_0, 22, 34);
scalar_kernel!(s_q5_1, scalar::dot_q5_1, 24, 36);
scalar_kernel!(s_q8_0, scalar::dot_q8_0, 34, 34);
scalar_kernel!(s_q4_0_block, scalar::dot_q4_0_block, 18, 34);
scalar_kernel!(s_q4_1_block, scalar::dot_q4_1_block, 20, 36);
scalar_kernel!(s_q5_0_block, scalar::dot_q5_0_block, 22, 34);
scalar_kernel!(s_q5_1_block, scalar::dot_q5_1_block, 24, 36);
scalar_kernel!(s_q8_0_block, scalar::dot_q8_0_block, 34, 34);
scalar_kernel!(s_q2_k, scalar::dot_q2_k, 84, 292);
scalar_kernel!(s_q3_k, scalar::dot_q3_k, 110, 292);
scalar_kernel!(s_q4_k, scalar::dot_q4_k, 144, 292);
scalar_kernel!(s_q4_k_gemv, scalar::dot_q4_k_gemv, 144, 292);
scalar_kernel!(s_q5_k, scalar::dot_q5_k, 176, 292);
scalar_kernel!(s_q6_k, scalar::dot_q6_k, 210, 292);

fn scalar_kernel(ty: GgmlType, order: SumOrder) -> Option<Kernel> {
    use GgmlType::*;
    let tile: TileFn = match (ty, order) {
        (Q4_0, SumOrder::Block) => s_q4_0_block,
        (Q4_1, SumOrder::Block) => s_q4_1_block,
        (Q5_0, SumOrder::Block) => s_q5_0_block,
        (Q5_1, SumOrder::Block) => s_q5_1_block,
        (Q8_0, SumOrder::Block) => s_q8_0_block,
        (ty, _) => match ty {
            F32 => s_f32,
            F16 => s_f16,
            BF16 => s_bf16,
            Q4_0 => s_q4_0,
            Q4_1 => s_q4_1,
            Q5_0 => s_q5_0,
            Q5_1 => s_q5_1,
            Q8_0 => s_q8_0,
            Q2K => s_q2_k,
            Q3K => s_q3_k,
            Q4K => s_q4_k,
            Q5K => s_q5_k,
            Q6K => s_q6_k,
            _ => return None,
        },
    };
    Some(Kernel {
        mr: 1,
        nt: 1,
        mr1: 1,
        exact_rows: false,
        tile,
    })
}

/// The kernel for weight type `ty` on `isa` in summation order `order` (heeded by the
/// 32-element block types only), or `None` if the type has no kernel. The caller checks that
/// `isa` is available.
pub(crate) fn kernel(ty: GgmlType, isa: Isa, order: SumOrder) -> Option<Kernel> {
    match isa {
        Isa::Scalar => scalar_kernel(ty, order),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => super::avx2::kernel(ty, order),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => super::avx512::kernel(ty, order),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => super::neon::kernel(ty, order),
        #[allow(unreachable_patterns)]
        _ => scalar_kernel(ty, order),
    }
}

/// Tokens llama.cpp's repacked matmuls take in groups ([`tail_kernel`]).
pub(crate) const GROUP_TOKENS: usize = 4;

/// For weight types whose llama.cpp matmul rounds the tokens left over from groups of
/// [`GROUP_TOKENS`] differently (repacked Q4_K: gemm for the groups, gemv for the rest), the
/// kernel for those last `n % 4` tokens; `None` when every token uses [`kernel`].
pub(crate) fn tail_kernel(ty: GgmlType, isa: Isa) -> Option<Kernel> {
    match (ty, isa) {
        (GgmlType::Q4K, Isa::Scalar) => Some(Kernel {
            mr: 1,
            nt: 1,
            mr1: 1,
            exact_rows: false,
            tile: s_q4_k_gemv,
        }),
        #[cfg(target_arch = "x86_64")]
        (_, Isa::Avx2) => super::avx2::tail_kernel(ty),
        #[cfg(target_arch = "x86_64")]
        (_, Isa::Avx512) => super::avx512::tail_kernel(ty),
        #[cfg(target_arch = "aarch64")]
        (_, Isa::Neon) => super::neon::tail_kernel(ty),
        _ => None,
    }
}

/// Quantize one row `x` into `y` (exactly one activation row of `act_ty`). `isa` is available.
pub(crate) fn quantize_row(act_ty: GgmlType, isa: Isa, x: &[f32], y: &mut [u8]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => super::avx2::quantize_row(act_ty, x, y),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => super::neon::quantize_row(act_ty, x, y),
        _ => quantize_row_scalar(act_ty, x, y),
    }
}

/// A level's quantizers of one block: `q8(x, y, with_sum)` makes a `Q8_0` block (a `Q8_1` one
/// with `with_sum`) from 32 floats, `q8k(x, y)` a `Q8_K` block from 256.
pub(crate) struct BlockQuantizers {
    pub q8: unsafe fn(*const f32, *mut u8, bool),
    pub q8k: unsafe fn(*const f32, *mut u8),
}

/// Quantize one row (`y` exactly one activation row of `act_ty` for `x`) block by block with a
/// level's block quantizers; f32 rows are copied.
///
/// # Safety
/// The quantizers' instruction set is available.
pub(crate) unsafe fn quantize_row_blocks(
    act_ty: GgmlType,
    x: &[f32],
    y: &mut [u8],
    q: BlockQuantizers,
) {
    // SAFETY: each quantizer reads one block of `x` and writes one block of `y`; the chunk
    // iterators hand it exactly that; the level is available (caller's contract).
    unsafe {
        match act_ty {
            GgmlType::Q8_0 => {
                for (xb, yb) in x.chunks_exact(32).zip(y.chunks_exact_mut(34)) {
                    (q.q8)(xb.as_ptr(), yb.as_mut_ptr(), false);
                }
            }
            GgmlType::Q8_1 => {
                for (xb, yb) in x.chunks_exact(32).zip(y.chunks_exact_mut(36)) {
                    (q.q8)(xb.as_ptr(), yb.as_mut_ptr(), true);
                }
            }
            GgmlType::Q8K => {
                for (xb, yb) in x.chunks_exact(256).zip(y.chunks_exact_mut(292)) {
                    (q.q8k)(xb.as_ptr(), yb.as_mut_ptr());
                }
            }
            _ => scalar::quantize_row_f32(x, y),
        }
    }
}

/// The scalar quantizer of `act_ty`.
pub(crate) fn quantize_row_scalar(act_ty: GgmlType, x: &[f32], y: &mut [u8]) {
    match act_ty {
        GgmlType::Q8_0 => scalar::quantize_row_q8_0(x, y),
        GgmlType::Q8_1 => scalar::quantize_row_q8_1(x, y),
        GgmlType::Q8K => scalar::quantize_row_q8_k(x, y),
        _ => scalar::quantize_row_f32(x, y),
    }
}
