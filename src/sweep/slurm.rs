//! `--emit slurm`: a Slurm array job with one task per run. Task i reads line i+1 of
//! `<output>/specs.txt` and runs `attnlab train SPEC --quiet` on it: on one GPU, or data-parallel
//! on `nodes` × `gpus_per_node` GPUs (one `srun` task per GPU, ranks from Slurm's variables). Nothing
//! is launched here.
use super::{write_specs, SweepPlan};
use crate::{IoContext, Result};
use std::path::{Path, PathBuf};

/// GPUs of one run: `nodes` × `gpus_per_node` (1 × 1 = the single-GPU array job).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunShape {
    pub nodes: usize,
    pub gpus_per_node: usize,
}

impl Default for RunShape {
    fn default() -> Self {
        RunShape { nodes: 1, gpus_per_node: 1 }
    }
}

/// Write the resolved specs, `<output>/specs.txt` and `<output>/sweep.sbatch`; returns the script path.
pub(super) fn emit(plan: &SweepPlan, exe: &Path, cwd: &Path, shape: RunShape) -> Result<PathBuf> {
    write_specs(plan)?;
    std::fs::create_dir_all(&plan.output).at(&plan.output)?;
    let list = plan.output.join("specs.txt");
    let lines: String = plan.runs.iter().map(|r| format!("{}\n", r.spec_path.display())).collect();
    std::fs::write(&list, lines).at(&list)?;
    let script = plan.output.join("sweep.sbatch");
    std::fs::write(&script, sbatch_script(plan, exe, cwd, shape)).at(&script)?;
    Ok(script)
}

/// The sbatch script for `plan`. Spec paths (and the data and run directories inside the specs)
/// are relative to `cwd`, the directory the sweep was planned in, so the job changes to it first.
pub fn sbatch_script(plan: &SweepPlan, exe: &Path, cwd: &Path, shape: RunShape) -> String {
    let out = cwd.join(&plan.output);
    let (nodes, g) = (shape.nodes.max(1), shape.gpus_per_node.max(1));
    // All runs of a sweep share the base, so one subcommand (train or linearize) serves them all.
    let command = plan.runs.first().map(|r| r.spec.command()).unwrap_or("train");
    let world = nodes * g;
    // Data-parallel runs: one srun task per GPU; attnlab reads the torchrun-style variables set
    // here and keeps each task on GPU LOCAL_RANK. The first failing task ends the job step.
    let (resources, run) = if world == 1 {
        ("#SBATCH --gres=gpu:1".to_string(), format!(r#"exec "$ATTNLAB" {command} "$SPEC" --quiet"#))
    } else {
        (
            format!("#SBATCH --nodes={nodes}\n#SBATCH --ntasks-per-node={g}\n#SBATCH --gres=gpu:{g}"),
            format!(
                r#"# {world} data-parallel workers ({nodes} node(s) x {g} GPU(s)); rank 0 on the first node hosts the
# rendezvous. Run directories must be on a file system every node sees (resume reads checkpoints).
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export ATTNLAB SPEC
srun --kill-on-bad-exit=1 bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE={g} exec "$ATTNLAB" {command} "$SPEC" --quiet'"#
            ),
        )
    };
    let job = plan.file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "attnlab-sweep".into());
    let n = plan.runs.len();
    format!(
        r#"#!/bin/bash
# attnlab sweep {file}: {n} runs, one array task ({world} GPU(s)) each.
# Written by `attnlab sweep --emit slurm`. Submit with: sbatch {script}
# Add the partition, time limit and account your cluster needs (#SBATCH -p / -t / -A).
# Re-submitting is safe: finished runs exit at once, interrupted ones resume.
#SBATCH --job-name={job}
#SBATCH --array=0-{last}
{resources}
#SBATCH --output={log}
set -euo pipefail
cd {cwd}
ATTNLAB=${{ATTNLAB:-{exe}}}
SPEC=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {list})
echo "task $SLURM_ARRAY_TASK_ID: $SPEC"
{run}
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
    )
}

/// A path as one single-quoted shell word.
fn quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}
