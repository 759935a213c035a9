//! Errors of the CUDA backend.

/// Why the CUDA backend could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda.so` is not on this machine (no NVIDIA driver).
    #[error("no CUDA driver found (libcuda.so could not be loaded)")]
    NoDriver,
    /// The driver loaded but reports no device.
    #[error("CUDA driver found but no CUDA device is present")]
    NoDevice,
    /// A device index beyond the devices present.
    #[error("CUDA device {index} does not exist ({count} present)")]
    BadDevice { index: usize, count: usize },
    /// `libnvrtc.so` could not be loaded, so the kernels cannot be compiled.
    #[error("NVRTC (libnvrtc.so.13) could not be loaded: the kernels cannot be compiled")]
    NoNvrtc,
    /// NVRTC failed; the log names the kernel file and line.
    #[error("NVRTC error in {what}:\n{log}")]
    Nvrtc { what: String, log: String },
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {what}: {err}")]
    Driver { what: String, err: String },
    /// A cuBLAS call failed.
    #[error("cuBLAS error in {what}: {err}")]
    Cublas { what: String, err: String },
    /// The model uses something this backend cannot run.
    #[error("model {path} cannot run on the CUDA backend: {why}")]
    Model { path: String, why: String },
    /// The model file could not be opened.
    #[error("cannot open model {path}: {source}")]
    Open {
        path: String,
        source: gguf::GgufError,
    },
    /// An option out of range.
    #[error("invalid option {name} = {value}: {why}")]
    Option {
        name: &'static str,
        value: String,
        why: &'static str,
    },
    /// Device memory ran out.
    #[error("not enough GPU memory for {what}: need {need} bytes, {free} free")]
    OutOfMemory { what: String, need: u64, free: u64 },
    /// A caller-side argument does not fit the kernel (shape, length).
    #[error("invalid kernel argument: {0}")]
    Arg(String),
    /// A graph capture was invalidated by work outside it (e.g. another handle on the device
    /// loading its kernels meanwhile): the launches it held were not run; capturing again later
    /// may succeed.
    #[error("graph capture invalidated by other work on the device")]
    CaptureInvalidated,
}

pub(crate) fn drv(
    what: impl Into<String>,
) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    let what = what.into();
    move |e| CudaError::Driver {
        what,
        err: format!("{e:?}"),
    }
}
