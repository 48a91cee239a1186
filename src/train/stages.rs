//! The training loop of every command: `train` is one stage of it, `finetune` and `linearize` two.
//! Stages run one after another over one VarStore, each with its own trainable parameters, AdamW
//! (fresh moments at every stage start) and learning-rate schedule (`schedule`). The loop owns the
//! optimizer step (zero grad → the task's forward/backward → data-parallel gradient average →
//! clipping → AdamW), periodic held-out evaluation (which steps a plateau schedule), metrics rows,
//! checkpoints every `checkpoint_every` updates and at every stage end, exact resume from the
//! newest complete checkpoint, the divergence stop, and the progress bar. The task says what is
//! specific: which parameters train, the loss of an update, what evaluation means.
//!
//! The host waits for the device only on logging, evaluation and checkpoint steps.
use super::checkpoint::{self, State};
use super::distributed::{Communicator, GradSync, Watchdog};
use super::optim::{AdamW, Hyper};
use super::run::RunDir;
use super::schedule::{Lr, LrState};
use crate::{Error, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{de::DeserializeOwned, Serialize};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{nn::VarStore, Kind, Tensor};

/// What a run does; stages are numbered from 1.
pub trait StagedTask {
    /// Whether parameter `name` trains in `stage`.
    fn trains(&self, stage: usize, name: &str) -> bool;
    fn hyper(&self, stage: usize) -> Hyper;
    /// Called once per session before the first update, with the global updates `from..to` this
    /// session will run (train starts its batch prefetch here).
    fn begin(&mut self, _from: u64, _to: u64) -> Result<()> {
        Ok(())
    }
    /// Forward and backward of update `step` of `stage` (0-based within the stage; gradients left
    /// on the parameters). Returns the detached loss (a device scalar: no host sync) and, when
    /// `log`, extra metrics for the row.
    fn step(&mut self, stage: usize, step: u64, log: bool) -> Result<(Tensor, Map<String, Value>)>;
    /// Held-out evaluation after update `at.done`, called every `eval_every` updates of a stage;
    /// `None` skips it.
    fn evaluate(&mut self, _stage: usize, _at: &Progress) -> Result<Option<Evaluation>> {
        Ok(None)
    }
    /// A metrics row to write at global step 0 (before any update, fresh runs only) and after the
    /// last update of each stage.
    fn at_boundary(&mut self, _global_step: u64) -> Result<Option<Map<String, Value>>> {
        Ok(None)
    }
}

/// Where the run is after an update.
pub struct Progress {
    pub done: u64,
    pub tokens: u64,
    pub elapsed_s: f64,
}

pub struct Evaluation {
    /// The held-out loss a plateau schedule steps on: logged as `val_loss`, with the `lr` that follows.
    pub val_loss: Option<f64>,
    /// The rest of the row (`step` is added when missing, `stage` on staged runs).
    pub row: Map<String, Value>,
}

pub struct StagePlan {
    pub steps: u64,
    pub lr: Lr,
    /// Evaluate every N updates of the stage (0 = never).
    pub eval_every: u64,
}

pub struct Plan {
    pub stages: Vec<StagePlan>,
    /// Gradient-norm clipping (0 = none).
    pub clip: f64,
    pub log_every: u64,
    pub checkpoint_every: u64,
    pub keep: usize,
    pub tokens_per_step: u64,
    /// Command name for the progress bar.
    pub label: &'static str,
    pub quiet: bool,
    /// Stop (as if interrupted) after this many updates in total: resume tests.
    pub stop_after: Option<u64>,
    /// Rows carry `stage` (staged commands), or the gradient norm and throughput (`train`).
    pub rows: Rows,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// `step, stage, loss, lr, tokens, elapsed_s` + the task's extras.
    Staged,
    /// `step, tokens, loss, lr, grad_norm, tokens_per_s, elapsed_s` (+ `world_size` when > 1).
    Throughput,
}

/// This process as one rank of a data-parallel job: gradients and the loss are averaged over the
/// ranks between backward and clipping; only rank 0 logs, evaluates and checkpoints.
pub struct DataParallel<'a> {
    pub comm: &'a mut dyn Communicator,
    /// Element type of the reduced gradients.
    pub grad_kind: Kind,
    pub bucket_bytes: usize,
    pub watchdog: Option<&'a Watchdog>,
}

/// How a session ended.
pub struct Ran {
    /// Updates done in total (the plan's total unless stopped early).
    pub end: u64,
    pub tokens: u64,
    pub elapsed_s: f64,
    /// Throughput over the last logging interval.
    pub tokens_per_s: f64,
}

impl Plan {
    pub fn total(&self) -> u64 {
        self.stages.iter().map(|s| s.steps).sum()
    }

    /// (stage, first global step of the stage) of global update `g`; `None` past the end.
    fn stage_of(&self, g: u64) -> Option<(usize, u64)> {
        let mut start = 0;
        for (i, s) in self.stages.iter().enumerate() {
            if g < start + s.steps {
                return Some((i + 1, start));
            }
            start += s.steps;
        }
        None
    }

    fn is_stage_end(&self, done: u64) -> bool {
        self.stages
            .iter()
            .scan(0, |acc, s| {
                *acc += s.steps;
                Some(*acc)
            })
            .any(|end| end == done)
    }
}

/// Make exactly the parameters `trains` selects trainable; an AdamW over them (sorted by name).
pub fn optimizer_over(vs: &VarStore, trains: impl Fn(&str) -> bool, hyper: Hyper) -> Option<AdamW> {
    for (name, t) in vs.variables() {
        let _ = t.shallow_clone().set_requires_grad(trains(&name));
    }
    let params = super::named_parameters(vs);
    (!params.is_empty()).then(|| AdamW::new(params, hyper))
}

/// The running stage: its optimizer, schedule and (data parallel) gradient buckets.
struct Current {
    stage: usize,
    start: u64,
    opt: AdamW,
    lr: LrState,
    /// Gradient buckets and the parameters they cover (data parallel only).
    sync: Option<(GradSync, Vec<Tensor>)>,
}

fn enter_stage(dir: &RunDir, vs: &VarStore, plan: &Plan, task: &impl StagedTask, stage: usize, start: u64, done: u64, dist: Option<&DataParallel>) -> Result<Current> {
    let opt = optimizer_over(vs, |n| task.trains(stage, n), task.hyper(stage)).ok_or_else(|| Error::Other(format!("stage {stage} has no trainable parameters")))?;
    let sp = &plan.stages[stage - 1];
    let mut lr = LrState::new(&sp.lr, sp.steps);
    if lr.is_plateau() {
        replay_plateau(dir, &mut lr, plan.rows == Rows::Staged, stage, done)?;
    }
    let sync = dist.map(|d| {
        let tensors: Vec<Tensor> = opt.slots.iter().map(|s| s.param.shallow_clone()).collect();
        (GradSync::new(&tensors, d.bucket_bytes, d.grad_kind), tensors)
    });
    Ok(Current { stage, start, opt, lr, sync })
}

/// A plateau schedule at update `done` of a resumed run, rebuilt from the held-out losses that
/// metrics.jsonl logged for the stage up to that update (rows logged again after a crash count once).
fn replay_plateau(dir: &RunDir, lr: &mut LrState, staged: bool, stage: usize, done: u64) -> Result<()> {
    let mut seen = std::collections::BTreeMap::new();
    for (_, row) in super::metrics::read(&dir.path.join("metrics.jsonl"))?.rows {
        let row_stage = row.get("stage").and_then(Value::as_u64);
        let this_stage = if staged { row_stage == Some(stage as u64) } else { row_stage.is_none() };
        if let (Some(at), Some(val), true) = (row.get("step").and_then(Value::as_u64), row.get("val_loss").and_then(Value::as_f64), this_stage) {
            if at <= done {
                seen.insert(at, val);
            }
        }
    }
    for val in seen.values() {
        lr.observe(*val, 0.0);
    }
    Ok(())
}

/// Run the stages from `resume` (a checkpoint: `checkpoint::resume_point`, or the start) to the end
/// or to `plan.stop_after`.
pub fn run(dir: &RunDir, vs: &VarStore, plan: &Plan, task: &mut impl StagedTask, resume: Option<(u64, PathBuf)>, mut dist: Option<DataParallel>) -> Result<Ran> {
    let total = plan.total();
    let rank0 = dist.as_ref().is_none_or(|d| d.comm.rank() == 0);
    let world = dist.as_ref().map_or(1, |d| d.comm.world());
    let mut state = State { step: 0, tokens: 0, elapsed_s: 0.0 };
    let mut current: Option<Current> = None;
    if rank0 {
        // Rows past the resume point (all of them when the run starts over) are written again.
        let aside = super::metrics::set_aside_after(&dir.path.join("metrics.jsonl"), resume.as_ref().map(|r| r.0))?;
        if aside > 0 && !plan.quiet {
            eprintln!("{}: {aside} rows of metrics.jsonl past step {} moved to {}", dir.path.display(), resume.as_ref().map_or(0, |r| r.0), super::metrics::DISCARDED);
        }
    }
    match resume {
        Some((step, path)) => {
            match plan.stage_of(step) {
                // Mid-stage: weights, this stage's moments and its own update count.
                Some((stage, start)) if step > start => {
                    let mut c = enter_stage(dir, vs, plan, task, stage, start, step, dist.as_ref())?;
                    state = checkpoint::load(&path, vs, &mut c.opt)?;
                    c.opt.set_steps_done(state.step - start);
                    current = Some(c);
                }
                // At a stage boundary (or the end): the next stage starts with fresh moments.
                _ => {
                    checkpoint::load_weights(vs, &path.join("model.safetensors"))?;
                    let sp = path.join("state.json");
                    state = serde_json::from_str(&std::fs::read_to_string(&sp).map_err(|e| Error::io(&sp, e))?)?;
                }
            }
            if !plan.quiet {
                eprintln!("resuming {} from step {step}", dir.path.display());
            }
        }
        None if rank0 => {
            if let Some(row) = task.at_boundary(0)? {
                dir.append_metrics(&with_step(row, 0, "start"))?;
            }
        }
        None => {}
    }
    let end = plan.stop_after.map_or(total, |s| s.min(total));
    if state.step < end && current.is_none() {
        let (stage, start) = plan.stage_of(state.step).expect("step < total");
        current = Some(enter_stage(dir, vs, plan, task, stage, start, state.step, dist.as_ref())?);
    }
    if let (Some(d), Some(Current { sync: Some((_, tensors)), .. })) = (dist.as_mut(), current.as_ref()) {
        // Same seed and checkpoint give the same weights everywhere; the broadcast makes sure.
        for t in tensors {
            tch::no_grad(|| d.comm.broadcast(&mut t.shallow_clone(), 0))?;
        }
    }
    task.begin(state.step, end)?;

    let bar = crate::progress::bar(total, plan.label, plan.quiet);
    bar.set_position(state.step);
    let session = Instant::now();
    let elapsed = |state: &State| state.elapsed_s + session.elapsed().as_secs_f64();
    let (mut last_log_t, mut last_log_step, mut last_tps) = (Instant::now(), state.step, 0.0);
    for g in state.step..end {
        let (stage, start) = plan.stage_of(g).expect("g < total");
        if current.as_ref().is_none_or(|c| c.stage != stage) {
            current = Some(enter_stage(dir, vs, plan, task, stage, start, g, dist.as_ref())?);
        }
        let c = current.as_mut().expect("set above");
        let done = g + 1;
        let log = done % plan.log_every.max(1) == 0 || plan.is_stage_end(done) || done == end;
        let lr = c.lr.lr(g - c.start);
        c.opt.zero_grad();
        let (mut loss, extra) = task.step(stage, g - c.start, log)?;
        if let (Some(d), Some((sync, tensors))) = (dist.as_mut(), c.sync.as_ref()) {
            sync.average(d.comm, tensors)?;
            let mut l = loss.reshape([1]);
            d.comm.all_reduce_sum(&mut l)?;
            loss = l.reshape([]) / world as f64;
        }
        let norm = if plan.clip > 0.0 || plan.rows == Rows::Throughput { Some(c.opt.clip(plan.clip)?) } else { None };
        c.opt.step(lr)?;
        if let Some(dog) = dist.as_ref().and_then(|d| d.watchdog) {
            dog.beat();
        }
        state.step = done;
        if !rank0 {
            // Only rank 0 logs, evaluates and checkpoints.
            continue;
        }
        state.tokens += plan.tokens_per_step;
        bar.set_position(done);
        let stage_end = plan.is_stage_end(done);
        let ckpt = stage_end || (plan.checkpoint_every > 0 && done % plan.checkpoint_every == 0);
        if log || ckpt {
            // The only host synchronisation of an update, and only on logging / checkpoint steps.
            let l = loss.double_value(&[]);
            if !l.is_finite() {
                let last = checkpoint::list(&dir.path).pop().map(|(s, _)| format!("step {s}")).unwrap_or_else(|| "none".into());
                let which = if plan.rows == Rows::Staged { format!("stage {stage} ") } else { String::new() };
                return Err(Error::Diverged { step: done, msg: format!("{which}loss is {l}; last good checkpoint: {last} in {}", dir.path.display()) });
            }
            if log {
                let secs = last_log_t.elapsed().as_secs_f64().max(1e-9);
                last_tps = ((done - last_log_step) * plan.tokens_per_step) as f64 / secs;
                (last_log_t, last_log_step) = (Instant::now(), done);
                let mut row = json!({"step": done, "tokens": state.tokens, "loss": l, "lr": lr, "elapsed_s": elapsed(&state)});
                match plan.rows {
                    Rows::Staged => row["stage"] = json!(stage),
                    Rows::Throughput => {
                        row["grad_norm"] = json!(norm.as_ref().map_or(0.0, |n| n.double_value(&[])));
                        row["tokens_per_s"] = json!(last_tps);
                        if world > 1 {
                            row["world_size"] = json!(world);
                        }
                    }
                }
                let row = row.as_object_mut().expect("object");
                row.extend(extra);
                dir.append_metrics(row)?;
                let at = if plan.rows == Rows::Staged { format!("stage {stage} · ") } else { String::new() };
                bar.set_message(format!("{at}loss {l:.4} · {last_tps:.0} tok/s"));
            }
        }
        let every = plan.stages[stage - 1].eval_every;
        if every > 0 && (done - c.start) % every == 0 {
            if let Some(ev) = task.evaluate(stage, &Progress { done, tokens: state.tokens, elapsed_s: elapsed(&state) })? {
                let mut row = ev.row;
                row.entry("step").or_insert(json!(done));
                if plan.rows == Rows::Staged {
                    row.insert("stage".into(), json!(stage));
                }
                if let Some(val) = ev.val_loss {
                    let next = c.lr.observe(val, lr);
                    row.insert("val_loss".into(), json!(val));
                    row.insert("lr".into(), json!(next));
                    bar.set_message(format!("stage {stage} · held-out loss {val:.5} (lr {next:.2e})"));
                }
                dir.append_metrics(&row)?;
            }
        }
        if stage_end {
            if let Some(row) = task.at_boundary(done)? {
                dir.append_metrics(&with_step(row, done, &format!("end of stage {stage}")))?;
            }
        }
        if ckpt {
            checkpoint::save(&dir.path, vs, &c.opt, &State { step: done, tokens: state.tokens, elapsed_s: elapsed(&state) }, plan.keep.max(1))?;
        }
    }
    bar.finish_and_clear();
    Ok(Ran { end, tokens: state.tokens, elapsed_s: elapsed(&state), tokens_per_s: last_tps })
}

fn with_step(mut row: Map<String, Value>, step: u64, at: &str) -> Map<String, Value> {
    row.insert("step".into(), json!(step));
    row.insert("at".into(), json!(at));
    row
}

/// Items of update `step` of a stage: epochs over `items`, each shuffled by (seed, stage, epoch), `b`
/// per update.
pub fn step_items<T>(items: &[T], step: u64, b: usize, seed: u64, stage: u64) -> Vec<&T> {
    let n = items.len();
    (0..b)
        .map(|j| {
            let k = step as usize * b + j;
            let (epoch, i) = (k / n, k % n);
            let mut order: Vec<usize> = (0..n).collect();
            order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ (stage << 32) ^ epoch as u64));
            &items[order[i]]
        })
        .collect()
}

/// A finished run (DONE written): its eval.json, `Null` when missing or unreadable. The one
/// "already done" check of every command: a finished run is never touched again.
pub fn finished(dir: &RunDir) -> Option<Value> {
    dir.is_done().then(|| {
        let p = dir.path.join("eval.json");
        std::fs::read_to_string(&p).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or(Value::Null)
    })
}

/// The run directory of a staged command (`what`: finetune or linearize) through `RunDir::open`,
/// its config read back as the command's spec.
pub fn prepare_dir<S: PartialEq + Clone + Serialize + DeserializeOwned>(path: &Path, spec: &S, normalize: impl Fn(&mut S), what: &str) -> Result<RunDir> {
    let kind = crate::run_kind::RunKind::named(what).ok_or_else(|| Error::Other(format!("prepare_dir: `{what}` is not a command that makes run directories")))?;
    let cfg = path.join("config.yaml");
    RunDir::open(path, kind, spec, |text| serde_yaml::from_str(text).map_err(|e| Error::Other(format!("{}: {e}", cfg.display()))), normalize)
}

#[cfg(test)]
mod tests;
