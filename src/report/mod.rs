//! `attnlab report RESULTS_DIR`: every run directory below RESULTS_DIR → runs.parquet, the DAR
//! paper's Tables 1–3 next to the paper's numbers (Markdown / LaTeX / CSV), Figure 3 (Rel.(%) vs
//! step), loss by window position, loss and perplexity curves (PNG + SVG), and report.md tying them together and saying
//! which rows are missing and why.
//!
//! load (run dirs → Run) → groups (which runs compare: same scale and recipe) → tables (rows, Rel.%)
//! → render (md/tex/csv); frame (polars → parquet); figures + plots (plotters); document (report.md).
pub mod document;
pub mod downstream;
pub mod figures;
pub mod frame;
pub mod groups;
pub mod load;
pub mod longctx;
pub mod paired;
pub mod paper;
/// The line charts (`src/plots.rs`, below eval: `bench-decode` draws with them too).
pub use crate::plots;
pub mod recall;
pub mod ruler_arms;
pub mod render;
pub mod stats;
pub mod tables;

#[cfg(test)]
mod tests;

pub use tables::{rel, Unit};

use crate::{Error, IoContext, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What a report produced (for the command line) — report.md has the details.
#[derive(Debug)]
pub struct ReportSummary {
    pub report: PathBuf,
    pub runs: usize,
    pub finished: usize,
    /// Folders with a config.yaml that could not be read.
    pub skipped: usize,
    /// (title, rows with results, rows).
    pub tables: Vec<(String, usize, usize)>,
    /// One line per table row without a result, with the reason.
    pub missing: Vec<String>,
    /// Every file written.
    pub files: Vec<PathBuf>,
}

impl std::fmt::Display for ReportSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} runs ({} finished{}) → {}",
            self.runs,
            self.finished,
            if self.skipped > 0 { format!(", {} unreadable", self.skipped) } else { String::new() },
            self.report.display()
        )?;
        for (title, filled, rows) in &self.tables {
            writeln!(f, "  {title}: {filled}/{rows} rows")?;
        }
        if !self.missing.is_empty() {
            writeln!(f, "  {} rows missing (listed in report.md)", self.missing.len())?;
        }
        write!(f, "  {} files written", self.files.len())
    }
}

const FORMATS: [&str; 3] = ["md", "tex", "csv"];

/// Table file formats from `--format md,tex,csv` (repeated flags and commas both work).
fn parse_formats(formats: &[String]) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for f in formats.iter().flat_map(|f| f.split(',')).map(|f| f.trim().to_ascii_lowercase()).filter(|f| !f.is_empty()) {
        if !FORMATS.contains(&f.as_str()) {
            return Err(Error::Other(format!("--format `{f}`: want a comma-separated list of md, tex, csv")));
        }
        if !out.contains(&f) {
            out.push(f);
        }
    }
    Ok(out)
}

fn write_file(path: &Path, text: &str, files: &mut Vec<PathBuf>) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).at(dir)?;
    }
    std::fs::write(path, text).at(path)?;
    files.push(path.to_path_buf());
    Ok(())
}

/// Build the report of every run below `results_dir` into `out`. `formats`: table files to write
/// (md, tex, csv; report.md is always written); `unit`: `word` or `token` perplexity for the tables.
pub fn run_report(results_dir: &Path, out: &Path, formats: &[String], unit: &str) -> Result<ReportSummary> {
    let unit = Unit::parse(unit).ok_or_else(|| Error::Other(format!("--unit `{unit}`: want word or token")))?;
    let formats = parse_formats(formats)?;
    let (runs, skipped) = load::discover(results_dir)?;
    std::fs::create_dir_all(out).at(out)?;
    let mut files = Vec::new();

    let mut df = frame::build(&runs)?;
    let parquet = out.join("runs.parquet");
    frame::write_parquet(&mut df, &parquet)?;
    files.push(parquet);

    let tables = tables::build(&runs, &paper::dar()?, unit);
    let mut table_files: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for t in &tables {
        for f in &formats {
            let text = match f.as_str() {
                "md" => render::markdown_file(t),
                "tex" => render::latex(t),
                _ => render::csv(t),
            };
            let rel = PathBuf::from(format!("tables/{}.{f}", t.id));
            write_file(&out.join(&rel), &text, &mut files)?;
            table_files.entry(t.id.clone()).or_default().push(rel);
            if !t.pairs.is_empty() {
                let rel = PathBuf::from(format!("tables/{}-paired.{f}", t.id));
                write_file(&out.join(&rel), &render::paired_file(t, f), &mut files)?;
                table_files.entry(format!("{}-paired", t.id)).or_default().push(rel);
            }
        }
    }

    // RULER / BABILong scores and STILL's ablations (also of linearized runs, which `runs` lacks).
    let mut long = longctx::build(&longctx::discover(results_dir)?, &paper::still()?);
    // The recall test and RULER scores pooled over seeds by arm, with paired differences between arms.
    long.extend(recall::build(&runs));
    long.extend(ruler_arms::build(&runs));
    // Recall learning curves (scored while training) and capacity (codes right vs facts).
    let (curves, mut recall_figs) = recall::curves(&runs, out)?;
    let (capacity, capacity_figs) = recall::capacity(&runs, out)?;
    long.extend(curves.into_iter().chain(capacity));
    recall_figs.extend(capacity_figs);
    for g in &long {
        for f in &formats {
            let rel = PathBuf::from(format!("tables/{}.{f}", g.id));
            write_file(&out.join(&rel), &g.render(f), &mut files)?;
            table_files.entry(g.id.clone()).or_default().push(rel);
        }
    }

    let (mut figure3, mut sweeps, mut per_run, mut by_position) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let all: Vec<&load::Run> = runs.iter().collect();
    for (key, members) in groups::by_recipe(&all) {
        figure3.extend(figures::figure3(&key, &members, out, unit)?);
        by_position.extend(figures::position_figures(&key, &members, out)?);
        if members.len() > 1 {
            sweeps.extend(figures::sweep_figures(&key, &members, out, unit)?);
        }
    }
    for r in &runs {
        per_run.extend(figures::run_figures(r, out, unit)?);
    }
    for f in figure3.iter().chain(&by_position).chain(&recall_figs).chain(&sweeps).chain(&per_run) {
        files.extend(f.files.iter().map(|p| out.join(p)));
    }

    let text = document::write(&document::Inputs {
        results_dir,
        runs: &runs,
        skipped: &skipped,
        tables: &tables,
        long: &long,
        table_files: &table_files,
        figure3: &figure3,
        by_position: &by_position,
        recall: &recall_figs,
        sweeps: &sweeps,
        per_run: &per_run,
        unit,
    });
    // The downstream table (DAR Table 4) from every run's tasks/*.json.
    let down = downstream::build(&downstream::collect(results_dir)?, &downstream::paper()?);
    let mut down_files: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for t in &down {
        for f in formats.iter().filter(|f| *f != "tex") {
            let rel = PathBuf::from(format!("tables/{}.{f}", t.id));
            write_file(&out.join(&rel), &if f == "md" { downstream::markdown(t) } else { downstream::csv(t) }, &mut files)?;
            down_files.entry(t.id.clone()).or_default().push(rel);
        }
    }
    let text = text + &downstream::section(&down, &down_files);
    let report = out.join("report.md");
    write_file(&report, &text, &mut files)?;
    Ok(ReportSummary {
        report,
        runs: runs.len(),
        finished: runs.iter().filter(|r| r.done).count(),
        skipped: skipped.len(),
        tables: tables
            .iter()
            .map(|t| (t.title.clone(), t.filled(), t.rows.len()))
            .chain(long.iter().map(|g| (g.title.clone(), g.filled(), g.rows)))
            .chain(down.iter().map(|t| (t.title.clone(), t.rows.len(), t.rows.len())))
            .collect(),
        missing: tables.iter().flat_map(|t| t.missing()).chain(long.iter().flat_map(|g| g.missing.clone())).collect(),
        files,
    })
}
