//! Matrix products `out[t][r] = dot(W row r, x_t)`, tiled and spread over a [`Pool`].
//!
//! Work is cut into chunks of (rows × tokens). A chunk's weight rows are read once per group of
//! `nt` tokens and stay in L2 between groups; each tile reuses every unpacked weight block for
//! `nt` tokens and every activation block for `mr` rows. Threads take chunks from a shared
//! counter, so a slow or descheduled thread does not hold the others up.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use gguf::GgmlType;

use super::kernels::{self, Kernel, Tile};
use super::{act_type, best_isa, quantize_acts, row_bytes, ActBuf, DotError, Isa, Pool};

/// Products smaller than this many multiply-adds run on the calling thread alone: handing them
/// out costs more than it saves.
const SERIAL_MACS: usize = 1 << 15;
/// Tokens per chunk, at most (rounded to a multiple of the kernel's `nt`).
const TOKENS_PER_CHUNK: usize = 64;
/// Weight bytes per chunk, at most: keeps a chunk's rows in L2 while its token groups run.
const CHUNK_WEIGHT_BYTES: usize = 256 * 1024;

/// `out[t * rows + r] = dot(row r of w, token t of acts)` for every weight row `r` and token `t`,
/// with the best instruction set. `w` holds `rows` rows of `cols` elements of `weight_ty` in GGUF
/// layout; `acts` must come from [`quantize_acts`] for the same weight type and `cols`; `out`
/// has `acts.n_tokens() * rows` elements.
pub fn matmul(
    weight_ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    acts: &ActBuf,
    out: &mut [f32],
    pool: &Pool,
) -> Result<(), DotError> {
    matmul_with_isa(weight_ty, w, rows, cols, acts, out, pool, best_isa())
}

/// [`matmul`] on f32 activations `x` (`n_tokens` rows of `cols`): quantizes them into a
/// per-thread scratch buffer first.
#[allow(clippy::too_many_arguments)]
pub fn matmul_f32(
    weight_ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &Pool,
) -> Result<(), DotError> {
    thread_local! {
        static SCRATCH: RefCell<ActBuf> = RefCell::new(ActBuf::new());
    }
    SCRATCH.with(|s| {
        // A nested call (impossible unless a kernel calls back in) gets a fresh buffer rather
        // than a borrow panic.
        match s.try_borrow_mut() {
            Ok(mut buf) => {
                quantize_acts(weight_ty, x, n_tokens, cols, &mut buf)?;
                matmul(weight_ty, w, rows, cols, &buf, out, pool)
            }
            Err(_) => {
                let mut buf = ActBuf::new();
                quantize_acts(weight_ty, x, n_tokens, cols, &mut buf)?;
                matmul(weight_ty, w, rows, cols, &buf, out, pool)
            }
        }
    })
}

/// Raw pointers moved into the pool's closure. Threads write disjoint output elements and only
/// read the inputs.
#[derive(Clone, Copy)]
struct Ptrs {
    w: *const u8,
    a: *const u8,
    out: *mut f32,
}
// SAFETY: the pointers are only dereferenced inside `matmul_with_isa`'s `pool.run`, which
// returns before the borrows they came from end; writes go to disjoint elements.
unsafe impl Send for Ptrs {}
// SAFETY: as above.
unsafe impl Sync for Ptrs {}

/// [`matmul`] with an explicit instruction set (for tests and comparisons).
#[allow(clippy::too_many_arguments)]
pub fn matmul_with_isa(
    weight_ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    acts: &ActBuf,
    out: &mut [f32],
    pool: &Pool,
    isa: Isa,
) -> Result<(), DotError> {
    if !isa.available() {
        return Err(DotError::IsaUnavailable { isa });
    }
    let want = act_type(weight_ty)?;
    if acts.act_type() != want {
        return Err(DotError::ActType {
            weight_ty,
            expected: want,
            got: acts.act_type(),
        });
    }
    if acts.cols() != cols {
        return Err(DotError::Cols {
            weight_ty,
            expected: cols,
            got: acts.cols(),
        });
    }
    let wrb = row_bytes(weight_ty, cols)?;
    let wlen = wrb.checked_mul(rows).ok_or(DotError::Overflow {
        what: "weight matrix size",
    })?;
    if w.len() != wlen {
        return Err(DotError::Length {
            what: "weights (bytes)",
            expected: wlen,
            got: w.len(),
        });
    }
    let n_tokens = acts.n_tokens();
    let olen = n_tokens.checked_mul(rows).ok_or(DotError::Overflow {
        what: "output size",
    })?;
    if out.len() != olen {
        return Err(DotError::Length {
            what: "output (f32)",
            expected: olen,
            got: out.len(),
        });
    }
    if olen == 0 {
        return Ok(());
    }
    if cols == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let k = kernels::kernel(weight_ty, isa).ok_or(DotError::Unsupported { ty: weight_ty })?;
    let nb = cols / weight_ty.block_size();
    let plan = Plan::new(&k, rows, n_tokens, wrb, pool.n_threads(), cols);
    let p = Ptrs {
        w: w.as_ptr(),
        a: acts.bytes().as_ptr(),
        out: out.as_mut_ptr(),
    };
    let arb = acts.row_bytes();
    let run_chunk = |c: usize| {
        // Capture `p` whole (it is Sync), not its raw-pointer fields one by one.
        let p: Ptrs = p;
        let (r0, r1, t0, t1) = plan.chunk(c);
        let mut t = t0;
        while t < t1 {
            let tn = (t1 - t).min(k.nt);
            let mr = if tn == 1 { k.mr1 } else { k.mr };
            let mut r = r0;
            while r < r1 {
                let rn = (r1 - r).min(mr);
                let tile = Tile {
                    nb,
                    w: p.w.wrapping_add(r * wrb),
                    w_stride: wrb,
                    a: p.a.wrapping_add(t * arb),
                    a_stride: arb,
                    out: p.out.wrapping_add(t * rows + r),
                    out_stride: rows,
                    rows: rn,
                    toks: tn,
                };
                // SAFETY: rows r..r+rn < `rows` and tokens t..t+tn < `n_tokens`, whose sizes
                // were checked against `w`, `acts` and `out` above; rn <= mr (mr1 for one
                // token), 1 <= tn <= nt;
                // `isa` is available. Chunks are disjoint, so no two tiles write one element.
                unsafe { (k.tile)(&tile) };
                r += rn;
            }
            t += tn;
        }
    };
    if plan.serial || plan.n_chunks == 1 || pool.n_threads() == 1 {
        (0..plan.n_chunks).for_each(run_chunk);
    } else {
        let next = AtomicUsize::new(0);
        pool.run(|_| loop {
            let c = next.fetch_add(1, Ordering::Relaxed);
            if c >= plan.n_chunks {
                break;
            }
            run_chunk(c);
        });
    }
    Ok(())
}

/// How a product is cut into chunks: `row_chunks × tok_chunks`, row-chunk-major.
struct Plan {
    /// Too small to be worth handing out: run every chunk on the calling thread.
    serial: bool,
    rows: usize,
    n_tokens: usize,
    rc: usize,
    tc: usize,
    tok_chunks: usize,
    n_chunks: usize,
}

impl Plan {
    fn new(
        k: &Kernel,
        rows: usize,
        n_tokens: usize,
        wrb: usize,
        threads: usize,
        cols: usize,
    ) -> Plan {
        let macs = rows.saturating_mul(cols).saturating_mul(n_tokens);
        let tc = if n_tokens <= TOKENS_PER_CHUNK {
            n_tokens
        } else {
            (TOKENS_PER_CHUNK / k.nt).max(1) * k.nt
        };
        let tok_chunks = n_tokens.div_ceil(tc);
        let rc = if macs < SERIAL_MACS || threads == 1 {
            rows
        } else {
            // Aim for about four chunks per thread so uneven progress balances out.
            let want_row_chunks = (threads * 4).div_ceil(tok_chunks).max(1);
            rows.div_ceil(want_row_chunks)
        };
        let max_rc = (CHUNK_WEIGHT_BYTES / wrb.max(1)).max(1);
        let rc = rc.min(max_rc).max(1);
        // Whole tiles per chunk where possible.
        let rc = if rc >= k.mr {
            rc.div_ceil(k.mr) * k.mr
        } else {
            rc
        };
        let row_chunks = rows.div_ceil(rc);
        Plan {
            serial: macs < SERIAL_MACS,
            rows,
            n_tokens,
            rc,
            tc,
            tok_chunks,
            n_chunks: row_chunks * tok_chunks,
        }
    }

    /// Rows `r0..r1` and tokens `t0..t1` of chunk `c`.
    fn chunk(&self, c: usize) -> (usize, usize, usize, usize) {
        let (rb, tb) = (c / self.tok_chunks, c % self.tok_chunks);
        let r0 = rb * self.rc;
        let t0 = tb * self.tc;
        (
            r0,
            (r0 + self.rc).min(self.rows),
            t0,
            (t0 + self.tc).min(self.n_tokens),
        )
    }
}
