//! Fault injection for failover and supervision tests and demonstrations.
//!
//! A [`FaultSwitch`] is a shared, thread-safe plan of faults: on every step (while switched on),
//! at the n-th step from now (once), or while loading. A real backend consults it: the CPU backend
//! does so itself (`CpuBackend::with_faults`), and [`Faulty`] wraps any backend. Neither is a
//! mock: with nothing planned every call goes to the real backend unchanged.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::{
    Backend, BackendError, BackendInfo, KvStats, OpDesc, SeqId, StepBatch, StepOutput, Support,
};

/// What a fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Nothing: the call runs normally.
    Off = 0,
    /// The call returns a device error (the device failed).
    Error = 1,
    /// The call panics (the backend's state is then unknown).
    Panic = 2,
}

impl Fault {
    fn from_u8(v: u8) -> Fault {
        match v {
            1 => Fault::Error,
            2 => Fault::Panic,
            _ => Fault::Off,
        }
    }
}

#[derive(Debug, Default)]
struct Plan {
    every_step: AtomicU8,
    every_load: AtomicU8,
    steps: AtomicU64,
    loads: AtomicU64,
    /// One-shot faults at absolute step / load numbers (1-based).
    at_step: Mutex<Vec<(u64, Fault)>>,
    at_load: Mutex<Vec<(u64, Fault)>>,
}

/// A shared fault plan; cloning shares it, so a test keeps one clone and the backend (and every
/// backend the actor's supervisor rebuilds from the same factory) the others. Steps and loads are
/// counted over all of them.
#[derive(Clone, Debug, Default)]
pub struct FaultSwitch(Arc<Plan>);

fn take_planned(list: &Mutex<Vec<(u64, Fault)>>, n: u64) -> Fault {
    let Ok(mut g) = list.lock() else {
        return Fault::Off;
    };
    match g.iter().position(|&(at, _)| at == n) {
        Some(i) => g.swap_remove(i).1,
        None => Fault::Off,
    }
}

impl FaultSwitch {
    /// A switch whose every step does `f`.
    pub fn new(f: Fault) -> Self {
        let s = FaultSwitch::default();
        s.set(f);
        s
    }

    /// Make every step from now do `f` (`Fault::Off` ends it).
    pub fn set(&self, f: Fault) {
        self.0.every_step.store(f as u8, Ordering::SeqCst);
    }

    /// What every step does now.
    pub fn get(&self) -> Fault {
        Fault::from_u8(self.0.every_step.load(Ordering::SeqCst))
    }

    /// Make every load (backend construction) from now do `f`.
    pub fn set_load(&self, f: Fault) {
        self.0.every_load.store(f as u8, Ordering::SeqCst);
    }

    /// Make the `n`-th step from now (1 = the next one) do `f`, once.
    pub fn fail_step_in(&self, n: u64, f: Fault) {
        let at = self.0.steps.load(Ordering::SeqCst) + n.max(1);
        if let Ok(mut g) = self.0.at_step.lock() {
            g.push((at, f));
        }
    }

    /// Make the `n`-th load from now (1 = the next one) do `f`, once.
    pub fn fail_load_in(&self, n: u64, f: Fault) {
        let at = self.0.loads.load(Ordering::SeqCst) + n.max(1);
        if let Ok(mut g) = self.0.at_load.lock() {
            g.push((at, f));
        }
    }

    /// Steps counted so far.
    pub fn steps(&self) -> u64 {
        self.0.steps.load(Ordering::SeqCst)
    }

    /// Loads counted so far.
    pub fn loads(&self) -> u64 {
        self.0.loads.load(Ordering::SeqCst)
    }

    /// Called by a backend at each step: counts it and says what to do.
    pub fn on_step(&self) -> Fault {
        let n = self.0.steps.fetch_add(1, Ordering::SeqCst) + 1;
        match take_planned(&self.0.at_step, n) {
            Fault::Off => self.get(),
            f => f,
        }
    }

    /// Called by a backend while it is being built: counts it and says what to do.
    pub fn on_load(&self) -> Fault {
        let n = self.0.loads.fetch_add(1, Ordering::SeqCst) + 1;
        match take_planned(&self.0.at_load, n) {
            Fault::Off => Fault::from_u8(self.0.every_load.load(Ordering::SeqCst)),
            f => f,
        }
    }
}

/// A real backend whose steps fail as its switch plans (load faults do not apply: it wraps a
/// backend that is already built).
pub struct Faulty {
    inner: Box<dyn Backend>,
    switch: FaultSwitch,
}

impl Faulty {
    /// Wrap `inner`.
    pub fn new(inner: Box<dyn Backend>, switch: FaultSwitch) -> Self {
        Faulty { inner, switch }
    }
}

impl Faulty {
    /// The switch's verdict for this step: go on, fail, or panic.
    fn fault(&self) -> Result<(), BackendError> {
        match self.switch.on_step() {
            Fault::Off => Ok(()),
            Fault::Error => Err(BackendError::Device {
                backend: self.inner.info().name.clone(),
                msg: "injected fault".into(),
            }),
            Fault::Panic => panic!("injected panic in step"),
        }
    }
}

impl Backend for Faulty {
    fn info(&self) -> &BackendInfo {
        self.inner.info()
    }
    fn support(&self, op: &OpDesc) -> Support {
        self.inner.support(op)
    }
    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, BackendError> {
        self.fault()?;
        self.inner.step(batch)
    }
    fn step_argmax(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        self.fault()?;
        self.inner.step_argmax(batch)
    }
    fn device_top_k(&self) -> usize {
        self.inner.device_top_k()
    }
    fn step_top_k(
        &mut self,
        batch: &StepBatch,
        k: usize,
    ) -> Result<Vec<Vec<(u32, f32)>>, BackendError> {
        self.fault()?;
        self.inner.step_top_k(batch, k)
    }
    fn pipelines_decode(&self) -> bool {
        self.inner.pipelines_decode()
    }
    fn decode_greedy(
        &mut self,
        batch: &StepBatch,
        steps: usize,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        self.fault()?;
        self.inner.decode_greedy(batch, steps)
    }
    fn release(&mut self, seq: SeqId) {
        self.inner.release(seq)
    }
    fn kv(&self) -> KvStats {
        self.inner.kv()
    }
    fn reuse_prefix(&mut self, seq: SeqId, prompt: &[u32]) -> usize {
        self.inner.reuse_prefix(seq, prompt)
    }
    fn recycle(&mut self, logits: Vec<f32>) {
        self.inner.recycle(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planned_faults_fire_once_at_their_count() {
        let s = FaultSwitch::default();
        assert_eq!(s.on_step(), Fault::Off);
        s.fail_step_in(2, Fault::Panic);
        s.fail_step_in(3, Fault::Error);
        assert_eq!(s.on_step(), Fault::Off);
        assert_eq!(s.on_step(), Fault::Panic);
        assert_eq!(s.on_step(), Fault::Error);
        assert_eq!(s.on_step(), Fault::Off);
        assert_eq!(s.steps(), 5);
        s.set(Fault::Error);
        assert_eq!(s.clone().on_step(), Fault::Error);
        s.set(Fault::Off);
        assert_eq!(s.on_step(), Fault::Off);

        s.fail_load_in(1, Fault::Panic);
        assert_eq!(s.on_load(), Fault::Panic);
        assert_eq!(s.on_load(), Fault::Off);
        s.set_load(Fault::Error);
        assert_eq!(s.on_load(), Fault::Error);
        assert_eq!(s.loads(), 3);
    }
}
