//! Fault injection for failover tests and demonstrations: a wrapper around a real backend that
//! fails its steps while a switch is on. Not a mock: with the switch off every call goes to the
//! wrapped backend unchanged.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::backend::{
    Backend, BackendError, BackendInfo, KvStats, OpDesc, SeqId, StepBatch, StepOutput, Support,
};

/// What a switched-on fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Steps run normally.
    Off = 0,
    /// Steps return a device error.
    Error = 1,
    /// Steps panic (the actor survives it only as far as failing its requests and stopping).
    Panic = 2,
}

/// Shared switch; cloning shares it. Only tests and the `--inject-fault` option hold one.
#[derive(Clone, Debug, Default)]
pub struct FaultSwitch(Arc<AtomicU8>);

impl FaultSwitch {
    /// A switch in state `f`.
    pub fn new(f: Fault) -> Self {
        let s = FaultSwitch::default();
        s.set(f);
        s
    }
    /// Change the fault.
    pub fn set(&self, f: Fault) {
        self.0.store(f as u8, Ordering::SeqCst);
    }
    /// Current fault.
    pub fn get(&self) -> Fault {
        match self.0.load(Ordering::SeqCst) {
            1 => Fault::Error,
            2 => Fault::Panic,
            _ => Fault::Off,
        }
    }
}

/// A real backend whose steps fail while its switch is on.
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

impl Backend for Faulty {
    fn info(&self) -> &BackendInfo {
        self.inner.info()
    }
    fn support(&self, op: &OpDesc) -> Support {
        self.inner.support(op)
    }
    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, BackendError> {
        match self.switch.get() {
            Fault::Off => self.inner.step(batch),
            Fault::Error => Err(BackendError::Device {
                backend: self.inner.info().name.clone(),
                msg: "injected fault".into(),
            }),
            Fault::Panic => panic!("injected panic in step"),
        }
    }
    fn release(&mut self, seq: SeqId) {
        self.inner.release(seq)
    }
    fn kv(&self) -> KvStats {
        self.inner.kv()
    }
}
