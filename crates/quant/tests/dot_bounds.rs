//! Guard pages: every kernel of every level this CPU has (the scalar reference included) runs
//! with its inputs and outputs placed right against an inaccessible page, so that a read or a
//! write of even one byte past the end (or before the start) of a weight row, an activation row,
//! an f32 input or an output faults at once, every run, instead of only when a heap buffer
//! happens to end at a page boundary (an intermittent "signal 11" under qemu in CI).
//!
//! Each buffer is an anonymous `mmap` of whole pages plus one page mapped `PROT_NONE`: either
//! the data ends on the last byte before the guard page ([`Edge::End`]) or it starts on the
//! first byte after it ([`Edge::Start`]). The results are also compared bit for bit with the
//! same call on ordinary heap copies, so the guarded copies are known to hold the same data.
//!
//! What cannot be guarded: buffers the crate allocates itself. [`ActBuf`] (the quantized
//! activations of `matmul`), the per-thread scratch of the `*_f32` entry points, the transposed
//! activations of the many-token kernels and the interleaved weights inside [`PackedMat`] are
//! internal; around them the test guards what the caller passes in (the weight matrix, the f32
//! input of the quantizers, the GGUF bytes that are packed) and the output rows. `vec_dot`
//! takes raw activation bytes, so there a copy of an [`ActBuf`] row sits at the guard edge.
//!
//! Inputs are fresh random data each run; the seed is written to stderr at the start of each
//! test (outside the test harness's capture, so it survives a crash) and `CROSSOVER_TEST_SEED`
//! replays it. On a fault, a signal handler writes the calls the test threads were making
//! before the process dies.
#![cfg(unix)]

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

mod common;

use common::inputs::{run_seed, WEIGHT_TYPES};
use gguf::GgmlType;
use half::f16;
use quant::dot::{self, f32ops, ggml, ActBuf, Isa, PackedMat, Pool, SumOrder};

// ---- guarded buffers ------------------------------------------------------------------------

/// Which side of the data the inaccessible page is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Edge {
    /// The data's last byte is the last byte of a readable page; the next page is `PROT_NONE`.
    End,
    /// The data's first byte is the first byte of a page; the page before is `PROT_NONE`.
    Start,
}

const EDGES: [Edge; 2] = [Edge::End, Edge::Start];

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    assert!(p > 0, "sysconf(_SC_PAGESIZE) failed");
    p as usize
}

/// A copy of a slice in its own anonymous mapping, against a guard page on one side.
struct Guarded<T> {
    map: *mut libc::c_void,
    map_len: usize,
    data: *mut T,
    len: usize,
}

impl<T: Copy> Guarded<T> {
    fn new(values: &[T], edge: Edge) -> Guarded<T> {
        assert!(
            !values.is_empty(),
            "a guarded buffer holds at least one element"
        );
        let page = page_size();
        let bytes = std::mem::size_of_val(values);
        let data_pages = bytes.div_ceil(page);
        let map_len = (data_pages + 1) * page;
        // SAFETY: a fresh private anonymous mapping that nothing else refers to; every offset
        // below stays inside it, and the copy fills exactly the data's bytes.
        unsafe {
            let map = libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANON,
                -1,
                0,
            );
            assert!(
                map != libc::MAP_FAILED,
                "mmap of {map_len} bytes: {}",
                std::io::Error::last_os_error()
            );
            let base = map as *mut u8;
            let (guard, data) = match edge {
                Edge::End => (
                    base.add(data_pages * page),
                    base.add(data_pages * page - bytes),
                ),
                Edge::Start => (base, base.add(page)),
            };
            assert_eq!(
                libc::mprotect(guard as *mut libc::c_void, page, libc::PROT_NONE),
                0,
                "mprotect: {}",
                std::io::Error::last_os_error()
            );
            assert!(
                (data as usize).is_multiple_of(std::mem::align_of::<T>()),
                "guarded data misaligned for its type"
            );
            std::ptr::copy_nonoverlapping(values.as_ptr(), data as *mut T, values.len());
            Guarded {
                map,
                map_len,
                data: data as *mut T,
                len: values.len(),
            }
        }
    }

    fn get(&self) -> &[T] {
        // SAFETY: `data` holds `len` initialized elements for as long as the mapping lives.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }

    fn get_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `get`; the borrow of `self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }
}

impl<T> Drop for Guarded<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `Guarded::new` and no slice of it outlives `self`.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

// ---- naming the call that faulted -----------------------------------------------------------

/// Test threads whose current call is recorded at once (more share slots, harmlessly).
const SLOTS: usize = 8;
/// Bytes of one record (longer descriptions are cut).
const SLOT_BYTES: usize = 240;

/// The call each test thread is about to make, as bytes ending at the first 0. Atomics, so the
/// fault handler may read every thread's record from whichever thread faulted (a pool worker
/// has no record of its own) without a lock.
static CASES: [[AtomicU8; SLOT_BYTES]; SLOTS] =
    [const { [const { AtomicU8::new(0) }; SLOT_BYTES] }; SLOTS];
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

/// This thread's record in [`CASES`], claimed on first use and cleared when the thread ends.
struct Slot(Cell<usize>);

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(s) = CASES.get(self.0.get()) {
            s[0].store(0, Ordering::Relaxed);
        }
    }
}

thread_local! {
    static SLOT: Slot = const { Slot(Cell::new(usize::MAX)) };
}

/// Record the call about to run (and make sure the fault handler is installed).
fn case(what: std::fmt::Arguments<'_>) {
    install_fault_handler();
    let text = what.to_string();
    let bytes = &text.as_bytes()[..text.len().min(SLOT_BYTES - 1)];
    SLOT.with(|s| {
        if s.0.get() == usize::MAX {
            s.0.set(NEXT_SLOT.fetch_add(1, Ordering::Relaxed) % SLOTS);
        }
        let slot = &CASES[s.0.get()];
        // Empty the record first and fill in its first byte last, so the handler never reads
        // part of a new record joined to the tail of an old one.
        slot[0].store(0, Ordering::Relaxed);
        for (i, &b) in bytes.iter().enumerate().skip(1) {
            slot[i].store(b, Ordering::Relaxed);
        }
        slot[bytes.len()].store(0, Ordering::Relaxed);
        if let Some(&b) = bytes.first() {
            slot[0].store(b, Ordering::Relaxed);
        }
    });
}

/// write(2) to stderr; async-signal-safe.
fn raw_stderr(b: &[u8]) {
    // SAFETY: the buffer is valid for its length.
    unsafe { libc::write(2, b.as_ptr() as *const libc::c_void, b.len()) };
}

/// On SIGSEGV/SIGBUS: write the calls the test threads were making (marking the faulting
/// thread's own), then let the default action kill the process as it would have anyway
/// (`SA_RESETHAND` restored it, and returning re-runs the faulting access). Only
/// async-signal-safe work: atomic loads, a stack buffer and write(2).
extern "C" fn on_fault(_sig: libc::c_int) {
    let mine = SLOT.try_with(|s| s.0.get()).unwrap_or(usize::MAX);
    raw_stderr(b"\ndot_bounds: memory fault; the calls in flight on the test threads:\n");
    for (i, slot) in CASES.iter().enumerate() {
        let mut buf = [0u8; SLOT_BYTES];
        let mut n = 0;
        for (d, s) in buf.iter_mut().zip(slot) {
            *d = s.load(Ordering::Relaxed);
            if *d == 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            raw_stderr(if i == mine {
                b"  (the faulting thread) "
            } else {
                b"  "
            });
            raw_stderr(&buf[..n]);
            raw_stderr(b"\n");
        }
    }
    if mine == usize::MAX {
        raw_stderr(b"  (the faulting thread has no record: a pool worker of one of these)\n");
    }
}

fn install_fault_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for sig in [libc::SIGSEGV, libc::SIGBUS] {
            // SAFETY: a zeroed sigaction is valid; the handler only makes async-signal-safe
            // calls (see `on_fault`).
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_fault as extern "C" fn(libc::c_int) as libc::sighandler_t;
                sa.sa_flags = libc::SA_RESETHAND;
                libc::sigemptyset(&mut sa.sa_mask);
                assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
            }
        }
    });
}

// ---- inputs ---------------------------------------------------------------------------------

/// xorshift64* on a splitmix-scrambled seed: plenty for test data.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    fn signed(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// `n` values in [-scale, scale), with an occasional outlier ten times larger.
    fn floats(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let v = self.signed() * scale;
                if self.next().is_multiple_of(64) {
                    v * 10.0
                } else {
                    v
                }
            })
            .collect()
    }
    fn halves(&mut self, n: usize, scale: f32) -> Vec<f16> {
        self.floats(n, scale)
            .into_iter()
            .map(f16::from_f32)
            .collect()
    }
}

/// Scalar first, then every SIMD level this CPU has.
fn levels() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.available()).collect()
}

/// The summation orders that differ for `ty` (only the 32-element block types have two).
fn orders(ty: GgmlType) -> &'static [SumOrder] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
            &SumOrder::ALL
        }
        _ => &[SumOrder::Ggml],
    }
}

/// Row lengths to try for `ty`: one block, an odd number of blocks, and a longer row (the
/// float types: odd lengths that leave every kind of vector tail).
fn row_lengths(ty: GgmlType) -> &'static [usize] {
    match ty.block_size() {
        1 => &[1, 3, 7, 17, 33, 100],
        32 => &[32, 96, 576],
        _ => &[256, 512],
    }
}

/// `rows` rows of `cols` weights of `ty`, quantized from random floats.
fn weights(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let x = rng.floats(rows * cols, 0.1);
    quant::quantize_to_vec(ty, &x).unwrap()
}

fn acts(ty: GgmlType, x: &[f32], n_tokens: usize, cols: usize, isa: Isa) -> ActBuf {
    let mut b = ActBuf::new();
    dot::quantize_acts_with_isa(ty, x, n_tokens, cols, &mut b, isa).unwrap();
    b
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

// ---- the tests ------------------------------------------------------------------------------

/// The guard pages are real (on this OS and under this runner, qemu included): a forked child
/// that reads one byte across the edge dies of the fault, one that reads the edge byte itself
/// does not. Without this the other tests could pass without guarding anything.
#[test]
fn bounds_guard_pages_fault_when_touched() {
    extern "C" fn child_fault(_sig: libc::c_int) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(42) }
    }
    for edge in EDGES {
        let g = Guarded::new(&[1u8, 2, 3], edge);
        let inside = match edge {
            Edge::End => g.get().as_ptr().wrapping_add(2),
            Edge::Start => g.get().as_ptr(),
        };
        let outside = match edge {
            Edge::End => inside.wrapping_add(1),
            Edge::Start => inside.wrapping_sub(1),
        };
        for (p, should_fault) in [(inside, false), (outside, true)] {
            // SAFETY: the child only calls async-signal-safe functions (signal, a load,
            // _exit) before it exits; the parent only waits for it.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
            if pid == 0 {
                // SAFETY: see above; the load may fault, which is the point.
                unsafe {
                    let h = child_fault as extern "C" fn(libc::c_int) as libc::sighandler_t;
                    libc::signal(libc::SIGSEGV, h);
                    libc::signal(libc::SIGBUS, h);
                    std::ptr::read_volatile(p);
                    libc::_exit(0);
                }
            }
            let mut status = 0;
            // SAFETY: waiting for our own child.
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            assert_eq!(r, pid, "waitpid: {}", std::io::Error::last_os_error());
            assert!(libc::WIFEXITED(status), "{edge:?}: child status {status}");
            let code = libc::WEXITSTATUS(status);
            let want = if should_fault { 42 } else { 0 };
            assert_eq!(
                code,
                want,
                "{edge:?}: a read {} the data {}",
                if should_fault {
                    "across the edge of"
                } else {
                    "at the edge of"
                },
                if should_fault {
                    "did not fault"
                } else {
                    "faulted"
                }
            );
        }
    }
}

/// The activation quantizers of every level read exactly their f32 rows: single tokens,
/// several, and the float types' odd lengths, with the input at each guard edge. The guarded
/// run gives the scalar reference's bytes (quantization is bit-identical across levels).
#[test]
fn bounds_act_quantizers_read_only_their_input() {
    let mut rng = Rng::new(run_seed("bounds_act_quantizers_read_only_their_input"));
    // One weight type per activation type (Q8_0, Q8_1, Q8_K, F32), F16 for odd lengths too.
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q4K,
        GgmlType::F32,
        GgmlType::F16,
    ] {
        for &cols in row_lengths(ty) {
            for n_tokens in [1usize, 2, 3] {
                let x = rng.floats(n_tokens * cols, 4.0);
                let want = acts(ty, &x, n_tokens, cols, Isa::Scalar);
                for edge in EDGES {
                    let gx = Guarded::new(&x, edge);
                    for isa in levels() {
                        case(format_args!(
                            "quantize_acts_with_isa {ty} {n_tokens}x{cols} {} (f32 input at \
                             the {edge:?} edge)",
                            isa.name()
                        ));
                        let got = acts(ty, gx.get(), n_tokens, cols, isa);
                        assert!(
                            got.bytes() == want.bytes(),
                            "{ty} {n_tokens}x{cols} {} {edge:?}: quantized bytes differ from \
                             the scalar reference",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

/// `vec_dot` of every weight type on every level, in both summation orders where a type has
/// two, with the weight row and the activation row each at either guard edge.
#[test]
fn bounds_vec_dot_reads_only_its_rows() {
    let mut rng = Rng::new(run_seed("bounds_vec_dot_reads_only_its_rows"));
    for ty in WEIGHT_TYPES {
        for &cols in row_lengths(ty) {
            let w = weights(&mut rng, ty, 1, cols);
            let x = rng.floats(cols, 2.0);
            // Activation bytes are the same on every level; a copy of the row goes to the edge.
            let a = acts(ty, &x, 1, cols, Isa::Scalar);
            let a = a.row(0).unwrap();
            let gw = EDGES.map(|e| Guarded::new(&w, e));
            let ga = EDGES.map(|e| Guarded::new(a, e));
            for isa in levels() {
                for &order in orders(ty) {
                    let want = dot::vec_dot_ordered(ty, &w, a, cols, isa, order).unwrap();
                    for (gw, we) in gw.iter().zip(EDGES) {
                        for (ga, ae) in ga.iter().zip(EDGES) {
                            case(format_args!(
                                "vec_dot_ordered {ty} cols {cols} {} {order} (weight row at the \
                                 {we:?} edge, activation row at the {ae:?} edge)",
                                isa.name()
                            ));
                            let got =
                                dot::vec_dot_ordered(ty, gw.get(), ga.get(), cols, isa, order)
                                    .unwrap();
                            assert_eq!(
                                got.to_bits(),
                                want.to_bits(),
                                "{ty} cols {cols} {} {order} weights {we:?} acts {ae:?}",
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// `matmul_ordered` of every weight type on every level (single rows, single tokens, ragged
/// row and token counts, a product large enough to be split over the pool's threads), with the
/// weight matrix and the output at each guard edge; and `matmul_f32_ordered` (the best level:
/// the pooled activation quantizer for many tokens) with its f32 input guarded as well.
#[test]
fn bounds_matmul_reads_only_its_weights() {
    let mut rng = Rng::new(run_seed("bounds_matmul_reads_only_its_weights"));
    // One thread, and more threads than this machine may have cores: the chunks (and so the
    // tiles at their edges) differ.
    let pools = [Pool::new(1).unwrap(), Pool::new(3).unwrap()];
    for ty in WEIGHT_TYPES {
        let lengths = row_lengths(ty);
        let (short, long) = (lengths[1], lengths[lengths.len() - 1]);
        // (rows, cols, tokens): every count of tokens left over from groups of 4, single rows
        // and tokens, 8 or more tokens (the many-token kernels); the last one is over the
        // serial threshold, so it is cut into chunks, and its 17 tokens take the pooled
        // quantizer in `matmul_f32`.
        let shapes = [
            (1usize, short, 1usize),
            (3, short, 1),
            (2, short, 3),
            (5, short, 2),
            (4, short, 4),
            (7, short, 5),
            (6, short, 8),
            (13, short, 9),
            (1, long, 6),
            (33, long, 17),
        ];
        for (rows, cols, n_tokens) in shapes {
            let w = weights(&mut rng, ty, rows, cols);
            let x = rng.floats(n_tokens * cols, 2.0);
            let gw = EDGES.map(|e| Guarded::new(&w, e));
            let gx = EDGES.map(|e| Guarded::new(&x, e));
            let nan = vec![f32::NAN; rows * n_tokens];
            let mut gout = EDGES.map(|e| Guarded::new(&nan, e));
            for isa in levels() {
                let a = acts(ty, &x, n_tokens, cols, isa);
                for (&order, pool) in orders(ty)
                    .iter()
                    .flat_map(|o| pools.iter().map(move |p| (o, p)))
                {
                    let threads = pool.n_threads();
                    let mut want = nan.clone();
                    dot::matmul_ordered(ty, &w, rows, cols, &a, &mut want, pool, isa, order)
                        .unwrap();
                    for (i, edge) in EDGES.into_iter().enumerate() {
                        let out = gout[i].get_mut();
                        out.fill(f32::NAN);
                        case(format_args!(
                            "matmul_ordered {ty} {rows}x{cols} x {n_tokens} tokens {} {order} \
                             {threads} threads (weights and output at the {edge:?} edge)",
                            isa.name()
                        ));
                        dot::matmul_ordered(ty, gw[i].get(), rows, cols, &a, out, pool, isa, order)
                            .unwrap();
                        assert!(
                            same_bits(out, &want),
                            "{ty} {rows}x{cols}x{n_tokens} {} {order} {threads} threads \
                             {edge:?}: output differs",
                            isa.name()
                        );
                    }
                }
            }
            // The f32 entry point quantizes on the best level.
            let pool = &pools[1];
            let best = dot::best_isa();
            let a = acts(ty, &x, n_tokens, cols, best);
            for &order in orders(ty) {
                let mut want = nan.clone();
                dot::matmul_ordered(ty, &w, rows, cols, &a, &mut want, pool, best, order).unwrap();
                for (i, edge) in EDGES.into_iter().enumerate() {
                    let out = gout[i].get_mut();
                    out.fill(f32::NAN);
                    case(format_args!(
                        "matmul_f32_ordered {ty} {rows}x{cols} x {n_tokens} tokens {} {order} \
                         (weights, f32 input and output at the {edge:?} edge)",
                        best.name()
                    ));
                    dot::matmul_f32_ordered(
                        ty,
                        gw[i].get(),
                        rows,
                        cols,
                        gx[i].get(),
                        n_tokens,
                        out,
                        pool,
                        order,
                    )
                    .unwrap();
                    assert!(
                        same_bits(out, &want),
                        "matmul_f32 {ty} {rows}x{cols}x{n_tokens} {order} {edge:?}: output \
                         differs"
                    );
                }
            }
        }
    }
}

/// Packing (the levels with a packed layout) reads only the GGUF bytes it is given, and the
/// packed products write only their output rows; the f32 entry point reads only its input.
/// The packed weights themselves live inside `PackedMat` and cannot be guarded.
#[test]
fn bounds_packed_reads_only_its_input() {
    let mut rng = Rng::new(run_seed("bounds_packed_reads_only_its_input"));
    let pool = Pool::new(2).unwrap();
    let mut ran = false;
    for isa in levels() {
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            for (rows, cols) in [(16usize, 256usize), (32, 512)] {
                if !PackedMat::packable(ty, rows, cols, isa) {
                    continue;
                }
                ran = true;
                let w = weights(&mut rng, ty, rows, cols);
                let plain = PackedMat::pack_with_isa(ty, &w, rows, cols, isa)
                    .unwrap()
                    .unwrap();
                for edge in EDGES {
                    let gw = Guarded::new(&w, edge);
                    case(format_args!(
                        "PackedMat::pack_with_isa {ty} {rows}x{cols} {} (GGUF bytes at the \
                         {edge:?} edge)",
                        isa.name()
                    ));
                    let p = PackedMat::pack_with_isa(ty, gw.get(), rows, cols, isa)
                        .unwrap()
                        .unwrap();
                    assert!(
                        p.bytes() == plain.bytes(),
                        "{ty} {edge:?}: packed bytes differ"
                    );
                    case(format_args!(
                        "PackedMat::copy {ty} {rows}x{cols} (GGUF bytes at the {edge:?} edge)"
                    ));
                    let c = PackedMat::copy(ty, gw.get(), rows, cols).unwrap();
                    assert!(
                        c.bytes() == w.as_slice(),
                        "{ty} {edge:?}: copied bytes differ"
                    );
                }
                for n_tokens in [1usize, 5, 9] {
                    let x = rng.floats(n_tokens * cols, 2.0);
                    let a = acts(ty, &x, n_tokens, cols, dot::best_isa());
                    let nan = vec![f32::NAN; rows * n_tokens];
                    for &order in orders(ty) {
                        let mut want = nan.clone();
                        dot::matmul_packed_ordered(&plain, &a, &mut want, &pool, false, order)
                            .unwrap();
                        for edge in EDGES {
                            let gx = Guarded::new(&x, edge);
                            let mut out = Guarded::new(&nan, edge);
                            case(format_args!(
                                "matmul_packed_ordered {ty} {rows}x{cols} x {n_tokens} tokens \
                                 {} {order} (output at the {edge:?} edge)",
                                isa.name()
                            ));
                            dot::matmul_packed_ordered(
                                &plain,
                                &a,
                                out.get_mut(),
                                &pool,
                                false,
                                order,
                            )
                            .unwrap();
                            assert!(same_bits(out.get(), &want), "{ty} {order} {edge:?}");
                            out.get_mut().fill(f32::NAN);
                            case(format_args!(
                                "matmul_f32_packed_ordered {ty} {rows}x{cols} x {n_tokens} \
                                 tokens {} {order} (f32 input and output at the {edge:?} edge)",
                                isa.name()
                            ));
                            dot::matmul_f32_packed_ordered(
                                &plain,
                                gx.get(),
                                n_tokens,
                                out.get_mut(),
                                &pool,
                                order,
                            )
                            .unwrap();
                            assert!(same_bits(out.get(), &want), "{ty} {order} {edge:?} (f32)");
                        }
                    }
                }
            }
        }
    }
    if !ran {
        println!("skipping: no packed layout on this CPU");
    }
}

/// The f32/f16 helpers of attention and SwiGLU (`f32ops`, `ggml`) on every level, at lengths
/// around every vector width (1 to 129), with each input and in-place buffer at either guard
/// edge; the results equal those of the same level on heap copies, bit for bit.
#[test]
fn bounds_f32_helpers_stay_in_their_slices() {
    let mut rng = Rng::new(run_seed("bounds_f32_helpers_stay_in_their_slices"));
    let lengths = [
        1usize, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129,
    ];
    for n in lengths {
        let a = rng.floats(n, 2.0);
        let b = rng.floats(n, 2.0);
        let h = rng.halves(n, 2.0);
        let h2 = rng.halves(n, 2.0);
        let e = rng.floats(n, 30.0);
        let alpha = rng.signed();
        for isa in levels() {
            let name = isa.name();
            let want_dot = f32ops::dot_f32_isa(isa, &a, &b).unwrap();
            let want_doth = f32ops::dot_f32_f16_isa(isa, &a, &h).unwrap();
            let mut want_axpy = b.clone();
            f32ops::axpy_f16_isa(isa, &mut want_axpy, alpha, &h).unwrap();
            let mut want_exp = e.clone();
            f32ops::exp_inplace_isa(isa, &mut want_exp).unwrap();
            let mut want_swiglu = a.clone();
            ggml::swiglu_isa(isa, &mut want_swiglu, &b);
            let mut want_softmax = e.clone();
            ggml::softmax_isa(isa, &mut want_softmax);
            let want_f16 = ggml::dot_f16_isa(isa, &h, &h2);
            let want_f16v = ggml::dot_f16_vec_isa(isa, &h, &h2);
            let mut want_fma = b.clone();
            ggml::fma_f16_row_isa(isa, &mut want_fma, alpha, &h);
            for edge in EDGES {
                let (ga, gb) = (Guarded::new(&a, edge), Guarded::new(&b, edge));
                let (gh, gh2) = (Guarded::new(&h, edge), Guarded::new(&h2, edge));
                let at = |what: &str| {
                    case(format_args!(
                        "{what} n {n} {name} (inputs and outputs at the {edge:?} edge)"
                    ))
                };

                at("f32ops::dot_f32_isa");
                let d = f32ops::dot_f32_isa(isa, ga.get(), gb.get()).unwrap();
                assert_eq!(d.to_bits(), want_dot.to_bits(), "dot_f32 n {n} {name}");

                at("f32ops::dot_f32_f16_isa");
                let d = f32ops::dot_f32_f16_isa(isa, ga.get(), gh.get()).unwrap();
                assert_eq!(d.to_bits(), want_doth.to_bits(), "dot_f32_f16 n {n} {name}");

                at("f32ops::axpy_f16_isa");
                let mut y = Guarded::new(&b, edge);
                f32ops::axpy_f16_isa(isa, y.get_mut(), alpha, gh.get()).unwrap();
                assert!(same_bits(y.get(), &want_axpy), "axpy_f16 n {n} {name}");

                at("f32ops::exp_inplace_isa");
                let mut y = Guarded::new(&e, edge);
                f32ops::exp_inplace_isa(isa, y.get_mut()).unwrap();
                assert!(same_bits(y.get(), &want_exp), "exp n {n} {name}");

                at("ggml::swiglu_isa");
                let mut g = Guarded::new(&a, edge);
                ggml::swiglu_isa(isa, g.get_mut(), gb.get());
                assert!(same_bits(g.get(), &want_swiglu), "swiglu n {n} {name}");

                at("ggml::softmax_isa");
                let mut s = Guarded::new(&e, edge);
                ggml::softmax_isa(isa, s.get_mut());
                assert!(same_bits(s.get(), &want_softmax), "softmax n {n} {name}");

                at("ggml::dot_f16_isa");
                let d = ggml::dot_f16_isa(isa, gh.get(), gh2.get());
                assert_eq!(d.to_bits(), want_f16.to_bits(), "dot_f16 n {n} {name}");

                at("ggml::dot_f16_vec_isa");
                let d = ggml::dot_f16_vec_isa(isa, gh.get(), gh2.get());
                assert_eq!(d.to_bits(), want_f16v.to_bits(), "dot_f16_vec n {n} {name}");

                at("ggml::fma_f16_row_isa");
                let mut acc = Guarded::new(&b, edge);
                ggml::fma_f16_row_isa(isa, acc.get_mut(), alpha, gh.get());
                assert!(same_bits(acc.get(), &want_fma), "fma_f16_row n {n} {name}");
            }
        }
    }
}
