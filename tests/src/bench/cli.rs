//! A benchmark's command line and where its results go.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};

/// The benchmark's arguments; anything it does not know (cargo passes `--bench`) is
/// ignored.
pub struct Args(Vec<String>);

impl Args {
    pub fn from_env() -> Args {
        Args(std::env::args().collect())
    }

    pub fn flag(&self, flag: &str) -> bool {
        self.0.iter().any(|a| a == flag)
    }

    /// The value after `flag`, if `flag` is given.
    pub fn value(&self, flag: &str) -> Result<Option<&str>> {
        self.0
            .iter()
            .position(|a| a == flag)
            .map(|i| {
                self.0
                    .get(i + 1)
                    .map(String::as_str)
                    .ok_or_else(|| anyhow!("{flag} needs a value"))
            })
            .transpose()
    }

    /// `--sizes 10,1000`, if given.
    pub fn sizes(&self) -> Result<Option<Vec<u32>>> {
        self.value("--sizes")?
            .map(|sizes| {
                sizes
                    .split(',')
                    .map(|s| s.trim().parse().with_context(|| format!("--sizes: {s:?}")))
                    .collect()
            })
            .transpose()
    }

    /// A number after `flag`, if given.
    pub fn number(&self, flag: &str) -> Result<Option<usize>> {
        self.value(flag)?
            .map(|v| v.parse().with_context(|| format!("{flag}: {v:?}")))
            .transpose()
    }

    /// `--sizes`, `--rounds` and `--threads` over a bench's defaults, checked.
    pub fn overrides(
        &self,
        sizes: &mut Vec<u32>,
        rounds: &mut usize,
        threads: &mut usize,
    ) -> Result<()> {
        if let Some(s) = self.sizes()? {
            *sizes = s;
        }
        if let Some(r) = self.number("--rounds")? {
            *rounds = r;
        }
        if let Some(t) = self.number("--threads")? {
            *threads = t;
        }
        if sizes.contains(&0) || *rounds == 0 || !(1..=64).contains(threads) {
            bail!("sizes and rounds must be positive and threads within 1..=64");
        }
        Ok(())
    }

    /// `--out DIR`, by default the workspace's bench/results (cargo runs a bench in its
    /// package's directory, tests/, so a relative default would land in tests/).
    pub fn out_dir(&self) -> Result<PathBuf> {
        Ok(self.value("--out")?.map_or_else(
            || Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/results"),
            PathBuf::from,
        ))
    }
}

/// Runs a benchmark's `run`, and on an error says so and exits with 1.
pub fn main_with(bench: &str, run: impl FnOnce(&Args) -> Result<()>) {
    if let Err(e) = run(&Args::from_env()) {
        eprintln!("{bench} benchmark failed: {e:#}");
        std::process::exit(1);
    }
}

/// Prints `markdown` and writes it and `json` to `<out_dir>/<stem>.md` and `.json`.
pub fn write_results(
    out_dir: &Path,
    stem: &str,
    markdown: &str,
    json: &serde_json::Value,
) -> Result<()> {
    println!("{markdown}");
    std::fs::create_dir_all(out_dir).with_context(|| format!("create {}", out_dir.display()))?;
    let md_path = out_dir.join(format!("{stem}.md"));
    std::fs::write(&md_path, markdown).with_context(|| format!("write {}", md_path.display()))?;
    let json_path = out_dir.join(format!("{stem}.json"));
    let json = serde_json::to_string_pretty(json)?;
    std::fs::write(&json_path, json + "\n")
        .with_context(|| format!("write {}", json_path.display()))?;
    eprintln!("wrote {} and {}", md_path.display(), json_path.display());
    Ok(())
}
