//! CPU dot-product kernels for LLM inference: activation quantization, `vec_dot` of every weight
//! type against its activation type, multi-threaded `matmul`, and the small f32/f16 helpers that
//! attention needs.
//!
//! The scheme follows ggml: a weight type `W` is multiplied against activations quantized to its
//! "vec dot type" (`Q4_0`/`Q5_0`/`Q8_0` → `Q8_0`; `Q4_1`/`Q5_1` → `Q8_1`; K-quants → `Q8_K`), so the
//! inner loops are integer multiply-adds with one float scale per block. Float weights (`F32`,
//! `F16`, `BF16`) are multiplied against f32 activations, which is more accurate than ggml's
//! conversion of the activations to f16 and costs nothing extra.
//!
//! Every kernel has a scalar reference (module [`scalar`]) and SIMD versions for AVX2+FMA+F16C and
//! AVX-512 (F/BW/VL/VNNI), chosen at run time ([`best_isa`]); NEON on aarch64. Activation
//! quantization is bit-identical across instruction sets. The scalar dot products follow the
//! order of float operations of llama.cpp's x86 kernels (see [`scalar`]), and the AVX-512 tiles of
//! the quantized types reproduce them bit for bit, so products round as llama.cpp's do; the AVX2
//! tiles differ only in the order of float additions. The 32-element block types also have a
//! second order, whole-block integer sums ([`SumOrder::Block`]: one f32 step per block instead
//! of eight), which every kernel of every level (scalar, AVX2, AVX-512, packed, AMX) computes
//! bit for bit alike; the plain entry points use llama.cpp's ([`SumOrder::Ggml`]), the
//! `*_ordered` ones take the order.

use gguf::GgmlType;

pub mod f32ops;
pub mod ggml;
mod kernels;
mod matmul;
mod packed;
mod pool;
pub mod scalar;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_packed;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

pub use f32ops::{axpy_f16, dot_f32, dot_f32_f16, exp_f32, exp_inplace, softmax_inplace};
pub use matmul::{
    matmul, matmul_f32, matmul_f32_multi, matmul_f32_ordered, matmul_f32_packed,
    matmul_f32_packed_multi_ordered, matmul_f32_packed_ordered, matmul_multi, matmul_ordered,
    matmul_packed, matmul_packed_ordered, matmul_packed_with_amx, matmul_with_isa, MatJob,
};
pub use packed::{PackedMat, Q4K_GROUP_BYTES, Q4K_GROUP_ROWS, Q6K_GROUP_BYTES};
pub use pool::Pool;

#[cfg(target_arch = "x86_64")]
pub use amx::{amx_available, amx_enabled, set_amx};

/// Whether this CPU has AMX-INT8 and the OS lets this process use it (never, off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn amx_available() -> bool {
    false
}
/// Whether the many-token packed products use AMX (never, off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn amx_enabled() -> bool {
    false
}
/// Turn the AMX path on or off (no effect off x86-64).
#[cfg(not(target_arch = "x86_64"))]
pub fn set_amx(_on: bool) {}

use std::sync::atomic::{AtomicU8, Ordering};

/// Why a dot-product request was refused. Each variant names the type and sizes involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DotError {
    /// No dot-product kernel exists for this weight type.
    #[error("{ty}: no dot-product kernel for this weight type (supported: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K)")]
    Unsupported { ty: GgmlType },
    /// The row length is not a whole number of blocks of the weight type.
    #[error("{ty}: {cols} columns is not a multiple of the block size {block_size}")]
    NotBlockMultiple {
        ty: GgmlType,
        cols: usize,
        block_size: usize,
    },
    /// A buffer has the wrong length.
    #[error("{what}: holds {got} elements/bytes, expected {expected}")]
    Length {
        /// Which buffer (e.g. `"weights (bytes)"`, `"activations x (f32)"`).
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// The activations were quantized for a different weight type.
    #[error("activations were quantized as {got}, but {weight_ty} weights need {expected}")]
    ActType {
        weight_ty: GgmlType,
        expected: GgmlType,
        got: GgmlType,
    },
    /// The activations' row length differs from the weight matrix's.
    #[error("activations have {got} columns, the {weight_ty} weight matrix has {expected}")]
    Cols {
        weight_ty: GgmlType,
        expected: usize,
        got: usize,
    },
    /// A size computation overflowed.
    #[error("size overflow computing {what}")]
    Overflow { what: &'static str },
    /// The requested instruction set is not available on this CPU.
    #[error("instruction set {isa:?} is not available on this CPU")]
    IsaUnavailable { isa: Isa },
    /// Packed matrices multiplied in one dispatch differ in what they must share.
    #[error("packed matrices of one dispatch must share {what}: {first} vs {other}")]
    Mixed {
        /// `"weight type"`, `"columns"` or `"layout"`.
        what: &'static str,
        first: String,
        other: String,
    },
    /// A worker thread could not be started.
    #[error("could not start worker thread {index}: {reason}")]
    Spawn { index: usize, reason: String },
}

/// An instruction-set level for the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust: the reference every other level is tested against.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// x86-64 with AVX-512 F/BW/VL and VNNI (plus everything `Avx2` needs).
    Avx512,
    /// aarch64 NEON (every aarch64 CPU; the 8-bit dot-product instructions are used where the
    /// CPU has them, detected at run time).
    Neon,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// Whether this CPU can run kernels of this level.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => has_avx2(),
            Isa::Avx512 => has_avx512(),
            Isa::Neon => has_neon(),
        }
    }

    /// Lower-case name (`scalar`, `avx2`, `avx512`, `neon`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// Parse a name as [`Isa::name`] prints it.
    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL
            .iter()
            .copied()
            .find(|i| i.name().eq_ignore_ascii_case(s.trim()))
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}
#[cfg(not(target_arch = "x86_64"))]
fn has_avx2() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}
#[cfg(not(target_arch = "x86_64"))]
fn has_avx512() -> bool {
    false
}

/// NEON is part of every aarch64 CPU.
fn has_neon() -> bool {
    cfg!(target_arch = "aarch64")
}

static BEST_ISA: AtomicU8 = AtomicU8::new(u8::MAX);

/// The best instruction set this CPU supports, detected once and cached.
///
/// The environment variable `CROSSOVER_ISA` (`scalar`, `avx2`, `avx512`, `neon`) lowers the
/// choice for debugging and comparison; a level the CPU lacks is ignored.
pub fn best_isa() -> Isa {
    let v = BEST_ISA.load(Ordering::Relaxed);
    if let Some(isa) = Isa::ALL.get(v as usize) {
        return *isa;
    }
    let detected = [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Scalar]
        .into_iter()
        .find(|i| i.available())
        .unwrap_or(Isa::Scalar);
    let chosen = std::env::var("CROSSOVER_ISA")
        .ok()
        .and_then(|s| Isa::from_name(&s))
        .filter(|i| i.available())
        .unwrap_or(detected);
    let idx = Isa::ALL.iter().position(|i| *i == chosen).unwrap_or(0);
    BEST_ISA.store(idx as u8, Ordering::Relaxed);
    chosen
}

/// How a product of a 32-element block type (`Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`) combines
/// its exact integer work in f32. Both orders compute the same integer sums and differ only in
/// where the f32 roundings fall; each kernel of every instruction set, every tile shape and
/// token count gives the same bits for a given order (so serial and batched decode agree).
/// K-quants and float weights have one order each and ignore this choice.
///
/// Per (weight row, activation row), with `d = d_w * d_y` the f32 product of the block's two
/// f16 scales and, for types with a min (`Q4_1`, `Q5_1`), `m_w` the weight block's min and `s_y`
/// the activation block's `s` (`Q8_1`):
///
/// - [`SumOrder::Ggml`]: llama.cpp's x86 `vec_dot` (and llamafile's Q8_0 kernel): eight f32
///   lanes, lane `j` taking `lane_j = fma(d, isum_j, lane_j)` block by block with `isum_j` the
///   integer dot of the block's elements `4j..4j+4`; `summs = fma(m_w, s_y, summs)`; the result
///   `hsum_float_8(lanes) + summs` (`((l4 + l0) + (l6 + l2)) + ((l5 + l1) + (l7 + l3))`). The
///   logits are then bit-identical to llama.cpp's CPU backend. Eight conversions and eight
///   fused multiply-adds per block, as much vector work as the integer products.
/// - [`SumOrder::Block`]: whole-block integer sums: `isum` the exact i32 dot of the block's 32
///   elements (|isum| < 2^24, so its f32 conversion is exact too), `acc = fma(d, isum, acc)`
///   block by block in order, `summs = fma(m_w, s_y, summs)`, the result `acc + summs`. One
///   conversion and one fused multiply-add per block; at least as close to the exact product as
///   `Ggml` (fewer roundings of the same exact terms), not bit-identical to llama.cpp.
///
/// Both start from `acc = summs = 0`; the references are [`scalar::dot_q4_1`] and
/// [`scalar::dot_q4_1_block`] (and their siblings).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SumOrder {
    /// llama.cpp's order (bit-identical products); the default of this crate's plain entry points.
    #[default]
    Ggml,
    /// Whole-block integer sums, one f32 step per block.
    Block,
}

impl SumOrder {
    /// Both orders.
    pub const ALL: [SumOrder; 2] = [SumOrder::Ggml, SumOrder::Block];

    /// Lower-case name (`ggml`, `block`).
    pub fn name(self) -> &'static str {
        match self {
            SumOrder::Ggml => "ggml",
            SumOrder::Block => "block",
        }
    }

    /// Parse a name as [`SumOrder::name`] prints it (case-insensitive, spaces trimmed).
    pub fn from_name(s: &str) -> Option<SumOrder> {
        SumOrder::ALL
            .into_iter()
            .find(|o| o.name().eq_ignore_ascii_case(s.trim()))
    }
}

impl std::fmt::Display for SumOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The activation type a weight type is multiplied against ("vec dot type"): `Q8_0`, `Q8_1`,
/// `Q8_K`, or `F32` for the float weight types.
pub fn act_type(weight_ty: GgmlType) -> Result<GgmlType, DotError> {
    use GgmlType::*;
    Ok(match weight_ty {
        F32 | F16 | BF16 => F32,
        Q4_0 | Q5_0 | Q8_0 => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q2K | Q3K | Q4K | Q5K | Q6K => Q8K,
        _ => return Err(DotError::Unsupported { ty: weight_ty }),
    })
}

/// Whether [`matmul`] and [`vec_dot`] handle this weight type.
pub fn supports(weight_ty: GgmlType) -> bool {
    act_type(weight_ty).is_ok()
}

/// Bytes of one row of `cols` elements of `ty`, after checking `cols` is a whole number of blocks.
pub fn row_bytes(ty: GgmlType, cols: usize) -> Result<usize, DotError> {
    let bs = ty.block_size();
    if !cols.is_multiple_of(bs) {
        return Err(DotError::NotBlockMultiple {
            ty,
            cols,
            block_size: bs,
        });
    }
    (cols / bs)
        .checked_mul(ty.type_size())
        .ok_or(DotError::Overflow { what: "row bytes" })
}

/// 64-byte aligned storage unit for [`ActBuf`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Activations of `n_tokens` rows of length `cols`, converted to the activation type of one
/// weight type ([`act_type`]): ggml blocks (`BlockQ8_0`, `BlockQ8_1`, `BlockQ8K`) or plain f32,
/// one token's row after another. The buffer is 64-byte aligned and rows are packed, so each row
/// is aligned for its block type (every row size is a multiple of that type's alignment).
///
/// Reuse one buffer across calls: [`quantize_acts`] only grows the allocation.
#[derive(Clone)]
pub struct ActBuf {
    act_ty: GgmlType,
    n_tokens: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<Line>,
}

impl Default for ActBuf {
    fn default() -> Self {
        ActBuf::new()
    }
}

impl std::fmt::Debug for ActBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActBuf")
            .field("act_ty", &self.act_ty)
            .field("n_tokens", &self.n_tokens)
            .field("cols", &self.cols)
            .finish()
    }
}

impl ActBuf {
    /// An empty buffer (no tokens).
    pub fn new() -> ActBuf {
        ActBuf {
            act_ty: GgmlType::F32,
            n_tokens: 0,
            cols: 0,
            row_bytes: 0,
            data: Vec::new(),
        }
    }

    /// The activation type the rows are stored in.
    pub fn act_type(&self) -> GgmlType {
        self.act_ty
    }

    /// Number of token rows.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// All rows as bytes.
    pub fn bytes(&self) -> &[u8] {
        let n = self.n_tokens * self.row_bytes;
        // SAFETY: `data` holds at least `n` initialized bytes (`reshape` sized it so) and `Line`
        // is plain bytes with no padding.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, n) }
    }

    /// Row `t` as bytes, or `None` past the last token.
    pub fn row(&self, t: usize) -> Option<&[u8]> {
        if t >= self.n_tokens {
            return None;
        }
        self.bytes()
            .get(t * self.row_bytes..(t + 1) * self.row_bytes)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.n_tokens * self.row_bytes;
        // SAFETY: as in `bytes`; the borrow of `self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut u8, n) }
    }

    fn reshape(&mut self, act_ty: GgmlType, n_tokens: usize, cols: usize) -> Result<(), DotError> {
        let row_bytes = row_bytes(act_ty, cols)?;
        let total = row_bytes.checked_mul(n_tokens).ok_or(DotError::Overflow {
            what: "activation buffer size",
        })?;
        let lines = total.div_ceil(64);
        if self.data.len() < lines {
            self.data.resize(lines, Line([0; 64]));
        }
        self.act_ty = act_ty;
        self.n_tokens = n_tokens;
        self.cols = cols;
        self.row_bytes = row_bytes;
        Ok(())
    }
}

/// Quantize `n_tokens` rows of `cols` f32 activations (`x`, token-major) into `buf`, in the
/// activation type `weight_ty` needs, with the best instruction set.
pub fn quantize_acts(
    weight_ty: GgmlType,
    x: &[f32],
    n_tokens: usize,
    cols: usize,
    buf: &mut ActBuf,
) -> Result<(), DotError> {
    quantize_acts_with_isa(weight_ty, x, n_tokens, cols, buf, best_isa())
}

/// [`quantize_acts`] with an explicit instruction set (for tests and comparisons).
pub fn quantize_acts_with_isa(
    weight_ty: GgmlType,
    x: &[f32],
    n_tokens: usize,
    cols: usize,
    buf: &mut ActBuf,
    isa: Isa,
) -> Result<(), DotError> {
    if !isa.available() {
        return Err(DotError::IsaUnavailable { isa });
    }
    let act_ty = act_type(weight_ty)?;
    // The weight's block size, not just the activation's: Q8_0 rows for Q4_0 weights must still
    // be whole weight blocks, and K-quant rows whole super-blocks.
    row_bytes(weight_ty, cols)?;
    let expected = n_tokens.checked_mul(cols).ok_or(DotError::Overflow {
        what: "activation element count",
    })?;
    if x.len() != expected {
        return Err(DotError::Length {
            what: "activations x (f32)",
            expected,
            got: x.len(),
        });
    }
    buf.reshape(act_ty, n_tokens, cols)?;
    let rb = buf.row_bytes;
    if cols == 0 {
        return Ok(());
    }
    for (xr, yr) in x
        .chunks_exact(cols)
        .zip(buf.bytes_mut().chunks_exact_mut(rb))
    {
        kernels::quantize_row(act_ty, isa, xr, yr);
    }
    Ok(())
}

/// Dot product of one weight row (`cols` elements of `weight_ty`, as bytes) with one activation
/// row (`cols` elements of `act_type(weight_ty)`, as bytes, e.g. from [`ActBuf::row`]) using the
/// given instruction set. Meant for tests and one-off products; [`matmul`] is the fast path.
pub fn vec_dot(
    weight_ty: GgmlType,
    w_row: &[u8],
    acts_row: &[u8],
    cols: usize,
    isa: Isa,
) -> Result<f32, DotError> {
    vec_dot_ordered(weight_ty, w_row, acts_row, cols, isa, SumOrder::Ggml)
}

/// [`vec_dot`] in a chosen [`SumOrder`] (which only the 32-element block types heed).
pub fn vec_dot_ordered(
    weight_ty: GgmlType,
    w_row: &[u8],
    acts_row: &[u8],
    cols: usize,
    isa: Isa,
    order: SumOrder,
) -> Result<f32, DotError> {
    if !isa.available() {
        return Err(DotError::IsaUnavailable { isa });
    }
    let act_ty = act_type(weight_ty)?;
    let wb = row_bytes(weight_ty, cols)?;
    let ab = row_bytes(act_ty, cols)?;
    if w_row.len() != wb {
        return Err(DotError::Length {
            what: "weight row (bytes)",
            expected: wb,
            got: w_row.len(),
        });
    }
    if acts_row.len() != ab {
        return Err(DotError::Length {
            what: "activation row (bytes)",
            expected: ab,
            got: acts_row.len(),
        });
    }
    let k =
        kernels::kernel(weight_ty, isa, order).ok_or(DotError::Unsupported { ty: weight_ty })?;
    let mut out = 0f32;
    let tile = kernels::Tile {
        nb: cols / weight_ty.block_size(),
        w: w_row.as_ptr(),
        w_stride: wb,
        a: acts_row.as_ptr(),
        a_stride: ab,
        out: &mut out,
        out_stride: 1,
        rows: 1,
        toks: 1,
    };
    // SAFETY: the lengths of both rows were checked against `cols` above, `out` has room for
    // the single result, and the kernel was chosen for an available instruction set.
    unsafe { (k.tile)(&tile) };
    Ok(out)
}
