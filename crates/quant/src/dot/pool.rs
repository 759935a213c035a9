//! A small fork-join thread pool with spinning workers.
//!
//! A 135M-parameter model runs about 200 matrix products per token at 100+ tokens/s, so the cost
//! of handing a job to the workers and waiting for them must be a few microseconds, not the tens
//! that waking parked threads costs. Workers therefore spin on a generation counter for a while
//! after each job (as ggml's workers do) and only park on a condition variable after
//! [`Pool::spin`] of idleness.

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::DotError;

type Job<'a> = &'a (dyn Fn(usize) + Sync);

struct Shared {
    /// Points at a `Job` on the dispatching thread's stack while a job runs.
    job: AtomicPtr<()>,
    /// Bumped once per job (and at shutdown); workers run each generation exactly once.
    generation: AtomicUsize,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    spin: Duration,
    lock: Mutex<()>,
    wake: Condvar,
}

thread_local! {
    /// Set while this thread runs a pool job, so a nested `run` executes inline instead of
    /// deadlocking on the pool it is already part of.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// A fixed set of threads that run a closure on every thread at once ([`Pool::run`]).
///
/// The calling thread takes part as thread 0, so `Pool::new(n)` starts `n - 1` workers.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n: usize,
    dispatch: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("threads", &self.n).finish()
    }
}

/// The number of threads the machine offers (at least 1).
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

impl Pool {
    /// How long an idle worker spins before parking, unless set with [`Pool::with_spin`].
    pub const DEFAULT_SPIN: Duration = Duration::from_millis(2);

    /// A pool of `n_threads` threads (0 = one per available CPU).
    pub fn new(n_threads: usize) -> Result<Pool, DotError> {
        Pool::with_spin(n_threads, Pool::DEFAULT_SPIN)
    }

    /// A pool whose idle workers spin for `spin` before parking.
    pub fn with_spin(n_threads: usize, spin: Duration) -> Result<Pool, DotError> {
        let n = if n_threads == 0 {
            default_threads()
        } else {
            n_threads
        };
        let shared = Arc::new(Shared {
            job: AtomicPtr::new(std::ptr::null_mut()),
            generation: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            spin,
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = Pool {
            shared,
            workers: Vec::with_capacity(n.saturating_sub(1)),
            n,
            dispatch: Mutex::new(()),
        };
        for index in 1..n {
            let s = Arc::clone(&pool.shared);
            let h = std::thread::Builder::new()
                .name(format!("crossover-cpu-{index}"))
                .spawn(move || worker(s, index))
                .map_err(|e| DotError::Spawn {
                    index,
                    reason: e.to_string(),
                });
            match h {
                Ok(h) => pool.workers.push(h),
                // Dropping `pool` stops the workers started so far.
                Err(e) => return Err(e),
            }
        }
        Ok(pool)
    }

    /// Number of threads, the caller included.
    pub fn n_threads(&self) -> usize {
        self.n
    }

    /// Run `f(i)` once for every thread index `i` in `0..n_threads()`, concurrently, and return
    /// when all have finished. The caller runs index 0. A panic in any of them is re-raised here
    /// after all have finished. Called from inside a job, it runs every index inline.
    pub fn run<F: Fn(usize) + Sync>(&self, f: F) {
        if self.n == 1 || IN_JOB.with(|c| c.get()) {
            (0..self.n).for_each(&f);
            return;
        }
        let _g = self.dispatch.lock().unwrap_or_else(|e| e.into_inner());
        let sh = &*self.shared;
        let job: Job<'_> = &f;
        sh.job
            .store(&job as *const Job<'_> as *mut (), Ordering::Relaxed);
        sh.pending.store(self.n - 1, Ordering::Relaxed);
        // SeqCst pairs with the worker's SeqCst `sleepers` increment: either we see the sleeper
        // and wake it, or it sees the new generation before waiting.
        sh.generation.fetch_add(1, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        IN_JOB.with(|c| c.set(true));
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        IN_JOB.with(|c| c.set(false));
        // `f` and `job` live on this stack frame: no return (or unwind) before every worker is
        // done with them.
        let mut spins = 0u32;
        while sh.pending.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                // A worker was descheduled (more threads than free cores): let it run.
                std::thread::yield_now();
            }
        }
        sh.job.store(std::ptr::null_mut(), Ordering::Relaxed);
        if let Err(p) = mine {
            sh.panicked.store(false, Ordering::Relaxed);
            resume_unwind(p);
        }
        if sh.panicked.swap(false, Ordering::Relaxed) {
            panic!("a crossover CPU worker thread panicked");
        }
    }

    /// Run `f(i)` for every `i` in `0..n`, spread over the threads: each thread takes the next
    /// index from a shared counter, so uneven items balance out.
    pub fn par_for<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        if n == 0 {
            return;
        }
        if n == 1 || self.n == 1 {
            (0..n).for_each(f);
            return;
        }
        let next = AtomicUsize::new(0);
        self.run(|_| loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            f(i);
        });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let sh = &*self.shared;
        sh.shutdown.store(true, Ordering::SeqCst);
        sh.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _l = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            // A worker cannot panic outside `catch_unwind`; nothing useful to do if it did.
            let _ = h.join();
        }
    }
}

fn worker(sh: Arc<Shared>, index: usize) {
    let mut seen = 0usize;
    loop {
        seen = wait_for_job(&sh, seen);
        if sh.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let jp = sh.job.load(Ordering::Relaxed) as *const Job<'_>;
        // SAFETY: the dispatcher stored a pointer to a live `Job` before bumping the generation
        // we just observed (SeqCst orders the two), and keeps it alive until `pending` reaches
        // zero, which needs our decrement below.
        let job: Job<'_> = unsafe { *jp };
        IN_JOB.with(|c| c.set(true));
        if catch_unwind(AssertUnwindSafe(|| job(index))).is_err() {
            sh.panicked.store(true, Ordering::Relaxed);
        }
        IN_JOB.with(|c| c.set(false));
        sh.pending.fetch_sub(1, Ordering::Release);
    }
}

/// Wait until the generation differs from `seen`; return the new one.
fn wait_for_job(sh: &Shared, seen: usize) -> usize {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let g = sh.generation.load(Ordering::SeqCst);
        if g != seen {
            return g;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) && start.elapsed() >= sh.spin {
            break;
        }
        std::hint::spin_loop();
    }
    let mut l = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
    sh.sleepers.fetch_add(1, Ordering::SeqCst);
    let g = loop {
        let g = sh.generation.load(Ordering::SeqCst);
        if g != seen {
            break g;
        }
        l = sh.wake.wait(l).unwrap_or_else(|e| e.into_inner());
    };
    sh.sleepers.fetch_sub(1, Ordering::SeqCst);
    g
}
