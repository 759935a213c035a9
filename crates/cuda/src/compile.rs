//! Kernel sources and their run-time compilation with NVRTC, cached on disk.
//!
//! The kernels are CUDA C kept in `crates/cuda/kernels/`, built into the binary as text and
//! compiled for the device's own architecture when a backend starts (so one binary serves every
//! GPU generation and the machine building it needs no CUDA). The result is cached under
//! `~/.cache/crossover/cuda/<hash>.cubin`, keyed by the source, the options and the NVRTC version.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys as nvrtc_sys;
use sha2::{Digest, Sha256};

use crate::error::CudaError;

/// The kernel files, in the order they are concatenated into one program.
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cu", include_str!("../kernels/common.cu")),
    ("quant.cu", include_str!("../kernels/quant.cu")),
    ("matvec.cu", include_str!("../kernels/matvec.cu")),
    ("matvec_q.cu", include_str!("../kernels/matvec_q.cu")),
    ("mmq.cu", include_str!("../kernels/mmq.cu")),
    ("matvec_sm.cu", include_str!("../kernels/matvec_sm.cu")),
    ("matvec_cl.cu", include_str!("../kernels/matvec_cl.cu")),
    ("prefill.cu", include_str!("../kernels/prefill.cu")),
    ("ops.cu", include_str!("../kernels/ops.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
    ("attn_batch.cu", include_str!("../kernels/attn_batch.cu")),
    ("mmf.cu", include_str!("../kernels/mmf.cu")),
    ("decode.cu", include_str!("../kernels/decode.cu")),
    ("probe.cu", include_str!("../kernels/probe.cu")),
    ("exact.cu", include_str!("../kernels/exact.cu")),
];

/// The whole program: every kernel file, each preceded by a `#line` directive so NVRTC's error
/// messages name the real file and line.
pub fn program_source() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// Whether the NVRTC library can be loaded (it is looked for on the loader path).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names; no symbol is called.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is present (checked above); both out-pointers are valid locals.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion")?;
    Ok((major, minor))
}

fn check(r: nvrtc_sys::nvrtcResult, what: &str) -> Result<(), CudaError> {
    if r == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Nvrtc {
            what: what.to_string(),
            log: format!("{r:?}"),
        })
    }
}

/// What a compilation produced.
pub enum Image {
    /// Machine code for one real architecture (`sm_XY`).
    Cubin(Vec<u8>),
    /// PTX text (NUL-terminated), for the driver to compile.
    Ptx(Vec<u8>),
}

impl Image {
    /// The bytes to hand to `cuModuleLoadData`.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Image::Cubin(b) | Image::Ptx(b) => b,
        }
    }
}

fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        // Precise division/sqrt and no flush-to-zero: the kernels are checked against the CPU's
        // IEEE f32 arithmetic.
        "--fmad=true".into(),
        "-default-device".into(),
    ]
}

/// Compile the whole program for `arch` (`sm_90`, or `compute_90` for PTX). Errors carry
/// NVRTC's log, which names the kernel file and line.
pub fn compile(arch: &str) -> Result<Image, CudaError> {
    compile_source(&program_source(), arch)
}

/// Compile an arbitrary source (used by tests to check that a broken kernel is reported).
pub fn compile_source(src: &str, arch: &str) -> Result<Image, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let src_c = CString::new(src).map_err(|_| CudaError::Nvrtc {
        what: "source".into(),
        log: "kernel source contains a NUL byte".into(),
    })?;
    let name = CString::new("crossover.cu").unwrap_or_default();
    let mut prog: nvrtc_sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: `src_c` and `name` outlive the program; no headers are passed (0, null, null).
    let r = unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            &mut prog,
            src_c.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    check(r, "nvrtcCreateProgram")?;
    let guard = ProgGuard(prog);
    let opts: Vec<CString> = options(arch)
        .into_iter()
        .filter_map(|o| CString::new(o).ok())
        .collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `opt_ptrs` points into `opts`, alive for the call; the program handle is valid.
    let r = unsafe {
        nvrtc_sys::nvrtcCompileProgram(guard.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr())
    };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Nvrtc {
            what: format!("compiling kernels for {arch} ({r:?})"),
            log: program_log(guard.0),
        });
    }
    let cubin = arch.starts_with("sm_");
    let mut size = 0usize;
    // SAFETY: the program compiled; `size` is a valid out-pointer.
    let r = unsafe {
        if cubin {
            nvrtc_sys::nvrtcGetCUBINSize(guard.0, &mut size)
        } else {
            nvrtc_sys::nvrtcGetPTXSize(guard.0, &mut size)
        }
    };
    check(r, "get image size")?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds exactly the size NVRTC reported.
    let r = unsafe {
        if cubin {
            nvrtc_sys::nvrtcGetCUBIN(guard.0, buf.as_mut_ptr() as *mut c_char)
        } else {
            nvrtc_sys::nvrtcGetPTX(guard.0, buf.as_mut_ptr() as *mut c_char)
        }
    };
    check(r, "get image")?;
    Ok(if cubin {
        Image::Cubin(buf)
    } else {
        Image::Ptx(buf)
    })
}

struct ProgGuard(nvrtc_sys::nvrtcProgram);

impl Drop for ProgGuard {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once, here.
        unsafe {
            let _ = nvrtc_sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn program_log(prog: nvrtc_sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: valid program handle and out-pointer.
    if unsafe { nvrtc_sys::nvrtcGetProgramLogSize(prog, &mut size) }
        != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS
    {
        return "(no log)".into();
    }
    let mut buf = vec![0u8; size.max(1)];
    // SAFETY: `buf` has the reported size.
    if unsafe { nvrtc_sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char) }
        != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS
    {
        return "(no log)".into();
    }
    CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The cache folder: `$CROSSOVER_CUDA_CACHE`, else `$XDG_CACHE_HOME/crossover/cuda`, else
/// `~/.cache/crossover/cuda`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("CROSSOVER_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("crossover").join("cuda"))
}

/// Compiled kernels for `arch`, from the disk cache when an identical compilation was done
/// before. Returns the image and whether it came from the cache. A cache that cannot be read
/// or written is skipped (compiling is always possible), never an error.
pub fn compile_cached(arch: &str) -> Result<(Image, bool), CudaError> {
    let src = program_source();
    let (maj, min) = nvrtc_version()?;
    let mut h = Sha256::new();
    h.update(src.as_bytes());
    h.update(options(arch).join(" ").as_bytes());
    h.update(format!("nvrtc {maj}.{min}").as_bytes());
    let key: String = h
        .finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect();
    let cubin = arch.starts_with("sm_");
    let file =
        cache_dir().map(|d| d.join(format!("{key}.{}", if cubin { "cubin" } else { "ptx" })));
    if let Some(f) = &file {
        if let Ok(bytes) = std::fs::read(f) {
            if !bytes.is_empty() {
                let img = if cubin {
                    Image::Cubin(bytes)
                } else {
                    Image::Ptx(bytes)
                };
                return Ok((img, true));
            }
        }
    }
    let img = compile_source(&src, arch)?;
    if let Some(f) = &file {
        if let Some(dir) = f.parent() {
            if std::fs::create_dir_all(dir).is_ok() {
                // Write then rename, so a concurrent reader never sees half a file.
                let tmp = f.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, img.bytes()).is_ok() {
                    let _ = std::fs::rename(&tmp, f);
                }
            }
        }
    }
    Ok((img, false))
}
