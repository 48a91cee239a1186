//! Sweeps: one YAML file names a base experiment spec and the axes to vary; `attnlab sweep` expands
//! it into runs, gives each its own run directory and launches `attnlab train` on each (one per GPU,
//! or sequentially, or as a Slurm array).
//!
//! ## The sweep file
//!
//! ```yaml
//! base: ../experiments/pythia-70m-dar.yaml   # the spec every run starts from (relative to this file)
//! output: results/table1                     # sweep output folder (relative to the current directory)
//! name: "{attention.kind}-d{attention.d_down}-w{attention.window}"   # run name template
//! set: {train.steps: 100}                    # overrides for every run
//! grid: {attention.d_down: [256, 128, 64]}   # Cartesian product over these lists
//! zip: {train.seed: [1, 2], train.lr: [1.0e-3, 6.0e-4]}   # lock-step lists (same length)
//! seeds: [1, 2, 3]                           # optional: every run once per train.seed, seed-major (names get -s<seed>)
//! runs:                                      # optional; default: one empty entry
//!   - {name: "vanilla", attention.kind: vanilla, attention.d_down: null, attention.window: null}
//!   - {attention.kind: dar}
//!   - {attention.kind: uniform, attention.window: null, grid: {attention.d_down: [32, 16]}}
//! ```
//!
//! * Keys of `set`, `grid`, `zip` and `runs` entries are dotted paths into the spec (as `--set`);
//!   values are YAML. A `null` value deletes the key, so the spec's default (or nothing, e.g. no
//!   `d_down` for vanilla) applies.
//! * Runs = `runs` entries × top-level points × the entry's own points, where the points of a
//!   level are `grid` (Cartesian product, first key slowest) × `zip` (the i-th value of every list).
//!   In a `runs` entry, `name`, `grid` and `zip` are reserved: they give that entry its own name
//!   template and axes; every other key is an override.
//! * Precedence, lowest first: base spec < `set` < top-level `grid`/`zip` < the entry's overrides <
//!   the entry's `grid`/`zip` < `attnlab sweep --set`. So an entry can undo an axis (vanilla with
//!   `attention.d_down: null` under a top-level d_down grid).
//! * Every run is resolved and validated like `attnlab train` (errors name the sweep file, the run
//!   and the key). Runs whose resolved configs are identical are merged (the first one is kept).
//! * Names: `{dotted.path}` placeholders are filled from the *resolved* spec, so defaults count
//!   (`d{attention.d_down}` renders `d128` for a 70M DAR run that set no d_down). A placeholder
//!   with no value (d_down of vanilla) is an error: give that entry its own `name:`. Names must be
//!   unique within a sweep. The spec's own `name:` and `output:` are always set by the sweep.
//!
//! ## What a sweep writes
//!
//! ```text
//! <output>/<name>-<hash>/        run directory (hash = crate::util::short_hash of the resolved
//!                                config without name/output): same config → same folder, so a
//!                                re-launch skips DONE runs, resumes partial ones, and a changed
//!                                config gets a new folder
//! <output>/<name>-<hash>/train.log   the child's stdout + stderr (appended on every launch)
//!                                (with --gpus: CUDA_VISIBLE_DEVICES=<gpu>, --set train.device=cuda:0;
//!                                a partial run resumes with the train.device its config.yaml records)
//! <output>/specs/<name>-<hash>.yaml  the resolved spec the child runs (`attnlab train FILE --quiet`)
//! <output>/specs.txt, sweep.sbatch   with `--emit slurm` only
//! ```
pub mod compare;
mod launch;
mod plan;
mod slurm;
#[cfg(test)]
mod tests;

pub use plan::{apply, plan, remove_path, render, PlannedRun, RunSpec, SweepPlan};
pub use slurm::{sbatch_script, RunShape};

use crate::{IoContext, Result};
use std::path::{Path, PathBuf};

/// How `attnlab sweep` runs a sweep (the CLI flags).
#[derive(Debug, Clone, Default)]
pub struct SweepOptions {
    /// Print the table of runs (name, overrides, run dir, status) and do nothing else.
    pub dry_run: bool,
    /// GPUs to spread runs over, one run per GPU at a time (CUDA_VISIBLE_DEVICES values).
    pub gpus: Vec<String>,
    /// Without GPUs: how many CPU runs at once (0 or 1 = sequential).
    pub max_parallel: usize,
    /// Write a batch-system script instead of running anything.
    pub emit: Option<Emit>,
    /// `key=value` overrides applied to every run, after the sweep file's own.
    pub sets: Vec<String>,
    /// Replace the sweep file's `output:`.
    pub out: Option<PathBuf>,
    /// The `attnlab` executable for child runs (default: the current executable).
    pub exe: Option<PathBuf>,
    /// With `emit`: GPUs (and nodes) of each run; more than one makes every run data-parallel.
    pub shape: RunShape,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// `<output>/sweep.sbatch`: a Slurm array job, one task (one GPU) per run.
    Slurm,
}

/// State of a run directory on disk (`RunStatus::of`: DONE, or a config.yaml `train` resumes).
pub use crate::runs::Status as RunStatus;

/// What the sweep did with a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing launched (dry run, or a script was emitted).
    Planned,
    /// Already DONE: not launched.
    Skipped,
    /// Launched and exited 0.
    Trained,
    /// Launched and failed (non-zero exit, or could not start).
    Failed,
    /// Not launched (or refused at once): another process holds the run directory's lock.
    Busy,
    /// Launched and stopped by a SIGINT / SIGTERM the sweep passed on (last checkpoint kept).
    Stopped,
}

#[derive(Debug, Clone)]
pub struct RunReport {
    pub name: String,
    pub dir: PathBuf,
    pub overrides: String,
    /// "steps × batch × T" of a training run (empty for linearize runs): what the dry run shows.
    pub shape: String,
    /// The run directory's state before the sweep acted.
    pub before: RunStatus,
    pub outcome: Outcome,
    pub exit: Option<i32>,
    pub wall_s: Option<f64>,
    /// Last training loss in metrics.jsonl.
    pub final_loss: Option<f64>,
    /// `<run dir>/train.log`, when the run was launched.
    pub log: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct SweepSummary {
    pub output: PathBuf,
    pub runs: Vec<RunReport>,
    pub merged_duplicates: usize,
    /// `<output>/sweep.sbatch` when a script was emitted.
    pub script: Option<PathBuf>,
}

impl SweepSummary {
    pub fn failed(&self) -> usize {
        self.count(Outcome::Failed)
    }

    pub fn count(&self, outcome: Outcome) -> usize {
        self.runs.iter().filter(|r| r.outcome == outcome).count()
    }
}

/// Expand `file` and run it as `opts` says; prints the run table (dry run) or a summary table at
/// the end. Failed runs do not stop the others: check `SweepSummary::failed()`.
pub fn run_sweep(file: &Path, opts: &SweepOptions) -> Result<SweepSummary> {
    let plan = plan::plan(file, &opts.sets, opts.out.as_deref())?;
    let exe = match &opts.exe {
        Some(e) => e.clone(),
        None => std::env::current_exe().map_err(|e| crate::Error::Other(format!("cannot locate the attnlab executable: {e}")))?,
    };
    let planned = |outcome| plan.runs.iter().map(|r| report(r, outcome)).collect::<Vec<_>>();
    let mut summary = SweepSummary { output: plan.output.clone(), runs: Vec::new(), merged_duplicates: plan.merged_duplicates, script: None };
    println!("{}", headline(&plan));
    if opts.dry_run {
        summary.runs = planned(Outcome::Planned);
        print!("{}", plan_table(&summary.runs));
        return Ok(summary);
    }
    if let Some(Emit::Slurm) = opts.emit {
        let cwd = std::env::current_dir().map_err(|e| crate::Error::io(".", e))?;
        if opts.shape.nodes * opts.shape.gpus_per_node > 1 && plan.runs.iter().any(|r| r.spec.command() != "train") {
            return Err(crate::Error::Other(format!("{}: only `attnlab train` runs data-parallel; emit linearize sweeps with one GPU per run", file.display())));
        }
        let script = slurm::emit(&plan, &exe, &cwd, opts.shape)?;
        summary.runs = planned(Outcome::Planned);
        print!("{}", plan_table(&summary.runs));
        println!("wrote {} ({} array tasks; specs in {})", script.display(), plan.runs.len(), plan.output.join("specs").display());
        println!("submit with: sbatch {}", script.display());
        summary.script = Some(script);
        return Ok(summary);
    }
    write_specs(&plan)?;
    summary.runs = launch::run_all(&plan, opts, &exe);
    print!("{}", summary_table(&summary.runs));
    if summary.count(Outcome::Busy) > 0 {
        println!("{} run(s) busy: another process is writing them (not launched; run the sweep again once it is done)", summary.count(Outcome::Busy));
    }
    if let Some(sig) = launch::stopped_by() {
        return Err(crate::Error::Other(format!(
            "sweep stopped by signal {sig}: {} run(s) stopped (their last checkpoints kept), {} not started; run the sweep again to finish them",
            summary.count(Outcome::Stopped),
            summary.count(Outcome::Planned)
        )));
    }
    if summary.failed() > 0 {
        println!("{} of {} runs failed; their logs:", summary.failed(), summary.runs.len());
        for r in summary.runs.iter().filter(|r| r.outcome == Outcome::Failed) {
            println!("  {}: {}", r.name, r.log.as_ref().map(|l| l.display().to_string()).unwrap_or_default());
        }
    }
    Ok(summary)
}

/// `attnlab sweep`: `run_sweep`, refusing a run shape (`--gpus-per-run`, `--nodes`) without a batch
/// script to give it to, and failing when any run failed (their logs are listed by then).
pub fn sweep_command(file: &Path, opts: &SweepOptions) -> Result<SweepSummary> {
    if (opts.shape.gpus_per_node > 1 || opts.shape.nodes > 1) && opts.emit.is_none() {
        return Err(crate::Error::Other("--gpus-per-run / --nodes shape the runs of an emitted batch script (--emit slurm); a local sweep runs one GPU per run (or `attnlab train --gpus` for one data-parallel run)".into()));
    }
    let summary = run_sweep(file, opts)?;
    if summary.failed() > 0 {
        return Err(crate::Error::Other(format!("{} of {} runs failed (logs listed above)", summary.failed(), summary.runs.len())));
    }
    Ok(summary)
}

/// Write every run's resolved spec to `<output>/specs/<id>.yaml` (what the child runs).
pub fn write_specs(plan: &SweepPlan) -> Result<()> {
    for r in &plan.runs {
        if let Some(parent) = r.spec_path.parent() {
            std::fs::create_dir_all(parent).at(parent)?;
        }
        let text = format!("# run `{}` of sweep {} (base {}); resolved: run it with `attnlab {} THIS_FILE`\n{}", r.name, plan.file.display(), plan.base.display(), r.spec.command(), r.spec.to_yaml());
        std::fs::write(&r.spec_path, text).at(&r.spec_path)?;
    }
    Ok(())
}

fn report(r: &PlannedRun, outcome: Outcome) -> RunReport {
    RunReport {
        name: r.name.clone(),
        dir: r.dir.clone(),
        overrides: r.overrides.clone(),
        shape: r.spec.as_train().map_or(String::new(), |s| format!("{} × {} × {}", s.steps(), s.batch_size(), s.seq_len())),
        before: RunStatus::of(&r.dir),
        outcome,
        exit: None,
        wall_s: None,
        final_loss: final_loss(&r.dir),
        log: None,
    }
}

fn headline(plan: &SweepPlan) -> String {
    let merged = match plan.merged_duplicates {
        0 => String::new(),
        n => format!(" ({n} duplicate config{} merged)", if n == 1 { "" } else { "s" }),
    };
    format!("sweep {}: {} runs{merged} → {}", plan.file.display(), plan.runs.len(), plan.output.display())
}

/// The last training loss logged in `<dir>/metrics.jsonl` (eval rows have no `loss` key).
pub fn final_loss(dir: &Path) -> Option<f64> {
    let rows = crate::train::metrics::read(&dir.join("metrics.jsonl")).ok()?.rows;
    rows.iter().rev().find_map(|(_, v)| v.get("loss").and_then(|l| l.as_f64()))
}

/// The dry-run table: name, overrides, run dir, status.
pub fn plan_table(runs: &[RunReport]) -> String {
    let status = |r: &RunReport| match crate::train::lock::holder(&r.dir) {
        Some(h) if r.before != RunStatus::Done => format!("{} (busy: {h})", r.before.name()),
        _ => r.before.name().to_string(),
    };
    let rows: Vec<Vec<String>> = runs.iter().map(|r| vec![r.name.clone(), r.overrides.clone(), r.shape.clone(), r.dir.display().to_string(), status(r)]).collect();
    table(&["name", "overrides", "steps × batch × T", "run dir", "status"], &rows)
}

/// The end-of-sweep table: name, status, exit, wall time, final loss.
pub fn summary_table(runs: &[RunReport]) -> String {
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            let status = match r.outcome {
                Outcome::Planned => r.before.name(),
                Outcome::Skipped => "done (skipped)",
                Outcome::Trained if r.before == RunStatus::Partial => "resumed, done",
                Outcome::Trained => "done",
                Outcome::Failed => "FAILED",
                Outcome::Busy => "busy (another process)",
                Outcome::Stopped => "stopped (signal)",
            };
            vec![
                r.name.clone(),
                status.into(),
                r.exit.map_or("-".into(), |c| c.to_string()),
                r.wall_s.map_or("-".into(), |s| format!("{s:.1}s")),
                r.final_loss.map_or("-".into(), |l| format!("{l:.4}")),
            ]
        })
        .collect();
    table(&["name", "status", "exit", "wall", "final loss"], &rows)
}

/// Left-aligned columns separated by two spaces.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    crate::runs::columns(header, rows, false)
}
