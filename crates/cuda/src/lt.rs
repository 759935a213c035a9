//! cuBLASLt for the batched decode products (v10).
//!
//! `cublasGemmEx` with `CUBLAS_GEMM_DEFAULT` takes the heuristic's first algorithm, which for the
//! thin products of a 9..64-sequence step (n = 16..64 against m, k in the thousands) reads the f16
//! weight copies at 1.4-3.1 TB/s. Here each (m, n, k, accumulate) shape of those steps asks the
//! heuristic for several candidates (split-K ones included, within a fixed workspace), times each
//! once against `cublasGemmEx` as a graph of repeated launches, and keeps the fastest for the rest
//! of the process: one fixed algorithm per shape, so a shape's results do not change from step to
//! step. The backend tunes its decode buckets' shapes at load; any other shape is tuned on first
//! use outside a graph capture (a capture of an untuned shape takes `cublasGemmEx`, so the
//! backend runs one eager pass before capturing a wide bucket).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::sys as lt;

use crate::device::{DevBuf, Gpu};
use crate::error::CudaError;

/// The workspace the candidates may use (split-K partial sums).
const WORKSPACE_BYTES: usize = 32 << 20;

/// One product shape: `C[n, m] (+)= A[n, k] * W[m, k]^T`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Accumulates into `C` (beta 1).
    pub acc: bool,
}

/// What tuning one shape found (for reports).
#[derive(Clone, Copy, Debug)]
pub struct GemmTuning {
    pub shape: GemmShape,
    /// Heuristic candidates that ran.
    pub candidates: usize,
    /// Microseconds per product: `cublasGemmEx`, and the fastest candidate (NaN if none ran).
    pub gemm_ex_us: f64,
    pub best_lt_us: f64,
    /// Whether the kept choice is a cuBLASLt algorithm (else `cublasGemmEx`).
    pub lt_kept: bool,
    /// The K split of the fastest cuBLASLt candidate (1: none).
    pub best_split_k: u32,
}

struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    la: lt::cublasLtMatrixLayout_t,
    lb: lt::cublasLtMatrixLayout_t,
    lc: lt::cublasLtMatrixLayout_t,
    /// The kept algorithm and its workspace; `None`: `cublasGemmEx` was fastest.
    algo: Option<(lt::cublasLtMatmulAlgo_t, usize)>,
    tuning: GemmTuning,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created once by this plan and is destroyed once, here.
        unsafe {
            let _ = lt::cublasLtMatrixLayoutDestroy(self.la);
            let _ = lt::cublasLtMatrixLayoutDestroy(self.lb);
            let _ = lt::cublasLtMatrixLayoutDestroy(self.lc);
            let _ = lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

/// The cuBLASLt handle, its workspace and the tuned shapes.
pub struct Lt {
    handle: lt::cublasLtHandle_t,
    ws: DevBuf,
    plans: RefCell<HashMap<GemmShape, Plan>>,
    /// Output of the timed candidates (so tuning never touches the caller's `C`).
    scratch: RefCell<Option<DevBuf>>,
}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.borrow_mut().clear();
        // SAFETY: created by cublasLtCreate, destroyed once, after every plan made with it.
        unsafe {
            let _ = lt::cublasLtDestroy(self.handle);
        }
    }
}

fn lt_err(what: impl Into<String>) -> impl FnOnce(lt::cublasStatus_t) -> CudaError {
    let what = what.into();
    move |e| CudaError::Cublas {
        what,
        err: format!("{e:?}"),
    }
}

fn check(s: lt::cublasStatus_t, what: &str) -> Result<(), CudaError> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(lt_err(what)(s))
    }
}

impl Lt {
    /// Open cuBLASLt with its workspace, or say why not.
    pub(crate) fn open(
        gpu_alloc: impl FnOnce(usize) -> Result<DevBuf, CudaError>,
    ) -> Result<Lt, String> {
        // SAFETY: only attempts to dlopen libcublasLt.
        if !unsafe { lt::is_culib_present() } {
            return Err("libcublasLt.so could not be loaded".into());
        }
        let mut h = std::ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer.
        check(unsafe { lt::cublasLtCreate(&mut h) }, "cublasLtCreate")
            .map_err(|e| e.to_string())?;
        let handle = h;
        let ws = match gpu_alloc(WORKSPACE_BYTES) {
            Ok(b) => b,
            Err(e) => {
                // SAFETY: created just above, destroyed once.
                unsafe {
                    let _ = lt::cublasLtDestroy(handle);
                }
                return Err(e.to_string());
            }
        };
        Ok(Lt {
            handle,
            ws,
            plans: RefCell::new(HashMap::new()),
            scratch: RefCell::new(None),
        })
    }
}

/// Descriptors of one shape (f16 `W` row-major `m x k` used transposed, f16 `A` row-major
/// `n x k`, f32 `C` row-major `n x m`, f32 compute), in cuBLAS's column-major terms as
/// [`Gpu::gemm_f16`] describes them.
fn describe(sh: GemmShape) -> Result<Plan, CudaError> {
    let (m, n, k) = (sh.m as u64, sh.n as u64, sh.k as u64);
    let mut desc = std::ptr::null_mut();
    // SAFETY: out-pointer valid; the enums are cuBLASLt's.
    check(
        unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType::CUDA_R_32F,
            )
        },
        "cublasLtMatmulDescCreate",
    )?;
    let mut plan = Plan {
        desc,
        la: std::ptr::null_mut(),
        lb: std::ptr::null_mut(),
        lc: std::ptr::null_mut(),
        algo: None,
        tuning: GemmTuning {
            shape: sh,
            candidates: 0,
            gemm_ex_us: f64::NAN,
            best_lt_us: f64::NAN,
            lt_kept: false,
            best_split_k: 1,
        },
    };
    // cublasOperation_t: CUBLAS_OP_T = 1 (W), CUBLAS_OP_N = 0 (A).
    let (ta, tb) = (1i32, 0i32);
    for (attr, v) in [
        (
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &ta,
        ),
        (
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            &tb,
        ),
    ] {
        // SAFETY: the attribute is an i32 (cublasOperation_t) read from a live local.
        check(
            unsafe {
                lt::cublasLtMatmulDescSetAttribute(
                    plan.desc,
                    attr,
                    v as *const i32 as *const c_void,
                    std::mem::size_of::<i32>(),
                )
            },
            "cublasLtMatmulDescSetAttribute",
        )?;
    }
    let layouts = [
        (lt::cudaDataType::CUDA_R_16F, k, m, k as i64),
        (lt::cudaDataType::CUDA_R_16F, k, n, k as i64),
        (lt::cudaDataType::CUDA_R_32F, m, n, m as i64),
    ];
    let mut out = [std::ptr::null_mut(); 3];
    for (o, (ty, rows, cols, ld)) in out.iter_mut().zip(layouts) {
        // SAFETY: out-pointer valid.
        check(
            unsafe { lt::cublasLtMatrixLayoutCreate(o, ty, rows, cols, ld) },
            "cublasLtMatrixLayoutCreate",
        )?;
    }
    [plan.la, plan.lb, plan.lc] = out;
    Ok(plan)
}

/// The K split an algorithm is configured with (1 where it says none).
fn split_k_of(algo: &lt::cublasLtMatmulAlgo_t) -> u32 {
    let mut v = 1u32;
    let mut got = 0usize;
    // SAFETY: reads one u32 attribute of a live algorithm into a local.
    let s = unsafe {
        lt::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            lt::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
            (&mut v) as *mut u32 as *mut c_void,
            std::mem::size_of::<u32>(),
            &mut got,
        )
    };
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        v.max(1)
    } else {
        1
    }
}

/// More candidates: the heuristic's first four with the K dimension split 2, 4 and 8 ways
/// (partial sums reduced in the workspace in f32, a fixed order), where cuBLASLt accepts the
/// configuration. A thin product of few output tiles (m = 3072 at n <= 64: 24 tiles of 128
/// rows) otherwise leaves most SMs idle.
fn split_k_variants(
    l: &Lt,
    plan: &Plan,
    cands: &[(lt::cublasLtMatmulAlgo_t, usize)],
    wsb: usize,
) -> Vec<(lt::cublasLtMatmulAlgo_t, usize)> {
    let mut out = Vec::new();
    for (algo, _) in cands.iter().take(4) {
        if split_k_of(algo) > 1 {
            continue;
        }
        for split in [2u32, 4, 8] {
            let mut a = *algo;
            let scheme =
                lt::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
            let set = |a: &mut lt::cublasLtMatmulAlgo_t,
                       attr: lt::cublasLtMatmulAlgoConfigAttributes_t,
                       v: u32| {
                // SAFETY: writes one u32 attribute of a local copy of an algorithm.
                unsafe {
                    lt::cublasLtMatmulAlgoConfigSetAttribute(
                        a,
                        attr,
                        (&v) as *const u32 as *const c_void,
                        std::mem::size_of::<u32>(),
                    )
                }
            };
            use lt::cublasLtMatmulAlgoConfigAttributes_t as A;
            if set(&mut a, A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, split)
                != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                || set(&mut a, A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, scheme)
                    != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            {
                continue;
            }
            // SAFETY: zeroed result is plain data the call overwrites; descriptors are live.
            let mut r: lt::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
            let ok = unsafe {
                lt::cublasLtMatmulAlgoCheck(
                    l.handle, plan.desc, plan.la, plan.lb, plan.lc, plan.lc, &a, &mut r,
                )
            };
            if ok == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && r.workspaceSize <= wsb
            {
                out.push((a, r.workspaceSize));
            }
        }
    }
    out
}

impl Gpu {
    /// Whether products of `n` tokens take the tuned cuBLASLt path (9..64 tokens, while it is
    /// available and on: `CROSSOVER_CUDA_LT=0` turns it off).
    pub fn lt_wants(&self, n: usize) -> bool {
        self.lt.is_some() && self.lt_on.get() && n > 8 && n <= 64
    }

    /// What tuning found for every shape tuned so far, sorted by shape.
    pub fn gemm_tunings(&self) -> Vec<GemmTuning> {
        let mut v: Vec<GemmTuning> = self
            .lt
            .as_ref()
            .map(|l| l.plans.borrow().values().map(|p| p.tuning).collect())
            .unwrap_or_default();
        v.sort_by_key(|t| t.shape);
        v
    }

    /// Whether the stream is capturing a graph now.
    fn capturing(&self) -> Result<bool, CudaError> {
        let st = self
            .stream
            .capture_status()
            .map_err(crate::error::drv("cuStreamIsCapturing"))?;
        Ok(st != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The tuned cuBLASLt product for `sh` if it has one and it beat `cublasGemmEx` (tuning
    /// it first when it is new and no capture is running). Returns whether it ran.
    pub(crate) fn gemm_lt(&self, sh: GemmShape, w: u64, a: u64, c: u64) -> Result<bool, CudaError> {
        let Some(l) = self.lt.as_ref() else {
            return Ok(false);
        };
        if !l.plans.borrow().contains_key(&sh) {
            if self.capturing()? {
                return Ok(false);
            }
            self.lt_tune(l, sh, w, a)?;
        }
        let plans = l.plans.borrow();
        let Some(p) = plans.get(&sh) else {
            return Ok(false);
        };
        let Some((algo, ws)) = p.algo.as_ref() else {
            return Ok(false);
        };
        self.lt_run(l, p, algo, *ws, w, a, c, sh.acc)
            .map_err(lt_err(format!(
                "cublasLtMatmul m={} n={} k={}",
                sh.m, sh.n, sh.k
            )))?;
        Ok(true)
    }

    #[allow(clippy::too_many_arguments)]
    fn lt_run(
        &self,
        l: &Lt,
        p: &Plan,
        algo: &lt::cublasLtMatmulAlgo_t,
        ws: usize,
        w: u64,
        a: u64,
        c: u64,
        acc: bool,
    ) -> Result<(), lt::cublasStatus_t> {
        let (alpha, beta) = (1.0f32, if acc { 1.0f32 } else { 0.0 });
        // SAFETY: the descriptors are live (owned by `p`), the pointers are device buffers of
        // the plan's shape (the caller's contract, as for `gemm_f16`), the workspace holds at
        // least `ws` bytes (checked when the algorithm was kept), alpha/beta are host scalars.
        let s = unsafe {
            lt::cublasLtMatmul(
                l.handle,
                p.desc,
                (&alpha) as *const f32 as *const c_void,
                w as *const c_void,
                p.la,
                a as *const c_void,
                p.lb,
                (&beta) as *const f32 as *const c_void,
                c as *const c_void,
                p.lc,
                c as *mut c_void,
                p.lc,
                algo,
                l.ws.ptr() as *mut c_void,
                ws,
                self.stream.cu_stream() as lt::cudaStream_t,
            )
        };
        if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(s)
        }
    }

    /// Time `cublasGemmEx` and the heuristic's candidates for `sh` (each as a graph of
    /// up to 10 products, into a scratch output) and keep the fastest.
    fn lt_tune(&self, l: &Lt, sh: GemmShape, w: u64, a: u64) -> Result<(), CudaError> {
        // Products per timed graph: about 150 us of work each (the weight bytes at ~3 TB/s),
        // 1 to 10, so a large head costs milliseconds to tune rather than tens of them.
        let est_us = (sh.m * sh.k * 2) as f64 / 3e6;
        let reps = ((150.0 / est_us.max(1.0)).round() as usize).clamp(1, 10);
        let want = self.lt_candidates.get().clamp(1, 64);
        let mut plan = describe(sh)?;
        let mut pref = std::ptr::null_mut();
        // SAFETY: out-pointer valid.
        check(
            unsafe { lt::cublasLtMatmulPreferenceCreate(&mut pref) },
            "cublasLtMatmulPreferenceCreate",
        )?;
        let wsb = l.ws.bytes();
        // SAFETY: the attribute is a u64 read from a live local; `pref` is live.
        let r = unsafe {
            lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&(wsb as u64)) as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
        };
        // SAFETY: zeroed results are plain data the call overwrites.
        let mut res: Vec<lt::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; want];
        let mut got = 0i32;
        let r = check(r, "cublasLtMatmulPreferenceSetAttribute").and_then(|()| {
            // SAFETY: descriptors live; `res` holds `want` results.
            check(
                unsafe {
                    lt::cublasLtMatmulAlgoGetHeuristic(
                        l.handle,
                        plan.desc,
                        plan.la,
                        plan.lb,
                        plan.lc,
                        plan.lc,
                        pref,
                        want as i32,
                        res.as_mut_ptr(),
                        &mut got,
                    )
                },
                "cublasLtMatmulAlgoGetHeuristic",
            )
        });
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = lt::cublasLtMatmulPreferenceDestroy(pref);
        }
        // No candidate (an unsupported shape) leaves cublasGemmEx in use.
        let cands: Vec<(lt::cublasLtMatmulAlgo_t, usize)> = if r.is_ok() {
            res.iter()
                .take(got.max(0) as usize)
                .filter(|h| {
                    h.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS && h.workspaceSize <= wsb
                })
                .map(|h| (h.algo, h.workspaceSize))
                .collect()
        } else {
            Vec::new()
        };
        let mut cands = cands;
        if self.lt_splitk.get() {
            cands.extend(split_k_variants(l, &plan, &cands, wsb));
        }
        let need = sh.m * sh.n * 4;
        {
            let mut sc = l.scratch.borrow_mut();
            if sc.as_ref().is_none_or(|b| b.bytes() < need) {
                *sc = None;
                *sc = Some(self.alloc_zeroed(need)?);
            }
        }
        let c = l.scratch.borrow().as_ref().map_or(0, DevBuf::ptr);
        let beta = if sh.acc { 1.0 } else { 0.0 };
        let ex_ms = self.time_graph(2, &mut || {
            for _ in 0..reps {
                self.gemm_ex(w, a, c, sh.m, sh.n, sh.k, beta)?;
            }
            Ok(())
        })?;
        let mut best: Option<(f64, usize)> = None;
        let mut ran = 0;
        for (i, (algo, ws)) in cands.iter().enumerate() {
            let t = self.time_graph(2, &mut || {
                for _ in 0..reps {
                    self.lt_run(l, &plan, algo, *ws, w, a, c, sh.acc)
                        .map_err(lt_err("candidate"))?;
                }
                Ok(())
            });
            // A candidate that fails to run is skipped (the stream is synchronized clean).
            let Ok(t) = t else {
                self.sync()?;
                continue;
            };
            ran += 1;
            if best.is_none_or(|(b, _)| t < b) {
                best = Some((t, i));
            }
        }
        let us = |ms: f64| ms * 1e3 / reps as f64;
        plan.tuning.candidates = ran;
        plan.tuning.gemm_ex_us = us(ex_ms);
        if let Some((t, i)) = best {
            plan.tuning.best_lt_us = us(t);
            plan.tuning.best_split_k = split_k_of(&cands[i].0);
            if t < ex_ms || self.lt_force.get() {
                plan.algo = Some(cands[i]);
                plan.tuning.lt_kept = true;
            }
        }
        l.plans.borrow_mut().insert(sh, plan);
        Ok(())
    }
}
