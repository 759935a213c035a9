//! GPU power and energy through NVML, loaded at run time: absent NVML is a clear "n/a", never a
//! guess. (CPU power is not read anywhere: neither machine this was built on exposes RAPL.)

use std::ffi::OsStr;

use nvml_wrapper::Nvml;

/// Reads one GPU's power draw and its energy counter.
pub struct PowerMeter {
    nvml: Nvml,
    index: u32,
    /// Device name as NVML reports it.
    pub name: String,
}

/// Where NVML is looked for, in order: the loader path, then the folder NVIDIA's container
/// runtime mounts it in.
const NVML_PATHS: &[&str] = &[
    "libnvidia-ml.so.1",
    "libnvidia-ml.so",
    "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
];

impl PowerMeter {
    /// Open NVML and device `index`. The error says why power cannot be read (report it as
    /// "n/a: <why>").
    pub fn open(index: u32) -> Result<PowerMeter, String> {
        let mut why = Vec::new();
        for p in NVML_PATHS {
            match Nvml::builder().lib_path(OsStr::new(p)).init() {
                Ok(nvml) => {
                    let name = match nvml.device_by_index(index) {
                        Ok(d) => d.name().unwrap_or_else(|_| "?".into()),
                        Err(e) => return Err(format!("NVML has no device {index}: {e}")),
                    };
                    return Ok(PowerMeter { nvml, index, name });
                }
                Err(e) => why.push(format!("{p}: {e}")),
            }
        }
        Err(format!("NVML not found ({})", why.join("; ")))
    }

    /// Power draw now, in watts.
    pub fn power_w(&self) -> Result<f64, String> {
        let d = self
            .nvml
            .device_by_index(self.index)
            .map_err(|e| e.to_string())?;
        d.power_usage()
            .map(|mw| mw as f64 / 1000.0)
            .map_err(|e| e.to_string())
    }

    /// Energy used since the driver loaded, in joules (difference two readings for an interval).
    pub fn energy_j(&self) -> Result<f64, String> {
        let d = self
            .nvml
            .device_by_index(self.index)
            .map_err(|e| e.to_string())?;
        d.total_energy_consumption()
            .map(|mj| mj as f64 / 1000.0)
            .map_err(|e| e.to_string())
    }
}
