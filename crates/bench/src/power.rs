//! Energy counters: NVML on NVIDIA GPUs, RAPL (`/sys/class/powercap`) on the CPU package.
//!
//! A run's energy is the difference of a cumulative counter read before and after it; its mean
//! power is that energy over the run's wall time. Where no counter can be read, the source says
//! why ("n/a (no RAPL here)") and the tables print that instead of a number: nothing is ever
//! estimated.

use std::fs;
use std::path::{Path, PathBuf};

/// A cumulative energy counter.
pub trait EnergyCounter: Send {
    /// What it measures (`RAPL package-0`, `NVML NVIDIA H200`).
    fn describe(&self) -> String;
    /// Energy since some fixed origin, in joules. Readings only ever go up; a counter that wraps
    /// must hide it (see [`Rapl`]).
    fn read_j(&mut self) -> Result<f64, String>;
}

/// Where a backend's energy comes from, or why there is none.
pub enum PowerSource {
    Counter(Box<dyn EnergyCounter>),
    Unavailable(String),
}

impl PowerSource {
    /// The source for the backend named `name`: `cuda:N` reads NVML device N; `cpu...` reads
    /// RAPL under `/sys/class/powercap`; anything else has none.
    pub fn for_backend(name: &str) -> PowerSource {
        if name.starts_with("cuda:") {
            // `cuda:N`, or a test double `cuda:N-lacking-TYPE` on the same device.
            return match cuda::HostPlan::parse_name(name).map(|(d, _)| d as u32) {
                Some(i) => match cuda::power::PowerMeter::open(i) {
                    Ok(m) => PowerSource::Counter(Box::new(Nvml(m))),
                    Err(why) => PowerSource::Unavailable(format!("n/a ({why})")),
                },
                None => PowerSource::Unavailable(format!("n/a (no device index in {name})")),
            };
        }
        if name.starts_with("cpu") {
            return match Rapl::open(Path::new(RAPL_ROOT)) {
                Ok(r) => PowerSource::Counter(Box::new(r)),
                Err(why) => PowerSource::Unavailable(why),
            };
        }
        PowerSource::Unavailable(format!("n/a (no energy counter for {name})"))
    }

    /// Read the counter; `Err` carries the "n/a (...)" text.
    pub fn read_j(&mut self) -> Result<f64, String> {
        match self {
            PowerSource::Counter(c) => c.read_j().map_err(|e| format!("n/a ({e})")),
            PowerSource::Unavailable(why) => Err(why.clone()),
        }
    }

    /// What it measures, or why nothing.
    pub fn describe(&self) -> String {
        match self {
            PowerSource::Counter(c) => c.describe(),
            PowerSource::Unavailable(why) => why.clone(),
        }
    }
}

/// NVML's total-energy counter of one GPU (millijoules since the driver loaded).
pub struct Nvml(pub cuda::power::PowerMeter);

impl EnergyCounter for Nvml {
    fn describe(&self) -> String {
        format!("NVML {}", self.0.name)
    }
    fn read_j(&mut self) -> Result<f64, String> {
        self.0.energy_j()
    }
}

/// Where the kernel exposes RAPL.
pub const RAPL_ROOT: &str = "/sys/class/powercap";

/// One RAPL zone's counter file and its wrap range.
struct Zone {
    name: String,
    energy: PathBuf,
    max_uj: u64,
    last_uj: u64,
    /// Microjoules accumulated over wraps.
    total_uj: u128,
}

/// The CPU packages' RAPL energy counters (`intel-rapl:N` top-level zones, summed over
/// sockets). The `energy_uj` counters wrap at `max_energy_range_uj`; readings are unwrapped, so
/// two reads must not be more than one wrap apart (minutes on any CPU).
pub struct Rapl {
    zones: Vec<Zone>,
}

fn read_u64(p: &Path) -> Result<u64, String> {
    let s = fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
    s.trim()
        .parse()
        .map_err(|_| format!("{}: `{}` is not a number", p.display(), s.trim()))
}

impl Rapl {
    /// Find the package zones under `root`. The error is the table's text: "n/a (no RAPL here)"
    /// when the kernel exposes none, or the reason the counters cannot be read.
    pub fn open(root: &Path) -> Result<Rapl, String> {
        let entries = match fs::read_dir(root) {
            Ok(e) => e,
            Err(_) => return Err("n/a (no RAPL here)".into()),
        };
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    // Top-level zones only (`intel-rapl:0`, not `intel-rapl:0:1`, which are
                    // parts of the package and would be counted twice).
                    .is_some_and(|n| {
                        (n.starts_with("intel-rapl:") || n.starts_with("amd-rapl:"))
                            && n.matches(':').count() == 1
                    })
            })
            .collect();
        dirs.sort();
        if dirs.is_empty() {
            return Err("n/a (no RAPL here)".into());
        }
        let mut zones = Vec::new();
        for d in dirs {
            let name = fs::read_to_string(d.join("name"))
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| d.display().to_string());
            if !name.starts_with("package") {
                continue;
            }
            let energy = d.join("energy_uj");
            let first = read_u64(&energy).map_err(|e| format!("n/a (RAPL not readable: {e})"))?;
            let max_uj = read_u64(&d.join("max_energy_range_uj"))
                .map_err(|e| format!("n/a (RAPL not readable: {e})"))?;
            zones.push(Zone {
                name,
                energy,
                max_uj,
                last_uj: first,
                total_uj: first as u128,
            });
        }
        if zones.is_empty() {
            return Err("n/a (no RAPL package zone here)".into());
        }
        Ok(Rapl { zones })
    }
}

impl EnergyCounter for Rapl {
    fn describe(&self) -> String {
        let names: Vec<&str> = self.zones.iter().map(|z| z.name.as_str()).collect();
        format!("RAPL {}", names.join("+"))
    }

    fn read_j(&mut self) -> Result<f64, String> {
        let mut sum = 0u128;
        for z in &mut self.zones {
            let now = read_u64(&z.energy)?;
            let step = if now >= z.last_uj {
                now - z.last_uj
            } else {
                // Wrapped: the counter went through max_energy_range_uj back to 0.
                z.max_uj.saturating_sub(z.last_uj) + now
            };
            z.total_uj += step as u128;
            z.last_uj = now;
            sum += z.total_uj;
        }
        Ok(sum as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zone(root: &Path, dir: &str, name: &str, uj: u64, max: u64) {
        let d = root.join(dir);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("name"), format!("{name}\n")).unwrap();
        fs::write(d.join("energy_uj"), format!("{uj}\n")).unwrap();
        fs::write(d.join("max_energy_range_uj"), format!("{max}\n")).unwrap();
    }

    /// A powercap tree laid out as the kernel's (two packages, a sub-zone that must not be
    /// counted twice, an unrelated control type), read through a counter wrap.
    #[test]
    fn rapl_sums_packages_and_unwraps() {
        let root = std::env::temp_dir().join(format!("crossover-rapl-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        zone(&root, "intel-rapl:0", "package-0", 900_000, 1_000_000);
        zone(&root, "intel-rapl:0:0", "core", 5, 1_000_000);
        zone(&root, "intel-rapl:1", "package-1", 100, 1_000_000);
        fs::create_dir_all(root.join("dtpm")).unwrap();
        let mut r = Rapl::open(&root).unwrap();
        assert_eq!(r.describe(), "RAPL package-0+package-1");
        let e0 = r.read_j().unwrap();
        // package-0 wraps: 900000 -> 1000000 -> 0 -> 50000 = 150000 uJ; package-1 +200 uJ.
        fs::write(root.join("intel-rapl:0/energy_uj"), "50000\n").unwrap();
        fs::write(root.join("intel-rapl:1/energy_uj"), "300\n").unwrap();
        let e1 = r.read_j().unwrap();
        assert!(((e1 - e0) - 0.150_200).abs() < 1e-9, "{}", e1 - e0);
        // Unreadable counter: the reason, not a number.
        fs::write(root.join("intel-rapl:1/energy_uj"), "garbage\n").unwrap();
        assert!(r.read_j().unwrap_err().contains("not a number"));
        fs::remove_dir_all(&root).unwrap();
        let missing = Rapl::open(&root.join("nowhere")).err().unwrap();
        assert_eq!(missing, "n/a (no RAPL here)");
    }

    /// On this machine the answer must be true: a number only where the kernel exposes RAPL.
    #[test]
    fn cpu_source_matches_the_machine() {
        let has = Path::new(RAPL_ROOT).join("intel-rapl:0").exists()
            || Path::new(RAPL_ROOT).join("amd-rapl:0").exists();
        let mut s = PowerSource::for_backend("cpu");
        if !has {
            assert_eq!(s.read_j().unwrap_err(), "n/a (no RAPL here)");
        }
    }
}
