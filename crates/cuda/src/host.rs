//! Host placement: weight matrices the CUDA backend keeps in host memory and multiplies on the
//! CPU inside its own plan.
//!
//! Two things put a matmul on the host:
//! - **Layer placement** (`--layers-on-gpu N`, for models bigger than GPU memory): the matmul
//!   weights of layers `N..` stay in the memory-mapped file and never reach the GPU. Everything
//!   else of those layers (norms, RoPE, attention, the KV cache) stays on the GPU.
//! - **A missing kernel**: [`HostPlan::lacking`] makes the backend behave as one built without
//!   the matmul kernel of that weight type (a test double, named `cuda:N-lacking-TYPE`, that
//!   exercises the fallback on a real GPU).
//!
//! Such a matmul runs as: wait for the stream, copy the activations device -> host, run
//! [`runtime::fallback::HostMatMul`] (the CPU backend's own kernels, so the op's result is bit
//! for bit the CPU backend's on the same input), copy the result host -> device (adding it to
//! the destination first when the op accumulates into the residual). A step that contains such
//! an op cannot be captured in a CUDA graph (host work in the middle), so those steps launch
//! eagerly. The backend's `support` answers `Fallback { to: "host", why }` for them, which
//! `crossover audit` lists and counts.

use std::sync::Arc;

use cudarc::driver::result as drv_result;
use gguf::{GgmlType, GgufFile, TensorInfo};
use model::{ModelConfig, ModelWeights};
use runtime::fallback::{FallbackStats, HostMatMul, HostWeight};
use runtime::{OpDesc, Support};

use crate::device::Gpu;
use crate::error::{drv, CudaError};

/// Which matmuls the CUDA backend runs on the host. The default runs everything on the GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostPlan {
    /// Layers `0..N` keep their matmul weights on the GPU, the rest in host memory. `None`: all
    /// on the GPU.
    pub layers_on_gpu: Option<usize>,
    /// Behave as a build without the matmul kernel of this weight type (test double): every
    /// matmul of that type runs on the host, and the backend is named `cuda:N-lacking-TYPE`.
    pub lacking: Option<GgmlType>,
    /// Threads of the host executor (0: one per available CPU).
    pub threads: usize,
}

impl HostPlan {
    /// Why a matmul of `ty` in `layer` (`None`: the output head) runs on the host, or `None`
    /// when it runs on the GPU.
    pub fn host_reason(&self, layer: Option<usize>, ty: GgmlType) -> Option<String> {
        if let (Some(n), Some(l)) = (self.layers_on_gpu, layer) {
            if l >= n {
                return Some(format!(
                    "layer placement: layer {l} kept in host memory (--layers-on-gpu {n})"
                ));
            }
        }
        if self.lacking == Some(ty) {
            let t = ty.to_string().to_lowercase();
            return Some(format!(
                "no CUDA matmul kernel for {t} (test double built without it)"
            ));
        }
        None
    }

    /// The backend's answer for `op` when this plan moves it to the host.
    pub fn support(&self, op: &OpDesc) -> Option<Support> {
        if op.op != "matmul" {
            return None;
        }
        let why = self.host_reason(op.layer, op.ty?)?;
        Some(Support::Fallback {
            to: "host".into(),
            why,
        })
    }

    /// A note for the backend's device description: empty when everything runs on the GPU.
    pub fn note(&self) -> String {
        let mut s = String::new();
        if let Some(n) = self.layers_on_gpu {
            s.push_str(&format!(
                "; matmuls of layers {n}.. in host memory, run on the CPU (--layers-on-gpu {n})"
            ));
        }
        if let Some(t) = self.lacking {
            let t = t.to_string().to_lowercase();
            s.push_str(&format!(
                "; {t} matmuls run on the CPU (test double without that kernel)"
            ));
        }
        s
    }

    /// The backend's name for device `device`: `cuda:N`, or `cuda:N-lacking-TYPE` for the test
    /// double.
    pub fn backend_name(&self, device: usize) -> String {
        match self.lacking {
            Some(t) => format!("cuda:{device}-lacking-{}", t.to_string().to_lowercase()),
            None => format!("cuda:{device}"),
        }
    }

    /// Parse a backend name as [`HostPlan::backend_name`] writes it: `(device, lacking)`.
    pub fn parse_name(name: &str) -> Option<(usize, Option<GgmlType>)> {
        let rest = name.strip_prefix("cuda:")?;
        match rest.split_once("-lacking-") {
            None => Some((rest.parse().ok()?, None)),
            Some((d, t)) => Some((
                d.parse().ok()?,
                Some(GgmlType::from_name(&t.to_uppercase())?),
            )),
        }
    }
}

/// The CUDA backend's answer to "can you run this op?" ([`runtime::Backend::support`]): the
/// plan's host placement first, then the kernels this build has (a weight type without a
/// matmul or lookup kernel cannot run: `to = "none"`). A function of the plan alone, so
/// `crossover audit` can show a placement on a machine without a GPU.
pub fn cuda_support(plan: &HostPlan, op: &OpDesc) -> Support {
    if let Some(s) = plan.support(op) {
        return s;
    }
    match op.ty {
        Some(ty) if (op.op == "matmul" || op.op == "get_rows") && !crate::kernels::supports(ty) => {
            Support::Fallback {
                to: "none".into(),
                why: format!("no CUDA kernel for {ty}"),
            }
        }
        _ => Support::Native,
    }
}

/// Where a model's matmul weights go under a plan, in bytes (as stored in the file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightSplit {
    /// Matmul weights uploaded to the GPU (quantized, as stored).
    pub device_bytes: u64,
    /// Matmul weights left in host memory.
    pub host_bytes: u64,
    /// Matmuls on the host.
    pub host_mats: usize,
    /// Matmuls in all.
    pub mats: usize,
}

impl std::fmt::Display for WeightSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "{} of {} matmuls on the host ({:.1} MiB of weights kept in host memory), {:.1} MiB \
             of matmul weights on the GPU ({:.1} MiB with every layer there)",
            self.host_mats,
            self.mats,
            mib(self.host_bytes),
            mib(self.device_bytes),
            mib(self.device_bytes + self.host_bytes)
        )
    }
}

/// How `plan` splits the matmul weights of a model (the 7 of each layer and the output head;
/// the embedding table always goes to the GPU for lookups, and is counted here only when it is
/// also the head). Computed from the file alone: no GPU needed.
pub fn weight_split(cfg: &ModelConfig, w: &ModelWeights, plan: &HostPlan) -> WeightSplit {
    let mut s = WeightSplit::default();
    let mut add = |layer: Option<usize>, t: &TensorInfo| {
        let b = t.ty.bytes_for(t.n_elements()).unwrap_or(0);
        s.mats += 1;
        if plan.host_reason(layer, t.ty).is_some() {
            s.host_bytes += b;
            s.host_mats += 1;
        } else {
            s.device_bytes += b;
        }
    };
    for (li, l) in w.layers.iter().enumerate() {
        for t in [
            &l.attn_q,
            &l.attn_k,
            &l.attn_v,
            &l.attn_output,
            &l.ffn_gate,
            &l.ffn_up,
            &l.ffn_down,
        ] {
            add(Some(li), t);
        }
    }
    add(
        None,
        if cfg.tied_output {
            &w.token_embd
        } else {
            &w.output
        },
    );
    s
}

/// A weight matrix left in host memory (the memory-mapped file).
pub(crate) struct HostMat {
    pub file: Arc<GgufFile>,
    pub info: TensorInfo,
    pub rows: usize,
    pub cols: usize,
}

impl HostMat {
    pub fn new(file: &Arc<GgufFile>, info: &TensorInfo) -> Result<HostMat, CudaError> {
        let cols = info.dims.first().copied().unwrap_or(0) as usize;
        let rows = info.dims.iter().skip(1).product::<u64>() as usize;
        if !quant::dot::supports(info.ty) {
            return Err(CudaError::Model {
                path: info.name.clone(),
                why: format!("type {} has neither a GPU nor a CPU matmul kernel", info.ty),
            });
        }
        Ok(HostMat {
            file: file.clone(),
            info: info.clone(),
            rows,
            cols,
        })
    }
}

/// The host side of the fallback: the executor and the buffer results come back through.
#[derive(Debug, Default)]
pub(crate) struct HostExec {
    mm: HostMatMul,
    acc: Vec<f32>,
}

impl HostExec {
    pub fn new(threads: usize) -> HostExec {
        HostExec {
            mm: HostMatMul::with_threads(threads),
            acc: Vec::new(),
        }
    }

    /// `y (+)= W x` for `n` tokens with `W` in host memory; `x` (`n * cols` f32) and `y`
    /// (`n * rows` f32) are device addresses on `gpu`'s stream.
    pub fn linear(
        &mut self,
        gpu: &Gpu,
        m: &HostMat,
        x: u64,
        n: usize,
        y: u64,
        acc: bool,
    ) -> Result<(), CudaError> {
        let stream = gpu.stream.cu_stream();
        let xs = self.mm.stage(n * m.cols);
        // SAFETY: `x` holds `n * cols` f32 written by earlier work on this stream (the caller's
        // scratch buffer sized for the step); the copy is ordered after that work and the
        // synchronize below completes it before `xs` is read.
        unsafe { drv_result::memcpy_dtoh_async(xs, x, stream) }.map_err(drv("cuMemcpyDtoH"))?;
        if acc {
            self.acc.clear();
            self.acc.resize(n * m.rows, 0.0);
            // SAFETY: as above, for `y`'s `n * rows` f32.
            unsafe { drv_result::memcpy_dtoh_async(&mut self.acc[..], y, stream) }
                .map_err(drv("cuMemcpyDtoH"))?;
        }
        gpu.sync()?;
        let w = HostWeight {
            name: &m.info.name,
            ty: m.info.ty,
            data: m.file.tensor_data(&m.info),
            rows: m.rows,
            cols: m.cols,
        };
        let r = self
            .mm
            .run(&w, n)
            .map_err(|e| CudaError::Arg(e.to_string()))?;
        let out: &[f32] = if acc {
            // The CPU backend adds the product to the residual the same way (one f32 add).
            for (a, b) in self.acc.iter_mut().zip(r) {
                *a += *b;
            }
            &self.acc
        } else {
            r
        };
        // SAFETY: `y` has room for `n * rows` f32 (see above). From pageable memory the driver
        // stages the data before returning, so `out` may be reused afterwards.
        unsafe { drv_result::memcpy_htod_async(y, out, stream) }.map_err(drv("cuMemcpyHtoD"))
    }

    /// What the executor has done so far.
    pub fn stats(&self) -> FallbackStats {
        self.mm.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(layer: Option<usize>, ty: GgmlType, name: &str) -> OpDesc {
        OpDesc {
            op: name.into(),
            ty: Some(ty),
            shape: vec![64, 64],
            layer,
        }
    }

    #[test]
    fn plan_answers_per_layer_and_type() {
        let p = HostPlan {
            layers_on_gpu: Some(10),
            ..HostPlan::default()
        };
        assert_eq!(p.support(&op(Some(9), GgmlType::Q4K, "matmul")), None);
        let s = p.support(&op(Some(10), GgmlType::Q4K, "matmul"));
        assert!(
            matches!(&s, Some(Support::Fallback { to, why }) if to == "host" && why.starts_with("layer placement: layer 10")),
            "{s:?}"
        );
        // Only matmuls move; the head stays on the GPU.
        assert_eq!(p.support(&op(Some(12), GgmlType::Q4K, "attention")), None);
        assert_eq!(p.support(&op(None, GgmlType::Q6K, "matmul")), None);
        let d = HostPlan {
            lacking: Some(GgmlType::Q6K),
            ..HostPlan::default()
        };
        assert_eq!(d.backend_name(1), "cuda:1-lacking-q6_k");
        assert_eq!(
            HostPlan::parse_name("cuda:1-lacking-q6_k"),
            Some((1, Some(GgmlType::Q6K)))
        );
        assert_eq!(HostPlan::parse_name("cuda:3"), Some((3, None)));
        assert_eq!(HostPlan::parse_name("cuda:x"), None);
        assert_eq!(HostPlan::parse_name("cuda:0-lacking-zz"), None);
        assert!(matches!(
            d.support(&op(None, GgmlType::Q6K, "matmul")),
            Some(Support::Fallback { .. })
        ));
        assert_eq!(d.support(&op(None, GgmlType::Q6K, "get_rows")), None);
    }
}
