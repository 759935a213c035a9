//! A small fork-join thread pool with spinning workers.
//!
//! A 135M-parameter model runs about 200 matrix products per token at 100+ tokens/s, so the cost
//! of handing a job to the workers and waiting for them must be a few microseconds, not the tens
//! that waking parked threads costs. Workers therefore spin on a generation counter for a while
//! after each job (as ggml's workers do) and only park on a condition variable after
//! a short spin window of idleness ([`Pool::DEFAULT_SPIN`], or [`Pool::with_spin`]).
//!
//! A job is a set of numbered items taken from a shared counter. The dispatching thread works on
//! items too and, once every item is taken, closes the job: a worker that had not joined by then
//! (descheduled, or still waking up) skips it instead of being waited for. So on a busy machine
//! a call is only held up by a worker that is preempted while running an item, never by one that
//! has not started.

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::DotError;

/// The job being run: items `0..n`, handed out by `next`.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
}

impl Job<'_> {
    /// Take and run items until none are left; returns false if one panicked.
    fn work(&self) -> bool {
        let mut ok = true;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return ok;
            }
            if catch_unwind(AssertUnwindSafe(|| (self.f)(i))).is_err() {
                ok = false;
            }
        }
    }
}

struct Shared {
    /// Points at the `Job` on the dispatching thread's stack while the job is open or any
    /// worker that joined it still runs.
    job: AtomicPtr<()>,
    /// Bumped once per job (and at shutdown); workers look at each generation once.
    generation: AtomicUsize,
    /// The generation open for joining, or 0 once its dispatcher has closed it.
    open: AtomicUsize,
    /// Workers inside a job (joined and not yet left).
    joined: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    spin: Duration,
    lock: Mutex<()>,
    wake: Condvar,
}

thread_local! {
    /// Set while this thread runs a pool item, so a nested call runs inline instead of
    /// deadlocking on the pool it is already part of.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// A fixed set of threads that share out numbered work items ([`Pool::par_for`],
/// [`Pool::run`]).
///
/// The calling thread takes part, so `Pool::new(n)` starts `n - 1` workers.
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
    ///
    /// Short: the gaps between the products of one step are microseconds, so a worker still
    /// catches every job of a step; between steps (sampling, sending tokens) it parks, which
    /// costs one wake-up per step. Spinning for 2 ms instead took a core from whatever else had
    /// to run on a busy machine (the server's other threads, other processes): with a load
    /// average of ~3.6 on 2 cores, a one-sequence decode step took 20-23 ms spinning 2 ms and
    /// 10-13 ms spinning 50 us, a 64-sequence step 323-387 ms and 137-241 ms
    /// (`crates/server/examples/batch_step.rs`, SmolLM2, 2 threads).
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

    /// A pool of `n_threads` threads (0 = one per available CPU), whose idle workers spin for
    /// [`Pool::DEFAULT_SPIN`], or for the microseconds the environment variable
    /// `CROSSOVER_POOL_SPIN_US` names (to measure the trade-off on a given machine).
    pub fn new(n_threads: usize) -> Result<Pool, DotError> {
        let spin = std::env::var("CROSSOVER_POOL_SPIN_US")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map_or(Pool::DEFAULT_SPIN, Duration::from_micros);
        Pool::with_spin(n_threads, spin)
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
            open: AtomicUsize::new(0),
            joined: AtomicUsize::new(0),
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
                .spawn(move || worker(s))
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

    /// Run `f(i)` exactly once for every `i` in `0..n_threads()`, spread over the pool's
    /// threads (a thread may run several), and return when all have finished. See
    /// [`Pool::par_for`].
    pub fn run<F: Fn(usize) + Sync>(&self, f: F) {
        self.par_for(self.n, f)
    }

    /// Run `f(i)` exactly once for every `i` in `0..n`, the threads taking the next index from a
    /// shared counter (so uneven items balance out), and return when all have finished. A panic
    /// in any item is re-raised here after all items have finished. Called from inside an
    /// item, it runs every index inline on the calling thread.
    pub fn par_for<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        if n == 0 {
            return;
        }
        if n == 1 || self.n == 1 || IN_JOB.with(|c| c.get()) {
            (0..n).for_each(f);
            return;
        }
        let _g = self.dispatch.lock().unwrap_or_else(|e| e.into_inner());
        let sh = &*self.shared;
        let job = Job {
            f: &f,
            n,
            next: AtomicUsize::new(0),
        };
        sh.job
            .store(&job as *const Job<'_> as *mut (), Ordering::SeqCst);
        // Only this thread (holding `dispatch`) writes the generation.
        let g = sh.generation.load(Ordering::SeqCst).wrapping_add(1).max(1);
        sh.open.store(g, Ordering::SeqCst);
        // SeqCst pairs with the worker's SeqCst `sleepers` increment: either we see the sleeper
        // and wake it, or it sees the new generation before waiting.
        sh.generation.store(g, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        IN_JOB.with(|c| c.set(true));
        let mine = catch_unwind(AssertUnwindSafe(|| job.work()));
        IN_JOB.with(|c| c.set(false));
        // Every item is taken: late workers must not join any more. `job` and `f` live on this
        // stack frame, so no return (or unwind) before every joined worker has left.
        sh.open.store(0, Ordering::SeqCst);
        let mut spins = 0u32;
        while sh.joined.load(Ordering::SeqCst) != 0 {
            spins = spins.wrapping_add(1);
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                // A joined worker was preempted mid-item: let it run.
                std::thread::yield_now();
            }
        }
        sh.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        let worker_panicked = sh.panicked.swap(false, Ordering::SeqCst);
        match mine {
            Err(p) => resume_unwind(p),
            Ok(false) => panic!("a pool item panicked on the calling thread"),
            Ok(true) if worker_panicked => panic!("a pool item panicked on a worker thread"),
            Ok(true) => {}
        }
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

fn worker(sh: Arc<Shared>) {
    let mut seen = 0usize;
    loop {
        seen = wait_for_job(&sh, seen);
        if sh.shutdown.load(Ordering::SeqCst) {
            return;
        }
        sh.joined.fetch_add(1, Ordering::SeqCst);
        // Joining counts only while the job is still open; the dispatcher closes it before it
        // waits for `joined` to drop to zero, so either it waits for us or we see it closed.
        if sh.open.load(Ordering::SeqCst) == seen {
            let jp = sh.job.load(Ordering::SeqCst) as *const Job<'_>;
            // SAFETY: the job of generation `seen` is open, so its dispatcher stored this
            // pointer before opening it and keeps the `Job` alive until `joined` is zero, which
            // needs our decrement below.
            let job = unsafe { &*jp };
            IN_JOB.with(|c| c.set(true));
            if !job.work() {
                sh.panicked.store(true, Ordering::SeqCst);
            }
            IN_JOB.with(|c| c.set(false));
        }
        sh.joined.fetch_sub(1, Ordering::SeqCst);
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
