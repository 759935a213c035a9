//! The CUDA backend: runs Llama-family GGUF models on NVIDIA GPUs.
//!
//! Libraries are loaded at run time (`cudarc` dynamic loading), so the same binary builds and
//! runs on machines without CUDA; [`available`] says why a GPU cannot be used. Kernels are CUDA
//! C in `crates/cuda/kernels/`, compiled by NVRTC for the device's architecture at start and
//! cached on disk ([`compile`]).

pub mod compile;
pub mod device;
pub mod error;
pub mod exact;
pub mod kernels;
pub mod lt;

pub use device::{available, DevBuf, Gpu, SideCfg};
pub use error::CudaError;
pub use lt::{GemmShape, GemmTuning};
pub mod backend;
pub mod host;
pub mod power;

pub use backend::{
    CudaBackend, CudaOptions, DecodeV10, GemmWeights, KvPf, StepStats, TraceFn, SIDE_ONE,
    SIDE_ONE_NEXT, SIDE_WIDE,
};
pub use host::{HostPlan, WeightSplit};
pub use power::PowerMeter;
