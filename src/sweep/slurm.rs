//! `--emit slurm`: a Slurm array job with one task (one GPU) per run. Task i reads line i+1 of
//! `<output>/specs.txt` and runs `attnlab train SPEC --quiet` on it. Nothing is launched here.
use super::{write_specs, SweepPlan};
use crate::{IoContext, Result};
use std::path::{Path, PathBuf};

/// Write the resolved specs, `<output>/specs.txt` and `<output>/sweep.sbatch`; returns the script path.
pub(super) fn emit(plan: &SweepPlan, exe: &Path, cwd: &Path) -> Result<PathBuf> {
    write_specs(plan)?;
    std::fs::create_dir_all(&plan.output).at(&plan.output)?;
    let list = plan.output.join("specs.txt");
    let lines: String = plan.runs.iter().map(|r| format!("{}\n", r.spec_path.display())).collect();
    std::fs::write(&list, lines).at(&list)?;
    let script = plan.output.join("sweep.sbatch");
    std::fs::write(&script, sbatch_script(plan, exe, cwd)).at(&script)?;
    Ok(script)
}

/// The sbatch script for `plan`. Spec paths (and the data and run directories inside the specs)
/// are relative to `cwd`, the directory the sweep was planned in, so the job changes to it first.
pub fn sbatch_script(plan: &SweepPlan, exe: &Path, cwd: &Path) -> String {
    let out = cwd.join(&plan.output);
    let job = plan.file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "attnlab-sweep".into());
    let n = plan.runs.len();
    format!(
        r#"#!/bin/bash
# attnlab sweep {file}: {n} runs, one array task (one GPU) each.
# Written by `attnlab sweep --emit slurm`. Submit with: sbatch {script}
# Add the partition, time limit and account your cluster needs (#SBATCH -p / -t / -A).
# Re-submitting is safe: finished runs exit at once, interrupted ones resume.
#SBATCH --job-name={job}
#SBATCH --array=0-{last}
#SBATCH --gres=gpu:1
#SBATCH --output={log}
set -euo pipefail
cd {cwd}
ATTNLAB=${{ATTNLAB:-{exe}}}
SPEC=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {list})
echo "task $SLURM_ARRAY_TASK_ID: $SPEC"
exec "$ATTNLAB" {command} "$SPEC" --quiet
"#,
        file = plan.file.display(),
        script = quote(&out.join("sweep.sbatch")),
        job = job.replace(|c: char| c.is_whitespace(), "_"),
        last = n.saturating_sub(1),
        // #SBATCH lines are not shell: no quoting there.
        log = out.join("slurm-%A_%a.out").display(),
        cwd = quote(cwd),
        exe = quote(exe),
        list = quote(&out.join("specs.txt")),
        command = plan.runs.first().map(|r| r.spec.command()).unwrap_or("train"),
    )
}

/// A path as one single-quoted shell word.
fn quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}
